"""Pipeline schedules and resharding checkpoints under real torchrun on gloo (two launches).

The 4-rank launch checks pp=2 x dp=2 (FSDP2) against a single process and saves checkpoints; the
2-rank launch checks every schedule at pp=2 and resumes those checkpoints under other plans."""
from pathlib import Path

import pytest

from tests.torchrun_util import passed_checks, run_torchrun

DIST = Path(__file__).parent / "dist"

FOUR_RANK_CHECKS = {
    "pp2xdp2_fsdp_1f1b_matches_single_process",
    "pp2xdp2_fsdp_interleaved_1f1b_matches_single_process",
    "pp2xdp2_fsdp_zero_bubble_matches_single_process",
    "pp2xdp2_nested_fsdp_zero_bubble_matches_single_process",
    "pp2xdp2_fsdp_tied_gpt2_matches_single_process",
    "trainer_pp2_tp2_sp_packed_documents_match_single_process",
    "pp2xdp2_checkpoint_saved",
    "pp2xdp2_tied_checkpoint_saved",
}
TWO_RANK_CHECKS = {
    "pp2_gpipe_matches_single_process",
    "pp2_1f1b_matches_single_process",
    "pp2_interleaved_1f1b_matches_single_process",
    "pp2_zero_bubble_matches_single_process",
    "pp2_1f1b_packed_documents_match_single_process",
    "pp2_interleaved_1f1b_packed_documents_match_single_process",
    "pp2_zero_bubble_packed_documents_match_single_process",
    "pp2_tied_gpt2_matches_single_process",
    "trainer_pp2_interleaved_packed_documents_match_single_process",
    "resume_test-llama_pp2xdp2_at_4_ranks_as_dp2_fsdp_at_2_ranks",
    "resume_test-llama_pp2xdp2_at_4_ranks_as_pp2_at_2_ranks",
    "resume_test-llama_pp2xdp2_at_4_ranks_as_tp2_at_2_ranks",
    "resume_test-llama_pp2xdp2_at_4_ranks_as_pp2_interleaved_one_optimizer_at_2_ranks",
    "resume_test-llama_pp2xdp2_at_4_ranks_as_dp2_ddp_zero1_at_2_ranks",
    "zero1_checkpoint_resumes_as_one_process",
    "resume_test-gpt2_pp2xdp2_at_4_ranks_as_dp2_fsdp_at_2_ranks",
    "resume_test-gpt2_pp2xdp2_at_4_ranks_as_pp2_interleaved_one_optimizer_at_2_ranks",
    "resume_test-gpt2_pp2xdp2_at_4_ranks_as_pp2_at_2_ranks",
    "async_save_keeps_the_weights_of_its_step",
    "corrupt_checkpoint_refused_alike_on_every_rank",
    "corrupt_checkpoint_leaves_model_untouched",
}


@pytest.fixture(scope="module")
def saved_at_four_ranks(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("pipeline") / "ckpt"
    return ckpt, run_torchrun(DIST / "pipeline_dp_checkpoint_save.py", 4, str(ckpt))


@pytest.mark.dist
def test_pp_x_fsdp_at_4_ranks_matches_single_process_and_saves(saved_at_four_ranks):
    _, out = saved_at_four_ranks
    assert FOUR_RANK_CHECKS <= passed_checks(out), out[-3000:]


@pytest.mark.dist
def test_schedules_at_2_ranks_and_resume_under_other_plans(saved_at_four_ranks):
    ckpt, _ = saved_at_four_ranks
    out = run_torchrun(DIST / "pipeline_schedules.py", 2, str(ckpt))
    assert TWO_RANK_CHECKS <= passed_checks(out), out[-3000:]
