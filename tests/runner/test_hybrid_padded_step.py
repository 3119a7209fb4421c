"""A hybrid drafter (suffix + a model drafter) on the padded verify step (runner/host_drafts.py).

Its verifies take the padded device step (GraphedVerify over HostDraftSlots with reads_rows: no
device draft loop), on the CPU the same buffers run eagerly; after each step's read the suffix
side drafts from the token lists and the model drafter catches up on the host over the step's
target rows (DrafterRows, HostStep.propose). The host step it took before is the reference
(fixtures/padded_step.host_step_for_host_drafters). Checked:
  - greedy output equals plain greedy output (fp32) with both sides drafting, in a batch of
    unequal draft counts and under chunked prefill and preemption; no verify takes the host step;
  - nothing is queued ahead (the model's catch-up reads every step's rows after the read);
  - greedy rows with logprobs equal the host step's, beside seeded sampled rows (whose model
    drafts come with their distributions) that are reproducible and leave no KV block behind;
  - a grammar's requests under the hybrid on the padded step: plain's output, every verify padded.
"""

from __future__ import annotations

import pytest
import regex

from fixtures.padded_step import count_steps, host_step_for_host_drafters, record_host_steps
from fixtures.spec_prompts import PROMPTS, STRESS
from foretell import LLM, SamplingParams
from foretell.runner.graphed_verify import GraphedVerify
from foretell.runner.host_drafts import HostDraftSlots

MAX_TOKENS = 20


def hybrid_spec(model: str, method: str = "eagle3") -> dict:
    """Suffix drafts (K = 6) where the match is 3 tokens or longer, else the model drafter's 2."""
    return {"method": "suffix", "hybrid": method, "model": model, "num_speculative_tokens": 6,
            "hybrid_num_speculative_tokens": 2, "hybrid_min_match_length": 3}


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def engine(folder, spec=None, **options) -> LLM:
    return LLM(folder, dtype="float32", speculative_config=spec, **{"num_kv_blocks": 128, **options})


@pytest.fixture(scope="module")
def plain(qwen3_checkpoint):
    return ids(engine(qwen3_checkpoint).generate(PROMPTS, greedy(), use_tqdm=False))


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
@pytest.mark.parametrize("mode", ["batch", "stress"])
def test_hybrid_greedy_equals_plain_on_the_padded_step(qwen3_checkpoint, eagle3_head, plain, method, mode,
                                                       monkeypatch):
    # draft_model: the target drafting for itself, so the model's drafts are accepted and its
    # catch-up reads accepted rows; the random EAGLE3 head accepts nothing but reads the aux rows
    model = eagle3_head if method == "eagle3" else qwen3_checkpoint
    host_steps = record_host_steps(monkeypatch)
    counts = count_steps(monkeypatch)
    llm = engine(qwen3_checkpoint, hybrid_spec(model, method), **(STRESS if mode == "stress" else {}))
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == plain
    runner = llm.engine.runner
    assert isinstance(runner.draft_graphs, HostDraftSlots) and runner.draft_graphs.reads_rows
    assert runner.draft_graphs.verify_lens == (1, 3, 4, 7)  # host_draft_verify_lens(K = 6)
    assert counts["padded"] > 0
    # the host step took the prefills alone (under stress, beside verifies split off: split_step.py)
    assert counts["host_verify"] == 0 and all(host_steps)
    assert (runner.num_split_steps > 0) == (mode == "stress")
    hybrid = runner.proposer
    assert hybrid.num_suffix_drafts > 0 and hybrid.num_model_drafts > 0
    assert not runner.pipeline.queue_ahead and runner.pipeline.num_launched == 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    if method == "draft_model":
        assert stats["num_accepted_tokens"] >= hybrid.num_model_drafts  # most of the self-drafts


def test_hybrid_padded_step_equals_the_host_step(qwen3_checkpoint):
    """Greedy rows with logprobs are the host step's; seeded sampled rows (the model's sampled
    drafts verified against the distributions they were drawn from) are reproducible. The
    target drafts for itself (a draft model), so drafts are accepted in both kinds of row."""
    params = [greedy(logprobs=2), greedy(),
              SamplingParams(temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.7, max_tokens=MAX_TOKENS, ignore_eos=True, seed=8, logprobs=1)]

    def generate():
        llm = engine(qwen3_checkpoint, hybrid_spec(qwen3_checkpoint, "draft_model"))
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return llm, ids(outs), [[(lp.token_id, round(lp.logprob, 4)) for lp in o.outputs[0].logprobs or []]
                                for o in outs]

    with host_step_for_host_drafters():
        reference, ref_tokens, ref_logprobs = generate()
    assert reference.engine.runner.draft_graphs is None  # the host step
    llm, tokens, logprobs = generate()
    kind = next(k for k in llm.engine.runner.pipeline.kinds if isinstance(k, GraphedVerify))
    assert kind.num_sampled_steps > 0 and kind.num_logprob_steps > 0
    assert tokens[:2] == ref_tokens[:2] and logprobs[:2] == ref_logprobs[:2]
    assert generate()[1:] == (tokens, logprobs)  # seeded: reproducible
    assert all(len(t) == MAX_TOKENS for t in tokens)
    stats = llm.get_stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_hybrid_grammar_on_the_padded_step(qwen3_checkpoint, eagle3_head, monkeypatch):
    """A grammar's requests verify on the padded step with their masks; drafts are shaped on the
    host after the read (the suffix side's cut where the grammar rejects them, the model's masked
    as it drafts), and the output is plain decoding's under the same grammar."""
    pattern = r"(the|cat|[0-9]{1,2}) reads the book, (the|a) cat reads the book\."
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": pattern})
    prompts = PROMPTS[:3]
    expected = ids(engine(qwen3_checkpoint).generate(prompts, params, use_tqdm=False))
    counts = count_steps(monkeypatch)
    llm = engine(qwen3_checkpoint, hybrid_spec(eagle3_head))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert ids(outputs) == expected
    assert all(regex.fullmatch(pattern, o.outputs[0].text) for o in outputs)
    kind = next(k for k in llm.engine.runner.pipeline.kinds if isinstance(k, GraphedVerify))
    assert counts["padded"] > 0 and counts["host_verify"] == 0 and kind.num_grammar_steps > 0
