"""`foretell bench`: load the prompts, run no speculation and every speculative configuration at
every batch size, compare with Hugging Face if asked, and return the report (a JSON-able dict).

The prompts are tokenized once, with the model's tokenizer, so every configuration (and
transformers, with --compare hf) sees the same token ids.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass, field
from typing import Any

from foretell.bench.datasets import Prompt, load_prompts, ordinary_vocab
from foretell.speculative_config import SpeculativeConfig
from foretell.bench.sweep import add_comparisons, release, run_closed_loop, summarize
from foretell.progress import progress_bar

REPORT_SCHEMA_VERSION = 1
WARMUP_MAX_TOKENS = 16


@dataclass
class BenchSettings:
    model: str
    engine_kwargs: dict[str, Any]  # everything LLM() takes except speculative_config
    speculative_configs: list[dict[str, Any]]
    batch_sizes: list[int]
    dataset: str = "gsm8k"
    num_prompts: int | None = 16
    input_len: int = 128  # the random dataset's prompt length
    max_tokens: int = 128
    temperature: float = 0.0
    ignore_eos: bool = False
    chat: bool = False
    seed: int = 0
    warmup: bool = True
    progress: bool = True
    compare: list[str] = field(default_factory=list)  # "hf"


def tokenize_prompts(prompts: list[Prompt], tokenizer, chat: bool) -> list[list[int]]:
    ids = []
    for p in prompts:
        if p.token_ids is not None:
            ids.append(list(p.token_ids))
        elif chat:
            ids.append(tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
        else:
            ids.append(tokenizer.encode(p.text))
        if not ids[-1]:
            raise ValueError(f"prompt {p.source} tokenizes to no tokens")
    return ids


def config_label(method: str, k: int | str) -> str:
    return "none" if method == "none" else f"{method} k={k}"


def check_settings(s: BenchSettings) -> None:
    if not s.batch_sizes:
        raise ValueError("--batch-sizes needs at least one batch size")
    if "hf" in s.compare:
        if s.temperature != 0:
            raise ValueError("--compare hf compares greedy tokens: use --temperature 0")
        if s.engine_kwargs.get("load_format") == "dummy":
            raise ValueError("--compare hf needs real weights: drop --load-format dummy")
    unknown = sorted(set(s.compare) - {"hf"})
    if unknown:
        raise ValueError(f"--compare: unknown engine(s) {unknown}; supported: hf")


def run_bench(s: BenchSettings) -> dict[str, Any]:
    from foretell import LLM, SamplingParams, __version__

    check_settings(s)
    threads = s.engine_kwargs.get("num_cpu_threads")
    if threads is not None:  # before any run, so transformers' comparison uses the same
        import torch

        torch.set_num_threads(threads)
    max_batch = max(s.batch_sizes)
    engine_kwargs = dict(s.engine_kwargs)
    engine_kwargs["max_num_seqs"] = max(engine_kwargs.get("max_num_seqs") or 1, max_batch)
    engine_kwargs.pop("speculative_config", None)

    prompts = None
    if s.dataset != "random":  # a bad name or file fails before any model loads
        prompts = load_prompts(s.dataset, s.num_prompts, s.seed, s.input_len)
    llm = LLM(s.model, **engine_kwargs)
    tokenizer = llm.tokenizer
    if prompts is None:
        vocab = ordinary_vocab(tokenizer)
        prompts = load_prompts(s.dataset, s.num_prompts, s.seed, s.input_len, vocab)
    prompt_ids = tokenize_prompts(prompts, tokenizer, s.chat)
    eos_ids = sorted(tokenizer.eos_token_ids)
    # No name may keep the first engine's runner (and its KV cache) alive past release() below:
    # the next configuration's engine would find the device's memory taken (as it did on the H200).
    device = str(llm.engine.runner.device)
    dtype = str(llm.engine.runner.dtype).replace("torch.", "")
    params = SamplingParams(
        temperature=s.temperature, max_tokens=s.max_tokens, ignore_eos=s.ignore_eos, seed=s.seed
    )
    prefill_params = SamplingParams(
        temperature=s.temperature, max_tokens=1, ignore_eos=s.ignore_eos, seed=s.seed
    )
    warmup_params = SamplingParams(
        temperature=s.temperature, max_tokens=min(WARMUP_MAX_TOKENS, s.max_tokens),
        ignore_eos=s.ignore_eos, seed=s.seed,
    )

    def requests_for(batch_size: int) -> list[dict]:
        n = max(len(prompt_ids), batch_size)  # enough requests to fill the batch once
        return [{"prompt_token_ids": prompt_ids[i % len(prompt_ids)]} for i in range(n)]

    configs: list[dict[str, Any] | None] = [None] + list(s.speculative_configs)
    total = len(configs) * sum(len(requests_for(b)) for b in s.batch_sizes)
    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, int, int], list[list[int]]] = {}
    baselines: dict[int, dict[str, Any]] = {}
    # Loading each configuration logs (cache size, max_model_len): those lines print above the bar.
    with progress_bar(total, "bench", s.progress, unit="req") as bar:
        for config in configs:
            method = config["method"] if config else "none"
            resolved = SpeculativeConfig.from_any(config) if config else None
            k = resolved.num_speculative_tokens if resolved else 0  # adaptive: its maximum
            adaptive = bool(resolved and resolved.adaptive)
            label = f"auto<={k}" if adaptive else k
            if config is not None:
                llm = LLM(s.model, speculative_config=config, **engine_kwargs)
            if s.warmup:
                # Every prompt once (the prefix cache holds them all for every measured run),
                # then a short run at each batch size, so that kernels for the shapes of the
                # measured steps (decode, verify, drafting) are compiled and cached.
                run_closed_loop(llm, requests_for(1), prefill_params, max_batch)
                for batch_size in s.batch_sizes:
                    first = requests_for(batch_size)[:batch_size]
                    run_closed_loop(llm, first, warmup_params, batch_size)
            for batch_size in s.batch_sizes:
                bar.set_description(f"bench {config_label(method, label)} bs={batch_size}")
                run = run_closed_loop(llm, requests_for(batch_size), params, batch_size, bar.update)
                row = summarize(run, method, k, batch_size)
                row["adaptive"] = adaptive
                row["speculative_config"] = config
                if config is None:
                    baselines[batch_size] = row
                exact = s.temperature == 0 and not (config or {}).get("simulate_acceptance")
                add_comparisons(
                    row, baselines[batch_size], outputs.get(("none", 0, batch_size), run.outputs),
                    run.outputs, exact,
                )
                rows.append(row)
                outputs.setdefault((method, k, batch_size), run.outputs)  # fixed k first (hf_compare's)
            release(llm)
            llm = None

    report: dict[str, Any] = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "foretell_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": s.model,
        "device": device,
        "dtype": dtype,
        "engine": {k: v for k, v in engine_kwargs.items() if _jsonable(v)},
        "dataset": {
            "name": s.dataset,
            "num_prompts": len(prompt_ids),
            "mean_prompt_tokens": statistics.fmean(len(p) for p in prompt_ids),
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "ignore_eos": s.ignore_eos,
            "chat": s.chat,
            "seed": s.seed,
        },
        "torch_threads": _torch_threads(),
        "batch_sizes": list(s.batch_sizes),
        "speculative_configs": list(s.speculative_configs),
        "results": rows,
    }
    if "hf" in s.compare:
        from foretell.bench.hf_compare import compare_with_hf

        report["hf_comparison"] = compare_with_hf(
            s.model, prompt_ids, s.max_tokens, s.ignore_eos, eos_ids, dtype, device, rows,
            outputs, min(s.batch_sizes), s.progress,
        )
    return report


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list, dict))
