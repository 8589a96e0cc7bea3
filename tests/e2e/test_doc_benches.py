"""The bench commands of docs/benchmarks.md that run in a minute or so, run for real as the page
shows them (the ones it calls quick, but for those of MINUTES, and those that take seconds): each
must exit as the page says and print what it measured. The page's other commands take many
minutes (or the test bed); tests/unit/test_doc_commands.py runs their arguments through each
bench's parser."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.support import REPO, supervisor_env
from tests.unit.test_doc_commands import BENCH, DocCommand

SECONDS = {"bench/fault_loop_lag.py", "bench/flood.py"}  # whole runs of seconds
# Quick on the page, but a minute or more here (soak.py's quick run 3 min, ckpt.py's 2,
# stragglers.py's 1.7, whose slow rank named and replaced is test_stragglers_e2e's, step.py's
# 0.85, whose layouts train in the checkpoint and standby tests): the slow tier's budget goes to
# what no other test checks; their arguments go through their parsers still.
MINUTES = {"bench/soak.py", "bench/ckpt.py", "bench/stragglers.py", "bench/step.py"}


def short_commands() -> list[DocCommand]:
    """The page's quick commands and those of SECONDS, each once (a record repeats its command)."""
    found: dict[tuple[str, ...], DocCommand] = {}
    for c in BENCH:
        argv = tuple(shlex.split(c.text, comments=True))
        quick = re.search(r"#.*\bquick\b", c.text) or argv[1] in SECONDS
        quick = quick and argv[1] not in MINUTES
        if c.page == "docs/benchmarks.md" and quick and "[" not in c.text:
            found.setdefault(argv, c)
    return list(found.values())


SHORT = short_commands()


def test_the_short_commands_are_found():
    scripts = {c.text.split()[1] for c in SHORT}
    assert {"bench/memtier.py", *SECONDS} <= scripts


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cmd", SHORT, ids=lambda c: c.text.split("#")[0].strip())
def test_a_short_bench_command_of_the_docs_runs(cmd: DocCommand):
    argv = shlex.split(cmd.text, comments=True)[1:]
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, env=supervisor_env(), capture_output=True, text=True,
        timeout=840,
    )  # fmt: skip
    assert proc.returncode == cmd.expect, (
        f"{cmd.id}: `{cmd.text}` exited {proc.returncode}:\n{proc.stdout[-2000:]}"
        f"{proc.stderr[-3000:]}"
    )
    assert proc.stdout.strip(), f"{cmd.id}: `{cmd.text}` printed nothing"
