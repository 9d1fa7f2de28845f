"""Launch a test script under real `torchrun` on gloo (few launches, many checks per launch).

A distributed test script lives in `tests/dist/`, runs its checks on every rank and exits non-zero
on the first failure; rank 0 prints one `CHECK <name> ok` line per passed check, so a failing
launch still shows which checks passed.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 600) -> str:
    """Run `torchrun --standalone --nproc-per-node nproc script args`; return its output or fail."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(script), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {Path(script).name} failed (exit {proc.returncode}):\n{out[-6000:]}")
    return out


def passed_checks(output: str) -> set[str]:
    return {line.split()[1] for line in output.splitlines() if line.startswith("CHECK ") and line.endswith(" ok")}
