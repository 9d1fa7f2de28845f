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
    # Gradients as stored and reduced between ranks. Tessera's runtime keeps them in fp32 (FSDP2's
    # MixedPrecisionPolicy reduces in fp32 onto fp32 shards; the DDP path keeps fp32 weights under
    # autocast), as Llama 3's training did; Megatron-LM's fp16 runs without
    # --accumulate-allreduce-grads-in-fp32 kept them in fp16. Either fp32 or the working dtype; the
    # runtime runs fp32 only (a lower one is a what-if of the cost model).
    grad_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="dtype gradients are stored and reduced in: fp32 or the working dtype")
    # Bytes of optimizer state per parameter: AdamW keeps fp32 master, momentum and variance.
    optimizer: Literal["adamw", "sgd"] = "adamw"

    @model_validator(mode="after")
    def _check(self) -> "Workload":
        if any(n <= 0 for n in self.seq_lens):
            raise ValueError("sequence lengths must be positive")
        if self.grad_dtype not in ("fp32", self.dtype):
            raise ValueError(f"grad_dtype {self.grad_dtype} must be fp32 or the working dtype {self.dtype}")
        return self

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter of the working weights (gradients: `grad_bytes`)."""
        return 4 if self.dtype == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of a gradient, stored and reduced (`grad_dtype`)."""
        return 4 if self.grad_dtype == "fp32" else 2

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of optimizer state incl. fp32 master weights (mixed precision)."""
        master = 0 if self.dtype == "fp32" else 4
        return master + (8 if self.optimizer == "adamw" else 0)
