"""What a grammar costs per engine step at batch 1 (issue 27's overhead bar), on any device.

One prompt, --tokens greedy tokens (EOS ignored), the default family (or --model), with the
drafter of --method. Five runs in one engine, each repeated --repeats times (the median is kept):

  padded_step   no grammar, no controls: the padded device step (graphed verify and draft loop,
                queued ahead; eager on the CPU), what a request without a grammar gets
  host_step     the same request with the runner's device steps turned off for the run (its step
                pipeline tries no kind): the host step (runner/host_step.py), without the grammar
  always_true   an always-true grammar (regex `(.|\\n)*`): the grammar's machinery, no constraint;
                with a model drafter on the padded step (structured/padded_verify.py: graphed
                draft loop, one read a step, masks uploaded), else on the host step
  always_true_host  the same grammar with the padded verify off (GraphedVerify.enabled): the host
                step with its eager, masked draft loop, what every grammar request took before
                2026-12-02 (issue 27's slow grammar step on the H200: docs/perf-log.md); the
                same as always_true where the padded step takes no grammar (n-gram, no drafter)
  json          the JSON schema of scripts/check_structured_gpu.py (what users send)

For each: milliseconds per engine step (wall, and this thread's CPU time, steadier on a shared
machine), and the grammar's host time per step on the engine's thread from StructuredOutputs'
MaskTimer: the verify rows' fill (llguidance, or the wait for the rows filled ahead on the
worker thread), their copy and device op, the drafter loop's masks, and handing the next step's
rows to the worker (fill_ahead). The grammar's own cost is always_true against host_step; what a
user pays for a grammar is always_true against padded_step; always_true_host against
always_true is what the grammar's padded step saves. Before 2026-12-02 the table's baseline was a no-op
logit_bias, which since 99df117 (logits controls on the padded step) no longer takes the host
step: it compared the grammar's host step against the padded step. With --count-syncs, one more
request of each run under bench/device_syncs.DeviceSyncCounter: device->host syncs, device ops and
uploads per step, and where the syncs are made (counts, not times: the same on any machine). Then
the device op alone: apply_token_bitmask on [k + 1, vocab] logits for the default family's
vocabulary and a 151,936-token one.

    python -m foretell.bench.structured_overhead --method eagle3 --device cpu --tokens 64
    python -m foretell.bench.structured_overhead --method none --json-out out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

ALWAYS_TRUE = r"(.|\n)*"
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "reasoning": {"type": "string", "maxLength": 160},
        "answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
    },
    "required": ["reasoning", "answer"],
    "additionalProperties": False,
}
TIMER_FIELDS = ("seconds", "verify_fill_seconds", "verify_apply_seconds", "draft_seconds", "fill_ahead_seconds")


def structured_of(llm):
    """The engine's StructuredOutputs (one-process runner)."""
    return llm.engine.runner.host_step.structured


def _counters(llm) -> dict:
    timer = structured_of(llm).timer
    stats = llm.get_stats()
    out = {name: getattr(timer, name, 0.0) for name in TIMER_FIELDS}
    out.update(steps=stats["num_steps"], drafts=stats.get("num_drafts", 0),
               accepted=stats.get("num_accepted_tokens", 0), wall=time.perf_counter(), cpu=time.thread_time())
    return out


def measure(llm, prompt: str, params, repeats: int) -> dict:
    """Median over repeats of one request's per-step figures (the first, warm-up run dropped)."""
    llm.generate([prompt], params, use_tqdm=False)
    runs = []
    for _ in range(repeats):
        start = _counters(llm)
        outs = llm.generate([prompt], params, use_tqdm=False)
        end = _counters(llm)
        d = {k: end[k] - start[k] for k in end}
        steps = max(d["steps"], 1)
        runs.append({
            "tokens": len(outs[0].outputs[0].token_ids),
            "steps": d["steps"],
            "mean_acceptance_length": 1 + d["accepted"] / d["drafts"] if d["drafts"] else None,
            "ms_per_step": 1e3 * d["wall"] / steps,
            "cpu_ms_per_step": 1e3 * d["cpu"] / steps,
            "mask_ms_per_step": 1e3 * d["seconds"] / steps,
            "verify_fill_ms_per_step": 1e3 * d["verify_fill_seconds"] / steps,
            "verify_apply_ms_per_step": 1e3 * d["verify_apply_seconds"] / steps,
            "draft_mask_ms_per_step": 1e3 * d["draft_seconds"] / steps,
            "fill_ahead_ms_per_step": 1e3 * d["fill_ahead_seconds"] / steps,
        })
    return {key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None for key in runs[0]}


