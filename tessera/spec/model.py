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
from functools import lru_cache
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
    PROJECTOR = "projector"  # encoder features -> LLM embeddings (a VLM's MLP connector)
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


class Matmul(Frozen):
    """One matrix multiply of a layer's forward, per token: (tokens x k) @ (k x n).

    `shard` says which dimension tensor parallelism divides: "col" (column-parallel: n / tp),
    "row" (row-parallel: k / tp) or "none" (replicated, e.g. the MoE router). `expert`: one GEMM of
    each expert; the tokens it sees are the routed ones (top_k x capacity factor of the tokens,
    spread over the experts)."""

    n: int = Field(gt=0)
    k: int = Field(gt=0)
    shard: Literal["col", "row", "none"] = "col"
    expert: bool = False


AttentionKernel = Literal["flash", "unfused"]
KernelStyle = Literal["eager", "fused"]


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
    These four scale with the activation element size (x 2 for fp32 runs), except for a layer a
    model profile measured (`compute_measured`): its bytes are the measured ones, in the
    profile's dtype, fp32 parts included.

    What eager PyTorch holds besides (per token, see `_Execution` for the per-operation counts):
      - `act_fp32_tp`, `act_fp32_replicated`: saved tensors that are fp32 whatever the activation
        dtype (norm statistics, SDPA's logsumexp, the LM head's log-probabilities);
      - `act_bytes_selective_replicated`: the part of `act_bytes_replicated` selective recompute
        drops (the runtime's policy keeps matmul outputs and the block input only);
      - `rms_norm_width`: elements per token its RMSNorms normalise. The fused CUDA kernel keeps
        the input and an fp32 statistic (what the replicated bytes count); a device without it (a
        CPU runs `rms_norm`'s composite) keeps the fp32 upcast input and normalised product
        instead of the input: (8 - a) bytes per element more, a the activation element size;
      - `act_held_tp`: bytes (16-bit, scaled like the above) the training loop holds until the
        micro-batch's backward ends without autograd saving them (the LM head's logits);
      - `bwd_transient`, `bwd_transient_fp32`: bytes alive only while the layer's backward runs,
        beside its saved tensors (16-bit scaled / fp32), divided by TP: a block's incoming
        gradient and its MLP branches' gradients; the LM head's gradient of the log-probabilities
        and of the fp32 logits at the start of backward;
      - `bwd_transient_fp32_vocab_parallel`: fp32 bytes the LM head's backward holds beside those
        when it runs tensor parallel (divided by TP too): DTensor's `loss_parallel` builds the
        gradient of the vocabulary-sharded logits as (a zero tensor with -1 at the targets +
        exp(log-probabilities)) x the output gradient, three V-sized tensors alive at once where
        the plain loss has two (torch/distributed/tensor/parallel/loss.py,
        `_nll_loss_and_log_softmax_backward`).

    Per-operation compute (cost/compute.py, used on devices with a GEMM description):
      - `matmuls`: the linear layers' GEMMs (`Matmul`), priced by their shape after TP sharding
        and micro-batching; `flops_per_token` = sum of 2 n k (experts: x top_k).
      - attention core: `attn_kernel` "flash" (one fused kernel, causal blocks skipped, priced at
        the device's flash-attention throughput) or "unfused" (the s x s scores materialised: two
        batched GEMMs forward, four backward, and `score_bytes_fwd` / `score_bytes_bwd` bytes of
        softmax / mask / dropout traffic per score element), with `head_dim`.
      - memory-bound work (norms, activation functions, rotary, residual adds, dropout,
        cross-entropy): `elementwise_bytes_tp` (divided by TP) and `elementwise_bytes_replicated`
        (divided only under Megatron SP) bytes read + written per token in the forward; the
        backward moves twice as much (cost/compute.py). `kernels`: kernel launches per forward.
    `tied_params`: of `params`, a weight shared with another layer (the LM head tied to the
    embedding): counted once where both sit on the same pipeline rank (cost/layer.py).
    `compute_measured`: a model profile measured this layer (`tessera profile model`): its fitted
    scales and overheads then price it as a whole, instead of the per-operation model.
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
    act_bytes_selective_replicated: float = Field(default=0.0, ge=0)
    act_fp32_tp: float = Field(default=0.0, ge=0)
    act_fp32_replicated: float = Field(default=0.0, ge=0)
    rms_norm_width: int = Field(default=0, ge=0)
    act_held_tp: float = Field(default=0.0, ge=0)
    bwd_transient: float = Field(default=0.0, ge=0)
    bwd_transient_fp32: float = Field(default=0.0, ge=0)
    bwd_transient_fp32_vocab_parallel: float = Field(default=0.0, ge=0)
    selective_flops_per_token: float = 0.0
    selective_attn_fraction: float = 0.0
    num_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    # MoE: parameters of the experts (the part expert parallelism divides) and routing.
    expert_params: int = 0
    num_experts: int = 0
    top_k: int = 0
    capacity_factor: float = 1.0  # token-slots per routed slot an expert is sized for (1.0 dropless)
    dropless: bool = True  # False: capacity_factor caps what an expert serves (the rest is dropped)
    # Routing skew: the most loaded expert-parallel rank's tokens over the mean (>= 1; 1 = balanced).
    # Given, or measured from a routing trace (`tessera.cost.moe.routing_skew`).
    routing_skew: float = Field(default=1.0, ge=1.0)
    # Inter-node all-to-all bytes relative to uniform routing (< 1 with NetMoE sample placement).
    a2a_internode_scale: float = Field(default=1.0, ge=0.0)
    matmuls: tuple[Matmul, ...] = ()
    head_dim: int = Field(default=0, ge=0)
    attn_kernel: AttentionKernel = "flash"
    score_bytes_fwd: float = Field(default=0.0, ge=0)
    score_bytes_bwd: float = Field(default=0.0, ge=0)
    # Bytes per attention-score element kept for backward by unfused attention (x heads x seq
    # per token, divided by TP; dropped by selective recompute).
    act_score_bytes: float = Field(default=0.0, ge=0)
    elementwise_bytes_tp: float = Field(default=0.0, ge=0)
    elementwise_bytes_replicated: float = Field(default=0.0, ge=0)
    kernels: int = Field(default=0, ge=0)
    tied_params: int = Field(default=0, ge=0)
    # How another system's trainer executes the layer, to price its published runs (`from_config`);
    # the runtime refuses both (runtime/parallelize.py). `recompute_replays_all`: full recompute
    # re-runs the whole forward, its last TP collective included (a reentrant checkpoint, as
    # Megatron-LM's `CheckpointFunction`); PyTorch's non-reentrant checkpoint, the runtime's, stops
    # at the last tensor the backward needs. `grad_sync_after_backward`: the step's gradient sync
    # starts once the whole backward has ended (Megatron-LM's local DDP of 2021), not overlapped.
    recompute_replays_all: bool = False
    grad_sync_after_backward: bool = False
    compute_measured: bool = False
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

    @model_validator(mode="after")
    def _check_config(self) -> "ModelSpec":
        """The layers are the config's: a file whose config says one model and whose layers say
        another would train the one and be priced as the other."""
        if self.config is None:
            return self
        want = _config_signature(self.config)
        have = self.layers
        if len(want) != len(have):
            raise ValueError(f"model.config describes {len(want)} layers (with embedding and head), "
                             f"model.layers has {len(have)}")
        for i, (a, b) in enumerate(zip(want, have)):
            if a != (b.kind, b.hidden, b.params):
                raise ValueError(f"model.layers[{i}] ({b.name}: {b.kind.value}, hidden {b.hidden}, {b.params:,} "
                                 f"parameters) is not what model.config describes ({a[0].value}, hidden "
                                 f"{a[1]}, {a[2]:,} parameters)")
        return self

    @property
    def num_params(self) -> int:
        """Parameters of the model, a tied weight counted once (the LM head's copy of the
        embedding is `tied_params`)."""
        return sum(layer.params - layer.tied_params for layer in self.layers)

    @property
    def num_blocks(self) -> int:
        return sum(1 for layer in self.layers if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD))

    def flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token at this sequence length (training step = 3x this)."""
        return sum(layer.flops_per_token + layer.attn_flops_coeff * seq_len for layer in self.layers)

    @classmethod
    def from_config(cls, config: TransformerConfig, *, attention: AttentionKernel = "flash",
                    kernels: KernelStyle = "eager", dropout: bool = False, checkpoint: str = "early_stop",
                    grad_sync: str = "overlapped") -> "ModelSpec":
        """The planner's view of `config` as Tessera's runtime executes it by default: flash
        attention (SDPA), eager PyTorch element-wise ops, no dropout, a non-reentrant checkpoint
        that stops at the last saved tensor, the gradient sync overlapped with the backward. Other
        implementations (for example Megatron-LM's fused kernels with materialised attention
        scores and dropout, its reentrant checkpoint and its local DDP's sync after the backward,
        to compare with its published runs) change the costs, not the architecture."""
        if checkpoint not in ("early_stop", "reentrant"):
            raise ValueError(f"checkpoint must be 'early_stop' or 'reentrant', not '{checkpoint}'")
        if grad_sync not in ("overlapped", "after_backward"):
            raise ValueError(f"grad_sync must be 'overlapped' or 'after_backward', not '{grad_sync}'")
        way = _Execution(attention, kernels, dropout)
        layers = [embedding_layer(config, way)]
        layers += [block_layer(config, i, way) for i in range(config.num_layers)]
        layers.append(head_layer(config, way))
        if checkpoint != "early_stop" or grad_sync != "overlapped":
            other = dict(recompute_replays_all=checkpoint == "reentrant",
                         grad_sync_after_backward=grad_sync == "after_backward")
            layers = [layer.model_copy(update=other) for layer in layers]
        # Built from the config: consistent by construction (and `_check_config` builds one).
        return cls.model_construct(name=config.name, layers=tuple(layers), config=config)


@lru_cache(maxsize=64)
def _config_signature(config: TransformerConfig) -> tuple:
    """(kind, hidden, parameters) of each layer `config` describes: what `_check_config` compares,
    built once per config (plans are validated many times during a search)."""
    return tuple((a.kind, a.hidden, a.params) for a in ModelSpec.from_config(config).layers)


def _norm_params(c: TransformerConfig) -> int:
    return 2 * c.hidden if c.norm == "layernorm" else c.hidden


class _Execution:
    """How the layers execute (see `ModelSpec.from_config`), and the per-token byte counts of
    their memory-bound work that follow from it.

    Units: bytes read + written per token in the forward with 16-bit activations (2 bytes an
    element); cost/compute.py doubles them for the backward and scales them for fp32 runs.
    Counted per operation, each reading its inputs and writing its output once:
      - "fused" (Megatron-LM's fused kernels: apex LayerNorm, fused bias-GeLU / SwiGLU,
        bias-dropout-add, fused rotary; torch.compile fuses alike): a norm reads and writes h
        elements (2h x 2 bytes); a residual add reads 2h and writes h (6h bytes; dropout adds a
        1-byte mask per element); rotary reads and writes q and k; GeLU reads and writes f, SwiGLU
        reads 2f and writes f.
      - "eager" (Tessera's runtime in eager PyTorch, `tessera.models.transformer`): norms as above
        (LayerNorm and RMSNorm have fused CUDA kernels); `apply_rope` runs as separate kernels in
        fp32: upcast (read 2, write 4 bytes an element), four products (8 bytes each, on half the
        elements), two sums (12 bytes, half the elements), the concatenation (8) and the downcast
        (6): 48 bytes per element of q and k; the attention output is copied once for the
        head-to-hidden reshape (4 bytes an element of q); SwiGLU is SiLU (4 bytes an element of f)
        then a product (6 bytes on f): 10 bytes; GeLU 4 bytes on f.
      - cross-entropy per logit (neither runtime fuses it): eager `F.cross_entropy(logits.float())`
        upcasts (6 bytes), runs log-softmax (12) forward, and its backward (12) and the downcast (6):
        36 bytes in all; Megatron's vocabulary-parallel loss is a chain of fp32 PyTorch ops (upcast
        6, max 4, subtract 8, exp 8, sum 4 forward; softmax 8, gradient 8, downcast 6 backward): 52.
        Stored as a third of the total (the model charges the backward twice the forward).
      - unfused attention (`score_bytes_*`, per element of the s x s scores): the fused
        scale-mask-softmax reads and writes the scores (4 bytes), attention dropout reads and
        writes them and writes a 1-byte mask (5 bytes); backward: dropout (5) then softmax's
        gradient reading probabilities and gradient, writing one (6).
    """

    def __init__(self, attention: str, kernels: str, dropout: bool):
        if attention not in ("flash", "unfused"):
            raise ValueError(f"attention must be 'flash' or 'unfused', not '{attention}'")
        if kernels not in ("eager", "fused"):
            raise ValueError(f"kernels must be 'eager' or 'fused', not '{kernels}'")
        self.attention, self.fused, self.dropout = attention, kernels == "fused", dropout

    def residual(self, h: int) -> float:
        return 2.0 * 3 * h + (1.0 * h if self.dropout else 0.0)

    def block_bytes(self, c: TransformerConfig, q_dim: int, kv_dim: int, f: int) -> tuple[float, float]:
        """(bytes divided by TP, replicated bytes) per token of a block's forward."""
        h = c.hidden
        replicated = 2 * (2.0 * 2 * h) + 2 * self.residual(h)
        rope = c.position == "rope"
        if self.fused:
            tp = (2.0 * 2 * (q_dim + kv_dim) if rope else 0.0) + (2.0 * 3 * f if c.mlp == "swiglu" else 2.0 * 2 * f)
        else:
            tp = ((48.0 * (q_dim + kv_dim) if rope else 0.0) + 4.0 * q_dim
                  + (10.0 * f if c.mlp == "swiglu" else 4.0 * f))
        return tp, replicated

    def block_activations(self, c: TransformerConfig, q_dim: int, kv_dim: int, f: int, heads: int) -> dict:
        """Bytes per token a block keeps for backward, by `LayerSpec` field (see its docstring).

        "fused" (Megatron-LM, Korthikanti et al. 2022 Table 2 without the attention scores,
        which `act_score_bytes` counts): 16-bit norm inputs and outputs (8h), q, k, v and the
        attention output, the MLP's inputs and activation outputs; selective recompute drops the
        attention output and the activation-function output.

        "eager" (Tessera's runtime, counted per operation from what autograd saves, a the
        activation element size, r = 4 bytes fp32):
          norm (x2)   its input x (a h) and statistics (r: RMSNorm's rstd; LayerNorm's mean and
                      rstd, 2r); the q/k/v (MLP) projections save its output (a h)
          RoPE        nothing: the rotations multiply constants (cos, sin views of a buffer),
                      so autograd keeps only them; its outputs are what SDPA saves
          SDPA        q, k, v (a (q + 2 kv)), its output (a q; the head-merging reshape of the
                      flash output is a view, the output projection saves it) and the
                      logsumexp (r per head)
          residuals   nothing (an add keeps no input); the next norm saves the sum
          SwiGLU      w1 and w3 outputs, SiLU's output, their product (a 4 f); GeLU: fc1's
                      output and GeLU's (a 2 f)
        Selective recompute runs the runtime's policy (tessera.runtime.parallelize: matmul
        outputs saved, everything else recomputed): it keeps the block input, the q/k/v, w1/w3
        (fc1) outputs and the two output projections' (a (3 h + q + 2 kv + 2 f), GeLU a f).
        Backward transient (both): the incoming gradient and the gradients of the MLP's branches
        produced together (SwiGLU a (h + 2 f), GeLU a (h + f)), measured on CPU for a block.
        """
        h = c.hidden
        swiglu = c.mlp == "swiglu"
        branches = 2 if swiglu else 1
        out = dict(bwd_transient=2.0 * (h + branches * f), act_bytes_input=2.0 * h)
        if self.fused:
            out.update(act_bytes_replicated=4.0 * 2 * h + (2.0 * h if self.dropout else 0.0),
                       act_bytes_tp=2.0 * (q_dim + 2 * kv_dim) + 2.0 * q_dim + 2.0 * f * (3 if swiglu else 2),
                       act_bytes_selective=2.0 * q_dim + 2.0 * f)
            return out
        stats = 4.0 if c.norm == "rmsnorm" else 8.0
        out.update(act_bytes_replicated=2.0 * 4 * h, act_fp32_replicated=2 * stats,
                   act_bytes_tp=2.0 * (2 * q_dim + 2 * kv_dim) + 2.0 * f * (4 if swiglu else 2),
                   act_fp32_tp=4.0 * heads if self.attention == "flash" else 0.0,
                   act_bytes_selective=2.0 * q_dim + 2.0 * f * (2 if swiglu else 1),
                   act_bytes_selective_replicated=2.0 * h,
                   rms_norm_width=2 * h if c.norm == "rmsnorm" else 0)
        return out

    def head_activations(self, c: TransformerConfig) -> dict:
        """Bytes per token the LM head keeps (see `block_activations` for a and r).

        "eager": the final norm (input and output, a 2h, and its statistics) and, for
        `F.cross_entropy(logits.float())`, the log-probabilities log_softmax saves (r V, fp32
        whatever a; the cast's fp32 copy of the logits is freed once log_softmax has read it);
        the training loop holds the logits themselves (a V) until the backward ends; the backward
        starts with the gradient of the log-probabilities and then of the fp32 logits alive
        together (2 r V), the largest transient of the step for a large vocabulary; tensor
        parallel (`loss_parallel`), a third fp32 V-sized tensor beside them (r V).
        "fused" (Megatron-LM): the norm's input and output and the fp32 logits of the
        vocabulary-parallel cross-entropy (4 V)."""
        h, v = c.hidden, c.vocab_size
        if self.fused:
            return dict(act_bytes_tp=4.0 * v, act_bytes_replicated=4.0 * h, act_bytes_input=2.0 * h)
        return dict(act_bytes_replicated=4.0 * h, act_fp32_replicated=4.0 if c.norm == "rmsnorm" else 8.0,
                    act_fp32_tp=4.0 * v, act_held_tp=2.0 * v, bwd_transient_fp32=8.0 * v,
                    bwd_transient_fp32_vocab_parallel=4.0 * v,
                    act_bytes_input=2.0 * h, rms_norm_width=h if c.norm == "rmsnorm" else 0)

    def score_bytes(self) -> tuple[float, float]:
        if self.attention == "flash":
            return 0.0, 0.0
        return 4.0 + (5.0 if self.dropout else 0.0), 6.0 + (5.0 if self.dropout else 0.0)

    def score_act_bytes(self) -> float:
        """Bytes per score element saved for backward (Korthikanti et al. 2022: softmax output
        2, dropout mask 1 and output 2)."""
        if self.attention == "flash":
            return 0.0
        return 2.0 + (3.0 if self.dropout else 0.0)

    def block_kernels(self, c: TransformerConfig) -> int:
        """Kernel launches of a block's forward (counted from the operations listed above)."""
        gemms = (4 if self.fused else 5) + (3 if c.mlp == "swiglu" and not self.fused else 2)
        attention = 1 if self.attention == "flash" else 4
        elementwise = 6 if self.fused else (6 + (18 if c.position == "rope" else 0) + 1
                                             + (2 if c.mlp == "swiglu" else 1))
        return gemms + attention + elementwise


