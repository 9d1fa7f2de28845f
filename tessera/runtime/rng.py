"""A rank's random number generators as tensors and numbers (saved in checkpoints, loaded with
`torch.load(weights_only=True)`): torch's CPU generator, every CUDA device's, numpy's global
MT19937 state and Python's `random`. Restored, the next draws are the ones an uninterrupted run
would have made."""
from __future__ import annotations

import random

import numpy as np
import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}
    version, internal, gauss_next = random.getstate()
    state["python"] = {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64),
                       "gauss_next": gauss_next}
    return state


def restore_rng_state(state: dict) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["gauss"]))
    if "python" in state:
        s = state["python"]
        random.setstate((s["version"], tuple(int(x) for x in s["state"].tolist()), s["gauss_next"]))
