"""A model's own tokenizer: `tokenizer.json` through the `tokenizers` package, with its special
tokens and chat template from `tokenizer_config.json` (or `special_tokens_map.json`,
`chat_template.jinja`).

Documents become token ids and a flag per token (`DOC_START`, `NO_LOSS`):
  - text:  [BOS] text [EOS] (each special token where the tokenizer has one); every token but the
    first is a target;
  - chat:  the rendered conversation (`runtime/chat.py`; the template writes its own special
    tokens, as `apply_chat_template` does); only the assistant turns' tokens are targets.
The loader turns the flags into labels (-100 where a token is not a target or starts the next
document) and document boundaries (`runtime/data.py`).
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..errors import TesseraError
from .chat import ChatRenderer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
DOC_START = 1  # the token starts a document (attention and positions restart; it is nobody's target)
NO_LOSS = 2  # the token is not a target (prompt and system text of a chat)
FLAGGED = 4  # set on every token of a flagged stream (token files in the same run have no flags)


def _token_text(value) -> str | None:
    """A special token as `tokenizer_config.json` writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """The tokenizer of a Hugging Face model directory (see the module docstring)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.directory = Path(directory).expanduser()
        path = self.directory / TOKENIZER_FILE
        if not path.is_file():
            raise TesseraError(f"'{self.directory}' has no {TOKENIZER_FILE}: the model's tokenizer is needed "
                               "to tokenize text data for it")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises plain Exceptions for malformed files
            raise TesseraError(f"'{path}' is not a readable tokenizer ({str(e).splitlines()[0]})") from None
        config = self._json("tokenizer_config.json")
        special = self._json("special_tokens_map.json")
        self.bos_token = _token_text(config.get("bos_token", special.get("bos_token")))
        self.eos_token = _token_text(config.get("eos_token", special.get("eos_token")))
        self.bos_id = self._id(self.bos_token, "bos_token")
        self.eos_id = self._id(self.eos_token, "eos_token")
        template_file = self.directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        self.chat_template = template if isinstance(template, str) else None
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        self.renderer = ChatRenderer(self.chat_template,
                                     {n: _token_text(config.get(n, special.get(n))) for n in names})

    def _json(self, name: str) -> dict:
        path = self.directory / name
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise TesseraError(f"'{path}' is not valid JSON ({e})") from None
        return data if isinstance(data, dict) else {}

    def _id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise TesseraError(f"{self.directory / 'tokenizer_config.json'}: {field} {token!r} is not in the vocabulary")
        return token_id

    @functools.cached_property
    def vocab_size(self) -> int:
        """Token ids are below this (added tokens included)."""
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        return max(vocab.values()) + 1 if vocab else 0

    @functools.cached_property
    def fingerprint(self) -> str:
        """Hash of the files that decide the ids: part of every token-cache key."""
        h = hashlib.sha256()
        for name in (TOKENIZER_FILE, *CONFIG_FILES):
            path = self.directory / name
            h.update(name.encode() + b"\0" + (path.read_bytes() if path.is_file() else b"") + b"\0")
        return h.hexdigest()[:16]

    def check_fits(self, model_vocab_size: int) -> None:
        """Refuse a tokenizer whose ids the model's embedding does not have."""
        if self.vocab_size > model_vocab_size:
            raise TesseraError(f"{self.directory / TOKENIZER_FILE} has {self.vocab_size:,} tokens, more than the "
                               f"model's embedding of {model_vocab_size:,} rows (vocab_size)")

    # --- encoding ---------------------------------------------------------------------------------
    def encode_texts(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, flags) of each text document: [BOS] text [EOS]."""
        bos = [self.bos_id] if self.bos_id is not None else []
        eos = [self.eos_id] if self.eos_id is not None else []
        out = []
        for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=False):
            ids = np.asarray(bos + enc.ids + eos, dtype=np.uint32)
            flags = np.full(len(ids), FLAGGED, dtype=np.uint8)
            flags[:1] |= DOC_START
            out.append((ids, flags))
        return out

    def encode_chats(self, conversations: Sequence[tuple[list[dict], str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids, flags) of each (messages, where) conversation; targets: the assistant turns."""
        rendered = [self.renderer.render_with_spans(messages, where) for messages, where in conversations]
        out = []
        encodings = self.tokenizer.encode_batch([text for text, _ in rendered], add_special_tokens=False)
        for (text, spans), enc, (_, where) in zip(rendered, encodings, conversations):
            starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
            trained = np.zeros(len(starts), dtype=bool)
            for lo, hi in spans:
                trained |= (starts >= lo) & (starts < hi)
            if not trained.any():
                raise TesseraError(f"{where}: the assistant turns of the conversation tokenize to nothing")
            flags = np.where(trained, FLAGGED, FLAGGED | NO_LOSS).astype(np.uint8)
            flags[:1] |= DOC_START
            out.append((np.asarray(enc.ids, dtype=np.uint32), flags))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=False)
