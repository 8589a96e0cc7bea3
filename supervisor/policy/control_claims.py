"""Who owns a rank's identity on the control channel: the pure rule (supervisor.watch.control
acts on it).

Only a peer that holds the job's key reaches the control socket at all (CURVE, with keys derived
from it: contracts.control_msgs). Each such peer claims `<attempt>/<rank>` in a signed hello sent
on its own routing id, `<attempt>/<rank>/<nonce>`. The first claim of an identity wins for as
long as the attempt is known: a second claimant (another routing id) is refused and counted,
whatever it says, so the process that claimed first is sent every command; the owner's hello
again changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

# Why a claim was refused (the counts of `control_refused`, with a hello's BadMessage reasons and
# `key`: a CURVE client key other than the job's, refused in the handshake).
CLAIMED = "claimed"  # the identity is another routing id's
CONN = "conn"  # the hello names another routing id than its own, or another identity than its id's
ENDED = "ended"  # the attempt's processes have ended: its identities are claimed no more


@dataclass(frozen=True)
class Claim:
    """A hello that passed its signature and schema, and the routing id that carried it."""

    attempt: int
    rank: int
    conn: str  # the routing id the hello names
    sender: bytes  # the routing id that carried it


@dataclass(frozen=True)
class Verdict:
    owner: bytes | None  # who owns the identity after the claim (None: nobody yet)
    refused: str | None  # why the claim was refused, None when it was taken (or held already)


def judge(claim: Claim, owner: bytes | None, ended: bool) -> Verdict:
    """The claim of `claim.attempt/claim.rank`, owned now by `owner`; `ended`: the attempt's
    identities have been let go (supervisor.watch.control.ControlServer.forget)."""
    prefix = f"{claim.attempt}/{claim.rank}/".encode()
    sender = claim.sender
    if claim.conn.encode() != sender or not sender.startswith(prefix) or sender == prefix:
        return Verdict(owner, CONN)
    if ended:
        return Verdict(owner, ENDED)
    if owner is not None and owner != sender:
        return Verdict(owner, CLAIMED)
    return Verdict(sender, None)
