"""Collectives of one training step, counted (`tessera.runtime.comm_count`) and checked against the
contract the cost model prices (gradient sync per ZeRO stage and micro-batch, TP per block).

Called from runtime_equivalence.py inside its torchrun launches; rank 0 prints `CHECK <name> ok`.
"""
from __future__ import annotations

from collections import Counter

import torch.distributed as dist

from runtime_common import GLOBAL_BATCH, INTERLEAVED_4_CHUNKS, LLAMA, LLAMA6, OPTIM, SEQ, S, global_batches, make_plan
from tessera.runtime.comm_count import count_collectives
from tessera.runtime.trainer import TrainConfig, Trainer

SCALAR_BYTES = 16  # the loss and gradient-norm reductions: left out of the comparison
GLOBAL_ROWS_X_SEQ = GLOBAL_BATCH * SEQ  # tokens of one step (tensor parallel ranks hold them all)


def _ok(name: str) -> None:
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def _with_micro_batches(plan, m: int):
    dp = max(s.dp for s in plan.layers)
    return plan.model_copy(update={"num_micro_batches": m, "micro_batch_size": plan.workload.global_batch // dp // m})


def _step(trainer: Trainer, batch) -> None:
    tokens, labels = batch
    trainer.train_step(trainer.local_rows(tokens), trainer.local_rows(labels))


def counted_step(trainer: Trainer, batch) -> Counter:
    """(kind, group size) -> [calls, bytes] of the gradient/parameter/activation collectives of one step."""
    with count_collectives() as records:
        _step(trainer, batch)
    out: Counter = Counter()
    for r in records:
        if r.bytes > SCALAR_BYTES and r.kind not in ("send", "recv"):
            out[(r.kind, r.group_size, "calls")] += 1
            out[(r.kind, r.group_size, "bytes")] += r.bytes
    return out


def _unit_bytes(units) -> list[int]:
    """Full fp32 bytes of the parameters each FSDP2 unit manages itself (not its nested units'),
    every module of a unit of several modules (the LM head's norm and projection) included."""
    out = []
    for u in units:
        groups = u.module._get_fsdp_state()._fsdp_param_groups
        out.append(sum(fp._orig_size.numel() * 4 for g in groups for fp in g.fsdp_params))
    return out


def expected_sync(plan, part, m: int) -> Counter:
    """The contract (grad_sync.py) per FSDP2 unit of a parallelised part: z0 all-reduce once; z1
    reduce-scatter and all-gather once; z2 reduce-scatter every micro-batch, all-gather once; z3
    all-gather twice and reduce-scatter once every micro-batch; HSDP: the replica all-reduce of
    the gradient shard once per step."""
    out: Counter = Counter()
    layer_of_unit = _layer_of_units(plan, part.chunk)
    for u, nbytes in zip(part.sync.units, _unit_bytes(part.sync.units)):
        if nbytes == 0:  # a root without parameters of its own issues nothing
            continue
        s = plan.layers[layer_of_unit[id(u.module)]]
        shard, replicate = s.shard_degree, s.dp // s.shard_degree
        calls = {0: (0, 0), 1: (1, 1), 2: (1, m), 3: (2 * m, m)}[u.zero]
        if shard > 1:
            for kind, n in zip(("all_gather", "reduce_scatter"), calls):
                out[(kind, shard, "calls")] += n
                out[(kind, shard, "bytes")] += n * nbytes
        if replicate > 1:
            out[("all_reduce", replicate, "calls")] += 1
            out[("all_reduce", replicate, "bytes")] += nbytes // shard
    return out


def _layer_of_units(plan, chunk) -> dict[int, int]:
    head = len(plan.layers) - 1
    out = {id(chunk): 0 if chunk.has_embedding else head}
    for key, block in chunk.layers.items():
        out[id(block)] = int(key) + 1
    for m in (chunk.norm, chunk.output):
        if m is not None:
            out[id(m)] = head
    return out


def check_gradient_sync_counts() -> None:
    """2 ranks, 1/2/4 micro-batches: DDP, FSDP2 with z0 blocks, ZeRO-1/2/3, HSDP (shard 1)."""
    n = len(make_plan(LLAMA, 2, S(dp=2)).layers)
    _check_sync("collectives_per_step_follow_the_zero_contract_2_ranks", {
        "ddp_z0": make_plan(LLAMA, 2, S(dp=2)),
        "fsdp_z0_blocks": make_plan(LLAMA, 2, [S(dp=2, zero=2)] + [S(dp=2)] * (n - 2) + [S(dp=2, zero=2)]),
        "z1": make_plan(LLAMA, 2, S(dp=2, zero=1)),
        "z2": make_plan(LLAMA, 2, S(dp=2, zero=2)),
        "z3": make_plan(LLAMA, 2, S(dp=2, zero=3)),
        "hsdp_z3_shard1": make_plan(LLAMA, 2, S(dp=2, zero=3, dp_shard=1)),
    }, (1, 2, 4))


def check_hsdp_sync_counts() -> None:
    """4 ranks, HSDP shard 2 x replicate 2: the replica all-reduce once per step, at every stage."""
    _check_sync("hsdp_collectives_follow_the_zero_contract_4_ranks", {
        f"hsdp_z{z}": make_plan(LLAMA, 4, S(dp=4, zero=z, dp_shard=2)) for z in (1, 2, 3)}, (2,))


def _check_sync(name: str, plans: dict, micro_batches: tuple[int, ...]) -> None:
    batch = global_batches(LLAMA, steps=1)[0]
    grad_bytes = sum(p.numel() * 4 for p in _meta_model().parameters())
    for plan_name, plan in plans.items():
        trainer = Trainer(TrainConfig(plan=plan, steps=8, optim=OPTIM, seed=0))
        for _ in range(2):  # lazy initialisation, DDP's bucket rebuild at its second step
            _step(trainer, batch)
        for m in micro_batches:
            trainer.plan = _with_micro_batches(plan, m)
            got = counted_step(trainer, batch)
            if trainer.parallel.ddp_group is not None:
                dp = plan.layers[0].dp
                want = Counter({("all_reduce", dp, "calls"): 1, ("all_reduce", dp, "bytes"): grad_bytes})
            else:
                want = expected_sync(trainer.plan, trainer.parallel, m)
            if got != want:
                raise AssertionError(f"{plan_name} at {m} micro-batches: counted {dict(got)}, contract {dict(want)}")
        trainer.close()
    _ok(name)


def _meta_model():
    from tessera.models.transformer import build_model

    return build_model(LLAMA, device="meta")


def _block_windows(trainer: Trainer, records: list) -> None:
    """Mark in `records` where each block's forward and backward begin and end."""
    for key, block in trainer.parallel.chunk.layers.items():
        block.register_forward_pre_hook(lambda *_, k=key: records.append(("enter", k, "forward")))
        block.register_forward_hook(lambda *_, k=key: records.append(("exit", k, "forward")))
        block.register_full_backward_pre_hook(lambda *_, k=key: records.append(("enter", k, "backward")))
        block.register_full_backward_hook(lambda *_, k=key: records.append(("exit", k, "backward")))


def block_collectives(trainer: Trainer, batch) -> dict[str, Counter]:
    """forward/backward -> (kind, bytes) -> calls, summed over the blocks, of one step."""
    out = {"forward": Counter(), "backward": Counter()}
    with count_collectives() as records:
        _block_windows(trainer, records)
        _step(trainer, batch)
    inside = None
    for r in records:
        if isinstance(r, tuple):
            inside = r[2] if r[0] == "enter" else None
        elif inside is not None:
            out[inside][(r.kind, r.bytes)] += 1
    return out


def check_tp_block_counts() -> None:
    """2 ranks, tensor parallel blocks: per block and micro-batch, Megatron's 2 all-reduces forward
    and 2 backward of the (tokens x hidden) activation (with sequence parallelism 2 all-gathers +
    2 reduce-scatters each way). Full recompute replays the forward's collectives in the backward
    except the block's last (the MLP output reduction, whose result backward does not need: the
    non-reentrant checkpoint stops recomputing once it has every saved tensor); selective replays
    none (its policy saves collective outputs)."""
    batch = global_batches(LLAMA, steps=1)[0]
    blocks = LLAMA.num_layers
    act = GLOBAL_ROWS_X_SEQ * LLAMA.hidden * 4  # one micro-batch's activation, fp32, full sequence
    cases = {
        ("none", "none"): ({("all_reduce", act): 2}, {("all_reduce", act): 2}),
        ("none", "full"): ({("all_reduce", act): 2}, {("all_reduce", act): 2 + 1}),
        ("megatron", "selective"): ({("all_gather", act): 2, ("reduce_scatter", act): 2},
                                    {("all_gather", act): 2, ("reduce_scatter", act): 2}),
        ("megatron", "full"): ({("all_gather", act): 2, ("reduce_scatter", act): 2},
                               {("all_gather", act): 2 + 2, ("reduce_scatter", act): 2 + 1}),
    }
    for (sp, rc), (fwd, bwd) in cases.items():
        trainer = Trainer(TrainConfig(plan=make_plan(LLAMA, 2, S(tp=2, sp=sp, recompute=rc)), steps=3, optim=OPTIM,
                                      seed=0))
        _step(trainer, batch)
        got = block_collectives(trainer, batch)
        trainer.close()
        for phase, per_block in (("forward", fwd), ("backward", bwd)):
            want = Counter({k: v * blocks for k, v in per_block.items()})
            if got[phase] != want:
                raise AssertionError(f"tp2 sp={sp} recompute={rc} {phase}: counted {dict(got[phase])}, "
                                     f"contract {dict(want)}")
    _ok("tp_block_collectives_per_micro_batch_2_ranks")


def check_pipeline_sync_counts() -> None:
    """4 ranks, pp=2 x dp=2, every ZeRO stage in the pipeline: each unit follows its own stage."""
    layers = [S(dp=2, zero=3), S(dp=2, zero=2), S(dp=2, zero=1), S(dp=2), S(dp=2, zero=3), S(dp=2, zero=2)]
    cases = [(LLAMA, layers, schedule, m, ((0, 3), (3, 6))) for schedule, m in (("1f1b", 2), ("zero_bubble", 4))]
    # 4 one-layer chunks per rank: more than torch's multi-chunk schedule keeps gathered at once.
    cases.append((LLAMA6, INTERLEAVED_4_CHUNKS, "interleaved_1f1b", 4, tuple((i, i + 1) for i in range(8))))
    for config, layers, schedule, m, stages in cases:
        batch = global_batches(config, steps=1)[0]
        plan = make_plan(config, 4, layers, num_micro_batches=m, schedule=schedule, stages=stages)
        trainer = Trainer(TrainConfig(plan=plan, steps=3, optim=OPTIM, seed=0))
        _step(trainer, batch)
        got = counted_step(trainer, batch)
        want = sum((expected_sync(plan, part, m) for part in trainer.pipeline_parts), Counter())
        trainer.close()
        if got != want:
            raise AssertionError(f"pipeline {schedule} at {m} micro-batches, rank {dist.get_rank()}: counted "
                                 f"{dict(got)}, contract {dict(want)}")
    _ok("pipeline_collectives_follow_each_layers_zero_stage_4_ranks")
