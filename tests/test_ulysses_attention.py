"""Ulysses attention (tessera.runtime.attention) on 2 gloo ranks equals single-process SDPA."""
import pytest

from tests.torchrun_util import ROOT, passed_checks, run_torchrun

EXPECTED = {
    "kv_repeats", "model_logits", "model_grads", "model_packed_logits", "model_packed_grads",
    "sliced_doc_ids_refused", "flex_packed_docs_output", "trainer_ulysses_packed", "trainer_ulysses_dp_mix_packed",
    *(f"{case}_{what}" for case in ("mha_causal", "gqa_causal", "gqa_repeat_kv", "packed_docs",
                                    "many_docs_repeat_kv", "group_of_one", "swapped_to_pair")
      for what in ("output", "grad_q", "grad_k", "grad_v")),
}


@pytest.mark.dist
def test_ulysses_attention_matches_single_process():
    out = run_torchrun(ROOT / "tests" / "dist" / "ulysses_attention.py", 2, timeout=300)
    assert passed_checks(out) == EXPECTED
