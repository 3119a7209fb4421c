"""Structured outputs under speculation (issue 27): greedy output with every drafter (eagle3,
draft_model, ngram on the Qwen3 fixture; MTP on the DeepSeek-V3 fixture) equals plain greedy output
token for token with a regex, a choice and a grammar (fp32), also across preemption; every output
matches its constraint; sampled requests (drafts with and without probabilities) stay inside it.
JSON schemas on the shipped default family (a real BPE vocabulary): every response validates with
the jsonschema package, with and without each drafter, and the tokens are the same."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import regex

from fixtures import deepseek as ds
from foretell import LLM, SamplingParams
from foretell.defaults import member_path

PROMPTS = [
    "The cat reads the book. The cat reads the book. The cat",
    "def add(x):\n    return x + 1\ndef add(x):\n    return",
    "a b a b a b a b",
]
DS_PROMPTS = [[5, 17, 250, 3, 99, 41, 7, 5, 17, 250, 3], [300, 12, 8, 8, 61, 2, 19, 300, 12, 8], [9, 9, 9, 9]]
# Bounded, so that even a random model's output ends within max_tokens.
REGEX = r"(the|cat|[0-9]{1,2})( (the|book|cat|[0-9]{1,2})){1,3}\."
CHOICES = ["return x + 1", "the book", "a b a b"]
GRAMMAR = 'start: "(" item ("," item)? ("," item)? ")"\nitem: /[a-c]{1,2}/ | "x"'


def constraints() -> list[tuple[SamplingParams, object]]:
    """(params, check of the output text) per constraint."""
    def fullmatch(pattern):
        return lambda text: regex.fullmatch(pattern, text) is not None

    return [
        (SamplingParams(temperature=0, max_tokens=32, structured_outputs={"regex": REGEX}), fullmatch(REGEX)),
        (SamplingParams(temperature=0, max_tokens=32, structured_outputs={"choice": CHOICES}), CHOICES.__contains__),
        (SamplingParams(temperature=0, max_tokens=32, structured_outputs={"grammar": GRAMMAR}),
         fullmatch(r"\((x|[a-c]{1,2})(,(x|[a-c]{1,2})){0,2}\)")),
    ]


def run(llm: LLM, prompts) -> list[list[tuple[list[int], str, str]]]:
    results = []
    for params, _ in constraints():
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
    return results


def check_outputs(results) -> None:
    for (_, check), outs in zip(constraints(), results):
        for token_ids, text, reason in outs:
            assert reason == "stop" and check(text), (text, reason)


def spec_config(method: str, request) -> dict:
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        config["model"] = request.getfixturevalue("qwen3_tied_checkpoint")
    elif method == "eagle3":
        config["model"] = request.getfixturevalue("eagle3_head")
    elif method == "draft_model_self":  # the target drafting for itself (unmasked: drafts get cut)
        config.update(method="draft_model", model=request.getfixturevalue("qwen3_checkpoint"))
    elif method == "ngram":
        config["prompt_lookup_min"] = 1
    return config


@pytest.fixture(scope="module")
def qwen3_plain(qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128) as llm:
        results = run(llm, PROMPTS)
    check_outputs(results)
    return results


@pytest.mark.parametrize("method", ["eagle3", "draft_model", "draft_model_self", "ngram"])
def test_greedy_structured_output_is_lossless(method, request, qwen3_checkpoint, qwen3_plain):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
             speculative_config=spec_config(method, request)) as llm:
        got = run(llm, PROMPTS)
    assert got == qwen3_plain


def test_mtp_structured_output_is_lossless(checkpoint_root, tokenizer_dir):
    folder = ds.checkpoint(checkpoint_root, tokenizer_dir, "v3")
    prompts = [{"prompt_token_ids": p} for p in DS_PROMPTS]
    with LLM(folder, dtype="float32", num_kv_blocks=64) as llm:
        plain = run(llm, prompts)
    check_outputs(plain)
    with LLM(folder, dtype="float32", num_kv_blocks=64,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        assert run(llm, prompts) == plain


def test_preempted_structured_sequences_resume_their_grammar(qwen3_checkpoint, qwen3_plain, request):
    """Few KV blocks: sequences are preempted and recomputed; their matchers replay the output."""
    params, _ = constraints()[0]
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=16, block_size=4, max_num_seqs=3,
             speculative_config=spec_config("draft_model_self", request)) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        preemptions = llm.get_stats()["num_preemptions"]
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [t for t, _, _ in qwen3_plain[0]]


@pytest.mark.parametrize("method", ["draft_model", "ngram"])  # drafts with probabilities; one-hot drafts
def test_sampled_structured_output_stays_inside_the_grammar(method, request, qwen3_checkpoint):
    with LLM(qwen3_checkpoint, dtype="float32", num_kv_blocks=128,
             speculative_config=spec_config(method, request)) as llm:
        for (params, check) in constraints():
            sampled = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=32,
                                     structured_outputs=params.structured_outputs)
            for out in llm.generate(PROMPTS, sampled, use_tqdm=False):
                for sample in out.outputs:
                    assert sample.finish_reason == "stop" and check(sample.text), sample.text


# ---- JSON on the shipped default family (a real BPE vocabulary) -----------------------------
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "sum"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
JSON_PROMPTS = ["Return the person as JSON: ", "def read_file(path):", "Question: how many bolts? Answer in JSON."]


@pytest.mark.slow  # eight engines on the default family: about 45 s on 2 busy cores
@pytest.mark.skipif(not os.path.isdir(member_path("target")), reason="no default models")
def test_json_schema_outputs_validate_and_are_lossless():
    params = [SamplingParams(temperature=0, max_tokens=64,
                             structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
              SamplingParams(temperature=0, max_tokens=48, structured_outputs={"json_object": True,
                                                                               "disable_any_whitespace": True})]

    def generate(spec):
        with LLM(member_path("target"), num_kv_blocks=128, speculative_config=spec) as llm:
            outs = [llm.generate(JSON_PROMPTS, p, use_tqdm=False) for p in params]
        return [[(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in out] for out in outs]

    plain = generate(None)
    for token_ids, text, reason in plain[0]:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    for token_ids, text, reason in plain[1]:  # any object: unbounded, a small model may not close it
        assert text.startswith("{") and (reason == "length" or isinstance(json.loads(text), dict))
    assert any(reason == "stop" for _, _, reason in plain[1])
    for method in ("eagle3", "draft_model", "ngram"):
        spec = {"method": method, "num_speculative_tokens": 3}
        if method != "ngram":
            spec["model"] = member_path(method)
        assert generate(spec) == plain, method


@pytest.mark.skipif(not os.path.isdir(member_path("target")), reason="no default models")
def test_json_schema_outputs_validate_with_eagle3():
    """The fast share of the test above: the schema, plain and with the trained EAGLE3 head."""
    params = SamplingParams(temperature=0, max_tokens=64,
                            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    results = []
    for spec in (None, {"method": "eagle3", "model": member_path("eagle3"), "num_speculative_tokens": 3}):
        with LLM(member_path("target"), num_kv_blocks=128, speculative_config=spec) as llm:
            results.append([o.outputs[0] for o in llm.generate(JSON_PROMPTS[:2], params, use_tqdm=False)])
    for out in results[0]:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert [o.token_ids for o in results[1]] == [o.token_ids for o in results[0]]
