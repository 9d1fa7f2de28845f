"""glibc's allocator kept in one regime (`TESSERA_STEADY_MALLOC`, runtime/host_malloc.py)."""
import platform
import subprocess
import sys

import pytest

from tessera.runtime.host_malloc import steady_host_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_not_applied_when_switched_off_or_when_the_user_set_glibcs_own():
    assert steady_host_allocator({"TESSERA_STEADY_MALLOC": "0"}) is None
    assert steady_host_allocator({"MALLOC_MMAP_THRESHOLD_": "65536"}) is None
    assert steady_host_allocator({"MALLOC_TRIM_THRESHOLD_": "0"}) is None
    with pytest.raises(ValueError, match="TESSERA_STEADY_MALLOC must be 1 .* or 0, got 'on'"):
        steady_host_allocator({"TESSERA_STEADY_MALLOC": "on"})


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_freed_blocks_are_reused_not_returned_to_the_kernel():
    """A step that allocates three 16 MiB blocks (an LM head's logits and their gradients) and
    frees them: with glibc's dynamic thresholds the freed heap top (48 MiB, above the 32 MiB the
    trim threshold rose to) goes back to the kernel and every step faults its pages in again;
    with the thresholds fixed, the next step reuses them. In fresh processes, so that this
    one's allocator is not touched by the test."""
    probe = """
import ctypes, resource, sys
from tessera.runtime.host_malloc import steady_host_allocator
settings = steady_host_allocator({}) if sys.argv[1] == "steady" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 16 * 2**20
def step():
    blocks = [libc.malloc(n) for _ in range(3)]
    for b in blocks:
        ctypes.memset(b, 1, n)
    for b in blocks:
        libc.free(b)
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(settings is not None, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    faults = {}
    for mode in ("steady", "default"):
        out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True,
                             env={"PATH": "/usr/bin:/bin"}).stdout.split()
        assert out[0] == str(mode == "steady")
        faults[mode] = int(out[1])
    pages_per_step = 3 * 16 * 2**20 // 4096
    assert faults["steady"] < pages_per_step // 10
    assert faults["default"] >= 4 * pages_per_step * 0.9


def test_a_bad_setting_is_one_line_from_the_cli(monkeypatch, capsys):
    from tessera.cli import main

    monkeypatch.setenv("TESSERA_STEADY_MALLOC", "yes")
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tessera plan: error: TESSERA_STEADY_MALLOC must be 1 (fixed glibc malloc thresholds, "
                   "the default) or 0, got 'yes'")
