"""CPU pinning of local ranks (`TESSERA_PIN_CPU=1`)."""
import os

import pytest

from tessera.runtime import affinity
from tessera.runtime.affinity import core_share, host_cores, pin_cpu_rank


def test_core_shares_are_disjoint_blocks_or_round_robin():
    cores = [4, 5, 6, 7, 0, 1, 2, 3]
    assert [core_share(r, 4, cores) for r in range(4)] == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]
    assert [core_share(r, 3, cores) for r in range(3)] == [{0, 1}, {2, 3}, {4, 5}]  # 2 left idle
    assert [core_share(r, 4, [0, 1]) for r in range(4)] == [{0}, {1}, {0}, {1}]  # oversubscribed
    with pytest.raises(ValueError, match="local rank 4 is not in 0..3"):
        core_share(4, 4, cores)
    with pytest.raises(ValueError, match="no cores to share"):
        core_share(0, 1, [])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_pinning_only_when_asked_under_torchrun():
    before = os.sched_getaffinity(0)
    try:
        assert pin_cpu_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}) is None  # not asked
        assert pin_cpu_rank({"TESSERA_PIN_CPU": "1"}) is None  # not under torchrun
        share = pin_cpu_rank({"TESSERA_PIN_CPU": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(len(before))})
        assert share == {min(before)} and os.sched_getaffinity(0) == share
        assert host_cores() == len(before)  # what the ranks share, not this rank's own core
    finally:
        os.sched_setaffinity(0, before)
        affinity._host_cores = None


def test_a_bad_pin_setting_is_one_line_from_the_cli(monkeypatch, capsys):
    from tessera.cli import main

    monkeypatch.setenv("TESSERA_PIN_CPU", "yes")
    assert main(["plan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tessera plan: error: TESSERA_PIN_CPU must be 1 (pin each rank to its cores) or 0, got 'yes'"
