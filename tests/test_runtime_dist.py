"""The runtime executes plans exactly: one torchrun launch per world size, many plans per launch.

Each plan trains 3 AdamW steps (with clipping and warmup) and its losses must equal a one-process
run on the same global batch (tests/dist/runtime_equivalence.py lists the plans).
"""
from pathlib import Path

import pytest

from tests.torchrun_util import passed_checks, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).parent / "dist" / "runtime_equivalence.py"

EXPECTED = {
    2: {"dp2_ddp", "zero1_dp2", "zero3_dp2_selective", "tp2", "ulysses2", "tp2_megatron_sp",
        "layerwise_tp2_dp2_microbatch2", "gpt2_tied_tp2_sp", "pp2_1f1b", "pp2_zero_bubble_gpt2_tied"},
    4: {"dp4_ddp", "zero1_dp4", "zero2_dp4", "zero3_dp4_full_recompute", "hsdp_4_shard2", "zero3_cpu_offload",
        "dp2_tp2", "ulysses2_dp2_ddp", "ulysses2_zero3_dp2_layerwise", "zero3_tp2_sp_selective", "zero1_tp2",
        "layerwise_dp2tp2_then_dp4", "layerwise_vocab_tp4_blocks_dp4", "gpt2_tied_zero3_tp2_sp",
        "moe_zero2_tp2_sp", "pp2_dp2_zero3_1f1b", "pp2_tp2_sp_gpipe_layerwise", "pp2_interleaved_gpt2_tied_dp2"},
}


@pytest.mark.parametrize("world", [2, 4])
def test_plans_match_one_process(world):
    out = run_torchrun(SCRIPT, world)
    assert passed_checks(out) == EXPECTED[world]
