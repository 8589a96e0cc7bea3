"""`python -m testbed up N [--slurm] | down | exec HOST CMD... | kill HOST | cut HOST |
heal HOST | status` (as root). `exec` replaces itself by the command in the host: its stdin,
stdout, stderr and exit status are the command's; a killed host answers as ssh does, with exit
status 255. `up --slurm` adds a Slurm cluster (testbed/slurm.py)."""

from __future__ import annotations

import argparse
import os
import sys

from testbed.bed import Bed, current, down, up
from testbed.commands import BedError
from testbed.layout import unreachable

UNREACHABLE = 255


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m testbed", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    upper = sub.add_parser("up", help="bring up N hosts n0..nN-1")
    upper.add_argument("n", type=int)
    upper.add_argument(
        "--slurm",
        action="store_true",
        help="and a Slurm cluster: slurmctld here, a slurmd in each host",
    )
    sub.add_parser("down", help="take the bed down, leaving nothing behind")
    ex = sub.add_parser("exec", help="run a command in a host")
    ex.add_argument("host")
    ex.add_argument("cmd", nargs=argparse.REMAINDER)
    for name, what in (("kill", "lose the host: every process killed, its link down"),
                       ("cut", "pull the host's cable: processes live, unreachable"),
                       ("heal", "bring a killed or cut host back")):  # fmt: skip
        sub.add_parser(name, help=what).add_argument("host")
    sub.add_parser("status", help="each host, its address, state and processes")
    return p


def the_bed() -> Bed:
    bed = current()
    if bed is None:
        raise BedError("no test bed is up (`python -m testbed up N`)")
    return bed


def show_status(bed: Bed) -> None:
    print(f"{'host':<6}{'address':<14}{'state':<8}{'link':<6}processes")
    for s in bed.status():
        link = "up" if s.link_up else "down"
        print(f"{s.name:<6}{s.address:<14}{s.state:<8}{link:<6}{s.processes}")


def run_in(host: str, cmd: list[str]) -> int:
    bed = the_bed()
    try:
        argv = bed.argv(host, cmd or [os.environ.get("SHELL", "/bin/sh")])
    except (BedError, KeyError):
        print(unreachable(host), file=sys.stderr)
        return UNREACHABLE
    sys.stdout.flush()
    os.execvp(argv[0], argv)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "up":
            bed = up(args.n, slurm_cluster=args.slurm)
            show_status(bed)
            if bed.slurm:
                print(f"Slurm: export SLURM_CONF={bed.slurm_env()['SLURM_CONF']}")
        elif args.command == "down":
            down()
        elif args.command == "exec":
            return run_in(args.host, args.cmd)
        elif args.command == "status":
            bed = current()
            if bed is None:
                print("no test bed is up")
            else:
                show_status(bed)
        else:
            getattr(the_bed(), args.command)(args.host)
    except (BedError, KeyError) as e:
        print(f"testbed: {e.args[0] if e.args else e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
