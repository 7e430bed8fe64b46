"""YAML text read from a client or a file (a catalog, a service's config), without aliases and
not nested past `nesting.MAX_DEPTH`.

An alias (`*name`) stands for the node its anchor named, however large: 20 KB aliased 10,000
times in a catalog once took a dry run to gigabytes. Nothing modelfleet reads needs one, so
any alias is refused, naming where it is, before anything is built. So is a document nested
deeper than the limit (`nesting.py`): libyaml's events are walked, and the walk stops at the
first level past it, before PyYAML's composer (which recursed on the C stack into a segfault
at 100,000 levels) sees any. Pure: text in, data out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from modelfleet.core import nesting

# libyaml's parser where PyYAML was built with it: the pure-Python one took half a second over
# a control plane's config naming 10,000 known nodes.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_OPEN = (yaml.SequenceStartEvent, yaml.MappingStartEvent)
_CLOSE = (yaml.SequenceEndEvent, yaml.MappingEndEvent)


class TooDeep(yaml.YAMLError):
    """YAML nested deeper than the limit: a YAMLError, as any text that is not taken."""


def load(text: str, limit: int = nesting.MAX_DEPTH) -> Any:
    """The data of YAML `text`; yaml.YAMLError when it is not YAML, holds an alias or nests
    deeper than `limit` (TooDeep)."""
    try:
        nesting.check(_steps(text), limit, _where)
    except nesting.TooDeep as exc:
        raise TooDeep(str(exc)) from None
    return yaml.load(text, Loader=_LOADER)


def _steps(text: str) -> Iterator[tuple[int, yaml.Event]]:
    """The openings and closings of `text`'s collections; an alias refused where it is."""
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, _OPEN):
            yield 1, event
        elif isinstance(event, _CLOSE):
            yield -1, event
        elif isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError(
                f"{_where(event)}: an alias (*{event.anchor}) is not taken: write the value "
                "out (an alias may stand for any amount of text)"
            )


def _where(event: yaml.Event) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark else "in the text"
