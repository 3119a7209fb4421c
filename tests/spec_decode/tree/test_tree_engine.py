"""Draft trees end to end (speculative_config topk > 1, runner/tree_step.py): greedy output equals
plain greedy output token for token (Qwen3 and Llama-3.1 layouts, batches of different prompt
lengths, chunked prefill and preemption, requests ending mid-tree at max_tokens and at
max_model_len); an oracle drafter that hides the target's own continuation on the tree's last
branch is accepted along it (the path's K/V moved into place, the catch-up reading its rows);
topk 1 is today's chain; sampled trees are valid and reproducible with a seed; bad configs are
named; no KV block outlives its request."""

from __future__ import annotations

import os

import pytest

from fixtures.eagle3 import write_eagle3_head
from foretell import LLM, SamplingParams
from foretell.spec_decode.tree.proposer import ModelTreeDrafter
from foretell.spec_decode.tree.shape import sibling_ranks

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "def add(x):\n    return x + 1\ndef add(x):\n    return",
    "Question: what is 3 plus 7? Answer:",
]
MAX_TOKENS = 20
TREE = {"num_speculative_tokens": 3, "topk": 3, "num_draft_tokens": 8}
STRESS = dict(max_num_batched_tokens=16, num_kv_blocks=20, block_size=4)  # chunks + preemption


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llama31_eagle3_head(checkpoint_root, llama31_checkpoint) -> str:
    folder = os.path.join(checkpoint_root, "eagle3_llama31_tree")
    if not os.path.isdir(folder):
        write_eagle3_head(folder, llama31_checkpoint, "specforge", seed=5)
    return folder


@pytest.fixture(scope="module")
def targets(qwen3_checkpoint, eagle3_head, llama31_checkpoint, llama31_eagle3_head):
    return {"qwen3": (qwen3_checkpoint, eagle3_head), "llama31": (llama31_checkpoint, llama31_eagle3_head)}


@pytest.fixture(scope="module")
def baselines(targets):
    out = {}
    for name, (target, _) in targets.items():
        llm = LLM(target, dtype="float32", num_kv_blocks=128)
        out[name] = ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    return out


def tree_llm(target: str, head: str, tree: dict = TREE, **kwargs) -> LLM:
    spec = {"method": "eagle3", "model": head, **tree}
    return LLM(target, dtype="float32", speculative_config=spec, **{"num_kv_blocks": 128, **kwargs})


def check_blocks_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_requests_running"] == 0 and not llm.engine.runner.tree_step.trees


@pytest.mark.parametrize("mode", ["batch", "one_by_one", "stress"])
@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_greedy_trees_equal_plain_greedy(targets, baselines, family, mode):
    target, head = targets[family]
    llm = tree_llm(target, head, **(STRESS if mode == "stress" else {}))
    assert llm.engine.runner.tree_step is not None and llm.engine.runner.padded_forward is None
    if mode == "one_by_one":
        got = [ids(llm.generate([p], greedy(), use_tqdm=False))[0] for p in PROMPTS]
    else:
        got = ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    assert got == baselines[family]
    stats = llm.get_stats()
    assert mode != "stress" or stats["num_preemptions"] > 0
    assert stats["num_drafts"] > 0
    assert len(stats["accepted_per_position"]) == TREE["num_speculative_tokens"]
    assert sum(stats["accepted_count_histogram"]) == stats["num_drafts"]
    check_blocks_free(llm)


