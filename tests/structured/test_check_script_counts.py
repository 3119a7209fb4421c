"""scripts/check_structured_gpu.py's counts from token origins (issue 27's acceptance readings):
steps, verifies with drafts, accepted drafts and tokens of whole outputs and of each output's first
tokens (whole steps), against counts written out by hand for outputs built step by step."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import pytest

from foretell.engine.token_origins import step_origins

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "check_structured_gpu.py")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("check_structured_gpu_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def output(steps: list[tuple[int, int]]):
    """An output whose steps verified (drafts, accepted) each; (0, 0) is a step without drafts."""
    origins, token = [], 100
    for step, (drafts, accepted) in enumerate(steps):
        draft_ids = list(range(token, token + drafts))
        new = draft_ids[:accepted] + [token + 50]
        origins += step_origins(draft_ids, drafts, new, accepted, step)
        token += 100
    return SimpleNamespace(outputs=[SimpleNamespace(token_origins=origins)])


# The prefill's token; 3 drafts, 2 accepted; no drafts (the grammar cut them); 2 drafts, both accepted.
STEPS = [(0, 0), (3, 2), (0, 0), (2, 2)]  # tokens by step: 1, 3, 1, 3


def test_whole_outputs(script):
    counts = script.origin_counts([output(STEPS), output([(0, 0)])])
    assert (counts["steps"], counts["verifies"], counts["accepted"], counts["tokens"]) == (5, 2, 4, 9)
    assert counts["tokens_per_step"] == 9 / 5
    assert counts["mean_acceptance_length"] == 1 + 4 / 2


def test_first_tokens_take_whole_steps(script):
    outs = [output(STEPS)]
    # 5 tokens end inside step 2: steps 0-2, all their tokens
    assert script.origin_counts(outs, [5]) == {"steps": 3, "verifies": 1, "accepted": 2, "tokens": 5,
                                               "tokens_per_step": 5 / 3, "mean_acceptance_length": 3.0}
    two = script.origin_counts(outs, [2])  # the second token is step 1's first: step 1 counts whole
    assert (two["steps"], two["verifies"], two["accepted"], two["tokens"]) == (2, 1, 2, 4)
    assert script.origin_counts(outs, [100]) == script.origin_counts(outs)  # past the end: all of it
    nothing = script.origin_counts(outs, [0])
    assert nothing["steps"] == nothing["tokens"] == 0
    assert nothing["tokens_per_step"] is None and nothing["mean_acceptance_length"] is None


def test_an_output_without_drafts_has_no_acceptance_length(script):
    counts = script.origin_counts([output([(0, 0), (0, 0)])])
    assert counts["verifies"] == 0 and counts["mean_acceptance_length"] is None
    assert counts["tokens_per_step"] == 1.0


def test_ratio(script):
    assert script.ratio(1.5, 2.0) == 0.75
    assert script.ratio(None, 2.0) is None and script.ratio(1.0, 0.0) is None
