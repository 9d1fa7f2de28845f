"""Image-text data for vision-language training: one image and one caption per sample.

Sources (`load_image_text(source)`):
  - "synthetic-shapes" or "synthetic-shapes:N": N (default 4,096) generated samples. Sample i is
    drawn from a generator seeded by i alone: one shape (circle, square, triangle, cross) of one
    colour (red, green, blue, yellow), small or large, in one quadrant, on dark noise; its caption
    names all four ("a small red circle at the top left"), so a model that looks at the image can
    predict the caption and one that does not cannot (log 64 nats of the caption are in the image).
  - a `.jsonl` file, or a directory with `.jsonl` files: one sample per line,
    `{"image": "<path relative to the file>" or "synthetic-shapes:<i>", "text": "<caption>"}`;
  - a directory of images (`.npy`, `.png`, `.jpg`), each with its caption in a `.txt` file of the
    same stem.
Images: `.npy` arrays (H, W), (H, W, C) or (C, H, W), uint8 0..255 or floats 0..1; `.png`/`.jpg`
through Pillow. Each must match the encoder's image size and channels, or loading stops with one
sentence naming the file (no resizing: what trains is what was given).

Sequences (`encode_sample`), S = the workload's sequence length: the image's P placeholder tokens,
the caption's tokens, end-of-text, then padding; labels are the next token where that is caption
text or end-of-text, -100 elsewhere (image placeholders, padding), so the loss covers text only
and the last placeholder predicts the caption's first token. Captions longer than S - P - 1
tokens are cut. Text is byte-level (ids 0..255, end-of-text 256) for models whose vocabulary is
without room for GPT-2's vocabulary and an image token beyond it, GPT-2 BPE otherwise.

Order and sharding follow `tessera.runtime.data`: global sample g is sample perm_e[g mod N] of
epoch e = g // N (perm_e seeded by (seed, e)); each step takes the next `global_batch` samples;
the last ceil(holdout * N) samples are the held-out split, read in order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import TesseraError
from .data import split_windows

SYNTHETIC = "synthetic-shapes"
DEFAULT_SYNTHETIC_SAMPLES = 4096
IMAGE_SUFFIXES = (".npy", ".png", ".jpg", ".jpeg")
IGNORE_INDEX = -100
BYTE_EOS = 256  # end-of-text of the byte-level text encoding
SHAPES = ("circle", "square", "triangle", "cross")
COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.15, 0.3, 0.95), "yellow": (0.95, 0.9, 0.1)}


# --- synthetic images ---------------------------------------------------------------------------------


def synthetic_shape(index: int, image_size: int, channels: int) -> tuple[np.ndarray, str]:
    """Sample `index` of the synthetic-shapes set: (image (C, S, S) float32 in [0, 1], caption)."""
    rng = np.random.default_rng([index, 7])
    shape = SHAPES[rng.integers(len(SHAPES))]
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    large = bool(rng.integers(2))
    top, left = bool(rng.integers(2)), bool(rng.integers(2))
    s = image_size
    half = s / 2
    radius = (0.38 if large else 0.22) * half
    # The centre lies inside its quadrant far enough for the shape to stay in it.
    cy = (0 if top else half) + rng.uniform(radius, half - radius) if half > 2 * radius else (0 if top else half) + half / 2
    cx = (0 if left else half) + rng.uniform(radius, half - radius) if half > 2 * radius else (0 if left else half) + half / 2
    y, x = np.mgrid[0:s, 0:s] + 0.5
    dy, dx = y - cy, x - cx
    if shape == "circle":
        mask = dx ** 2 + dy ** 2 <= radius ** 2
    elif shape == "square":
        mask = (np.abs(dx) <= 0.8 * radius) & (np.abs(dy) <= 0.8 * radius)
    elif shape == "triangle":  # apex up
        mask = (dy >= -radius) & (dy <= radius) & (np.abs(dx) <= (dy + radius) / 2)
    else:
        arm = radius / 3
        mask = ((np.abs(dx) <= arm) & (np.abs(dy) <= radius)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= radius))
    rgb = np.array(COLOURS[colour], dtype=np.float32)
    if channels != 3:  # grey levels keep the colours apart
        rgb = np.full(channels, float(rgb @ np.array([0.3, 0.59, 0.11])) * 0.8 + 0.2, dtype=np.float32)
    image = rng.uniform(0.0, 0.15, size=(channels, s, s)).astype(np.float32)
    image[:, mask] = rgb[:, None]
    caption = (f"a {'large' if large else 'small'} {colour} {shape} at the "
               f"{'top' if top else 'bottom'} {'left' if left else 'right'}")
    return image, caption


# --- reading --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    image: str  # a file path, or "synthetic-shapes:<i>"
    text: str


def _synthetic_count(source: str) -> int | None:
    if source == SYNTHETIC:
        return DEFAULT_SYNTHETIC_SAMPLES
    if source.startswith(SYNTHETIC + ":"):
        count = source.split(":", 1)[1]
        if not count.isdigit() or int(count) < 1:
            raise TesseraError(f"'{source}': the number of synthetic samples must be a positive integer")
        return int(count)
    return None


def _jsonl_samples(path: Path) -> list[Sample]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TesseraError(f"{path}:{n} is not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("image"), str) or not isinstance(row.get("text"), str):
            raise TesseraError(f"{path}:{n} needs string fields 'image' and 'text'")
        image = row["image"]
        if not image.startswith(SYNTHETIC + ":"):
            image = str((path.parent / image).resolve())
        out.append(Sample(image, row["text"]))
    return out


def load_image_text(source: str | Path) -> list[Sample]:
    """The samples of `source` (see the module docstring), in a fixed order."""
    count = _synthetic_count(str(source))
    if count is not None:
        return [Sample(f"{SYNTHETIC}:{i}", "") for i in range(count)]
    path = Path(source)
    if not path.exists():
        raise TesseraError(f"image-text data {source} does not exist")
    if path.is_file():
        if path.suffix != ".jsonl":
            raise TesseraError(f"image-text data {source}: a file must be .jsonl (one {{image, text}} per line)")
        samples = _jsonl_samples(path)
    elif sorted(path.glob("*.jsonl")):
        samples = [s for f in sorted(path.glob("*.jsonl")) for s in _jsonl_samples(f)]
    else:
        images = sorted(f for f in path.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        samples = []
        for f in images:
            caption = f.with_suffix(".txt")
            if not caption.is_file():
                raise TesseraError(f"image {f} has no caption file {caption.name}")
            samples.append(Sample(str(f), caption.read_text().strip()))
    if not samples:
        raise TesseraError(f"image-text data {source} holds no samples (.jsonl lines, or images with .txt captions)")
    return samples


def _read_image_file(path: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise TesseraError(f"image {path} does not exist")
    if p.suffix.lower() == ".npy":
        array = np.load(p)
    else:
        try:
            from PIL import Image
        except ImportError:
            raise TesseraError(f"reading {p.suffix} images needs Pillow; store them as .npy instead") from None
        with Image.open(p) as img:
            array = np.asarray(img)
    if array.dtype == np.uint8:
        array = array.astype(np.float32) / 255.0
    return np.asarray(array, dtype=np.float32)


def to_chw(array: np.ndarray, image_size: int, channels: int, name: str) -> np.ndarray:
    """(C, S, S) of an (H, W), (H, W, C) or (C, H, W) array, or one sentence saying why not."""
    if array.ndim == 2:
        array = array[None]
    elif array.ndim == 3 and array.shape[0] != channels and array.shape[-1] in (1, 2, 3, 4):
        array = np.moveaxis(array, -1, 0)
    if array.ndim != 3 or array.shape[1:] != (image_size, image_size) or array.shape[0] != channels:
        got = "x".join(map(str, array.shape[1:])) + f" with {array.shape[0]} channels" if array.ndim == 3 \
            else f"of shape {array.shape}"
        raise TesseraError(f"image {name} is {got}; the encoder takes {image_size}x{image_size} "
                           f"with {channels} channels")
    return np.ascontiguousarray(array, dtype=np.float32)


def read_image(sample: Sample, image_size: int, channels: int) -> tuple[np.ndarray, str]:
    """(image (C, S, S) float32, caption) of one sample; a synthetic image's own caption when it has none."""
    if sample.image.startswith(SYNTHETIC + ":"):
        index = sample.image.split(":", 1)[1]
        if not index.isdigit():
            raise TesseraError(f"'{sample.image}': a synthetic image is named synthetic-shapes:<integer>")
        image, caption = synthetic_shape(int(index), image_size, channels)
        return image, sample.text or caption
    return to_chw(_read_image_file(sample.image), image_size, channels, sample.image), sample.text


