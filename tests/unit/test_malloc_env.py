"""The ranks' huge-pages setting (supervisor/launch/malloc_env.py)."""

import os
import subprocess

import pytest

from supervisor.launch.malloc_env import HUGE_PAGES, huge_pages_env


def test_added_when_wanted_and_nothing_said():
    assert huge_pages_env(True, {}, {}) == {"GLIBC_TUNABLES": HUGE_PAGES}


def test_off_adds_nothing():
    assert huge_pages_env(False, {}, {}) == {}


def test_the_users_other_tunables_are_kept():
    inherited = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert huge_pages_env(True, {}, inherited) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    }
    launch = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    assert huge_pages_env(True, launch, inherited) == {
        "GLIBC_TUNABLES": f"glibc.malloc.tcache_count=0:{HUGE_PAGES}"
    }


def test_a_hugetlb_setting_of_the_users_wins():
    assert huge_pages_env(True, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, {}) == {}
    assert huge_pages_env(True, {}, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=2"}) == {}


@pytest.mark.parametrize(
    ("users", "added"),
    [
        ("", True),
        ("glibc.malloc.arena_max=2:", True),  # a trailing colon: an empty entry glibc skips
        ("glibc.malloc.hugetlbx=1", True),  # another name that begins the same
        ("glibc.rtld.x=glibc.malloc.hugetlb", True),  # the name inside another's value
        ("glibc.malloc.hugetlb", True),  # no value: glibc sets nothing
        ("a=1::glibc.malloc.hugetlb=0", False),
    ],
)
def test_odd_tunables_of_the_users_are_read_as_glibc_reads_them(users, added):
    merged = f"{users}:{HUGE_PAGES}" if users else HUGE_PAGES
    assert huge_pages_env(True, {"GLIBC_TUNABLES": users}, {}) == (
        {"GLIBC_TUNABLES": merged} if added else {}
    )


LD_SO = "/lib64/ld-linux-x86-64.so.2"


@pytest.mark.skipif(not os.path.exists(LD_SO), reason="glibc's x86-64 loader")
@pytest.mark.parametrize(
    "users",
    ["glibc.malloc.arena_max=2:", "glibc.rtld.x=glibc.malloc.hugetlb", "glibc.malloc.hugetlb"],
)
def test_glibc_itself_reads_huge_pages_on_after_the_users_tunables(users):
    """The loader's own account of the tunables it was given (`--list-tunables`)."""
    env = {**os.environ, **huge_pages_env(True, {"GLIBC_TUNABLES": users}, {})}
    listed = subprocess.run(
        [LD_SO, "--list-tunables"], env=env, capture_output=True, text=True, check=False
    ).stdout
    if "glibc.malloc.hugetlb" not in listed:
        pytest.skip("a glibc without the hugetlb tunable")
    assert "glibc.malloc.hugetlb: 0x1 " in listed
