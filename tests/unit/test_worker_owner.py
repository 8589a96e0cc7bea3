"""The worker's side of one job per checkpoint dir: a job that is just ending is waited for."""

from __future__ import annotations

import os
import threading

import pytest

from contracts import locks
from worker.ckpt import owner
from worker.errors import UsageError


def test_a_lock_let_go_within_the_wait_is_no_refusal(tmp_path):
    fd = locks.lock_dir(tmp_path, {"job": "ending", "host": "h", "pid": 1})
    threading.Timer(0.3, os.close, (fd,)).start()  # the job ends as this one starts
    owner.refuse_if_owned(tmp_path, wait_s=5.0)


def test_a_lock_still_held_after_the_wait_is_refused_naming_its_job(tmp_path):
    fd = locks.lock_dir(tmp_path, {"job": "other-job", "host": "h", "pid": 77})
    try:
        with pytest.raises(UsageError, match="in use by job other-job .pid 77 on h."):
            owner.refuse_if_owned(tmp_path, wait_s=0.2)
    finally:
        os.close(fd)
