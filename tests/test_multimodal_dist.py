"""Vision-language training with separate encoder and LLM plans, with an LLM pipeline whose bubbles
hold the encoder's passes (Optimus), at 4 ranks against one process and multi-task Spindle waves on groups of ranks against one process running the tasks one after
another (one torchrun launch: tests/dist/multimodal_equivalence.py)."""
import pytest

from torchrun_util import ROOT, passed_checks, run_torchrun

EXPECTED = {
    "vlm_llm_dp4_ddp_encoder_dp4",
    "vlm_llm_dp2_tp2_encoder_ranks01",
    "vlm_llm_vocab_tp4_blocks_dp2_tp2_sp_mb2_encoder_zero3_ranks23_recompute",
    "vlm_llm_layerwise_mb2_encoder_zero2_dp4",
    "vlm_qwen2vl_llm_ulysses2_dp2_encoder_rank1",
    "vlm_train_3_steps_llm_dp2_tp2_zero3_encoder_ranks01",
    "vlm_planned_task_colocated",
    "vlm_optimus_pp2_dp2_mb4_planned_bubbles",
    "vlm_optimus_pp4_mb4_recompute_given_bubbles",
    "vlm_optimus_pp2_tp2_gpipe_mb2_stage0_encodes_nothing",
    "vlm_optimus_planned_pipeline_and_bubbles",
    "vlm_optimus_train_3_steps_pp2_dp2_zero1",
    "vlm_optimus_pp2_dp2_mb4_encoder_zero3_hsdp_empty_shares",
    "vlm_optimus_pp2_dp2_mb4_encoder_zero2_recompute_per_rank",
    "vlm_optimus_train_3_steps_pp2_dp2_encoder_zero1_hsdp",
    "spindle_3_tasks_2_waves_cross_group_handoff",
}


@pytest.mark.dist
def test_vlm_and_spindle_gradients_and_training_match_one_process_at_4_ranks():
    out = run_torchrun(ROOT / "tests" / "dist" / "multimodal_equivalence.py", 4)
    assert passed_checks(out) >= EXPECTED, out[-3000:]
