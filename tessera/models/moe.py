"""Mixture-of-experts layer: router, experts, optional shared expert, and the router losses.

Notation: one forward call (a micro-batch) routes T tokens x_t; z_t = W_g x_t are the router
logits over E experts; each token uses k of them.

Routing (`TransformerConfig.router`):
  topk_softmax (Mixtral):  chosen_t = top-k(z_t),  weights_t = softmax(z_t[chosen_t]).
  softmax_topk (Qwen-MoE): p_t = softmax(z_t), chosen_t = top-k(p_t), weights_t = p_t[chosen_t]
                           (divided by their sum when `norm_topk_prob`).
  y_t = sum_j weights_tj * expert_{chosen_tj}(x_t)  [+ sigmoid(w_s . x_t) * shared_expert(x_t)].

Capacity (`capacity_factor` c; None = dropless): within each sequence of S tokens, expert e serves
at most C = ceil(c * S * k / E) token-slots. Slots are served choice by choice (every token's first
choice, then every second choice, ...; GShard's priority) and by position within a choice; a
dropped slot adds nothing (its weight is not handed to the other choices). Per sequence, so that
the result does not depend on how a batch is split over ranks.

Load-balancing loss (Switch Transformer, Fedus et al. 2021, eq. 4; scaled so that a perfectly
balanced router scores 1 for any k):
    L_lb = E / (k T^2) * sum_e n_e * sum_t p_te,
n_e the token-slots routed to expert e (before any drop), p_t = softmax(z_t) over all experts.
Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5):  L_z = (1/T) sum_t logsumexp(z_t)^2.
Each MoE layer adds aux = router_aux_loss_coef * L_lb + router_z_loss_coef * L_z per forward call;
one process trains on  LM loss + `moe_aux_loss(model)`.

Distribution: the layer asks its `context` (a `MoEContext`, one process by default) for the
statistics of the whole micro-batch (T and n_e over every rank holding part of it), for the
capacity counts of sequence pieces on other ranks, and to run the experts on the routed token
copies. Expert parallelism (`tessera.runtime.expert_parallel`) installs a context whose dispatch
moves tokens with all-to-alls to the rank holding each expert, and whose aux-loss gradient is
injected at the layer output (no term is added to the runtime's loss).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..spec.model import TransformerConfig


class Experts(nn.Module):
    """Experts by global index: parameters are named `<e>.w1.weight` etc., as in an `nn.ModuleList`
    (HF conversion relies on it). Under expert parallelism a rank keeps only its own (`keep`).

    `forward(x, counts)`: x holds the tokens grouped by expert in index order, counts[i] rows for
    the i-th expert held; every expert runs, on zero rows too, so that every parameter has a
    gradient (the gradient reductions of data parallelism need the same ones on every rank)."""

    def __init__(self, experts: dict[int, nn.Module]):
        super().__init__()
        for e, module in experts.items():
            self.add_module(str(e), module)

    @property
    def indices(self) -> list[int]:
        return [int(k) for k in self._modules]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, e: int) -> nn.Module:
        return self._modules[str(e)]

    def keep(self, indices) -> None:
        """Drop every expert whose global index is not in `indices`."""
        wanted = {str(e) for e in indices}
        for key in list(self._modules):
            if key not in wanted:
                del self._modules[key]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = [expert(part) for expert, part in zip(self._modules.values(), x.split(counts))]
        return torch.cat(outs) if outs else x[:0]


def route(logits: torch.Tensor, top_k: int, router: str, norm_topk_prob: bool):
    """(chosen (T, k) expert ids, weights (T, k) fp32, probs (T, E) fp32 softmax over all experts)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if router == "topk_softmax":
        top, chosen = torch.topk(logits, top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=torch.float32)
    else:
        weights, chosen = torch.topk(probs, top_k, dim=-1)
        if norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen, weights, probs


# Uniform routing (`uniform_routing`): the dry run on fake tensors, which have no values to route by.
_UNIFORM = {"on": False}


