"""Wall time of a full `tessera.search.search` on the standard cases (this machine, one process).

Prints a table and ends with `summary: max_7b_s=<s> max_large_s=<s>` (wall time of the worst 7B
case and of the worst 70B/175B case on 1,024 GPUs); the line before gives the same in CPU time. Run: python benchmarks/search_speed.py
"""
from __future__ import annotations

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
    ("llama2-70b", 64, 1024, 4096, "70b"),
    ("llama2-70b", 1024, 1536, 4096, "large"),
    ("gpt3-175b", 1024, 1536, 2048, "large"),
    ("mixtral-8x7b", 64, 512, 4096, "moe"),
]


def main() -> None:
    table = Table(title="tessera search: full-search wall time")
    for col in ("model", "GPUs", "batch x seq", "wall s", "cpu s", "plan", "step s", "MFU", "peak GiB"):
        table.add_column(col)
    worst: dict[str, float] = {}
    worst_cpu: dict[str, float] = {}
    for name, gpus, batch, seq, group in CASES:
        model, cluster = get_model(name), make_cluster("h100-80gb", gpus)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = search(model, cluster, Workload(global_batch=batch, seq_len=seq))
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        worst[group] = max(worst.get(group, 0.0), dt)
        worst_cpu[group] = max(worst_cpu.get(group, 0.0), cpu)
        p = plan.prediction
        blocks = [s for s, layer in zip(plan.layers, model.layers) if layer.num_heads]
        common = max(set(blocks), key=blocks.count)
        summary = (f"pp{plan.pipeline.degree} {plan.pipeline.schedule.value}"
                   f"{'' if plan.pipeline.virtual_stages == 1 else f' v{plan.pipeline.virtual_stages}'}"
                   f" m{plan.num_micro_batches}x{plan.micro_batch_size} | {common.describe()}")
        table.add_row(name, str(gpus), f"{batch} x {seq}", f"{dt:.2f}", f"{cpu:.2f}", summary, f"{p.step_time_s:.2f}",
                      f"{p.mfu:.1%}", f"{p.peak_memory / 2**30:.1f}")
    Console(width=160).print(table)
    print(f"cpu: max_7b_cpu_s={worst_cpu['7b']:.2f} max_large_cpu_s={worst_cpu['large']:.2f} "
          f"(process time; the wall time includes waiting for a shared CPU)")
    print(f"summary: max_7b_s={worst['7b']:.2f} max_large_s={worst['large']:.2f}")


if __name__ == "__main__":
    main()
