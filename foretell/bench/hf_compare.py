"""`--compare hf`: the same prompts and token counts through Hugging Face transformers' generate.

Plain greedy generate for the no-speculation row, assisted generation (with the same draft
folder, k assistant tokens, constant schedule) for draft_model rows, and prompt-lookup decoding
for ngram rows. transformers runs one prompt at a time (assisted generation only supports batch
size 1), so its tokens/s are batch-1 numbers; foretell's are from the smallest batch size of the
sweep. Each row says whether every output matches foretell's token for token.
"""

from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm


def _load(folder: str, dtype: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def _set_eos(model, eos_ids: list[int] | None) -> None:
    # generate() falls back to the model's generation_config for an eos_token_id of None, so
    # the only way to make it ignore EOS (as foretell's ignore_eos does) is to clear it there.
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = (eos_ids or [0])[0]


def _generate_all(
    model, prompt_ids: list[list[int]], max_tokens: int, bar, **kwargs
) -> tuple[list[list[int]], float]:
    import torch

    outputs, elapsed = [], 0.0
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids], device=model.device)
            start = time.perf_counter()
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                do_sample=False, **kwargs,
            )
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
            elapsed += time.perf_counter() - start
            outputs.append(out[0, len(ids):].tolist())
            bar.update(1)
    return outputs, elapsed


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter's end), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(hf_outputs: list[list[int]], foretell_outputs: list[list[int]]) -> dict[str, Any]:
    mismatches = []
    for i, (h, f) in enumerate(zip(hf_outputs, foretell_outputs)):
        pos = first_mismatch(h, f)
        if pos is not None:
            mismatches.append({"prompt_index": i, "first_mismatch_position": pos})
    return {
        "num_prompts": len(hf_outputs),
        "num_agree": len(hf_outputs) - len(mismatches),
        "agree": not mismatches,
        "mismatches": mismatches,
    }


def compare_with_hf(
    model_folder: str,
    prompt_ids: list[list[int]],
    max_tokens: int,
    ignore_eos: bool,
    eos_ids: list[int],
    dtype: str,
    device: str,
    rows: list[dict[str, Any]],
    outputs: dict[tuple[str, int, int], list[list[int]]],
    batch_size: int,
    progress: bool = True,
) -> dict[str, Any]:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    eos = None if ignore_eos else list(eos_ids)
    target = _load(model_folder, dtype, device)
    _set_eos(target, eos)
    foretell_rows = [r for r in rows if r["batch_size"] == batch_size]
    modes = [r for r in foretell_rows if r["method"] in ("none", "draft_model", "ngram")]
    n = len(prompt_ids)
    bar = tqdm(total=n * len(modes), desc="hf generate", unit="req", disable=not progress)
    drafts: dict[str, Any] = {}
    results = []
    try:
        for row in modes:
            config = row.get("speculative_config") or {}
            kwargs: dict[str, Any] = {}
            if row["method"] == "draft_model":
                folder = config["model"]
                if folder not in drafts:
                    drafts[folder] = _load(folder, dtype, device)
                    _set_eos(drafts[folder], eos)
                kwargs = dict(
                    assistant_model=drafts[folder], num_assistant_tokens=row["k"],
                    num_assistant_tokens_schedule="constant",
                )
                mode = "assisted generation"
            elif row["method"] == "ngram":
                kwargs = dict(
                    prompt_lookup_num_tokens=row["k"],
                    max_matching_ngram_size=config.get("prompt_lookup_max", 2),
                )
                mode = "prompt lookup"
            else:
                mode = "generate"
            _generate_all(target, prompt_ids[:1], min(max_tokens, 2), _NoBar(), **kwargs)  # warm
            hf_out, elapsed = _generate_all(target, prompt_ids, max_tokens, bar, **kwargs)
            generated = sum(len(o) for o in hf_out)
            foretell_out = outputs[(row["method"], row["k"], batch_size)][:n]
            results.append({
                "method": row["method"],
                "k": row["k"],
                "hf_mode": mode,
                "hf_tokens_per_s": generated / elapsed if elapsed > 0 else None,
                "hf_generated_tokens": generated,
                "hf_wall_s": elapsed,
                "foretell_tokens_per_s": row["tokens_per_s"],
                **agreement(hf_out, foretell_out),
            })
    finally:
        bar.close()
    return {
        "transformers_version": transformers.__version__,
        "hf_batch_size": 1,
        "foretell_batch_size": batch_size,
        "rows": results,
    }


class _NoBar:
    def update(self, n: int) -> None:
        pass
