"""Document attention without dense masks (tessera.models.attention) equals the dense-mask reference."""
from __future__ import annotations

import re
import subprocess
import sys
import warnings

import pytest
import torch

from tessera.models import attention
from tessera.models.attention import DocumentBuckets, Documents, attend, document_block_mask
from tessera.models.transformer import build_model
from tessera.spec.model import TransformerConfig
from tests.torchrun_util import ROOT


def doc_ids_of(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in rows])


# One document, several, many (short ones, repeated lengths, length 1) per row.
ROWS = [[96], [30, 40, 26], [1] * 21 + [3] * 10 + [5, 7, 9, 11, 13]]


def run(q, k, v, grad_out, docs):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attend(*inputs, docs)
    (out * grad_out).sum().backward()
    return [out] + [t.grad for t in inputs]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_bucketed_attention_equals_dense_mask(dtype, tol, kv_heads):
    ids = doc_ids_of(ROWS)
    gen = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(3, 4, 96, 8, generator=gen, dtype=dtype)
    k, v = (torch.randn(3, kv_heads, 96, 8, generator=gen, dtype=dtype) for _ in range(2))
    grad_out = torch.randn(q.shape, generator=gen, dtype=dtype)
    want = run(q, k, v, grad_out, Documents(ids, backend="dense"))
    got = run(q, k, v, grad_out, Documents(ids))
    assert Documents(ids).backend == "buckets"
    for name, g, w in zip(("output", "grad_q", "grad_k", "grad_v"), got, want):
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def test_one_document_per_row_is_plain_causal():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=gen) for _ in range(3))
    plain = attend(q, k, v)
    assert torch.equal(attend(q, k, v, torch.zeros(2, 40, dtype=torch.long)), plain)
    torch.testing.assert_close(attend(q, k, v, Documents(torch.zeros(2, 40, dtype=torch.long), "dense")), plain)


def test_buckets_pad_less_than_a_quarter_and_cover_every_token():
    lengths = range(1, 5000)
    padded = [DocumentBuckets.padded_length(n) for n in lengths]
    assert all(n <= p < 1.25 * n + 1 for n, p in zip(lengths, padded))
    assert len({p for p in padded if 1024 <= p < 2048}) == 4  # four lengths per octave
    ids = doc_ids_of(ROWS)
    buckets = DocumentBuckets.build(ids)
    assert buckets.num_docs == 1 + 3 + 36
    assert sorted(torch.cat([i.flatten() for i in buckets.index]).unique().tolist()) == list(range(ids.numel()))
    assert sorted(buckets.inverse.tolist()) == sorted(set(buckets.inverse.tolist()))  # a token has one slot


@pytest.mark.parametrize("rows", [
    [[300, 100, 100]],                       # not a multiple of the 128-token tile
    [[512], [1, 2, 3, 506]],                 # one document; tiny ones at a row start
    [[128, 128, 256], [129, 127, 1, 255]],   # boundaries on and off the tile edges
    [[40] * 12 + [32]],                      # many short documents
])
def test_block_mask_equals_create_block_mask(rows):
    from torch.nn.attention.flex_attention import create_block_mask

    ids = doc_ids_of(rows)
    s = ids.shape[1]

    def document_causal(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    want = create_block_mask(document_causal, ids.shape[0], None, s, s, device="cpu")
    got = document_block_mask(ids)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_forward_equals_dense_mask_on_cpu(kv_heads):
    """The CUDA path's block mask and call, run eagerly on CPU (flex has no CPU backward)."""
    ids = doc_ids_of([[300, 100, 100], [129, 127, 1, 243]])
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 500, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 500, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        got = attend(q, k, v, Documents(ids, backend="flex"))
    torch.testing.assert_close(got, attend(q, k, v, Documents(ids, backend="dense")), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_model_with_doc_ids_equals_dense_reference(family, monkeypatch):
    """Logits and every parameter's gradient; the buckets are built once per forward, not per layer."""
    extra = dict(family="gpt2", norm="layernorm", mlp="gelu", position="learned", num_kv_heads=4) \
        if family == "gpt2" else dict(num_kv_heads=2)
    config = TransformerConfig(name=f"t-{family}", vocab_size=101, hidden=32, num_layers=3, num_heads=4,
                               ffn_hidden=48, max_seq_len=96, **extra)
    ids = doc_ids_of(ROWS)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    idx = torch.arange(96).expand(3, -1)
    positions = idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values
    tokens = torch.randint(0, 101, (3, 96), generator=torch.Generator().manual_seed(2))

    def run_model(docs):
        model = build_model(config, seed=4)
        logits = model(tokens, positions, docs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
        return logits, {n: p.grad for n, p in model.named_parameters()}

    builds = []
    real_build = DocumentBuckets.build.__func__
    monkeypatch.setattr(DocumentBuckets, "build", classmethod(lambda cls, d: builds.append(1) or real_build(cls, d)))
    logits, grads = run_model(ids)
    assert len(builds) == 1  # one Documents per forward, shared by the 3 blocks
    ref_logits, ref_grads = run_model(Documents(ids, backend="dense"))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


def test_bad_doc_ids_are_refused_in_one_sentence():
    q = torch.randn(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"doc_ids must not decrease along a row"):
        attend(q, q, q, torch.tensor([[0, 0, 1, 1, 0, 0]]))
    with pytest.raises(ValueError, match=r"doc_ids must be a \(batch, seq\) integer tensor, got \(1, 1, 6\)"):
        attend(q, q, q, torch.zeros(1, 1, 6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"doc_ids \(1, 5\) do not match the attention's \(batch, seq\) \(1, 6\)"):
        attend(q, q, q, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"unknown document attention backend 'fast'"):
        Documents(torch.zeros(1, 6, dtype=torch.long), backend="fast")


def test_compiled_flex_is_made_once(monkeypatch):
    made = []
    monkeypatch.setattr(attention, "_compiled_flex", None)
    monkeypatch.setattr(torch, "compile", lambda fn: made.append(fn) or fn)
    first = attention.compiled_flex_attention()
    assert attention.compiled_flex_attention() is first and len(made) == 1


def test_32k_token_window_trains_in_linear_memory():
    """One Trainer step at 32,768 tokens (5 documents): the step's peak-memory growth stays below
    the dense mask alone (1 GiB; SDPA's dense scores would add 16 GiB). Fresh process, so that
    the peak is the step's."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "doc_attention.py"), "--window-only"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = dict(re.findall(r"(\w+)=([\d.]+)", out.stdout.strip().splitlines()[-1]))
    assert int(summary["window_tokens"]) == 32768
    assert float(summary["window_peak_growth_mib"]) < 1024, out.stdout
    assert "loss 6.2" in out.stdout  # ln(512) = 6.24: a finite first-step loss of random tokens
