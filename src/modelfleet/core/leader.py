"""Which control plane leads, from what each of several answered when asked: the one rule an
agent and `ctl` follow to go straight to the leader. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    """One control plane's answer to "who leads?"."""

    asked: str  # the control plane asked (its URL)
    leading: bool  # it leads and acts now
    epoch: int  # the lease's epoch as it last saw it
    names: str | None  # where the leader it last saw is reached (itself when leading)


def leader_of(claims: Iterable[Claim], seen_epoch: int = 0) -> str | None:
    """Where the leader is reached: the one that says it leads now, under the highest epoch;
    while none does, the leader named by the answer that saw the highest epoch (a follower
    that read the lease lately outranks one whose view is stale). Never under an epoch below
    `seen_epoch` (a leader of that epoch answered before: an older one lost its lease). None
    when no answer names one."""
    usable = [c for c in claims if c.epoch >= seen_epoch]
    leading = [c for c in usable if c.leading]
    if leading:
        return max(leading, key=lambda c: c.epoch).asked
    named = [c for c in usable if c.names]
    if not named:
        return None
    return max(named, key=lambda c: c.epoch).names
