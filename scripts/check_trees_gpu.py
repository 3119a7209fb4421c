"""Issue 28's draft-tree bars on the GPU, one script, JSON into OUT_DIR after every part:

  (a) verify cost: Llama-3.1-8B shape (foretell/configs, bf16, dummy weights), one target forward
      over a 16-node tree (positions root + depth, the ancestor mask through the Triton attention)
      against one decode row, batch 1, with the logits: eager, and on the GPU each captured in a
      CUDA graph and replayed (as the engine runs them; the bar's ratio, with a profiler kernel
      summary per replay); also the engine's decode step and 16 causal rows (a chain verify of 15).
      Bar: tree verify <= 1.2x decode.
      The 16-row forwards run on the few-row GEMMs bound for 16 rows (the MMA, as a tree engine
      binds them); tree_verify_cublas_s is the same forward on cuBLAS (the binding before).
  (b) engine tok/s at batch 1, acceptance simulated (spec_decode/tree/simulated.py: per-depth
      rates for the best path): trees at a best-path mean length of 5.4 against the chain (k = 3)
      at 2.93 and plain decoding. Bar: trees >= 900 tok/s (SpecForge/SGLang's figure: 638 at 5.40).
  (c) real acceptance of the default Qwen3-layout family (its target and EAGLE3 head) on GSM8K
      test prompts, greedy, per dtype (float32: output must equal plain; bfloat16: reported):
      mean acceptance length, per depth, prompts equal to plain. Bar: trees >= 3.3.
  (p) where one tree step's time goes: the first --trees shape at 5.4 as in (b), its phases timed
      (host time and CUDA event spans: mask, verify graph, verification, compaction, catch-up,
      expansion graph, host time between) and a torch.profiler kernel / launch summary
      (scripts/tree_step_phases.py; a table printed, "p_phases" in the JSON).

    python scripts/check_trees_gpu.py OUT_DIR [--parts a,b,c,p] [--trees 6,4,16 5,4,16]
        [--new-tokens 256] [--num-prompts 64] [--max-tokens 128] [--tiny]

--tiny runs every part on the CPU with tiny random models (a smoke test of the script). On the
H200: part (a) one engine, (b) 2 + len(--trees) engines of dummy 8B weights, (c) 2 engines per
dtype per tree on the default family (tiny): a few minutes in all; split --parts over calls
when time is short. In (b) the tree step verifies on its CUDA graph (runner/tree_graphs.py) and
expands its trees on the drafter's (spec_decode/tree/draft_graphs.py), with the catch-up in the same
replay after a graphed verify (run_after_verify); verification, K/V compaction and the step's host
read stay eager. Each tree row says how many graphs it captured
and how many of its steps used them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from foretell import LLM, SamplingParams  # noqa: E402
from foretell.bench import engine_probe as probe  # noqa: E402
from foretell.bench.bench_models import eagle3_bench_models, synthetic_prompt  # noqa: E402
from foretell.defaults import member_path  # noqa: E402
from foretell.layers.small_m import prepare_small_m_linears  # noqa: E402
from foretell.ops.attention.metadata import AttentionMetadata  # noqa: E402
from foretell.spec_decode.tree.build import build_tree  # noqa: E402
from foretell.spec_decode.tree.shape import TreeShape  # noqa: E402

VERIFY_BAR, TOK_S_BAR, ACCEPTANCE_BAR = 1.2, 900.0, 3.3
TREE_LENGTH, CHAIN_LENGTH, CHAIN_K = 5.4, 2.93, 3
VERIFY_TREE = TreeShape(5, 4, 16)  # 16 verify rows; the shape only sets the mask


def parse_tree(text: str) -> dict:
    depth, topk, nodes = (int(x) for x in text.split(","))
    return {"num_speculative_tokens": depth, "topk": topk, "num_draft_tokens": nodes}


def write(out_path: str, report: dict) -> None:
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2)


# ---- (a) one verify forward over a 16-node tree against a decode row ---------------------------------
def step_metadata(block_table: torch.Tensor, block_size: int, context: int, rows: int,
                  tree_mask: torch.Tensor | None) -> AttentionMetadata:
    device = block_table.device
    positions = torch.arange(context, context + rows, device=device)
    slots = block_table[0, positions // block_size].to(torch.int64) * block_size + positions % block_size
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, rows], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([context + rows], dtype=torch.int32, device=device),
        block_table=block_table, slot_mapping=slots, block_size=block_size, max_query_len=rows,
        max_seq_len=context + rows, query_start_loc_cpu=[0, rows], seq_lens_cpu=[context + rows], tree_mask=tree_mask)


def time_call(fn, device: torch.device, iters: int) -> float:
    """Median seconds of fn() over iters calls, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def graphed_replay(fn):
    """fn captured in a CUDA graph (after an eager call compiles its kernels): its replay."""
    from foretell.device_util import graph_capture

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        fn()
    return graph.replay


