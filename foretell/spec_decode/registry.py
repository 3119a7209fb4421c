"""The speculative methods: SpeculativeConfig.method -> the proposer class that drafts for it.

An explicit dict, read once when the runner is built. Each class builds itself from the config
(`from_config(config, target_hf_config, options)`); "eagle3" picks the MLA-head variant itself
when the head's config asks for one (eagle3_mla.py).
"""

from __future__ import annotations

from foretell.spec_decode.draft_model import DraftModelProposer
from foretell.spec_decode.eagle3_mla import Eagle3MLAProposer
from foretell.spec_decode.mtp import MTPProposer
from foretell.spec_decode.ngram import NgramProposer
from foretell.spec_decode.proposer import Proposer

PROPOSERS: dict[str, type] = {
    "eagle3": Eagle3MLAProposer,  # an Eagle3Proposer, or its MLA-head subclass by head config
    "mtp": MTPProposer,
    "draft_model": DraftModelProposer,
    "ngram": NgramProposer,
}


def build_proposer(config, target_hf_config, options) -> Proposer:
    """The proposer for a SpeculativeConfig, built from PROPOSERS."""
    if config.method not in PROPOSERS:
        raise ValueError(
            f"speculative method {config.method!r} is not available; available: {sorted(PROPOSERS)}"
        )
    return PROPOSERS[config.method].from_config(config, target_hf_config, options)
