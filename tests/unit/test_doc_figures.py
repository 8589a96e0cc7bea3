"""Every measured figure in docs/ says which bench command produced it and when.

docs/benchmarks.md, per bench (`## NAME.py`): what the bench does comes first and holds no
figures (a setting or a goal is written in backticks, as code). Figures come in records: a
record starts with a paragraph that names the day (YYYY-MM-DD) and the command
(`python bench/NAME.py ...`, the section's own bench), and runs to the next record or section.
A section without a record says "No figures recorded".

Elsewhere in docs/, a paragraph with a sentence that gives a measured figure (a number with its
unit, said to be measured, a median, on this host) links to the section of docs/benchmarks.md
that records it. The commands themselves are run by test_doc_commands.py.
"""

from __future__ import annotations

import re

import pytest

from tests.support import REPO

BENCHMARKS = REPO / "docs" / "benchmarks.md"
# A number with a unit of measure (a second, a byte, a share, a ratio), not inside backticks.
FIGURE = re.compile(
    r"(?<![\w.+-])[+-]?\d[\d,]*(\.\d+)?(-\d[\d,]*(\.\d+)?)?\s?"
    r"(s|ms|us|µs|min|MB|GB|KB|MiB|GiB|KiB|MB/s|GB/s|%|x)(?![\w/])"
)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
# What says a sentence's figure was measured (on the other pages).
MEASURED = re.compile(
    r"\b(measured|median|on the development host|on the debug preset|"
    r"restarted in|a call)\b"
)


def paragraphs(text: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph or list outside fenced blocks; a heading and a
    table's row are each a paragraph of their own."""
    out: list[tuple[int, str]] = []
    lines: list[str] = []
    start, fenced = 0, False
    for n, line in enumerate(text.splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if not line.strip() or line.startswith(("#", "|")):
            if lines:
                out.append((start, " ".join(lines)))
                lines = []
            if line.startswith(("#", "|")):
                out.append((n, line))
            continue
        if not lines:
            start = n
        lines.append(line.strip())
    return out


def figures(paragraph: str) -> list[str]:
    """The figures of a paragraph, its code spans (settings, commands, messages) left out."""
    plain = re.sub(r"`[^`]*`", "", paragraph)
    plain = re.sub(r"\]\([^)]*\)", "]", plain)  # a link's target
    return [m.group(0) for m in FIGURE.finditer(plain)]


def sections() -> dict[str, list[tuple[int, str]]]:
    """docs/benchmarks.md's bench sections: `NAME.py` -> its paragraphs."""
    out: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for n, para in paragraphs(BENCHMARKS.read_text()):
        heading = re.match(r"^## (\w+\.py)$", para)
        if heading:
            current = out.setdefault(heading.group(1), [])
        elif para.startswith("#"):
            current = None
        elif current is not None:
            current.append((n, para))
    return out


def is_record_head(script: str, paragraph: str) -> bool:
    return bool(DATE.search(paragraph)) and f"`python bench/{script}" in paragraph


def test_every_bench_has_a_section():
    names = {p.name for p in (REPO / "bench").glob("*.py")}
    assert set(sections()) <= names
    assert {"step.py", "node_loss.py", "soak.py", "fault_loop_lag.py"} <= set(sections())


@pytest.mark.parametrize("script", sorted(sections()))
def test_every_figure_of_a_bench_is_in_a_dated_record_of_its_command(script: str):
    paras = sections()[script]
    heads = [n for n, p in paras if is_record_head(script, p)]
    first = heads[0] if heads else None
    loose = [
        f"line {n}: {figures(p)}: {p[:80]}..."
        for n, p in paras
        if (first is None or n < first) and figures(p)
    ]
    assert not loose, (
        f"docs/benchmarks.md, {script}: figures outside a record (a paragraph naming the date "
        f"and `python bench/{script} ...` starts one; settings and goals go in backticks):\n"
        + "\n".join(loose)
    )
    if first is None:
        assert any("No figures recorded" in p for _, p in paras), (
            f"docs/benchmarks.md, {script}: no record and no 'No figures recorded'"
        )


def test_a_figure_on_another_page_links_to_its_record():
    bad = []
    for page in sorted((REPO / "docs").glob("*.md")):
        if page == BENCHMARKS:
            continue
        for n, para in paragraphs(page.read_text()):
            if para.startswith("#") or "benchmarks.md#" in para:
                continue
            for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z(*])", para):
                plain = re.sub(r"`[^`]*`", "", sentence)
                if figures(sentence) and MEASURED.search(plain):
                    bad.append(f"{page.name}:{n}: {figures(sentence)}: {sentence[:90]}...")
    assert not bad, (
        "measured figures without a link to the record in docs/benchmarks.md that holds them "
        "(its date and command):\n" + "\n".join(bad)
    )


def test_the_figure_pattern_sees_figures_and_not_settings():
    assert figures("the crash 9.60 s, the node loss 9.51 s (0.99x), 821 MB/s, 8-19 %") == [
        "9.60 s", "9.51 s", "0.99x", "821 MB/s", "8-19 %"]  # fmt: skip
    assert figures("`--rate 15`, `timeout_s = 4`, step 12, 3 runs, (`0.25 s`)") == []
