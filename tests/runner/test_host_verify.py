"""A host drafter's greedy verify step verified on the host (runner/host_verify.py).

greedy_accept_on_host is held to the device's verification (ops/step/reference.accept_drafts_torch,
the torch twin of the Triton kernel the padded step launches) over random padded steps, pad rows
whose target token equals the pad token, accept limits and sequences without drafts; bad shapes
are refused. On an engine (the padded step on the CPU for host drafters, fixtures/padded_step.py)
the suffix drafter's greedy steps take the host's verification and give plain greedy output, and
a step with logprobs or sampled rows keeps the device's.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.padded_step import fallback_on_the_padded_forward, record_fallbacks
from foretell import LLM, SamplingParams
from foretell.bench.datasets import load_prompts
from foretell.defaults import default_target
from foretell.ops.step.reference import accept_drafts_torch
from foretell.runner.graphed_verify import PAD_DRAFT_TOKEN, GraphedVerify
from foretell.runner.host_verify import HostVerifiedStep, greedy_accept_on_host
from foretell.runner.step_pipeline import HostCopy

SPEC = {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 10,
        "suffix_decoding_min_match_length": 2}
PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "a b a b a b a b",
           "def add(x):\n    return x + 1\ndef add(x):\n    return", "1 2 3 1 2 3 1 2"]


def device_reference(tokens: list[int], q: int, draft_ids: list[list[int]], limits: list[int | None]):
    """(accepted, next token) per sequence as the padded step computes them on the device: drafts
    padded with PAD_DRAFT_TOKEN to q - 1, caps = min(real drafts, limit)."""
    n = len(draft_ids)
    greedy = torch.tensor(tokens, dtype=torch.int64).view(n, q)
    drafts = torch.tensor([d + [PAD_DRAFT_TOKEN] * (q - 1 - len(d)) for d in draft_ids], dtype=torch.int64)
    caps = torch.tensor([len(d) if lim is None else min(len(d), lim) for d, lim in zip(draft_ids, limits)])
    accepted, next_token, live = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), torch.zeros(())
    accept_drafts_torch(greedy, drafts.view(n, q - 1), caps, accepted, next_token, live)
    return accepted.tolist(), next_token.tolist()


def test_equals_the_devices_verification_on_random_padded_steps():
    rng = random.Random(0)
    for _ in range(400):
        n, q = rng.randint(1, 6), rng.choice([2, 3, 5, 9, 17])
        vocab = rng.choice([2, 3, 50])  # few tokens: long accepted runs, pad token 0 often the target's
        tokens = [rng.randrange(vocab) for _ in range(n * q)]
        draft_ids, limits = [], []
        for i in range(n):
            length = rng.randint(0, q - 1)
            row = tokens[i * q:(i + 1) * q]
            # mostly the target's own tokens (accepted), then a random cut
            drafts = [row[j] if rng.random() < 0.8 else rng.randrange(vocab) for j in range(length)]
            draft_ids.append(drafts)
            limits.append(rng.choice([None, None, rng.randint(0, q)]))
        results = greedy_accept_on_host(tokens, q, draft_ids, limits)
        accepted, next_token = device_reference(tokens, q, draft_ids, limits)
        assert [r.num_accepted for r in results] == accepted
        assert [r.new_token_ids[-1] for r in results] == next_token
        for r, d, lim in zip(results, draft_ids, limits):
            assert r.new_token_ids[:-1] == d[:r.num_accepted]
            assert r.num_drafts == (len(d) if lim is None else min(len(d), lim))
            assert r.next_drafts == []


def test_padding_is_never_accepted_even_where_the_target_picks_the_pad_token():
    q = 5  # one real draft, three pad rows; the target's tokens at every row are the pad token
    tokens = [7, PAD_DRAFT_TOKEN, PAD_DRAFT_TOKEN, PAD_DRAFT_TOKEN, PAD_DRAFT_TOKEN]
    (result,) = greedy_accept_on_host(tokens, q, [[7]], [None])
    assert (result.num_accepted, result.new_token_ids) == (1, [7, PAD_DRAFT_TOKEN])
    (result,) = greedy_accept_on_host(tokens, q, [[]], [None])  # no drafts: the first row's token
    assert (result.num_accepted, result.new_token_ids, result.num_drafts) == (0, [7], 0)


def test_accept_limit_cuts_a_full_match():
    tokens = [1, 2, 3, 4]
    assert greedy_accept_on_host(tokens, 4, [[1, 2, 3]], [None])[0].new_token_ids == [1, 2, 3, 4]
    capped = greedy_accept_on_host(tokens, 4, [[1, 2, 3]], [1])[0]
    assert (capped.num_accepted, capped.new_token_ids, capped.num_drafts) == (1, [1, 2], 1)
    assert greedy_accept_on_host(tokens, 4, [[1, 2, 3]], [0])[0].new_token_ids == [1]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="3 tokens for 1 sequences of 4 rows"):
        greedy_accept_on_host([1, 2, 3], 4, [[1]], [None])
    with pytest.raises(ValueError, match="accept limits"):
        greedy_accept_on_host([1, 2, 3, 4], 4, [[1]], [])
    with pytest.raises(ValueError, match="4 drafts do not fit a step of 4 rows"):
        greedy_accept_on_host([1, 2, 3, 4], 4, [[1, 2, 3, 4]], [None])


def test_the_step_reads_its_copy_and_is_never_followed():
    step = HostVerifiedStep([], (1, 3), HostCopy.queue(torch.tensor([5, 6, 9])), [[5, 6]], [None])
    assert step.launch_next(None) is None and not step.matches([], 16)
    (result,) = step.read(None)
    assert (result.new_token_ids, result.num_accepted) == ([5, 6, 9], 2)


def padded(llm) -> GraphedVerify:
    return next(kind for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify))


def generate(checkpoint, params, spec=None, **options):
    llm = LLM(checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec, **options)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_suffix_greedy_steps_are_verified_on_the_host_and_equal_plain(qwen3_checkpoint, monkeypatch,
                                                                       async_scheduling):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, plain = generate(qwen3_checkpoint, params)
    llm, tokens = generate(qwen3_checkpoint, params, SPEC, async_scheduling=async_scheduling)
    assert tokens == plain
    kind = padded(llm)
    assert kind.num_host_verified_steps > 0 and kind.num_mixed_steps > 0
    assert llm.get_stats()["num_accepted_tokens"] > 0


def test_steps_with_logprobs_or_sampled_rows_verify_on_the_device(qwen3_checkpoint, monkeypatch):
    for params in (SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0.1, max_tokens=16, ignore_eos=True, seed=5)):
        llm, _ = generate(qwen3_checkpoint, params, dict(SPEC, suffix_decoding_min_token_prob=0.0))
        kind = padded(llm)
        assert kind.num_steps > 0 and llm.get_stats()["num_drafts"] > 0
        assert kind.num_host_verified_steps == 0


@pytest.mark.parametrize("max_tokens", [24, 9])  # 9: sequences stop within a step's drafts
def test_the_plain_step_after_a_drafting_one_is_queued_and_exact(qwen3_checkpoint, monkeypatch, max_tokens):
    """With the plain step after each host-verified step queued on the device (advanced from the
    verify's buffers), greedy output equals plain decoding's; such steps are taken when the
    drafter drafts nothing next and dropped when it drafts, and no KV block is left behind."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _, plain = generate(qwen3_checkpoint, params)
    queued, taken = record_fallbacks(monkeypatch)
    spec = dict(SPEC, suffix_decoding_min_accepted_tokens=0)  # the gate off: every match drafts
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec, async_scheduling="on")
    fallback_on_the_padded_forward(llm)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens == plain
    assert padded(llm).num_host_verified_steps > 0
    if max_tokens == 24:
        used = [step for step in queued if any(step is t for t in taken)]
        assert used, "no queued plain step was taken"
    block_manager = llm.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks  # (nothing kept past the requests)


