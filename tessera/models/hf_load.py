"""Fill a parallelised model's local shards straight from a Hugging Face checkpoint's safetensors files.

    stats = load_hf_shards(model_parts, hf_dir, config, device)   # after the plan is applied

Each parameter of each part (a plain tensor, or a DTensor with `device_mesh` / `placements`; names
may carry checkpoint / compile / DDP wrapper segments, `canonical_name`) is written with the values
the full model would have, reading only this rank's box of each tensor from the files: no rank
ever holds the full model, and the peak extra host memory is one local shard of one parameter. A
box that is one run of the stored tensor (a row shard, a whole tensor, one expert) is one
positioned read into its own buffer; other boxes (column shards of tensor parallelism) go through
`safe_open(...).get_slice(name)[box]`. Nothing keeps the files mapped, so the pages read do not
stay in the rank's resident memory. A part still on the meta device is allocated
first (`to_empty`) and its RoPE table recomputed, as `runtime.materialize` does for a random init.

Names and layouts go through the converter of `tessera.models.hf` applied to *lazy views*: an
`HFView` records what the converter does to an HF tensor (GPT-2's Conv1D transpose, the split of
the fused `c_attn` into q/k/v, the fused expert tensors of transformers >= 5 indexed per expert)
without reading it, and maps a box of the Tessera tensor back to a box of the stored one. A tied
output head (absent from the files) reads the embedding.

Every shard file is checked before any parameter is touched: a file the index names but that is
missing, or one shorter than its header says (truncated), is refused in one line.
"""
from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import TesseraError
from ..spec.hf_config import hf_dict_to_config, read_hf_config_dict, unsupported_features
from ..spec.model import TransformerConfig
from .hf import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, check_state_dict, hf_to_tessera_state_dict
from .transformer import rope_frequencies

log = logging.getLogger(__name__)

# Wrapper segments that parallelisation adds to parameter names (recompute, compile, DDP); the
# same list as `runtime.materialize.canonical_name`, kept here so that the models package does
# not import the runtime.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def canonical_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


# ----------------------------------------------------------------------------- config

def check_hf_dir(hf_dir: str | Path) -> Path:
    d = Path(hf_dir).expanduser()
    if not d.is_dir():
        raise TesseraError(f"--init-from directory '{d}' does not exist")
    if not (d / CONFIG_FILE).is_file():
        raise TesseraError(f"--init-from directory '{d}' has no {CONFIG_FILE}")
    return d


def hf_model_config(hf_dir: str | Path) -> TransformerConfig:
    """The `TransformerConfig` of an HF checkpoint directory, refusing features the model does not compute."""
    d = check_hf_dir(hf_dir)
    raw = read_hf_config_dict(d)
    problems = unsupported_features(raw)
    if problems:
        raise TesseraError(f"{d / CONFIG_FILE}: {', '.join(problems)} is not computed by the Tessera model, "
                           "so training would start from other outputs")
    return hf_dict_to_config(raw, name=d.resolve().name, source=str(d / CONFIG_FILE))


