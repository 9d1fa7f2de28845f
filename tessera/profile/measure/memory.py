"""Measure memory the way the cost model counts it: model states of the local shards + saved activations.

On a CPU there is no device allocator to ask for a peak (the process RSS mixes in the Python
heap, gloo buffers and freed-but-cached pages), so Tessera measures by instrumentation, on CPU
and GPU alike:

- model states (`model_state_bytes`): bytes of this rank's parameters, gradients and optimizer
  state tensors (the local shard of a DTensor / FSDP parameter, each storage counted once);
- activations (`SavedActivationMeter`): the peak over the step of the bytes autograd holds for
  backward — the unique storages of saved tensors, parameters and buffers excluded — counted live:
  a storage is added when first saved and removed when autograd frees the last tensor saved on it.
  The input that a checkpointed (recomputed) module keeps for its replay is counted too, for as
  long as the module's output graph lives.

On CUDA `torch.cuda.max_memory_allocated` is reported beside it as a cross-check.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding the data of `t` (inside a DTensor or another wrapper subclass)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain_tensors(getattr(t, n))]
    return [t]


def _storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage behind `t`, or None when it has none."""
    for x in _plain_tensors(t):
        try:
            s = x.untyped_storage()
            n = s.nbytes()
            if n:
                return s.data_ptr(), n
        except (RuntimeError, NotImplementedError):  # meta / fake / storage-less tensors
            continue
    return None


class _Saved:
    """What the pack hook stores: the tensor, and a reference that un-counts it when freed."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: "SavedActivationMeter", key: tuple[int, int] | None):
        self.tensor, self.meter, self.key = tensor, meter, key
        if key is not None:
            meter._acquire(key)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedActivationMeter:
    """Live and peak bytes of tensors saved for backward while `track()` is active.

    Parameters and buffers of `modules` are excluded (also the unsharded parameters FSDP
    materialises during forward: every module's parameters are looked up just before it runs).
    """

    def __init__(self, *modules: nn.Module):
        self.modules = [m for m in modules if m is not None]
        self.live_bytes = 0
        self.peak_bytes = 0
        self._refs: dict[int, list[int]] = {}  # data_ptr -> [count, nbytes]
        self._excluded: set[int] = set()

    # --- counting ----------------------------------------------------------------------------
    def _acquire(self, key: tuple[int, int]) -> None:
        ptr, n = key
        ref = self._refs.get(ptr)
        if ref is None:
            self._refs[ptr] = [1, n]
            self.live_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            ref[0] += 1

    def _release(self, key: tuple[int, int]) -> None:
        ref = self._refs.get(key[0])
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            self.live_bytes -= ref[1]
            del self._refs[key[0]]

    def _exclude_module(self, module: nn.Module, *_args) -> None:
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            key = _storage_key(t)
            if key is not None:
                self._excluded.add(key[0])

    def _pack(self, t: torch.Tensor):
        if isinstance(t, nn.Parameter):
            return t
        key = _storage_key(t)
        if key is not None and key[0] in self._excluded:
            return t
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _hold_checkpoint_input(self, module: nn.Module, args, output) -> None:
        """A recomputed module keeps its input for the replay: count it while its graph lives."""
        out = output[0] if isinstance(output, (tuple, list)) else output
        inp = args[0] if args else None
        if not isinstance(out, torch.Tensor) or out.grad_fn is None or not isinstance(inp, torch.Tensor):
            return
        out.grad_fn.metadata.setdefault("tessera_saved_input", []).append(_Saved(inp, self, _storage_key(inp)))

    # --- use -------------------------------------------------------------------------------------
    def reset(self) -> None:
        self.live_bytes = self.peak_bytes = 0
        self._refs.clear()

    @contextlib.contextmanager
    def track(self, reset: bool = True) -> Iterator["SavedActivationMeter"]:
        """Count saved activations of everything run inside (forward and backward)."""
        if reset:
            self.reset()
        self._excluded = set()
        handles = []
        for root in self.modules:
            for m in root.modules():
                self._exclude_module(m)
                handles.append(m.register_forward_pre_hook(self._exclude_module))
                if "checkpoint" in type(m).__name__.lower():
                    handles.append(m.register_forward_hook(self._hold_checkpoint_input))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in handles:
                h.remove()


def model_state_bytes(modules: Iterable[nn.Module], optimizers: Iterable[torch.optim.Optimizer] = ()
                      ) -> dict[str, float]:
    """{'params', 'grads', 'optimizer'}: bytes of this rank's local shards, each storage once."""
    seen: set[int] = set()

    def count(tensors: Iterable[torch.Tensor]) -> float:
        total = 0
        for t in tensors:
            key = _storage_key(t)
            if key is not None and key[0] not in seen:
                seen.add(key[0])
                total += key[1]
        return float(total)

    params = [p for m in modules for p in m.parameters()]
    out = {"params": count(params), "grads": count(p.grad for p in params if p.grad is not None)}
    states = []
    for opt in optimizers:
        for state in opt.state.values():
            states += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    out["optimizer"] = count(states)
    return out
