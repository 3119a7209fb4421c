"""Draft trees with a draft LM (speculative_config method "draft_model", topk > 1): the tree drafter
(spec_decode/tree/proposer.py) feeds the draft LM each frontier token at its own position, its
scratch rows after the root's row, which the LM's catch-up writes. In float32 on the Qwen3 fixture:
greedy output equals plain greedy output with another LM as the draft and with the target drafting
for itself (its best drafts right: paths run deep, so requests end inside trees at max_tokens and
at max_model_len); every drafted node's score (its path's log-probability under the
draft LM) equals the one a plain forward of the draft LM over the context and the path computes;
sampled trees are reproducible; no KV block is left behind."""

from __future__ import annotations

import pytest

from foretell import LLM, SamplingParams
from foretell.spec_decode.tree.proposer import ModelTreeDrafter
from test_tree_engine import check_blocks_free, ids

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "Question: what is 3 plus 7? Answer:",
    "Once upon a time",
]
MAX_TOKENS = 10
TREE = {"num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}


def greedy(max_tokens: int | None = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tree_llm(target: str, draft: str, tree: dict = TREE, **kwargs) -> LLM:
    spec = {"method": "draft_model", "model": draft, **tree}
    return LLM(target, dtype="float32", speculative_config=spec, **{"num_kv_blocks": 64, **kwargs})


@pytest.mark.parametrize("drafter", ["other_lm", "itself"])
def test_greedy_draft_model_trees_equal_plain(qwen3_checkpoint, qwen3_tied_checkpoint, drafter):
    draft = qwen3_checkpoint if drafter == "itself" else qwen3_tied_checkpoint
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    llm = tree_llm(qwen3_checkpoint, draft)
    assert llm.engine.runner.tree_step is not None
    want = ids(plain.generate(PROMPTS, greedy(), use_tqdm=False))
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == want
    stats = llm.get_stats()
    assert stats["num_drafts"] > 0
    if drafter == "itself":  # the target's own argmax is every tree's best depth-1 child
        assert stats["acceptance_per_position"][0] == 1.0
    check_blocks_free(llm)


def test_tree_scores_are_the_draft_lms_path_logprobs(qwen3_checkpoint, qwen3_tied_checkpoint, monkeypatch):
    """Each node's score, recomputed from scratch: the draft LM run plainly over the sequence so far
    (its root last) and the node's path, the path tokens' log-probabilities summed (prompt_logprobs).
    This holds the depth forwards' positions, scratch slots and ancestor masks against no shortcut."""
    drafted = []  # (the sequence's tokens through its root, tree tokens, parents, scores)
    original = ModelTreeDrafter.draft

    def recording_draft(self, batch, drafting):
        tree = original(self, batch, drafting)
        for j, i in enumerate(drafting):
            drafted.append((batch.histories[i], tree.tokens[j].tolist(), tree.parents[j].tolist(),
                            tree.scores[j].tolist()))
        return tree

    monkeypatch.setattr(ModelTreeDrafter, "draft", recording_draft)
    llm = tree_llm(qwen3_checkpoint, qwen3_tied_checkpoint, {"num_speculative_tokens": 3, "topk": 2,
                                                             "num_draft_tokens": 11})  # every candidate kept
    llm.generate(PROMPTS[:2], greedy(6), use_tqdm=False)
    assert len(drafted) >= 4
    draft_lm = LLM(qwen3_tied_checkpoint, dtype="float32", num_kv_blocks=64)
    checked = 0
    for history, tokens, parents, scores in drafted[:4]:
        assert tokens[0] == history[-1]  # the root: the sequence's next token
        for node in range(1, len(tokens)):
            path, at = [], node
            while at > 0:  # the node's path back to the root (parents: node indices, the root 0)
                path.insert(0, tokens[at])
                at = parents[at]
            params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
            out = draft_lm.generate([{"prompt_token_ids": history + path}], params, use_tqdm=False)[0]
            entries = out.prompt_logprobs[len(history):]  # the path tokens' own log-probabilities
            assert [entry.token_id for entry in entries] == path
            expected = sum(entry.logprob for entry in entries)
            assert scores[node] == pytest.approx(expected, abs=2e-4), (node, path)
            checked += 1
    assert checked >= 4 * 10


def test_draft_model_trees_end_inside_trees(qwen3_checkpoint):
    """Every draft right, so the accepted paths run deep and the ends (max_tokens, max_model_len)
    land inside trees; near the limit the scheduler cuts trees and the drafter's rows stay below it."""
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_model_len=40)
    llm = tree_llm(qwen3_checkpoint, qwen3_checkpoint, {"num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 7},
                   max_model_len=40)
    for max_tokens in (1, 2, 5, 6, None):  # None: up to max_model_len
        params = greedy(max_tokens)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert ids(got) == ids(plain.generate(PROMPTS, params, use_tqdm=False)), max_tokens
        for out in got:
            assert len(out.outputs[0].token_ids) == (max_tokens or 40 - len(out.prompt_token_ids))
            assert out.outputs[0].finish_reason == "length"
    check_blocks_free(llm)


def test_sampled_draft_model_trees_beside_greedy(qwen3_checkpoint, qwen3_tied_checkpoint):
    """Greedy, seeded and unseeded sampled requests in one batch of trees: the greedy one equals plain
    greedy, the seeded one its run alone and its rerun, every token in the vocabulary."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    llm = tree_llm(qwen3_checkpoint, qwen3_tied_checkpoint, seed=0)
    mixed = ids(llm.generate(PROMPTS, [greedy(), seeded, unseeded], use_tqdm=False))
    alone = ids(llm.generate([PROMPTS[1]], seeded, use_tqdm=False))[0]
    assert mixed[0] == ids(plain.generate([PROMPTS[0]], greedy(), use_tqdm=False))[0]
    assert mixed[1] == alone
    size = llm.engine.runner.vocab_size
    assert all(len(r) == MAX_TOKENS and all(0 <= t < size for t in r) for r in mixed)
    check_blocks_free(llm)


def test_draft_model_trees_reserve_the_root_row(qwen3_checkpoint):
    """A draft LM's tree writes one KV slot more past the verified tokens than EAGLE3's (its
    catch-up's last row is the root's own)."""
    from foretell.speculative_config import SpeculativeConfig

    eagle = SpeculativeConfig(method="eagle3", model="head", **TREE)
    draft = SpeculativeConfig(method="draft_model", model=qwen3_checkpoint, **TREE)
    assert (eagle.num_draft_kv_slots, draft.num_draft_kv_slots) == (4, 5)  # max(depth, (depth - 1) * topk) (+ 1)


def test_tree_steps_report_their_drafting_time(qwen3_checkpoint, monkeypatch):
    """The runner's StepTimes for a tree step split its wall time: the eager drafting after the
    read (draft_s, what `foretell bench` reports as draft ms) and the rest (target_s)."""
    from foretell.runner.model_runner import ModelRunner

    times = []
    execute = ModelRunner.execute

    def timed(self, sched):
        results = execute(self, sched)
        times.append((self.last_times.target_s, self.last_times.draft_s))
        return results

    monkeypatch.setattr(ModelRunner, "execute", timed)
    llm = tree_llm(qwen3_checkpoint, qwen3_checkpoint)
    llm.generate(PROMPTS[:1], greedy(), use_tqdm=False)
    assert all(target > 0 and draft >= 0 for target, draft in times)
    assert sum(draft > 0 for _, draft in times) >= len(times) - 1  # every step drafts but a request's last