def embedding_layer(c: TransformerConfig, way: _Execution | None = None) -> LayerSpec:
    way = way or _Execution("flash", "eager", False)
    params = c.vocab_size * c.hidden
    moved = 2.0 * 2 * c.hidden  # the lookup reads and writes h elements
    if c.position == "learned":
        params += c.max_seq_len * c.hidden
        moved += way.residual(c.hidden)  # adding the position embedding
    # Output of the lookup (the next block's input) is held by the block, so nothing here.
    return LayerSpec(name="embedding", kind=LayerKind.EMBEDDING, hidden=c.hidden, params=params,
                     flops_per_token=0.0, vocab_size=c.vocab_size, elementwise_bytes_replicated=moved,
                     kernels=2 if c.position == "learned" else 1)


def head_layer(c: TransformerConfig, way: _Execution | None = None) -> LayerSpec:
    way = way or _Execution("flash", "eager", False)
    h, v = c.hidden, c.vocab_size
    tied = v * h if c.tie_embeddings else 0
    params = _norm_params(c) + v * h
    # Activations: `_Execution.head_activations` (sharded over the vocabulary by a
    # vocabulary-parallel head).
    return LayerSpec(name="lm_head", kind=LayerKind.LM_HEAD, hidden=h, params=params, tied_params=tied,
                     flops_per_token=2.0 * h * v, vocab_size=v, **way.head_activations(c),
                     matmuls=(Matmul(n=v, k=h, shard="col"),),
                     elementwise_bytes_tp=(52.0 if way.fused else 36.0) / 3 * v,
                     elementwise_bytes_replicated=2.0 * 2 * h, kernels=3 if way.fused else 6)


