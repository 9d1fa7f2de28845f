"""Shared by the runtime's torchrun scripts: small models, hand-made plans, the one-process reference."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tessera.models.transformer import build_model
from tessera.plan import LayerStrategy, PipelineSpec, Plan, Recompute, SPKind
from tessera.runtime.materialize import full_value_slice
from tessera.runtime.optim import OptimConfig, build_optimizer, build_scheduler, clip_grad_norm_
from tessera.runtime.trainer import TrainConfig, Trainer
from tessera.spec.model import ModelSpec, TransformerConfig
from tessera.spec.presets.clusters import local_cpu_cluster
from tessera.spec.workload import Workload

LLAMA = TransformerConfig(name="test-llama", vocab_size=512, hidden=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, ffn_hidden=96, max_seq_len=64)
GPT2 = TransformerConfig(name="test-gpt2", family="gpt2", vocab_size=512, hidden=64, num_layers=4, num_heads=4,
                         num_kv_heads=4, ffn_hidden=128, max_seq_len=64, norm="layernorm", mlp="gelu",
                         position="learned", linear_bias=True, tie_embeddings=True)
# Six blocks: 8 plan layers give a pp=2 interleaved schedule 4 one-layer chunks per rank, more than
# the 3 that torch's multi-chunk schedules keep gathered at once.
LLAMA6 = LLAMA.model_copy(update={"name": "test-llama6", "num_layers": 6})
MOE = TransformerConfig(name="test-moe", family="mixtral", vocab_size=512, hidden=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, ffn_hidden=64, max_seq_len=64, num_experts=4, top_k=2)

GLOBAL_BATCH, SEQ, STEPS = 8, 16, 3
OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=STEPS, grad_clip=0.5)


def S(dp=1, tp=1, sp="none", sp_degree=1, zero=0, dp_shard=0, recompute="none", offload=False,
      cp=1) -> LayerStrategy:
    return LayerStrategy(dp=dp, tp=tp, sp=SPKind(sp), sp_degree=sp_degree, zero=zero, dp_shard=dp_shard,
                         recompute=Recompute(recompute), offload_optimizer=offload, cp=cp)


# pp rank 0 runs layers 0, 2, 4, 6 of LLAMA6 (ZeRO-1, 1, 1, 0), pp rank 1 layers 1, 3, 5, 7 (ZeRO-2, 3, 2, 1).
INTERLEAVED_4_CHUNKS = [S(dp=2, zero=z) for z in (1, 2, 1, 3, 1, 2, 0, 1)]


def make_plan(config: TransformerConfig, world: int, strategies, num_micro_batches: int = 1,
              global_batch: int = GLOBAL_BATCH, seq_len: int = SEQ, stages=None,
              schedule: str = "1f1b") -> Plan:
    """A hand-made plan: one strategy for every layer, or a list (embedding, blocks..., head);
    `stages` = the pipeline chunks' layer ranges (pp = world / ranks of a stage)."""
    spec = ModelSpec.from_config(config)
    n = len(spec.layers)
    layers = tuple(strategies) if isinstance(strategies, (list, tuple)) else (strategies,) * n
    assert len(layers) == n, (len(layers), n)
    dp = max(s.dp for s in layers)
    return Plan(model=spec, cluster=local_cpu_cluster(world),
                workload=Workload(global_batch=global_batch, seq_len=seq_len, dtype="fp32"),
                micro_batch_size=global_batch // dp // num_micro_batches, num_micro_batches=num_micro_batches,
                pipeline=_pipeline(world, layers[0].devices, stages or ((0, n),), schedule), layers=layers)


