"""A single-device decoder-only Transformer covering GPT-2, LLaMA, Qwen2, Mistral and Mixtral.

Plain modules only: parallelism is applied from outside by `tessera.runtime` according to a Plan.
Module names follow torchtitan's LLaMA so that TP plans and pipeline splits can name them:
`tok_embeddings`, `pos_embeddings` (GPT-2), `layers.<i>` (a ModuleDict, so a pipeline stage can
drop the blocks it does not own), `norm`, `output`. In a block: `attention_norm`,
`attention.{wq,wk,wv,wo}`, `ffn_norm`, `feed_forward.{w1,w2,w3}` or `moe` (`tessera.models.moe`).

Attention reshapes with `view(B, S, -1, head_dim)` so the local head count follows a TP degree,
and calls `self.attention.core` (replaceable: Ulysses wraps it with all-to-alls). Packed documents
arrive as document ids, never as a dense mask (`tessera.models.attention`).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..spec.model import TransformerConfig
from .attention import Documents, attend
from .init import init_piece
from .moe import MoE


def build_norm(config: TransformerConfig) -> nn.Module:
    if config.norm == "layernorm":
        return nn.LayerNorm(config.hidden, eps=config.norm_eps, bias=True)
    return nn.RMSNorm(config.hidden, eps=config.norm_eps)


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """Complex rotations e^{i * pos * theta^(-2k/d)}, shape (max_seq_len, head_dim // 2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2k], x[2k+1])... in the HF 'rotate_half' layout: first half with second half.

    x: (B, S, H, D); freqs: (S, D/2) complex, or (B, S, D/2) for per-token positions.
    """
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    cos, sin = freqs.real, freqs.imag
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.type_as(x)


class CoreAttention(nn.Module):
    """softmax(QK^T/sqrt(d)) V on (B, H, S, D) tensors; causal, or document-causal for packed
    documents (`docs`: a `Documents`, or doc ids (B, S); see `tessera.models.attention.attend`)."""

    def forward(self, q, k, v, docs: Documents | torch.Tensor | None = None) -> torch.Tensor:
        return attend(q, k, v, docs)


class Attention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.head_dim = config.head_dim
        q_dim = config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        qkv_bias = config.qkv_bias or config.linear_bias
        self.wq = nn.Linear(config.hidden, q_dim, bias=qkv_bias)
        self.wk = nn.Linear(config.hidden, kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(config.hidden, kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(q_dim, config.hidden, bias=config.linear_bias)
        self.core = CoreAttention()

    def forward(self, x, freqs=None, docs=None):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if freqs is not None:
            q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), docs)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, config: TransformerConfig, hidden: int | None = None):
        super().__init__()
        f = hidden or config.ffn_hidden
        self.swiglu = config.mlp == "swiglu"
        self.w1 = nn.Linear(config.hidden, f, bias=config.linear_bias)
        self.w2 = nn.Linear(f, config.hidden, bias=config.linear_bias)
        if self.swiglu:
            self.w3 = nn.Linear(config.hidden, f, bias=config.linear_bias)

    def forward(self, x):
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: TransformerConfig, index: int):
        super().__init__()
        self.attention_norm = build_norm(config)
        self.attention = Attention(config)
        self.ffn_norm = build_norm(config)
        if config.is_moe_layer(index):
            self.moe = MoE(config, FeedForward)
        else:
            self.feed_forward = FeedForward(config)

    def forward(self, x, freqs=None, docs=None):
        x = x + self.attention(self.attention_norm(x), freqs, docs)
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return x + mlp(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        if config.position == "learned":
            self.pos_embeddings = nn.Embedding(config.max_seq_len, config.hidden)
        else:
            self.register_buffer(
                "freqs", rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta),
                persistent=False)
        self.layers = nn.ModuleDict({str(i): Block(config, i) for i in range(config.num_layers)})
        self.norm = build_norm(config)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """GPT-2 style init (`tessera.models.init`): normal(0, std), residual projections scaled by
        1/sqrt(2 * layers); each value depends on (seed, name) only, so a rank can draw its shard."""
        for name, p in self.named_parameters():
            p.copy_(init_piece(name, p.shape, seed, self.config.num_layers, std))
        if self.config.position != "learned":
            self.freqs = rope_frequencies(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """tokens (B, S) -> logits (B, S, vocab). Packed documents: `positions` (B, S) restart at
        each document; `doc_ids` (B, S) number the documents of each row (0, 0, 1, 1, 1, 2, ...), and
        attention stays inside each document. A `Documents` may be passed instead (e.g. with
        backend="dense" for a reference run); None is plain causal attention."""
        docs = Documents.of(doc_ids)
        if docs is not None:
            docs.prepare()  # once per forward, shared by every layer
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs = None
        if self.config.position == "learned":
            if getattr(self, "pos_embeddings", None) is not None:
                pos = positions if positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
                h = h + self.pos_embeddings(pos)
        else:
            freqs = self.freqs[positions] if positions is not None else self.freqs[: h.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs, docs)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(config: TransformerConfig, seed: int = 0, device: str | torch.device = "cpu") -> Transformer:
    with torch.device(device):
        model = Transformer(config)
    if str(device) != "meta":
        model.init_weights(seed)
    return model
