"""Adaptive per-step SP groups (tessera.runtime.varlen) at 4 gloo ranks equal a single process:
gradients after the first step and losses of three steps, on ZeRO-3, HSDP, TP + ZeRO and DDP
layouts, with strategy switching (working modes 3 -> 2 -> 1, recompute per group); a static
plan's balanced data loader against one process."""
import pytest

from tests.torchrun_util import ROOT, passed_checks, run_torchrun

LAYOUTS = ("zero3_dp4", "hsdp_shard2", "tp2_zero3", "tp2_plan_megatron_sp_zero2", "replicated_ddp")
PER_LAYOUT = ("mixed_step_grads", "plan_same_on_all_ranks", "plan_uses_sequence_parallel", "planned_step_grads",
              "losses")
EXPECTED = ({"pack_group_doc_ids", "balanced_loader_moves_rows", "balanced_loader_grads"}
            | {f"{layout}_{check}" for layout in LAYOUTS for check in PER_LAYOUT})


@pytest.mark.dist
def test_adaptive_steps_match_single_process(tmp_path):
    out = run_torchrun(ROOT / "tests" / "dist" / "adaptive_varlen.py", 4, str(tmp_path), timeout=600)
    assert passed_checks(out) == EXPECTED
