"""The memory instrumentation: saved activations counted once per storage, live, without parameters."""
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tessera.profile.measure.memory import SavedActivationMeter, model_state_bytes


def test_saved_activations_are_counted_once_and_released_after_backward():
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, requires_grad=True)
    meter = SavedActivationMeter(lin)
    with meter.track():
        h = lin(x)  # saves x (and the weight: excluded)
        y = torch.tanh(h)  # saves its output y
        z = (y * y).sum()  # saves y twice: one storage
        assert meter.live_bytes == x.nbytes + y.nbytes
        z.backward()
    assert meter.peak_bytes == x.nbytes + y.nbytes
    del h, y, z
    assert meter.live_bytes == 0


def test_checkpointed_module_counts_only_its_kept_input():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x = torch.randn(4, 32, requires_grad=True)
    plain = SavedActivationMeter(block)
    with plain.track():
        block(x).sum().backward()
    wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
    meter = SavedActivationMeter(wrapped)
    with meter.track():
        out = wrapped(x)
        kept = meter.live_bytes
        out.sum().backward()
    assert kept == x.nbytes and plain.peak_bytes > 4 * x.nbytes


def test_model_state_bytes_counts_params_grads_and_optimizer_state():
    model = nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters()) * 4
    assert model_state_bytes([model], [opt]) == {"params": n, "grads": n, "optimizer": 2 * n}


def test_allocator_window_counts_what_is_built_inside_and_its_peak_in_the_measured_step():
    from tessera.profile.measure.validate import AllocatorWindow

    before = torch.ones(1 << 20)  # 4 MiB allocated before the window: not the plan's
    n = 256 * 1024  # 1 MiB of fp32
    with AllocatorWindow(torch.device("cpu")) as window:
        kept = torch.zeros(n)  # built inside: counted throughout
        transient = torch.zeros(4 * n)  # freed before the measured step: not in its peak
        del transient
        with window.measured():
            scratch = [torch.zeros(2 * n), torch.zeros(n)]  # 3 MiB on top of `kept`
            del scratch
            small = torch.zeros(n // 4)
        del small, before
    assert window.peak_bytes == 4 * n * 4
    assert kept.numel() == n


def test_a_block_freed_on_a_thread_the_profiler_does_not_watch_leaves_the_peak_when_reused():
    """The CPU allocator reports only what profiled threads free: a tensor a gloo thread drops is
    never taken off its running total. Its address handed out again shows it was freed."""
    from tessera.profile.measure.validate import live_peak

    MiB = 2**20
    events = [(0, 0xA, 8 * MiB),  # model states, built before the step
              (1, 0xB, 4 * MiB),  # a collective's buffer; its free happens on another thread (no event)
              (10, 0xB, 2 * MiB),  # inside the step: 0xB handed out again, so the 4 MiB block was freed
              (11, 0xC, 1 * MiB),
              (12, 0xC, -1 * MiB),
              (30, 0xD, 16 * MiB)]  # after the window: not in it
    assert live_peak(events, (5, 20)) == 11 * MiB  # states + the reused block + 1 MiB of scratch
    assert live_peak(events, (0, 0)) == 8 * MiB  # only the first event is inside
    assert live_peak(events[:2], (5, 20)) == 12 * MiB  # no event inside: what was live when it opened
    assert live_peak([(0, 0xE, -3 * MiB)], (0, 5)) == 0.0  # a free of a block allocated before profiling

