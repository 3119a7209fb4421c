"""max_model_len: the longest sequence a runner serves, from the model, the drafter, the request
and the KV cache the runner allocated."""

from __future__ import annotations

import logging

from foretell.config import EngineConfig
from foretell.models.base import HFConfig
from foretell.runner.kv_cache import CachePlan
from foretell.spec_decode.proposer import Proposer

logger = logging.getLogger("foretell")


def resolve_max_model_len(hf_config: HFConfig, proposer: Proposer | None, config: EngineConfig,
                          cache_plan: CachePlan, num_lookahead_tokens: int) -> int:
    """The longest sequence: the model's limit (and a draft model's, whose rotary table ends
    there too), and no more than one sequence alone can hold in the KV cache (with its
    lookahead slots), so any admitted sequence can finish. A max_model_len asked for past
    either is refused, saying which."""
    limit = hf_config.language_model().get("max_position_embeddings", 2048)
    limit_source = f"the model's max_position_embeddings {limit} ({hf_config.language_model().source})"
    drafter_limit = proposer.capabilities.max_positions if proposer is not None else None
    if drafter_limit is not None and drafter_limit < limit:
        limit = drafter_limit
        limit_source = f"the draft model's max_position_embeddings {limit} ({config.speculative.model})"
    asked = config.model.max_model_len
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len {asked} is larger than {limit_source}")
    capacity = cache_plan.num_tokens - num_lookahead_tokens
    if asked is not None and asked > capacity:
        raise ValueError(
            f"max_model_len {asked} is more than the KV cache can hold for one sequence "
            f"({capacity} tokens in {cache_plan.num_blocks} blocks of "
            f"{cache_plan.block_size}): give the cache more memory or lower max_model_len"
        )
    if asked is None and capacity < limit:
        logger.warning(
            "max_model_len set to %d (the KV cache holds %d tokens; the model allows %d)",
            max(capacity, 1), capacity, limit,
        )
    return max(1, min(asked or limit, capacity))
