"""Reading a checkpoint never runs code: the restricted readers on real DCP files and on crafted
ones (a single process, no process group)."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from worker.ckpt import rng, safe_load, storage
from worker.ckpt.resume import _problem


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_rng_records_are_json_and_restore_exactly():
    torch.manual_seed(1), np.random.seed(2), random.seed(3), random.gauss(0, 1)
    record = json.loads(json.dumps(rng.capture("cpu")))
    drawn = (torch.rand(4), np.random.rand(4), random.random(), random.gauss(0, 1))
    rng.restore(record)
    again = (torch.rand(4), np.random.rand(4), random.random(), random.gauss(0, 1))
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1])
    assert drawn[2:] == again[2:]


def test_an_older_checkpoint_s_pickled_rng_still_restores():
    old = base64.b64encode(pickle.dumps(rng.states("cpu"))).decode()
    drawn = (torch.rand(4), np.random.rand(4))
    rng.restore(old)
    assert torch.equal(drawn[0], torch.rand(4)) and np.array_equal(drawn[1], np.random.rand(4))


def test_a_crafted_rng_record_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    crafted = base64.b64encode(pickle.dumps({"torch": RunsCode(marker)})).decode()
    with pytest.raises(safe_load.UnsafeCheckpoint, match="posix.system|os.system"):
        rng.restore(crafted, "meta.json (rank 1)")
    with pytest.raises(safe_load.UnsafeCheckpoint, match="not a generator record"):
        rng.restore({"format": rng.FORMAT, "torch": 5})
    assert not marker.exists()


def test_real_dcp_files_load_through_the_restricted_readers(tmp_path):
    state = {"w": torch.arange(6.0).reshape(2, 3), "lr": 0.25, "betas": (0.9, 0.95)}
    dcp.save(state, storage_writer=storage.writer(tmp_path), no_dist=True)
    md = safe_load.load_metadata(tmp_path / ".metadata")
    assert set(md.state_dict_metadata) == {"w", "lr", "betas"}
    out = {"w": torch.zeros(2, 3), "lr": 0.0, "betas": (0.0, 0.0)}
    dcp.load(out, storage_reader=storage.reader(tmp_path), planner=safe_load.SafeLoadPlanner(),
             no_dist=True)  # fmt: skip
    assert torch.equal(out["w"], state["w"]) and out["lr"] == 0.25 and out["betas"] == (0.9, 0.95)


def test_crafted_dcp_metadata_and_byte_records_are_refused(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    with pytest.raises(safe_load.UnsafeCheckpoint, match="no checkpoint holds"):
        safe_load.load_metadata(tmp_path / ".metadata")
    record = io.BytesIO()
    torch.save(RunsCode(marker), record)
    record.seek(0)

    class Item:
        class dest_index:  # noqa: N801 - the shape of DCP's ReadItem
            fqn = "optim.param_groups.0.lr"

    with pytest.raises(safe_load.UnsafeCheckpoint, match="optim.param_groups.0.lr"):
        safe_load.SafeLoadPlanner().load_bytes(Item, record)
    assert not marker.exists()


def test_resume_treats_a_crafted_checkpoint_as_damaged(tmp_path):
    step = tmp_path / "step-6"
    step.mkdir()
    marker = tmp_path / "ran"
    meta = {"files": {}, "rng": [rng.capture("cpu"), base64.b64encode(b"\x80junk").decode()]}
    (step / "meta.json").write_text(json.dumps(meta))
    problem = _problem(step, check_crc=False)
    assert problem is not None and "refused" in problem and "(rank 1)" in problem
    meta["rng"] = [rng.capture("cpu")]
    (step / "meta.json").write_text(json.dumps(meta))
    assert _problem(step, check_crc=False) is None
    (step / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    assert "refused" in (_problem(step, check_crc=False) or "")
    assert not marker.exists()
