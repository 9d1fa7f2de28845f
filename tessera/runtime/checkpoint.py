"""Distributed checkpoints that reshard, written atomically and verified on load.

Model and optimizer state go through `torch.distributed.checkpoint` (DCP) with the state-dict
helpers of `torch.distributed.checkpoint.state_dict`: every tensor is saved under the fully
qualified name it has in the full model (FSDP2 shards and TP DTensors are described by their
global shape and offsets, pipeline chunks keep the full model's names), so a checkpoint written
under one plan and world size loads under any other. Optimizer state is saved flattened
(`state.<param fqn>.<key>`, `param_groups.<param fqn>.<key>`), so the states of several pipeline
chunks merge into one dictionary.

`extra_state` (LR scheduler, data position, RNG states, step...) is saved per rank with
`torch.save` as `extra/rank-<r>.pt`; on load rank r gets the dictionary rank r saved, or rank 0's
when the checkpoint was written by fewer ranks. It holds tensors, numbers, strings, lists and
dictionaries only, and is read with `torch.load(weights_only=True)`; the DCP metadata and values
go through `safe_dcp` (nothing in a checkpoint is unpickled as an arbitrary object).

Layout of a directory:
    step-20/            a complete checkpoint: DCP files, extra/, manifest.json
    step-30.tmp/        being written (or left by a crash: never loaded, removed by the next save)
A save writes into `step-N.tmp/`; after every rank has finished (barrier), the ranks hash the files
(each a share), rank 0 writes `manifest.json` (file sizes and SHA-256) and renames the directory
to `step-N/`. A crash at any point leaves no `step-N/` without a manifest. `load` checks every
file against the manifest before touching the model and refuses a mismatch in one sentence;
`latest_valid` walks back from the newest checkpoint to the first that passes that check.

Asynchronous saves (`async_save=True`): the state is staged and DCP writes it in a background
thread; a finisher thread then waits for the write and does the barrier, hashing, manifest and
rename on a dedicated gloo group, so training goes on through all of it. The next `save`, `load`
or `wait` joins it.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TesseraError
from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_HASH_CHUNK = 1 << 22


# --- process-group helpers (all of them no-ops in a single process) ----------------------------


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _world() -> int:
    return dist.get_world_size() if _dist() else 1


def _barrier(group=None) -> None:
    if _dist():
        dist.barrier(group=group)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every call without a process group; a single process is what we mean then."""
    with warnings.catch_warnings():
        if not _dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _no_dist_kwarg(fn) -> dict:
    """`no_dist=True` in a single process, where the DCP function takes it (older ones infer it)."""
    import inspect

    return {"no_dist": not _dist()} if "no_dist" in inspect.signature(fn).parameters else {}


def _save_planner():
    """DCP's default save planner, reusing the global plan while no rank's local plan changed.

    Without it every save gathers each rank's plan (hundreds of items: optimizer state is saved
    flattened, hyperparameters per parameter) to rank 0, which deduplicates the replicated ones and
    scatters the result back: on 4 CPU ranks of a 4M-parameter model, a third of a save's CPU time
    on rank 0, and O(world) there however large the job. With caching a rank whose items are the
    same as at its last save sends an empty plan and all reuse the cached global plan; a rank whose
    state changed (another plan after a re-plan) sends its new plan and the global plan is rebuilt."""
    import inspect

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    if "enable_plan_caching" in inspect.signature(DefaultSavePlanner.__init__).parameters:
        return DefaultSavePlanner(enable_plan_caching=True)
    return DefaultSavePlanner()


def _all_gather(obj, group=None) -> list:
    if not _dist():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --- state dictionaries -----------------------------------------------------------------------