class PaddedVerifyOff:
    """While inside: the runner's padded verify step declines every batch (GraphedVerify.enabled
    off), so verifies take the host step; plain decoding queued ahead is untouched."""

    def __init__(self, llm):
        from foretell.runner.graphed_verify import GraphedVerify

        self.pipeline = llm.engine.runner.pipeline
        self.kinds = [kind for kind in self.pipeline.kinds if isinstance(kind, GraphedVerify)]

    def __enter__(self):
        for kind in self.kinds:
            kind.enabled = False
        self.pipeline.reset()
        return self

    def __exit__(self, *exc):
        for kind in self.kinds:
            kind.enabled = True
        self.pipeline.reset()


def padded_grammar_steps(llm) -> int:
    """Padded verify steps with a grammar so far (0 without a padded verify)."""
    from foretell.runner.graphed_verify import GraphedVerify

    return sum(kind.num_grammar_steps for kind in llm.engine.runner.pipeline.kinds if isinstance(kind, GraphedVerify))


class HostStepOnly:
    """While inside: the runner's step pipeline launches no device step (padded verify, decode
    queued ahead), so every batch takes the host step. An instance attribute swapped and put
    back: the engine's classes are untouched."""

    def __init__(self, llm):
        self.pipeline = llm.engine.runner.pipeline
        self.kinds = None

    def __enter__(self):
        self.kinds, self.pipeline.kinds = self.pipeline.kinds, []
        self.pipeline.reset()
        return self

    def __exit__(self, *exc):
        self.pipeline.kinds = self.kinds
        self.pipeline.reset()


def count_syncs(llm, prompt: str, params) -> dict:
    """One request under DeviceSyncCounter: per engine step, the device->host syncs, device ops
    and uploads, and the sync sites (per step, the most frequent first)."""
    from foretell.bench.device_syncs import DeviceSyncCounter

    stats = llm.get_stats
    with DeviceSyncCounter() as counter:
        counter.track_engine(llm.engine.runner)
        steps = stats()["num_steps"]
        llm.generate([prompt], params, use_tqdm=False)
        steps = max(stats()["num_steps"] - steps, 1)
    return {"syncs_per_step": counter.num_syncs / steps, "device_ops_per_step": counter.num_device_ops / steps,
            "uploads_per_step": counter.num_uploads / steps,
            "sync_sites_per_step": {site: n / steps for site, n in counter.sync_sites.most_common()}}


def bitmask_op_us(vocab_size: int, num_rows: int, device: str, repeats: int = 200) -> float:
    """Median microseconds of apply_token_bitmask on [num_rows, vocab_size] float32 logits."""
    import torch

    from foretell.structured.bitmask import apply_token_bitmask, num_mask_words

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, generator=generator).to(device)  # [rows, vocab]
    bitmask = torch.randint(-2**31, 2**31 - 1, (num_rows, num_mask_words(vocab_size)), dtype=torch.int32,
                            generator=generator).to(device)  # [rows, words]
    times = []
    for _ in range(repeats):
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        apply_token_bitmask(logits, None, bitmask)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return 1e6 * statistics.median(times)


def run(model: str | None, method: str, device: str, dtype: str, tokens: int, repeats: int,
        fill_ahead: bool = True, forced_drafts: bool = True, num_cpu_threads: int | None = None,
        syncs: bool = False) -> dict:
    from foretell import LLM, SamplingParams
    from foretell.bench.datasets import gsm8k_test_prompts
    from foretell.defaults import member_path

    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": 3, "structured_forced_drafts": forced_drafts}
        if method in ("eagle3", "draft_model"):
            spec["model"] = member_path(method)
    prompt = gsm8k_test_prompts(1)[0] + " Reply with JSON."
    base = dict(temperature=0, max_tokens=tokens, ignore_eos=True)
    report: dict = {"method": method, "device": device, "dtype": dtype, "tokens": tokens, "fill_ahead": fill_ahead,
                    "forced_drafts": forced_drafts}
    threads = {} if num_cpu_threads is None else {"num_cpu_threads": num_cpu_threads}
    with LLM(model or member_path("target"), device=device, dtype=dtype, speculative_config=spec, **threads) as llm:
        if not fill_ahead:  # every step fills its own rows (an instance attribute: the class is untouched)
            structured_of(llm).fill_ahead = lambda scheduled, results: None
        plain = SamplingParams(**base)
        always_true = SamplingParams(**base, structured_outputs={"regex": ALWAYS_TRUE})
        runs = {
            "padded_step": plain,
            "host_step": plain,
            "always_true": always_true,
            "always_true_host": always_true,
            # The JSON document ends where it ends: no ignore_eos (a closed document allows only EOS).
            "json": SamplingParams(temperature=0, max_tokens=tokens, structured_outputs={
                "json": JSON_SCHEMA, "disable_any_whitespace": True}),
        }
        contexts = {"host_step": HostStepOnly, "always_true_host": PaddedVerifyOff}
        for name, params in runs.items():
            with contexts[name](llm) if name in contexts else contextlib.nullcontext():
                grammar_steps = padded_grammar_steps(llm)
                report[name] = measure(llm, prompt, params, repeats)
                report[name]["padded_grammar_steps"] = padded_grammar_steps(llm) - grammar_steps
                if syncs:
                    report[name].update(count_syncs(llm, prompt, params))
        vocab = llm.engine.runner.vocab_size
    grammar = report["always_true"]
    for base_run, suffix in (("host_step", ""), ("padded_step", "_vs_padded_step"),
                             ("always_true_host", "_vs_grammar_on_the_host_step")):
        for key in ("ms_per_step", "cpu_ms_per_step"):
            base_value = report[base_run][key]
            report[f"overhead_percent_{key}{suffix}"] = 100.0 * (grammar[key] - base_value) / base_value
    report["bitmask_op_us"] = {f"{rows}x{v}": bitmask_op_us(v, rows, device)
                               for v in (vocab, 151936) for rows in (1, 4)}
    return report


