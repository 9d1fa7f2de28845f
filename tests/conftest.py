"""Suite-wide settings: one intra-op thread (on a 2-core machine two threads are 5-30x slower,
see PLATFORM_NOTES), without importing torch for tests that do not need it."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_runtest_setup(item):
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)
