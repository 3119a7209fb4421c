"""Where does batch 1 differ from batch N in the batch-invariant mode (issue 23)? One process, for the H200.

    python scripts/diagnose_batch_invariance_gpu.py OUT_DIR [--sections graphs,eager,localise,sampling]
        [--num-prompts 64] [--max-tokens 256] [--max-eager-prompts 8] [--mode-off]
    python scripts/diagnose_batch_invariance_gpu.py OUT_DIR --tiny     # CPU smoke run, tiny random Qwen3

The default Qwen3-layout family (foretell.defaults.member_path("target", "qwen3")), bf16,
batch_invariant=True (--mode-off: False, for contrast), GSM8K test prompts, greedy, ignore_eos:

graphs     all prompts at once against each prompt alone, with CUDA graphs (the engine's default);
           per differing prompt the index of its first differing token.
eager      the same with enforce_eager=True: every prompt at once, and alone only the prompts that
           differed with graphs (at most --max-eager-prompts; the first ones when none differed).
           Whether graphs matter: do the eager runs differ where the graphed ones did, and does the
           eager batched output equal the graphed one?
localise   the first differing prompt (prompt 0 when none differs): its prompt + the batched run's
           tokens up to the divergence (S, L tokens; row L - 1 predicts the token that differed),
           and each other prompt's sequence at the same step, fed by hand-built eager forwards
           through the eager engine's model and KV cache (the engine idle), with forward hooks on
           every named module keeping S's rows of every output:
             prefill alone            S in one forward                          (the prefill reference)
             prefill among N          S in the middle of every sequence's prefill, one forward
             prefill in chunks        S in two forwards (split at L // 2)
             decode alone             S[:L-1] prefilled alone, then S[L-1] alone (the decode reference)
             decode among 2 / among N S[L-1] with 1 / N - 1 other sequences' next tokens
                                      (their contexts prefilled alone, as S's)
           Each formation against its reference (and decode alone against prefill alone's last row):
           the first module, in execution order, whose output rows differ, by how much, at which
           position, how many module outputs differ in all, and each formation's greedy token.
sampling   seeded sampling (temperature 0.8, a seed per request) all at once against alone, with
           graphs: matches and first differing indices.

Writes OUT_DIR/diagnose_batch_invariance.json after every section and prints a short table.
About a minute on an H200 (most of it engine builds and Triton compiles); --tiny runs on the CPU
in a few minutes with 4 prompts x 8 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench.engine_probe import target_model  # noqa: E402

SECTIONS = ("graphs", "eager", "localise", "sampling")
RESULTS: dict = {}


def save(out_dir: str) -> None:
    with open(os.path.join(out_dir, "diagnose_batch_invariance.json"), "w") as f:
        json.dump(RESULTS, f, indent=2, default=str)


# ------------------------------------------------------------------------------- engines, prompts


@dataclass
class Setup:
    model: str
    engine: dict  # LLM keyword arguments shared by every engine
    prompts: list  # texts, or {"prompt_token_ids": [...]} with --tiny
    max_tokens: int


def make_setup(args: argparse.Namespace, scratch: str) -> Setup:
    if args.tiny:
        from foretell.bench.tiny_checkpoints import QWEN3_TINY, write_tiny_qwen3

        model = write_tiny_qwen3(os.path.join(scratch, "tiny-qwen3"))
        vocab = QWEN3_TINY["vocab_size"]
        gen = torch.Generator().manual_seed(23)
        prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
                   for n in torch.randint(9, 40, (args.num_prompts,), generator=gen)]
        engine = dict(device="cpu", dtype=args.dtype, skip_tokenizer_init=True, kv_cache_memory_bytes=32 << 20)
    else:
        from foretell.bench.datasets import gsm8k_test_prompts
        from foretell.defaults import member_path

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for the CPU smoke run")
        model = member_path("target", "qwen3")
        prompts = gsm8k_test_prompts(args.num_prompts)
        engine = dict(device="cuda", dtype=args.dtype, kv_cache_memory_bytes=1 << 30)
    engine.update(batch_invariant=not args.mode_off, max_num_seqs=args.num_prompts, enable_prefix_caching=False,
                  log_stats_interval_s=0)
    return Setup(model, engine, prompts, args.max_tokens)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM, prompts: list, params) -> tuple[list[list[int]], list[list[int]]]:
    """(output token ids, prompt token ids) per prompt."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [list(o.prompt_token_ids) for o in outs]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (the shorter one's length when one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def differences(together: list[list[int]], alone: dict[int, list[int]]) -> dict[int, int]:
    """{prompt index: first differing token index} over the prompts run alone."""
    found = {i: first_difference(together[i], out) for i, out in alone.items()}
    return {i: d for i, d in found.items() if d is not None}