@contextlib.contextmanager
def uniform_routing() -> Iterator[None]:
    """Route every token of the MoE layers uniformly inside the block: token t's j-th slot goes to
    expert (t k + j) mod E, so each expert gets N / E of the N = T k slots (the first N mod E one
    more) and every split is known without reading a tensor (the cost model's mean routing). The
    router still runs; every slot is served (a balanced load stays within any capacity >= 1)."""
    saved = _UNIFORM["on"]
    _UNIFORM["on"] = True
    try:
        yield
    finally:
        _UNIFORM["on"] = saved


def uniform_counts(slots: int, num_experts: int) -> list[int]:
    """Slots per expert of `uniform_routing` for `slots` token-slots."""
    return [slots // num_experts + (e < slots % num_experts) for e in range(num_experts)]


def split_sizes(counts) -> list[int]:
    """Rows per expert as a list: the routing's own list (uniform routing), else read from the tensor."""
    return counts if isinstance(counts, list) else counts.tolist()


def capacity(config: TransformerConfig, seq_len: int) -> int:
    """Token-slots one expert serves per sequence of `seq_len` tokens (module docstring)."""
    return math.ceil(config.capacity_factor * seq_len * config.top_k / config.num_experts)


def capacity_keep(chosen: torch.Tensor, num_experts: int, limit: int, context: "MoEContext") -> torch.Tensor:
    """Which token-slots are served: chosen (B, S_local, k) -> bool (B, S_local, k).

    A slot's place in its expert's queue is the number of slots of the same row before it: all
    slots of earlier choices, then those of the same choice at earlier positions (on this rank,
    plus the row's earlier sequence pieces on others, from `context.sequence_counts`)."""
    onehot = F.one_hot(chosen, num_experts)  # (B, S, k, E)
    per_choice = onehot.sum(1)  # (B, k, E)
    before, totals = context.sequence_counts(per_choice)
    earlier_choices = totals.cumsum(1) - totals
    base = earlier_choices + before  # (B, k, E)
    place = onehot.cumsum(1) - onehot + base[:, None]
    return (place * onehot).sum(-1) < limit


@dataclass
class Routing:
    """One forward call's routing: `chosen` (B, S, k) experts of every token, `slots` the served
    token-slots (flat index token * k + choice) grouped by expert (`counts` (E,) each, `expert`
    the expert of each), `token` and `weights` of each served slot; `routed` (E,) slots before
    capacity drops; the router's logits and softmax; `sizes` the counts as a list when known
    without reading the device (`uniform_routing`), else None."""

    logits: torch.Tensor
    probs: torch.Tensor
    chosen: torch.Tensor
    routed: torch.Tensor
    slots: torch.Tensor
    token: torch.Tensor
    expert: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    sizes: list[int] | None = None


class MoEContext:
    """How a MoE layer runs on one process; `tessera.runtime.expert_parallel` subclasses it.

    `token_pieces`: ranks holding distinct tokens of the micro-batch (T = local tokens x pieces).
    `aux_grad_scale`: None keeps the aux loss in the autograd graph (`MoE.aux_loss`, for the
    caller to add); a number injects its gradient at the layer output with that factor instead.
    """

    token_pieces: int = 1
    seq_pieces: int = 1  # ranks a sequence is split over (Ulysses)
    aux_grad_scale: float | None = None
    carries_residual: bool = False  # the block calls `MoE.forward_block` (`place_block`)

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Routing counts (E,) of the whole micro-batch from this rank's."""
        return counts

    def sequence_counts(self, per_choice: torch.Tensor) -> tuple[torch.Tensor | int, torch.Tensor]:
        """(counts of the rows' earlier sequence pieces, counts of the whole rows), each (B, k, E)."""
        return 0, per_choice

    def dispatch(self, x: torch.Tensor, token: torch.Tensor, counts, experts: Experts) -> torch.Tensor:
        """Expert outputs for the routed copies x[token] (grouped by expert; counts (E,) per
        expert, a tensor or, under uniform routing, a list), in the same order."""
        return experts(x[token], split_sizes(counts))

    # Tensor parallelism (runtime/expert_tp.py) replaces these: the layer's input as it computes on
    # it, the block's norm, the router's input, the shared expert's output, the weighted sum of the
    # expert outputs (out_t = sum_j w_tj y_tj [+ gate_t shared_t]) and the layer's output.
    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def block_norm(self, norm: nn.Module):
        """The block's `ffn_norm` as the layer applies it (per-layer placement)."""
        return norm

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def run_shared(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return mlp(x)

    def mix(self, y, w, token, tokens: int, shared, gate) -> torch.Tensor:
        out = torch.zeros((tokens, y.shape[-1]), dtype=y.dtype, device=y.device)
        out.index_add_(0, token, y * w.to(y.dtype)[:, None])
        return out if shared is None else out + gate * shared

    def leave(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def place_block(self, moe: "MoE", h: torch.Tensor, routing: Routing, norm, shape, inject) -> torch.Tensor:
        """h + the layer's output for norm(h) (h flat (T, H)), shaped like the block's input, on the
        rows the context places the samples on for the next layer (`carries_residual` contexts
        only); `inject(t)` returns t carrying the aux loss's gradient, for a tensor of this rank's
        backward."""
        raise NotImplementedError


LOCAL = MoEContext()


class _InjectAux(torch.autograd.Function):
    """Identity on the layer output whose backward also seeds d(aux)/d(aux) = scale, so the aux
    loss's gradient flows wherever the output's does (a pipeline stage included)."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """Top-k routed experts with the router losses (module docstring). State-dict names:
    `gate`, `experts.<e>.{w1,w2,w3}`, and `shared_expert.*`, `shared_expert_gate` (Qwen-MoE)."""

    def __init__(self, config: TransformerConfig, expert: type[nn.Module]):
        super().__init__()
        self.config = config
        self.num_experts, self.top_k = config.num_experts, config.top_k
        self.gate = nn.Linear(config.hidden, config.num_experts, bias=False)
        self.experts = Experts({e: expert(config) for e in range(config.num_experts)})
        if config.shared_expert_ffn:
            self.shared_expert = expert(config, hidden=config.shared_expert_ffn)
            self.shared_expert_gate = nn.Linear(config.hidden, 1, bias=False)
        self.context: MoEContext = LOCAL
        self.aux_loss: torch.Tensor | None = None  # of the last forward (module docstring)
        self.stats = MoEStats(config.num_experts)
        self.routing_log: list[torch.Tensor] | None = None  # a list: each forward appends its choices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        x = ctx.enter(x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        router_in = ctx.router_input(flat)
        r = self._route(router_in, shape)
        y = ctx.dispatch(flat, r.token, r.counts if r.sizes is None else r.sizes, self.experts)
        shared = gate = None
        if self.config.shared_expert_ffn:
            gate = torch.sigmoid(self.shared_expert_gate(router_in))
            shared = ctx.run_shared(self.shared_expert, flat)
        out = ctx.mix(y, r.weights, r.token, flat.shape[0], shared, gate)
        return ctx.leave(self._inject(out, self._record(r)).view(shape))

    def forward_block(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """h + MoE(norm(h)) for a context that carries the residual (`MoEContext.carries_residual`:
        NetMoE per-layer placement): the context returns the sum with the residual, on the rows of
        the samples this rank runs next (runtime/moe_placement.py)."""
        ctx = self.context
        h = ctx.enter(h)
        norm = ctx.block_norm(norm)
        shape = h.shape
        flat_h = h.reshape(-1, shape[-1])
        r = self._route(ctx.router_input(norm(flat_h)), shape)
        aux = self._record(r)
        return ctx.place_block(self, flat_h, r, norm, shape, lambda t: self._inject(t, aux))

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The gated shared expert (Qwen-MoE): sigmoid(w_s . x) * shared_expert(x)."""
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _route(self, flat: torch.Tensor, shape) -> "Routing":
        cfg, ctx = self.config, self.context
        logits = self.gate(flat)
        chosen, weights, probs = route(logits, self.top_k, cfg.router, cfg.norm_topk_prob)
        if _UNIFORM["on"]:
            return self._uniform_route(logits, probs, weights, shape)
        routed = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        slots = torch.arange(chosen.numel(), device=flat.device)
        if cfg.capacity_factor is not None:
            seq = shape[1] * ctx.seq_pieces
            keep = capacity_keep(chosen.view(shape[0], shape[1], -1), self.num_experts, capacity(cfg, seq), ctx)
            slots = slots[keep.flatten()]
        expert_of = chosen.flatten()[slots]
        order = torch.argsort(expert_of, stable=True)
        slots = slots[order]
        return Routing(logits=logits, probs=probs, chosen=chosen.view(shape[0], shape[1], -1), routed=routed,
                       slots=slots, token=slots // self.top_k, expert=expert_of[order],
                       counts=torch.bincount(expert_of, minlength=self.num_experts),
                       weights=weights.flatten()[slots])

    def _uniform_route(self, logits, probs, weights, shape) -> "Routing":
        """`uniform_routing`'s routing of the T tokens: slot i = t k + j to expert i mod E, slots
        grouped by expert with shape-only operations (no value of a tensor is read)."""
        n, e, k = logits.shape[0] * self.top_k, self.num_experts, self.top_k
        sizes = uniform_counts(n, e)
        device = logits.device
        # Expert e's slots are e, e + E, e + 2E, ...: grouped by expert in index order.
        slots = torch.cat([torch.arange(c, device=device) * e + i for i, c in enumerate(sizes)])
        chosen = (torch.arange(n, device=device) % e).view(shape[0], shape[1], k)
        counts = torch.tensor(sizes, device=device)
        expert = torch.cat([torch.full((c,), i, dtype=torch.long, device=device) for i, c in enumerate(sizes)])
        return Routing(logits=logits, probs=probs, chosen=chosen, routed=counts, slots=slots, token=slots // k,
                       expert=expert, counts=counts, weights=weights.flatten()[slots], sizes=sizes)

    def _record(self, r: "Routing") -> torch.Tensor | None:
        """The aux loss (kept in `aux_loss`, detached when its gradient is injected) and the
        statistics; returns the loss for `_inject`."""
        aux = self._aux_loss(r.logits, r.probs, r.routed, r.logits.shape[0])
        self.aux_loss = aux.detach() if aux is not None and self.context.aux_grad_scale is not None else aux
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside the backward
            self.stats.add(r.routed, len(r.slots), self.aux_loss)
            if self.routing_log is not None:
                self.routing_log.append(r.chosen.detach())
        return aux

    def _inject(self, out: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """`out` carrying the aux loss's gradient (injecting contexts), else `out`."""
        if aux is None or self.context.aux_grad_scale is None:
            return out
        return _InjectAux.apply(out, aux, self.context.aux_grad_scale)

    def _aux_loss(self, logits, probs, routed, tokens: int) -> torch.Tensor | None:
        """This rank's share of the layer's aux loss: shares of all ranks add up to the loss of the
        whole micro-batch (both terms are sums over tokens once n_e and T are global)."""
        cfg = self.config
        if not (cfg.router_aux_loss_coef or cfg.router_z_loss_coef):
            return None
        total = tokens * self.context.token_pieces
        aux = torch.zeros((), dtype=torch.float32, device=logits.device)
        if cfg.router_aux_loss_coef:
            n = self.context.reduce_counts(routed).float()
            lb = self.num_experts / (self.top_k * total * total) * (n * probs.sum(0)).sum()
            aux = aux + cfg.router_aux_loss_coef * lb
        if cfg.router_z_loss_coef:
            z = torch.logsumexp(logits.float(), dim=-1).pow(2).sum() / total
            aux = aux + cfg.router_z_loss_coef * z
        return aux


class MoEStats:
    """What one rank routed since the last `take` (for reports): token-slots per expert (before
    drops), slots served, and the sum of its aux-loss shares."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.routed = None
        self.served = 0
        self.aux = 0.0
        self.calls = 0
        self.a2a_bytes = 0  # bytes this rank sent to other ranks in all-to-alls (expert parallel)

    def add(self, routed: torch.Tensor, served: int, aux: torch.Tensor | None) -> None:
        routed = routed.detach()
        self.routed = routed if self.routed is None else self.routed + routed
        self.served += served
        self.calls += 1
        if aux is not None:
            self.aux = self.aux + aux.detach()


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor | float:
    """Sum of the MoE layers' aux losses of the last forward (0.0 without any): what one process
    adds to its language-model loss."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else 0.0
