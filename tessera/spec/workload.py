"""What one training step processes: batch size, sequence lengths, precision, optimizer."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .model import Frozen


class Workload(Frozen):
    """A step of `global_batch` sequences.

    Fixed length: `seq_len`. Variable length: `seq_lens` is a sample of real lengths (tokens);
    the static planner plans for `seq_len` (the cap the batches are packed to) and the adaptive
    planner (`tessera.adapt`) uses the sample.
    """

    global_batch: int = Field(gt=0, description="sequences per optimizer step")
    seq_len: int = Field(gt=0, description="tokens per sequence (or packing cap)")
    seq_lens: tuple[int, ...] = ()
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Bytes of optimizer state per parameter: AdamW keeps fp32 master, momentum and variance.
    optimizer: Literal["adamw", "sgd"] = "adamw"

    @model_validator(mode="after")
    def _check(self) -> "Workload":
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError("sequence lengths must be positive")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter of the working weights (and of gradients)."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of optimizer state incl. fp32 master weights (mixed precision)."""
        master = 0 if self.dtype == "fp32" else 4
        return master + (8 if self.optimizer == "adamw" else 0)
