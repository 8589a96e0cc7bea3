"""The memory tier's threads' CPU: counted from /proc per thread, kept when a thread ends, and
charged to a copy when the state lives on CPU."""

from __future__ import annotations

import threading
import time

import torch

from tests.unit.tier_support import cpu_tier, trained_linear
from worker.ckpt.memory import tier
from worker.ckpt.memory.thread_cpu import ThreadCpu, cpu_sharers, runtime_s

SPIN_S = 0.05


def spin(cpu: ThreadCpu, retire: bool, spun: threading.Event, end: threading.Event) -> None:
    cpu.add_current()
    started = time.thread_time()
    while time.thread_time() - started < SPIN_S:
        pass
    spun.set()
    end.wait(10)
    if retire:
        cpu.retire_current()


def test_a_thread_s_cpu_counts_and_stays_counted_once_it_ended():
    cpu = ThreadCpu()
    assert cpu.seconds() == 0.0
    # Retired as it ends; or found gone at the next reading (counted as last read, alive).
    for retire in (True, False):
        before = cpu.seconds()
        spun, end = threading.Event(), threading.Event()
        thread = threading.Thread(target=spin, args=(cpu, retire, spun, end))
        thread.start()
        assert spun.wait(10)
        alive = cpu.seconds()
        assert alive - before >= 0.8 * SPIN_S
        end.set()
        thread.join()
        assert cpu.seconds() >= alive  # never goes back
    assert runtime_s(threading.get_native_id()) is not None  # this host has /proc


def test_a_copy_on_cpu_reports_what_the_tier_s_threads_ran(tmp_path):
    t = cpu_tier(tmp_path, *trained_linear())
    assert t.cpu_charged
    spent = []
    for step in (1, 2):
        t.save(step, step, {})
        assert t._copied.wait(30)  # the copy thread and its worker did the whole copy
        deadline = time.monotonic() + 30
        while t.sealed != step and time.monotonic() < deadline:
            time.sleep(0.01)
        report = t.wait_copied()
        spent.append(report.background_seconds)
        assert report.cpu_sharers == 1  # the one rank of its group on this host
    t.close(remove=False)
    assert all(s > 0 for s in spent), spent


def test_the_ranks_that_keep_a_host_s_cores_busy_all_count():
    """Ranks that fill the cores: each one's tier CPU holds all of them up (the ranks on the
    host count); cores to spare: one rank's CPU stands for the copy."""
    assert cpu_sharers(3, 1, 2) == 3  # the mixed soak's 3 ranks on 2 cores
    assert cpu_sharers(2, 1, 2) == 2
    assert cpu_sharers(4, 8, 32) == 4  # 4 ranks of 8 threads: every core
    assert cpu_sharers(1, 2, 2) == 1  # one rank alone: its own CPU
    assert cpu_sharers(2, 1, 8) == 1  # cores to spare
    assert cpu_sharers(0, 1, 1) == 1


def test_a_state_on_a_device_is_not_charged():
    assert tier._on_cpu(torch.nn.Linear(2, 2))
    assert not tier._on_cpu(torch.nn.Linear(2, 2, device="meta"))
