"""Splitting a model into pipeline chunks, in one process: ownership, names, composition."""
import pytest
import torch

from tessera.errors import TesseraError
from tessera.models import build_model
from tessera.runtime.pipeline import chunks_of_rank, split_model
from tests.dist.pipeline_checkpoint_common import TINY_GPT2, TINY_LLAMA, make_plan


def _names(modules):
    return [set(dict(m.named_parameters())) for m in modules]


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_GPT2])
def test_interleaved_chunks_compose_to_the_full_model(config):
    model = build_model(config, seed=0)
    plan = make_plan(config, world=2, pp=2, schedule="interleaved_1f1b", virtual_stages=2)
    assert [chunks_of_rank(plan, r) for r in (0, 1)] == [[0, 2], [1, 3]]
    rank0, rank1 = split_model(model, plan, 0), split_model(model, plan, 1)
    chunks = [rank0[0], rank1[0], rank0[1], rank1[1]]
    tokens = torch.randint(0, config.vocab_size, (2, 8))
    h = tokens
    for chunk in chunks:
        h = chunk(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)
    # Names stay those of the full model; every parameter is owned by exactly one chunk,
    # except a tied embedding, whose head copy lives in the last chunk under `output.weight`.
    full = set(n for n, _ in model.named_parameters(remove_duplicate=False))
    owned = _names(chunks)
    assert set().union(*owned) == full
    assert sum(len(s) for s in owned) == len(full)
    if config.tie_embeddings:
        head = dict(chunks[-1].named_parameters())["output.weight"]
        assert head is not model.tok_embeddings.weight
        torch.testing.assert_close(head, model.tok_embeddings.weight)


def test_chunk_ownership_follows_plan_layer_ranges():
    model = build_model(TINY_LLAMA, seed=0)
    plan = make_plan(TINY_LLAMA, world=2, pp=2)  # stages (0, 3), (3, 6)
    (first,), (last,) = split_model(model, plan, 0), split_model(model, plan, 1)
    assert first.tok_embeddings is model.tok_embeddings and first.norm is None and first.output is None
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert last.tok_embeddings is None and last.output is model.output
    assert first.layers["0"] is model.layers["0"]  # shared, not copied


def test_plan_for_another_model_is_refused():
    plan = make_plan(TINY_LLAMA, world=2, pp=2)
    other = build_model(TINY_LLAMA.model_copy(update={"num_layers": 6}), seed=0)
    with pytest.raises(TesseraError, match="6 blocks"):
        split_model(other, plan, 0)
    with pytest.raises(TesseraError, match="pipeline rank 2"):
        split_model(build_model(TINY_LLAMA), plan, 2)
