"""Document attention without dense masks: speed against the dense mask, and a 32K-token window.

1. Speed: forward + backward of a tiny LLaMA (2 blocks, hidden 64, 4 heads, 2 kv heads) on packed
   rows, with the document attention this device uses (`Documents`, backend chosen by device) and
   with the dense (B, 1, S, S) mask reference, for several window lengths and two document-length
   mixes: "wiki" (log-normal, median 347 tokens like Wikipedia articles) and "short" (8..64 tokens:
   the many-short-documents case). Fastest of `--repeats` runs of each, taken in turns.
2. Window: one training step (the `Trainer`, one rank) of the same model at `--window` tokens
   (default 32768) with a few documents per row; prints the step time and the growth of the
   process's peak resident memory during the step, beside what a dense mask alone would take
   (S^2 bytes per row) and SDPA's dense scores on top (B * H * S^2 * 4 bytes).

    python benchmarks/doc_attention.py [--seq-lens 1024 2048 4096] [--window 32768]
    python benchmarks/doc_attention.py --window-only   # just part 2 (run by a test)

Ends with `summary: speedup_vs_dense=<x> window_tokens=<n> window_step_s=<s> window_peak_growth_mib=<m>`
(speedup: geometric mean over the table). Timings on a shared machine are disturbed by its load.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tessera.models.attention import Documents  # noqa: E402
from tessera.models.transformer import build_model  # noqa: E402
from tessera.spec.model import TransformerConfig  # noqa: E402

VOCAB = 512


def tiny_llama(seq_len: int) -> TransformerConfig:
    return TransformerConfig(name="doc-attention-llama", vocab_size=VOCAB, hidden=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, ffn_hidden=96, max_seq_len=seq_len)


def packed_rows(rows: int, seq_len: int, mix: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, doc_ids) of `rows` windows filled with documents of the given length mix."""
    rng = np.random.default_rng(seed)
    doc_ids = np.empty((rows, seq_len), dtype=np.int64)
    for r in range(rows):
        lens, total = [], 0
        while total < seq_len:
            n = int(rng.integers(8, 65)) if mix == "short" else max(1, int(rng.lognormal(np.log(347), 1.2)))
            lens.append(min(n, seq_len - total))
            total += lens[-1]
        doc_ids[r] = np.repeat(np.arange(len(lens)), lens)
    ids = torch.from_numpy(doc_ids)
    idx = torch.arange(seq_len).expand(rows, -1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    positions = idx - torch.cummax(torch.where(starts, idx, 0), dim=1).values
    return positions, ids


def time_steps(model, tokens, positions, makers, repeats: int) -> list[float]:
    """Fastest of `repeats` forward + backward runs with each `Documents` maker, taken in turns so
    that a burst of load on a shared machine hits both alike."""
    times = [[] for _ in makers]
    for _ in range(repeats):
        for slot, make_docs in enumerate(makers):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            logits = model(tokens, positions, make_docs())  # the Documents is built inside the timing
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
            times[slot].append(time.perf_counter() - start)
    return [min(t) for t in times]


def speed_table(seq_lens: list[int], rows: int, repeats: int) -> list[tuple]:
    out = []
    for seq_len in seq_lens:
        model = build_model(tiny_llama(seq_len), seed=0)
        tokens = torch.randint(0, VOCAB, (rows, seq_len), generator=torch.Generator().manual_seed(1))
        for mix in ("wiki", "short"):
            positions, ids = packed_rows(rows, seq_len, mix)
            docs = int(ids[:, -1].sum()) + rows
            fast, dense = time_steps(model, tokens, positions,
                                     [lambda: Documents(ids), lambda: Documents(ids, backend="dense")], repeats)
            out.append((seq_len, mix, docs, Documents(ids).backend, fast, dense))
    return out


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def train_window(seq_len: int, rows: int = 1) -> dict:
    """One Trainer step of the tiny LLaMA on `rows` windows of `seq_len` tokens, 5 documents each
    (1/2, 1/4, 1/8, 1/16, 1/16 of the window). Returns the step time and peak-memory growth."""
    from tessera.runtime.trainer import TrainConfig, Trainer
    from tessera.search.baselines import manual_plan
    from tessera.spec.model import ModelSpec
    from tessera.spec.presets.clusters import local_cpu_cluster
    from tessera.spec.workload import Workload

    config = tiny_llama(seq_len)
    plan = manual_plan(ModelSpec.from_config(config), local_cpu_cluster(1),
                       Workload(global_batch=rows, seq_len=seq_len, dtype="fp32"))
    trainer = Trainer(TrainConfig(plan=plan, steps=1, synthetic_data=True))
    lens = torch.tensor([seq_len // 2, seq_len // 4, seq_len // 8, seq_len // 16])
    lens = torch.cat([lens, (seq_len - lens.sum()).reshape(1)])
    doc_ids = torch.repeat_interleave(torch.arange(len(lens)), lens).expand(rows, -1)
    positions = torch.arange(seq_len) - (torch.cumsum(lens, 0) - lens)[doc_ids]
    seqs = torch.randint(0, VOCAB, (rows, seq_len + 1), generator=torch.Generator().manual_seed(2))
    before = peak_rss_bytes()
    start = time.perf_counter()
    loss = trainer.train_step(seqs[:, :-1], seqs[:, 1:], positions, doc_ids)
    elapsed = time.perf_counter() - start
    growth = peak_rss_bytes() - before
    trainer.close()
    return {"tokens": seq_len, "rows": rows, "docs_per_row": len(lens), "step_s": elapsed, "loss": loss,
            "peak_growth_mib": growth / 2**20, "dense_mask_gib": rows * seq_len**2 / 2**30,
            "dense_scores_gib": rows * config.num_heads * seq_len**2 * 4 / 2**30}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window", type=int, default=32768)
    parser.add_argument("--window-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    w = train_window(args.window)  # first: the peak-memory growth is the step's, not the table's
    if not args.window_only:
        table = speed_table(args.seq_lens, args.rows, args.repeats)
        print(f"{'seq':>6} {'mix':>6} {'docs':>5} {'backend':>8} {'docs s':>8} {'dense s':>8} {'speedup':>8}")
        for seq_len, mix, docs, backend, fast, dense in table:
            print(f"{seq_len:>6} {mix:>6} {docs:>5} {backend:>8} {fast:>8.3f} {dense:>8.3f} {dense / fast:>8.2f}")
    print(f"window: {w['tokens']} tokens x {w['rows']} row, {w['docs_per_row']} documents: one training step "
          f"{w['step_s']:.2f} s, loss {w['loss']:.4f}, peak memory grew {w['peak_growth_mib']:.0f} MiB "
          f"(a dense mask alone: {w['dense_mask_gib']:.1f} GiB; SDPA's dense scores: {w['dense_scores_gib']:.1f} GiB)")
    speedup = "n/a" if args.window_only else f"{np.exp(np.mean([np.log(d / f) for *_, f, d in table])):.2f}"
    print(f"summary: speedup_vs_dense={speedup} window_tokens={w['tokens']} window_step_s={w['step_s']:.2f} "
          f"window_peak_growth_mib={w['peak_growth_mib']:.0f}", flush=True)


if __name__ == "__main__":
    main()
