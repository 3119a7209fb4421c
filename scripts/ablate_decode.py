"""What each kind of kernel costs inside a captured batch-1 decode (and verify) forward: capture the
target's forward again with one kind of kernel taken out, and time the replay against the full one.

With programmatic dependent launch (ops/common/pdl.py) kernels overlap, so a profiler's per-kernel
times no longer add up to the step; taking a kernel out and timing the graph does. The variants
replace a module's forward by an allocation of its output (no launch, garbage values: the timings
are all this is for):

    full          the forward as the engine captures it
    no_norms      RMSNorm (with its fused residual add) returns its input
    no_rope_kv    two launches (RoPE + KV write, attention), the first returning the query unrotated
    no_attend     two launches, the paged attention returning an empty output
    no_attention  RoPE, KV write and attention (one launch for decode/verify) return an empty output
    no_lm_head    the LM head returns empty logits
    linears_only  no norms, no attention, no RoPE: the weight reads and the glue between them
    no_linears    every Linear returns an empty output: the rest of the chain alone

and alternatives (same results, other launches):

    attn_unsplit / attn_split64 / attn_split128   the attention's context not split, or split in
                  pieces of at least 64 / 128 tokens (the engine's default: 32)
    no_pdl_glue   norms, RoPE + KV write and attention launched plainly (no PDL)
    two_launch_rope  RoPE + KV write, then the attention: two launches (the engine fuses them for
                  decode and verify: ops/attention/triton_rope_paged.py)
    attn_*        (with the two launches)
    norm_warps4 / norm_warps8   the norms (with their residual add) on 4 / 8 warps (the engine's: 16
                  for a 4096-wide row)
    <layer>_<kernel>  that layer's linears (qkv, o, gate_up, down, lm_head) on another kernel than
                  the engine's choice: cublas, gemv, mma (its default tiles), mma_split1/2/4

    python scripts/ablate_decode.py OUT_DIR [--model foretell/configs/llama-3.1-8b] [--context 256]
        [--variants full no_attention ...] [--alternative-rows 1 4] [--draft-alternatives]

--draft-alternatives does the same for the EAGLE3 head's own linears (fc, qkv at 4 and 1 rows, its
LM head), timing the draft loop captured afresh ("draft_loop" columns).

Llama-3.1-8B shape with random bf16 weights (load_format dummy), batch 1, query lengths 1 and 4
(the EAGLE3 k = 3 verify), plus the EAGLE3 draft loop graph as the engine captured it.
Writes OUT_DIR/ablate_decode.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from bench_result import graph_replay_ms, replay_ms, write_result  # noqa: E402
from foretell import LLM  # noqa: E402
from foretell.ops.attention import triton_paged, triton_rope_kv, triton_rope_paged  # noqa: E402
from foretell.ops.gemm import triton_gemv, triton_mma  # noqa: E402
from foretell.ops.pointwise import triton_paged as pointwise_kernels  # noqa: E402
from foretell.ops.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from foretell.layers.embedding import LMHead  # noqa: E402
from foretell.layers.linear import Linear, MergedLinear  # noqa: E402
from foretell.layers.norm import RMSNorm  # noqa: E402
from foretell.ops.gemm.dispatch import GemmKey  # noqa: E402

CONFIGS = os.path.join(ROOT, "foretell", "configs")


def _norm_passthrough(self, x, residual=None):
    return x, x if residual is None else residual


def _rope_kv_passthrough(positions, query, *args, **kwargs):
    return query


def _rope_attend_empty(self, positions, query, *args, **kwargs):
    return torch.empty_like(query)


def _attend_empty(self, query, kv_cache, metadata, scale):
    return torch.empty_like(query)


def _linear_empty(self, x):
    return x.new_empty(*x.shape[:-1], self.output_size)


def _gated_empty(self, x):
    return x.new_empty(*x.shape[:-1], self.output_size // 2)


def _warps_at_most(cap: int):
    engine_warps = pointwise_kernels._num_warps
    return lambda tile_elements: min(cap, engine_warps(tile_elements))


def _attend_with(**split):
    def attend(self, query, kv_cache, metadata, scale):
        from foretell.ops.attention.triton_paged import paged_attention_triton

        return paged_attention_triton(query, kv_cache, metadata.block_table, metadata.seq_lens,
                                      metadata.query_start_loc, metadata.max_query_len, scale,
                                      torch.empty_like(query), counters=self.split_counters, **split)
    return attend


def _lm_head_empty(self, hidden):
    return torch.empty(*hidden.shape[:-1], self.vocab_size, dtype=torch.float32, device=hidden.device)


TWO_LAUNCHES = (triton_rope_paged, "fits", lambda *args: False)  # RoPE + KV write, then the attention
PATCHES = {
    "norms": [(RMSNorm, "forward", _norm_passthrough)],
    "two_launches": [TWO_LAUNCHES],
    "rope_kv": [TWO_LAUNCHES, (triton_rope_kv, "rope_write_kv_triton", _rope_kv_passthrough)],
    "attend": [TWO_LAUNCHES, (TritonAttentionBackend, "attend", _attend_empty)],
    "attention": [(TritonAttentionBackend, "rope_attend", _rope_attend_empty)],
    "lm_head": [(LMHead, "forward", _lm_head_empty)],
    "no_pdl_glue": [(module, "pdl_enabled", lambda t: False) for module in (pointwise_kernels, triton_rope_kv,
                                                                            triton_paged, triton_rope_paged)],
    "attn_unsplit": [TWO_LAUNCHES, (TritonAttentionBackend, "attend", _attend_with(num_splits=1))],
    "attn_split64": [TWO_LAUNCHES, (TritonAttentionBackend, "attend", _attend_with(min_split_tokens=64))],
    "attn_split128": [TWO_LAUNCHES, (TritonAttentionBackend, "attend", _attend_with(min_split_tokens=128))],
    "linears": [(Linear, "forward", _linear_empty), (MergedLinear, "forward_gated", _gated_empty),
                (LMHead, "forward", _lm_head_empty)],
    "norm_warps4": [(pointwise_kernels, "_num_warps", _warps_at_most(4))],
    "norm_warps8": [(pointwise_kernels, "_num_warps", _warps_at_most(8))],
}
VARIANTS = {
    "full": [],
    "no_norms": ["norms"],
    "no_rope_kv": ["rope_kv"],
    "no_attend": ["attend"],
    "no_attention": ["attention"],
    "no_lm_head": ["lm_head"],
    "linears_only": ["norms", "attention"],
    "no_linears": ["linears"],
    "no_pdl_glue": ["no_pdl_glue"],
    "two_launch_rope": ["two_launches"],
    "attn_unsplit": ["attn_unsplit"],
    "attn_split64": ["attn_split64"],
    "attn_split128": ["attn_split128"],
    "norm_warps4": ["norm_warps4"],
    "norm_warps8": ["norm_warps8"],
}
LLAMA_SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                "lm_head": (128256, 4096)}
# The Llama-8B EAGLE3 head's own linears (rows, N, K): the catch-up's 4-row fc and qkv, a chained
# step's 1-row qkv, the 32000-word LM head (its o, gate_up and down share the target's shapes).
EAGLE3_DRAFT_SHAPES = {"draft_fc": (4, 4096, 12288), "draft_qkv4": (4, 6144, 8192), "draft_qkv1": (1, 6144, 8192),
                       "draft_lm_head": (1, 32000, 4096)}


def alternatives(current, m: int, n: int, k: int, mma_sweep: bool = False) -> dict:
    """Other ways to run a layer's linears than the engine's choice `current` (mma_sweep: every
    MMA tile width x split x pipeline depth as well)."""
    device = torch.device("cuda")
    mma = triton_mma.pick_config(m, n, k, device)
    other = {"cublas": None}
    if mma_sweep:  # tile widths x splits x depths, then narrower and wider tiles than 64 rows of W
        for block_k in (64, 128, 256):
            for split in (1, 2, 4, 8):
                for stages in (2, 3, 4):
                    other[f"mma_bk{block_k}_split{split}_s{stages}"] = triton_mma.MmaConfig(block_k, split, stages)
        _, smem = triton_mma.device_limits(device)
        for block_n, block_k, split, warps in ((16, 256, 1, 4), (16, 256, 2, 4), (32, 256, 1, 4), (32, 256, 2, 4),
                                               (32, 128, 4, 4), (128, 128, 1, 8), (128, 128, 2, 8)):
            stages = triton_mma._stages_that_fit(block_n, block_k, smem)
            other[f"mma_bn{block_n}_bk{block_k}_split{split}_w{warps}"] = triton_mma.MmaConfig(
                block_k, split, stages, block_n, warps)
    if m == 1:  # the GEMV's default, then other tiles: rows of W per program x columns per tile
        other["gemv"] = triton_gemv.pick_config(1, n, k)
        whole = 1 << (k - 1).bit_length()
        for rows, width in ((1, whole), (2, whole), (4, whole), (8, whole), (4, 2048), (1, 8192)):
            warps = max(4, min(16, rows * width // (32 * 64)))  # about 64 weights a thread
            other[f"gemv_{rows}x{width}"] = triton_gemv.SmallMConfig(1, rows, min(width, whole), warps)
    other["mma"] = mma
    for split in (1, 2, 4):
        other[f"mma_split{split}"] = triton_mma.MmaConfig(128, split, 4)
    seen = [current]
    kept = {}
    for name, config in other.items():
        if config not in seen:
            seen.append(config)
            kept[name] = config
    return kept


@contextlib.contextmanager
def patched(groups: list[str]):
    with contextlib.ExitStack() as stack:
        for group in groups:
            for owner, name, replacement in PATCHES[group]:
                stack.enter_context(mock.patch.object(owner, name, replacement))
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--model", default=f"{CONFIGS}/llama-3.1-8b")
    parser.add_argument("--draft", default=f"{CONFIGS}/llama-3.1-8b-eagle3")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--alternative-rows", type=int, nargs="*", default=[1, 4],
                        help="query lengths whose layers are tried on other kernels (default 1 4)")
    parser.add_argument("--alternative-layers", nargs="*", default=list(LLAMA_SHAPES), choices=list(LLAMA_SHAPES),
                        help="which layers' linears are tried on other kernels (default all)")
    parser.add_argument("--mma-sweep", action="store_true",
                        help="at query lengths above 1, also try a grid of MMA tiles, splits and depths")
    parser.add_argument("--draft-alternatives", action="store_true",
                        help="also re-time the EAGLE3 draft loop with each of the head's own linears on other kernels")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                        help="which of the variants above to time (default all; full always runs first)")
    args = parser.parse_args()
    variants = ["full"] + [v for v in args.variants if v != "full"]
    if not torch.cuda.is_available():
        sys.exit("ablate_decode.py needs a CUDA device (it times CUDA graphs)")
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": 3,
            "simulate_acceptance": {"mean_acceptance_length": 2.93}}
    llm = LLM(args.model, dtype="bfloat16", device="cuda", load_format="dummy", skip_tokenizer_init=True,
              speculative_config=spec, log_stats_interval_s=0, max_num_seqs=1)
    runner = llm.engine.runner
    graphs = runner.graphs
    result = {"model": args.model, "context": args.context, "timing": "median ms of a graph replay", "rows": {}}
    with torch.inference_mode():
        for q in (1, 4):
            graphs.prepare_replay((1, q), args.context)
            for variant in variants:
                with patched(VARIANTS[variant]):
                    ms = graph_replay_ms(lambda: graphs._forward(1, q), reps=50)[0]
                result["rows"].setdefault(variant, {})[f"q{q}"] = ms
                full = result["rows"]["full"][f"q{q}"]
                print(f"q={q} {variant:13} {ms:7.3f} ms  ({full - ms:+.3f} ms removed)", flush=True)
        gemm = runner.small_m_gemm
        for q in args.alternative_rows:  # each layer's linears on another kernel (or cuBLAS), one kind at a time
            graphs.prepare_replay((1, q), args.context)
            for layer, (n, k) in LLAMA_SHAPES.items():
                if layer in args.alternative_layers:
                    time_alternatives(gemm, GemmKey(q, n, k, torch.bfloat16, False), layer, f"q{q}", result,
                                      lambda: graphs._forward(1, q), args.mma_sweep and q > 1)
        graphs.prepare_replay((1, 4), args.context)  # the state a draft loop after a 4-token verify reads
        result["draft_loop_ms"] = replay_ms(runner.draft_graphs.graphs[1].graph, reps=50)
        if args.draft_alternatives:  # the draft's own shapes, the loop captured afresh for each
            loop = lambda: runner.draft_graphs._loop(1)  # noqa: E731
            result["rows"]["full"]["draft_loop"] = graph_replay_ms(loop, reps=50)[0]
            for name, (m, n, k) in EAGLE3_DRAFT_SHAPES.items():
                time_alternatives(gemm, GemmKey(m, n, k, torch.bfloat16, False), name, "draft_loop", result, loop,
                                  args.mma_sweep and m > 1)
    print(f"EAGLE3 draft loop (catch-up + 2 chained steps) {result['draft_loop_ms']:.3f} ms")
    write_result(args.out_dir, "ablate_decode", "ablate_decode", result)


def time_alternatives(gemm, key: GemmKey, layer: str, column: str, result: dict, forward, mma_sweep: bool) -> None:
    """Re-time `forward` (captured afresh) with the linears of `key` on each alternative kernel in
    turn, into result["rows"][f"{layer}_{name}"][column] (against result["rows"]["full"][column])."""
    if gemm is None or key not in gemm.choices:
        print(f"{column} {layer}: no few-row kernel choice for {key}", flush=True)
        return
    full = result["rows"]["full"][column]
    for name, config in alternatives(gemm.choices[key], key.m_bucket, key.n, key.k, mma_sweep).items():
        kept, gemm.choices[key] = gemm.choices[key], config
        try:
            ms = graph_replay_ms(forward, reps=50)[0]
        except Exception as err:  # a config this device cannot run (shared memory, say): next
            print(f"{column} {layer + '_' + name:13} failed: {str(err).splitlines()[0][:200]}", flush=True)
            torch.cuda.synchronize()
            continue
        finally:
            gemm.choices[key] = kept
        result["rows"].setdefault(f"{layer}_{name}", {})[column] = ms
        print(f"{column} {layer + '_' + name:13} {ms:7.3f} ms  ({full - ms:+.3f} ms removed)", flush=True)


if __name__ == "__main__":
    main()
