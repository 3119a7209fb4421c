"""EAGLE3 heads whose draft layer is MLA (head config with kv_lora_rank).

build_proposer maps method "eagle3" here; `from_config` returns this class for an MLA head and a
plain Eagle3Proposer for every other head, so standard heads are untouched. Everything but the
head's construction (aux layers, d2t, catch-up, chaining) is Eagle3Proposer's.
"""

from __future__ import annotations

from foretell.models.base import HFConfig
from foretell.models.eagle3_mla import Eagle3MLAHead, is_mla_head
from foretell.spec_decode.eagle3 import Eagle3Proposer


class Eagle3MLAProposer(Eagle3Proposer):
    head_class = Eagle3MLAHead

    @classmethod
    def from_config(cls, config, target_hf_config, options) -> Eagle3Proposer:
        head_config = HFConfig.from_folder(config.model) if config.model else None
        if head_config is not None and is_mla_head(head_config):
            return cls(config, target_hf_config, options)
        return Eagle3Proposer(config, target_hf_config, options)
