"""An attempt's straggler watch (supervisor.run.stragglers) fed real messages: the event names
the slow rank and its node with what will be done, and a replacement falls due only once a
durable checkpoint newer than the finding is complete."""

from __future__ import annotations

from contracts import messages
from supervisor.run.stragglers import StragglerWatch
from supervisor.settings.loading import from_dict
from tests.support import BEACON_JOB as JOB

NODES = ["n0", "n1", "n2", "n3"]


def beat(rank: int, step: int, compute: float) -> dict:
    ident = messages.RankIdentity(JOB, 0, rank, 4, "h", 1)
    return ident.message("beat", 0.0, phase="train", step=step, compute=compute, wait=0.1)


def watch(action: str, spares: int, shrink: bool = False, last: int = 100):
    cfg = from_dict(
        {
            "stragglers": {"action": action},
            "restart": {"shrink": shrink},
            "worker": {"save_interval": 4, "train_iters": last},
        }
    )
    said: list[tuple[str, dict]] = []
    w = StragglerWatch(cfg, 4, NODES, lambda: spares, lambda e, **f: said.append((e, f)))
    return w, said


def run_steps(w: StragglerWatch, steps, ckpt=None) -> None:
    for step in steps:
        for rank in range(4):
            w.on_message(beat(rank, step, 0.3 if rank == 2 else 0.1))
        w.check(ckpt)


def test_a_replacement_waits_for_the_next_durable_checkpoint():
    w, said = watch("replace", spares=1)
    run_steps(w, range(1, 12), ckpt=8)
    (event, fields), *more = said
    assert not more and event == "straggler"
    assert (fields["ranks"], fields["node"], fields["action"]) == ([2], "n2", "replace")
    assert fields["step"] == 10 and fields["window"] == 10
    assert w.replacing is not None and not w.replace_due.is_set()  # checkpoint 8 is older
    w.check(12)
    assert w.replace_due.is_set()


def test_without_a_spare_or_shrink_it_is_reported_only():
    w, said = watch("replace", spares=0)
    run_steps(w, range(1, 14), ckpt=12)
    ((_, fields),) = said
    assert fields["action"] == "report" and fields["done"].startswith("reported only")
    assert w.replacing is None and not w.replace_due.is_set()


def test_off_means_nothing_is_scored():
    cfg = from_dict({"stragglers": {"enabled": False}})
    said: list = []
    w = StragglerWatch(cfg, 4, NODES, lambda: 1, lambda e, **f: said.append(e))
    run_steps(w, range(1, 20))
    assert said == [] and w.times.latest == {}
