"""The memory tier's threads' CPU: counted from /proc per thread, kept when a thread ends, and
charged to a copy when the state lives on CPU."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

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


def test_the_ranks_that_want_more_of_the_same_cores_than_there_are_all_count():
    """Ranks that want more of the cores they share than there are: each one's tier CPU holds
    all of them up; ranks that just fill them, cores to spare, or each rank pinned to cores of
    its own: one rank's CPU stands for the copy."""
    two, all64 = 0b11, (1 << 64) - 1
    assert cpu_sharers(two, 1, [two, two, two]) == 3  # the mixed soak's 3 ranks on 2 cores
    assert cpu_sharers(all64, 32, [all64] * 4) == 4  # 4 ranks of 32 threads on 64 cores
    assert cpu_sharers(two, 1, [two, two]) == 1  # the kills soak's 2 ranks on 2 cores
    assert cpu_sharers(all64, 16, [all64] * 4) == 1  # 4 ranks of 16 threads: just every core
    pinned = [((1 << 16) - 1) << (16 * k) for k in range(4)]  # each its own 16 cores
    assert cpu_sharers(pinned[1], 32, pinned) == 1
    assert cpu_sharers(two, 2, [two]) == 1  # one rank alone: its own CPU
    assert cpu_sharers((1 << 8) - 1, 1, [(1 << 8) - 1] * 2) == 1  # cores to spare
    assert cpu_sharers(two, 1, []) == 1


def test_a_rank_alone_in_its_group_counts_itself():
    """The collective that counts them (the job's ranks on the host, their cores), in a group
    of one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert tier.host_sharers() == 1
    finally:
        dist.destroy_process_group()


def test_a_state_on_a_device_is_not_charged():
    assert tier._on_cpu(torch.nn.Linear(2, 2))
    assert not tier._on_cpu(torch.nn.Linear(2, 2, device="meta"))
