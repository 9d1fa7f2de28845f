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

import math
from collections.abc import Iterator

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


class MoEContext:
    """How a MoE layer runs on one process; `tessera.runtime.expert_parallel` subclasses it.

    `token_pieces`: ranks holding distinct tokens of the micro-batch (T = local tokens x pieces).
    `aux_grad_scale`: None keeps the aux loss in the autograd graph (`MoE.aux_loss`, for the
    caller to add); a number injects its gradient at the layer output with that factor instead.
    """

    token_pieces: int = 1
    seq_pieces: int = 1  # ranks a sequence is split over (Ulysses)
    aux_grad_scale: float | None = None

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Routing counts (E,) of the whole micro-batch from this rank's."""
        return counts

    def sequence_counts(self, per_choice: torch.Tensor) -> tuple[torch.Tensor | int, torch.Tensor]:
        """(counts of the rows' earlier sequence pieces, counts of the whole rows), each (B, k, E)."""
        return 0, per_choice

    def dispatch(self, x: torch.Tensor, token: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        """Expert outputs for the routed copies x[token] (grouped by expert; counts (E,) per
        expert), in the same order."""
        return experts(x[token], counts.tolist())


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
        cfg, ctx = self.config, self.context
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        chosen, weights, probs = route(logits, self.top_k, cfg.router, cfg.norm_topk_prob)
        routed = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        slots = torch.arange(chosen.numel(), device=x.device)
        if cfg.capacity_factor is not None:
            seq = shape[1] * ctx.seq_pieces
            keep = capacity_keep(chosen.view(shape[0], shape[1], -1), self.num_experts, capacity(cfg, seq), ctx)
            slots = slots[keep.flatten()]
        expert_of = chosen.flatten()[slots]
        order = torch.argsort(expert_of, stable=True)
        slots = slots[order]
        token = slots // self.top_k
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        y = ctx.dispatch(flat, token, counts, self.experts)
        w = weights.flatten()[slots].to(y.dtype)
        out = torch.zeros_like(flat).index_add_(0, token, y * w[:, None])
        if cfg.shared_expert_ffn:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        aux = self._aux_loss(logits, probs, routed, flat.shape[0])
        if aux is not None and ctx.aux_grad_scale is not None:
            out = _InjectAux.apply(out, aux, ctx.aux_grad_scale)
            aux = aux.detach()
        self.aux_loss = aux
        if torch._C._current_graph_task_id() == -1:  # not a recompute inside the backward
            self.stats.add(routed, len(slots), aux)
            if self.routing_log is not None:
                self.routing_log.append(chosen.detach().view(shape[0], shape[1], -1))
        return out.view(shape)

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
