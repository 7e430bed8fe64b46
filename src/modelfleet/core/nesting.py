"""How deep a document nests, checked before it is built: JSON and YAML read from anyone.

A parser builds nested lists and objects by recursion, and some of it runs on the C stack:
a 200 KB catalog of nested `[` killed the control plane with a segfault in PyYAML's composer,
a 40 KB one held its event loop for seconds in libyaml's scanner (whose work per token grows
with the depth), and deep JSON made the router's `json.loads` raise RecursionError (a 500).
Nothing modelfleet reads nests anywhere near `MAX_DEPTH`, so a document that does is refused,
naming the limit, before a parser builds anything of it.

`check` is the one rule: it walks the openings and closings of a document, in order, and
stops at the first that passes the limit, so its cost is linear in what it walked. JSON's
openings are found here (`check_json`); YAML's are the start and end events of libyaml's own
parser (`yamltext.load`), so that no second reading of YAML's quoting can disagree with it.
Pure: text in, an answer or `TooDeep` out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

MAX_DEPTH = 64

# A JSON string (to the end of the text when it is never closed, so that an unclosed one is
# read once, not once per quote after it) or a bracket of an array or object.
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\Z)|[\[\]{}]', re.DOTALL)
_OPENS = frozenset(b"[{")

Mark = TypeVar("Mark")


class TooDeep(ValueError):
    """A document nests deeper than its limit; the message names the limit and where."""

    def __init__(self, limit: int, where: str = "") -> None:
        at = f" ({where})" if where else ""
        super().__init__(f"nested more than {limit} levels deep{at}: the limit is {limit}")
        self.limit = limit


def check(steps: Iterable[tuple[int, Mark]], limit: int, where: Callable[[Mark], str]) -> None:
    """Raise TooDeep at the first of `steps` that opens a level past `limit`. A step is +1
    (a list or object opened) or -1 (one closed) and a mark of where it is, which `where`
    says in words for the message; no step after that one is taken from `steps`."""
    depth = 0
    for step, mark in steps:
        depth += step
        if depth > limit:
            raise TooDeep(limit, where(mark))


def check_json(raw: bytes | str, limit: int = MAX_DEPTH) -> None:
    """Raise TooDeep when the JSON text `raw` nests deeper than `limit`. Whether it is JSON
    at all is its parser's to say, after this."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return  # too few openings to pass the limit, wherever they are: nothing to walk
    check(_json_steps(data), limit, lambda at: f"at byte {at}")


def _json_steps(data: bytes) -> Iterable[tuple[int, int]]:
    for token in _JSON_TOKENS.finditer(data):
        first = data[token.start()]
        if first != ord('"'):
            yield (1 if first in _OPENS else -1), token.start()
