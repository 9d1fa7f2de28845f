"""How the model profiler times a run: windows of runs in a row, on a fake clock (one process)."""
import pytest

from tessera.profile.measure import model as profiler


class _FakeRunner:
    """A run whose forward and backward take `fwd` and `bwd` seconds of the fake clock."""

    def __init__(self, clock: list[float], fwd: float, bwd: float):
        self.clock, self.fwd, self.bwd, self.runs = clock, fwd, bwd, 0

    def forward(self) -> None:
        self.clock[0] += self.fwd
        self.runs += 1

    def backward(self) -> None:
        self.clock[0] += self.bwd


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: now[0])
    return now


def test_a_timing_window_averages_as_many_runs_as_fill_it(clock):
    import torch

    cpu = torch.device("cpu")
    short, long = _FakeRunner(clock, 0.01, 0.02), _FakeRunner(clock, 0.4, 0.8)
    # 0.3 s: ten runs of the 0.03 s runner; the 1.2 s runner is longer than the window, so one.
    times = profiler._time_interleaved([short, long], cpu, reps=2, window_s=0.3)
    assert [r.runs for r in (short, long)] == [1 + 1 + 2 * 10, 1 + 1 + 2 * 1]  # warm-up, sizing, samples
    (sf, sb), (lf, lb) = times
    assert sf == pytest.approx([0.01, 0.01]) and sb == pytest.approx([0.02, 0.02])
    assert lf == pytest.approx([0.4, 0.4]) and lb == pytest.approx([0.8, 0.8])
    # No window: one run per sample, none to size it.
    one = _FakeRunner(clock, 0.01, 0.02)
    profiler._time_interleaved([one], cpu, reps=3)
    assert one.runs == 1 + 3
    assert profiler.time_sample(one, cpu, runs=4) == pytest.approx((0.01, 0.02)) and one.runs == 8
    with pytest.raises(ValueError, match=r"a timing window cannot be negative, got -0.5 s"):
        profiler.runs_filling([one], cpu, -0.5)


def test_wider_tensor_parallel_is_measured_on_whole_groups_within_a_node():
    from tessera.spec.model import TransformerConfig

    def cfg(heads, kv, ffn=688):
        return TransformerConfig(name="m", hidden=256, num_layers=2, num_heads=heads, num_kv_heads=kv,
                                 ffn_hidden=ffn, vocab_size=512, max_seq_len=64)

    assert profiler.wide_tp_degrees(cfg(8, 8), world=16, local_world=8) == [4, 8]
    assert profiler.wide_tp_degrees(cfg(8, 4), world=8, local_world=8) == [4]  # 4 KV heads: not over 8
    assert profiler.wide_tp_degrees(cfg(8, 8, ffn=690), world=8, local_world=8) == []  # MLP not divisible
    assert profiler.wide_tp_degrees(cfg(8, 8), world=12, local_world=6) == []  # a group of 4 would span nodes
    assert profiler.wide_tp_degrees(cfg(8, 8), world=2, local_world=2) == []
