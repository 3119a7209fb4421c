"""What a request with only a grammar costs the host step beyond its masks (issue 27's overhead):
no logits controls are built or applied for it (SamplingParams.needs_logits_controls is False,
apply_sampling_controls hands back the same tensor), and with a logit bias beside the grammar
they still are."""

from __future__ import annotations

import torch

from foretell import SamplingParams
from foretell.runner.logits_processing import apply_sampling_controls


class Seq:
    def __init__(self, params: SamplingParams):
        self.sampling_params, self.output_token_ids, self.token_ids = params, [], [1, 2]
        self.num_output_tokens, self.num_prompt_tokens, self.prompt_token_ids = 0, 2, [1, 2]
        self.eos_token_ids = frozenset({0})


class Item:
    def __init__(self, params: SamplingParams, drafts: list[int]):
        self.seq, self.draft_token_ids = Seq(params), drafts


def test_a_grammar_alone_needs_no_logits_controls():
    grammar = SamplingParams(temperature=0, structured_outputs={"regex": "a+"})
    assert grammar.needs_logits_processing and not grammar.needs_logits_controls
    logits = torch.randn(3, 16)  # [rows, vocab]
    assert apply_sampling_controls(logits, [Item(grammar, [5, 6])], keep_raw=True) is logits


def test_a_bias_beside_the_grammar_is_still_applied():
    biased = SamplingParams(temperature=0, structured_outputs={"regex": "a+"}, logit_bias={3: -100.0})
    assert biased.needs_logits_controls
    logits = torch.zeros(2 + 1, 16)  # [rows, vocab]: a grammar-only sequence (2 rows), then the biased one
    out = apply_sampling_controls(logits, [Item(SamplingParams(structured_outputs={"regex": "a+"}), [5]),
                                           Item(biased, [])], keep_raw=True)
    assert out is not logits and torch.equal(logits, torch.zeros(3, 16))  # a copy: the raw logits kept
    expected = torch.zeros(3, 16)
    expected[2, 3] = -100.0
    assert torch.equal(out, expected)
