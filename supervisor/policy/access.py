"""Who may read what a job writes: the run dir, the checkpoints, the logs and reports.

On a shared login node the umask's usual `022` would leave every run dir and checkpoint readable
by every user. A job's directories are made for its user alone unless `[job] share_with_group`
names a group, which may then read (never write) them. The supervisor takes the umask below, and
so does every rank (`ES_UMASK`: ranks on other hosts do not inherit it).
"""

from __future__ import annotations

from dataclasses import dataclass

PRIVATE_UMASK = 0o077  # files 600, directories 700
GROUP_UMASK = 0o027  # files 640, directories 750
# A shared directory is setgid: what anyone writes in it (the ranks on other hosts, whose
# primary group may differ) takes the directory's group, and so stays readable by the group.
GROUP_DIR_MODE = 0o2750
PRIVATE_DIR_MODE = 0o700


@dataclass(frozen=True)
class Access:
    """The umask of the supervisor and its ranks, and the mode (and group, "" for none) of each
    directory the job creates."""

    umask: int
    dir_mode: int
    group: str

    @property
    def umask_text(self) -> str:
        """The umask as `ES_UMASK` carries it (`077`)."""
        return f"{self.umask:03o}"


def access_for(share_with_group: str) -> Access:
    """The job's access: its user's alone, or readable by the group `share_with_group`."""
    if not share_with_group:
        return Access(PRIVATE_UMASK, PRIVATE_DIR_MODE, "")
    return Access(GROUP_UMASK, GROUP_DIR_MODE, share_with_group)