# ------------------------------------------------------------------------------------- sections


def graphs_section(setup: Setup, state: dict) -> dict:
    params = greedy(setup.max_tokens)
    with LLM(setup.model, **setup.engine) as llm:
        t0 = time.perf_counter()
        batched, prompt_ids = generate(llm, setup.prompts, params)
        batched_s = time.perf_counter() - t0
        alone = {i: generate(llm, [p], params)[0][0] for i, p in enumerate(setup.prompts)}
        alone_s = time.perf_counter() - t0 - batched_s
    state.update(batched=batched, prompt_ids=prompt_ids, alone=alone)
    diff = differences(batched, alone)
    return {"num_prompts": len(setup.prompts), "max_tokens": setup.max_tokens,
            "matches": len(setup.prompts) - len(diff), "first_difference": diff,
            "batched_s": round(batched_s, 1), "alone_s": round(alone_s, 1)}


def eager_section(setup: Setup, state: dict, llm: LLM, max_prompts: int) -> dict:
    """llm: an engine of setup's with enforce_eager=True."""
    params = greedy(setup.max_tokens)
    graphed_diff = differences(state["batched"], state["alone"]) if "batched" in state else {}
    chosen = sorted(graphed_diff)[:max_prompts] or list(range(min(max_prompts, len(setup.prompts))))
    batched, prompt_ids = generate(llm, setup.prompts, params)
    alone = {i: generate(llm, [setup.prompts[i]], params)[0][0] for i in chosen}
    state.update(eager_batched=batched, eager_alone=alone, prompt_ids=prompt_ids)
    diff = differences(batched, alone)
    row = {"prompts_run_alone": chosen, "matches": f"{len(chosen) - len(diff)} of {len(chosen)}", "first_difference": diff}
    if "batched" in state:
        row["eager_batched_equals_graphed_batched"] = sum(a == b for a, b in zip(batched, state["batched"]))
        row["eager_alone_equals_graphed_alone"] = {i: alone[i] == state["alone"][i] for i in chosen}
    return row


def sampling_section(setup: Setup, max_tokens: int) -> dict:
    params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
              for i in range(len(setup.prompts))]
    with LLM(setup.model, **setup.engine) as llm:
        together = generate(llm, setup.prompts, params)[0]
        alone = {i: generate(llm, [p], q)[0][0] for i, (p, q) in enumerate(zip(setup.prompts, params))}
    diff = differences(together, alone)
    return {"max_tokens": max_tokens, "matches": len(setup.prompts) - len(diff), "first_difference": diff}


# ------------------------------------------------------------------------- hand-built forwards


@dataclass
class Segment:
    """Rows start:end of a sequence's tokens fed in one forward, over its own cache blocks."""

    tokens: list[int]
    start: int
    end: int
    blocks: list[int]


