"""`benchmarks/gpu_mfu.py --tiny` (the CPU mode of the single-GPU MFU benchmark) runs end to end:
a table per model with both loops, every timed step, and the summary line; both loops train the
same model on the same batches, so their losses agree."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_mode_prints_both_loops_and_the_summary():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_mfu.py"), "--tiny", "--steps", "2"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for model in ("tiny-gpt2", "tiny-llama"):
        assert f"\n{model} (" in out
    rows = re.findall(r"^(baseline|tessera)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d,]+)\s+([\d.]+)%", out, re.M)
    assert [r[0] for r in rows] == ["baseline", "tessera"] * 2
    for _, median, low, high, tokens_per_s, mfu in rows:
        assert 0 < float(low) <= float(median) <= float(high)
        assert float(tokens_per_s.replace(",", "")) > 0 and float(mfu) > 0
    steps = re.findall(r"^  (baseline|tessera) steps \(ms\): ([\d. ]+); last loss ([\d.]+)", out, re.M)
    assert len(steps) == 4 and all(len(s[1].split()) == 2 for s in steps)
    for base, ours in zip(steps[0::2], steps[1::2]):
        assert abs(float(base[2]) - float(ours[2])) < 1e-2
    summary = out.strip().splitlines()[-1]
    m = re.fullmatch(r"summary: gpu=cpu mfu_124m=([\d.]+) mfu_1b=([\d.]+) "
                     r"overhead_pct_124m=(-?[\d.]+) overhead_pct_1b=(-?[\d.]+)", summary)
    assert m, summary
