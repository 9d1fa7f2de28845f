"""A training checkpoint -> a Hugging Face directory, in one process, a shard at a time.

    export_checkpoint("ckpt", "out")   # ckpt/step-N (the latest) or a step directory itself

A checkpoint (`runtime/checkpoint.py`, any world size and plan) stores every model tensor under
its full-model name with its global shape; `model/config.json` (the `TransformerConfig`) and the
tokenizer (`model/tokenizer/*` copied from the `--init-from` directory, or `model/meta.json`
naming the built-in GPT-2 BPE) travel with it (`model_files`). The export checks the files against
the manifest, then reads the tensors with DCP's offline reader (`FileSystemReader`, no process
group) a few layers at a time, renames them to Hugging Face's names (`models/hf.py`), and writes
each shard as soon as it is full: the peak memory is one shard (`max_shard_bytes`), not the model.

Output: `config.json`, `model-0000k-of-0000n.safetensors`, `model.safetensors.index.json`, and the
tokenizer files. It appears all at once (a temporary sibling renamed into place).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..errors import TesseraError
from ..models.hf import CONFIG_FILE, INDEX_FILE, tessera_to_hf_state_dict
from ..models.transformer import Transformer
from ..spec.hf_config import to_hf_config
from ..spec.model import TransformerConfig

log = logging.getLogger(__name__)

MODEL_DIR = "model"  # inside a checkpoint step directory
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------- into the checkpoint

def model_files(config: TransformerConfig, init_from: str | Path | None) -> dict[str, bytes]:
    """What an export needs besides the weights, as files of the checkpoint (relative path -> bytes)."""
    files = {f"{MODEL_DIR}/config.json": (config.model_dump_json(indent=1) + "\n").encode()}
    if init_from is not None:
        for name in TOKENIZER_FILES:
            path = Path(init_from) / name
            if path.is_file():
                files[f"{MODEL_DIR}/tokenizer/{name}"] = path.read_bytes()
        if (Path(init_from) / CONFIG_FILE).is_file():
            files[f"{MODEL_DIR}/hf_config.json"] = (Path(init_from) / CONFIG_FILE).read_bytes()
        meta = {"tokenizer": "files", "init_from": str(init_from)}
    else:
        meta = {"tokenizer": "gpt2"}
    files[f"{MODEL_DIR}/meta.json"] = (json.dumps(meta, indent=1) + "\n").encode()
    return files


# ----------------------------------------------------------------------------- reading

def resolve_step(ckpt: str | Path) -> Path:
    """A step directory (`step-N` with a manifest), or the latest one of a checkpoint directory."""
    from .checkpoint import MANIFEST, CheckpointManager

    path = Path(ckpt).expanduser()
    if not path.is_dir():
        raise TesseraError(f"checkpoint directory '{path}' does not exist")
    if (path / MANIFEST).is_file():
        return path
    latest = CheckpointManager(path).latest()
    if latest is None:
        raise TesseraError(f"'{path}' holds no finished checkpoint (no step-N directory with a manifest)")
    return latest


def checkpoint_config(step: Path) -> TransformerConfig:
    path = step / MODEL_DIR / "config.json"
    if not path.is_file():
        raise TesseraError(f"checkpoint {step} has no {MODEL_DIR}/config.json (the model config), so it cannot be "
                           "exported; checkpoints written by this version carry it")
    try:
        return TransformerConfig.model_validate_json(path.read_text())
    except ValueError as e:
        raise TesseraError(f"{path} is not a model config ({str(e).splitlines()[0]})") from None


def _stored_model_tensors(step: Path) -> dict[str, tuple[str, torch.Size, torch.dtype]]:
    """Full-model name -> (checkpoint key, global shape, dtype) of every model tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..models.hf_load import canonical_name
    from .safe_dcp import read_metadata

    metadata = read_metadata(step)
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(md, TensorStorageMetadata):
            out[canonical_name(key[len("model."):])] = (key, md.size, md.properties.dtype)
    return out


def _read(step: Path, entries: dict[str, tuple[str, torch.Size, torch.dtype]]) -> dict[str, torch.Tensor]:
    """The full tensors `entries` (name -> (key, shape, dtype)) of the checkpoint, in one DCP read."""
    import torch.distributed.checkpoint as dcp

    from .checkpoint import _no_dist_kwarg, _quiet_single_process
    from .safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    state = {key: torch.empty(shape, dtype=dtype) for key, shape, dtype in entries.values()}
    with _quiet_single_process():
        dcp.load(state, storage_reader=SafeFileSystemReader(str(step)), planner=SafeLoadPlanner(),
                 **_no_dist_kwarg(dcp.load))
    return {name: state[key] for name, (key, _, _) in entries.items()}


