"""Expert parallelism equals one process: gradients after step one (every parameter, relative 1e-5)
and losses over three AdamW steps, at 4 ranks, for ep2 x dp2, ep4, ep2 x tp2, ep2 with a 2-stage
pipeline, capacity with micro-batches and recompute, and capacity under Ulysses; Mixtral-style and
Qwen-MoE-style routing (shared expert), load-balancing and z losses on.

The one-process reference trains the plain model on the same global batches, split into the
plan's micro-batches (micro-batch j holds block j of every data rank's rows), on the loss
(1/m) sum_j (LM loss_j + moe_aux_loss_j).

Run by tests/test_moe_dist.py under torchrun (4 ranks); rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from runtime_common import OPTIM, SEQ, STEPS, global_batches, make_plan  # noqa: E402

from tessera.models.moe import moe_aux_loss  # noqa: E402
from tessera.models.transformer import build_model  # noqa: E402
from tessera.plan import LayerStrategy, Recompute, SPKind  # noqa: E402
from tessera.runtime.materialize import canonical_name  # noqa: E402
from tessera.runtime.optim import build_optimizer, build_scheduler, clip_grad_norm_  # noqa: E402
from tessera.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tessera.spec.model import TransformerConfig  # noqa: E402

MIXTRAL = TransformerConfig(name="ep-mixtral", family="mixtral", vocab_size=256, hidden=32, num_layers=2,
                            num_heads=4, num_kv_heads=2, ffn_hidden=48, max_seq_len=64, num_experts=4, top_k=2,
                            router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
QWEN = TransformerConfig(name="ep-qwen-moe", family="qwen2_moe", vocab_size=256, hidden=32, num_layers=2,
                         num_heads=4, num_kv_heads=2, ffn_hidden=24, max_seq_len=64, num_experts=4, top_k=2,
                         qkv_bias=True, router="softmax_topk", norm_topk_prob=False, shared_expert_ffn=40,
                         router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
GRAD_RTOL, LOSS_RTOL = 1e-5, 1e-5


def S(dp=1, tp=1, sp="none", sp_degree=1, zero=0, recompute="none", ep=1) -> LayerStrategy:
    return LayerStrategy(dp=dp, tp=tp, sp=SPKind(sp), sp_degree=sp_degree, zero=zero,
                         recompute=Recompute(recompute), ep=ep)


def blocks(config, dense: LayerStrategy, moe: LayerStrategy) -> list[LayerStrategy]:
    return [dense, *([moe] * config.num_layers), dense]


def micro_batches(tokens: torch.Tensor, data_ranks: int, m: int) -> list[torch.Tensor]:
    """Global micro-batch j: block j (of m) of every data rank's rows, in rank order."""
    per_rank = tokens.chunk(data_ranks)
    return [torch.cat([rows.chunk(m)[j] for rows in per_rank]) for j in range(m)]


def reference(config: TransformerConfig, plan, batches, aux_out: list | None = None):
    """(losses, gradients of step one by name, gradient norm of step one) of one process; the
    router losses of each step (sum over layers, mean over micro-batches) go to `aux_out`."""
    model = build_model(config, seed=0)
    opt, sched = build_optimizer(model.parameters(), OPTIM), None
    sched = build_scheduler(opt, OPTIM)
    data_ranks, m = min(s.dp for s in plan.layers), plan.num_micro_batches
    losses, grads, norm = [], None, None
    for step, (tokens, labels, *docs) in enumerate(batches):
        total = aux_total = 0.0
        pieces = [micro_batches(x, data_ranks, m) for x in docs]
        for t, l, *extra in zip(micro_batches(tokens, data_ranks, m), micro_batches(labels, data_ranks, m), *pieces):
            lm = F.cross_entropy(model(t, *extra).flatten(0, 1), l.flatten())
            aux = moe_aux_loss(model)
            ((lm + aux) / m).backward()
            total += lm.item() / m
            aux_total += float(aux) / m
        if aux_out is not None:
            aux_out.append(aux_total)
        if step == 0:
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        n = clip_grad_norm_(list(model.parameters()), OPTIM.grad_clip)
        norm = float(n) if step == 0 else norm
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, grads, norm