def reference_continuations(target: str, max_tokens: int) -> dict[tuple[int, ...], list[int]]:
    """prompt ids -> prompt + the target's plain greedy output."""
    llm = LLM(target, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(PROMPTS, greedy(max_tokens + 8), use_tqdm=False)
    return {tuple(o.prompt_token_ids): list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}


def oracle_drafter(monkeypatch, full: dict[tuple[int, ...], list[int]]) -> list[tuple[int, int]]:
    """Wrap the tree drafter: on each tree's last node's path (the deepest node of highest index:
    never the best path when topk > 1), write the target's true continuation; siblings of the
    path that hold the same token get another one. Returns the list of (last node, depth) of the
    branches written, filled as the engine drafts."""
    original = ModelTreeDrafter.draft
    moved: list[tuple[int, int]] = []

    def draft(self, batch, drafting):
        tree = original(self, batch, drafting)
        if tree is None:
            return tree
        for j, i in enumerate(drafting):
            history = batch.histories[i]
            sequence = next((s for s in full.values() if s[: len(history)] == history), None)
            if sequence is None:
                continue
            continuation = sequence[len(history):]
            depths, parents = tree.depths[j].tolist(), tree.parents[j].tolist()
            node = max(range(len(depths)), key=lambda n: (depths[n], n))
            path = []
            while node > 0:
                path.append(node)
                node = parents[node]
            for node in reversed(path):
                if depths[node] > len(continuation):
                    break
                token = continuation[depths[node] - 1]
                for sibling in range(1, len(depths)):
                    if parents[sibling] == parents[node] and sibling != node and tree.tokens[j, sibling] == token:
                        tree.tokens[j, sibling] = (token + 1) % self.proposer.target_vocab
                tree.tokens[j, node] = token
            moved.append((path[0], len(path)) if path else (0, 0))
        assert (sibling_ranks(tree.parents) >= 0).all()
        return tree

    monkeypatch.setattr(ModelTreeDrafter, "draft", draft)
    return moved


@pytest.mark.parametrize("mode", ["batch", "stress"])
def test_oracle_branch_is_accepted_and_output_stays_exact(targets, baselines, monkeypatch, mode):
    target, head = targets["qwen3"]
    full = reference_continuations(target, MAX_TOKENS)
    moved = oracle_drafter(monkeypatch, full)
    llm = tree_llm(target, head, **(STRESS if mode == "stress" else {}))
    assert ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == baselines["qwen3"]
    stats = llm.get_stats()
    # The hidden branch (depth 2 or 3 here) is accepted to its end, but in the last steps of a
    # request (capped at max_tokens); the random head alone accepts about 0.1 a step.
    assert stats["mean_acceptance_length"] > 2.5
    assert any(node > depth for node, depth in moved)  # paths whose K/V had to move
    check_blocks_free(llm)


def test_requests_end_mid_tree_at_max_tokens_and_max_model_len(targets, monkeypatch):
    target, head = targets["qwen3"]
    plain = LLM(target, dtype="float32", num_kv_blocks=64, max_model_len=40)
    full = reference_continuations(target, 40)
    oracle_drafter(monkeypatch, full)  # long accepted paths: the ends land inside trees
    llm = tree_llm(target, head, {"num_speculative_tokens": 4, "topk": 2, "num_draft_tokens": 7},
                   num_kv_blocks=64, max_model_len=40)
    for max_tokens in (1, 2, 5, 6, 7, None):  # None: up to max_model_len
        params = greedy(max_tokens)
        want = ids(plain.generate(PROMPTS, params, use_tqdm=False))
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert ids(got) == want, max_tokens
        for out in got:
            assert len(out.outputs[0].token_ids) == (max_tokens or 40 - len(out.prompt_token_ids))
    check_blocks_free(llm)


def test_topk_one_is_todays_chain(qwen3_checkpoint, eagle3_head):
    chain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
                speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3})
    topk1 = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
                speculative_config={"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3,
                                    "topk": 1, "num_draft_tokens": 4})
    assert topk1.engine.runner.tree_step is None
    assert topk1.engine.runner.num_lookahead_tokens == chain.engine.runner.num_lookahead_tokens
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)
    for p in (greedy(), params):
        assert ids(topk1.generate(PROMPTS, p, use_tqdm=False)) == ids(chain.generate(PROMPTS, p, use_tqdm=False))
    assert topk1.get_stats()["accepted_per_position"] == chain.get_stats()["accepted_per_position"]


