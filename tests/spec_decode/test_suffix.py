"""Suffix decoding in the engine: greedy output equals plain greedy output (fp32) alone and as a
hybrid with EAGLE3, across k, chunked prefill and preemption, on a fixture and on the shipped
default model; a sampled run; the global cache across requests; bad configs; host time per step."""

from __future__ import annotations

import pytest
import torch

from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams
from foretell.spec_decode.proposer import DraftBatch
from foretell.spec_decode.suffix import SuffixProposer, SuffixSettings
from foretell.spec_decode.suffix_cache import GlobalSuffixCache

MAX_TOKENS = 24


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128)
    return ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))


def proposer_of(llm: LLM):
    return llm.engine.runner.proposer


@pytest.mark.parametrize("mode", ["batch", "stress"])
@pytest.mark.parametrize("k", [2, 8])
def test_suffix_greedy_equals_plain_greedy(qwen3_checkpoint, baseline, k, mode):
    options = dict(STRESS) if mode == "stress" else dict(num_kv_blocks=128)
    spec = {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": 6}
    llm = LLM(qwen3_checkpoint, dtype="float32", speculative_config=spec, **options)
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0
    if mode == "stress":
        assert stats["num_preemptions"] > 0
    proposer = proposer_of(llm)
    assert proposer.states == {}  # every sequence forgotten; their responses are cached
    assert len(proposer.cache) >= len(PROMPTS)
    # the same prompts again: drafts from the cached responses too, same output
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline
    assert llm.get_stats()["num_free_kv_blocks"] == llm.get_stats()["num_kv_blocks"]


def test_hybrid_with_eagle3_equals_plain_greedy(qwen3_checkpoint, eagle3_head, baseline):
    spec = {"method": "suffix", "hybrid": "eagle3", "model": eagle3_head, "num_speculative_tokens": 6,
            "hybrid_num_speculative_tokens": 2, "hybrid_min_match_length": 3}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline
    hybrid = proposer_of(llm)
    assert hybrid.num_suffix_drafts > 0 and hybrid.num_model_drafts > 0
    stress = LLM(qwen3_checkpoint, dtype="float32", speculative_config=spec, **STRESS)
    assert ids(stress.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline


def test_default_model_suffix_equals_plain_and_accepts_long_drafts():
    from foretell.bench.repetitive import repetitive_prompts
    from foretell.defaults import default_target

    # a multi-turn prompt quoting the earlier answer, and the same question re-asked after it
    quote, _, _, again = (p.text for p in repetitive_prompts(4))
    plain = LLM(default_target(), dtype="float32", num_kv_blocks=128)
    expected = ids(plain.generate([quote, again, again], greedy(40), use_tqdm=False))
    llm = LLM(default_target(), dtype="float32", num_kv_blocks=128, speculative_config={"method": "suffix"})
    got = [ids(llm.generate([prompt], greedy(40), use_tqdm=False))[0] for prompt in (quote, again, again)]
    assert got == expected
    stats = llm.get_stats()
    assert stats["mean_acceptance_length"] > 3  # the quoted answer, then the cached response
    assert len(proposer_of(llm).cache) == 3


def test_sampled_run_is_seeded_and_drafts(qwen3_checkpoint):
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
            "suffix_decoding_min_match_length": 1}
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    runs = []
    for _ in range(2):
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, speculative_config=spec)
        runs.append(ids(llm.generate(PROMPTS, params, use_tqdm=False)))
        stats = llm.get_stats()
        assert stats["num_drafts"] > 0
        assert not llm.engine.runner.host_step.draft_probs  # one-hot drafts keep no probabilities
    assert runs[0] == runs[1]
    assert all(len(r) == MAX_TOKENS for r in runs[0])


def draft_batch(histories: list[list[int]], seq_ids: list[int], k: int = 8) -> DraftBatch:
    n = len(histories)
    empty = torch.empty(0)
    return DraftBatch(
        start_positions=[len(h) - 2 for h in histories], num_valid_rows=[1] * n,
        next_token_ids=[h[-1] for h in histories], samples=[True] * n, token_ids=empty,
        hidden_states=empty, aux_hidden_states=[], block_table=empty, block_size=16,
        sampling_params=[None] * n, sample_indices=[0] * n, max_model_len=1000,
        histories=histories, seq_ids=seq_ids,
    )


def test_a_finished_response_drafts_for_the_next_request():
    proposer = SuffixProposer(8, SuffixSettings(max_tree_depth=8, min_match_length=2))
    prompt, answer = [1, 2, 3], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    history = prompt + answer[:1]
    proposer.propose(draft_batch([history], [1]))
    for t in answer[1:]:
        history = history + [t]
        proposer.propose(draft_batch([history], [1]))
    proposer.forget(1)
    assert list(proposer.cache.responses) == [answer]
    # another prompt whose answer starts the same way: the global cache drafts the rest
    other = [9, 9, 9, 50, 51, 52]
    drafts = proposer.propose(draft_batch([other], [2])).token_ids
    assert drafts == [[53, 54, 55]]  # max_spec_factor 1: as many tokens as matched
    # a history that does not continue the state seen (e.g. after a failed step) is rebuilt
    assert proposer.propose(draft_batch([[7, 8]], [2])).token_ids == [[]]
    # no seq ids: drafted from scratch, same drafts
    assert proposer.propose(draft_batch([other], [])).token_ids == [[53, 54, 55]]


