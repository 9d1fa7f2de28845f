"""Expert parallelism equals one process (tests/dist/moe_equivalence.py lists the plans and checks):
one torchrun launch at 4 ranks, many checks."""
from pathlib import Path

import pytest

from tests.torchrun_util import passed_checks, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).parent / "dist" / "moe_equivalence.py"

EXPECTED = {"aux_loss_visible", "ep2_dp2_zero2_mixtral", "ep4_zero1_qwen", "ep2_tp2_sp_qwen", "ep2_pp2_1f1b_mixtral",
            "ep2_pp2_gpipe_tp2_qwen", "ep2_pp2_zero_bubble_mixtral", "ep2_dp2_capacity_microbatch2_full_recompute",
            "ep2_ulysses2_capacity_selective", "ep2_dp2_netmoe_placement", "train_reports_routing",
            "ep_collectives_as_priced", "checkpoint_ep4_resume_ep2"}


def test_expert_parallel_plans_match_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    out = run_torchrun(SCRIPT, 4)
    assert passed_checks(out) == EXPECTED
