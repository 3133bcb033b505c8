"""Thread counts: fixed, or following the cores other processes leave free."""

import os
import subprocess
import sys
import time

import numba
import pytest

from edgemoe.threads import CpuSampler, ThreadGovernor, free_cores


def test_free_cores_count_what_other_processes_leave(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert free_cores(None, 2) == 2                        # nothing known: every core
    assert free_cores(0.1, 2) == 2 and free_cores(0.7, 2) == 1
    assert free_cores(1.0, 2) == 1 and free_cores(3.0, 2) == 1   # never below one thread
    assert free_cores(0.0, 1) == 1                         # never above the physical cores


def test_a_fixed_count_is_kept():
    ThreadGovernor(1).step()
    assert numba.get_num_threads() == 1
    with pytest.raises(ValueError, match="threads=0"):
        ThreadGovernor(0)


def test_our_own_cpu_time_is_not_counted_as_another_process(monkeypatch):
    readings = iter([(0.0, 1000, 300), (2.0, 1000 + 300, 300 + 100)])   # (time, machine busy, own) ticks
    monkeypatch.setattr(CpuSampler, "_read", staticmethod(lambda: next(readings)))
    sampler = CpuSampler()
    sampler.ticks_per_second = 100
    assert sampler.others_busy_cores() == pytest.approx(1.0)   # 300 busy ticks - our 100, over 2 s


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc")
def test_a_busy_process_is_seen():
    sampler = CpuSampler()
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.3)
        sampler.others_busy_cores()
        time.sleep(0.6)
        assert sampler.others_busy_cores() > 0.6
    finally:
        busy.kill()
        busy.wait()


def test_the_thread_limit_checked_on_the_command_line_is_numbas_pool():
    """--threads is checked before numba loads, from the same setting numba sizes its pool by."""
    import numba

    from edgemoe.options import kernel_thread_limit

    assert kernel_thread_limit() == numba.config.NUMBA_NUM_THREADS
