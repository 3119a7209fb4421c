"""foretell: an LLM inference engine built around exact speculative decoding.

The public names (LLM, SamplingParams, SpeculativeConfig) load on first use, so `import foretell`,
the CLI's `--help` and the torch-free core (scheduler, block manager, sequences, config) do not
pay for torch, transformers or the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from foretell.speculative_config import SpeculativeConfig
    from foretell.engine.llm import LLM
    from foretell.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY_NAMES = {
    "LLM": "foretell.engine.llm",
    "SamplingParams": "foretell.sampling_params",
    "SpeculativeConfig": "foretell.speculative_config",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY_NAMES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'foretell' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_NAMES])
