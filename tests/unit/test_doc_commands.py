"""Every shell command of README.md and docs/*.md that starts the supervisor (`python -m
supervisor ...`) or a bench (`python bench/...`) is run here, in a form that takes seconds and
reads the same words, and must exit as the page says (0, unless its comment says `exit N`):

- `run` and `experiment` with `--dry-run` (the config resolved and checked, the launch command
  built, nothing started); `validate`, `status`, `tail` and `report` as written (`tail -f`
  without `-f`, which follows until Ctrl-C), in this process. The real runs are other tests':
  the demo's in tests/e2e/test_demo.py, examples/minimal.toml's in tests/e2e/test_own_worker.py.
- a bench's arguments through the bench's own parser, up to its first `parse_args`
  (tests/bench_args.py): a flag it does not have, or a value its parser refuses, fails.
- a synopsis (`run CONFIG [--set KEY=VALUE]... [--dry-run]`): every optional part once, each
  alternative (`local|mpiexec`) in turn, the placeholders filled in (PLACEHOLDERS).
- a job script's `$VARIABLES` come from its own assignments. What cannot run here (PBS with
  PALS, a Slurm allocation) is in CANNOT_RUN_HERE, which says why and how far it is checked.

Commands come from fenced blocks (`bash`, and lines of untagged blocks that start with a command)
and from inline spans that hold a whole command (`python bench/intervals.py --seed 1`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from supervisor.commands import cli
from supervisor.launch.resolve import resolve
from supervisor.settings import loading, toml_dump
from tests.support import REPO, supervisor_env, synthetic_events, synthetic_metrics, write_run

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
VENV_BIN = str(Path(sys.executable).parent)

# A synopsis's placeholders; {run} and {out} are the test's own directories.
PLACEHOLDERS = {
    "CONFIG": "configs/debug.toml",
    "RUN_DIR": "{run}",
    "DIR": "{out}",
    "KEY=VALUE": "restart.max_restarts=3",  # harmless to a continued job too
    "KEY": "worker.train_iters",
    "NAME": "fault",
    "N": "5",
}
EXPERIMENT = {"CONFIG": "configs/experiments/restart.toml"}  # `experiment CONFIG`


@dataclass(frozen=True)
class NotHere:
    """A command for a place this host is not, and how far it is checked here."""

    why: str
    check: str  # "cli": run with `more`; "load": its config loaded (keys, types, values); "parse"
    more: tuple[str, ...] = ()  # overrides that stand in for what the place has
    variables: dict[str, str] = field(default_factory=dict)  # what the place's shell would set
    nodefile: bool = False  # a PBS_NODEFILE of three names that resolve on any host


_PALS = NotHere(
    "a PBS job script for Cray PALS, whose mpiexec is not here: MPICH's stands in for it "
    "(flavor auto), and three loopback names for the allocation's nodes",
    "cli",
    more=("--set", "launch.flavor=auto"),
    variables={"PALS_MPIEXEC": str(Path(VENV_BIN) / "mpiexec")},
    nodefile=True,
)
_SLURM = NotHere(
    "a Slurm batch script: srun needs an allocation (SLURM_JOB_ID), which this host has not; "
    "the config (the page's TOML block) is loaded and checked, not resolved",
    "load",
)
CANNOT_RUN_HERE = {
    'python -m supervisor validate "$CONFIG" "${SET[@]}"': _PALS,
    'python -m supervisor run "$CONFIG" "${SET[@]}"': _PALS,
    "python -m supervisor validate agpt2b-slurm.toml": _SLURM,
    "python -m supervisor run agpt2b-slurm.toml   # the batch shell's SIGTERM: a graceful stop": (
        _SLURM
    ),
    'python -m supervisor run job.toml   # launcher = "srun", nodes = "auto"': NotHere(
        "under salloc on the test bed's Slurm cluster; job.toml stands for the reader's own "
        "config: its flags are parsed",
        "parse",
    ),
}


@dataclass(frozen=True)
class DocCommand:
    page: str  # relative to the repository
    line: int
    text: str  # from `python` on, its comment included
    wrapper: str = ""  # what the page runs it under (`salloc ...`); `exec` is dropped
    variables: tuple[tuple[str, str], ...] = ()  # its block's assignments (`CONFIG=...`)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_bench(self) -> bool:
        return self.text.startswith("python bench/")

    @property
    def expect(self) -> int:
        said = re.search(r"#.*\bexits? (\d+)", self.text)
        return int(said.group(1)) if said else 0


_COMMAND = re.compile(r"\bpython (?:-m supervisor |bench/)")
_INLINE = re.compile(r"`(python (?:-m supervisor [a-z]+ [^`]+|bench/[^`]+))`")
_ASSIGN = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$")


def fenced_blocks(text: str) -> list[tuple[str, list[tuple[int, str]]]]:
    """(language, [(line number, line)]) of each fenced block of a page."""
    blocks: list[tuple[str, list[tuple[int, str]]]] = []
    current: list[tuple[int, str]] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current = []
                blocks.append((line[3:].strip(), current))
            else:
                current = None
        elif current is not None:
            current.append((n, line))
    return blocks


def doc_commands() -> list[DocCommand]:
    found: list[DocCommand] = []
    for page in PAGES:
        rel = str(page.relative_to(REPO))
        text = page.read_text()
        for lang, lines in fenced_blocks(text):
            if lang not in SHELL and lang != "":
                continue
            variables = tuple(
                (m.group(1), m.group(2)) for _, line in lines if (m := _ASSIGN.match(line.strip()))
            )
            for n, line in lines:
                s = line.strip().removeprefix("$ ")
                if lang == "" and not s.startswith(("python ", "exec ", "salloc ")):
                    continue  # a diagram or a sample of output
                for part in re.split(r"\s+&&\s+", s):
                    m = _COMMAND.search(part)
                    if m:
                        wrapper = part[: m.start()].strip()
                        wrapper = "" if wrapper == "exec" else wrapper
                        found.append(DocCommand(rel, n, part[m.start() :], wrapper, variables))
        for n, para in prose(text):
            found += [DocCommand(rel, n, m.group(1)) for m in _INLINE.finditer(para)]
    return found


def prose(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph outside fenced blocks, its lines joined (a code
    span may go on to the next line)."""
    out: list[tuple[int, str]] = []
    lines: list[str] = []
    start, fenced = 0, False
    for n, line in enumerate([*text.splitlines(), ""], 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.strip() and not lines:
            start = n
        if line.strip():
            lines.append(line.strip())
        elif lines:
            out.append((start, " ".join(lines)))
            lines = []
    return out


def bench_scripts() -> list[str]:
    """The benches docs/benchmarks.md has a section for."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    return [f"bench/{name}" for name in re.findall(r"^## (\w+\.py)$", text, re.M)]


def expanded(cmd: DocCommand, variables: dict[str, str]) -> list[list[str]]:
    """The command's words once per alternative, its optional parts given, its `$VARIABLES`
    and placeholders filled in (`{run}` and `{out}` left for the caller)."""
    text = cmd.text
    for _ in range(3):  # a variable's value may name another
        for name, value in variables.items():
            array = value[1:-1] if value.startswith("(") and value.endswith(")") else None
            text = text.replace(f'"${{{name}[@]}}"', array if array is not None else value)
            text = text.replace(f'"${name}"', value).replace(f"${name}", value)
    while True:  # [--set KEY=VALUE]... and [CONFIG]: given once (not 'faults=[]')
        done = re.sub(r"\[(-[^\[\]]*|[A-Z][A-Z_=]*)\](?:\.\.\.)?", r"\1", text)
        if done == text:
            break
        text = done
    words = [w for w in shlex.split(text, comments=True) if w != "..."]  # "and its flags"
    assert "|" not in words, f"{cmd.id}: a pipeline: {cmd.text}"
    filled = {**PLACEHOLDERS, **(EXPERIMENT if "experiment" in words[2:4] else {})}
    words = [filled.get(w, w) for w in words]
    choices = [w.split("|") if "|" in w and not w.startswith("-") else [w] for w in words]
    out = [list(c) for c in itertools.product(*choices)]
    for argv in out:
        bare = [w for w in argv if re.fullmatch(r"[A-Z][A-Z_]+", w) or "$" in w]
        assert not bare, f"{cmd.id}: {bare} in {cmd.text!r} is no placeholder the test knows"
    return out


COMMANDS = doc_commands()
SUPERVISOR = [c for c in COMMANDS if not c.is_bench]
BENCH = [c for c in COMMANDS if c.is_bench]


def test_the_pages_commands_are_found():
    """The scan sees what it must: the demo's command, a job script's, the synopses, benches."""
    texts = {c.text for c in COMMANDS}
    assert "python -m supervisor run configs/debug.toml" in texts  # the README's set-up line
    assert "python -m supervisor run examples/minimal.toml" in texts
    assert any(c.wrapper.startswith("salloc") for c in COMMANDS)
    assert {c.page for c in SUPERVISOR} >= {"README.md", "docs/supervisor.md", "docs/reports.md",
                                           "docs/configuration.md"}  # fmt: skip
    assert {c.text.split()[1] for c in BENCH} >= set(bench_scripts())
    assert len(SUPERVISOR) >= 25 and len(BENCH) >= 25, (len(SUPERVISOR), len(BENCH))


def test_the_list_of_what_cannot_run_here_is_used():
    wrapped = {c.text for c in COMMANDS if c.wrapper}
    assert wrapped <= set(CANNOT_RUN_HERE), f"a command under {wrapped}: say why it cannot run"
    unused = set(CANNOT_RUN_HERE) - {c.text for c in COMMANDS}
    assert not unused, f"CANNOT_RUN_HERE names commands no page has: {unused}"


# --- the supervisor ---------------------------------------------------------------------------
def continued_run(root: Path) -> Path:
    """A run dir as a stopped demo job leaves it (its resolved config, events that end
    INTERRUPTED, an attempt's metrics): `run --resume` continues it, `report` reads it."""
    cfg = loading.load("configs/debug.toml", [f"job.run_dir={root}"])
    events = [e for e in synthetic_events() if e["event"] not in ("done", "supervisor_exit")]
    events[0] = {**events[0], "job": "debug-1234abcd", "world": 2}
    events.append({**events[-1], "event": "supervisor_exit", "code": 5,
                   "code_name": "INTERRUPTED"})  # fmt: skip
    config = toml_dump.dumps(resolve(cfg).resolved_dict())
    return write_run(root, events, synthetic_metrics(), config)


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """A working directory like the repository's root (its configs and examples), in tmp_path,
    so that a run dir that `run` names (runs/NAME-TIME) would land here; the venv's mpiexec on
    PATH; no job's variables."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for name in ("configs", "examples"):
        (cwd / name).symlink_to(REPO / name)
    for page in PAGES:  # a page's whole job config, as the page saves it (NAME.toml)
        for lang, lines in fenced_blocks(page.read_text()):
            text = "\n".join(line for _, line in lines)
            name = tomllib.loads(text).get("job", {}).get("name") if lang == "toml" else None
            if name and f"`{name}.toml`" in page.read_text():
                (cwd / f"{name}.toml").write_text(text + "\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    for key in list(os.environ):
        if key.startswith(("ES_", "SLURM_", "PBS_", "PMI")):
            monkeypatch.delenv(key)
    return cwd


def cheap(argv: list[str]) -> list[str]:
    """The form of a supervisor command that starts nothing."""
    if argv[0] in ("run", "experiment") and "--dry-run" not in argv:
        return [*argv, "--dry-run"]
    if argv[0] == "tail":
        return [w for w in argv if w not in ("-f", "--follow")]
    return argv


@pytest.mark.parametrize("cmd", SUPERVISOR, ids=lambda c: c.id)
def test_a_supervisor_command_of_the_docs_exits_as_they_say(
    cmd, here, tmp_path, capsys, monkeypatch
):
    not_here = CANNOT_RUN_HERE.get(cmd.text)
    variables = dict(cmd.variables) | (not_here.variables if not_here else {})
    run = continued_run(tmp_path / "run")
    for words in expanded(cmd, variables):
        argv = [w.format(run=run, out=tmp_path / "out") for w in words[3:]]  # after -m supervisor
        if not_here is not None and not_here.check == "parse":
            cli.build_parser().parse_args(argv)
            continue
        if not_here is not None and not_here.check == "load":
            args = cli.build_parser().parse_args(argv)
            loading.load(args.config, args.set)  # a ConfigError fails the test
            continue
        argv = cheap(argv) + list(not_here.more if not_here else ())
        if not_here is not None and not_here.nodefile:
            nodefile = tmp_path / "nodefile"
            nodefile.write_text("127.0.0.1\nlocalhost\n127.0.0.2\n")  # resolve anywhere
            monkeypatch.setenv("PBS_NODEFILE", str(nodefile))
        rc = cli.main(argv)
        said = capsys.readouterr()
        assert rc == cmd.expect, (
            f"{cmd.id}: `{cmd.text}` as `python -m supervisor {shlex.join(argv)}` exited {rc}, "
            f"the page says {cmd.expect}:\n{said.out[-1500:]}{said.err[-1500:]}"
        )
    assert not (here / "runs").exists(), f"{cmd.id}: a run dir was made: something started"


# --- the benches ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_parsed() -> dict[tuple[str, tuple[str, ...]], dict]:
    """Each bench command's arguments as its parser took them (or refused them): one process
    for all of them."""
    asks = []
    for cmd in BENCH:
        for argv in expanded(cmd, dict(cmd.variables)):
            scripts = bench_scripts() if argv[1] == "bench/NAME.py" else [argv[1]]
            asks += [(script, argv[2:]) for script in scripts]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench_args"], input=json.dumps(asks), cwd=REPO,
        env=supervisor_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {(s, tuple(a)): got for (s, a), got in zip(asks, json.loads(proc.stdout), strict=True)}


@pytest.mark.parametrize("cmd", BENCH, ids=lambda c: c.id)
def test_a_bench_command_of_the_docs_is_taken_by_its_parser(cmd, bench_parsed):
    for argv in expanded(cmd, dict(cmd.variables)):
        scripts = bench_scripts() if argv[1] == "bench/NAME.py" else [argv[1]]
        for script in scripts:
            assert (REPO / script).is_file(), f"{cmd.id}: no {script}"
            got = bench_parsed[(script, tuple(argv[2:]))]
            assert got["code"] == cmd.expect, (
                f"{cmd.id}: `{cmd.text}` as `python {script} {shlex.join(argv[2:])}`: "
                f"{got.get('error')}"
            )
