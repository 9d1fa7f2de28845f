"""Memory per device: model states, activations and buffers of a layer under a strategy.

All functions take numpy arrays of strategy fields (one entry per candidate strategy), so the
search costs a whole candidate set at once and `evaluate` uses the very same formulas.

Model states (bytes), with P_d = dense params / tp (`tp_rank_params`: the embedding's and LM
head's vocabulary rows padded to a multiple of S as FSDP2 pads them, GPT-2's learned positions
and the final norm whole on every tp rank) and P_e = expert params / (tp * ep):
    params    = pb * (P_d / S3 + P_e / S3e)          pb = 2 (bf16) or 4 (fp32 workload); 0 at
                                                     ZeRO-3 in mixed precision (FSDP2's fp32
                                                     shard is the master ob counts, the bf16
                                                     copy gathered for use is a buffer)
    grads     = gb * (P_d / S2 + P_e / S2e)          gb = 4: gradients kept and reduced in fp32
                                                     (`Workload.grad_dtype`; what the runtime does)
    optimizer = ob * (P_d / S1 + P_e / S1e)          ob = 12 for AdamW in mixed precision
                                                     (fp32 master + m + v)
where S_k is the ZeRO shard degree S (dp, or dp_shard under HSDP) when zero >= k, else 1
(ZeRO-1 shards the optimizer, ZeRO-2 also gradients, ZeRO-3 also parameters), and for the
expert part S_ke = gcd(S, dp * sp / ep): experts are replicated only over dp * sp / ep ranks.
Offload (FSDP2 `CPUOffloadPolicy`): the parameter, gradient and optimizer-state shards live in
host memory, gb + ob per sharded parameter (+ pb in an fp32 run: in mixed precision the fp32
shard is the master copy ob counts); the device keeps only unsharded copies: the
parameters when ZeRO < 3 (gathered once per step and kept), the gradients when ZeRO < 2
(accumulated unsharded over the micro-batches); optimizer 0. A tied LM head on the embedding's pipeline rank counts its shared weight there only.

Activations per in-flight micro-batch, t tokens on the device (t = micro-batch sequences per
replica * seq_len / ulysses degree), a = activation element bytes (2, or 4 for fp32 runs),
s = a / 2 (the spec's bytes are 16-bit; 1 for a layer a model profile measured, whose bytes are
the measured ones, fp32 parts included, so the fp32 terms below are 0 for it):
    none       t * [s (act_tp / tp + act_replicated / tp_sp) + act_fp32_tp / tp
                    + (act_fp32_replicated + u) / tp_sp + s held_tp / tp] + scores
    selective  t * [s ((act_tp - act_selective) / tp + (act_replicated - act_sel_repl) / tp_sp)
                    + s held_tp / tp]
    full       t * s act_input / tp_sp                         (only the block input is kept)
with tp_sp = tp under Megatron SP, else 1, held_tp the logits the training loop holds (LM head),
u = (8 - a) rms_norm_width on a device without a fused RMSNorm kernel (a CPU: `rms_norm`'s
composite keeps the fp32 upcast input and normalised product), else 0, and
scores = t * s * heads / tp * act_score_bytes for unfused attention (Korthikanti's 5 a s / h
term; 0 with flash attention). For a GPT block with Megatron's kernels ("fused") this is
s b h (34 - 2) without TP (no dropout masks), s b h (8 + 24 / tp) with TP and s b h 32 / tp
with TP + SP: the paper's formulas without the dropout masks and with flash attention. For the
runtime's eager modules (spec/model.py, `_Execution.block_activations`) it is what autograd saves,
operation by operation: a LLaMA block keeps a (6 h + 2 q + 2 kv + 4 f) + r (2 + heads) bytes per
token on a GPU (r = 4), and on a CPU in fp32 4 (6 h + 2 q + 2 kv + 4 f + heads + 2), measured
exactly (tests/test_cost_memory.py).

Transient buffer of a layer (the peak while its backward runs):
    buf = t (s bwd_transient + bwd_transient_fp32 [+ bwd_transient_fp32_vocab_parallel if tp > 1]) / tp
                                (its incoming and MLP-branch gradients; the LM head's gradients
                                 of the log-probabilities and fp32 logits, 8 V bytes per token,
                                 12 V under DTensor's vocabulary-parallel loss)
        + 2 * pb * (P_d + P_e)  if zero == 3  (its own and the prefetched next layer's weights)
        + pb * (P_d + P_e)      if offloaded with zero >= 2 (its unsharded gradient before the
                                 reduce-scatter and the copy to the host)
        + t * act_none          if full recompute (its activations replayed for its backward)
        + t * (act_none - act_selective) if selective recompute (the dropped part replayed)
A stage's buffer is the largest `buf` of its layers plus the device's `reserved_bytes`.

Fragmentation and the planner's margin (`memory_budget`): the caching allocator holds more than
the tensors it serves. Its waste is charged as `ClusterSpec.fragmentation` (default 10%) of the
allocated bytes (states + activations + buffers), and the planner keeps `memory_margin` (default
5%) of the device free:
    fits  <=>  (states + activations + buffers) (1 + fragmentation) + reserved
               <= memory (1 - memory_margin)
10% is the middle of what GMLake (Guo et al., ASPLOS 2024) measured for PyTorch's caching
allocator on LLM training with recompute and ZeRO (5-30% of reserved memory unused); `reserved`
(2 GiB by default) holds the CUDA context, NCCL buffers and cuBLAS workspaces. A measured
profile replaces both (the fragmentation is a field of the cluster file).
"""
from __future__ import annotations

