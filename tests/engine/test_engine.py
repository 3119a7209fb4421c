"""Engine core end to end: greedy equals Hugging Face, batching invariance (one at a time,
batched, chunked prefill, preemption, prefix-cache hits), seeds, stops, bad input, and that every
KV block is free again afterwards."""

from __future__ import annotations

import pytest
import torch

from foretell import LLM, SamplingParams

PROMPTS = [
    "The cat reads the book. The dog",
    "def add(x):\n    return",
    "Question: what is 3 plus 7? Answer:",
    "a",
]


def all_blocks_free(llm: LLM) -> bool:
    stats = llm.get_stats()
    return stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_requests_running"] == 0


def greedy(n: int = 32) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=128, dtype="float32")
    outs = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    assert all_blocks_free(llm)
    return outs


@pytest.mark.parametrize("fixture", ["qwen3_checkpoint", "llama31_checkpoint"])
def test_greedy_matches_hf_generate(fixture, request):
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(fixture)
    llm = LLM(folder, dtype="float32", num_kv_blocks=128)
    outs = llm.generate(PROMPTS, greedy(64), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        expected = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, ids.shape[1]:].tolist()
        assert out.outputs[0].token_ids == expected, prompt
        assert out.outputs[0].finish_reason == "length"
    assert all_blocks_free(llm)


@pytest.mark.parametrize(
    "options",
    [
        dict(num_kv_blocks=128, max_num_seqs=1),  # one at a time
        dict(num_kv_blocks=128, max_num_batched_tokens=5),  # chunked prefill
        dict(num_kv_blocks=12, block_size=4),  # preemption pressure
        dict(num_kv_blocks=128, block_size=1, enable_prefix_caching=False),
    ],
    ids=["serial", "chunked", "preempt", "block1"],
)
def test_batching_invariance(qwen3_checkpoint, reference, options):
    llm = LLM(qwen3_checkpoint, dtype="float32", **options)
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    if options.get("num_kv_blocks") == 12:
        assert llm.get_stats()["num_preemptions"] > 0
    assert all_blocks_free(llm)


def test_prefix_cache_hit_gives_same_tokens(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, block_size=4)
    shared = "The cat reads the book. The dog reads the book. The model"
    first = token_ids(llm.generate([shared + " runs"], greedy(), use_tqdm=False))
    cold = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64, block_size=4)
    expected = token_ids(cold.generate([shared + " sees"], greedy(), use_tqdm=False))
    again = token_ids(llm.generate([shared + " sees"], greedy(), use_tqdm=False))
    assert again == expected and first != again
    assert llm.get_stats()["prefix_cache_hit_rate"] > 0.3
    assert all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_across_batching(qwen3_checkpoint):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a = LLM(qwen3_checkpoint, num_kv_blocks=64).generate(PROMPTS, params, use_tqdm=False)
    b = LLM(qwen3_checkpoint, num_kv_blocks=12, block_size=4, max_num_batched_tokens=6).generate(
        PROMPTS, params, use_tqdm=False
    )
    assert token_ids(a) == token_ids(b)
    c = LLM(qwen3_checkpoint, num_kv_blocks=64).generate(
        PROMPTS, SamplingParams(temperature=1.0, seed=99, max_tokens=16), use_tqdm=False
    )
    assert token_ids(a) != token_ids(c)


def test_n_samples_logprobs_and_token_prompts(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=64)
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7, 8]},
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, logprobs=2),
        use_tqdm=False,
    )[0]
    assert out.prompt_token_ids == [5, 6, 7, 8] and len(out.outputs) == 3
    for completion in out.outputs:
        assert len(completion.logprobs) == len(completion.token_ids) == 8
        for token, lp in zip(completion.token_ids, completion.logprobs):
            assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 2
            assert max(lp.top.values()) >= lp.logprob - 1e-6
        assert completion.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in completion.logprobs))
    assert all_blocks_free(llm)


def test_stop_strings_stop_ids_and_eos(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=64)
    full = llm.generate([PROMPTS[0]], greedy(32), use_tqdm=False)[0].outputs[0]
    stop_token = full.token_ids[5]
    by_id = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    first = full.token_ids.index(stop_token)
    assert by_id.token_ids == full.token_ids[: first + 1] and by_id.finish_reason == "stop"
    assert by_id.stop_reason == stop_token
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        by_str = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=32, stop=stop), use_tqdm=False)[0].outputs[0]
        assert by_str.finish_reason == "stop" and by_str.text == text[: text.index(stop)]
    assert all_blocks_free(llm)


def test_chat_uses_template(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=64)
    out = llm.chat([{"role": "user", "content": "hi"}], greedy(4), use_tqdm=False)[0]
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out.prompt_token_ids == expected and len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(n=0), "n"),
        (dict(logprobs=100), "logprobs"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_requests_leave_nothing_behind(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=16, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": list(range(1, 100))}, greedy(4))
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, greedy(4))
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy(4)])
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(qwen3_checkpoint, not_an_option=1)
    assert not llm.engine.has_unfinished_requests() and all_blocks_free(llm)
    assert len(llm.generate(["ok"], greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


def test_max_model_len_ends_generation(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=16, max_model_len=12)
    up_to_the_end = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [1, 2, 3, 4]}, up_to_the_end, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
    assert all_blocks_free(llm)


def test_empty_prompt_is_refused(qwen3_checkpoint):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=16)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, greedy(4))
    assert all_blocks_free(llm) and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "options",
    [dict(num_kv_blocks=128), dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=5)],
    ids=["plain", "chunked_and_preempted"],
)
def test_prompt_logprobs_match_hf(qwen3_checkpoint, options):
    from transformers import AutoModelForCausalLM

    llm = LLM(qwen3_checkpoint, dtype="float32", **options)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=3)
    llm.generate(PROMPTS[:2], params, use_tqdm=False)  # fill the prefix cache: must not be used
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(qwen3_checkpoint, dtype=torch.float32)
    for out in outs:
        ids = out.prompt_token_ids
        assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
        if len(ids) < 2:
            continue
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
        for position, lp in enumerate(out.prompt_logprobs[1:]):
            assert lp.token_id == ids[position + 1]
            assert lp.logprob == pytest.approx(ref[position, ids[position + 1]].item(), abs=1e-4)
            top = ref[position].topk(3)
            assert list(lp.top) == top.indices.tolist()
    assert all_blocks_free(llm)
