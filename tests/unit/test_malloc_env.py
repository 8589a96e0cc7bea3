"""The ranks' huge-pages setting (supervisor/launch/malloc_env.py)."""

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
