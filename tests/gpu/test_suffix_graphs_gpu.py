"""On a CUDA GPU: host drafters (suffix, n-gram) verify on the target's captured graphs
(runner/host_drafts.py: the padded step with HostDraftSlots, drafts from the host's token lists
after its one read-back), steps without drafts queued ahead; greedy output (fp32) equals plain
decoding's, with logprobs, beside seeded sampled requests; and no verify takes the host step. With
K = 16 the graphs are captured for 1, 5, 9 and 17 rows per sequence (host_draft_verify_lens) and each
step replays the fewest that hold its longest draft."""

from __future__ import annotations

import pytest

from fixtures.padded_step import assert_same_outputs
from foretell import LLM, SamplingParams
from foretell.runner.decode_ahead import DecodeAhead
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_drafts import HostDraftSlots
from foretell.runner.host_step import HostStep

PROMPTS = ["The cat reads the book. The cat reads the book. The cat", "def add(x):\n    return x + 1\ndef add(x):",
           "a b a b a b a b", "Question: what is 3 plus 7? Answer:"]
# The gate's bar fixed (its "auto" default follows the machine's step times:
# tests/spec_decode/test_suffix_cost_gate.py)
SPECS = {"suffix": {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_min_match_length": 2,
                    "suffix_decoding_min_accepted_tokens": 1.0},
         "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}


def generate(folder, params, **kwargs):
    llm = LLM(folder, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8, **kwargs)
    return llm, [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("method", ["suffix", "ngram"])
def test_host_drafters_verify_on_the_graphs(qwen3_checkpoint, method, monkeypatch):
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2) for _ in PROMPTS]
    _, plain = generate(qwen3_checkpoint, params)
    host_verifies = []
    sample = HostStep.sample

    def counted(self, sched, batch, logits, results):
        host_verifies.append(any(item.draft_token_ids for item in sched.scheduled))
        return sample(self, sched, batch, logits, results)

    llm = LLM(qwen3_checkpoint, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              speculative_config=SPECS[method])
    # Counted from here: the warm-up's steps mix prefill chunks with verifies (the host step's, by
    # design), and its responses had already given the suffix cache matches to draft from.
    monkeypatch.setattr(HostStep, "sample", counted)
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner = llm.engine.runner
    assert runner.graphs.captures and isinstance(runner.draft_graphs, HostDraftSlots)
    assert not any(host_verifies)
    # A step without drafts is a plain decode step queued ahead (DecodeAhead), the others verify padded.
    verify = next(kind for kind in runner.pipeline.kinds if isinstance(kind, GraphedVerify))
    assert verify.num_steps > 0 and llm.get_stats()["num_accepted_tokens"] > 0
    assert isinstance(runner.pipeline.kinds[0], DecodeAhead)
    assert_same_outputs(got, plain)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    print(f"{method}: steps queued ahead {runner.pipeline.num_launched}, used {runner.pipeline.num_used}")


def test_sampled_requests_are_reproducible(qwen3_checkpoint):
    params = [SamplingParams(temperature=0.3, max_tokens=32, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]
    runs = [[o.token_ids for o in generate(qwen3_checkpoint, params, speculative_config=SPECS["suffix"])[1]]
            for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 32 for t in runs[0])


def test_suffix_k16_replays_the_smallest_verify_graph(qwen3_checkpoint, monkeypatch):
    """K = 16: graphs of 1, 5, 9 and 17 rows per sequence for every batch bucket; every padded step
    replays the one of the fewest rows that holds 1 + its longest draft (shorter ones taken), and
    greedy output (fp32) equals plain decoding's."""
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True) for _ in PROMPTS]
    _, plain = generate(qwen3_checkpoint, params)
    steps = []  # (rows per sequence, 1 + the longest draft)
    launch = GraphedVerify.launch

    def recorded(self, sched, batch):
        launched = launch(self, sched, batch)
        if launched is not None:
            steps.append((launched.key[1], 1 + max(len(item.draft_token_ids) for item in sched.scheduled)))
        return launched

    monkeypatch.setattr(GraphedVerify, "launch", recorded)
    spec = dict(SPECS["suffix"], num_speculative_tokens=16)
    llm, got = generate(qwen3_checkpoint, params, speculative_config=spec)
    runner = llm.engine.runner
    assert runner.graphs.captures and runner.draft_graphs.verify_lens == (1, 5, 9, 17)
    assert {q for _, q in runner.graphs.graphs} == {1, 5, 9, 17}
    assert {b for b, _ in runner.graphs.graphs} == set(runner.graphs.buckets)
    assert [g.token_ids for g in got] == [e.token_ids for e in plain]
    assert steps and all(q == min(b for b in (1, 5, 9, 17) if b >= most) for q, most in steps)
    assert {q for q, most in steps if most > 1} & {5, 9}, "no drafting step replayed a shorter graph"
    print(f"K = 16: verify lengths replayed {sorted({q for q, _ in steps})}, "
          f"accepted {llm.get_stats()['num_accepted_tokens']}")


def test_the_plain_step_after_a_drafting_one_is_queued_on_the_graphs(monkeypatch):
    """The shipped default target on the repetitive prompts, fp32, async scheduling: each greedy
    host-verified step queues the plain step after it on the (bucket, 1) graph (runner/host_verify.py);
    some are taken, some dropped, and greedy output equals plain decoding's."""
    from fixtures.padded_step import record_fallbacks
    from foretell.bench.datasets import load_prompts
    from foretell.defaults import default_target

    prompts = [p.text for p in load_prompts("repetitive", 8)]
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    options = dict(device="cuda", dtype="float32", num_kv_blocks=512, max_num_seqs=4)
    plain = [o.outputs[0].token_ids for o in LLM(default_target("qwen3"), **options).generate(prompts, params,
                                                                                               use_tqdm=False)]
    llm = LLM(default_target("qwen3"), speculative_config={"method": "suffix", "num_speculative_tokens": 8}, **options)
    queued, taken = record_fallbacks(monkeypatch)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    used = [step for step in queued if any(step is t for t in taken)]
    assert 0 < len(used) < len(queued)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    print(f"fallbacks queued {len(queued)}, taken {len(used)}")


def test_suffix_trees_verify_on_the_tree_graphs(qwen3_checkpoint):
    """method suffix with topk > 1 (tree/host_drafter.py): whole padded trees verify on the tree
    step's captured (bucket, T) graphs; greedy fp32 equals plain; a batch of 8 with trees."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, plain = generate(qwen3_checkpoint, params)
    spec = {"method": "suffix", "num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 7,
            "suffix_decoding_min_match_length": 1, "suffix_decoding_min_token_prob": 0.0,
            "suffix_decoding_min_accepted_tokens": 0}
    llm, got = generate(qwen3_checkpoint, params, speculative_config=spec)
    step = llm.engine.runner.tree_step
    assert step.host_trees and step.verify_graphs is not None and step.verify_graphs.captures
    assert [g.token_ids for g in got] == [e.token_ids for e in plain]
    assert step.num_graphed_verifies > 0 and llm.get_stats()["num_accepted_tokens"] > 0
    assert llm.engine.runner.pipeline.num_used > 0  # steps without trees decoded plainly, queued ahead
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
