"""Single-GPU throughput and MFU: Tessera's trainer against a plain PyTorch loop of the same model.

    python benchmarks/gpu_mfu.py [--models gpt2 llama-1b] [--steps 20] [--warmup 8] [--no-compile]
    python benchmarks/gpu_mfu.py --tiny     # CPU: tiny models, fp32, a few steps (what the test runs)

Per model, in one process on one device, one loop after the other (each built, warmed up, timed
and freed before the next, so that the larger model's two copies never share the device):
- baseline: `tessera.models.transformer.build_model` (same seed), `torch.autocast(bf16)` around
  forward and loss, cross-entropy on fp32 logits, backward, `torch.nn.utils.clip_grad_norm_(1.0)`,
  AdamW (`fused=True` on CUDA; decay on matrices only) with Tessera's warmup-cosine schedule,
  `zero_grad(set_to_none=True)`; each block `torch.compile`d unless `--no-compile`.
- tessera: a one-rank plan (dp=1, no ZeRO: the data-parallel path, the same autocast) run by
  `Trainer` with the same compile setting, stepped with `Trainer.run_step` (queued without a host
  wait, as `Trainer.train` steps).
Both take the same batches (random tokens, pinned host memory, copied asynchronously).

Timing: `--warmup` untimed steps (compilation, allocator, cuBLAS heuristics), then `--steps` timed
steps. On CUDA each step is the time between CUDA events recorded after consecutive steps (the
device's timeline: any wait for the host shows up in it), with `torch.cuda.synchronize()` before
the first and after the last; on CPU the wall time of each step. The table gives the median and
the range (min-max) of the timed steps, and every step's time is printed below it.

tokens/s = batch x seq / median step. MFU = 3 x F(s) x tokens/s / peak, F(s) the forward FLOPs per
token at sequence length s (`ModelSpec.flops_per_token`; PaLM appendix B: training = 3 x forward,
no recompute counted) and peak the detected GPU's dense bf16 rate in the cluster presets
(H100/H200/A100 by name and memory; the tiny mode divides by the fastest fp32 1024^3 matmul of a
few timed in the run, as `tessera profile hardware` takes a CPU's measured rate for its peak). Overhead = Tessera's median step / the baseline's - 1.
`host syncs/step`: on CUDA, synchronising calls counted by `torch.cuda.set_sync_debug_mode` over
the timed steps.

Ends with `summary: gpu=<name> mfu_124m=<x> mfu_1b=<y> overhead_pct_124m=<a> overhead_pct_1b=<b>`
(in the tiny mode the two slots are tiny-gpt2 and tiny-llama).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tessera.models.transformer import build_model  # noqa: E402
from tessera.runtime.optim import OptimConfig, implementation, lr_lambda, param_groups  # noqa: E402
from tessera.spec.model import ModelSpec  # noqa: E402
from tessera.spec.presets.clusters import DEVICES, local_cpu_cluster, make_cluster  # noqa: E402
from tessera.spec.presets.models import get_model_config  # noqa: E402
from tessera.spec.workload import Workload  # noqa: E402

# slot in the summary -> (model preset, sequences per step, sequence length)
GPU_MODELS = {"124m": ("gpt2", 16, 1024), "1b": ("llama-1b", 8, 2048)}
TINY_MODELS = {"124m": ("tiny-gpt2", 2, 64), "1b": ("tiny-llama", 2, 64)}
OPTIM = OptimConfig(lr=3e-4, warmup_steps=10, total_steps=10_000, grad_clip=1.0)


def detect_gpu(device: torch.device) -> tuple[str, str]:
    """(preset name, device name): the cluster preset of this GPU by name and memory, or the CPU's."""
    if device.type != "cuda":
        return "cpu", "cpu"
    name = torch.cuda.get_device_name(device)
    memory = torch.cuda.get_device_properties(device).total_memory
    lowered = name.lower()
    for family in ("h200", "h100", "a100"):
        if family in lowered:
            # By memory within the family (A100 40 GB and 80 GB); the closest preset.
            candidates = [k for k in DEVICES if k.startswith(family)]
            return min(candidates, key=lambda k: abs(DEVICES[k].memory_bytes - memory)), name
    raise SystemExit(f"no cluster preset for the GPU '{name}' (known: H100, H200, A100); "
                     "its peak FLOP/s is needed for MFU")


