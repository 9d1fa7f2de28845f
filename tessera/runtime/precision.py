"""Number formats on the device: bf16 mixed precision, TF32 for fp32 runs, and the peak MFU uses.

- Layers under FSDP2 (every plan but plain data parallelism): `MixedPrecisionPolicy` with
  `param_dtype=bf16, reduce_dtype=fp32`. The fp32 master shards are gathered and cast to bf16 for
  the forward and backward; gradients are reduced in fp32 and land on the fp32 shards AdamW updates.
- DDP and one-rank plans (`uses_ddp`): fp32 weights under `torch.autocast(bf16)`. Matmuls and SDPA
  run in bf16; softmax, norms and the loss in fp32 (autocast's op lists). The residual stream stays
  fp32 because the embedding output is fp32.
- On both paths the loss is taken on fp32 logits (`ParallelLoss` casts them), and backward runs
  outside autocast.
- fp32 on CUDA: TF32 tensor cores for matmuls and cuDNN (`allow_tf32`), so MFU divides by the
  device's tf32 peak (`peak_dtype`).
- fp16 is refused on CUDA: it needs loss scaling, which the runtime does not do.
- CPU runs fp32 (the CPUs this runs on have no fast bf16 matmul).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from ..errors import TesseraError

_LOW_PRECISION = {"bf16": torch.bfloat16}


def compute_dtype(workload_dtype: str, device_type: str) -> str:
    """The dtype a run actually computes in: the workload's on CUDA, fp32 elsewhere."""
    if device_type != "cuda":
        return "fp32"
    if workload_dtype == "fp16":
        raise TesseraError("workload.dtype fp16 needs loss scaling, which the runtime does not do; use bf16")
    return workload_dtype


def configure_matmul(device_type: str, dtype: str) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions on CUDA (a process-wide setting)."""
    if device_type == "cuda" and dtype == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def peak_dtype(dtype: str, device_type: str) -> str:
    """The `DeviceSpec.peak_flops` key the run's matmuls reach: tf32 for fp32 on CUDA with TF32 on."""
    if device_type == "cuda" and dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return dtype


def fsdp_mixed_precision(dtype: str):
    """FSDP2's policy for `dtype`: low-precision parameters, fp32 gradient reduction; None for fp32."""
    if dtype not in _LOW_PRECISION:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=_LOW_PRECISION[dtype], reduce_dtype=torch.float32)


def autocast(device_type: str, dtype: str):
    """A reusable autocast context for the forward and loss of the DDP path (no-op for fp32)."""
    if dtype not in _LOW_PRECISION:
        return nullcontext()
    return torch.autocast(device_type, dtype=_LOW_PRECISION[dtype])
