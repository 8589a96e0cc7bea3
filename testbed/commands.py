"""Running the system's tools (`ip`, `nsenter`, `unshare`): one place that bounds each call and
turns a failure into an error that quotes the tool's own message."""

from __future__ import annotations

import subprocess


class BedError(RuntimeError):
    """The bed could not do what was asked; the message says why in one line."""


def run(argv: list[str], timeout: float = 30.0, check: bool = True) -> str:
    """Run `argv`, return its stdout; raise BedError with its stderr when it fails and `check`."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise BedError(f"{argv[0]}: command not found") from e
    except subprocess.TimeoutExpired as e:
        raise BedError(f"`{' '.join(argv)}` took over {timeout:g} s") from e
    if check and done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise BedError(f"`{' '.join(argv)}`: {why[0]}")
    return done.stdout
