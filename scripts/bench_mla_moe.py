"""Time the Triton MLA attention and the fused MoE against their torch paths on CUDA.

MLA decode over the latent cache (kv_lora_rank 512 + rope 64, block 16) at DeepSeek-V2-Lite
(16 heads) and V3 (128 heads) shapes, batch 1/16/64, context 1k/4k, plus verify (4 query tokens).
"attend" is the whole backend call (W_UK absorption, kernel, W_UV) eagerly, with launch costs;
"kernel graph" is the attention kernel alone replayed in a CUDA graph over enough cache copies
(one per layer, up to 27) to outsize L2, per copy; GB/s is latent bytes read over that time.

Fused MoE at V2-Lite sizes (64 experts, top-6, hidden 2048, intermediate 1408), batch 1/16/64
and a 512-token prefill: the grouped path's eager (with launch costs) and CUDA-graph times
against the torch path; GB/s is the bytes of the experts actually routed to over the graph time.
--moe-shared N appends N shared experts every token goes through (V2-Lite: 2; ids 64, 65, weight 1),
as MoE.forward routes them.

MoE GEMV path (ops/moe/triton_gemv.py) against the grouped path at 1, 2, 4 and 8 tokens, both
graph-timed, and (unless --quick) a sweep of the GEMV tiles: gate_up configs with the down kernel
at its default, then down configs (with SPLIT, the slot split) with gate_up at its default, then
the two best together. The last line says up to how many tokens the GEMV path wins, which is
what GEMV_MAX_TOKENS in ops/moe/triton_gemv.py should be.

Unless --quick, each case also sweeps launch configs of the kernel and reports the best one
(the defaults come from mla_launch_config / moe_launch_config / gemv_launch_config).

    python scripts/bench_mla_moe.py OUT_DIR [--quick]
    python scripts/bench_mla_moe.py OUT_DIR --moe-sweep 1,4,16 --moe-top-k 6 --moe-shared 2   # MoE only

Prints tables and writes OUT_DIR/bench_mla_moe.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import write_result  # noqa: E402
from foretell.ops.attention.metadata import AttentionMetadata
from foretell.ops.mla.reference import TorchMLABackend
from foretell.ops.moe.reference import experts_forward_torch

RANK, ROPE, NOPE, V_DIM, BLOCK_SIZE = 512, 64, 128, 128, 16
MLA_MODELS = {"V2-Lite": 16, "V3": 128}  # query heads
MOE = dict(num_experts=64, top_k=6, hidden=2048, inter=1408, num_shared=0)
L2_OUTSIZE = 256 * 2**20
DEVICE = torch.device("cuda")
MLA_SWEEP = [dict(BLOCK_M=m, TILE_N=n, num_warps=w, num_stages=2)
             for m, w in ((16, 4), (32, 4), (32, 8), (64, 8)) for n in (32, 64)]
MOE_SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
             for n, k, w, s in ((32, 128, 4, 3), (32, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3),
                                (64, 128, 4, 4), (64, 256, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                (16, 256, 2, 4), (16, 512, 4, 3), (32, 256, 4, 4), (32, 512, 4, 3),
                                (32, 128, 2, 5), (64, 256, 4, 4), (32, 128, 4, 4), (32, 64, 4, 4),
                                (32, 128, 2, 4), (16, 128, 2, 4))]
GEMV_TOKENS = (1, 2, 4, 8)
# A first H200 probe: num_stages does not matter (Triton does not pipeline these loads); the down
# kernel wants its slots split at 1 token (SPLIT 1 is far slower there), so most rows split.
GEMV_SWEEP_GATE_UP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                      for n, k, w, s in ((4, 1024, 4, 1), (8, 256, 4, 1), (8, 512, 4, 1), (16, 128, 4, 1),
                                         (16, 256, 4, 1), (16, 512, 4, 1), (16, 256, 8, 1), (16, 256, 4, 3),
                                         (32, 128, 4, 1), (32, 256, 8, 1))]
GEMV_SWEEP_DOWN = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s, SPLIT=p)
                   for n, k, w, s, p in ((8, 512, 4, 1, 1), (16, 128, 4, 1, 8), (16, 256, 4, 1, 4),
                                         (16, 256, 4, 1, 8), (16, 256, 8, 1, 8), (16, 256, 4, 3, 8),
                                         (16, 512, 4, 1, 8), (32, 128, 4, 1, 8), (32, 256, 4, 1, 1),
                                         (32, 256, 4, 1, 2), (32, 256, 4, 1, 4), (32, 256, 4, 1, 8),
                                         (32, 256, 8, 1, 8), (64, 256, 4, 1, 8))]


def mla_case(heads: int, batch: int, context: int, q_len: int):
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).view(batch, blocks_per_seq)
    cache = torch.randn(num_blocks, BLOCK_SIZE, RANK + ROPE, device=DEVICE).bfloat16()
    starts, lens = [i * q_len for i in range(batch + 1)], [context] * batch
    md = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_table=table, slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=DEVICE),
        block_size=BLOCK_SIZE, max_query_len=q_len, max_seq_len=context,
        query_start_loc_cpu=starts, seq_lens_cpu=lens,
    )
    tokens = batch * q_len
    q_nope = torch.randn(tokens, heads, NOPE, device=DEVICE).bfloat16()
    q_pe = torch.randn(tokens, heads, ROPE, device=DEVICE).bfloat16()
    kv_b = (torch.randn(heads * (NOPE + V_DIM), RANK, device=DEVICE) / RANK**0.5).bfloat16()
    return q_nope, q_pe, kv_b, cache, md


def bench_mla(model: str, batch: int, context: int, q_len: int, rep: int, sweep: bool) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    from foretell.ops.mla.triton_attention import (
        TritonMLABackend,
        mla_attention_triton,
        mla_launch_config,
    )

    heads = MLA_MODELS[model]
    torch.manual_seed(0)
    q_nope, q_pe, kv_b, cache, md = mla_case(heads, batch, context, q_len)
    scale = (NOPE + ROPE) ** -0.5
    triton_backend, torch_backend = TritonMLABackend(), TorchMLABackend()
    out = triton_backend.attend(q_nope, q_pe, kv_b, cache, md, scale, V_DIM)
    ref = torch_backend.attend(q_nope, q_pe, kv_b, cache, md, scale, V_DIM)
    err = (out.float() - ref.float()).abs().max().item()
    t_attend = do_bench(lambda: triton_backend.attend(q_nope, q_pe, kv_b, cache, md, scale, V_DIM),
                        rep=rep, return_mode="median") * 1e3
    t_torch = do_bench(lambda: torch_backend.attend(q_nope, q_pe, kv_b, cache, md, scale, V_DIM),
                       rep=rep, return_mode="median") * 1e3

    q_lat = torch.randn(batch * q_len, heads, RANK, device=DEVICE).bfloat16() * 0.05
    o_lat = torch.empty_like(q_lat)
    num_bytes = batch * context * (RANK + ROPE) * 2
    layers = [cache] + [cache.clone() for _ in range(min(26, L2_OUTSIZE // num_bytes))]

    def kernel(layer_cache, config=None):
        mla_attention_triton(q_lat, q_pe, layer_cache, md.block_table, md.seq_lens, md.query_start_loc,
                             q_len, scale, o_lat, config=config)

    def graph_time(config=None) -> float:
        return do_bench_cudagraph(lambda: [kernel(c, config) for c in layers], rep=rep,
                                  return_mode="median") * 1e3 / len(layers)

    t_graph = graph_time()
    row = dict(model=model, heads=heads, batch=batch, context=context, q_len=q_len,
               default_config=mla_launch_config(heads, q_len, cache.dtype),
               triton_attend_us=t_attend, torch_attend_us=t_torch, kernel_graph_us=t_graph,
               kernel_gb_per_s=num_bytes / (t_graph * 1e-6) / 1e9, layer_copies=len(layers),
               max_abs_err_vs_torch=err)
    if sweep:
        timings = []
        for config in MLA_SWEEP:
            try:
                timings.append((graph_time(config), config))
            except Exception as error:  # a config that does not compile or fit: skip it
                print(f"  skip {config}: {type(error).__name__}", flush=True)
        best_t, best = min(timings, key=lambda x: x[0])
        row.update(best_kernel_graph_us=best_t, best_config=best,
                   sweep=[dict(config=c, us=t) for t, c in timings])
    layers.clear()
    return row


def moe_case(num_tokens: int):
    """x [T, H], gate_up [E + S, 2I, H], down [E + S, H, I], weights / ids [T, top_k + S] bf16
    at the MOE shapes: top_k distinct routed experts per token, then the S shared ones."""
    e, k, h, i, s = MOE["num_experts"], MOE["top_k"], MOE["hidden"], MOE["inter"], MOE["num_shared"]
    torch.manual_seed(0)
    x = torch.randn(num_tokens, h, device=DEVICE).bfloat16()
    gate_up = (torch.randn(e + s, 2 * i, h, device=DEVICE) / h**0.5).bfloat16()
    down = (torch.randn(e + s, h, i, device=DEVICE) / i**0.5).bfloat16()
    ids = torch.rand(num_tokens, e, device=DEVICE).topk(k, dim=-1).indices
    ids = torch.cat([ids, torch.arange(e, e + s, device=DEVICE).expand(num_tokens, s)], dim=1)
    weights = torch.cat([torch.rand(num_tokens, k, device=DEVICE), torch.ones(num_tokens, s, device=DEVICE)], dim=1)
    return x, gate_up, down, weights, ids


def expert_bytes(ids: torch.Tensor) -> tuple[int, int]:
    """(experts used, bytes of their weights): what a step must read at least."""
    used = ids.unique().numel()
    return used, used * 3 * MOE["hidden"] * MOE["inter"] * 2


def bench_moe(num_tokens: int, rep: int, sweep: bool) -> dict:
    """The grouped path (align, two grouped GEMMs, combine), forced at every token count."""
    from triton.testing import do_bench, do_bench_cudagraph

    from foretell.ops.moe.triton_experts import fused_experts_triton, moe_launch_config

    x, gate_up, down, weights, ids = moe_case(num_tokens)
    used, num_bytes = expert_bytes(ids)

    def grouped(config=None):
        return fused_experts_triton(x, gate_up, down, weights, ids, config=config, path="grouped")

    ref = experts_forward_torch(x, gate_up, down, weights, ids)
    err = (grouped() - ref).abs().max().item()
    t_eager = do_bench(grouped, rep=rep, return_mode="median") * 1e3
    t_torch = do_bench(lambda: experts_forward_torch(x, gate_up, down, weights, ids), rep=rep,
                       return_mode="median") * 1e3

    def graph_time(config=None) -> float:
        return do_bench_cudagraph(lambda: grouped(config), rep=rep, return_mode="median") * 1e3

    t_graph = graph_time()
    row = dict(num_tokens=num_tokens, experts_used=used,
               default_config=moe_launch_config(ids.numel(), gate_up.shape[0], x.dtype),
               fused_eager_us=t_eager, fused_graph_us=t_graph, torch_us=t_torch,
               graph_gb_per_s=num_bytes / (t_graph * 1e-6) / 1e9, max_abs_err_vs_torch=err)
    if sweep:
        best_t, best, timings = sweep_configs(graph_time, MOE_SWEEP)
        row.update(best_graph_us=best_t, best_config=best, sweep=timings)
    return row


def sweep_configs(graph_time, configs, wrap=lambda c: c) -> tuple[float, dict, list[dict]]:
    """(best us, its config, every timing) of graph_time(wrap(config)) over configs; a config that
    does not compile or fit is skipped."""
    timings = []
    for config in configs:
        try:
            timings.append(dict(config=config, us=graph_time(wrap(config))))
        except Exception as error:
            print(f"  skip {config}: {type(error).__name__}", flush=True)
    best = min(timings, key=lambda r: r["us"])
    return best["us"], best["config"], timings


def bench_moe_gemv(num_tokens: int, rep: int, sweep: bool) -> dict:
    """The GEMV path against the grouped one (both graph-timed), and a sweep of the GEMV tiles:
    each kernel's configs with the other kernel at its default, then the two best together."""
    from triton.testing import do_bench, do_bench_cudagraph

    from foretell.ops.moe.triton_gemv import gemv_launch_config
    from foretell.ops.moe.triton_experts import fused_experts_triton

    x, gate_up, down, weights, ids = moe_case(num_tokens)
    used, num_bytes = expert_bytes(ids)

    def run(path, config=None):
        return fused_experts_triton(x, gate_up, down, weights, ids, config=config, path=path)

    def graph_time(path, config=None) -> float:
        return do_bench_cudagraph(lambda: run(path, config), rep=rep, return_mode="median") * 1e3

    ref = experts_forward_torch(x, gate_up, down, weights, ids)
    t_grouped, t_gemv = graph_time("grouped"), graph_time("gemv")
    row = dict(num_tokens=num_tokens, slots=ids.shape[1], experts_used=used,
               default_config=gemv_launch_config(num_tokens, ids.shape[1], x.dtype),
               grouped_graph_us=t_grouped, gemv_graph_us=t_gemv,
               gemv_eager_us=do_bench(lambda: run("gemv"), rep=rep, return_mode="median") * 1e3,
               gemv_gb_per_s=num_bytes / (t_gemv * 1e-6) / 1e9,
               gemv_max_abs_err_vs_torch=(run("gemv") - ref).abs().max().item(),
               gemv_max_abs_diff_vs_grouped=(run("gemv") - run("grouped")).abs().max().item())
    if sweep:
        _, up_best, up_sweep = sweep_configs(lambda c: graph_time("gemv", c), GEMV_SWEEP_GATE_UP,
                                             lambda c: {"gate_up": c})
        _, down_best, down_sweep = sweep_configs(lambda c: graph_time("gemv", c), GEMV_SWEEP_DOWN,
                                                 lambda c: {"down": c})
        best = {"gate_up": up_best, "down": down_best}
        row.update(gemv_best_graph_us=graph_time("gemv", best), best_config=best,
                   sweep_gate_up=up_sweep, sweep_down=down_sweep)
    return row


