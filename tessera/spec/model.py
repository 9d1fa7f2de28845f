"""What is trained: a Transformer's architecture and its per-layer cost coefficients.

`TransformerConfig` holds the hyper-parameters that the runtime needs to build the torch
module (`tessera.models`) and that a Hugging Face `config.json` provides. `ModelSpec` is the
planner's view: an ordered tuple of `LayerSpec`, each with its parameter count, forward FLOPs per
token (the attention-score term, quadratic in sequence length, kept apart) and activation bytes
per token split by how tensor/sequence parallelism divides them.

Plain data: no torch import. Units: FLOPs, bytes, tokens.
"""
from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Frozen(BaseModel):
    """Immutable, typo-proof base: an unknown key is an error that names it."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class LayerKind(StrEnum):
    EMBEDDING = "embedding"
    DECODER = "decoder"  # attention + dense MLP block
    MOE_DECODER = "moe_decoder"  # attention + mixture-of-experts MLP block
    ENCODER = "encoder"  # bidirectional attention + MLP block (ViT / multimodal encoders)
    LM_HEAD = "lm_head"  # final norm + vocabulary projection + loss


class TransformerConfig(Frozen):
    """Hyper-parameters of a decoder-only Transformer (GPT-2 / LLaMA / Qwen / Mistral / Mixtral)."""

    name: str
    family: Literal["gpt2", "llama", "qwen2", "mistral", "mixtral", "qwen2_moe"] = "llama"
    vocab_size: int = Field(gt=0)
    hidden: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    ffn_hidden: int = Field(gt=0)
    max_seq_len: int = Field(default=4096, gt=0)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = 1e-5
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    # GPT-2 style: biases on every linear layer and on the norms.
    linear_bias: bool = False
    tie_embeddings: bool = False
    # Mixture of experts (0 experts = dense); `tessera.models.moe` states the formulas.
    num_experts: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    # None: dropless routing; c > 0: each expert takes at most ceil(c * seq_len * top_k / experts)
    # token-slots of each sequence, the rest are dropped.
    capacity_factor: float | None = None
    # Layers i with i % moe_every == moe_every - 1 are MoE layers (1 = every layer).
    moe_every: int = Field(default=1, ge=1)
    # "topk_softmax" (Mixtral): softmax over the top-k logits; "softmax_topk" (Qwen-MoE): softmax
    # over all experts, then the top-k probabilities (divided by their sum when norm_topk_prob).
    router: Literal["topk_softmax", "softmax_topk"] = "topk_softmax"
    norm_topk_prob: bool = False
    # Coefficients of the load-balancing loss and of the router z-loss added to the training loss.
    router_aux_loss_coef: float = Field(default=0.0, ge=0)
    router_z_loss_coef: float = Field(default=0.0, ge=0)
    # Qwen-MoE: an always-on expert of this hidden size, gated by sigmoid(w . x) (0 = none).
    shared_expert_ffn: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> "TransformerConfig":
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0 (or null for dropless routing)")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and index % self.moe_every == self.moe_every - 1


class TPDegreeCost(Frozen):
    """`LayerSpec.tp_overhead_s` and `tp_slowdown` as measured at one wider tensor-parallel degree."""

    degree: int = Field(ge=3)
    overhead_s: float = Field(ge=0)
    slowdown: float = Field(ge=0)


class LayerSpec(Frozen):
    """One layer as the cost model sees it.

    FLOPs are forward FLOPs per token (multiply-add = 2); backward is twice forward.
    `attn_flops_coeff` gives the attention-score part: per token it costs
    `attn_flops_coeff * seq_len` forward FLOPs, so a sequence costs `coeff * s**2` (causal
    masking already halves it, as flash attention skips the masked blocks).

    Activation bytes per token (16-bit activations) are stored under three rules, following
    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models":
      - `act_bytes_tp`: inside tensor-parallel regions, divided by the TP degree;
      - `act_bytes_replicated`: norms and block inputs, replicated under TP unless
        Megatron-style sequence parallelism shards them too;
      - `act_bytes_selective`: the part of the above that selective recompute drops (attention
        core and activation-function outputs), recomputed in backward for `selective_flops`.
    Full recompute keeps only the block input (`act_bytes_input`) and replays the forward.
    """

    name: str
    kind: LayerKind
    hidden: int
    params: int
    flops_per_token: float
    attn_flops_coeff: float = 0.0
    act_bytes_tp: float = 0.0
    act_bytes_replicated: float = 0.0
    act_bytes_selective: float = 0.0
    act_bytes_input: float = 0.0
    selective_flops_per_token: float = 0.0
    selective_attn_fraction: float = 0.0
    num_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    # MoE: parameters of the experts (the part expert parallelism divides) and routing.
    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    capacity_factor: float = 0.0  # 0: dropless
    # Routing skew: the most loaded expert-parallel rank's tokens over the mean (>= 1; 1 = balanced).
    # Given, or measured from a routing trace (`tessera.cost.moe.routing_skew`).
    routing_skew: float = Field(default=1.0, ge=1.0)
    # Inter-node all-to-all bytes relative to uniform routing (< 1 with NetMoE sample placement).
    a2a_internode_scale: float = Field(default=1.0, ge=0.0)
    # Measured/predicted compute time of the linear and attention-score terms on the target
    # device (1.0 = the FLOPs model as is); fitted by `tessera profile model`.
    linear_time_scale: float = Field(default=1.0, gt=0)
    attn_time_scale: float = Field(default=1.0, gt=0)
    # Measured fixed costs (0.0 = none), fitted by `tessera profile model`; the cost model adds
    # them per micro-batch, 1/3 to the forward and 2/3 to the backward (cost/layer.py):
    # `call_overhead_s`: seconds per forward + backward call of the layer, whatever its tokens
    # (kernel launches, Python dispatch; the intercept of the time fit).
    # `tp_overhead_s`: extra seconds per forward + backward when the layer runs tensor parallel
    # (tp > 1), beyond half the compute and the TP collectives (DTensor's per-operation dispatch).
    # `sp_overhead_s`: the same for Ulysses (sp > 1), beyond half the compute and the all-to-alls
    # (the head/sequence permutes around them).
    # `zero3_overhead_s`: extra seconds per forward + backward when ZeRO-3 shards the layer, beyond
    # its compute and its all-gathers and reduce-scatter (FSDP2's copy-in/out and hooks).
    # `tp_slowdown`, `sp_slowdown`: the fraction by which a rank's share of the compute runs slower
    # than its share under tensor parallel / Ulysses (smaller matmuls; waits at each collective on
    # the slower rank, which grow with the work between them); multiplies the compute time.
    call_overhead_s: float = Field(default=0.0, ge=0)
    tp_overhead_s: float = Field(default=0.0, ge=0)
    sp_overhead_s: float = Field(default=0.0, ge=0)
    zero3_overhead_s: float = Field(default=0.0, ge=0)
    tp_slowdown: float = Field(default=0.0, ge=0)
    sp_slowdown: float = Field(default=0.0, ge=0)
    # The two TP terms measured at degrees above 2, ascending: tp = d uses the entry of the largest
    # degree <= d, and tp_overhead_s / tp_slowdown (measured at 2) below the first. Measured apart
    # because they do not follow from tp=2's: a rank's share of the compute shrinks with the
    # degree, its waits on the slowest of more ranks do not (on 4 CPU ranks, a tp=4 block took
    # 15-45 ms more per fwd+bwd than tp=2's terms predict).
    tp_wider: tuple[TPDegreeCost, ...] = ()

    @model_validator(mode="after")
    def _tp_wider_ascending(self) -> "LayerSpec":
        degrees = [c.degree for c in self.tp_wider]
        if degrees != sorted(set(degrees)):
            raise ValueError(f"tp_wider degrees must ascend without repeats, got {degrees}")
        return self

    def tp_costs(self, degree: int) -> tuple[float, float]:
        """(overhead seconds, slowdown) of this layer at tensor-parallel `degree` (0s at 1)."""
        if degree <= 1:
            return 0.0, 0.0
        wider = [c for c in self.tp_wider if c.degree <= degree]
        return (wider[-1].overhead_s, wider[-1].slowdown) if wider else (self.tp_overhead_s, self.tp_slowdown)

    @property
    def dense_params(self) -> int:
        """Parameters that are not experts (replicated across expert-parallel ranks)."""
        return self.params - self.expert_params

    def forward_flops(self, seq_len: int, tokens: int) -> float:
        """Forward FLOPs for `tokens` tokens arranged in sequences of length `seq_len`."""
        return tokens * (self.flops_per_token + self.attn_flops_coeff * seq_len)


class ModelSpec(Frozen):
    """An ordered list of layers, plus the config the runtime builds the module from."""

    name: str
    layers: tuple[LayerSpec, ...]
    config: TransformerConfig | None = None

    @property
    def num_params(self) -> int:
        # A tied LM head counts no parameters of its own (see `head_layer`).
        return sum(layer.params for layer in self.layers)

    @property
    def num_blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD))

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at this sequence length (training step = 3x this)."""
        return sum(layer.flops_per_token + layer.attn_flops_coeff * seq_len for layer in self.layers)

    @classmethod
    def from_config(cls, config: TransformerConfig) -> "ModelSpec":
        layers = [embedding_layer(config)]
        layers += [block_layer(config, i) for i in range(config.num_layers)]
        layers.append(head_layer(config))
        return cls(name=config.name, layers=tuple(layers), config=config)