def _pipeline(world: int, stage_size: int, stages, schedule: str) -> PipelineSpec:
    pp = world // stage_size
    return PipelineSpec(degree=pp, schedule=schedule, virtual_stages=len(stages) // pp, stages=tuple(stages))


def global_batches(config: TransformerConfig, steps: int = STEPS, seed: int = 1, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seqs = torch.randint(0, config.vocab_size, (GLOBAL_BATCH, seq + 1), generator=gen)
        out.append((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()))
    return out


_REFERENCE: dict = {}


def one_process_losses(config: TransformerConfig, optim: OptimConfig, batches) -> list[float]:
    """One process, plain model: the trainer's AdamW, LR schedule and clipping on `batches`, each
    (tokens, labels) or (tokens, labels, positions, mask)."""
    return train_one_process(build_model(config, seed=0), optim, batches)


def train_one_process(model, optim: OptimConfig, batches) -> list[float]:
    """AdamW steps of `model` on `batches` ((tokens, labels, *model inputs)), as the trainer steps
    (its optimizer, LR schedule and clipping); the loss of each step."""
    opt = build_optimizer(model.parameters(), optim)
    sched = build_scheduler(opt, optim)
    losses = []
    for tokens, labels, *extra in batches:
        loss = torch.nn.functional.cross_entropy(model(tokens, *extra).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        clip_grad_norm_(list(model.parameters()), optim.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def reference_losses(config: TransformerConfig, batches) -> list[float]:
    """Losses of a one-process run on the same global batches (same init, optimizer, clipping)."""
    key = (config.name, batches[0][0].shape[1])
    if key not in _REFERENCE:
        _REFERENCE[key] = one_process_losses(config, OPTIM, batches)
    return _REFERENCE[key]


_REFERENCE_MODEL: dict = {}


def reference_model_and_gradients(config: TransformerConfig, batch):
    """One process: the freshly initialised model and its gradients of the mean loss on `batch`."""
    key = (config.name, batch[0].shape[1])
    if key not in _REFERENCE_MODEL:
        model = build_model(config, seed=0)
        tokens, labels, *extra = batch
        loss = torch.nn.functional.cross_entropy(model(tokens, *extra).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        _REFERENCE_MODEL[key] = params, grads
    return _REFERENCE_MODEL[key]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().cpu()


def check_initial_weights(name: str, trainer: Trainer, config: TransformerConfig, batch) -> None:
    """Every local shard equals the matching slice of a one-process `build_model(config, 0)`, bit for bit."""
    params, _ = reference_model_and_gradients(config, batch)
    for n, p in trainer.named_parameters():
        if not torch.equal(_local(p), full_value_slice(params[n], p)):
            raise AssertionError(f"{name}: initial {n} differs from the one-process build")


def check_gradients(name: str, trainer: Trainer, config: TransformerConfig, batch, rtol: float) -> None:
    """Every parameter's local gradient shard equals the one-process gradient's slice:
    max |g - g_ref| <= rtol * max |g_ref| over the whole parameter (fp32 reduction-order noise).
    Gradients that are exactly zero in theory (GPT-2's key bias: softmax ignores a shift) are
    rounding noise; their scale is floored at 1e-3 of the largest gradient of the model."""
    _, grads = reference_model_and_gradients(config, batch)
    floor = 1e-3 * max(float(g.abs().max()) for g in grads.values())
    count = 0
    for n, p in trainer.named_parameters():
        if p.grad is None:
            raise AssertionError(f"{name}: {n} has no gradient")
        want = full_value_slice(grads[n], p.grad)
        err = float((_local(p.grad) - want).abs().max()) if want.numel() else 0.0
        scale = max(float(grads[n].abs().max()), floor)
        if err > rtol * scale:
            raise AssertionError(f"{name}: gradient of {n} off by {err:.3e} (max |grad| {scale:.3e})")
        count += 1
    if count == 0:
        raise AssertionError(f"{name}: this rank holds no parameter")


def run_plan(name: str, plan: Plan, config: TransformerConfig, batches, grad_rtol: float) -> list[float]:
    """Initial weights, the first step's gradients, then the losses of every step."""
    trainer = Trainer(TrainConfig(plan=plan, steps=STEPS, optim=OPTIM, seed=0))
    check_initial_weights(name, trainer, config, batches[0])
    tokens, labels = batches[0]
    losses = [trainer.compute_gradients(trainer.local_rows(tokens), trainer.local_rows(labels))]
    check_gradients(name, trainer, config, batches[0], grad_rtol)
    trainer.optimizer_step()
    losses += [trainer.train_step(trainer.local_rows(t), trainer.local_rows(l)) for t, l in batches[1:]]
    trainer.close()
    return losses


def check(name: str, plan: Plan, config: TransformerConfig, rtol: float = 1e-5, grad_rtol: float = 1e-5) -> None:
    batches = global_batches(config, seq=plan.workload.seq_len)
    want = reference_losses(config, batches)
    got = run_plan(name, plan, config, batches, grad_rtol)
    for step, (g, w) in enumerate(zip(got, want)):
        if abs(g - w) > rtol * abs(w):
            raise AssertionError(f"{name}: step {step} loss {g:.8f} != one-process {w:.8f}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


TRAIN_STEPS = 4


def reference_trained_losses(config: TransformerConfig) -> list[float]:
    """One process, `Trainer.train`'s synthetic batches, TRAIN_STEPS steps."""
    from tessera.runtime.trainer import SyntheticLoader

    optim = OptimConfig(**{**OPTIM.__dict__, "total_steps": TRAIN_STEPS})
    batches = (SyntheticLoader.global_batch_at(config.vocab_size, SEQ, GLOBAL_BATCH, 0, step)
               for step in range(TRAIN_STEPS))
    return one_process_losses(config, optim, batches)


def check_trained(name: str, plan: Plan, config: TransformerConfig, checkpoint_dir: str | None = None,
                  resume: str | None = None, rtol: float = 5e-5) -> None:
    """`Trainer.train()` (synthetic data, optional checkpoints / resume) matches one process.

    Four AdamW steps at lr 3e-3 amplify reduction-order rounding (2e-6 at step 3, ~1e-5 at step 4
    for a layer-wise plan), hence 5e-5 here; a wrong gradient or a lost optimizer state moves the
    loss by 1e-3 or more."""
    trainer = Trainer(TrainConfig(plan=plan, steps=TRAIN_STEPS, optim=OPTIM, seed=0, synthetic_data=True,
                                  checkpoint_dir=checkpoint_dir, checkpoint_every=2 if checkpoint_dir else 0,
                                  resume=resume))
    records = trainer.train()
    trainer.close()
    want = reference_trained_losses(config)
    first = TRAIN_STEPS - len(records)
    for r in records:
        w = want[r.step - 1]
        if abs(r.loss - w) > rtol * abs(w):
            raise AssertionError(f"{name}: step {r.step} loss {r.loss:.8f} != one-process {w:.8f}")
    assert [r.step for r in records] == list(range(first + 1, TRAIN_STEPS + 1)), [r.step for r in records]
    if resume is not None:
        assert first > 0, "resume did not skip the saved steps"
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)
