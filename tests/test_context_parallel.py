"""Context parallelism (ring attention) at 4 gloo ranks equals one process: attention alone, and
whole plans with packed documents and grouped-query attention composed with DP/ZeRO-3, TP with
Megatron SP, Ulysses, a pipeline and layer-wise layouts (tests/dist/context_parallel.py)."""
import pytest

from tests.torchrun_util import ROOT, passed_checks, run_torchrun

EXPECTED = {
    *(f"{case}_{what}" for case in ("ring_cp4_gqa", "ring_cp4_gqa_documents", "ring_cp2_gqa_documents",
                                    "ring_cp2_ulysses2_documents")
      for what in ("output", "grad_q", "grad_k", "grad_v")),
    "cp4", "cp2_dp2_ddp", "cp2_dp2_zero3_microbatch2", "cp2_tp2_megatron_sp", "cp2_ulysses2_selective",
    "cp2_pp2_1f1b", "layerwise_dp4_cp2_cp4_tp2",
}


@pytest.mark.dist
def test_context_parallel_matches_one_process():
    out = run_torchrun(ROOT / "tests" / "dist" / "context_parallel.py", 4, timeout=600)
    assert passed_checks(out) == EXPECTED