import numpy as np

from ..spec.model import LayerKind, LayerSpec
from ..spec.workload import Workload
from .schedule import in_flight

RC_NONE, RC_SELECTIVE, RC_FULL = 0, 1, 2

__all__ = ["RC_NONE", "RC_SELECTIVE", "RC_FULL", "in_flight", "model_state_bytes",
           "activation_bytes", "buffer_bytes", "expert_shard", "memory_budget", "required_memory",
           "offloaded_bytes", "tp_rank_params"]


def memory_budget(cluster) -> float:
    """Bytes the states, activations and buffers of a pipeline rank may take (module docstring)."""
    usable = cluster.device.memory_bytes * (1.0 - cluster.memory_margin) - cluster.device.reserved_bytes
    return usable / (1.0 + cluster.fragmentation)


def required_memory(allocated: float, cluster) -> float:
    """Device bytes needed for `allocated` bytes of states, activations and buffers."""
    return allocated * (1.0 + cluster.fragmentation) + cluster.device.reserved_bytes


def expert_shard(shard, dp, sp, ep):
    """ZeRO shard degree of expert states: gcd(S, dp * sp / ep)."""
    return np.gcd(np.asarray(shard, dtype=np.int64), (np.asarray(dp) * np.asarray(sp)) // np.asarray(ep))


def tp_rank_params(layer: LayerSpec, tp, shard=1, dense_params: float | None = None,
                   rows: tuple[int, int] | None = None):
    """Dense parameters of one tensor-parallel rank, gathered (what its ZeRO shard group of S
    ranks all-gathers and reduce-scatters), arrays over strategies.

    A block: dense / tp (its norms and row-parallel biases, replicated over tp, are ~1e-4 of it).
    The embedding and the LM head: the vocabulary table's ceil(V / tp) rows (vocabulary-parallel,
    `runtime/tp_embedding.py`, the first tp ranks' share) plus what tensor parallelism replicates
    whole: GPT-2's learned positions (S_max rows), the final norm's vectors. Each tensor's first
    dimension is padded to a multiple of S, as FSDP2 pads it into S equal pieces (torch.chunk's
    ceil(rows / S) rows each; the last ranks' pieces are shorter or empty). `dense_params`: the
    dense parameters to count, without a tied table counted elsewhere (then only the rest).
    `rows`: (tp block rows, shard piece rows) of one rank instead of the first rank's, for a
    prediction of that rank (`evaluate.rank_states`): its table counts block rows unsharded,
    piece x S sharded (so that a state divided by S is its own piece)."""
    tp = np.asarray(tp)
    dense = layer.dense_params if dense_params is None else dense_params
    if layer.kind not in (LayerKind.EMBEDDING, LayerKind.LM_HEAD) or not layer.vocab_size:
        return dense / tp
    shard = np.asarray(shard)
    h = layer.hidden
    rest = layer.dense_params - layer.vocab_size * h  # replicated over tp: positions, or the norm
    pad = lambda n: np.ceil(n / shard) * shard  # noqa: E731
    if rest % h:
        kept = rest
    elif layer.kind == LayerKind.EMBEDDING:
        kept = pad(rest // h) * h  # the position table's rows
    else:
        kept = (rest // h) * pad(h)  # norm vectors of h
    if rows is None:
        table = pad(np.ceil(layer.vocab_size / tp)) * h
    else:
        table = np.where(shard > 1, rows[1] * shard, rows[0]) * h
    return kept + np.where(dense > rest, table, 0.0)


def model_state_bytes(layer: LayerSpec, workload: Workload, tp, ep, zero, shard, expert_shard_deg, offload,
                      dense_params: float | None = None, rows: tuple[int, int] | None = None):
    """(params, grads, optimizer) bytes on one device, arrays over strategies; a sharded state
    holds the first rank's padded piece of each tensor (`tp_rank_params`; `rows`: another rank's)."""
    tp, ep, zero = np.asarray(tp), np.asarray(ep), np.asarray(zero)
    offload = np.asarray(offload, dtype=bool)
    pd = tp_rank_params(layer, tp, 1, dense_params, rows)
    padded = tp_rank_params(layer, tp, shard, dense_params, rows)
    pe = layer.expert_params / (tp * ep)
    pb, gb, ob = workload.param_bytes, workload.grad_bytes, workload.optimizer_bytes

    def sharded(k):
        s = np.where(zero >= k, shard, 1)
        se = np.where(zero >= k, expert_shard_deg, 1)
        return np.where(zero >= k, padded / s, pd) + pe / se

    # In mixed precision FSDP2's sharded parameter is the fp32 master (counted in ob): a ZeRO-3
    # layer keeps no working copy between uses (its gathered one is a buffer, `buffer_bytes`).
    mixed = workload.dtype != "fp32"
    params = np.where(offload | ((zero >= 3) & mixed), np.where(zero >= 3, 0.0, pb * (pd + pe)), pb * sharded(3))
    grads = np.where(offload, np.where(zero >= 2, 0.0, gb * (pd + pe)), gb * sharded(2))
    optimizer = np.where(offload, 0.0, ob * sharded(1))
    return params, grads, optimizer


def offloaded_bytes(layer: LayerSpec, workload: Workload, tp, ep, shard, expert_shard_deg, offload,
                    dense_params: float | None = None):
    """Host bytes of an offloaded layer on one device: its parameter, gradient and optimizer-state
    shards, gb + ob per sharded parameter, + pb in an fp32 run (in mixed precision FSDP2's fp32
    shard is the master copy that ob counts): what FSDP2's CPUOffloadPolicy keeps on the host."""
    tp, ep = np.asarray(tp), np.asarray(ep)
    local = tp_rank_params(layer, tp, shard, dense_params) / shard + layer.expert_params / (tp * ep) / expert_shard_deg
    master_is_param = workload.dtype == "fp32"
    per_param = workload.grad_bytes + workload.optimizer_bytes + (workload.param_bytes if master_is_param else 0)
    return np.where(np.asarray(offload, dtype=bool), per_param * local, 0.0)


def activation_bytes(layer: LayerSpec, tokens, tp, megatron_sp, recompute, seq_len: int = 0, sp=1,
                     elt: float = 2.0, fused_norms: bool = True):
    """Bytes one in-flight micro-batch keeps on one device (tokens: per device, after Ulysses;
    `elt`: activation element bytes; `fused_norms`: the device has a fused RMSNorm kernel)."""
    tp = np.asarray(tp, dtype=float)
    tp_sp = np.where(np.asarray(megatron_sp, dtype=bool), tp, 1.0)
    rc = np.asarray(recompute)
    measured = layer.compute_measured
    s = 1.0 if measured else elt / 2.0
    held = (elt / 2.0) * layer.act_held_tp / tp
    fp32 = 0.0 if measured else 1.0
    upcast = 0.0 if (measured or fused_norms) else (8.0 - elt) * layer.rms_norm_width
    scores = s * layer.act_score_bytes * layer.num_heads * seq_len / tp
    none = (s * (layer.act_bytes_tp / tp + layer.act_bytes_replicated / tp_sp)
            + fp32 * (layer.act_fp32_tp / tp + (layer.act_fp32_replicated + upcast) / tp_sp) + scores + held)
    selective = s * ((layer.act_bytes_tp - layer.act_bytes_selective) / tp
                     + (layer.act_bytes_replicated - layer.act_bytes_selective_replicated) / tp_sp) + held
    full = s * layer.act_bytes_input / tp_sp + held
    per_token = np.where(rc == RC_FULL, full, np.where(rc == RC_SELECTIVE, selective, none))
    return tokens * per_token


def buffer_bytes(layer: LayerSpec, workload: Workload, tokens, tp, ep, megatron_sp, zero, recompute, offload=False,
                 seq_len: int = 0, sp=1, dense_params: float | None = None, elt: float = 2.0,
                 fused_norms: bool = True, shard=1):
    """Transient bytes while this layer's backward runs (see the module docstring)."""
    tp, ep, zero = np.asarray(tp), np.asarray(ep), np.asarray(zero)
    rc = np.asarray(recompute)
    gathered = workload.param_bytes * (tp_rank_params(layer, tp, shard, dense_params) + layer.expert_params / (tp * ep))
    replay = activation_bytes(layer, tokens, tp, megatron_sp, RC_NONE, seq_len=seq_len, sp=sp, elt=elt,
                              fused_norms=fused_norms)
    kept = activation_bytes(layer, tokens, tp, megatron_sp, RC_SELECTIVE, seq_len=seq_len, sp=sp, elt=elt,
                            fused_norms=fused_norms)
    fp32 = layer.bwd_transient_fp32 + np.where(tp > 1, layer.bwd_transient_fp32_vocab_parallel, 0.0)
    transient = tokens * ((elt / 2.0) * layer.bwd_transient + fp32) / tp
    return (transient + np.where(zero == 3, 2.0 * gathered, 0.0)
            + np.where(np.asarray(offload, dtype=bool) & (zero >= 2), gathered, 0.0)
            + np.where(rc == RC_FULL, replay, np.where(rc == RC_SELECTIVE, replay - kept, 0.0)))