def cpu_matmul_rate(n: int = 1024, reps: int = 10) -> float:
    """FLOP/s of an n^3 fp32 matmul on this CPU, its fastest of `reps` (a peak is a best case; on
    a shared machine a median catches other jobs' load): the tiny mode's "peak"."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times)


def make_batches(vocab: int, batch: int, seq: int, count: int, pin: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        seqs = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        tokens, labels = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
        if pin:
            tokens, labels = tokens.pin_memory(), labels.pin_memory()
        out.append((tokens, labels))
    return out


def baseline_step(config, device: torch.device, dtype: str, compile_blocks: bool):
    """The plain loop's step function (see the module docstring)."""
    model = build_model(config, seed=0, device=device)
    if compile_blocks:
        for key, block in list(model.layers.items()):
            model.layers[key] = torch.compile(block)
    params = list(model.parameters())
    opt = torch.optim.AdamW(param_groups(params, OPTIM.weight_decay), lr=OPTIM.lr, betas=OPTIM.betas,
                            eps=OPTIM.eps, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(OPTIM))
    cast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else None

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        if cast is not None:
            with cast:
                logits = model(tokens)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        else:
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, OPTIM.grad_clip, foreach=True)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, (model, opt)


def tessera_step(spec: ModelSpec, cluster, batch: int, seq: int, dtype: str, compile_blocks: bool):
    """Tessera's step function: a one-rank plan run by the Trainer."""
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tessera.search.baselines import manual_plan

    plan = manual_plan(spec, cluster, Workload(global_batch=batch, seq_len=seq, dtype=dtype),
                       micro_batch_size=batch, name="gpu-mfu")
    trainer = Trainer(TrainConfig(plan=plan, steps=10**6, optim=OPTIM, seed=0, compile=compile_blocks))
    impl = implementation(trainer.params, OPTIM.fused)
    return trainer.run_step, trainer, plan, impl


@dataclass
class Timing:
    step_s: list[float]
    syncs_per_step: float | None
    peak_bytes: float | None
    loss: float

    @property
    def median(self) -> float:
        return statistics.median(self.step_s)