def full_grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on this rank (this rank's experts only)."""
    out = {}
    for part in trainer.model_parts:
        for name, p in part.named_parameters():
            g = p.grad
            if g is None:
                continue
            out[canonical_name(name)] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()
    return out


def packed(batches, seed: int = 5):
    """The batches as packed documents: every row cut in two at a random point (positions restart,
    attention stays inside each document)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for tokens, labels in batches:
        cut = torch.randint(1, tokens.shape[1], (tokens.shape[0], 1), generator=gen)
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        doc_ids = (pos >= cut).long()
        out.append((tokens, labels, torch.where(pos >= cut, pos - cut, pos), doc_ids))
    return out


def check(name: str, config: TransformerConfig, plan, placement: bool | str = False, docs: bool = False,
          offload=None) -> None:
    batches = global_batches(config)
    if docs:
        batches = packed(batches)
    want_losses, want_grads, want_norm = reference(config, plan, batches)
    trainer = Trainer(TrainConfig(plan=plan, steps=STEPS, optim=OPTIM, seed=0, moe_placement=placement,
                                  expert_offload=offload))
    moved = []
    if placement:  # note each step's placement (rank 0 solves it)
        place = trainer.placer.place

        def noted(*rows):
            out = place(*rows)
            if trainer.placer.last is not None:
                moved.append(trainer.placer.last.order() != sorted(trainer.placer.last.order()))
                assert trainer.placer.last.cost <= trainer.placer.last.baseline + 1e-9
            return out

        trainer.placer.place = noted
    captured = {}
    step_fn = trainer.optimizer_step

    def optimizer_step(loss=None):  # the gradients the optimizer is about to use (before clipping)
        if not captured:
            captured.update(full_grads(trainer))
        step_fn(loss)
        captured.setdefault("__norm__", float(trainer.grad_norm))

    trainer.optimizer_step = optimizer_step
    losses = [trainer.train_step(*(trainer.local_rows(x) for x in batch)) for batch in batches]
    trainer.close()
    rank = dist.get_rank()
    norm = captured.pop("__norm__")
    assert captured, f"{name}: no gradients captured"
    worst = (0.0, "")
    for pname, g in captured.items():
        ref = want_grads[pname]
        err = float((g - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
        worst = max(worst, (err, pname))
        if os.environ.get("MOE_DEBUG") and rank == 0:
            print(f"  {pname}: {err:.2e}", flush=True)
    if worst[0] > GRAD_RTOL:
        raise AssertionError(f"{name}: rank {rank} gradient of {worst[1]} off by {worst[0]:.2e} (relative)")
    experts_here = sum(1 for p in captured if ".experts." in p)
    layers_here = {p.split(".moe.")[0] for p in captured if ".moe." in p}
    experts_all = sum(1 for p in want_grads if ".experts." in p and p.split(".moe.")[0] in layers_here)
    ep = max(s.ep for s in plan.layers)
    if experts_here * ep != experts_all:
        raise AssertionError(f"{name}: rank {rank} holds {experts_here} of {experts_all} expert tensors, ep={ep}")
    if abs(norm - want_norm) > 1e-5 * want_norm:
        raise AssertionError(f"{name}: gradient norm {norm:.8f} != one-process {want_norm:.8f}")
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        if abs(got - want) > LOSS_RTOL * abs(want):
            raise AssertionError(f"{name}: step {step} loss {got:.8f} != one-process {want:.8f}")
    if offload is not None:  # APTMoE: every expert of this stage ran where the decision put it
        assert all(h.prefetches for h in trainer.host_experts), name
        for host in trainer.host_experts:
            assert all(host.ran[e][place] > 0 for e, place in host.where.items()), (name, host.ran)
    if placement and rank == 0 and not any(moved[1:]):
        raise AssertionError(f"{name}: the placement never moved a sample ({moved})")
    if placement == "layer":  # samples moved between layers too
        between = [bool((order != torch.arange(len(order))).any()) for c in trainer.placer.contexts
                   for order in c.decisions.values()]
        if not any(between):
            raise AssertionError(f"{name}: no MoE layer moved a sample")
    if rank == 0:
        print(f"  {name}: worst gradient error {worst[0]:.1e} ({worst[1]})", flush=True)
        print(f"CHECK {name} ok", flush=True)


def check_aux_matters() -> None:
    """The test can see the router losses: without them the gate's gradient moves by far more than
    the tolerance."""
    batches = global_batches(MIXTRAL)[:1]
    model = build_model(MIXTRAL, seed=0)
    tokens, labels = batches[0]
    lm = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    aux = moe_aux_loss(model)
    g_with = torch.autograd.grad(lm + aux, model.layers["0"].moe.gate.weight, retain_graph=True)[0]
    g_without = torch.autograd.grad(lm, model.layers["0"].moe.gate.weight)[0]
    rel = float((g_with - g_without).abs().max() / g_with.abs().max())
    assert rel > 100 * GRAD_RTOL, rel
    if dist.get_rank() == 0:
        print(f"CHECK aux_loss_visible ok", flush=True)


def plans():
    w = 4
    return [
        ("ep2_dp2_zero2_mixtral", MIXTRAL, make_plan(MIXTRAL, w, blocks(MIXTRAL, S(dp=4), S(dp=4, ep=2, zero=2)))),
        ("ep4_zero1_qwen", QWEN, make_plan(QWEN, w, blocks(QWEN, S(dp=4, zero=1), S(dp=4, ep=4, zero=1)))),
        ("ep2_tp2_sp_qwen", QWEN, make_plan(QWEN, w, blocks(QWEN, S(dp=2, tp=2, sp="megatron"),
                                                            S(dp=2, tp=2, sp="megatron", ep=2)))),
        ("ep2_pp2_1f1b_mixtral", MIXTRAL, make_plan(MIXTRAL, w, blocks(MIXTRAL, S(dp=2, zero=3), S(dp=2, ep=2, zero=3)),
                                                    num_micro_batches=2, stages=((0, 2), (2, 4)))),
        ("ep2_pp2_gpipe_tp2_qwen", QWEN, make_plan(QWEN, w, blocks(QWEN, S(tp=2), S(dp=2, ep=2)),
                                                   num_micro_batches=2, stages=((0, 2), (2, 4)), schedule="gpipe")),
        ("ep2_pp2_zero_bubble_mixtral", MIXTRAL, make_plan(MIXTRAL, w, blocks(MIXTRAL, S(dp=2, zero=2),
                                                                              S(dp=2, ep=2, zero=2)),
                                                          num_micro_batches=2, stages=((0, 2), (2, 4)),
                                                          schedule="zero_bubble")),
    ]


def capacity_plans():
    mix = MIXTRAL.model_copy(update=dict(name="ep-mixtral-cap", capacity_factor=1.0))
    qwen = QWEN.model_copy(update=dict(name="ep-qwen-cap", capacity_factor=1.25, norm_topk_prob=True))
    ulysses = S(dp=2, sp="ulysses", sp_degree=2, zero=3, ep=2)
    return [
        ("ep2_dp2_capacity_microbatch2_full_recompute", mix,
         make_plan(mix, 4, blocks(mix, S(dp=4), S(dp=4, ep=2, recompute="full")), num_micro_batches=2)),
        ("ep2_ulysses2_capacity_selective", qwen,
         make_plan(qwen, 4, blocks(qwen, S(dp=2, sp="ulysses", sp_degree=2, zero=3),
                                   ulysses.model_copy(update=dict(recompute=Recompute.SELECTIVE))))),
    ]


def check_train_report() -> None:
    """`Trainer.train()` on an expert-parallel plan reports per-expert token-slots, all-to-all bytes and
    router losses per step: slots add up to tokens x k, the router losses equal one process's, and
    the bytes are what the cost model's all-to-all volume gives for near-uniform routing."""
    from tessera.cost.moe import slot_bytes
    from tessera.runtime.trainer import SyntheticLoader

    plan = make_plan(MIXTRAL, 4, blocks(MIXTRAL, S(dp=4), S(dp=4, ep=4, zero=2)))
    steps = 2
    trainer = Trainer(TrainConfig(plan=plan, steps=steps, optim=OPTIM, seed=0, synthetic_data=True))
    records = trainer.train()
    trainer.close()
    batches = [SyntheticLoader.global_batch_at(MIXTRAL.vocab_size, SEQ, 8, 0, step) for step in range(steps)]
    aux: list[float] = []
    reference(MIXTRAL, plan, batches, aux)
    moe_block = plan.model.layers[1]
    for r, want_aux in zip(records, aux):
        counts = r.moe["tokens_per_expert"]
        assert sorted(counts) == ["0", "1"] and all(sum(c) == 8 * SEQ * MIXTRAL.top_k for c in counts.values()), counts
        assert abs(r.moe["aux_loss"] - want_aux) <= 1e-5 * want_aux, (r.moe["aux_loss"], want_aux)
        # 4 token all-to-alls per layer and step (dispatch, combine, and their backward), 3/4 of each
        # rank's slots leave it under uniform routing.
        mean = 4 * MIXTRAL.num_layers * 4 * float(slot_bytes(moe_block, 2 * SEQ, 4)) * 3 / 4
        assert 0.7 * mean < r.moe["a2a_bytes"] < 1.3 * mean, (r.moe["a2a_bytes"], mean)
    if dist.get_rank() == 0:
        print("CHECK train_reports_routing ok", flush=True)


def check_collectives_as_priced() -> None:
    """One step of an ep4 plan, its collectives counted on every rank (runtime/comm_count.py), against
    what the cost model lists and prices for each MoE layer (cost/moe.py `ep_collectives`): the
    same all-to-alls and all-reduces, the same sizes; the token all-to-alls' bytes over all ranks are
    the listed mean x ranks (the dispatch of each rank and the combine's gradient exactly: every
    rank sends all its k slots per token; the others depend on the routing, their sum does not)."""
    import torch

    from tessera.cost.moe import ep_collectives
    from tessera.runtime.comm_count import count_collectives

    plan = make_plan(MIXTRAL, 4, blocks(MIXTRAL, S(dp=4), S(dp=4, ep=4, zero=2)))
    trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0))
    tokens, labels = global_batches(MIXTRAL)[0]
    with count_collectives() as records:
        trainer.train_step(trainer.local_rows(tokens), trainer.local_rows(labels))
    trainer.close()
    layers = MIXTRAL.num_layers
    listed = ep_collectives(plan.model.layers[1], plan.layers[1], 2 * SEQ, 4, aux_loss=True)
    a2a = [r for r in records if r.kind == "all_to_all"]
    counts = [r for r in a2a if r.bytes == 8 * MIXTRAL.num_experts]
    token = [r for r in a2a if r.bytes != 8 * MIXTRAL.num_experts]
    want_a2a = [c for c in listed if c.op == "all_to_all"]
    assert len(a2a) == layers * len(want_a2a) and all(r.group_size == 4 for r in a2a), \
        [(r.bytes, r.group_size) for r in a2a]
    assert len(counts) == layers and len(token) == layers * 4
    mean = [c.nbytes for c in want_a2a if c.what != "counts"]
    # This rank's dispatch (the first token all-to-all of each layer) sends exactly its slots.
    assert all(token[4 * i].bytes == mean[0] for i in range(layers)), (token[0].bytes, mean[0])
    total = torch.tensor([float(sum(r.bytes for r in token))])
    dist.all_reduce(total)
    world = dist.get_world_size()
    assert float(total) == layers * world * sum(mean), (float(total), layers * world * sum(mean))
    stats = [r for r in records if r.kind == "all_reduce" and r.bytes == 8 * MIXTRAL.num_experts]
    want_ar = [c for c in listed if c.op == "all_reduce"]
    assert len(stats) == layers * len(want_ar) and all(r.group_size == want_ar[0].group for r in stats)
    if dist.get_rank() == 0:
        print("CHECK ep_collectives_as_priced ok", flush=True)


