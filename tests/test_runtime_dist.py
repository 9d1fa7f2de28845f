"""The runtime executes plans exactly: one torchrun launch per world size, many plans per launch.

Each plan starts from the one-process initial weights (bit for bit), its first step's gradients
must equal a one-process run's (every parameter, 1e-5 relative), then 3 AdamW steps (with clipping
and warmup) its losses (tests/dist/runtime_equivalence.py lists the plans); the collectives of a
step are counted against the cost model's contract (tests/dist/comm_counts.py). The 4-rank
launch also trains with `Trainer.train()` and saves checkpoints; the 2-rank launch resumes them
under other plans and must continue the same loss curve.
"""
from pathlib import Path

import pytest

from tests.torchrun_util import passed_checks, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).parent / "dist" / "runtime_equivalence.py"

EXPECTED = {
    2: {"dp2_ddp", "zero1_dp2", "zero3_dp2_selective", "tp2", "ulysses2", "tp2_megatron_sp",
        "layerwise_tp2_dp2_microbatch2", "gpt2_tied_tp2_sp", "pp2_1f1b", "pp2_zero_bubble_gpt2_tied",
        "gpt2_tied_zero3_embedding_tp2_sp_head", "tp2_zero1_offload", "odd_sequence_ulysses2_then_tp2_sp",
        "collectives_per_step_follow_the_zero_contract_2_ranks", "tp_block_collectives_per_micro_batch_2_ranks",
        "resume_at_2_ranks_tp2_sp", "resume_at_2_ranks_zero3_latest"},
    4: {"dp4_ddp", "zero1_dp4", "zero2_dp4", "zero3_dp4_full_recompute", "hsdp_4_shard2", "zero3_cpu_offload",
        "dp2_tp2", "ulysses2_dp2_ddp", "ulysses2_zero3_dp2_layerwise", "zero3_tp2_sp_selective", "zero1_tp2",
        "layerwise_dp2tp2_then_dp4", "layerwise_vocab_tp4_blocks_dp4", "gpt2_tied_zero3_tp2_sp",
        "gpt2_tied_zero3_embedding_dp2_tp2_head",
        "moe_zero2_tp2_sp", "pp2_dp2_zero3_1f1b", "pp2_tp2_sp_gpipe_layerwise", "pp2_interleaved_gpt2_tied_dp2",
        "pp2_dp2_zero_bubble_zero0123", "pp2_dp2_interleaved_4_chunks_zero0123",
        "pp2_gpt2_tied_tp2_embedding_dp2_head", "offload_zero1_zero2_zero3",
        "hsdp_collectives_follow_the_zero_contract_4_ranks", "pipeline_collectives_follow_each_layers_zero_stage_4_ranks",
        "train_and_checkpoint_layerwise_4"},
}


def test_plans_match_one_process_and_resume_across_plans(tmp_path):
    ckpt = tmp_path / "ckpt"
    out4 = run_torchrun(SCRIPT, 4, str(ckpt))
    assert passed_checks(out4) == EXPECTED[4]
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4"]
    out2 = run_torchrun(SCRIPT, 2, str(ckpt))
    assert passed_checks(out2) == EXPECTED[2]