class RowRecorder:
    """Forward hooks on every named module of a model, keeping rows lo:hi of each tensor output whose
    first dimension is the forward's token count: {(module name, call index, output index): rows}."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.records: dict[tuple[str, int, int], torch.Tensor] = {}
        self.order: list[tuple[str, int, int]] = []  # first seen, in execution order
        self.rows: tuple[int, int, int] | None = None  # (lo, hi, num_tokens) of the forward running

    @contextlib.contextmanager
    def watching(self, lo: int, hi: int, num_tokens: int):
        """Record rows lo:hi of the forwards run inside (a forward of num_tokens rows); calls are
        counted per module from the first forward on, so chunks add rows to the same keys."""
        self.rows, calls = (lo, hi, num_tokens), {}
        handles = [module.register_forward_hook(self._hook(name, calls)) for name, module in self.model.named_modules()
                   if name]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.rows = None

    def _hook(self, name: str, calls: dict):
        def hook(module, inputs, output):
            call = calls.get(name, 0)
            calls[name] = call + 1
            lo, hi, num_tokens = self.rows
            for j, tensor in enumerate(flat_tensors(output)):
                if tensor.dim() == 0 or tensor.shape[0] != num_tokens:
                    continue
                key = (name, call, j)
                rows = tensor[lo:hi].detach().to("cpu", copy=True)
                if key in self.records:  # a later chunk of the same sequence
                    rows = torch.cat([self.records[key], rows])
                else:
                    self.order.append(key)
                self.records[key] = rows
        return hook


def flat_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in flat_tensors(item)]
    return []


class Forwarder:
    """Eager forwards of hand-built batches through an idle engine's model, over its KV cache (blocks
    handed out from 0 upwards; nothing of the engine is running, and its prefix cache is off)."""

    def __init__(self, llm: LLM):
        target = target_model(llm)  # ValueError for a tensor-parallel engine: one process's model
        self.model = target.model
        self.device = target.device
        self.block_size = target.block_size
        self.num_blocks = target.num_blocks
        self.next_block = 0

    def blocks_for(self, num_tokens: int) -> list[int]:
        count = -(-num_tokens // self.block_size)
        if self.next_block + count > self.num_blocks:
            raise ValueError(f"the engine's KV cache has {self.num_blocks} blocks of {self.block_size}; the "
                             f"localisation needs more: raise kv_cache_memory_bytes or lower --num-prompts")
        blocks = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return blocks

    @torch.inference_mode()
    def forward(self, segments: list[Segment], recorder: RowRecorder | None = None,
                watch: int | None = None) -> torch.Tensor:  # [num_segments, vocab] float32: each last row's logits
        """One eager forward of the segments (as ModelRunner.target_forward runs a batch); with a
        recorder, the rows of segments[watch] are recorded."""
        from foretell.runner.input_batch import InputBatch, cache_slot

        ids, positions, slots, query_start = [], [], [], [0]
        for s in segments:
            ids += s.tokens[s.start : s.end]
            positions += list(range(s.start, s.end))
            slots += [cache_slot(s.blocks, p, self.block_size) for p in range(s.start, s.end)]
            query_start.append(query_start[-1] + s.end - s.start)
        last_rows = [q - 1 for q in query_start[1:]]
        batch = InputBatch(token_ids=ids, position_list=positions, slot_list=slots, block_ids=[s.blocks for s in segments],
                           query_start=query_start, seq_lens=[s.end for s in segments], block_size=self.block_size,
                           device=self.device, logits_row_ids=last_rows, sampling_seq_index=list(range(len(segments))),
                           row_positions=[s.end for s in segments])
        scope = (recorder.watching(query_start[watch], query_start[watch + 1], len(ids)) if recorder is not None
                 else contextlib.nullcontext())
        with scope:
            hidden, _ = self.model(batch.input_ids, batch.positions, batch.attn_metadata)  # [num_tokens, hidden]
            logits = self.model.compute_logits(hidden[batch.logits_rows])  # [num_segments, vocab] float32
        return logits.float().cpu()


def compare(reference: RowRecorder, other: RowRecorder, positions: list[int], rows_ref=slice(None),
            rows_other=slice(None)) -> dict:
    """The first module output (in the reference's execution order) whose recorded rows differ, and
    how many differ; positions: the context position of each compared row."""
    differing, first = 0, None
    for key in reference.order:
        if key not in other.records:
            continue
        a, b = reference.records[key][rows_ref], other.records[key][rows_other]
        if a.shape != b.shape:
            return {"error": f"{key}: shapes {list(a.shape)} and {list(b.shape)}"}
        if torch.equal(a, b):
            continue
        differing += 1
        if first is None:
            delta = (a.double() - b.double()).abs()
            rows = delta.flatten(1).amax(dim=1) if delta.dim() > 1 else delta  # [rows]
            bad = (rows > 0).nonzero().flatten().tolist() or list(range(len(rows)))
            first = {"module": key[0], "call": key[1], "output": key[2], "max_abs_diff": float(delta.max()),
                     "max_abs_value": float(a.double().abs().max()), "elements_differing": int((delta > 0).sum()),
                     "of_elements": delta.numel(), "first_position": positions[bad[0]],
                     "positions_differing": len(bad)}
    compared = sum(key in other.records for key in reference.order)
    return {"first_differing": first, "outputs_differing": differing, "outputs_compared": compared}


def localise_section(setup: Setup, state: dict, llm: LLM) -> dict:
    """The formations of the module docstring for the first differing prompt (prompt 0 when none),
    through llm: an idle engine of setup's with enforce_eager=True."""
    graphed = "batched" in state
    batched = state["batched"] if graphed else state.get("eager_batched")
    alone_runs = state.get("alone" if graphed else "eager_alone", {})
    prompt_ids = state.get("prompt_ids")
    if batched is None:
        raise ValueError("localise needs the graphs or eager section's batched run (--sections graphs,localise)")
    diff = differences(batched, alone_runs)
    target = min(diff, key=lambda i: (diff[i], i)) if diff else 0
    step = diff.get(target, setup.max_tokens - 1)  # the token index that differed
    seqs = [prompt_ids[i] + batched[i][:step] for i in range(len(batched))]  # every sequence at that step
    others = [i for i in range(len(seqs)) if i != target]
    s = seqs[target]
    length = len(s)
    fw = Forwarder(llm)
    s_blocks = fw.blocks_for(length)
    other_blocks = {i: fw.blocks_for(len(seqs[i])) for i in others}
    recorders, logits = {}, {}

    def run(name: str, fn) -> None:  # fn(recorder) -> S's last row's logits [vocab] float32
        recorders[name] = RowRecorder(fw.model)
        logits[name] = fn(recorders[name])

    def prefill_alone(rec):
        return fw.forward([Segment(s, 0, length, s_blocks)], rec, 0)[-1]

    def prefill_among(rec):
        order = others[: len(others) // 2] + [target] + others[len(others) // 2 :]
        segs = [Segment(seqs[i], 0, len(seqs[i]), s_blocks if i == target else other_blocks[i]) for i in order]
        return fw.forward(segs, rec, order.index(target))[order.index(target)]

    def prefill_chunks(rec):
        half = length // 2
        if half:
            fw.forward([Segment(s, 0, half, s_blocks)], rec, 0)
        return fw.forward([Segment(s, half, length, s_blocks)], rec, 0)[-1]

    def decode_among(count: int):
        def run_decode(rec):
            companions = others[: count - 1]
            for i in [target, *companions]:  # each context prefilled alone: the same bits every time
                if len(seqs[i]) > 1:
                    fw.forward([Segment(seqs[i], 0, len(seqs[i]) - 1, s_blocks if i == target else other_blocks[i])])
            order = companions[: len(companions) // 2] + [target] + companions[len(companions) // 2 :]
            segs = [Segment(seqs[i], len(seqs[i]) - 1, len(seqs[i]), s_blocks if i == target else other_blocks[i])
                    for i in order]
            return fw.forward(segs, rec, order.index(target))[order.index(target)]
        return run_decode

    run("prefill alone", prefill_alone)
    run("prefill among N", prefill_among)
    run("prefill in chunks", prefill_chunks)
    run("decode alone", decode_among(1))
    if others:
        run("decode among 2", decode_among(2))
        run(f"decode among {len(seqs)}", decode_among(len(seqs)))
    all_positions = list(range(length))
    comparisons = {}
    for name in recorders:
        if name.startswith("prefill") and name != "prefill alone":
            comparisons[f"{name} vs prefill alone"] = compare(recorders["prefill alone"], recorders[name], all_positions)
        elif name.startswith("decode") and name != "decode alone":
            comparisons[f"{name} vs decode alone"] = compare(recorders["decode alone"], recorders[name], [length - 1])
    comparisons["decode alone vs prefill alone (last row)"] = compare(
        recorders["prefill alone"], recorders["decode alone"], [length - 1], rows_ref=slice(length - 1, length))
    alone = alone_runs.get(target, [])
    reference = {name: logits["prefill alone" if name.startswith("prefill") else "decode alone"] for name in logits}
    return {"prompt": target, "token_index": step, "sequence_length": length, "num_sequences": len(seqs),
            "batched_token": batched[target][step] if step < len(batched[target]) else None,
            "alone_token": alone[step] if step < len(alone) else None,
            "greedy_token_per_formation": {name: int(row.argmax()) for name, row in logits.items()},
            "logits_max_abs_diff_vs_reference": {name: float((row.double() - reference[name].double()).abs().max())
                                                 for name, row in logits.items()},
            "comparisons": comparisons}


# ------------------------------------------------------------------------------------ the run


def run_section(name: str, out_dir: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        RESULTS[name] = fn(*args)
    except Exception as e:  # record and go on: one broken section must not hide the rest
        RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    RESULTS.setdefault("_seconds", {})[name] = round(time.perf_counter() - t0, 1)
    save(out_dir)


def print_table(num_prompts: int) -> None:
    print(f"\nbatch-invariance diagnosis (mode {'off' if RESULTS.get('mode_off') else 'on'}, {RESULTS.get('dtype')}), {num_prompts} prompts")
    for name in ("graphs", "eager", "sampling"):
        row = RESULTS.get(name)
        if not row:
            continue
        if "error" in row:
            print(f"  {name:<10}error: {row['error']}")
            continue
        matches = row.get("matches", "")
        print(f"  {name:<10}alone = together on {matches if matches != '' else '-'}; first differing token per "
              f"prompt: {row['first_difference'] or 'none'}")
        if name == "eager" and "eager_batched_equals_graphed_batched" in row:
            print(f"  {'':<10}eager batched = graphed batched on {row['eager_batched_equals_graphed_batched']}")
    loc = RESULTS.get("localise")
    if loc and "error" not in loc:
        print(f"  localise  prompt {loc['prompt']}, token {loc['token_index']} (S = {loc['sequence_length']} tokens, "
              f"{loc['num_sequences']} sequences); greedy token per formation {loc['greedy_token_per_formation']}")
        for name, c in loc["comparisons"].items():
            first = c.get("first_differing")
            where = ("identical" if first is None else
                     f"first {first['module']} (call {first['call']}, output {first['output']}) at position "
                     f"{first['first_position']}: max |diff| {first['max_abs_diff']:.3g} of {first['max_abs_value']:.3g}, "
                     f"{first['elements_differing']}/{first['of_elements']} elements")
            print(f"    {name:<44}{c.get('outputs_differing', '?')}/{c.get('outputs_compared', '?')} outputs differ; {where}"
                  if "error" not in c else f"    {name:<44}error: {c['error']}")
    elif loc:
        print(f"  localise  error: {loc['error']}")
    print(f"  seconds per section: {RESULTS.get('_seconds')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="folder for diagnose_batch_invariance.json")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 on the CPU (a smoke run)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts (default 64; --tiny 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="greedy tokens per prompt (default 256; --tiny 8)")
    parser.add_argument("--max-eager-prompts", type=int, default=8, help="prompts the eager section runs alone")
    parser.add_argument("--mode-off", action="store_true", help="batch_invariant=False (the default path), for contrast")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="the model's dtype (default bfloat16, the issue's)")
    args = parser.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; expected some of {list(SECTIONS)}")
    args.num_prompts = args.num_prompts or (4 if args.tiny else 64)
    args.max_tokens = args.max_tokens or (8 if args.tiny else 256)
    for flag in ("num_prompts", "max_tokens", "max_eager_prompts"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    os.makedirs(args.out, exist_ok=True)
    RESULTS.update(mode_off=args.mode_off, tiny=args.tiny, dtype=args.dtype, sections=sections)
    state: dict = {}
    with tempfile.TemporaryDirectory() as scratch:
        setup = make_setup(args, scratch)
        RESULTS["model"] = setup.model if not args.tiny else "tiny random Qwen3 (foretell.bench.tiny_checkpoints)"
        if "graphs" in sections:
            run_section("graphs", args.out, graphs_section, setup, state)
        if "eager" in sections or "localise" in sections:  # one eager engine for both
            with LLM(setup.model, enforce_eager=True, **setup.engine) as eager:
                if "eager" in sections:
                    run_section("eager", args.out, eager_section, setup, state, eager, args.max_eager_prompts)
                if "localise" in sections:
                    run_section("localise", args.out, localise_section, setup, state, eager)
        if "sampling" in sections:
            run_section("sampling", args.out, sampling_section, setup, max(1, args.max_tokens // 2))
    print_table(args.num_prompts)
    print(f"JSON in {os.path.join(args.out, 'diagnose_batch_invariance.json')}")


if __name__ == "__main__":
    main()