def test_dropped_responses_draft_nothing_and_held_matches_stay_valid():
    proposer = SuffixProposer(8, SuffixSettings(max_tree_depth=8, min_match_length=2))
    answer = [50, 51, 52, 53, 54, 55]
    proposer.cache.add(answer)
    reader = [9, 9, 50, 51]  # holds a match in the cached response while it is dropped
    assert proposer.propose(draft_batch([reader], [3])).token_ids == [[52, 53]]
    proposer.drop_cached_responses()
    assert len(proposer.cache) == 0 and proposer.cache.num_tokens == 0
    assert proposer.propose(draft_batch([[8, 8, 50, 51]], [4])).token_ids == [[]]  # nothing cached
    assert proposer.propose(draft_batch([reader + [52]], [3])).token_ids == [[]]  # its old match is gone
    proposer.cache.add([70, 71, 72, 73])  # later responses are cached and drafted from as before
    assert proposer.propose(draft_batch([[1, 70, 71]], [5])).token_ids == [[72, 73]]
    assert proposer.propose(draft_batch([reader + [52, 70, 71]], [3])).token_ids == [[72, 73]]


def test_warm_up_leaves_no_response_in_the_suffix_cache(qwen3_checkpoint, baseline, monkeypatch):
    """The warm-up's dummy requests finish (their responses enter the global cache) and then are
    dropped: no real request drafts from them; real responses are cached after it as before."""
    dropped = []
    clear = GlobalSuffixCache.clear
    monkeypatch.setattr(GlobalSuffixCache, "clear", lambda self: dropped.append(len(self)) or clear(self))
    spec = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 6}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, warm_up="on", max_num_batched_tokens=32,
              speculative_config=spec)
    cache = proposer_of(llm).cache
    assert llm.engine.warm_up_seconds > 0 and dropped and dropped[0] > 0  # the warm-up had cached some
    assert len(cache) == 0 and cache.num_tokens == 0 and proposer_of(llm).states == {}
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baseline
    assert len(cache) == len(PROMPTS)


def test_drafts_stop_at_the_useful_positions():
    proposer = SuffixProposer(8)
    history = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8, 9]
    batch = draft_batch([history], [1])
    batch.max_model_len = len(history) + 2  # two positions left after the history
    assert proposer.propose(batch).token_ids == [[10, 11]]
    batch.samples = [False]
    assert proposer.propose(batch).token_ids == [[]]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth must be an integer >= 2"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a number > 0"),
        ({"suffix_decoding_min_match_length": 0}, "suffix_decoding_min_match_length must be an integer >= 1"),
        ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be a number in \[0, 1\]"),
        ({"hybrid": "ngram"}, "hybrid must be one of eagle3, mtp, draft_model"),
        ({"hybrid": "eagle3"}, "hybrid 'eagle3' needs a draft model folder"),
        ({"hybrid": "mtp", "num_speculative_tokens": 2, "hybrid_num_speculative_tokens": 3},
         "hybrid_num_speculative_tokens 3 is more than num_speculative_tokens 2"),
        ({"hybrid_num_speculative_tokens": 2}, "needs a hybrid drafter"),
        ({"suffix_decoding_max_tree_dept": 3}, "unknown speculative_config keys"),
    ],
)
def test_bad_suffix_configs(qwen3_checkpoint, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(qwen3_checkpoint, num_kv_blocks=16, speculative_config={"method": "suffix", **config})


def test_hybrid_needs_method_suffix():
    from foretell.config import SpeculativeConfig

    with pytest.raises(ValueError, match="hybrid combines suffix decoding"):
        SpeculativeConfig(method="ngram", hybrid="mtp")


def test_cli_flags_build_the_suffix_config():
    import argparse

    from foretell.cli_args import add_engine_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    args = parser.parse_args(["--method", "suffix", "--suffix-decoding-max-tree-depth", "12",
                              "--suffix-decoding-min-token-prob", "0.2", "--suffix-decoding-min-match-length", "3",
                              "--hybrid", "mtp",
                              "--hybrid-min-match-length", "6"])
    config = speculative_config_from_args(args)
    assert config == {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 12,
                      "suffix_decoding_min_token_prob": 0.2, "suffix_decoding_min_match_length": 3, "hybrid": "mtp",
                      "hybrid_min_match_length": 6}


def test_host_time_per_step_is_measured():
    from foretell.bench.suffix_host_cost import measure_host_cost

    for batch_size in (1, 16):
        result = measure_host_cost(batch_size, num_steps=20, prompt_len=256, output_len=64)
        print(f"suffix drafter host time, batch {batch_size}: {result['us_per_step']:.0f} us/step, "
              f"{result['us_per_sequence']:.0f} us/sequence, prefill {result['prefill_ms']:.1f} ms")
        assert result["tokens_per_sequence_step"] > 1.5  # the copied output is drafted
