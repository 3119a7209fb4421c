"""Time the Triton paged attention kernel against the torch backend and torch's SDPA on CUDA.

Llama-3.1-8B shapes (32 query heads, 8 kv heads, head_dim 128, block 16): decode (1 query token)
and verify (4 query tokens) at batch 1/16/64 and context 1k/4k, plus a batch-1 prefill. Timings
are medians of triton.testing.do_bench (which flushes L2 between runs, as a real step across
layers would see, and includes the host launch cost). The "graph" column replays launches inside
a CUDA graph (do_bench_cudagraph, no launch cost); since that does not flush L2, it cycles over
enough copies of the cache (one per "layer", up to 32) to outsize L2, and reports time per copy.
GB/s is K/V + query + output bytes over the graph time.
SDPA reads a dense, unpaged K/V (its best case; verify needs an explicit bottom-right mask).

    python scripts/bench_attention.py OUT_DIR [--dtype bf16] [--quick]

Prints a table and writes OUT_DIR/bench_attention.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_result import write_result  # noqa: E402
from foretell.ops.attention.metadata import AttentionMetadata  # noqa: E402
from foretell.ops.attention.reference import TorchAttentionBackend  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"
L2_OUTSIZE = 256 * 2**20  # bytes of distinct caches to cycle through (H200 L2 is 50 MiB)


def build_case(batch: int, context: int, q_len: int, dtype: torch.dtype):
    """A paged batch whose sequences each hold `context` tokens, the last q_len of them new."""
    device = torch.device(DEVICE)
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    # Scattered blocks, as a long-running server's allocator would hand them out.
    table = torch.randperm(num_blocks, device=device, dtype=torch.int64).to(torch.int32)
    table = table.view(batch, blocks_per_seq)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=device)
    cache = cache.to(dtype)
    query = torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, device=device).to(dtype)
    starts = [i * q_len for i in range(batch + 1)]
    lens = [context] * batch
    metadata = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_table=table,
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device=device),
        block_size=BLOCK_SIZE,
        max_query_len=q_len,
        max_seq_len=context,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )
    return query, cache, metadata


def dense_kv(cache: torch.Tensor, metadata: AttentionMetadata):
    """The paged context copied out to [batch, kv_heads, context, head_dim] for SDPA."""
    context = metadata.max_seq_len
    idx = metadata.block_table.long()  # [batch, blocks]
    k = cache[0][idx].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = cache[1][idx].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    return k, v  # [batch, kv_heads, context, head_dim]


def sdpa_fn(query, cache, metadata, scale):
    batch, q_len, context = metadata.num_seqs, metadata.max_query_len, metadata.max_seq_len
    k, v = dense_kv(cache, metadata)
    q = query.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    if q_len == context:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                      enable_gqa=True)
    mask = None
    if q_len > 1:
        key_pos = torch.arange(context, device=query.device)
        query_pos = torch.arange(context - q_len, context, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, context], bottom-right causal
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=True)


def kv_bytes(batch: int, context: int, q_len: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elem
    return kv + 2 * batch * q_len * NUM_HEADS * HEAD_DIM * elem  # + query in, out


def bench_case(kind: str, batch: int, context: int, q_len: int, dtype: torch.dtype,
               rep: int) -> dict:
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from foretell.ops.attention.triton_paged import (
        _choose_num_splits,
        _launch_config,
        paged_attention_triton,
    )

    torch.manual_seed(0)
    query, cache, md = build_case(batch, context, q_len, dtype)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(query)

    def run_triton(layer_cache=cache, num_splits=None):
        return paged_attention_triton(query, layer_cache, md.block_table, md.seq_lens,
                                      md.query_start_loc, md.max_query_len, scale, out,
                                      num_splits=num_splits)

    config = _launch_config(NUM_HEADS // NUM_KV_HEADS, HEAD_DIM, q_len, cache.dtype)
    splits = _choose_num_splits(
        query.device,
        active_programs=batch * triton.cdiv(q_len, config["BLOCK_Q"]) * NUM_KV_HEADS,
        max_context=md.block_table.shape[1] * BLOCK_SIZE,
        max_query_len=q_len,
        tile_n=config["TILE_N"],
    )
    torch_backend = TorchAttentionBackend()
    reference = torch_backend.attend(query, cache, md, scale)
    err = (run_triton().float() - reference.float()).abs().max().item()
    t_triton = do_bench(run_triton, rep=rep, return_mode="median") * 1e3
    t_nosplit = (do_bench(lambda: run_triton(num_splits=1), rep=rep, return_mode="median") * 1e3
                 if splits > 1 else t_triton)

    num_bytes = kv_bytes(batch, context, q_len, dtype)
    layers = [cache] + [cache.clone() for _ in range(min(31, L2_OUTSIZE // num_bytes))]

    def run_layers():
        for layer_cache in layers:
            run_triton(layer_cache)

    t_graph = do_bench_cudagraph(run_layers, rep=rep, return_mode="median") * 1e3 / len(layers)
    num_layers = len(layers)
    layers.clear()
    t_torch = do_bench(lambda: torch_backend.attend(query, cache, md, scale), rep=rep,
                       return_mode="median") * 1e3
    t_sdpa = do_bench(sdpa_fn(query, cache, md, scale), rep=rep, return_mode="median") * 1e3
    return dict(kind=kind, batch=batch, context=context, q_len=q_len, num_splits=splits,
                triton_us=t_triton, triton_graph_us=t_graph, graph_cache_copies=num_layers,
                triton_no_split_us=t_nosplit, torch_backend_us=t_torch, sdpa_dense_us=t_sdpa,
                triton_graph_gb_per_s=num_bytes / (t_graph * 1e-6) / 1e9,
                max_abs_err_vs_torch=err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="folder to write bench_attention.json into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--quick", action="store_true", help="fewer cases, shorter timing")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA device")
    import triton

    dtype = DTYPES[args.dtype]
    rep = 30 if args.quick else 100
    cases = [("decode", b, c, 1) for b in (1, 16, 64) for c in (1024, 4096)]
    cases += [("verify", b, c, 4) for b in (1, 16, 64) for c in (1024, 4096)]
    cases += [("prefill", 1, c, c) for c in (1024, 4096)]
    if args.quick:
        cases = [c for c in cases if c[1] != 16]
    header = (f"{'case':8} {'batch':>5} {'ctx':>5} {'q':>4} {'splits':>6} {'triton us':>10} "
              f"{'graph us':>9} {'no-split':>9} {'torch us':>10} {'sdpa us':>9} {'GB/s':>7} "
              f"{'max err':>8}")
    print(f"{torch.cuda.get_device_name()}  {args.dtype}  torch {torch.__version__}  "
          f"triton {triton.__version__}")
    print(header)
    print("-" * len(header))
    rows = []
    for case in cases:
        r = bench_case(*case, dtype=dtype, rep=rep)
        rows.append(r)
        print(f"{r['kind']:8} {r['batch']:>5} {r['context']:>5} {r['q_len']:>4} "
              f"{r['num_splits']:>6} {r['triton_us']:>10.1f} {r['triton_graph_us']:>9.1f} "
              f"{r['triton_no_split_us']:>9.1f} {r['torch_backend_us']:>10.1f} "
              f"{r['sdpa_dense_us']:>9.1f} {r['triton_graph_gb_per_s']:>7.0f} "
              f"{r['max_abs_err_vs_torch']:>8.1e}", flush=True)
        torch.cuda.empty_cache()

    write_result(args.out_dir, "bench_attention", "attention", {
        "dtype": args.dtype,
        "shapes": dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       block_size=BLOCK_SIZE),
        "timing": "median of triton.testing.do_bench / do_bench_cudagraph, microseconds",
        "rows": rows,
    })


if __name__ == "__main__":
    main()
