"""lm-evaluation-harness against the server: the exact request shape its `local-completions` model
sends (always), and lm_eval itself on 3 GSM8K questions from a local JSON file (when installed).
The answers must be the offline engine's greedy output for the same token ids."""

from __future__ import annotations

import os

import pytest
import requests

pytest.importorskip("fastapi")

from server_helpers import MODEL_NAME  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402

GSM8K = os.path.join(os.path.dirname(__file__), "data", "gsm8k_3.jsonl")
MAX_GEN_TOKENS = 16
UNTIL = ["Question:"]


@pytest.fixture(scope="module")
def gsm8k_prompts():
    import json

    with open(GSM8K) as f:
        return [f"Question: {json.loads(line)['question']}\nAnswer:" for line in f]


@pytest.fixture(scope="module")
def offline_answers(qwen3_checkpoint, gsm8k_prompts):
    llm = LLM(qwen3_checkpoint, num_kv_blocks=160, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_GEN_TOKENS, stop=UNTIL)
    ids = [llm.tokenizer.encode(p) for p in gsm8k_prompts]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return ids, [o.outputs[0].text for o in outs]


def test_lm_eval_request_shape(server, offline_answers):
    """lm-eval's generate_until payload with batch_size 3: token-id prompts, stop, seed."""
    ids, expected = offline_answers
    payload = {"prompt": ids, "model": MODEL_NAME, "max_tokens": MAX_GEN_TOKENS, "temperature": 0,
               "stop": UNTIL, "seed": 1234}
    response = requests.post(server.url + "/v1/completions", json=payload,
                             headers={"Authorization": "Bearer "}, timeout=60)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    texts = [None] * len(choices)
    for choice in choices:  # lm-eval places each text by its index
        texts[choice["index"]] = choice["text"]
    assert texts == expected


def test_lm_eval_loglikelihood_shape_scores_the_prompt(server, qwen3_checkpoint, offline_answers):
    """Loglikelihood tasks send echo + logprobs and read the prompt tokens' log-probs back."""
    ids, _ = offline_answers
    prompt = ids[0]
    payload = {"model": MODEL_NAME, "prompt": [prompt], "temperature": 0, "max_tokens": 1,
               "logprobs": 1, "seed": 1234, "echo": True}
    response = requests.post(server.url + "/v1/completions", json=payload, timeout=30)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt) + 1  # the prompt, then the one new token
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    offline = LLM(qwen3_checkpoint, num_kv_blocks=160, max_model_len=512).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
        use_tqdm=False)[0].prompt_logprobs
    for served, expected in zip(logprobs["token_logprobs"][1 : len(prompt)], offline[1:]):
        assert served == pytest.approx(expected.logprob, abs=1e-4)
    streamed = requests.post(server.url + "/v1/completions", json={**payload, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and "without streaming" in streamed.json()["error"]["message"]


def test_lm_eval_local_completions_gsm8k(server, qwen3_checkpoint, offline_answers, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")  # lm_eval's API models need lm_eval[api]
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task_dir = tmp_path / "tasks"
    task_dir.mkdir()
    (task_dir / "gsm8k_local.yaml").write_text(f"""task: gsm8k_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {GSM8K}
  cache_dir: {tmp_path / "datasets"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('####')[-1].strip()}}}}"
generation_kwargs:
  until: {UNTIL}
  max_gen_toks: {MAX_GEN_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL_NAME, "base_url": server.url + "/v1/completions",
                    "tokenizer_backend": "huggingface", "tokenizer": qwen3_checkpoint,
                    "max_length": 512, "num_concurrent": 1, "max_retries": 1},
        tasks=["gsm8k_local"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        log_samples=True,
    )
    samples = sorted(results["samples"]["gsm8k_local"], key=lambda s: s["doc_id"])
    assert len(samples) == 3
    answers = [s["resps"][0][0] for s in samples]
    assert answers == offline_answers[1]
    assert "exact_match,none" in results["results"]["gsm8k_local"]
