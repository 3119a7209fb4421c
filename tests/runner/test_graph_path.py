"""The CUDA-graph path (static buffers, padded buckets, device-side verification, the draft-loop
graph) run without capture on the CPU through Triton's interpreter: greedy output equals the
plain engine's, with real and with simulated acceptance. On a GPU the same code is captured.

The engine-level checks of the step pipeline (queued-ahead verifies, preemption, capped and mixed
batches) run on the CPU's default torch attention backend, which takes the same padded step and
pipeline eagerly with exact buckets (runner/cuda_graph.py reads_host_lengths), in a fraction of a
second; their Triton-interpreter variants (padding buckets, the Triton attention: about 0.3 s of
CPU per interpreted attention call, minutes per test) are marked slow."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams

PROMPTS = ["The cat reads the book. The cat", "a b a b a b a b", "Question: what"]


if torch.cuda.is_available():
    pytest.skip("on a GPU the graph path is tested captured (tests/gpu)", allow_module_level=True)


from fixtures.triton_interpreter import import_interpreted, interpreter_mode  # noqa: E402, F401

import_interpreted("foretell.ops.attention.triton_paged")
import_interpreted("foretell.ops.attention.triton_write_kv")
import_interpreted("foretell.ops.attention.triton_backend")


def count_padded_verify_steps(monkeypatch) -> list:
    """A list that grows by one for each verify step the padded (graphed) step kind launches."""
    from foretell.runner.graphed_verify import GraphedVerify

    calls = []
    original = GraphedVerify.launch

    def counted(self, sched, batch):
        step = original(self, sched, batch)
        if step is not None:
            calls.append(1)
        return step

    monkeypatch.setattr(GraphedVerify, "launch", counted)
    return calls


# The attention backend of the pipeline tests: the default torch one, and the Triton interpreter's
# (padding buckets) with the slow tests.
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.slow)]


def generate(folder, **kwargs):
    llm = LLM(folder, dtype="float32", num_kv_blocks=64, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_path_matches_plain_greedy(qwen3_checkpoint, qwen3_tied_checkpoint, eagle3_head, monkeypatch, backend):
    calls = count_padded_verify_steps(monkeypatch)
    _, plain = generate(qwen3_checkpoint)
    configs = [
        # A self-draft is accepted every time; another LM and a random EAGLE3 head are rejected
        # at various positions: both catch-up layouts (row offset 0 and -1) with partial accepts.
        {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2},
        {"method": "draft_model", "model": qwen3_tied_checkpoint, "num_speculative_tokens": 3},
        {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2},
        # The draft's own cache paged in smaller blocks: the loop's block table is subdivided.
        {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3, "draft_block_size": 2},
    ]
    for config in configs:
        before = len(calls)
        llm, got = generate(qwen3_checkpoint, attention_backend=backend, speculative_config=config)
        assert got == plain, config
        assert llm.engine.runner.draft_graphs is not None and len(calls) > before, config
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_graph_path_with_simulated_acceptance(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2,
            "simulate_acceptance": {"rates": [0.8, 0.5]}}
    llm, got = generate(qwen3_checkpoint, attention_backend="triton", speculative_config=spec)
    stats = llm.get_stats()
    assert stats["synthetic_acceptance"] and stats["num_accepted_tokens"] > 0
    assert all(len(tokens) == 12 for tokens in got)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_requests_ending_mid_verify_stay_on_the_graph_path(qwen3_checkpoint, monkeypatch):
    """Near max_tokens a graph-backed engine keeps the k draft rows (the verify's graph shape) and
    caps what may be accepted instead of dropping drafts: a self-draft accepts everything, so
    without the cap it would emit past max_tokens; every verify step takes the graphed path, the
    output equals plain greedy and the statistics count only the usable drafts."""
    calls = count_padded_verify_steps(monkeypatch)
    spec = {"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 5}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, attention_backend="triton",
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    out = llm.generate(["The cat"], params, use_tqdm=False)[0].outputs[0]
    s = llm.get_stats()
    assert len(out.token_ids) == 9 and s["acceptance_rate"] == 1.0
    # prefill: 1 token; verify 1: 5 drafts + 1; verify 2: capped at 1 accepted draft + 1 token
    assert s["num_drafts"] == 2 and s["num_draft_tokens"] == 6 and s["num_accepted_tokens"] == 6
    assert len(calls) == 2
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    assert out.token_ids == plain.generate(["The cat"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_capped_and_uncapped_requests_mixed_with_prefills(qwen3_checkpoint, eagle3_head, backend):
    """Different max_tokens per request, one sampled request (its drafts are trimmed instead),
    prompts arriving while others verify: greedy outputs equal the plain engine's."""
    prompts = PROMPTS + ["The dog runs and the dog", "x"]
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (4, 7, 10, 5, 3)]
    sampled = SamplingParams(temperature=0.8, max_tokens=6, seed=1, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    for spec in ({"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 3},
                 {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}):
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, attention_backend=backend,
                  speculative_config=spec)
        outs = llm.generate(prompts + ["The cat"], greedy + [sampled], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:-1]] == expected, spec["method"]
        assert len(outs[-1].outputs[0].token_ids) == 6
        s = llm.get_stats()
        assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
        assert s["num_accepted_tokens"] <= s["num_draft_tokens"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_steps_queued_ahead_give_the_same_tokens(qwen3_checkpoint, eagle3_head, backend):
    """async_scheduling on: each graphed verify step queues the next one from its device outputs
    before the host reads them. Requests of different lengths (capped near max_tokens, so the
    launch ahead stops or goes unused), arrivals, blocks of 4 (the scheduler adds blocks between a
    launch and its use): greedy output equals plain, for a self-draft (every draft accepted) and
    a random EAGLE3 head (partial accepts)."""
    prompts = PROMPTS + ["The dog runs and the dog", "x"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (30, 7, 22, 5, 16)]
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for spec in ({"method": "draft_model", "model": qwen3_checkpoint, "num_speculative_tokens": 2},
                 {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 3}):
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128, max_num_seqs=4, attention_backend=backend,
                  block_size=4, async_scheduling="on", speculative_config=spec)
        runner = llm.engine.runner
        assert runner.pipeline.queue_ahead and runner.num_lookahead_tokens == 2 * spec["num_speculative_tokens"] + 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected, spec
        assert 0 < runner.pipeline.num_used <= runner.pipeline.num_launched, spec
        s = llm.get_stats()
        assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_verify_ahead_with_simulated_acceptance(qwen3_checkpoint, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2,
            "simulate_acceptance": {"rates": [0.8, 0.5]}}
    llm, got = generate(qwen3_checkpoint, attention_backend="triton", speculative_config=spec, async_scheduling="on")
    assert all(len(tokens) == 12 for tokens in got)
    assert llm.engine.runner.pipeline.num_used > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_ahead_under_preemption(qwen3_checkpoint, eagle3_head, backend):
    """A cache so small that sequences are preempted between a queued verify step and its use:
    the queued step is dropped (its KV writes land in freed blocks before their next owner's) and
    greedy output still equals plain greedy."""
    prompts = PROMPTS + ["The dog runs and the dog"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": 2}
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=26, block_size=4, max_num_seqs=4,
              attention_backend=backend, async_scheduling="on", speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    s = llm.get_stats()
    assert got == expected
    assert s["num_preemptions"] > 0 and llm.engine.runner.pipeline.num_used > 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_decode_ahead_on_graphs_takes_the_graphs_argmax(qwen3_checkpoint, monkeypatch):
    """Plain decode one step ahead on the graph path: a greedy step takes the graph's own argmax,
    its tokens reach the host from the next step's input buffer (or directly, when no step
    follows on the graph); batches shrink as requests end, sampled and greedy requests mix.
    Tokens equal the plain engine's (greedy) and the same engine's without decode ahead (seeded)."""
    from foretell.runner import cuda_graph

    downloads = []
    original = cuda_graph.CudaGraphRunner.download_input_ids
    monkeypatch.setattr(cuda_graph.CudaGraphRunner, "download_input_ids",
                        lambda self, rows: downloads.append(rows) or original(self, rows))
    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 11, 3)]
    sampled = SamplingParams(temperature=0.9, max_tokens=7, seed=3, ignore_eos=True)
    params = greedy + [sampled]
    prompts = PROMPTS + ["The dog"]
    got = {}
    for mode in ("on", "off"):
        llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, max_num_seqs=4, attention_backend="triton",
                  async_scheduling=mode, block_size=4)
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.get_stats()
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
        if mode == "on":
            assert llm.engine.runner.graphs is not None and llm.engine.runner.pipeline.num_used > 0
            greedy_only = llm.generate(PROMPTS[:2], greedy[:2], use_tqdm=False)
    assert got["on"] == got["off"]
    plain = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:2], greedy[:2], use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in greedy_only] == expected
    assert downloads  # greedy batches on the graph read their tokens back from the next step's inputs