def test_sampled_trees_are_valid_and_reproducible(targets, monkeypatch):
    target, head = targets["qwen3"]
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=16, ignore_eos=True)
              for t, p, s in ((0.7, 1.0, 1), (1.0, 0.9, 2), (0.0, 1.0, None))]
    runs = []
    for _ in range(2):
        llm = tree_llm(target, head, seed=0)
        runs.append([ids(llm.generate([prompt], p, use_tqdm=False))[0] for prompt, p in zip(PROMPTS, params)])
        size = llm.engine.runner.vocab_size
        check_blocks_free(llm)
    assert runs[0] == runs[1]
    assert all(len(r) == 16 and all(0 <= t < size for t in r) for r in runs[0])
    other = tree_llm(target, head, seed=0)
    reseeded = SamplingParams(temperature=0.7, seed=99, max_tokens=16, ignore_eos=True)
    assert ids(other.generate([PROMPTS[0]], reseeded, use_tqdm=False))[0] != runs[0][0]


def test_mixed_greedy_seeded_and_unseeded_trees_in_one_batch(targets, baselines):
    """One verify group holding greedy, seeded and unseeded sampled trees (path_verify merges them):
    the greedy request equals plain greedy, the seeded one its run alone, all tokens valid."""
    target, head = targets["qwen3"]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = tree_llm(target, head, seed=0)
    mixed = ids(llm.generate(PROMPTS[:3], [greedy(), seeded, unseeded], use_tqdm=False))
    alone = ids(llm.generate([PROMPTS[1]], seeded, use_tqdm=False))[0]
    assert mixed[0] == baselines["qwen3"][0]
    assert mixed[1] == alone
    size = llm.engine.runner.vocab_size
    assert all(len(r) == MAX_TOKENS and all(0 <= t < size for t in r) for r in mixed)
    check_blocks_free(llm)


def test_requests_that_process_logits_run_without_trees(targets, baselines):
    """Penalties / logprobs under trees: those requests draft nothing (plain decoding, exact),
    beside tree requests in the same batch."""
    target, head = targets["qwen3"]
    plain = LLM(target, dtype="float32", num_kv_blocks=128)
    llm = tree_llm(target, head)
    special = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)]
    want = [ids(plain.generate([PROMPTS[0]], special[0], use_tqdm=False))[0],
            ids(plain.generate([PROMPTS[1]], special[1], use_tqdm=False))[0], baselines["qwen3"][2]]
    outs = llm.generate(PROMPTS, [*special, greedy()], use_tqdm=False)
    assert ids(outs) == want
    assert len(outs[1].outputs[0].logprobs) == MAX_TOKENS
    check_blocks_free(llm)


@pytest.mark.parametrize("spec, message", [
    ({"topk": 0}, "topk must be an integer >= 1"),
    ({"topk": 2, "num_draft_tokens": 1}, "must be an integer in [2, 11]"),
    ({"topk": 2, "num_draft_tokens": 12}, "must be an integer in [2, 11]"),
    ({"topk": 1, "num_draft_tokens": 6}, "num_draft_tokens must be 4"),
    ({"method": "mtp", "model": None, "topk": 2}, "need method 'eagle3', 'draft_model' or 'suffix'"),
    ({"topk": 2, "simulate_acceptance": {"rates": [0.5, 0.4]}}, "must be 3 non-increasing values"),
])
def test_bad_tree_configs_are_named(qwen3_checkpoint, eagle3_head, spec, message):
    config = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3, **spec}
    if config["model"] is None:
        del config["model"]
    with pytest.raises(ValueError) as error:
        LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=32, speculative_config=config)
    assert message in str(error.value)


def test_default_num_draft_tokens(qwen3_checkpoint, eagle3_head):
    llm = tree_llm(qwen3_checkpoint, eagle3_head, {"num_speculative_tokens": 2, "topk": 2})
    assert llm.engine.config.speculative.num_draft_tokens == 5
    assert llm.engine.runner.num_lookahead_tokens == 2  # (depth - 1) * topk draft slots


def test_cli_flags_build_the_tree_config():
    import argparse

    from foretell.cli_args import add_engine_args, speculative_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_required=False)
    args = parser.parse_args(["--method", "eagle3", "--draft-model", "head", "--num-speculative-tokens", "5",
                              "--topk", "4", "--num-draft-tokens", "16"])
    config = speculative_config_from_args(args)
    assert (config["num_speculative_tokens"], config["topk"], config["num_draft_tokens"]) == (5, 4, 16)
    args = parser.parse_args(["--method", "eagle3", "--draft-model", "head"])
    assert "topk" not in speculative_config_from_args(args)