def same_architecture(a: TransformerConfig, b: TransformerConfig) -> bool:
    """Equal but for the name (and max_seq_len, which only sizes the RoPE table)."""
    skip = {"name", "max_seq_len"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


# ----------------------------------------------------------------------------- files

@dataclass(frozen=True)
class StoredTensor:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    data_start: int  # byte offset of the tensor's data in the file


def _contiguous_run(shape: tuple[int, ...], box: tuple[slice, ...]) -> tuple[int, int] | None:
    """(first element, element count) when `box` is one run of the row-major tensor, else None:
    single indices on the leading dims, one range, then whole dims (row shards, one expert...)."""
    j = 0
    while j < len(shape) and box[j].stop - box[j].start == 1:
        j += 1
    if any((box[i].start, box[i].stop) != (0, shape[i]) for i in range(j + 1, len(shape))):
        return None
    first, stride = 0, 1
    for i in reversed(range(len(shape))):
        first += box[i].start * stride
        stride *= shape[i]
    count = 1
    for b in box:
        count *= b.stop - b.start
    return first, count


def read_box(key: str, stored: StoredTensor, box: tuple[slice, ...]) -> torch.Tensor:
    """The box of a stored tensor, and nothing more: a contiguous run with one positioned read
    into its own buffer (no mapping of the file); any other box through `safe_open(...).get_slice`."""
    run = _contiguous_run(stored.shape, box)
    if run is None:
        from safetensors import safe_open

        with safe_open(str(stored.file), framework="pt") as handle:
            return handle.get_slice(key)[box]
    first, count = run
    out = torch.empty(count, dtype=stored.dtype)
    buffer = out.view(torch.uint8).numpy()
    with open(stored.file, "rb") as f:
        f.seek(stored.data_start + first * out.element_size())
        if f.readinto(buffer) != buffer.nbytes:
            raise TesseraError(f"shard '{stored.file}' is truncated: tensor '{key}' runs past its end")
    return out.reshape([b.stop - b.start for b in box])


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (truncation)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > size - 8:
                raise ValueError(f"its header claims {n} bytes")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise TesseraError(f"shard '{path.name}' of '{path.parent}' is missing") from None
    except (OSError, ValueError, struct.error) as e:
        raise TesseraError(f"shard '{path}' is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    header = {k: dict(v, data_start=8 + n + int(v["data_offsets"][0])) for k, v in header.items()}
    end = 8 + n + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if size < end:
        raise TesseraError(f"shard '{path}' is truncated: {size:,} bytes, its header needs {end:,}")
    return header


def stored_tensors(hf_dir: str | Path) -> dict[str, StoredTensor]:
    """HF name -> (file, shape, dtype) of every tensor of a safetensors checkpoint (headers only)."""
    d = Path(hf_dir)
    if (d / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise TesseraError(f"'{d / INDEX_FILE}' has no valid weight_map") from None
        files = sorted(set(weight_map.values()))
    elif (d / WEIGHTS_FILE).is_file():
        weight_map, files = None, [WEIGHTS_FILE]
    else:
        raise TesseraError(f"no safetensors weights in '{d}' (expected {WEIGHTS_FILE} or {INDEX_FILE})")
    out: dict[str, StoredTensor] = {}
    for name in files:
        path = d / name
        for key, entry in _read_header(path).items():
            if entry["dtype"] not in _DTYPES:
                raise TesseraError(f"shard '{path}': tensor '{key}' has dtype {entry['dtype']}, which is not supported")
            out[key] = StoredTensor(path, tuple(entry["shape"]), _DTYPES[entry["dtype"]], entry["data_start"])
    if weight_map is not None:
        absent = sorted(k for k, f in weight_map.items() if k not in out)
        if absent:
            raise TesseraError(f"'{d / INDEX_FILE}' maps '{absent[0]}' to '{weight_map[absent[0]]}', "
                               f"which does not hold it ({len(absent)} tensor(s) missing)")
    return out


# ----------------------------------------------------------------------------- lazy views

@dataclass(frozen=True)
class HFView:
    """A view of a stored tensor without its data: the dims it keeps and where, the dims it indexes.

    `dims[v]` is the stored dim that view dim v runs along, `offsets[d]` the first stored index of
    stored dim d, `fixed[d]` the index of a dim the view dropped (one expert of a fused tensor)."""

    key: str
    stored: StoredTensor
    shape: tuple[int, ...]
    dims: tuple[int, ...]
    offsets: tuple[int, ...]
    fixed: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, key: str, stored: StoredTensor) -> "HFView":
        n = len(stored.shape)
        return cls(key, stored, stored.shape, tuple(range(n)), (0,) * n)

    # The operations `hf.hf_to_tessera_state_dict` applies to tensors.
    def t(self) -> "HFView":
        if len(self.shape) != 2:
            raise TesseraError(f"'{self.key}': cannot transpose a {len(self.shape)}-D tensor")
        return HFView(self.key, self.stored, self.shape[::-1], self.dims[::-1], self.offsets, self.fixed)

    def chunk(self, n: int, dim: int = 0) -> list["HFView"]:
        size = self.shape[dim]
        if size % n:
            raise TesseraError(f"'{self.key}': dim {dim} of size {size} does not split into {n}")
        return [self._narrow(dim, i * (size // n), size // n) for i in range(n)]

    def _narrow(self, dim: int, start: int, length: int) -> "HFView":
        offsets = list(self.offsets)
        offsets[self.dims[dim]] += start
        shape = list(self.shape)
        shape[dim] = length
        return HFView(self.key, self.stored, tuple(shape), self.dims, tuple(offsets), self.fixed)

    def __getitem__(self, index: int) -> "HFView":
        if not isinstance(index, int) or not 0 <= index < self.shape[0]:
            raise TesseraError(f"'{self.key}': unsupported index {index!r}")
        d = self.dims[0]
        return HFView(self.key, self.stored, self.shape[1:], self.dims[1:], self.offsets,
                      self.fixed + ((d, self.offsets[d] + index),))

    def stored_box(self, offsets, sizes) -> tuple[slice, ...]:
        """The slices of the stored tensor that hold the view's box (offsets, sizes)."""
        fixed = dict(self.fixed)
        box = []
        for d in range(len(self.stored.shape)):
            if d in fixed:
                box.append(slice(fixed[d], fixed[d] + 1))
            else:
                v = self.dims.index(d)
                start = self.offsets[d] + offsets[v]
                box.append(slice(start, start + sizes[v]))
        return tuple(box)

    def read(self, offsets, sizes) -> torch.Tensor:
        """The view's box (offsets, sizes), read from the file (only that box is read)."""
        data = read_box(self.key, self.stored, self.stored_box(offsets, sizes))
        kept = [d for d in range(len(self.stored.shape)) if d not in dict(self.fixed)]
        data = data.reshape([data.shape[d] for d in kept])
        return data.permute([kept.index(d) for d in self.dims]) if len(kept) > 1 else data


def tessera_views(hf_dir: str | Path, config: TransformerConfig) -> dict[str, HFView]:
    """Tessera name -> the lazy view of the HF tensor that holds it (checked against `config`'s shapes)."""
    stored = stored_tensors(hf_dir)
    views = hf_to_tessera_state_dict({k: HFView.of(k, s) for k, s in stored.items()}, config)
    check_state_dict(config, views)
    return views


# ----------------------------------------------------------------------------- loading

@dataclass
class LoadStats:
    tensors: int = 0
    bytes_read: int = 0  # bytes of the stored dtype read from the files by this rank
    local_bytes: int = 0  # bytes of this rank's shards (parameter dtype)
    seconds: float = 0.0
    files: set = field(default_factory=set)


def _local_box(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor to write, offsets, sizes) of a parameter's box in the full tensor."""
    if hasattr(p, "device_mesh"):
        chunks = p.__create_chunk_list__()  # what DCP saves: this rank's box of the global tensor
        if len(chunks) != 1:
            raise TesseraError(f"a parameter sharded as {p.placements} has {len(chunks)} local boxes")
        return p.to_local(), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return p, (0,) * p.dim(), tuple(p.shape)


def _targets(parts: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, parameter) of every distinct parameter of the parts."""
    seen, out = set(), []
    for part in parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((canonical_name(name), p))
    return out


def _allocate(part: nn.Module, config: TransformerConfig, device: torch.device) -> None:
    """A meta-built part on `device` (values undefined until loaded), with its RoPE table."""
    part.to_empty(device=device)
    if config.position != "learned":
        freqs = rope_frequencies(config.head_dim, config.max_seq_len, config.rope_theta).to(device)
        for module in part.modules():
            if "freqs" in module._buffers:
                module.freqs = freqs


@torch.no_grad()
def load_hf_shards(parts: nn.Module | list[nn.Module], hf_dir: str | Path, config: TransformerConfig,
                   device: torch.device | str | None = None) -> LoadStats:
    """Write the HF checkpoint `hf_dir` into the local shards of `parts` (see the module docstring).

    `config` is the model the parts were built for; the checkpoint must have exactly its tensors.
    Parts on the meta device are allocated on `device` first."""
    start = time.perf_counter()
    parts = [parts] if isinstance(parts, nn.Module) else list(parts)
    d = check_hf_dir(hf_dir)
    views = tessera_views(d, config)  # every file checked before any parameter is touched
    for part in parts:
        if any(p.is_meta for p in part.parameters()):
            if device is None:
                raise TesseraError("a meta-device model part needs a device to be allocated on")
            _allocate(part, config, torch.device(device))
    stats = LoadStats()
    targets = _targets(parts)
    # File by file, in file order (each read opens the file: no mapping that would keep the pages
    # this rank touched resident until the end).
    targets.sort(key=lambda t: (str((v := _view_for(t[0], views, config)).stored.file), v.stored.data_start))
    for name, p in targets:
        view = _view_for(name, views, config)
        local, offsets, sizes = _local_box(p)
        if local.numel() == 0:
            continue  # an uneven FSDP2 shard with no rows on this rank
        value = view.read(offsets, sizes)
        if tuple(value.shape) != tuple(local.shape):
            raise TesseraError(f"'{name}': read a {tuple(value.shape)} box for a {tuple(local.shape)} shard")
        local.copy_(value)
        stats.tensors += 1
        stats.bytes_read += value.numel() * value.element_size()
        stats.local_bytes += local.numel() * local.element_size()
        stats.files.add(view.stored.file.name)
    stats.seconds = time.perf_counter() - start
    log.info("loaded %d tensors (%.1f MB read) from %s in %.2fs", stats.tensors, stats.bytes_read / 1e6, d,
             stats.seconds)
    return stats


def _view_for(name: str, views: dict[str, HFView], config: TransformerConfig) -> HFView:
    if name in views:
        return views[name]
    if name == "output.weight" and config.tie_embeddings:  # the head is the embedding
        return views["tok_embeddings.weight"]
    raise TesseraError(f"model parameter '{name}' has no tensor in the checkpoint")
