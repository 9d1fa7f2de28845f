"""Data tokenized with a model's own tokenizer (`--init-from`): text and chat JSONL, with target flags.

A source is the default corpus (None / "shakespeare"), one file, or a directory of files (path
order), each:
  - `.txt`: one text document;
  - `.jsonl`: one document per line, either `{"text": "..."}` or `{"messages": [{"role": "user",
    "content": "..."}, {"role": "assistant", "content": "..."}, ...]}` (a chat, rendered with the
    model's chat template; only its assistant turns are trained, `runtime/chat.py`);
  - `.bin` / `.npy`: token ids already made with this tokenizer (no flags; documents start at BOS,
    else at EOS, as for GPT-2's end-of-text).
The text documents become one stream of uint32 ids and one of flags (`hf_tokenizer`), cached under
`cache_dir()` with a key of the tokenizer's fingerprint, the source's files (names, sizes, times)
and a format version.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import TesseraError
from .chat import check_messages
from .data import (DEFAULT_CORPUS, TEXT_SUFFIXES, TOKEN_SUFFIXES, TokenStream, _atomic_save, _cache_lock,
                   _load_cached, _play_files, _token_file, cache_dir, shakespeare_documents)
from .hf_tokenizer import HFTokenizer

log = logging.getLogger(__name__)

_FORMAT = "hf-1"
Document = tuple[str, object, str]  # ("text", text, where) or ("chat", messages, where)


def read_documents(files: list[Path]) -> list[Document]:
    """The documents of `.txt` / `.jsonl` files, in order; bad lines are refused as file:line."""
    docs: list[Document] = []
    for f in files:
        if f.suffix == ".txt":
            docs.append(("text", f.read_text(encoding="utf-8", errors="replace"), str(f)))
            continue
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            where = f"{f}:{n}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise TesseraError(f"{where}: not a JSON object") from None
            if isinstance(record, dict) and "messages" in record:
                docs.append(("chat", check_messages(record["messages"], where), where))
            elif isinstance(record, dict) and isinstance(record.get("text"), str):
                docs.append(("text", record["text"], where))
            else:
                raise TesseraError(f"{where}: expected a JSON object with a \"text\" string or a \"messages\" list")
    return docs


def encode(documents: list[Document], tokenizer: HFTokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(ids uint32, flags uint8) of the documents joined in order (empty texts dropped)."""
    texts = [i for i, d in enumerate(documents) if d[0] == "text" and d[1].strip()]
    chats = [i for i, d in enumerate(documents) if d[0] == "chat"]
    encoded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    encoded.update(zip(texts, tokenizer.encode_texts([documents[i][1] for i in texts])))
    encoded.update(zip(chats, tokenizer.encode_chats([(documents[i][1], documents[i][2]) for i in chats])))
    parts = [encoded[i] for i in sorted(encoded)]
    if not parts:
        return np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint8)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def cached_encoding(key: str, make: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, flags) cached as `<cache>/tokens-<key>.npy` and `flags-<key>.npy` (written atomically)."""
    paths = cache_dir() / f"tokens-{key}.npy", cache_dir() / f"flags-{key}.npy"

    def cached():
        ids, flags = (_load_cached(p) for p in paths)
        return (ids, flags) if ids is not None and flags is not None and len(ids) == len(flags) else None

    if (found := cached()) is not None:
        return found
    with _cache_lock(paths[0]):
        if (found := cached()) is not None:  # another rank wrote it while this one waited
            return found
        ids, flags = make()
        try:
            _atomic_save(paths[1], flags)
            _atomic_save(paths[0], ids)
        except OSError as e:
            log.warning("cannot write the token cache %s (%s); continuing without it", paths[0], e)
    return ids, flags


def _key(tokenizer: HFTokenizer, *parts: object) -> str:
    return hashlib.sha256(json.dumps([_FORMAT, tokenizer.fingerprint, *parts]).encode()).hexdigest()[:20]


def finetune_stream(source: str | Path | None, tokenizer: HFTokenizer) -> TokenStream:
    """The flagged token stream of `source` (see the module docstring)."""
    if source is None or str(source) == DEFAULT_CORPUS:
        plays = [hashlib.sha256(f.read_bytes()).hexdigest() for f in _play_files()]
        ids, flags = cached_encoding(_key(tokenizer, "shakespeare", plays), lambda: encode(
            [("text", t, DEFAULT_CORPUS) for t in shakespeare_documents()], tokenizer))
        return TokenStream([ids], DEFAULT_CORPUS, tokenizer.vocab_size, flags=[flags])
    root = Path(source).expanduser()
    if root.is_file():
        files, base = [root], root.parent
    elif root.is_dir():
        files = sorted((f for f in root.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + TOKEN_SUFFIXES),
                       key=lambda f: f.relative_to(root).as_posix())
        base = root
    else:
        raise TesseraError(f"data '{root}' does not exist")
    text_files = [f for f in files if f.suffix in TEXT_SUFFIXES]
    token_files = [f for f in files if f.suffix in TOKEN_SUFFIXES]
    stats = [(f.relative_to(base).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    segments, flags = [], []
    if text_files:
        ids, text_flags = cached_encoding(_key(tokenizer, str(root.resolve()), stats),
                                          lambda: encode(read_documents(text_files), tokenizer))
        segments.append(ids)
        flags.append(text_flags)
    for f in token_files:
        segments.append(_token_file(f))
        flags.append(None)
    stream = TokenStream(segments, str(root), tokenizer.vocab_size if not token_files else None, flags=flags)
    if len(stream) < 2:
        raise TesseraError(f"data '{root}' holds no usable tokens (expected {', '.join(TEXT_SUFFIXES + TOKEN_SUFFIXES)} "
                           "files)")
    return stream