def _plain_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1 (`ZeroRedundancyOptimizer`) keeps this rank's share of the state in `.optim`, a plain
    optimizer over the parameters this rank owns: saving that share under the parameters' names
    from every rank stores each state once, and loading asks each rank for the share it now owns."""
    # By name: importing torch.distributed.optim costs seconds (TorchScript) for nothing otherwise.
    zero1 = any(c.__name__ == "ZeroRedundancyOptimizer" for c in type(opt).__mro__)
    return opt.optim if zero1 else opt


def _sync_zero1_hyperparameters(optimizers, to_outer: bool) -> None:
    """ZeRO-1 copies LR etc. from its outer param groups (which the LR scheduler writes) to the
    inner optimizer only when it steps: sync inner from outer before saving, outer from inner
    after loading."""
    for opt in [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers or []:
        inner = _plain_optimizer(opt)
        if inner is opt or len(inner.param_groups) != len(opt.param_groups):
            continue
        pairs = zip(inner.param_groups, opt.param_groups) if to_outer else zip(opt.param_groups, inner.param_groups)
        for src, dst in pairs:
            dst.update({k: v for k, v in src.items() if k != "params"})


class _PartsView(nn.Module):
    """One module over several pipeline chunks of a rank, with the full model's names, so that a
    single optimizer over all chunks maps every parameter to its name."""

    def __init__(self, model_parts: Sequence[nn.Module]):
        super().__init__()
        for part in model_parts:
            for name, child in part.named_children():
                if isinstance(child, nn.ModuleDict) and isinstance(getattr(self, name, None), nn.ModuleDict):
                    getattr(self, name).update(child)
                elif name in self._modules and self._modules[name] is not child:
                    raise TesseraError(f"two model parts both hold '{name}'")
                else:
                    self.add_module(name, child if not isinstance(child, nn.ModuleDict) else nn.ModuleDict(child))


def _pair(model_parts: Sequence[nn.Module], optimizers) -> list[tuple[nn.Module, torch.optim.Optimizer]]:
    """(module, optimizer) pairs whose parameters match: one optimizer per part, or one for all."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = [_plain_optimizer(o) for o in (optimizers or [])]
    if not optimizers:
        return []
    if len(optimizers) == len(model_parts):
        return list(zip(model_parts, optimizers))
    if len(optimizers) == 1:
        return [(_PartsView(model_parts), optimizers[0])]
    raise TesseraError(f"checkpoint needs one optimizer per model part or one for all: got {len(optimizers)} "
                       f"optimizers for {len(model_parts)} parts")


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _model_states(model_parts) -> list[dict]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return [get_model_state_dict(part) for part in model_parts]


def _optim_states(pairs) -> list[dict]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return [get_optimizer_state_dict(part, opt, options=_options()) for part, opt in pairs]


def _tied_aliases(part: nn.Module) -> dict[str, list[str]]:
    """First name -> other names of each parameter reachable under several names (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, p in part.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {n[0]: n[1:] for n in names.values() if len(n) > 1}


def _with_tied_aliases(part: nn.Module, flat_optim: dict) -> dict:
    """Also store a tied parameter's optimizer state under its other names.

    The optimizer knows a tied weight once (as `tok_embeddings.weight`); a pipeline that unties
    it asks for `output.weight` on the last stage, so the checkpoint carries both."""
    out = dict(flat_optim)
    for primary, aliases in _tied_aliases(part).items():
        for prefix in ("state.", "param_groups."):
            head = f"{prefix}{primary}."
            for key, value in flat_optim.items():
                if key.startswith(head):
                    for alias in aliases:
                        out[f"{prefix}{alias}.{key[len(head):]}"] = value
    return out


def _first_failure(e: BaseException) -> str:
    """One line from a DCP failure (a CheckpointException wraps one exception per rank)."""
    failures = getattr(e, "failures", None)
    if failures:
        wrapped = next(iter(failures.values()))
        e = getattr(wrapped, "exception", wrapped)
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _merge(states: list[dict]) -> dict:
    merged: dict = {}
    for s in states:
        merged.update(s)
    return merged


# --- files, hashes, manifest ------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_CHUNK):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _problem(ckpt: Path, rel: str, entry: dict) -> str | None:
    """What is wrong with one file of a checkpoint, or None."""
    path = ckpt / rel
    if not path.is_file():
        return f"file {rel} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"file {rel} has {size} bytes, manifest says {entry['bytes']}"
    if _sha256(path) != entry["sha256"]:
        return f"file {rel} does not match its checksum in the manifest"
    return None


def read_manifest(ckpt: str | Path) -> dict:
    """The manifest of checkpoint `ckpt`; a TesseraError if it is missing or unreadable."""
    ckpt = Path(ckpt)
    path = ckpt / MANIFEST
    if not path.is_file():
        raise TesseraError(f"checkpoint {ckpt} is corrupt: {MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_text())
        manifest["files"], manifest["step"]  # noqa: B018 - the keys every manifest has
    except (ValueError, KeyError, TypeError):
        raise TesseraError(f"checkpoint {ckpt} is corrupt: {MANIFEST} is not a valid manifest") from None
    return manifest


def verify(ckpt: str | Path) -> dict:
    """Check every file of `ckpt` against its manifest (the ranks share the hashing).

    Returns the manifest; raises the same one-line TesseraError on every rank otherwise."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        error = f"checkpoint {ckpt} does not exist"
        manifest = None
    else:
        try:
            manifest, error = read_manifest(ckpt), None
        except TesseraError as e:
            manifest, error = None, str(e)
    problems = []
    if manifest is not None:
        names = sorted(manifest["files"])
        for rel in names[_rank()::_world()]:
            if (p := _problem(ckpt, rel, manifest["files"][rel])) is not None:
                problems.append(p)
    found = [e for e in _all_gather(error or (problems[0] if problems else None)) if e]
    if found:
        first = found[0]
        raise TesseraError(first if first.startswith("checkpoint ") else f"checkpoint {ckpt} is corrupt: {first}")
    return manifest


