"""`tessera profile hardware|model`: measure this machine or a model, write a profile JSON.

    torchrun --nproc-per-node 8 -m tessera profile hardware -o cluster.json
    torchrun --nproc-per-node 8 -m tessera profile model --model llama2-7b -o model-profile.json

Every rank measures; rank 0 shows the progress and writes the file atomically (an interrupted
profile leaves the previous file, or none, never half of one).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from ..errors import TesseraError
from ..profile.fit import STATISTICS

STATISTIC_HELP = "summary of repeated timings (default: median; see tessera.profile.fit.STATISTICS)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    hw = sub.add_parser("hardware", help="collective curves, matmul FLOP/s, overlap -> cluster JSON")
    hw.add_argument("-o", "--out", dest="output", default="cluster.json",
                    help="where to write the ClusterSpec JSON (default: cluster.json)")
    hw.add_argument("--output", dest="output", help=argparse.SUPPRESS)  # the earlier name
    hw.add_argument("--min-bytes", type=_size, default=4 * 1024, help="smallest message (e.g. 4K; default 4K)")
    hw.add_argument("--max-bytes", type=_size, default=None,
                    help="largest message (default 16M on CPU, 1G on CUDA)")
    hw.add_argument("--reps", type=int, default=5, help="timed repetitions per point (default 5)")
    hw.add_argument("--matmul-size", type=int, default=None, help="side of the square matmuls")
    hw.add_argument("--dtypes", default=None, help="comma-separated matmul dtypes (default per device)")
    hw.add_argument("--collectives", default=None, help="comma-separated subset of the collectives")
    hw.add_argument("--name", default=None, help="cluster name written in the profile")
    hw.add_argument("--statistic", choices=tuple(STATISTICS), default="median", help=STATISTIC_HELP)
    m = sub.add_parser("model", help="per-layer time and activation memory, fitted scales -> model profile JSON")
    m.add_argument("--model", required=True, help="preset name or a model config JSON")
    m.add_argument("-o", "--out", dest="output", default="model-profile.json",
                   help="where to write the model profile JSON (default: model-profile.json)")
    m.add_argument("--output", dest="output", help=argparse.SUPPRESS)  # the earlier name
    m.add_argument("--sizes", default=None, help="batch x seq sizes, e.g. 1x128,2x128,1x256")
    m.add_argument("--reps", type=int, default=3, help="timed repetitions per size (default 3)")
    m.add_argument("--dtype", default=None, help="fp32 / bf16 / fp16 (default: bf16 on CUDA, fp32 on CPU)")
    m.add_argument("--statistic", choices=tuple(STATISTICS), default="median", help=STATISTIC_HELP)
    m.add_argument("--window", type=_seconds, default=0.0, metavar="SECONDS",
                   help="each timing averages as many runs in a row as fill this many seconds (default 0: "
                        "one run); on a machine shared with other jobs, about a training step's length")
    m.add_argument("--cluster", default=None,
                   help="cluster profile whose achieved FLOP/s the scales refer to (default: measured here)")


def _size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("B")
    try:
        return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size such as 4096, 4K, 16M or 1G") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds >= 0")
    return value


def _parse_sizes(text: str | None) -> list[tuple[int, int]] | None:
    if not text:
        return None
    out = []
    for part in text.split(","):
        try:
            b, s = part.lower().split("x")
            out.append((int(b), int(s)))
        except ValueError:
            raise TesseraError(f"size '{part}' is not BATCHxSEQ (e.g. 2x128)") from None
    return out


def resolve_model(name: str):
    """A preset name, or a JSON file holding a ModelSpec or a TransformerConfig."""
    from ..spec.model import ModelSpec, TransformerConfig
    from ..spec.presets import get_model

    path = Path(name)
    if path.suffix == ".json" and path.is_file():
        data = json.loads(path.read_text())
        if "layers" in data:
            return ModelSpec.model_validate(data)
        return ModelSpec.from_config(TransformerConfig.model_validate(data))
    return get_model(name)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Bar:
    """A rich progress bar on rank 0 (nothing on the other ranks)."""

    def __init__(self, total: int, title: str):
        self.progress = None
        if _rank() == 0:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description:<36}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn())
            self.task = self.progress.add_task(title, total=total)

    def __enter__(self):
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc):
        if self.progress:
            self.progress.stop()

    def __call__(self, what: str, done: int) -> None:
        if self.progress:
            self.progress.update(self.task, advance=done, description=what)


def _terminate_as_interrupt(*_):
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    # torchrun stops workers with SIGTERM: turn it into KeyboardInterrupt so clean-up runs.
    signal.signal(signal.SIGTERM, _terminate_as_interrupt)
    out = Path(args.output)
    if not out.parent.exists():
        raise TesseraError(f"output folder {out.parent} does not exist")
    return _hardware(args) if args.what == "hardware" else _model(args)


def _hardware(args) -> int:
    import torch.distributed as dist

    from ..profile.apply import write_atomic
    from ..profile.measure.hardware import HardwareOptions, detect_environment, planned_units, profile_hardware

    opts = HardwareOptions(min_bytes=args.min_bytes, max_bytes=args.max_bytes, reps=args.reps,
                           matmul_size=args.matmul_size, name=args.name, statistic=args.statistic,
                           dtypes=args.dtypes.split(",") if args.dtypes else None)
    if args.collectives:
        opts.collectives = tuple(args.collectives.split(","))
    env = detect_environment()
    if env.rank == 0:
        print(f"profiling {env.world} ranks on {env.device.type} ({env.backend}): "
              f"{planned_units(env, opts)} measurements", flush=True)
    try:
        with _Bar(planned_units(env, opts), "hardware") as bar:
            cluster = profile_hardware(opts, progress=bar, env=env)
        if env.rank == 0:
            write_atomic(args.output, cluster.model_dump_json(indent=1))
            _print_cluster(cluster, args.output)
    finally:
        dist.destroy_process_group()
    return 0


def _model(args) -> int:
    import torch
    import torch.distributed as dist

    from ..profile.apply import load_cluster_profile, write_atomic
    from ..profile.measure.model import planned_units, profile_model

    spec = resolve_model(args.model)
    sizes = _parse_sizes(args.sizes)
    if not torch.cuda.is_available():  # refused in one line before the allocator fails
        from ..runtime.machine import check_model_fits_host

        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check_model_fits_host(spec, ranks, "profile", 2 if args.dtype in ("bf16", "fp16") else 4)
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    reference = None
    if args.cluster:
        cluster = load_cluster_profile(args.cluster)
        dtype = args.dtype or ("bf16" if torch.cuda.is_available() else "fp32")
        reference = cluster.peak(dtype) * cluster.compute_efficiency
    try:
        with _Bar(planned_units(spec, dist.get_world_size() if dist.is_initialized() else 1, args.reps),
                  f"model {spec.name}") as bar:
            profile = profile_model(spec, sizes=sizes, reps=args.reps, dtype=args.dtype,
                                    reference_flops=reference, progress=bar, statistic=args.statistic,
                                    window_s=args.window)
        if _rank() == 0:
            write_atomic(args.output, profile.model_dump_json(indent=1))
            _print_model(profile, args.output)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _print_cluster(cluster, path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{cluster.name} -> {path}")
    t.add_column("what")
    t.add_column("value", justify="right")
    for dtype, peak in sorted(cluster.device.peak_flops.items()):
        t.add_row(f"matmul {dtype}", f"{peak * cluster.compute_efficiency / 1e12:.3f} TFLOP/s")
    t.add_row("compute efficiency", f"{cluster.compute_efficiency:.2f}")
    t.add_row("intra-node link", f"{cluster.intra_node.bandwidth / 1e9:.2f} GB/s, {cluster.intra_node.latency * 1e6:.1f} us")
    if cluster.num_nodes > 1:
        t.add_row("inter-node link", f"{cluster.inter_node.bandwidth / 1e9:.2f} GB/s, {cluster.inter_node.latency * 1e6:.1f} us")
    t.add_row("overlap slowdown", f"{cluster.overlap_slowdown:.2f}x")
    t.add_row("memory bandwidth", f"{cluster.device.memory_bandwidth / 1e9:.1f} GB/s")
    t.add_row("device memory", f"{cluster.device.memory_bytes / 2**30:.1f} GiB")
    t.add_row("collective curves", str(len(cluster.collectives)))
    Console().print(t)


def _print_model(profile, path) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{profile.model} on {profile.device} ({profile.dtype}) -> {path}",
              caption="call, tp, sp, z3: ms per forward + backward; call always, the others when run tensor parallel, "
                      "Ulysses, ZeRO-3; tp, sp +x%: their compute runs x% slower than its share")
    for col in ("layer", "lin x", "attn x", "call", "tp", "sp", "z3", "R²", "max err", "act B/tok", "bwd/fwd"):
        t.add_column(col, justify="right", no_wrap=col == "layer")
    ms = lambda x: "-" if x is None else f"{x * 1e3:.2f}"  # noqa: E731
    slow = lambda x, f: ms(x) if not f else f"{ms(x)} +{f:.0%}"  # noqa: E731
    for k in profile.layers:
        t.add_row(k.layer, f"{k.linear_time_scale:.2f}", f"{k.attn_time_scale:.2f}",
                  f"{k.overhead_s * 1e3:.2f}", slow(k.tp_overhead_s, k.tp_slowdown),
                  slow(k.sp_overhead_s, k.sp_slowdown), ms(k.zero3_overhead_s),
                  f"{k.fit_r2:.3f}", f"{k.fit_max_rel_err:.0%}", f"{k.activation_bytes_per_token:,.0f}",
                  f"{k.backward_over_forward:.2f}")
    Console().print(t)
    for k in profile.layers:
        for w in k.tp_wider:
            print(f"{k.layer} at tp={w.degree}: {slow(w.overhead_s, w.slowdown)} ms per forward + backward")
    print(f"reference matmul rate: {profile.reference_flops / 1e9:.1f} GFLOP/s per rank")
