"""Keep glibc's allocator in one regime for the whole run: `steady_host_allocator()`.

On a CPU, every tensor PyTorch allocates comes from glibc `malloc` (c10's `alloc_cpu`). glibc
serves a request above its mmap threshold with a fresh `mmap` and returns it to the kernel on
free, so the next step's tensor of that size page-faults and is zeroed again. The threshold is
dynamic: it starts at 128 KiB and rises to the size of any mmapped block freed (up to 32 MiB),
so whether a layer's activations are served from the heap or page-faulted in depends on what
the process happened to free before. Measured on the 2-core CI machine (2 ranks, fp32, the
fidelity benchmark's LLaMA at 2 x 512 tokens): a block's forward + backward took 90 ms with the
tensors on the heap and 144 ms with them mmapped, the LM head 89 ms and 125 ms; a model profile
had timed the head in the slow regime and the blocks in the fast one, and the training steps it
predicted ran in whichever regime their own history chose.

Setting the threshold explicitly turns the dynamic adjustment off (mallopt(3)): requests up to
32 MiB (glibc's largest threshold on 64-bit) always come from the heap, and a trim threshold of
1 GiB keeps freed heap memory for the next step instead of returning it after every free, as a
GPU's caching allocator keeps its blocks. Larger requests are mmapped as before. What the torch
allocator reports (the memory figures the cost model is checked against) is unchanged; the
process's resident size can stay up to its peak, which a training process reaches every step.

Applied by the CLI to every verb (before anything is allocated), on glibc only; a user who set
glibc's own `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` keeps them, and
`TESSERA_STEADY_MALLOC=0` leaves glibc's defaults alone.
"""
from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

ENV = "TESSERA_STEADY_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc malloc.h
MMAP_THRESHOLD = 32 * 2**20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: 4 MiB * sizeof(long)
TRIM_THRESHOLD = 2**30
_GLIBC_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def steady_host_allocator(environ: Mapping[str, str] = os.environ) -> dict[str, int] | None:
    """Fix glibc's mmap and trim thresholds (module docstring). Returns what was set, or None
    when nothing was: not asked (`TESSERA_STEADY_MALLOC=0`), the user's own glibc settings, or
    not glibc."""
    value = environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 1 (fixed glibc malloc thresholds, the default) or 0, got '{value}'")
    if value == "0" or any(v in environ for v in _GLIBC_VARS):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    settings = {"mmap_threshold": MMAP_THRESHOLD, "trim_threshold": TRIM_THRESHOLD}
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    return settings if ok else None
