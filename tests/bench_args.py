"""Reads bench commands' arguments the way each bench does, and stops there: `python -m
tests.bench_args` takes `[[script, [arg, ...]], ...]` as JSON on stdin and prints, for each,
`{"code": 0, "args": {...}}` (its parser took them) or `{"code": 2, "error": "..."}` (its parser
refused them, with argparse's words). A bench is run as `python bench/NAME.py` runs it, as far as
its first `parse_args`: nothing it measures starts. tests/unit/test_doc_commands.py uses it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class Parsed(Exception):
    """What a bench's parser made of its arguments: the bench goes no further."""


_parse_args = argparse.ArgumentParser.parse_args


def _stop_after_parsing(self, args=None, namespace=None):
    raise Parsed(_parse_args(self, args, namespace))


def parse(script: str, argv: list[str]) -> dict:
    path = REPO / script
    sys.argv = [str(path), *argv]
    sys.path[0] = str(path.parent)  # as for `python bench/NAME.py`: its helper modules beside it
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            runpy.run_path(str(path), run_name="__main__")
    except Parsed as parsed:
        return {"code": 0, "args": {k: repr(v) for k, v in vars(parsed.args[0]).items()}}
    except SystemExit as exc:  # argparse's error (2), or --help (0)
        return {"code": exc.code, "error": said.getvalue()[-800:]}
    return {"code": None, "error": "the bench ran without parsing its arguments"}


def main() -> None:
    argparse.ArgumentParser.parse_args = _stop_after_parsing
    print(json.dumps([parse(script, argv) for script, argv in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
