"""The speculative methods: SpeculativeConfig.method -> the proposer class that drafts for it.

An explicit dict, read once when the runner is built. Each class builds itself from the config
(`from_config(config, target_hf_config, options)`); "eagle3" picks the MLA-head variant itself
when the head's config asks for one (eagle3_mla.py). "suffix" with a `hybrid` model drafter is
the HybridProposer over a SuffixProposer and that method's proposer (hybrid.py).
"""

from __future__ import annotations

from dataclasses import replace

from foretell.spec_decode.draft_model import DraftModelProposer
from foretell.spec_decode.eagle3_mla import Eagle3MLAProposer
from foretell.spec_decode.mtp import MTPProposer
from foretell.spec_decode.ngram import NgramProposer
from foretell.spec_decode.hybrid import HybridProposer
from foretell.spec_decode.proposer import Proposer
from foretell.spec_decode.suffix import SuffixProposer

PROPOSERS: dict[str, type] = {
    "eagle3": Eagle3MLAProposer,  # an Eagle3Proposer, or its MLA-head subclass by head config
    "mtp": MTPProposer,
    "draft_model": DraftModelProposer,
    "ngram": NgramProposer,
    "suffix": SuffixProposer,
}


def build_proposer(config, target_hf_config, options) -> Proposer:
    """The proposer for a SpeculativeConfig, built from PROPOSERS."""
    if config.method not in PROPOSERS:
        raise ValueError(
            f"speculative method {config.method!r} is not available; available: {sorted(PROPOSERS)}"
        )
    proposer = PROPOSERS[config.method].from_config(config, target_hf_config, options)
    if getattr(config, "hybrid", None):
        model_config = replace(config, method=config.hybrid, hybrid=None, hybrid_num_speculative_tokens=None,
                               num_speculative_tokens=config.hybrid_num_speculative_tokens,
                               num_draft_tokens=None)  # the model drafter's own chain: k + 1 nodes
        model = PROPOSERS[config.hybrid].from_config(model_config, target_hf_config, options)
        return HybridProposer(proposer, model, config.hybrid_min_match_length)
    return proposer