def print_report(report: dict) -> None:
    print(f"batch 1, {report['method']}, {report['device']} {report['dtype']}, {report['tokens']} tokens, "
          f"fill ahead {'on' if report['fill_ahead'] else 'off'}, "
          f"forced drafts {'on' if report['forced_drafts'] else 'off'}")
    print(f"{'run':16} {'ms/step':>8} {'cpu ms':>8} {'masks ms':>9} {'fill':>7} {'apply':>7} {'draft':>7} "
          f"{'ahead':>7} {'accept':>7}")
    counted = "syncs_per_step" in report["always_true"]
    for name in ("padded_step", "host_step", "always_true", "always_true_host", "json"):
        r = report[name]
        accept = f"{r['mean_acceptance_length']:.3f}" if r["mean_acceptance_length"] else "-"
        syncs = (f" {r['syncs_per_step']:6.2f} {r['device_ops_per_step']:7.1f} {r['uploads_per_step']:7.1f}"
                 if counted else "")
        print(f"{name:16} {r['ms_per_step']:8.3f} {r['cpu_ms_per_step']:8.3f} {r['mask_ms_per_step']:9.3f} "
              f"{r['verify_fill_ms_per_step']:7.3f} {r['verify_apply_ms_per_step']:7.3f} "
              f"{r['draft_mask_ms_per_step']:7.3f} {r['fill_ahead_ms_per_step']:7.3f} {accept:>7}{syncs}")
    if counted:
        print("(last columns: device->host syncs, device ops, uploads per step, counted on a separate request)")
        for name in ("padded_step", "host_step", "always_true", "always_true_host"):
            sites = ", ".join(f"{n:.2f} {site}" for site, n in report[name]["sync_sites_per_step"].items())
            print(f"  {name} syncs: {sites or 'none'}")
    print(f"always-true grammar vs the host step without it: {report['overhead_percent_ms_per_step']:+.1f}% wall, "
          f"{report['overhead_percent_cpu_ms_per_step']:+.1f}% thread CPU; vs the padded step "
          f"{report['overhead_percent_ms_per_step_vs_padded_step']:+.1f}% wall; vs the same grammar on the host step "
          f"{report['overhead_percent_ms_per_step_vs_grammar_on_the_host_step']:+.1f}% wall, "
          f"{report['overhead_percent_cpu_ms_per_step_vs_grammar_on_the_host_step']:+.1f}% thread CPU")
    print(f"always-true grammar steps on the padded verify: {report['always_true']['padded_grammar_steps']:.0f}")
    print("apply_token_bitmask: " + ", ".join(f"{k} {v:.1f} us" for k, v in report["bitmask_op_us"].items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target folder (default: the shipped default family's)")
    parser.add_argument("--method", default="eagle3", choices=["none", "eagle3", "draft_model", "ngram"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of each timed request")
    parser.add_argument("--repeats", type=int, default=3, help="timed requests per run (the median is kept)")
    parser.add_argument("--no-fill-ahead", action="store_true",
                        help="fill each step's verify rows in the step (no worker thread), for an A/B")
    parser.add_argument("--structured-forced-drafts", choices=["on", "off"], default="on",
                        help="the grammar's forced tokens drafted (speculative_config structured_forced_drafts)")
    parser.add_argument("--num-cpu-threads", type=int, default=None, help="torch intra-op threads on the CPU")
    parser.add_argument("--count-syncs", action="store_true",
                        help="one more request a run under DeviceSyncCounter: syncs, device ops, uploads per step")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        raise ValueError(f"--tokens and --repeats must be >= 1, got {args.tokens} and {args.repeats}")
    report = run(args.model, args.method, args.device, args.dtype, args.tokens, args.repeats,
                 fill_ahead=not args.no_fill_ahead, forced_drafts=args.structured_forced_drafts == "on",
                 num_cpu_threads=args.num_cpu_threads, syncs=args.count_syncs)
    print_report(report)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
