"""The memory tier's threads' CPU: counted from /proc per thread, kept when a thread ends, and
charged to a copy when the state lives on CPU."""

from __future__ import annotations

import threading
import time

import torch

from tests.unit.tier_support import cpu_tier, trained_linear
from worker.ckpt.memory import tier
from worker.ckpt.memory.thread_cpu import ThreadCpu, runtime_s

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
        spent.append(t.wait_copied().background_seconds)
    t.close(remove=False)
    assert all(s > 0 for s in spent), spent


def test_a_state_on_a_device_is_not_charged():
    assert tier._on_cpu(torch.nn.Linear(2, 2))
    assert not tier._on_cpu(torch.nn.Linear(2, 2, device="meta"))
