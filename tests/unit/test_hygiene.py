"""Node hygiene (issue 17): what an attempt leaves on its node, and what removes it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from supervisor.host import hygiene
from supervisor.launch.processes import kill_order
from worker.dist import mpi_shm_paths, release_mpi_shm

MAPS = """\
7f0000000000-7f0000204000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_5d7aebab_0
7f0000300000-7f0000304000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_5d7aebab_0
7f0000400000-7f0000404000 rw-s 00000000 00:1a 124 /dev/shm/mpich_vci_5d7aebab_0
7f0000500000-7f0000504000 rw-s 00000000 00:1a 125 /dev/shm/es-mem-job-1/rank-0/slot-0.bin
7f0000600000-7f0000604000 rw-s 00000000 00:1a 126 /dev/shm/mpich_shm_0bad_1 (deleted)
7f0000700000-7f0000704000 r-xp 00000000 08:01 127 /usr/lib/libmpi.so.12
7f0000800000-7f0000804000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
"""


def test_mpi_shm_paths_are_mpichs_own_segments_once_each():
    assert mpi_shm_paths(MAPS) == [
        "/dev/shm/mpich_shm_5d7aebab_0",
        "/dev/shm/mpich_vci_5d7aebab_0",
    ]  # not the memory tier's slots, not one already unlinked, not a library


def test_release_unlinks_the_names_it_maps_and_tolerates_a_peer_first(tmp_path: Path):
    seg, peer, other = tmp_path / "mpich_shm_1_0", tmp_path / "mpich_vci_1_0", tmp_path / "keep"
    seg.write_bytes(b"x")
    other.write_bytes(b"y")
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f00-7f01 rw-s 0 00:1a 1 {seg}\n7f02-7f03 rw-s 0 00:1a 2 {peer}\n"
        f"7f04-7f05 rw-s 0 00:1a 3 {other}\n"
    )  # `peer` is already gone: another local rank unlinked it
    assert release_mpi_shm(str(maps)) == [str(seg)]
    assert not seg.exists() and other.exists()
    assert release_mpi_shm(str(tmp_path / "missing")) == []


# --- the supervisor's side ------------------------------------------------------------------------
def test_stage_dir_is_the_workers_default_under_the_supervisor(tmp_path: Path):
    from worker.ckpt.async_save import default_stage_root

    env = {"TMPDIR": str(tmp_path)}
    flags = {"async_ckpt": True, "ckpt_dir": "/ckpt"}
    assert hygiene.stage_dir(flags, env, "job-0123abcd") == str(tmp_path / "es-ckpt-job-0123abcd")
    with pytest.MonkeyPatch.context() as mp:  # the worker's own answer, in the ranks' env
        mp.setattr(tempfile, "tempdir", None)
        mp.setenv("TMPDIR", str(tmp_path))
        for job in ("job-0123abcd", "a/../b"):  # an odd id: both hash it alike
            assert str(default_stage_root("/ckpt", job)) == hygiene.stage_dir(flags, env, job)
    assert hygiene.stage_dir({"async_ckpt": False}, env, "job-1") is None
    assert hygiene.stage_dir({**flags, "ckpt_stage_dir": "/scratch/x"}, env, "job-1") is None
    assert hygiene.temp_dir({"TMPDIR": str(tmp_path / "missing")}) == tempfile.gettempdir()


def test_orphans_are_the_candidates_nothing_holds():
    assert hygiene.orphans(["/a", "/b", "/c"], {"/b", "/x"}) == ["/a", "/c"]


def test_kill_order_spares_the_launcher_and_its_children_for_last():
    # mpiexec 10 -> proxy 11 -> ranks 12, 13 (one with a child 14); 20: an orphan rank
    parents = {10: 1, 11: 10, 12: 11, 13: 11, 14: 13, 20: 1}
    assert kill_order(parents, [10]) == ([12, 13, 14, 20], [10, 11])
    assert kill_order({12: 11, 13: 11}, [10]) == ([12, 13], [])  # the launcher is gone
    assert kill_order(parents, []) == ([10, 11, 12, 13, 14, 20], [])  # local: ranks only


def test_sweep_removes_only_this_users_unheld_files(tmp_path: Path):
    shm, hydra = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    hydra.mkdir()
    orphan = shm / "mpich_shm_1_0"
    held = shm / "mpich_shm_2_0"
    other = shm / "es-mem-job"  # not MPICH's
    xml = hydra / "hydra_hwloc_xmlfile_abc"
    for f in (orphan, held, xml):
        f.write_bytes(b"x")
    other.mkdir()
    (shm / "mpich_vci_3_0").symlink_to(held)  # never followed nor removed
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        roots = [(str(shm), hygiene.SHM_PREFIXES), (str(hydra), hygiene.HYDRA_PREFIXES)]
        assert hygiene.sweep(roots, min_age_s=60) == []  # too young: maybe a starting job's
        assert hygiene.sweep(roots, min_age_s=0) == sorted([str(orphan), str(xml)])
        assert held.exists() and other.exists() and (shm / "mpich_vci_3_0").is_symlink()
    finally:
        holder.kill()
        holder.wait(timeout=10)
    assert hygiene.sweep(roots, min_age_s=0) == [str(held)]  # its holder is gone


HOLD = "import sys, time\nf = open(sys.argv[1])\nprint('holding', flush=True)\ntime.sleep(120)\n"


def test_a_teardown_removes_the_segments_its_ranks_still_mapped(tmp_path: Path):
    proc = tmp_path / "proc"
    (proc / "11").mkdir(parents=True)
    (proc / "11" / "maps").write_text(
        "7f0-7f1 rw-s 0 00:1 5 /dev/shm/mpich_shm_9_0\n"
        "7f1-7f2 rw-s 0 00:1 6 /dev/shm/mpich_vci_9_0 (deleted)\n"  # unlinked by its rank
        "7f2-7f3 r-xp 0 08:1 7 /usr/lib/libc.so.6\n"
        "7f3-7f4 rw-s 0 00:1 8 /dev/shm/es-mem-job/rank-0/slot-0.bin\n"  # the memory tier's
    )
    assert hygiene.mapped_segments([11, 12], str(proc)) == {"/dev/shm/mpich_shm_9_0"}
    left, held = tmp_path / "mpich_shm_1_0", tmp_path / "mpich_shm_2_0"
    for f in (left, held):
        f.write_bytes(b"x")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(held)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        gone = str(tmp_path / "mpich_shm_3_0")
        assert hygiene.remove_unheld([str(left), str(held), gone]) == [str(left)]
        assert held.exists() and not left.exists()
    finally:
        holder.kill()
        holder.wait(timeout=10)
