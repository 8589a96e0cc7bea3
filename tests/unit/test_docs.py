"""The docs against the code: docs/configuration.md holds every config key with its default,
docs/architecture.md every environment name, exit code and event, links resolve inside the
repository, nothing refers to files outside it, and the README stays short.

Reads files only: no process, no torch.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from contracts import env_names
from contracts.exit_codes import ExitCode
from faults import spec as fault_spec
from supervisor.commands import experiment
from supervisor.settings import config as config_mod
from worker import args as worker_args

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 200

# --- docs/configuration.md ------------------------------------------------------------------------
_HEADING = re.compile(r"^#+ `\[\[?([a-z_.]+)\]\]?`\s*$")
_ROW = re.compile(r"^\| `([a-z_]+)` \|(.*)$")
_TICKED = re.compile(r"`([^`]+)`")


def config_page() -> dict[str, dict[str, list[str]]]:
    """Section (`job`, `heartbeat.progress`, `faults`, …) -> key -> the row's other cells."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for line in (DOCS / "configuration.md").read_text().splitlines():
        heading = _HEADING.match(line)
        if heading:
            current = sections.setdefault(heading.group(1), {})
            continue
        if line.startswith("#"):
            current = None
            continue
        row = _ROW.match(line)
        if row and current is not None:
            assert row.group(1) not in current, f"{row.group(1)} twice in one table"
            current[row.group(1)] = [c.strip() for c in row.group(2).split("|")]
    return sections


KEY_ONLY = object()  # a key whose default depends on other keys: only its presence is checked


def code_tables() -> dict[str, dict[str, Any]]:
    """Section -> key -> default (`KEY_ONLY` where the code has no single default)."""
    tables: dict[str, dict[str, Any]] = {}

    def add(prefix: str, obj: Any) -> None:
        keys = tables.setdefault(prefix, {})
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                add(f"{prefix}.{f.name}", value)
            else:
                keys[f.name] = value

    cfg = config_mod.Config()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name == "worker":
            parser = worker_args.build_parser()
            flags = {
                a.dest: a.default
                for a in parser._actions  # argparse keeps no public list
                if a.option_strings and a.dest != "help"
            }
            tables["worker"] = {"module": value.module, **flags}
        elif f.name == "faults":
            tables["faults"] = dict.fromkeys(fault_spec.KNOWN_KEYS, KEY_ONLY)
        elif dataclasses.is_dataclass(value):
            add(f.name, value)
    tables["experiment"] = dict.fromkeys(experiment.EXPERIMENT_KEYS, KEY_ONLY)
    return tables


def test_every_config_table_is_on_the_page():
    page, code = config_page(), code_tables()
    assert sorted(page) == sorted(code), "tables on docs/configuration.md differ from the code"


def test_the_page_s_list_of_tables_names_every_table():
    """The list at the top of the page, where a reader looks first, names every top-level table."""
    text = (DOCS / "configuration.md").read_text()
    listed = text.split("The tables:", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`\[\[?([a-z_]+)\]\]?`", listed))
    tops = {table.split(".")[0] for table in code_tables()}
    assert tops <= named, f"the list of tables lacks {sorted(tops - named)}"


@pytest.mark.parametrize("table", sorted(code_tables()))
def test_every_config_key_is_on_the_page(table: str):
    page = config_page().get(table, {})
    keys = code_tables()[table]
    missing = sorted(set(keys) - set(page))
    extra = sorted(set(page) - set(keys))
    assert not missing, f"[{table}] keys missing from docs/configuration.md: {missing}"
    assert not extra, f"[{table}] keys on docs/configuration.md the code does not have: {extra}"


@pytest.mark.parametrize("table", sorted(code_tables()))
def test_config_defaults_match_the_code(table: str):
    """A default the code has is the first `…` of the row's default cell, as a TOML value."""
    page = config_page().get(table, {})
    for key, default in code_tables()[table].items():
        if default is KEY_ONLY or default is None or key not in page:
            continue
        cells = page[key]
        assert len(cells) >= 3, f"[{table}] {key}: expected | key | type | default | meaning |"
        ticked = _TICKED.search(cells[1])
        assert ticked, f"[{table}] {key}: default cell {cells[1]!r} has no `value`"
        shown = tomllib.loads(f"v = {ticked.group(1)}")["v"]
        assert shown == default, f"[{table}] {key}: the page says {shown!r}, the code {default!r}"


# --- docs/architecture.md -------------------------------------------------------------------------
def architecture() -> str:
    return (DOCS / "architecture.md").read_text()


def test_every_environment_name_is_documented():
    names = [v for k, v in vars(env_names).items() if k.startswith("ENV_") and isinstance(v, str)]
    text = architecture()
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/architecture.md lacks {missing}"


def test_every_exit_code_is_documented():
    text = section(architecture(), "Exit status")
    missing = [c.name for c in ExitCode if not re.search(rf"^\| {int(c)} \| `{c.name}` \|", text,
                                                          re.M)]  # fmt: skip
    assert not missing, f"docs/architecture.md's exit code table lacks {missing}"


_EMITTED = re.compile(r"(?:emit|EventToEmit)\(\s*\"([a-z_]+)\"", re.S)


def emitted_events() -> set[str]:
    """Event names the supervisor and faults/ write, as far as their source says them."""
    names: set[str] = set()
    for path in [*(ROOT / "supervisor").rglob("*.py"), *(ROOT / "faults").rglob("*.py")]:
        names |= set(_EMITTED.findall(path.read_text()))
    names |= {"rank_exit", "hang", "no_progress", "events_reopened"}  # findings; the log's own
    return names


def test_the_event_scan_sees_the_supervisor():
    assert {"launch", "attempt_end", "relaunch", "fault", "give_up"} <= emitted_events()


def section(text: str, title: str) -> str:
    """The part of a page under `## title`, up to the next `## ` heading."""
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_every_event_is_documented():
    text = section(architecture(), "Events")
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    missing = sorted(emitted_events() - documented)
    assert not missing, f"docs/architecture.md's event table lacks {missing}"


# --- the repository as a whole --------------------------------------------------------------------
SKIP_DIRS = {".git", ".venv", ".ruff_cache", ".pytest_cache", "__pycache__", "runs", "out", "build"}
OUTSIDE = ("../" + "shared", "DESIGN" + ".md")  # split: this file must not match itself


def repository_files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(p in SKIP_DIRS or p.endswith(".egg-info") for p in rel.parts[:-1]):
            continue
        if path.is_file() and not path.is_symlink():
            found.append(path)
    return found


def test_no_file_refers_outside_the_repository():
    bad = []
    for path in repository_files():
        data = path.read_bytes()
        bad += [f"{path.relative_to(ROOT)}: {s}" for s in OUTSIDE if s.encode() in data]
    assert not bad, bad


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors a markdown page's headings get (GitHub's rule, backticks and dots dropped)."""
    found: set[str] = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        base, n = slug, 1
        while slug in found:
            slug, n = f"{base}-{n}", n + 1
        found.add(slug)
    return found


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_resolve_inside_the_repository(page: Path):
    bad = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif not path.exists():
            bad.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"{target}: no such heading")
    assert not bad, f"{page.name}: {bad}"