def _block_matmuls(c: TransformerConfig, q_dim: int, kv_dim: int, way: _Execution, expert: bool) -> tuple:
    """The GEMMs of a block as the runtime issues them (Megatron fuses q, k, v into one GEMM and
    SwiGLU's two input projections into another)."""
    h, f = c.hidden, c.ffn_hidden
    if way.fused:
        attn = (Matmul(n=q_dim + 2 * kv_dim, k=h), Matmul(n=h, k=q_dim, shard="row"))
        up = (Matmul(n=2 * f, k=h, expert=expert),) if c.mlp == "swiglu" else (Matmul(n=f, k=h, expert=expert),)
    else:
        attn = (Matmul(n=q_dim, k=h), Matmul(n=kv_dim, k=h), Matmul(n=kv_dim, k=h),
                Matmul(n=h, k=q_dim, shard="row"))
        up = tuple(Matmul(n=f, k=h, expert=expert) for _ in range(2 if c.mlp == "swiglu" else 1))
    return attn, up + (Matmul(n=h, k=f, shard="row", expert=expert),)


def block_layer(c: TransformerConfig, index: int, way: _Execution | None = None) -> LayerSpec:
    """A decoder block: norm, attention, norm, MLP (dense or MoE)."""
    way = way or _Execution("flash", "eager", False)
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
    # Activations (bytes/token): `_Execution.block_activations`.
    acts = way.block_activations(c, q_dim, kv_dim, f, c.num_heads)
    bytes_tp, bytes_rep = way.block_bytes(c, q_dim, kv_dim, f)
    score_fwd, score_bwd = way.score_bytes()
    attn_mm, mlp_mm = _block_matmuls(c, q_dim, kv_dim, way, expert=moe)
    execution = dict(head_dim=c.head_dim, attn_kernel=way.attention, score_bytes_fwd=score_fwd,
                     score_bytes_bwd=score_bwd, act_score_bytes=way.score_act_bytes(),
                     elementwise_bytes_tp=bytes_tp, elementwise_bytes_replicated=bytes_rep,
                     kernels=way.block_kernels(c))
    if moe:
        # Dropless routing keeps k token-slots per token on average (skew is `routing_skew`).
        k, cap = c.top_k, c.capacity_factor or 1.0
        router_params = h * c.num_experts
        params = attn_params + norms + router_params + c.num_experts * expert_params + shared_params
        flops = attn_linear_flops + 2.0 * h * c.num_experts + k * mlp_flops + 2.0 * shared_params
        # Each token visits k experts (capacity factor pads the buffers): the MLP's share of the
        # dense counts times k cap, plus the expert inputs gathered per expert (h each).
        dense_mlp = acts["act_bytes_tp"] - way.block_activations(c, q_dim, kv_dim, 0, c.num_heads)["act_bytes_tp"]
        mlp_sel = 2.0 * f * (2 if (c.mlp == "swiglu" and not way.fused) else 1)
        acts["act_bytes_tp"] += (k * cap - 1) * dense_mlp + k * cap * 2.0 * h
        acts["act_bytes_selective"] += (k * cap - 1) * mlp_sel
        if c.shared_expert_ffn:  # Qwen-MoE's shared expert: a dense MLP of its size on every token
            sf = c.shared_expert_ffn
            acts["act_bytes_tp"] += (way.block_activations(c, q_dim, kv_dim, sf, c.num_heads)["act_bytes_tp"]
                                     - way.block_activations(c, q_dim, kv_dim, 0, c.num_heads)["act_bytes_tp"])
            acts["act_bytes_selective"] += 2.0 * sf * (2 if (c.mlp == "swiglu" and not way.fused) else 1)
            mlp_mm = mlp_mm + _block_matmuls(c.model_copy(update={"ffn_hidden": sf}), q_dim, kv_dim, way,
                                             expert=False)[1] + (Matmul(n=1, k=h, shard="none"),)
        act_mult = k * cap  # the experts' element-wise work runs on the routed tokens
        execution["elementwise_bytes_tp"] = bytes_tp + (act_mult - 1) * (way.block_bytes(c, 0, 0, f)[0])
        return LayerSpec(
            name=f"block{index}", kind=LayerKind.MOE_DECODER, hidden=h, params=params,
            flops_per_token=flops, attn_flops_coeff=attn_coeff, **acts,
            selective_flops_per_token=0.0, selective_attn_fraction=1.0,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            expert_params=c.num_experts * expert_params, num_experts=c.num_experts,
            top_k=k, capacity_factor=cap, dropless=c.capacity_factor is None,
            matmuls=attn_mm + (Matmul(n=c.num_experts, k=h, shard="none"),) + mlp_mm, **execution)
    mlp_params = expert_params
    return LayerSpec(
        name=f"block{index}", kind=LayerKind.DECODER, hidden=h,
        params=attn_params + mlp_params + norms,
        flops_per_token=attn_linear_flops + mlp_flops, attn_flops_coeff=attn_coeff, **acts,
        selective_flops_per_token=0.0, selective_attn_fraction=1.0,
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, matmuls=attn_mm + mlp_mm, **execution)
