"""`tail` of a run whose events.jsonl holds an event with a huge value (a hand edit, another
program's line) printed the whole value: 50 MB to the terminal. Each printed line is capped and
says how much was left out; --json still prints the line as written. Process-free."""

from __future__ import annotations

import json

from supervisor.commands import cli, tail


def test_a_huge_value_is_cut_in_tail_and_whole_in_json(tmp_path, capsys):
    (tmp_path / "config.toml").write_text('[job]\nname = "x"\n')
    event = {"event": "progress", "attempt": 0, "step": 1, "ts": 1.0, "x": "a" * 100_000}
    (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n")
    assert cli.main(["tail", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    longest = max(len(line) for line in out.splitlines())
    assert longest < tail.TAIL_LINE_MAX + 100, longest
    assert "more characters; --json shows the line whole" in out
    assert cli.main(["tail", "--json", str(tmp_path)]) == 0
    assert "a" * 100_000 in capsys.readouterr().out