def _units(names: list[str]) -> list[list[str]]:
    """Tensors grouped so that each group converts alone (a block's q/k/v fuse for GPT-2)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = re.match(r"layers\.(\d+)\.", name)
        groups.setdefault(m.group(0) if m else name, []).append(name)
    return list(groups.values())


def parse_size(text: str) -> int:
    """'2GB', '500MB', '64KB' or a byte count -> bytes (decimal units, as Hugging Face's)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise TesseraError(f"max shard size {text!r} is not a size like 2GB, 500MB or 1000000")
    return int(float(m[1]) * {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}[m[2]])


# ----------------------------------------------------------------------------- writing

def export_checkpoint(ckpt: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 2 * 10**9, overwrite: bool = False) -> tuple[Path, TransformerConfig]:
    """Write the Hugging Face directory of checkpoint `ckpt` to `out_dir` (see the module docstring)."""
    from safetensors.torch import save_file

    from .checkpoint import verify

    step = resolve_step(ckpt)
    config = checkpoint_config(step)
    hf_config = to_hf_config(config)  # refuses what the HF architecture cannot express, before reading
    verify(step)
    stored = _stored_model_tensors(step)
    with torch.device("meta"):
        expected = [k for k in Transformer(config).state_dict() if not (config.tie_embeddings and k == "output.weight")]
    missing = [k for k in expected if k not in stored]
    if missing:
        raise TesseraError(f"checkpoint {step} lacks the model tensor(s) {', '.join(missing[:3])} of {config.name}")
    out = Path(out_dir).expanduser()
    if out.exists() and not overwrite:
        raise TesseraError(f"'{out}' already exists (choose another directory or pass --overwrite)")

    def nbytes(name: str) -> int:
        _, shape, dt = stored[name]
        return shape.numel() * (dtype or dt).itemsize

    shards: list[list[str]] = [[]]
    for unit in _units(expected):
        size = sum(nbytes(n) for n in unit)
        if shards[-1] and sum(nbytes(n) for n in shards[-1]) + size > max_shard_bytes:
            shards.append([])
        shards[-1].extend(unit)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map, total = {}, 0
        for i, names in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            tensors = _read(step, {n: stored[n] for n in names})
            if dtype is not None:
                tensors = {k: v.to(dtype) for k, v in tensors.items()}
            hf_tensors = {k: v.contiguous() for k, v in tessera_to_hf_state_dict(tensors, config).items()}
            save_file(hf_tensors, str(tmp / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in hf_tensors})
            total += sum(t.numel() * t.element_size() for t in hf_tensors.values())
            del tensors, hf_tensors
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        hf_config.update(_special_token_ids(step))
        if dtype is not None:
            hf_config["torch_dtype"] = hf_config["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        _write_tokenizer(step, tmp, config)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s (%d shards) to %s", step, len(shards), out)
    return out, config


def _special_token_ids(step: Path) -> dict:
    """BOS/EOS/PAD ids of the `--init-from` model's config.json (they name its tokenizer's tokens)."""
    path = step / MODEL_DIR / "hf_config.json"
    original = json.loads(path.read_text()) if path.is_file() else {}
    return {k: original[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in original}


def _write_tokenizer(step: Path, out: Path, config: TransformerConfig | None = None) -> None:
    """The checkpoint's tokenizer files, or GPT-2's (built-in runs) as a tokenizer.json."""
    saved = step / MODEL_DIR / "tokenizer"
    meta_path = step / MODEL_DIR / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if saved.is_dir():
        for f in sorted(saved.iterdir()):
            shutil.copyfile(f, out / f.name)
    elif meta.get("tokenizer") == "gpt2":
        from .tokenizer import GPT2_VOCAB_SIZE, gpt2_tokenizer

        if config is not None and config.vocab_size < GPT2_VOCAB_SIZE:  # trained on synthetic tokens
            log.warning("%s: the model's %d-token vocabulary is not GPT-2's; the export has no tokenizer",
                        step, config.vocab_size)
            return

        gpt2_tokenizer().save(str(out / "tokenizer.json"))
        special = "<|endoftext|>"
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "bos_token": special, "eos_token": special, "unk_token": special,
             "model_max_length": 1024}, indent=2) + "\n")
    else:
        log.warning("checkpoint %s carries no tokenizer; the export has none", step)
