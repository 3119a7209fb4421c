"""Issue 27's structured-output checks on the default family, in one process (< 3 min on the H200):

    python scripts/check_structured_gpu.py OUT_DIR [--num-prompts 64] [--device auto]

1. json: N GSM8K prompts with each of two JSON schemas, greedy, EAGLE3 k=3 (--method): the share
   of responses that validate with the jsonschema package, and the mean acceptance length
   (1 + accepted / drafts) of the same prompts without a grammar and with it (bar: >= 90%).
   Two more ratios, from each token's origin (SamplingParams.return_token_origins), because that
   mean counts only verifies with drafts: a step whose drafts the grammar cut to none does not
   lower it, and a JSON response is far shorter than the plain one (max_tokens), whose later text
   the drafter predicts better. tokens_per_step: output tokens per sequence step, every step
   counted (the one that ends the prefill too); position_matched: the plain run's mean
   acceptance length over each prompt's first tokens, as many as its JSON response has.
2. overhead at batch 1 (one prompt, --overhead-tokens tokens, EOS ignored), plain and with the
   drafter: tok/s with no controls, with a no-op logit bias (the host step that every request with
   logits controls takes: off CUDA graphs and decode-ahead), and with an always-true grammar
   (regex `(.|\\n)*`); the grammar's own cost is the third against the second, and the host time
   the masks took (StructuredOutputs.timer: verify masks and draft-loop masks) per engine step.
3. mask host time per step at batch 1 and 8 with the JSON schema (the batched llguidance fill).
Parts 1-3 with the drafter run twice in its engine, grammar-forced drafts on and off
(StructuredOutputs.forced_drafts, which speculative_config structured_forced_drafts sets), one
after the other, so the forced drafts' acceptance and cost separate from the rest: every window
also counts Triton compilations (new verify lengths past k), drafts per verify and forced drafts
(and how many of those were tokens a fast-forward run held back: forced_drafts.forced_tail).
Writes OUT_DIR/check_structured_gpu.json and prints a short table. Runs on the CPU too (slowly;
pass --num-prompts 8 --overhead-tokens 32 there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import jsonschema  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402
from foretell.bench.datasets import gsm8k_test_prompts  # noqa: E402
from foretell.bench.structured_overhead import HostStepOnly  # noqa: E402
from foretell.defaults import member_path  # noqa: E402

# Two JSON schemas, bounded so every response can close within --max-tokens: a GSM8K answer with
# its reasoning first (the kind of text the default family was trained on) and a short record of
# a number and a list. The default family never saw JSON, and how much of a response is JSON
# syntax (where its drafters are weakest) differs between them, so acceptance does too.
SCHEMAS = {
    "reasoning_answer": {
        "type": "object",
        "properties": {
            "reasoning": {"type": "string", "maxLength": 160},
            "answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
        },
        "required": ["reasoning", "answer"],
        "additionalProperties": False,
    },
    "answer_steps": {
        "type": "object",
        "properties": {
            "answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
            "steps": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
        },
        "required": ["answer", "steps"],
        "additionalProperties": False,
    },
}
SCHEMA = SCHEMAS["reasoning_answer"]  # the mask timings' schema
ALWAYS_TRUE = r"(.|\n)*"


def forced_modes(llm: LLM) -> list[tuple[str, bool]]:
    """(label, forced drafts on) for each run: both where the engine drafts, else the one."""
    return [("", True)] if probe.num_speculative_tokens(llm) is None else [("", True), ("_forced_off", False)]


class Window:
    """Counters of an engine over one piece of work: steps, drafts, accepted tokens, mask time."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.start = self._read()

    def _read(self) -> dict:
        stats = self.llm.get_stats()
        timer = probe.grammar_mask_timer(self.llm)
        return {"steps": stats["num_steps"], "drafts": stats.get("num_drafts", 0),
                "draft_tokens": stats.get("num_draft_tokens", 0), "jit": stats.get("jit_compiles", 0),
                "forced": timer.forced_drafts, "held_back": timer.held_back_drafts, "forced_s": timer.forced_seconds,
                "accepted": stats.get("num_accepted_tokens", 0), "mask_s": timer.seconds,
                "fill_s": timer.verify_fill_seconds, "apply_s": timer.verify_apply_seconds,
                "draft_s": timer.draft_seconds, "ahead": timer.rows_filled_ahead, "time": time.perf_counter()}

    def close(self) -> dict:
        end = self._read()
        d = {k: end[k] - self.start[k] for k in end}
        return {"steps": d["steps"], "seconds": d["time"], "num_drafts": d["drafts"],
                "mean_acceptance_length": 1 + d["accepted"] / d["drafts"] if d["drafts"] else None,
                "mask_ms_per_step": 1e3 * d["mask_s"] / max(d["steps"], 1),
                # its parts: verify rows filled (or finished after the worker's walk), their copy
                # and device op, the drafter loop's masks; rows the worker had filled ahead
                "verify_fill_ms_per_step": 1e3 * d["fill_s"] / max(d["steps"], 1),
                "verify_apply_ms_per_step": 1e3 * d["apply_s"] / max(d["steps"], 1),
                "draft_mask_ms_per_step": 1e3 * d["draft_s"] / max(d["steps"], 1),
                "forced_drafts_ms_per_step": 1e3 * d["forced_s"] / max(d["steps"], 1),
                "rows_filled_ahead": d["ahead"],
                "drafts_per_verify": d["draft_tokens"] / d["drafts"] if d["drafts"] else None,
                "forced_drafts": d["forced"], "held_back_drafts": d["held_back"], "jit_compiles": d["jit"]}