def _norm_params(c: TransformerConfig) -> int:
    return 2 * c.hidden if c.norm == "layernorm" else c.hidden


def embedding_layer(c: TransformerConfig) -> LayerSpec:
    params = c.vocab_size * c.hidden
    if c.position == "learned":
        params += c.max_seq_len * c.hidden
    # Output of the lookup (the next block's input) is held by the block, so nothing here.
    return LayerSpec(name="embedding", kind=LayerKind.EMBEDDING, hidden=c.hidden, params=params,
                     flops_per_token=0.0, vocab_size=c.vocab_size)


def head_layer(c: TransformerConfig) -> LayerSpec:
    h, v = c.hidden, c.vocab_size
    params = _norm_params(c) + (0 if c.tie_embeddings else v * h)
    # Keeps: norm input (2h) and output (2h) replicated; logits in fp32 for the loss (4v),
    # sharded by a vocabulary-parallel head.
    return LayerSpec(name="lm_head", kind=LayerKind.LM_HEAD, hidden=h, params=params,
                     flops_per_token=2.0 * h * v, act_bytes_tp=4.0 * v,
                     act_bytes_replicated=4.0 * h, act_bytes_input=2.0 * h, vocab_size=v)


def block_layer(c: TransformerConfig, index: int) -> LayerSpec:
    """A decoder block: norm, attention, norm, MLP (dense or MoE)."""
    h, f = c.hidden, c.ffn_hidden
    q_dim = c.num_heads * c.head_dim
    kv_dim = c.num_kv_heads * c.head_dim
    attn_params = h * q_dim + 2 * h * kv_dim + q_dim * h
    if c.qkv_bias or c.linear_bias:
        attn_params += q_dim + 2 * kv_dim
    if c.linear_bias:
        attn_params += h
    mats_per_expert = 3 if c.mlp == "swiglu" else 2
    expert_params = mats_per_expert * h * f + ((f + h) if c.linear_bias else 0)
    shared_params = (mats_per_expert * h * c.shared_expert_ffn + h) if c.shared_expert_ffn else 0
    moe = c.is_moe_layer(index)
    norms = 2 * _norm_params(c)
    # Causal attention: QK^T and AV are 2 * 2 * s * q_dim FLOPs per token, half of them masked.
    attn_coeff = 2.0 * q_dim
    attn_linear_flops = 2.0 * (h * q_dim + 2 * h * kv_dim + q_dim * h)
    mlp_flops = 2.0 * mats_per_expert * h * f
    # Activations (bytes/token, 16-bit): replicated = two norm inputs + two norm outputs.
    replicated = 4.0 * 2 * h
    # TP regions: q, k, v; attention output (input of wo); flash-attention softmax stats ~0.
    attn_tp = 2.0 * (q_dim + 2 * kv_dim) + 2.0 * q_dim
    # MLP: swiglu keeps w1 out, w3 out and their product (input of w2); gelu keeps fc1 out and gelu out.
    mlp_tp = 2.0 * f * (3 if c.mlp == "swiglu" else 2)
    # Selective recompute drops the attention output and the activation-function output,
    # recomputing the attention core (flash backward replays it anyway) and an elementwise op.
    selective = 2.0 * q_dim + 2.0 * f
    if moe:
        # Dropless routing keeps k token-slots per token on average (skew is `routing_skew`).
        k, cap = c.top_k, c.capacity_factor or 1.0
        router_params = h * c.num_experts
        params = attn_params + norms + router_params + c.num_experts * expert_params + shared_params
        shared_flops = 2.0 * (mats_per_expert * h * c.shared_expert_ffn + h) if c.shared_expert_ffn else 0.0
        flops = attn_linear_flops + 2.0 * h * c.num_experts + k * mlp_flops + shared_flops
        # Each token visits k experts (capacity factor pads the buffers), and the shared expert.
        shared_act = 2.0 * c.shared_expert_ffn * (3 if c.mlp == "swiglu" else 2)
        mlp_act = k * cap * (mlp_tp + 2.0 * h) + shared_act
        selective += k * cap * 2.0 * f - 2.0 * f + 2.0 * c.shared_expert_ffn
        return LayerSpec(
            name=f"block{index}", kind=LayerKind.MOE_DECODER, hidden=h, params=params,
            flops_per_token=flops, attn_flops_coeff=attn_coeff, act_bytes_tp=attn_tp + mlp_act,
            act_bytes_replicated=replicated, act_bytes_selective=selective,
            act_bytes_input=2.0 * h, selective_flops_per_token=0.0, selective_attn_fraction=1.0,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            expert_params=c.num_experts * expert_params, num_experts=c.num_experts,
            top_k=k, capacity_factor=c.capacity_factor or 0.0)
    mlp_params = expert_params
    return LayerSpec(
        name=f"block{index}", kind=LayerKind.DECODER, hidden=h,
        params=attn_params + mlp_params + norms,
        flops_per_token=attn_linear_flops + mlp_flops, attn_flops_coeff=attn_coeff,
        act_bytes_tp=attn_tp + mlp_tp, act_bytes_replicated=replicated,
        act_bytes_selective=selective, act_bytes_input=2.0 * h,
        selective_flops_per_token=0.0, selective_attn_fraction=1.0,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads)
