"""Wall time of a full `tessera.search.search` on the standard cases (this machine, one process).

Each case is searched `--repeat` times (default 3); the table shows every wall time and the CPU
time of the slowest run. The summary line gives the slowest wall time of the 7B cases and of all
the others (targets: under 1 s and under 3 s): `summary: max_7b_s=<s> max_rest_s=<s>`. On a shared
machine the wall time includes waiting for a CPU; the line before the summary gives CPU times.
Run: python benchmarks/search_speed.py [--repeat N]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tessera.search import search  # noqa: E402
from tessera.spec import Workload  # noqa: E402
from tessera.spec.presets import get_model, make_cluster  # noqa: E402

CASES = [  # (model, GPUs, global batch, sequence length, group)
    ("llama2-7b", 8, 512, 4096, "7b"),
    ("llama2-7b", 64, 512, 4096, "7b"),
    ("llama2-70b", 64, 1024, 4096, "rest"),
    ("llama2-70b", 1024, 1536, 4096, "rest"),
    ("gpt3-175b", 1024, 1536, 2048, "rest"),
    ("mixtral-8x7b", 64, 512, 4096, "rest"),
    ("llama3-405b", 16384, 16384, 8192, "rest"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="searches per case")
    args = parser.parse_args()
    table = Table(title=f"tessera search: full-search wall time ({args.repeat} runs per case)")
    for col in ("model", "GPUs", "batch x seq", "wall s (each run)", "cpu s", "plan", "step s", "MFU", "peak GiB"):
        table.add_column(col)
    worst: dict[str, float] = {}
    worst_cpu: dict[str, float] = {}
    for name, gpus, batch, seq, group in CASES:
        model, cluster = get_model(name), make_cluster("h100-80gb", gpus)
        walls, cpus = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = search(model, cluster, Workload(global_batch=batch, seq_len=seq))
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        worst[group] = max(worst.get(group, 0.0), *walls)
        worst_cpu[group] = max(worst_cpu.get(group, 0.0), *cpus)
        p = plan.prediction
        blocks = [s for s, layer in zip(plan.layers, model.layers) if layer.num_heads]
        common = max(set(blocks), key=blocks.count)
        summary = (f"pp{plan.pipeline.degree} {plan.pipeline.schedule.value}"
                   f"{'' if plan.pipeline.virtual_stages == 1 else f' v{plan.pipeline.virtual_stages}'}"
                   f" m{plan.num_micro_batches}x{plan.micro_batch_size} | {common.describe()}")
        table.add_row(name, str(gpus), f"{batch} x {seq}", " ".join(f"{w:.2f}" for w in walls), f"{max(cpus):.2f}",
                      summary, f"{p.step_time_s:.2f}", f"{p.mfu:.1%}", f"{p.peak_memory / 2**30:.1f}")
    Console(width=170).print(table)
    print(f"cpu: max_7b_cpu_s={worst_cpu['7b']:.2f} max_rest_cpu_s={worst_cpu['rest']:.2f} "
          f"(process time; the wall time includes waiting for a shared CPU)")
    print(f"summary: max_7b_s={worst['7b']:.2f} max_rest_s={worst['rest']:.2f}")


if __name__ == "__main__":
    main()
