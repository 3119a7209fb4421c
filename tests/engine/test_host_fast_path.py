"""Issue 32's small-model fast path: the host work of an engine step.

- Tokenizer.decode through the Rust backend gives exactly what transformers' decode gives (the
  reference), with and without special tokens, on the test tokenizer and the shipped default one;
  tokenizers whose decode cleans up spaces, and slow ones, keep transformers' decode.
- The incremental detokenizer's text equals one decode of all the tokens, fed one at a time or in
  runs (as a verify step hands them over).
- Scheduler.postprocess's stops (EOS, stop ids, max_tokens, max_model_len, ignore_eos) against a
  plain re-statement of the rules, token by token.
- foretell.bench.host_overhead.measure_host_overhead: its structure on a tiny engine, plain and
  EAGLE3 (never its timings), leaves the engine as it found it, and refuses bad input.
"""

from __future__ import annotations

import random

import pytest

from foretell import LLM, SamplingParams
from foretell.bench.host_overhead import PARTS, measure_host_overhead
from foretell.bench.tiny_checkpoints import write_tiny_eagle3_head, write_tiny_qwen3
from foretell.defaults import default_target
from foretell.engine.block_manager import BlockManager
from foretell.config import SchedulerConfig
from foretell.engine.scheduler import ScheduledSequence, Scheduler
from foretell.engine.sequence import Sequence, SequenceStatus
from foretell.tokenizer import IncrementalDetokenizer, Tokenizer, fast_backend


