"""--regenerate: the target writes the responses itself, through foretell's LLM, so the head learns
the target's own distribution (greedy by default: what the engine drafts against at temperature 0).

Regenerated examples are cached as JSONL (input_ids, loss_mask) in the output folder, so --resume
and later runs with the same data reuse them instead of generating again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from dataclasses import dataclass

import torch

from foretell.progress import progress_bar
from foretell.training.data import Example, ExampleBuilder, Record

log = logging.getLogger(__name__)


@dataclass
class RegenerateOptions:
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    max_num_seqs: int = 256
    progress: bool = True  # a bar of generated tokens and finished samples (--no-progress: none)
    # A fixed KV budget on GPUs (not a share of what is free), so that the trainer and any other
    # process on the same GPU keep theirs whenever they start.
    gpu_kv_cache_bytes: int = 4 << 30


def regenerate_examples(
    target: str,
    records: list[Record],
    builder: ExampleBuilder,
    options: RegenerateOptions,
    cache_path: str | None = None,
) -> list[Example]:
    """Examples whose responses the target wrote; plain-text records are kept as they are."""
    prompts, sources, texts = [], [], []
    for record in records:
        ids = builder.prompt_ids(record)
        if ids is None:
            texts.extend(builder.examples(record))
        elif len(ids) >= builder.max_len:
            builder.skipped["prompt longer than --max-len"] = builder.skipped.get("prompt longer than --max-len", 0) + 1
        else:
            prompts.append(ids)
            sources.append(record.source)
    key = _cache_key(target, prompts, options, builder.max_len)
    cached = _read_cache(cache_path, key)
    if cached is not None:
        log.info("reusing %d regenerated examples from %s", len(cached), cache_path)
        return cached + texts
    generated = generate(target, prompts, options, builder.max_len) if prompts else []
    examples = []
    for ids, out, source in zip(prompts, generated, sources):
        if out:
            seq = (ids + out)[: builder.max_len]
            examples.append(Example(seq, [0] * len(ids) + [1] * (len(seq) - len(ids)), source))
    if cache_path:
        _write_cache(cache_path, key, examples)
    return examples + texts


def generate(target: str, prompts: list[list[int]], options: RegenerateOptions, max_len: int) -> list[list[int]]:
    """Output token ids of the target for each prompt (foretell's engine, no speculation)."""
    from foretell import LLM, SamplingParams

    kwargs = dict(dtype=options.dtype, device=options.device, max_num_seqs=options.max_num_seqs)
    if options.device != "cpu" and torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = options.gpu_kv_cache_bytes
    llm = LLM(target, **kwargs)
    room = llm.engine.max_model_len  # prompt + response must fit the engine's context as well
    params = [
        SamplingParams(temperature=options.temperature,
                       max_tokens=max(1, min(options.max_tokens, max_len - len(p), room - len(p))),
                       seed=None if options.temperature == 0 else options.seed + i)
        for i, p in enumerate(prompts)
    ]
    log.info("regenerating %d responses with the target (temperature %s, up to %d tokens)",
             len(prompts), options.temperature, options.max_tokens)
    result = run_with_progress(llm.engine, prompts, params, options.progress)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def run_with_progress(engine, prompts: list[list[int]], params: list, progress: bool,
                      redraw_interval_s: float = 0.1) -> list[list[int]]:
    """Drive the engine step by step. The bar counts generated tokens against the most the
    samples may take (a sample that ends early adds its unused budget), so it moves and has an
    ETA even while every sample is still running; the finished samples show beside it."""
    ids = [f"regenerate-{i}" for i in range(len(prompts))]
    index = {request_id: i for i, request_id in enumerate(ids)}
    outputs: list[list[int] | None] = [None] * len(prompts)
    budget = sum(p.max_tokens for p in params)
    try:
        for request_id, prompt, p in zip(ids, prompts, params):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, p)
        with progress_bar(budget, "regenerate", progress, unit="tok", mininterval=redraw_interval_s) as bar:
            done, unused = 0, 0
            tokens_before = engine.metrics.generation_tokens_total
            while done < len(prompts):
                for out in engine.step():
                    i = index.get(out.request_id)
                    if i is None or not out.finished:
                        continue
                    outputs[i] = list(out.outputs[0].token_ids)
                    unused += params[i].max_tokens - len(outputs[i])
                    done += 1
                bar.set_postfix_str(f"{done}/{len(prompts)} samples done", refresh=False)
                bar.update(engine.metrics.generation_tokens_total - tokens_before + unused - bar.n)
    except BaseException:
        for request_id, out in zip(ids, outputs):
            if out is None:
                engine.abort_request(request_id)
        raise
    return outputs


def _cache_key(target: str, prompts: list[list[int]], options: RegenerateOptions, max_len: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([os.path.abspath(target), options.temperature, options.max_tokens,
                         options.seed, max_len]).encode())
    for p in prompts:
        h.update(json.dumps(p).encode())
    return h.hexdigest()


def _read_cache(path: str | None, key: str) -> list[Example] | None:
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        header = json.loads(f.readline() or "{}")
        if header.get("key") != key:
            return None
        return [Example.from_json(json.loads(line)) for line in f if line.strip()]


def _write_cache(path: str, key: str, examples: list[Example]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"key": key}) + "\n")
        for e in examples:
            f.write(json.dumps(e.to_json()) + "\n")
    os.replace(tmp, path)
