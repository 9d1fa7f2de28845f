"""Routing traces of tiny-moe trained here (one process, CPU), for benchmarks/moe.py.

Two recordings. The ones the README quotes ship in benchmarks/data/ (recorded on the CI-class
machine, torch 2.13 CPU) and are read first: the texts depend on the installed packages and the
training on the machine, so a trace recorded elsewhere routes differently (a v1 recorded again
on a later main bounded the cut at 11% where the first had 28%). Otherwise, and with --retrace,
they are recorded into the Tessera cache directory:
  v1  40 steps x 16 samples x 64 tokens of prose and Python, every step recorded (the first
      trace; its routing is still close to the random initialisation).
  v2  tiny-moe trained for `steps` steps (default 240) x 8 samples x 128 tokens on four kinds of
      text that ship with this Python environment: Shakespeare (the built-in corpus), the
      standard library's Python source, PyTorch's C++ headers and the reStructuredText
      documentation of the installed packages; the routing of the last 2/3 of the steps (160)
      is kept: trained long enough for experts to specialise.
A trace holds `tokens` (steps, N, S), `chosen` (steps, L, N, S, k) the experts of every MoE
layer, `kind` (steps, N) each sample's text kind, and `loss` (the training loss of every step).

    python benchmarks/moe_traces.py   # record v2 (long: seconds a step on one core)
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import numpy as np

KINDS_V2 = ("prose", "python", "c++", "rst")
# v2's length: 240 steps (about 2 s of CPU each), the routing of the last 160 kept.
V2_STEPS, V2_KEEP = 240, 160


def _texts(kind: str, limit_chars: int) -> list[str]:
    """Documents of one kind of text shipped with this environment, sorted by path, up to a size."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    site = Path(sysconfig.get_paths()["purelib"])
    files = {"python": sorted(stdlib.glob("*.py")), "c++": sorted(site.glob("torch/include/**/*.h")),
             "rst": sorted(site.glob("**/*.rst"))}[kind]
    docs, size = [], 0
    for f in files:
        text = f.read_text(errors="ignore")
        if len(text) < 200:
            continue
        docs.append(text)
        size += len(text)
        if size >= limit_chars:
            break
    return docs


def _streams(kinds) -> list[np.ndarray]:
    from tessera.runtime.data import shakespeare_stream
    from tessera.runtime.tokenizer import encode_documents

    out = []
    for kind in kinds:
        if kind == "prose":
            out.append(np.concatenate(shakespeare_stream().segments).astype(np.int64))
        else:
            out.append(encode_documents(_texts(kind, 3_000_000)).astype(np.int64))
    return out


def streams() -> list[np.ndarray]:
    """v2's four token streams (cached: tokenising takes a while)."""
    from tessera.runtime.data import cache_dir

    path = cache_dir() / "moe-trace-v2-streams.npz"
    if path.is_file():
        data = np.load(path)
        return [data[k].astype(np.int64) for k in KINDS_V2]  # stored as uint16 (GPT-2 ids < 65536)
    out = _streams(KINDS_V2)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **dict(zip(KINDS_V2, [s.astype(np.uint16) for s in out])))
    tmp.replace(path)
    return out


def layer_slots(trace: dict, experts: int = 4) -> np.ndarray:
    """(steps x layers, E) token-slots per expert of every step and layer."""
    chosen = trace["chosen"].astype(np.int64)
    flat = chosen.reshape(chosen.shape[0] * chosen.shape[1], -1)
    return np.stack([np.bincount(row, minlength=experts) for row in flat]).astype(float)


def _v1_streams() -> list[np.ndarray]:
    """The first trace's data: Shakespeare and the first 60 standard-library modules."""
    from tessera.runtime.data import shakespeare_stream
    from tessera.runtime.tokenizer import encode_documents

    prose = np.concatenate(shakespeare_stream().segments).astype(np.int64)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    code = encode_documents([f.read_text(errors="ignore") for f in files]).astype(np.int64)
    return [prose, code]


def record(path: Path, streams: list[np.ndarray], steps: int, keep: int, batch: int, seq: int,
           log_every: int = 25) -> dict:
    """Train tiny-moe on samples drawn evenly from `streams` (one kind per sample) and record the
    routing of the last `keep` steps."""
    import torch
    import torch.nn.functional as F

    from tessera.models.moe import moe_aux_loss, moe_layers
    from tessera.models.transformer import build_model
    from tessera.runtime.optim import OptimConfig, build_optimizer
    from tessera.spec.presets import get_model_config

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    cfg = get_model_config("tiny-moe")
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model.parameters(), OptimConfig(lr=2e-3, warmup_steps=5, total_steps=steps))
    layers = moe_layers(model)
    for m in layers:
        m.routing_log = []
    tokens, chosen, kinds, losses = [], [], [], []
    t0 = time.perf_counter()
    for step in range(steps):
        kind = rng.integers(0, len(streams), size=batch)
        rows = []
        for k in kind:
            s = int(rng.integers(0, len(streams[k]) - seq - 1))
            rows.append(streams[k][s:s + seq + 1])
        seqs = torch.as_tensor(np.stack(rows))
        loss = F.cross_entropy(model(seqs[:, :-1]).flatten(0, 1), seqs[:, 1:].flatten()) + moe_aux_loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        routing = np.stack([m.routing_log.pop().numpy() for m in layers])
        losses.append(loss.item())
        if step >= steps - keep:
            tokens.append(seqs[:, :-1].numpy())
            chosen.append(routing.astype(np.int8))
            kinds.append(kind)
        if step % log_every == 0 or step == steps - 1:
            print(f"  trace: step {step + 1}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    trace = dict(tokens=np.stack(tokens), chosen=np.stack(chosen), kind=np.stack(kinds), loss=np.array(losses))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **trace)
    tmp.replace(path)
    return trace


def v1_path() -> Path:
    from tessera.runtime.data import cache_dir

    return cache_dir() / "moe-trace-v1-tiny-moe-40x16x64.npz"


def v2_path(steps: int) -> Path:
    from tessera.runtime.data import cache_dir

    return cache_dir() / f"moe-trace-v2-tiny-moe-{steps}x8x128.npz"


SHIPPED = Path(__file__).resolve().parent / "data"


def load(version: int, steps: int, retrace: bool) -> dict | None:
    """The shipped trace, else the cached one (None when v2 is neither and `retrace` is off: it
    takes long)."""
    path = v1_path() if version == 1 else v2_path(steps)
    shipped = SHIPPED / path.name
    if shipped.is_file() and not retrace:
        print(f"routing trace v{version}: {shipped.relative_to(SHIPPED.parent.parent)} (shipped)")
        return dict(np.load(shipped))
    if path.is_file() and not retrace:
        print(f"routing trace v{version}: {path} (cached)")
        return dict(np.load(path))
    if version == 2 and not retrace:
        print(f"routing trace v2: not recorded ({path}); `python benchmarks/moe_traces.py --steps {steps}`")
        return None
    print(f"routing trace v{version}: training tiny-moe to record it ({path})")
    if version == 1:
        return record(path, _v1_streams(), 40, 40, 16, 64, log_every=10)
    return record(path, streams(), steps, V2_KEEP * steps // V2_STEPS, 8, 128)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=V2_STEPS)
    args = ap.parse_args()
    load(2, args.steps, retrace=True)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