def check_tp_collectives_as_priced() -> None:
    """Tensor parallel with Megatron SP: a MoE block issues a dense block's tp collectives (per
    micro-batch an all-gather + reduce-scatter pair each way for each half, of the sequence's
    activation, as cost/collectives.py prices a block), and besides them only the all-reduce of
    the routing-weight gradients that cost/moe.py lists (the experts' outputs are reduced once,
    with the layer's, not as all-reduces of their token-slots)."""
    from collections import Counter

    from tessera.cost.moe import ep_collectives
    from tessera.runtime.comm_count import count_collectives

    moe_plan = dict((name, p) for name, _, p in plans())["ep2_tp2_sp_qwen"]
    dense = QWEN.model_copy(update=dict(name="tp-qwen-dense", family="qwen2", num_experts=0, top_k=0,
                                        shared_expert_ffn=0, router="topk_softmax", router_aux_loss_coef=0.0,
                                        router_z_loss_coef=0.0))
    dense_plan = make_plan(dense, 4, S(dp=2, tp=2, sp="megatron"))
    msg = 8 // 2 * SEQ * QWEN.hidden * 4  # a rank's (whole-sequence) activation, fp32
    counts = []
    for plan, config in ((moe_plan, QWEN), (dense_plan, dense)):
        trainer = Trainer(TrainConfig(plan=plan, steps=1, optim=OPTIM, seed=0))
        tokens, labels = global_batches(config)[0]
        with count_collectives() as records:
            trainer.train_step(trainer.local_rows(tokens), trainer.local_rows(labels))
        trainer.close()
        counts.append((Counter((r.kind, r.group_size) for r in records if r.bytes == msg), records))
    (moe, records), (dense_counts, _) = counts
    assert moe == dense_counts, (sorted(moe.items()), sorted(dense_counts.items()))
    layer, s = moe_plan.model.layers[1], moe_plan.layers[1]
    tiny = [c for c in ep_collectives(layer, s, 8 // s.dp * SEQ, 4, aux_loss=True) if "tensor parallel" in c.what]
    assert len(tiny) == 1 and tiny[0].op == "all_reduce" and tiny[0].phase == "backward", tiny
    small = [r for r in records if r.kind == "all_reduce" and r.group_size == s.tp and r.bytes == tiny[0].nbytes]
    assert len(small) == QWEN.num_layers, ([(r.bytes, r.group_size) for r in records if r.kind == "all_reduce"],
                                           tiny[0].nbytes)
    if dist.get_rank() == 0:
        print("CHECK tp_sp_collectives_as_priced ok", flush=True)


def check_checkpoint_across_ep(directory: str) -> None:
    """Save under ep4 after two steps, resume under ep2 (experts on other ranks): the third step's
    loss is the one of an uninterrupted one-process run."""
    from tessera.runtime.trainer import SyntheticLoader

    plans = [make_plan(MIXTRAL, 4, blocks(MIXTRAL, S(dp=4), S(dp=4, ep=ep, zero=zero)))
             for ep, zero in ((4, 2), (2, 3))]
    first = Trainer(TrainConfig(plan=plans[0], steps=2, optim=OPTIM, seed=0, synthetic_data=True,
                                checkpoint_dir=directory))
    first.train()
    first.close()
    second = Trainer(TrainConfig(plan=plans[1], steps=3, optim=OPTIM, seed=0, synthetic_data=True, resume=directory))
    records = second.train()
    second.close()
    batches = [SyntheticLoader.global_batch_at(MIXTRAL.vocab_size, SEQ, 8, 0, step) for step in range(3)]
    want = reference(MIXTRAL, plans[0], batches)[0]
    assert [r.step for r in records] == [3], [r.step for r in records]
    assert abs(records[0].loss - want[2]) <= 1e-5 * want[2], (records[0].loss, want[2])
    if dist.get_rank() == 0:
        print("CHECK checkpoint_ep4_resume_ep2 ok", flush=True)


def placement_plans():
    """NetMoE placement with one rank per node: every ep2 group spans two nodes. Per layer: Qwen-MoE
    (shared expert), a capacity that drops slots, two micro-batches, full recompute, packed documents;
    and under tensor parallelism with Megatron SP."""
    plan = make_plan(MIXTRAL, 4, blocks(MIXTRAL, S(dp=4), S(dp=4, ep=2, zero=1)))
    one_per_node = plan.cluster.model_copy(update=dict(num_nodes=4, gpus_per_node=1))
    qwen = QWEN.model_copy(update=dict(name="ep-qwen-cap-layer", capacity_factor=1.0, norm_topk_prob=True))
    layered = make_plan(qwen, 4, blocks(qwen, S(dp=4, zero=2), S(dp=4, ep=2, zero=2, recompute="full")),
                        num_micro_batches=2)
    tp_sp = make_plan(QWEN, 4, blocks(QWEN, S(dp=2, tp=2, sp="megatron"), S(dp=2, tp=2, sp="megatron", ep=2)))
    return [("ep2_dp2_netmoe_placement", MIXTRAL, plan.model_copy(update=dict(cluster=one_per_node)), True),
            ("ep2_dp4_netmoe_per_layer_qwen_capacity_recompute", qwen,
             layered.model_copy(update=dict(cluster=one_per_node)), "layer"),
            ("ep2_tp2_sp_netmoe_per_layer_qwen", QWEN, tp_sp.model_copy(update=dict(cluster=one_per_node)), "layer")]


def offload_plans():
    """APTMoE: a pipeline of four single-rank stages, each MoE layer's experts on its rank's host,
    two brought to the device and two computed on the host."""
    from tessera.cost.expert_offload import GPU, HOST, LayerOffload, OffloadPlan

    plan = make_plan(MIXTRAL, 4, blocks(MIXTRAL, S(), S()), num_micro_batches=4,
                     stages=((0, 1), (1, 2), (2, 3), (3, 4)))
    where = LayerOffload(where=(GPU, HOST, HOST, GPU), seconds=0.0, offload_all_s=0.0, host_all_s=0.0)
    return [("aptmoe_offload_pp4", MIXTRAL, plan, OffloadPlan(layers=(where,) * 2, micro_batches=4))]


if __name__ == "__main__":
    assert SEQ == 16
    dist.init_process_group("gloo")
    only = set(sys.argv[1:])
    check_aux_matters()
    for name, config, plan in plans() + capacity_plans():
        if not only or name in only:
            check(name, config, plan)
    for name, config, plan, how in placement_plans():
        if not only or name in only:
            check(name, config, plan, placement=how, docs=how == "layer")
    for name, config, plan, offload in offload_plans():
        if not only or name in only:
            check(name, config, plan, offload=offload)
    if not only or "train_reports_routing" in only:
        check_train_report()
    if not only or "ep_collectives_as_priced" in only:
        check_collectives_as_priced()
    if not only or "tp_sp_collectives_as_priced" in only:
        check_tp_collectives_as_priced()
    if os.environ.get("MOE_CHECKPOINT_DIR") and (not only or "checkpoint_ep4_resume_ep2" in only):
        check_checkpoint_across_ep(os.environ["MOE_CHECKPOINT_DIR"])
    dist.destroy_process_group()