def kernel_times_us(replay, iters: int, top: int = 12) -> dict:
    """Per replay, the CUDA kernels' microseconds by name (the profiler's device time), the most first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay()
        torch.cuda.synchronize()
    totals = {e.key[:80]: e.device_time_total / iters for e in prof.key_averages() if e.device_time_total > 0}
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"total": round(sum(totals.values()), 1), **{k: round(v, 1) for k, v in ranked[:top]}}


def part_verify_cost(target: str, options: dict, context: int, iters: int) -> dict:
    llm = LLM(target, skip_tokenizer_init=True, max_num_seqs=1, log_stats_interval_s=0, **options)
    target = probe.target_model(llm)
    model, device, block_size = target.model, target.device, target.block_size
    rows = VERIFY_TREE.num_draft_tokens
    num_blocks = -(-(context + rows) // block_size)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0)  # no request runs
    vocab = target.vocab_size
    gen = torch.Generator().manual_seed(0)
    tree = build_tree(VERIFY_TREE, torch.zeros(1, dtype=torch.int64), torch.randn(1, vocab, generator=gen),
                      lambda t, s, d: torch.randn(1, VERIFY_TREE.topk, vocab, generator=gen))
    ids = torch.randint(0, vocab, (rows,), generator=gen).to(device)
    tree_positions = (context + tree.depths[0]).to(device)
    tree_meta = step_metadata(block_table, block_size, context, rows, tree.ancestor_mask[0].to(device))
    chain_meta = step_metadata(block_table, block_size, context, rows, None)
    decode_meta = step_metadata(block_table, block_size, context, 1, None)
    chain_positions = torch.arange(context, context + rows, device=device)

    def forward(input_ids, positions, metadata):
        with torch.inference_mode():
            hidden, _ = model(input_ids, positions, metadata)
            return model.compute_logits(hidden)

    row = {"context": context, "tree": list(map(int, (VERIFY_TREE.depth, VERIFY_TREE.topk, rows)))}
    row["decode_s"] = time_call(lambda: forward(ids[:1], chain_positions[:1], decode_meta), device, iters)
    # This engine (no drafter) bound the few-row GEMMs for its decode graphs' 2 rows: 16 rows go to
    # cuBLAS, as a tree engine's verify did before tree_step_gemm_rows. Timed so, then bound as a
    # tree engine binds them (16 rows: the MMA in mode "on").
    row["tree_verify_cublas_s"] = time_call(lambda: forward(ids, tree_positions, tree_meta), device, iters)
    if target.small_m_gemm_mode is not None:
        prepare_small_m_linears(model, rows, target.small_m_gemm_mode)
    row["small_m_rows"] = rows if target.small_m_gemm_mode is not None else 0
    row["tree_verify_s"] = time_call(lambda: forward(ids, tree_positions, tree_meta), device, iters)
    row["causal_16_rows_s"] = time_call(lambda: forward(ids, chain_positions, chain_meta), device, iters)
    row["tree_over_decode_eager"] = row["tree_verify_s"] / row["decode_s"]
    if device.type == "cuda":  # the engine runs both forms as CUDA graphs: the bar's comparison
        forms = {"decode": lambda: forward(ids[:1], chain_positions[:1], decode_meta),
                 "tree_verify": lambda: forward(ids, tree_positions, tree_meta),
                 "causal_16_rows": lambda: forward(ids, chain_positions, chain_meta)}
        graphed = {name: graphed_replay(fn) for name, fn in forms.items()}
        for name, replay in graphed.items():
            row[f"graphed_{name}_s"] = time_call(replay, device, iters)
        row["tree_over_decode"] = row["graphed_tree_verify_s"] / row["graphed_decode_s"]
        row["kernels_us"] = {name: kernel_times_us(replay, 20) for name, replay in graphed.items()}
        del graphed, forms
    else:
        row["tree_over_decode"] = row["tree_over_decode_eager"]
    row["bar"] = VERIFY_BAR
    row["ok"] = row["tree_over_decode"] <= VERIFY_BAR
    # The engine's own decode step (CUDA graphs on the GPU) over a long request, for scale.
    prompt = synthetic_prompt(probe.vocab_size(llm), context)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    row["engine_decode_step_s"] = (time.perf_counter() - start) / 128  # prefill included: an upper bound
    del target, model, forward  # the closures hold the weights: drop them so close() can free the memory
    llm.close()
    return row


# ---- (b) engine tok/s at batch 1, simulated acceptance -------------------------------------------------
def run_batch1(llm: LLM, new_tokens: int) -> dict:
    prompt = synthetic_prompt(probe.vocab_size(llm), 128)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # compiled / captured
    before = llm.get_stats()
    start = time.perf_counter()
    outs = llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - start
    after = llm.get_stats()
    row = {"tok_s": len(outs[0].outputs[0].token_ids) / wall, "wall_s": wall}
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    if drafts:
        accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
        row["mean_acceptance_length"] = 1 + accepted / drafts
        row["steps"] = drafts
        row["step_s"] = wall / drafts
    return row


def part_tok_s(target: str, head: str, options: dict, trees: list[str], new_tokens: int) -> dict:
    configs = {"plain": None,
               f"chain k={CHAIN_K} at {CHAIN_LENGTH}": {"num_speculative_tokens": CHAIN_K,
                                                     "simulate_acceptance": {"mean_acceptance_length": CHAIN_LENGTH}}}
    for t in trees:
        configs[f"tree {t} at {TREE_LENGTH}"] = {**parse_tree(t),
                                                 "simulate_acceptance": {"mean_acceptance_length": TREE_LENGTH}}
    rows = {}
    for name, spec in configs.items():
        speculative = None if spec is None else {"method": "eagle3", "model": head, **spec}
        start = time.perf_counter()
        llm = LLM(target, speculative_config=speculative, skip_tokenizer_init=True, max_num_seqs=1,
                  log_stats_interval_s=0, **options)
        row = {"speculative_config": speculative, "start_s": time.perf_counter() - start,
               **run_batch1(llm, new_tokens)}
        if name.startswith("tree"):
            row["bar"], row["ok"] = TOK_S_BAR, row["tok_s"] >= TOK_S_BAR
            row.update(probe.tree_graph_use(llm))
        rows[name] = row
        print(name, json.dumps(row), flush=True)
        llm.close()
    return rows


# ---- (c) real acceptance of the default family ---------------------------------------------------------
def part_acceptance(trees: list[str], dtypes: list[str], device: str, num_prompts: int, max_tokens: int) -> dict:
    from foretell.bench.datasets import gsm8k_test_prompts

    prompts = gsm8k_test_prompts(num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    target, head = member_path("target"), member_path("eagle3")
    out = {}
    for dtype in dtypes:
        engine = dict(dtype=dtype, device=device, max_num_seqs=64, log_stats_interval_s=0)
        configs = {"plain": None, f"chain k={CHAIN_K}": {"num_speculative_tokens": CHAIN_K}}
        configs.update({f"tree {t}": parse_tree(t) for t in trees})
        rows, baseline = {}, None
        for name, shape in configs.items():
            spec = None if shape is None else {"method": "eagle3", "model": head, **shape}
            llm = LLM(target, speculative_config=spec, **engine)
            start = time.perf_counter()
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            row = {"seconds": time.perf_counter() - start, "output_tokens": sum(map(len, tokens))}
            if baseline is None:
                baseline = tokens
            else:
                stats = llm.get_stats()
                drafts = stats["num_drafts"]
                row.update(mean_acceptance_length=stats["mean_acceptance_length"],
                           acceptance_per_depth=[a / drafts for a in stats["accepted_per_position"]],
                           greedy_equal_prompts=sum(x == y for x, y in zip(tokens, baseline)), prompts=len(prompts))
                if name.startswith("tree"):
                    row["bar"], row["ok"] = ACCEPTANCE_BAR, row["mean_acceptance_length"] >= ACCEPTANCE_BAR
                    if dtype == "float32":
                        row["ok"] = row["ok"] and row["greedy_equal_prompts"] == len(prompts)
            rows[name] = row
            print(dtype, name, json.dumps(row), flush=True)
            llm.close()
        out[dtype] = rows
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--parts", default="a,b,c",
                        help="which of a (verify cost), b (tok/s), c (acceptance), p (a tree step's phases)")
    parser.add_argument("--trees", nargs="+", default=["6,4,16"], help="depth,topk,num_draft_tokens for (b)")
    parser.add_argument("--acceptance-trees", nargs="+", default=["5,4,16", "6,8,32"], help="trees for (c)")
    parser.add_argument("--acceptance-dtypes", default="float32,bfloat16")
    parser.add_argument("--context", type=int, default=512, help="(a): context tokens before the step")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (a smoke test)")
    args = parser.parse_args()
    if args.tiny:
        args.iters, args.new_tokens, args.context = min(args.iters, 5), min(args.new_tokens, 32), min(args.context, 64)
        args.num_prompts, args.max_tokens = min(args.num_prompts, 3), min(args.max_tokens, 16)
        args.acceptance_dtypes, args.acceptance_trees = "float32", args.acceptance_trees[:1]
    parts = set(args.parts.split(","))
    if not parts <= {"a", "b", "c", "p"}:
        parser.error(f"--parts takes a, b, c and p, got {args.parts!r}")
    os.makedirs(args.out_dir, exist_ok=True)
    out_path = os.path.join(args.out_dir, "check_trees_gpu.json")
    device = "cpu" if args.tiny else "cuda"
    report: dict = {"tiny": args.tiny, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    target, head, options = eagle3_bench_models(args.tiny)
    if "a" in parts:
        report["a_verify_cost"] = part_verify_cost(target, options, args.context, args.iters)
        print("a", json.dumps(report["a_verify_cost"]), flush=True)
        write(out_path, report)
    if "b" in parts:
        report["b_tok_s_batch1"] = part_tok_s(target, head, options, args.trees, args.new_tokens)
        write(out_path, report)
    if "p" in parts:
        from tree_step_phases import measure, print_report, tree_engine

        llm = tree_engine(target, head, options, args.trees[0], TREE_LENGTH)
        report["p_phases"] = {"tree": args.trees[0], "mean_length": TREE_LENGTH, **measure(llm, args.new_tokens)}
        llm.close()
        print_report(report["p_phases"])
        write(out_path, report)
    if "c" in parts:
        report["c_acceptance"] = part_acceptance(args.acceptance_trees, args.acceptance_dtypes.split(","), device,
                                                 args.num_prompts, args.max_tokens)
        write(out_path, report)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