def time_loop(step, batches, warmup: int, steps: int, device: torch.device) -> Timing:
    """`warmup` untimed steps, then `steps` timed ones (see the module docstring)."""
    cuda = device.type == "cuda"
    loss = None
    for i in range(warmup):
        loss = step(*batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, syncs = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
            events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
            events[0].record()
            for i in range(steps):
                loss = step(*batches[(warmup + i) % len(batches)])
                events[i + 1].record()
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize(device)
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
            syncs = sum("synchroniz" in str(w.message).lower() for w in caught) / steps
        else:
            for i in range(steps):
                t0 = time.perf_counter()
                loss = step(*batches[(warmup + i) % len(batches)])
                times.append(time.perf_counter() - t0)
    peak = float(torch.cuda.max_memory_allocated(device)) if cuda else None
    return Timing(step_s=times, syncs_per_step=syncs, peak_bytes=peak, loss=float(loss))


def free(device: torch.device, *objects) -> None:
    del objects
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_model(slot: str, name: str, batch: int, seq: int, args, device: torch.device, gpu: str) -> dict:
    config = get_model_config(name)
    spec = ModelSpec.from_config(config)
    dtype = "fp32" if args.tiny else "bf16"
    cluster = local_cpu_cluster(1) if device.type == "cpu" else make_cluster(gpu, 1, 1)
    peak_key = dtype if device.type == "cuda" else "fp32"
    peak = cluster.device.peak_flops[peak_key] if device.type == "cuda" else args.cpu_peak
    train_flops = 3.0 * spec.flops_per_token(seq)
    tokens = batch * seq
    batches = make_batches(config.vocab_size, batch, seq, max(4, min(16, args.steps)), pin=device.type == "cuda")
    results: dict[str, Timing] = {}

    step, keep = baseline_step(config, device, dtype, args.compile)
    results["baseline"] = time_loop(step, batches, args.warmup, args.steps, device)
    free(device, step, keep)
    del step, keep

    step, trainer, plan, impl = tessera_step(spec, cluster, batch, seq, dtype, args.compile)
    results["tessera"] = time_loop(step, batches, args.warmup, args.steps, device)
    predicted = plan.prediction.step_time_s if plan.prediction else None
    trainer.close()
    free(device, step, trainer)
    del step, trainer

    base = results["baseline"].median
    overhead = 100.0 * (results["tessera"].median / base - 1.0)
    how = (f"{'bf16 autocast' if dtype == 'bf16' else 'fp32'}, "
           f"AdamW {'fused' if impl['fused'] else 'foreach' if impl['foreach'] else 'per-parameter'}, "
           f"{'compiled blocks' if args.compile else 'eager'}")
    print(f"\n{name} ({spec.num_params / 1e6:,.0f}M parameters): {batch} x {seq} tokens per step, {how}; "
          f"{args.warmup} warm-up + {args.steps} timed steps; peak {peak_key} {peak / 1e12:,.2f} TFLOP/s ({gpu})")
    print(f"{'loop':<10}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'tokens/s':>12}{'MFU':>8}"
          f"{'syncs/step':>12}{'peak GiB':>10}{'overhead':>10}")
    row = {}
    for loop, t in results.items():
        tps = tokens / t.median
        mfu = train_flops * tps / peak
        row[loop] = mfu
        syncs = f"{t.syncs_per_step:.1f}" if t.syncs_per_step is not None else "-"
        mem = f"{t.peak_bytes / 2**30:.1f}" if t.peak_bytes is not None else "-"
        extra = f"{overhead:+.1f}%" if loop == "tessera" else ""
        print(f"{loop:<10}{t.median * 1e3:>11.1f}{min(t.step_s) * 1e3:>9.1f}{max(t.step_s) * 1e3:>9.1f}"
              f"{tps:>12,.0f}{100 * mfu:>7.1f}%{syncs:>12}{mem:>10}{extra:>10}")
    for loop, t in results.items():
        print(f"  {loop} steps (ms): {' '.join(f'{s * 1e3:.1f}' for s in t.step_s)}; last loss {t.loss:.3f}")
    if predicted:
        print(f"  cost model's prediction for this plan: {predicted * 1e3:.1f} ms per step")
    return {"mfu": row["tessera"], "overhead": overhead}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny models, fp32, a few steps (tests)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per loop (default 20; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 8; tiny 1)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step for every model")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence for every model")
    parser.add_argument("--no-compile", dest="compile", action="store_false",
                        help="eager blocks (default on CUDA: each block torch.compile'd; tiny: eager)")
    parser.add_argument("--only", choices=("124m", "1b"), default=None, help="run one of the two models")
    args = parser.parse_args()
    if args.tiny:
        args.compile = False
    args.steps = args.steps or (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 8)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")

    if args.tiny:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        raise SystemExit("no CUDA device: run with --tiny for the CPU mode")
    gpu, device_name = detect_gpu(device)
    print(f"device: {device_name} (preset {gpu}); torch {torch.__version__}")
    args.cpu_peak = cpu_matmul_rate() if device.type == "cpu" else None
    if args.cpu_peak:
        print(f"CPU peak for MFU: the fastest of 10 fp32 1024^3 matmuls, {args.cpu_peak / 1e9:.1f} GFLOP/s")
    models = TINY_MODELS if args.tiny else GPU_MODELS
    out = {}
    for slot, (name, batch, seq) in models.items():
        if args.only and slot != args.only:
            continue
        out[slot] = run_model(slot, name, args.batch or batch, args.seq_len or seq, args, device, gpu)

    def fmt(slot: str, key: str, scale: float) -> str:
        return f"{scale * out[slot][key]:.1f}" if slot in out else "nan"

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    print(f"summary: gpu={gpu} mfu_124m={fmt('124m', 'mfu', 100)} mfu_1b={fmt('1b', 'mfu', 100)} "
          f"overhead_pct_124m={fmt('124m', 'overhead', 1)} overhead_pct_1b={fmt('1b', 'overhead', 1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
