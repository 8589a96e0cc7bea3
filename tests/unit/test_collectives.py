"""worker.collectives: what ranks tell each other goes as JSON text, never as a pickle (the
multi-rank paths run in every e2e test that saves or resumes; here one rank's group)."""

from __future__ import annotations

import re

import pytest

from tests.support import REPO
from worker import collectives

VALUES = [
    None,
    "/ckpt/step-10",
    {"__0_0.distcp": 4_294_967_295, "ünïcode": [1.5, None, True]},
    [],
    {"format": "rng-json-1", "numpy": ["MT19937", [1, 2, 3], 624, 0, 0.0]},
]


def test_values_arrive_as_sent(one_rank_group):
    for value in VALUES:
        assert collectives.broadcast_json(value) == value
        assert collectives.all_gather_json(value) == [value]
        assert collectives.gather_json(value) == [value]


class _RunsCode:
    def __reduce__(self):
        return (print, ("ran",))


def test_what_only_a_pickle_could_carry_is_refused(one_rank_group):
    with pytest.raises(TypeError):
        collectives.all_gather_json(_RunsCode())


def test_no_pickling_collective_is_used():
    pickling = re.compile(
        r"\b(broadcast_object_list|all_gather_object|gather_object|scatter_object_list|"
        r"send_object_list|recv_object_list)\b"
    )
    for package in ("contracts", "worker", "supervisor", "faults"):
        for path in (REPO / package).rglob("*.py"):
            assert not pickling.search(path.read_text()), path
