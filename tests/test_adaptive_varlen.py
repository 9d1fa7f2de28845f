"""Adaptive per-step SP groups (tessera.runtime.varlen) at 4 gloo ranks equal a single process."""
import pytest

from tests.torchrun_util import ROOT, passed_checks, run_torchrun

EXPECTED = {"mixed_step_loss", "mixed_step_grads", "idle_ranks_loss", "idle_ranks_grads",
            "plan_same_on_all_ranks", "plan_uses_sequence_parallel", "planned_step_loss",
            "planned_step_grads", "misaligned_group_refused", "pack_group_doc_ids"}


@pytest.mark.dist
def test_adaptive_steps_match_single_process():
    out = run_torchrun(ROOT / "tests" / "dist" / "adaptive_varlen.py", 4, timeout=300)
    assert passed_checks(out) == EXPECTED
