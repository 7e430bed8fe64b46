"""Which control plane leads, from what each answered (`core.leader`): the rule agents and
`ctl` follow to go straight to the leader (issue 57)."""

from __future__ import annotations

from modelfleet.core.leader import Claim, leader_of


def test_the_one_that_leads_now_under_the_highest_epoch_is_the_leader() -> None:
    claims = [
        Claim("http://a", False, 3, "http://b"),  # a follower whose view is stale
        Claim("http://c", True, 4, "http://c"),
        Claim("http://b", True, 3, "http://b"),  # led under 3, not told yet
    ]
    assert leader_of(claims) == "http://c"


def test_while_none_leads_the_freshest_view_names_the_leader() -> None:
    claims = [
        Claim("http://a", False, 3, "http://b"),
        Claim("http://b", False, 4, "http://c"),
        Claim("http://c", False, 2, None),
    ]
    assert leader_of(claims) == "http://c"
    assert leader_of([Claim("http://a", False, 1, None)]) is None
    assert leader_of([]) is None


def test_a_leader_under_an_epoch_older_than_one_taken_is_never_chosen() -> None:
    claims = [Claim("http://a", True, 3, "http://a"), Claim("http://b", False, 3, "http://a")]
    assert leader_of(claims, seen_epoch=4) is None
    assert leader_of(claims, seen_epoch=3) == "http://a"
