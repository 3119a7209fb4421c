"""Device->host syncs of a grammar request's steps (issue 27), counted on the CPU by
bench/device_syncs.DeviceSyncCounter, so that CI holds what a CUDA step would wait for.

At batch 1 with EAGLE3 k=3 a speculative step under a grammar on the host step (the form of
n-gram's, tensor parallelism's and trees' grammar requests; a model drafter's verify on the padded
step since 2026-12-02: one sync, tests/structured/test_padded_grammar.py) reads back the verify's
result (1), each draft the grammar must consume before masking the next position (k - 1 = 2) and
the last draft (1): 4 syncs, against 2 for the same step without a grammar. Two syncs per step that
the chain steps' attention metadata made (repeat_interleave without output_size) are gone.
"""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams
from foretell.bench.device_syncs import DeviceSyncCounter, syncs_per_step
from foretell.bench.structured_overhead import HostStepOnly, PaddedVerifyOff
from foretell.device_util import to_device

ALWAYS_TRUE = r"(.|\n)*"
PROMPT = "def add(x):"
K = 3


# ---- the counter itself -------------------------------------------------------------------
def test_reads_of_device_data_are_syncs_and_host_reads_are_not():
    weight = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
    host = torch.arange(4)
    with DeviceSyncCounter() as counter:
        scores = weight.sum(1)  # device data: derived from a parameter
        host.tolist(), int(host[1]), bool(host.any()), host[host > 1], host.nonzero()  # host data: no sync
        assert counter.num_syncs == 0
        scores.tolist()
        float(scores[0])
        bool((scores > 0).any())
        scores.nonzero()
        scores[scores > 0]
        torch.where(scores > 0)
        scores.cpu(), scores.numpy()
    assert counter.num_syncs == 8
    sites = dict(counter.sync_sites)
    assert sum(n for site, n in sites.items() if site.startswith("tolist at")) == 1
    assert sum(n for site, n in sites.items() if site.startswith("_local_scalar_dense at")) == 2
    assert sum(n for site, n in sites.items() if site.startswith("nonzero at")) == 2  # .nonzero() and where(x)


def test_uploads_and_device_factories_hold_device_data():
    with DeviceSyncCounter() as counter:
        uploaded = to_device([3, 1, 2], torch.int64, torch.device("cpu"))  # [3]
        made = torch.zeros(3, device="cpu")  # an explicit device: the device's tensor
        host_made = torch.zeros(3)
        assert counter.num_uploads == 1
        assert counter.num_syncs == 0
        host_made.tolist()
        assert counter.num_syncs == 0
        uploaded.tolist(), made.tolist()
        assert counter.num_syncs == 2
        ok = torch.repeat_interleave(torch.arange(3, device="cpu"), uploaded, output_size=6)  # [6]
        assert counter.num_syncs == 2 and ok.tolist() == [0, 0, 0, 1, 2, 2]
        torch.repeat_interleave(torch.arange(3, device="cpu"), uploaded)  # the size is read back
        assert counter.num_syncs == 4  # ok.tolist() and the repeat_interleave
        host_made.copy_(uploaded)  # written with device data: the device's now
        host_made.tolist()
        assert counter.num_syncs == 5
        counter.enabled = False
        uploaded.tolist()
    assert counter.num_syncs == 5


# ---- the engine's steps -------------------------------------------------------------------
def _per_step_syncs(llm: LLM, params: SamplingParams) -> tuple[list[tuple[bool, dict]], list[int]]:
    """(for each engine step of one request: whether it verified drafts, its counts), the tokens."""
    steps, outs = syncs_per_step(llm, [PROMPT], params)
    return steps, list(outs[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def eagle3_llm(qwen3_checkpoint, eagle3_head):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
             speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K}) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain_llm(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64) as llm:
        yield llm


def test_speculative_grammar_step_syncs_at_batch_1(eagle3_llm, plain_llm):
    base = dict(temperature=0, max_tokens=10, ignore_eos=True)
    grammar = SamplingParams(**base, structured_outputs={"regex": ALWAYS_TRUE})
    expected = plain_llm.generate([PROMPT], grammar, use_tqdm=False)[0].outputs[0].token_ids
    eagle3_llm.generate([PROMPT], grammar, use_tqdm=False)  # the grammar compiled, the tokenizer loaded
    with PaddedVerifyOff(eagle3_llm):  # the host step's form
        steps, tokens = _per_step_syncs(eagle3_llm, grammar)
    assert tokens == list(expected)  # greedy with the grammar: plain decoding's tokens under it
    verifies = [counts for verified, counts in steps if verified]
    assert len(verifies) >= 3
    for counts in verifies:
        assert counts["syncs"] <= K + 1, counts["sites"]  # verify result + k - 1 grammar reads + the last draft
        assert not [site for site in counts["sites"] if "repeat_interleave" in site]
        grammar_sites = {site: n for site, n in counts["sites"].items() if "foretell/structured/" in site}
        assert sum(grammar_sites.values()) <= K - 1, grammar_sites

    with HostStepOnly(eagle3_llm):  # the same step without a grammar (the fixture's byte tokens
        # make "(.|\n)*" forbid a few, invalid UTF-8 at their place: other tokens)
        plain_steps, _ = _per_step_syncs(eagle3_llm, SamplingParams(**base))
    for verified, counts in plain_steps:
        if verified:
            assert counts["syncs"] <= 2, counts["sites"]  # the verify's result and the drafts


def test_plain_decode_grammar_step_syncs(plain_llm):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, structured_outputs={"regex": ALWAYS_TRUE})
    plain_llm.generate([PROMPT], params, use_tqdm=False)
    steps, _ = _per_step_syncs(plain_llm, params)
    for _, counts in steps[1:]:  # decode steps: the sampled token is the one read back
        assert counts["syncs"] <= 1, counts["sites"]