def spec_config(method: str) -> dict | None:
    if method == "none":
        return None
    config = {"method": method, "num_speculative_tokens": 3}
    if method in ("eagle3", "draft_model"):
        config["model"] = member_path(method)
    return config


def origin_counts(outs, lengths: list[int] | None = None) -> dict:
    """Steps, verifies with drafts, accepted drafts and tokens of these outputs (their token
    origins); when lengths is given, only the steps that emitted output i's first lengths[i]
    tokens (all of each such step's tokens)."""
    steps = verifies = accepted = tokens = 0
    for i, out in enumerate(outs):
        origins = out.outputs[0].token_origins
        if lengths is not None:
            last_step = origins[min(lengths[i], len(origins)) - 1].step if lengths[i] and origins else -1
            origins = [o for o in origins if o.step <= last_step]
        tokens += len(origins)
        steps += len({o.step for o in origins})
        verifies += len({o.step for o in origins if o.num_drafts})
        accepted += sum(o.kind == "accepted" for o in origins)
    return {"steps": steps, "verifies": verifies, "accepted": accepted, "tokens": tokens,
            "tokens_per_step": tokens / steps if steps else None,
            "mean_acceptance_length": 1 + accepted / verifies if verifies else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def json_check(llm: LLM, prompts: list[str], max_tokens: int) -> dict:
    """Each schema's validity and acceptance length against the same prompts without a grammar."""
    window = Window(llm)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, return_token_origins=True),
                         use_tqdm=False)
    report: dict = {"num_prompts": len(prompts), "without_grammar": window.close()}
    report["without_grammar"]["origins"] = origin_counts(plain)
    for (suffix, forced), (schema_name, schema) in [(m, s) for m in forced_modes(llm) for s in SCHEMAS.items()]:
        name = schema_name + suffix
        constrained = SamplingParams(temperature=0, max_tokens=max_tokens, return_token_origins=True,
                                     structured_outputs={"json": schema, "disable_any_whitespace": True})
        with probe.grammar_forced_drafts(llm, forced):
            window = Window(llm)
            outs = llm.generate(prompts, constrained, use_tqdm=False)
            with_grammar = window.close()
        valid, failures = 0, []
        for o in outs:
            text = o.outputs[0].text
            try:
                jsonschema.validate(json.loads(text), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append({"text": text[:200], "finish_reason": o.outputs[0].finish_reason,
                                 "error": str(e)[:200]})
        with_grammar["origins"] = origins = origin_counts(outs)
        plain_origins = report["without_grammar"]["origins"]
        matched = origin_counts(plain, [len(o.outputs[0].token_origins) for o in outs])
        report[name] = {"schema": schema, "forced_drafts": forced, "valid_percent": 100.0 * valid / len(prompts),
                        "failures": failures[:5],
                        "with_grammar": with_grammar,
                        "acceptance_length_ratio": ratio(with_grammar["mean_acceptance_length"],
                                                         report["without_grammar"]["mean_acceptance_length"]),
                        "tokens_per_step_ratio": ratio(origins["tokens_per_step"], plain_origins["tokens_per_step"]),
                        "position_matched_without": matched,
                        "position_matched_ratio": ratio(origins["mean_acceptance_length"],
                                                        matched["mean_acceptance_length"]),
                        "examples": [o.outputs[0].text for o in outs[:3]]}
    return report


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                             structured_outputs=params.structured_outputs,
                                             logit_bias=params.logit_bias), use_tqdm=False)  # warm
    window = Window(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = window.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result.update(tokens=tokens, tok_s=tokens / result["seconds"], ms_per_step=1e3 * result["seconds"] / max(result["steps"], 1))
    return result


def overhead_check(llm: LLM, prompt: str, num_tokens: int) -> dict:
    base = dict(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    runs = {
        "none": timed(llm, [prompt], SamplingParams(**base)),
        "host_step": timed(llm, [prompt], SamplingParams(**base, logit_bias={0: 0.0})),  # the padded step since 99df117
    }
    with HostStepOnly(llm):  # the step a grammar request takes, without the grammar
        runs["true_host_step"] = timed(llm, [prompt], SamplingParams(**base))
    for suffix, forced in forced_modes(llm):
        with probe.grammar_forced_drafts(llm, forced):
            runs["always_true_grammar" + suffix] = timed(llm, [prompt], SamplingParams(
                **base, structured_outputs={"regex": ALWAYS_TRUE}))
    grammar, host = runs["always_true_grammar"]["ms_per_step"], runs["host_step"]["ms_per_step"]
    runs["grammar_overhead_percent_vs_host_step"] = 100.0 * (grammar - host) / host
    true_host = runs["true_host_step"]["ms_per_step"]
    runs["grammar_overhead_percent_vs_true_host_step"] = 100.0 * (grammar - true_host) / true_host
    runs["grammar_overhead_percent_vs_none"] = 100.0 * (grammar - runs["none"]["ms_per_step"]) / runs["none"]["ms_per_step"]
    return runs


def mask_time_check(llm: LLM, prompts: list[str], num_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=num_tokens,
                            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    report = {}
    for suffix, forced in forced_modes(llm):
        with probe.grammar_forced_drafts(llm, forced):
            report.update({f"batch_{n}{suffix}": timed(llm, prompts[:n], params) for n in (1, 8)})
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=224, help="per JSON response")
    parser.add_argument("--overhead-tokens", type=int, default=256, help="tokens of each batch-1 timing run")
    parser.add_argument("--method", default="eagle3", choices=["eagle3", "draft_model", "ngram"])
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    if args.num_prompts < 8:
        raise ValueError(f"--num-prompts must be >= 8 (the batch-8 mask timing), got {args.num_prompts}")
    os.makedirs(args.out_dir, exist_ok=True)
    prompts = [p + " Reply with JSON." for p in gsm8k_test_prompts(args.num_prompts)]
    report: dict = {"method": args.method}
    started = time.perf_counter()
    with LLM(member_path("target"), device=args.device, speculative_config=spec_config(args.method)) as llm:
        report["json"] = json_check(llm, prompts, args.max_tokens)
        report["overhead_batch1_spec"] = overhead_check(llm, prompts[0], args.overhead_tokens)
        report["mask_time_spec"] = mask_time_check(llm, prompts, args.max_tokens)
        report["device"] = str(probe.engine_device(llm))
    with LLM(member_path("target"), device=args.device) as llm:
        report["overhead_batch1_plain"] = overhead_check(llm, prompts[0], args.overhead_tokens)
    report["seconds"] = time.perf_counter() - started
    path = os.path.join(args.out_dir, "check_structured_gpu.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)

    j = report["json"]
    for name in [n for n in j if isinstance(j[n], dict) and "valid_percent" in j[n]]:
        r = j[name]["with_grammar"]
        print(f"JSON schema {name}, {j['num_prompts']} prompts, {args.method} k=3: {j[name]['valid_percent']:.1f}% "
              f"valid; mean acceptance length {j['without_grammar']['mean_acceptance_length'] or 0:.3f} without -> "
              f"{r['mean_acceptance_length'] or 0:.3f} with ({100 * (j[name]['acceptance_length_ratio'] or 0):.1f}%); "
              f"{r['drafts_per_verify'] or 0:.2f} drafts a verify, {r['forced_drafts']} forced "
              f"({r['held_back_drafts']} held back), "
              f"{r['jit_compiles']} compilations; tokens a step {100 * (j[name]['tokens_per_step_ratio'] or 0):.1f}% "
              f"of the plain run's, acceptance length {100 * (j[name]['position_matched_ratio'] or 0):.1f}% of "
              f"its first tokens'")
    for name in ("overhead_batch1_plain", "overhead_batch1_spec"):
        runs = report[name]
        line = ", ".join(f"{k} {r['tok_s']:.0f} tok/s ({r['ms_per_step']:.2f} ms/step, masks "
                         f"{r['mask_ms_per_step']:.3f} ms, forced drafts {r['forced_drafts_ms_per_step']:.3f} ms, {r['jit_compiles']} compilations)"
                         for k, r in runs.items() if isinstance(r, dict))
        true_host = runs["grammar_overhead_percent_vs_true_host_step"]
        print(f"{name}: {line}; grammar {true_host:+.1f}% vs the true host step, "
              f"+{runs['grammar_overhead_percent_vs_host_step']:.1f}% vs the logit-bias step, "
              f"+{runs['grammar_overhead_percent_vs_none']:.1f}% vs none")
    for n, r in report["mask_time_spec"].items():
        print(f"JSON masks at {n}: {r['mask_ms_per_step']:.3f} ms host per step of {r['ms_per_step']:.2f} ms "
              f"(verify fill {r['verify_fill_ms_per_step']:.3f}, apply {r['verify_apply_ms_per_step']:.3f}, "
              f"draft loop {r['draft_mask_ms_per_step']:.3f}, forced drafts {r['forced_drafts_ms_per_step']:.3f}; "
              f"{r['rows_filled_ahead']} rows filled ahead; {r['drafts_per_verify'] or 0:.2f} drafts a verify, "
              f"{r['jit_compiles']} compilations)")
    print(f"wrote {path} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