# --- text -----------------------------------------------------------------------------------------------


class CaptionTokenizer:
    """GPT-2 BPE when the vocabulary holds GPT-2's and an image token beyond it; byte-level text
    (ids 0..255, end-of-text 256) otherwise."""

    def __init__(self, vocab_size: int, image_token_id: int):
        from .tokenizer import EOT_ID, GPT2_VOCAB_SIZE

        self.bpe = vocab_size > GPT2_VOCAB_SIZE and image_token_id >= GPT2_VOCAB_SIZE
        self.eos_id = EOT_ID if self.bpe else BYTE_EOS
        if not self.bpe and (vocab_size <= BYTE_EOS or image_token_id <= BYTE_EOS):
            raise TesseraError(f"byte-level captions need ids 0..{BYTE_EOS} apart from the image token "
                               f"({image_token_id}) in the vocabulary of {vocab_size}")

    def encode(self, text: str) -> list[int]:
        if self.bpe:
            from .tokenizer import gpt2_tokenizer

            return gpt2_tokenizer().encode(text).ids
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        if self.bpe:
            from .tokenizer import decode

            return decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def encode_sample(caption_ids: list[int], image_tokens: int, image_token_id: int, eos_id: int,
                  seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, labels), each (seq_len,): [image]*P + caption + eos + padding; labels as in the module docstring."""
    if seq_len < image_tokens + 2:
        raise TesseraError(f"seq_len {seq_len} cannot hold an image's {image_tokens} tokens and any text")
    text = caption_ids[:seq_len - image_tokens - 1] + [eos_id]
    stream = np.full(seq_len + 1, eos_id, dtype=np.int64)
    stream[:image_tokens] = image_token_id
    stream[image_tokens:image_tokens + len(text)] = text
    is_text = np.zeros(seq_len + 1, dtype=bool)
    is_text[image_tokens:image_tokens + len(text)] = True
    labels = np.where(is_text[1:], stream[1:], IGNORE_INDEX)
    return stream[:seq_len], labels


@dataclass
class ImageTextBatch:
    """Rows of one global batch: tokens and labels (B, S); images (N, C, H, W) of the global rows
    `image_rows` (one image per row); `num_targets`: labels that are not -100 in the whole global batch."""

    tokens: torch.Tensor
    labels: torch.Tensor
    images: torch.Tensor
    image_rows: list
    num_targets: int
    packed: bool = False


class ImageTextLoader:
    """The global batches of an image-text source, forever (epochs reshuffle)."""

    def __init__(self, samples: list[Sample], vlm, seq_len: int, global_batch: int, seed: int = 0,
                 holdout: float = 0.0, split: str = "train"):
        from ..models.vision import image_token_id

        self.samples, self.vision, self.seq_len, self.global_batch, self.seed = samples, vlm.vision, seq_len, \
            global_batch, seed
        self.image_token_id = image_token_id(vlm)
        self.image_tokens = vlm.image_tokens
        vocab_size = vlm.llm.vocab_size
        self.tokenizer = CaptionTokenizer(vocab_size, self.image_token_id)
        if not 0 <= self.image_token_id < vocab_size:
            raise TesseraError(f"image_token_id {self.image_token_id} is outside the vocabulary of {vocab_size}")
        self.first, self.count = split_windows(len(samples), holdout, split)
        self.shuffle = split == "train"
        if self.count < global_batch:
            raise TesseraError(f"the {split} split has {self.count} image-text samples, fewer than one "
                               f"global batch of {global_batch}")
        self.samples_seen = 0

    def _sample_ids(self, first_sample: int) -> np.ndarray:
        g = first_sample + np.arange(self.global_batch)
        epochs, offsets = np.divmod(g, self.count)
        out = np.empty_like(g)
        for e in np.unique(epochs):
            perm = (np.random.default_rng([self.seed, int(e)]).permutation(self.count) if self.shuffle
                    else np.arange(self.count))
            out[epochs == e] = perm[offsets[epochs == e]]
        return out + self.first

    def batch_at(self, first_sample: int, rows: slice | None = None, image_rows=None) -> ImageTextBatch:
        """Global samples [first_sample, first_sample + global_batch): text of `rows` (a slice),
        images of `image_rows` (global row indices, in the order wanted); default: all of both.
        Does not move the data position."""
        rows = rows or slice(0, self.global_batch)
        image_rows = list(range(self.global_batch)) if image_rows is None else [int(r) for r in image_rows]
        ids = self._sample_ids(first_sample)
        tokens, labels, images = [], [], {}
        for row, i in enumerate(ids):
            sample = self.samples[int(i)]
            # A synthetic sample's caption comes with its image (cheap to draw).
            if row in image_rows or not sample.text:
                image, caption = read_image(sample, self.vision.image_size, self.vision.channels)
                images[row] = image
            else:
                caption = sample.text
            t, lab = encode_sample(self.tokenizer.encode(caption), self.image_tokens, self.image_token_id,
                                   self.tokenizer.eos_id, self.seq_len)
            tokens.append(t)
            labels.append(lab)
        tokens, labels = np.stack(tokens), np.stack(labels)
        shape = (0, self.vision.channels, self.vision.image_size, self.vision.image_size)
        picked = [images[r] for r in image_rows]
        return ImageTextBatch(tokens=torch.from_numpy(tokens[rows]), labels=torch.from_numpy(labels[rows]),
                              images=torch.from_numpy(np.stack(picked)) if picked else torch.zeros(shape),
                              image_rows=image_rows, num_targets=int((labels != IGNORE_INDEX).sum()))

    def __iter__(self):
        return self

    def __next__(self) -> ImageTextBatch:
        batch = self.batch_at(self.samples_seen)
        self.samples_seen += self.global_batch
        return batch

    def state_dict(self) -> dict:
        return {"samples_seen": self.samples_seen, "seed": self.seed, "num_samples": len(self.samples)}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "num_samples"):
            if state.get(key) != self.state_dict()[key]:
                raise TesseraError(f"the saved data position is for {key}={state.get(key)!r}, "
                                   f"but this run has {key}={self.state_dict()[key]!r}")
        self.samples_seen = int(state["samples_seen"])
