"""A multi-task multimodal workload: several tasks sharing one VLM, each with its own modality mix,
batch and lengths (the input of the Spindle planner, `tessera plan --tasks tasks.yaml`).

File format (YAML or JSON):

    tasks:
      - name: captioning          # image + short text
        modalities: [image, text]
        batch: 256                # samples per optimizer step
        images_per_sample: 1
        text_tokens: 64           # text tokens per sample
      - name: text
        modalities: [text]
        batch: 64
        text_tokens: 4096
      - name: interleaved
        modalities: [image, text]
        batch: 64
        images_per_sample: 4
        text_tokens: 1024
        parts: [vision_encoder, projector, llm]   # optional: the model parts it runs
        image_size: 336                           # optional: checked against the encoder

A task's LLM sequence is `text_tokens + images_per_sample x image_tokens` tokens; its encoder runs
`batch x images_per_sample` images of `encoder_seq_len` tokens. No torch import.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from ..errors import TesseraError
from .model import Frozen
from .multimodal import MODEL_PARTS, VLMSpec

MODALITIES = ("image", "text")
_PARTS_OF = {"image": ("vision_encoder", "projector"), "text": ("llm",)}


class TaskSpec(Frozen):
    name: str
    modalities: tuple[str, ...]
    batch: int = Field(gt=0, description="samples per optimizer step")
    text_tokens: int = Field(ge=0)
    images_per_sample: int = Field(default=0, ge=0)
    parts: tuple[str, ...] = ()
    image_size: int | None = Field(default=None, gt=0)
    channels: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "TaskSpec":
        for m in self.modalities:
            if m not in MODALITIES:
                raise ValueError(f"task '{self.name}': unknown modality '{m}'; known: {', '.join(MODALITIES)}")
        for p in self.parts:
            if p not in MODEL_PARTS:
                raise ValueError(f"task '{self.name}': unknown model part '{p}'; the parts are {', '.join(MODEL_PARTS)}")
        if not self.modalities:
            raise ValueError(f"task '{self.name}': modalities is empty")
        if ("image" in self.modalities) != (self.images_per_sample > 0):
            raise ValueError(f"task '{self.name}': images_per_sample={self.images_per_sample} does not match "
                             f"modalities {list(self.modalities)} (image tasks need >= 1 image per sample)")
        needed = {p for m in self.modalities for p in _PARTS_OF[m]} | {"llm"}
        if self.parts and set(self.parts) != needed:
            raise ValueError(f"task '{self.name}': modalities {list(self.modalities)} run the parts "
                             f"{sorted(needed)}, not {list(self.parts)}")
        return self

    @property
    def has_images(self) -> bool:
        return self.images_per_sample > 0

    def llm_seq_len(self, vlm: VLMSpec) -> int:
        return self.text_tokens + self.images_per_sample * vlm.image_tokens

    def images(self) -> int:
        return self.batch * self.images_per_sample


class MultiTaskWorkload(Frozen):
    tasks: tuple[TaskSpec, ...]
    dtype: str = "bf16"

    @model_validator(mode="after")
    def _check(self) -> "MultiTaskWorkload":
        if not self.tasks:
            raise ValueError("tasks is empty")
        names = [t.name for t in self.tasks]
        if len(set(names)) != len(names):
            raise ValueError(f"task names repeat: {names}")
        return self

    def check_model(self, vlm: VLMSpec) -> None:
        """Refuse tasks whose images the model's encoder cannot take (one sentence)."""
        v = vlm.config.vision
        for t in self.tasks:
            if t.has_images and t.image_size is not None and t.image_size != v.image_size:
                raise TesseraError(f"task '{t.name}': images are {t.image_size} px but {vlm.name}'s encoder "
                                   f"takes {v.image_size} px")
            if t.has_images and t.channels is not None and t.channels != v.channels:
                raise TesseraError(f"task '{t.name}': images have {t.channels} channels but {vlm.name}'s encoder "
                                   f"takes {v.channels}")
            seq = t.llm_seq_len(vlm)
            if seq > vlm.config.llm.max_seq_len:
                raise TesseraError(f"task '{t.name}': {seq} LLM tokens per sample exceed the LLM's "
                                   f"max_seq_len {vlm.config.llm.max_seq_len}")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc and not msg.startswith("task") else msg


def parse_tasks(data, source: str = "tasks") -> MultiTaskWorkload:
    if not isinstance(data, dict) or "tasks" not in data:
        raise TesseraError(f"{source}: expected a mapping with a 'tasks' list")
    try:
        return MultiTaskWorkload.model_validate(data)
    except ValidationError as e:
        raise TesseraError(f"{source}: {_first_error(e)}") from None


def load_tasks(path: str | Path) -> MultiTaskWorkload:
    p = Path(path)
    if not p.is_file():
        raise TesseraError(f"task file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text())  # YAML is a superset of JSON
    except yaml.YAMLError as e:
        raise TesseraError(f"task file {p} is not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_tasks(data, f"task file {p}")