def test_nothing_is_queued_after_a_step_without_plain_decodings_kind():
    step = HostVerifiedStep([], (1, 3), HostCopy.queue(torch.tensor([5, 6, 9])), [[5, 6]], [None], fallback=None)
    assert step.launch_next(None) is None


def test_fallbacks_on_the_default_family_are_taken_and_dropped_and_exact(monkeypatch):
    """The shipped default target on the repetitive prompts (real suffix matches that end): greedy
    output equals plain decoding's, some queued plain steps are taken (nobody drafted next) and
    some dropped (a sequence drafted again)."""
    prompts = [p.text for p in load_prompts("repetitive", 4)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    options = dict(dtype="float32", num_kv_blocks=256)
    plain = [o.outputs[0].token_ids for o in LLM(default_target("qwen3"), **options).generate(prompts, params,
                                                                                               use_tqdm=False)]
    queued, taken = record_fallbacks(monkeypatch)
    llm = LLM(default_target("qwen3"), speculative_config={"method": "suffix", "num_speculative_tokens": 8},
              async_scheduling="on", **options)
    fallback_on_the_padded_forward(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    used = [step for step in queued if any(step is t for t in taken)]
    assert 0 < len(used) < len(queued)


def test_no_plain_step_is_queued_where_a_sequence_could_stop_or_outrun_its_table():
    """launch_next declines (before any device work) when a sequence could reach max_tokens or
    max_model_len within its drafts and one more token, when its furthest next position passes the
    blocks the buffers' table holds, when the buffers were rewritten since the verify, and under
    adaptive speculation (the scheduler chooses the next drafts)."""
    from types import SimpleNamespace

    from foretell.runner.host_verify import FallbackDecode

    def step(max_tokens=None, outputs=2, start=10, table_end=32, version=7, max_model_len=100):
        seq = SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=max_tokens), num_output_tokens=outputs,
                              token_ids=[1] * (start + 1))
        graphs = SimpleNamespace(inputs_version=7, captures=False, graphs={})
        decode = SimpleNamespace(max_model_len=max_model_len, block_size=16)
        fallback = FallbackDecode(decode, graphs, None, None, None, None, [start], [table_end], version)
        return HostVerifiedStep([seq], (1, 4), None, [[1, 2, 3]], [None], fallback)

    assert step(max_tokens=6).launch_next() is None  # 2 outputs + 3 drafts + 1 reach 6
    assert step(table_end=14).launch_next() is None  # position 10 + 3 + 1 = 14 is past the table
    assert step(version=6).launch_next() is None  # the buffers hold another step's inputs
    assert step(max_model_len=15).launch_next() is None  # 11 tokens + 3 + 1 reach the limit
    assert step().launch_next(num_next_drafts=2) is None
