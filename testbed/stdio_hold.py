"""An ssh session's stdio over the bed's network (testbed/ssh): `python -I stdio_hold.py
HOST_DIR -- COMMAND...` runs COMMAND (the `nsenter` into the host) with its stdin, stdout and
stderr relayed to this process's own, as a TCP connection would carry them.

Without it the session's stdio would be plain pipes, which no `cut` can touch: Hydra's proxy on a
cut-off host would see its mpiexec die at once and take its ranks down, where over a real cable
pulled it hears nothing until the link is back. So the relay goes by the host's state: `up`, it
forwards both ways; `cut`, it forwards nothing (a writer on either side blocks once the pipe is
full, as on a stalled connection); the caller gone (its mpiexec ended, this session's front
killed), the host's end is closed at once if the host is up, or once it is healed if cut (what
it would hear then: the connection reset); `killed` or gone from the bed, at once.

The relaying half runs in a session of its own, so that a signal to the caller's process group
(a launcher's teardown) ends the front and leaves the connection to the host, as with a network
link; the front waits for the command's exit status and exits with it (255 if the relay dies).
"""

from __future__ import annotations

import errno
import os
import select
import subprocess
import sys
import time
from pathlib import Path

CHUNK = 65536
LOOK_S = 0.1  # how often the host's state is read while nothing moves


def state_of(host_dir: Path) -> str:
    try:
        return (host_dir / "state").read_text().strip() or "killed"
    except OSError:
        return "killed"


def relay(host_dir: Path, argv: list[str], report: int) -> None:
    """The relaying half: run the command, forward by the host's state, report its status."""
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)  # fmt: skip
    assert child.stdin and child.stdout and child.stderr
    to_child = child.stdin.fileno()
    routes = {0: to_child, child.stdout.fileno(): 1, child.stderr.fileno(): 2}
    reading = set(routes)
    poll = select.poll()  # the sides still read from
    for fd in reading:
        poll.register(fd, select.POLLIN)

    def stop_reading(fd: int) -> None:
        if fd in reading:
            reading.discard(fd)
            poll.unregister(fd)

    caller_gone = False
    watch = select.poll()
    watch.register(1, 0)  # POLLERR once the caller's end of our stdout is closed
    while True:
        state = state_of(host_dir)
        if state == "cut":
            time.sleep(LOOK_S)
            continue
        if caller_gone or state != "up":
            break
        if not (reading - {0}) and child.poll() is not None:
            break  # the command ended and said all it had
        events = poll.poll(LOOK_S * 1000)
        if watch.poll(0):  # our stdout's reader is gone: the caller ended
            caller_gone = True
        for fd, ev in events:
            data = os.read(fd, CHUNK) if ev & (select.POLLIN | select.POLLHUP) else b""
            if not data:  # that side closed its end
                stop_reading(fd)
                if fd == 0:
                    _close(to_child)
                continue
            if not _write_all(routes[fd], data):
                if routes[fd] == to_child:
                    stop_reading(0)
                else:
                    caller_gone = True
    for stream in (child.stdin, child.stdout, child.stderr):  # the host hears the link end
        _close(stream.fileno())
    status = child.wait()
    code = 128 - status if status < 0 else status
    _write_all(report, f"{code}\n".encode())


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EBADF):
                return False
            raise
        view = view[n:]
    return True


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    host_dir, sep, command = Path(argv[0]), argv[1], argv[2:]
    if sep != "--" or not command:
        print("usage: stdio_hold.py HOST_DIR -- COMMAND...", file=sys.stderr)
        return 255
    report_r, report_w = os.pipe()
    if os.fork() == 0:  # the relaying half, in a session of its own
        os.close(report_r)
        os.setsid()
        code = 0
        try:
            relay(host_dir, command, report_w)
        except BaseException:  # noqa: BLE001 (nothing to report to but the front: 255)
            code = 255
        os._exit(code)
    os.close(report_w)
    for fd in (0, 1, 2):  # the relay holds the caller's stdio; the front waits only
        os.close(fd)
    said = b""
    while chunk := os.read(report_r, 64):
        said += chunk
    try:
        return int(said.strip())
    except ValueError:
        return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
