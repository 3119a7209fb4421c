"""How checkpoint tensor names map onto a model's parameters: WeightRule and WeightRules.

Models declare them (models/*.py), layers that own fused parameters declare theirs (layers/moe.py)
and the loader applies them (loader.py), so they sit below all three: no torch, no package import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class WeightRule:
    """Maps checkpoint tensor names onto a (fused) parameter.

    `pattern` is a regex searched in the checkpoint name; the match is replaced by `replacement`
    to get the parameter name, and `shard` (a value, or a function of the match) is passed to the
    parameter's weight_loader to say which slice the tensor fills.
    """

    pattern: str
    replacement: str
    shard: Any | Callable[[re.Match], Any] = None

    def apply(self, name: str) -> tuple[str, Any] | None:
        match = re.search(self.pattern, name)
        if match is None:
            return None
        shard = self.shard(match) if callable(self.shard) else self.shard
        return name[: match.start()] + match.expand(self.replacement) + name[match.end() :], shard


@dataclass
class WeightRules:
    fused: list[WeightRule] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)  # regexes of checkpoint keys to skip
