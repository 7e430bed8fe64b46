"""YAML text read from a client or a file (a catalog, a service's config), without aliases.

An alias (`*name`) stands for the node its anchor named, however large: 20 KB aliased 10,000
times in a catalog once took a dry run to gigabytes. Nothing modelfleet reads needs one, so
any alias is refused, naming where it is, before anything is built. Pure: text in, data out.
"""

from __future__ import annotations

from typing import Any

import yaml

# libyaml's parser where PyYAML was built with it: the pure-Python one took half a second over
# a control plane's config naming 10,000 known nodes.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load(text: str) -> Any:
    """The data of YAML `text`; yaml.YAMLError when it is not YAML or holds an alias."""
    for event in yaml.parse(text, Loader=_LOADER):
        if isinstance(event, yaml.AliasEvent):
            mark = event.start_mark
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
            raise yaml.YAMLError(
                f"{where}an alias (*{event.anchor}) is not taken: write the value out (an "
                "alias may stand for any amount of text)"
            )
    return yaml.load(text, Loader=_LOADER)