class CheckpointManager:
    """Saves and loads resharding checkpoints under `directory` (see the module docstring).

    `keep`: complete checkpoints kept (older ones are deleted after a successful save; 0 keeps all).
    `async_save`: write the DCP files in a background thread (on a dedicated gloo group) and
    finish the checkpoint (manifest, rename) at the next `save`, `load` or `wait`. Creating the
    manager is collective when `async_save` is set. `model_files` (relative path -> bytes: the model
    config and tokenizer, `runtime/export.py`) are written by rank 0 into every checkpoint, under the
    manifest like the rest."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False,
                 model_files: dict[str, bytes] | None = None):
        self.directory = Path(directory)
        self.keep = keep
        self.async_save = async_save
        self.model_files = dict(model_files or {})
        self._pending: _Finisher | None = None  # an async save in flight
        self._async_group = dist.new_group(backend="gloo") if async_save and _dist() else None

    # --- discovery ----------------------------------------------------------------------------
    def checkpoints(self) -> list[Path]:
        """Finished checkpoint directories (`step-N`), oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir()
                 if p.is_dir() and (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest finished checkpoint, or None. Leftover `.tmp` directories are never chosen."""
        found = self.checkpoints()
        return found[-1] if found else None

    def latest_valid(self) -> Path | None:
        """The newest checkpoint whose files match its manifest (collective: `verify`), walking back
        past any that do not (each one logged); None when there is none."""
        self.wait()
        for path in reversed(self.checkpoints()):
            try:
                verify(path)
                return path
            except TesseraError as e:
                logger.warning("%s; falling back to the checkpoint before it", e)
        return None

    # --- save ---------------------------------------------------------------------------------
    def save(self, step: int, model_parts: Sequence[nn.Module], optimizers, extra_state: dict | None = None) -> Path:
        """Save a checkpoint of `step` (collective: every rank calls it). Returns its final path."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final = self.directory / f"step-{step}"
        tmp = self.directory / f"step-{step}.tmp"
        if _rank() == 0:
            if tmp.exists():
                logger.warning("removing %s left by an interrupted save", tmp)
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            for rel, content in self.model_files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(content)
        _barrier()
        _sync_zero1_hyperparameters(optimizers, to_outer=False)
        pairs = _pair(model_parts, optimizers)
        optim = [_with_tied_aliases(part, o) for (part, _), o in zip(pairs, _optim_states(pairs))]
        state = {"model": _merge(_model_states(model_parts)), "optim": _merge(optim)}
        extra_dir = tmp / "extra"
        extra_dir.mkdir(exist_ok=True)
        torch.save(copy.deepcopy(extra_state or {}), extra_dir / f"rank-{_rank():05d}.pt")
        if self.async_save:
            with _quiet_single_process():
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group,
                                        planner=_save_planner(), **_no_dist_kwarg(dcp.async_save))
            self._pending = _Finisher(self, future, tmp, final, step)
        else:
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=str(tmp), planner=_save_planner(), **_no_dist_kwarg(dcp.save))
            self._finish(tmp, final, step)
        return final

    def wait(self) -> None:
        """Finish an asynchronous save in flight (collective); re-raises its error, if any."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.join()

    @property
    def saving(self) -> bool:
        """An asynchronous save is still being written or finished."""
        return self._pending is not None and self._pending.is_alive()

    def _finish(self, tmp: Path, final: Path, step: int, group=None) -> None:
        _barrier(group)  # every rank's DCP and extra files are written
        names = _files(tmp)
        mine = {rel: {"bytes": (tmp / rel).stat().st_size, "sha256": _sha256(tmp / rel)}
                for rel in names[_rank()::_world()]}
        shares = _all_gather(mine, group)
        if _rank() == 0:
            files = _merge(shares)
            manifest = {"version": MANIFEST_VERSION, "step": step, "world_size": _world(),
                        "time": time.time(), "files": files}
            part = tmp / (MANIFEST + ".part")
            with open(part, "w") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            part.rename(tmp / MANIFEST)
            old = None
            if final.exists():  # the same step saved again: swap, then drop the old one
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
            tmp.rename(final)
            _fsync_dir(self.directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            self._prune()
            logger.info("saved checkpoint %s (%d files, %.1f MB)", final, len(files),
                        sum(e["bytes"] for e in files.values()) / 1e6)
        _barrier(group)

    def _prune(self) -> None:
        if self.keep <= 0:
            return
        for path in self.checkpoints()[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    # --- load ---------------------------------------------------------------------------------
    def load(self, model_parts: Sequence[nn.Module], optimizers=None, path: str | Path | None = None) -> dict:
        """Load `path` (default: the latest checkpoint) into the model parts and optimizers.

        Every file is checked against the manifest first; a corrupt or partial checkpoint raises
        a one-line TesseraError before anything is modified. Returns this rank's extra_state
        (with "step" added from the manifest if it is absent)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        self.wait()
        if path is None:
            path = self.latest()
            if path is None:
                raise TesseraError(f"no checkpoint to resume from in {self.directory}")
        path = Path(path)
        manifest = verify(path)
        pairs = _pair(model_parts, optimizers)
        model_states, optim_states = _model_states(model_parts), _optim_states(pairs)
        state = {"model": _merge(model_states), "optim": _merge(optim_states)}
        if not pairs:
            del state["optim"]
        try:
            with _quiet_single_process():
                dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(),
                         **_no_dist_kwarg(dcp.load))
        except TesseraError:
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TesseraError(f"checkpoint {path} does not fit this model: {_first_failure(e)}") from None
        for part, part_state in zip(model_parts, model_states):
            set_model_state_dict(part, {k: state["model"][k] for k in part_state})
        for (part, opt), part_state in zip(pairs, optim_states):
            set_optimizer_state_dict(part, opt, {k: state["optim"][k] for k in part_state}, options=_options())
        _sync_zero1_hyperparameters(optimizers, to_outer=True)
        extra = self._load_extra(path)
        extra.setdefault("step", manifest["step"])
        logger.info("loaded checkpoint %s (step %d, written by %d ranks)", path, manifest["step"],
                    manifest.get("world_size", 0))
        return extra

    @staticmethod
    def _load_extra(path: Path) -> dict:
        own = path / "extra" / f"rank-{_rank():05d}.pt"
        source = own if own.is_file() else path / "extra" / "rank-00000.pt"
        if not source.is_file():
            return {}
        try:  # tensors, numbers, strings, lists and dictionaries only: nothing else is unpickled
            extra = torch.load(source, weights_only=True)
        except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError or RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TesseraError(f"checkpoint {path} is refused: {source.relative_to(path)} holds more than "
                               f"tensors and plain values ({first[:200]})") from None
        if not isinstance(extra, dict):
            raise TesseraError(f"checkpoint {path} is refused: {source.relative_to(path)} is not a dictionary")
        extra["_own_rank"] = source == own  # whether per-rank state (RNG) is this rank's own
        return extra


class _Finisher(threading.Thread):
    """Waits for an asynchronous DCP write, then finishes the checkpoint (`CheckpointManager._finish`)
    on the manager's own gloo group, beside training; `join` re-raises what went wrong."""

    def __init__(self, manager: CheckpointManager, future, tmp: Path, final: Path, step: int):
        super().__init__(name=f"checkpoint-{step}", daemon=True)
        self.manager, self.future, self.tmp, self.final, self.step = manager, future, tmp, final, step
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.future.result()
            self.manager._finish(self.tmp, self.final, self.step, group=self.manager._async_group)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread by `join`
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