def _random_ids(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("which", ["fixture", "default"])
def test_backend_decode_equals_transformers_decode(which, qwen3_checkpoint):
    tokenizer = Tokenizer(qwen3_checkpoint if which == "fixture" else default_target("qwen3"))
    assert tokenizer._backend is not None  # both are fast tokenizers without space clean-up
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    special = sorted(set(tokenizer.hf.all_special_ids))
    cases = [[], [0], special] + [_random_ids(rng, vocab, n) for n in (1, 2, 3, 7, 40)]
    cases += [_random_ids(rng, vocab, 5) + special + _random_ids(rng, vocab, 5) for _ in range(5)]
    for ids in cases:
        for skip in (True, False):
            assert tokenizer.decode(ids, skip_special_tokens=skip) == tokenizer.hf.decode(
                ids, skip_special_tokens=skip
            ), (ids, skip)
    # Not a list (a tuple): transformers' decode, the same text.
    assert tokenizer.decode(tuple(cases[4])) == tokenizer.hf.decode(list(cases[4]), skip_special_tokens=True)


def test_fast_backend_refuses_clean_up_and_slow_tokenizers(qwen3_checkpoint):
    hf = Tokenizer(qwen3_checkpoint).hf
    assert fast_backend(hf) is hf._tokenizer

    class CleansUp:
        is_fast = True
        _tokenizer = hf._tokenizer
        clean_up_tokenization_spaces = True

    class Slow:
        is_fast = False
        clean_up_tokenization_spaces = False

    assert fast_backend(CleansUp()) is None
    assert fast_backend(Slow()) is None


@pytest.mark.parametrize("run", [1, 3])
def test_incremental_text_equals_one_decode(run, qwen3_checkpoint):
    tokenizer = Tokenizer(qwen3_checkpoint)
    rng = random.Random(run)
    text = "héllo wörld 🙂 ünïcode ✓ done, the end. " * 3
    for ids in [tokenizer.encode(text), _random_ids(rng, tokenizer.vocab_size, 200)]:
        detok = IncrementalDetokenizer(tokenizer, SamplingParams())
        for i in range(0, len(ids), run):
            stop, taken = detok.add(ids[i:i + run])
            assert stop is None and taken == len(ids[i:i + run])
        full = tokenizer.hf.decode(ids, skip_special_tokens=True)
        # Text held back at the end is only an incomplete character (U+FFFD in the full decode).
        assert full.startswith(detok.text)
        assert set(full[len(detok.text):]) <= {"\ufffd"}


def _reference_stop(tokens_after: int, token: int, params: SamplingParams, eos: frozenset, num_tokens: int,
                    max_model_len: int) -> str | None:
    if not params.ignore_eos and token in eos:
        return "stop"
    if token in params.stop_token_ids:
        return "stop"
    if params.max_tokens is not None and tokens_after >= params.max_tokens:
        return "length"
    if num_tokens >= max_model_len:
        return "length"
    return None


@pytest.mark.parametrize("seed", range(6))
def test_postprocess_stops_match_the_rules(seed):
    rng = random.Random(seed)
    max_model_len = 40
    for case in range(40):
        params = SamplingParams(
            max_tokens=rng.choice([None, 1, 3, 10]),
            stop_token_ids=rng.choice([[], [5], [5, 6]]),
            ignore_eos=rng.random() < 0.3,
            temperature=0.0,
        )
        eos = frozenset({2})
        prompt = _random_ids(rng, 8, rng.randrange(1, 30))
        manager = BlockManager(64, 4)
        scheduler = Scheduler(SchedulerConfig(), manager, max_model_len)
        seq = Sequence(case, f"r{case}", 0, prompt, params, eos)
        seq.status = SequenceStatus.RUNNING
        scheduler.running.append(seq)
        manager.allocate(seq, max_model_len)
        seq.num_computed_tokens = len(prompt) - 1
        new = _random_ids(rng, 8, rng.randrange(0, 5))
        item = ScheduledSequence(seq, 1 + max(0, len(new) - 1), new[:-1], True)
        # The reference: append one at a time, stop at the first rule that fires.
        expected, reason = [], None
        for token in new:
            expected.append(token)
            reason = _reference_stop(len(expected), token, params, eos, len(prompt) + len(expected), max_model_len)
            if reason is not None:
                break
        if reason is None and params.max_tokens is not None and len(expected) >= params.max_tokens:
            reason = "length"
        appended = scheduler.postprocess(item, new, max(0, len(new) - 1))
        assert appended == expected
        assert seq.token_ids == prompt + expected
        assert seq.finish_reason == reason
        assert seq.is_finished == (reason is not None)
        if reason == "stop":
            assert seq.stop_reason == expected[-1]
        if reason is None:
            assert seq in scheduler.running


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = write_tiny_qwen3(str(root / "qwen3"))
    head = write_tiny_eagle3_head(str(root / "head"), target, draft_vocab_size=256, aux_layer_ids=[0, 1, 2])
    return target, head


PROMPTS = [[(11 * i + 5 * j * j) % 400 + 1 for j in range(12 + 3 * i)] for i in range(4)]


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_host_overhead_probe_structure(tiny, method):
    spec = None if method is None else {"method": "eagle3", "model": tiny[1], "num_speculative_tokens": 2}
    with LLM(tiny[0], device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
             speculative_config=spec, log_stats_interval_s=0) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in
                    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        engine, runner = llm.engine, llm.engine.runner
        result = measure_host_overhead(llm, PROMPTS, params, batch_size=2)
        assert result.method == method and result.batch_size == 2
        # The prefill step of each batch of 2 is untimed: the other 7 tokens of each come after it.
        assert result.num_tokens == 7 * len(PROMPTS)
        assert 1 <= result.num_steps <= 7 * len(PROMPTS) // 2
        for table in (result.wall_us, result.cpu_us, result.cpu_us_median):
            assert set(PARTS) <= set(table)
        assert result.wall_us["target forward"] > 0
        assert (result.wall_us["drafter forward"] > 0) == (method is not None)
        assert result.host_wall_us == pytest.approx(
            result.step_wall_us - result.wall_us["target forward"] - result.wall_us["drafter forward"])
        assert sum(result.wall_us.values()) == pytest.approx(result.step_wall_us)
        row = result.as_dict()
        assert row["num_steps"] == result.num_steps and set(row["cpu_us"]) == set(PARTS)
        assert PARTS[0] in result.table()
        # Nothing stays wrapped, and the engine still generates the same tokens.
        for obj in (engine, engine.scheduler, runner, runner.model):
            assert not {"step", "schedule", "execute", "postprocess", "forward", "compute_logits"} & set(vars(obj))
        again = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        assert again == expected
        with pytest.raises(ValueError, match="batch_size"):
            measure_host_overhead(llm, PROMPTS, params, batch_size=0)
        with pytest.raises(ValueError, match="prompts is empty"):
            measure_host_overhead(llm, [], params)
        engine.add_request("busy", {"prompt_token_ids": PROMPTS[0]}, params)
        with pytest.raises(ValueError, match="in flight"):
            measure_host_overhead(llm, PROMPTS, params)
        engine.abort_request("busy")


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_host_overhead_probe_with_stubbed_forward(tiny, method):
    """stub_forward: the target's forward is a stub whose argmax is one token, plain decode steps
    run on the graph buffers (queued ahead), and everything is put back afterwards."""
    from foretell.bench.host_overhead import _StubTarget

    spec = None if method is None else {"method": "eagle3", "model": tiny[1], "num_speculative_tokens": 2}
    with LLM(tiny[0], device="cpu", dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
             speculative_config=spec, log_stats_interval_s=0, async_scheduling="on") as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in
                    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        runner = llm.engine.runner
        graphs_before, used_before = runner.graphs, runner.pipeline.num_used
        result = measure_host_overhead(llm, PROMPTS, params, batch_size=2, stub_forward=True)
        assert result.num_tokens == 7 * len(PROMPTS)
        assert result.wall_us["target forward"] > 0
        if method is None:  # queued decode steps on the graph buffers, every one taken
            assert runner.pipeline.num_used - used_before >= result.num_steps - len(PROMPTS)
        assert runner.graphs is graphs_before
        assert not {"forward", "compute_logits", "compute_greedy_tokens"} & set(vars(runner.model))
        again = [o.outputs[0].token_ids for o in
                 llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]
        assert again == expected
    stub = _StubTarget(hidden_size=8, num_aux=2, vocab_size=50, token=7)
    import torch

    hidden, aux = stub.forward(torch.zeros(3, dtype=torch.int64), None, None)
    assert hidden.shape == (3, 8) and len(aux) == 2
    assert stub.compute_logits(hidden).argmax(-1).tolist() == [7, 7, 7]
    assert stub.compute_greedy_tokens(hidden).tolist() == [7, 7, 7]
