"""The ranks' allocator setting: glibc's malloc asked for transparent huge pages.

Why: a killed rank's memory is freed by the kernel before its exit can be seen, and that is the
first part of every detection, shorter with huge pages (`bench/downtime.py`, with and without
them: docs/benchmarks.md). Torch's host tensors come from glibc's malloc, which marks its memory
for huge pages with this tunable; glibc that lacks it ignores it, and a kernel with transparent
huge pages off gives none. The user's own GLIBC_TUNABLES is kept, and a hugetlb setting of
theirs wins.
"""

from __future__ import annotations

from collections.abc import Mapping

NAME = "GLIBC_TUNABLES"
_HUGETLB = "glibc.malloc.hugetlb"
HUGE_PAGES = f"{_HUGETLB}=1"


def huge_pages_env(
    wanted: bool, launch_env: Mapping[str, str], inherited: Mapping[str, str]
) -> dict[str, str]:
    """Pure: what to add to the ranks' environment ({} when not `wanted` or already said)."""
    if not wanted:
        return {}
    current = launch_env.get(NAME, inherited.get(NAME, ""))
    if _HUGETLB in _names(current):
        return {}
    return {NAME: f"{current}:{HUGE_PAGES}" if current else HUGE_PAGES}


def _names(tunables: str) -> set[str]:
    """Pure: the tunables GLIBC_TUNABLES sets (`name=value` pairs split at colons, as glibc
    reads them: an empty or valueless entry sets none), not a name inside another's value."""
    return {entry.split("=", 1)[0] for entry in tunables.split(":") if "=" in entry}