def print_gemv_rows(rows: list[dict]) -> None:
    header = (f"{'MoE GEMV':9} {'tokens':>6} {'slots':>5} {'experts':>7} {'grouped us':>10} {'gemv us':>8} "
              f"{'eager us':>8} {'GB/s':>6} {'best us':>8} {'max err':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{'':9} {r['num_tokens']:>6} {r['slots']:>5} {r['experts_used']:>7} {r['grouped_graph_us']:>10.1f} "
              f"{r['gemv_graph_us']:>8.1f} {r['gemv_eager_us']:>8.1f} {r['gemv_gb_per_s']:>6.0f} "
              f"{r.get('gemv_best_graph_us', float('nan')):>8.1f} {r['gemv_max_abs_err_vs_torch']:>8.1e}")
        if "best_config" in r:
            for name in ("gate_up", "down"):
                timings = ", ".join(f"{tuple(t['config'].values())}: {t['us']:.1f}" for t in r[f"sweep_{name}"])
                print(f"    {name} best {r['best_config'][name]}; {timings}")
    wins = 0
    for r in sorted(rows, key=lambda r: r["num_tokens"]):
        if min(r["gemv_graph_us"], r.get("gemv_best_graph_us", float("inf"))) >= r["grouped_graph_us"]:
            break
        wins = r["num_tokens"]
    print(f"GEMV path faster than grouped up to {wins} tokens (GEMV_MAX_TOKENS)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write bench_mla_moe.json into")
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timing, no sweeps")
    parser.add_argument("--moe-sweep", help="only the MoE, swept, at these comma-separated token counts")
    parser.add_argument("--moe-top-k", type=int, help="routed experts per token (V2-Lite: 6)")
    parser.add_argument("--moe-shared", type=int, default=0,
                        help="shared experts every token also goes through (V2-Lite: 2), packed after the routed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla_moe.py needs a CUDA device")
    import triton

    rep = 30 if args.quick else 100
    sweep = not args.quick
    if args.moe_top_k:
        MOE["top_k"] = args.moe_top_k
    MOE["num_shared"] = args.moe_shared
    if args.moe_sweep:
        rows = [bench_moe(int(t), rep=rep, sweep=True) for t in args.moe_sweep.split(",")]
        for r in rows:
            print(f"MoE grouped {r['num_tokens']} tokens: default {r['fused_graph_us']:.1f} us, best "
                  f"{r['best_graph_us']:.1f} us {r['best_config']}; "
                  + ", ".join(f"{tuple(c['config'].values())}: {c['us']:.1f}" for c in r["sweep"]), flush=True)
        gemv_rows = [bench_moe_gemv(t, rep=rep, sweep=True) for t in GEMV_TOKENS]
        print_gemv_rows(gemv_rows)
        write_result(args.out_dir, "bench_mla_moe", "moe_sweep",
                     {"moe_shapes": MOE, "moe": rows, "moe_gemv": gemv_rows})
        return
    print(f"{torch.cuda.get_device_name()}  bf16  torch {torch.__version__}  triton {triton.__version__}")
    mla_cases = [(m, b, c, 1) for m in MLA_MODELS for b in (1, 16, 64) for c in (1024, 4096)]
    mla_cases += [(m, b, 4096, 4) for m in MLA_MODELS for b in (1, 16)]
    if args.quick:
        mla_cases = [c for c in mla_cases if c[1] != 16]
    header = (f"{'MLA':8} {'batch':>5} {'ctx':>5} {'q':>2} {'attend us':>10} {'torch us':>10} "
              f"{'kernel graph us':>15} {'GB/s':>6} {'best us':>8} {'max err':>8}")
    print(header + "\n" + "-" * len(header))
    mla_rows = []
    for case in mla_cases:
        r = bench_mla(*case, rep=rep, sweep=sweep)
        mla_rows.append(r)
        print(f"{r['model']:8} {r['batch']:>5} {r['context']:>5} {r['q_len']:>2} {r['triton_attend_us']:>10.1f} "
              f"{r['torch_attend_us']:>10.1f} {r['kernel_graph_us']:>15.1f} {r['kernel_gb_per_s']:>6.0f} "
              f"{r.get('best_kernel_graph_us', float('nan')):>8.1f} {r['max_abs_err_vs_torch']:>8.1e}", flush=True)
        torch.cuda.empty_cache()

    header = (f"{'MoE grouped':11} {'tokens':>6} {'experts':>7} {'eager us':>9} {'graph us':>9} "
              f"{'torch us':>9} {'GB/s':>6} {'best us':>8} {'max err':>8}")
    print("\n" + header + "\n" + "-" * len(header))
    moe_rows = []
    for num_tokens in ((1, 64) if args.quick else (1, 16, 64, 512)):
        r = bench_moe(num_tokens, rep=rep, sweep=sweep)
        moe_rows.append(r)
        print(f"{'':11} {r['num_tokens']:>6} {r['experts_used']:>7} {r['fused_eager_us']:>9.1f} "
              f"{r['fused_graph_us']:>9.1f} {r['torch_us']:>9.1f} {r['graph_gb_per_s']:>6.0f} "
              f"{r.get('best_graph_us', float('nan')):>8.1f} {r['max_abs_err_vs_torch']:>8.1e}", flush=True)
        torch.cuda.empty_cache()
    gemv_rows = [bench_moe_gemv(t, rep=rep, sweep=sweep) for t in ((1, 4) if args.quick else GEMV_TOKENS)]
    print_gemv_rows(gemv_rows)

    write_result(args.out_dir, "bench_mla_moe", "mla_moe", {
        "dtype": "bf16",
        "mla_shapes": dict(kv_lora_rank=RANK, rope=ROPE, nope=NOPE, v_head_dim=V_DIM, block_size=BLOCK_SIZE,
                           heads=MLA_MODELS),
        "moe_shapes": MOE,
        "timing": "median of triton.testing.do_bench / do_bench_cudagraph, microseconds",
        "mla": mla_rows, "moe": moe_rows, "moe_gemv": gemv_rows,
    })


if __name__ == "__main__":
    main()
