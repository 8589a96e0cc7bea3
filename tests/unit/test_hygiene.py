"""Node hygiene (issue 17): what an attempt leaves on its node, and what removes it."""

from __future__ import annotations

from pathlib import Path

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
