"""Experiment: can programmatic dependent launch (PDL) hide the gaps of a batch-1 decode step?

A Llama-3.1-8B decode step at batch 1 is 32 layers of four weight-bound GEMVs (qkv, o, gate_up,
down) with small latency-bound kernels between them (norms, RoPE + KV write, attention), then the
lm_head. cuBLAS reads the weights at about 3.8 TB/s, but each kernel ramps up and drains on its own,
and the small kernels leave HBM idle. With PDL (Hopper's griddepcontrol, ops/common/pdl.py) a kernel
may start while the one before it still runs: it issues what does not depend on that kernel (loads
or an L2 prefetch of its own weights) and waits (`gdc_wait`) before it touches the activations.

This script builds that chain with stand-in norm and attention kernels at the real sizes, captures
it in a CUDA graph per variant and times the replays:
  cublas / cublas_pdl_small   F.linear + torch SiLU-mul; the small kernels plain or with PDL
  triton                      the GEMV below (16 x 512 tiles), no PDL
  triton_pdl_early_trigger    every kernel with PDL, each releasing the next at its start
  triton_pdl                  ... releasing the next once its reads are done
  triton_pdl_early_w          ... and loading its first weight tile before the wait
  triton_pdl_pfN              ... prefetching its first N KiB into L2 before the wait instead
  triton_byshape_*            two rows of W x all of K per program (2048 wide above K = 4096)
With --single, each shape alone too (8 GEMVs over distinct weights back to back in one graph), over
tile shapes, against cuBLAS. Variants with the same tiles must give the same output (PDL only moves
launches earlier): "same_as_triton" checks it. What the engine took from this: ops/gemm/triton_gemv.py;
the numbers: BENCHMARKS.md (seventh session).

    python scripts/bench_pdl_chain.py OUT_DIR [--layers 32] [--single]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from bench_result import graph_replay_ms, write_result

HIDDEN, Q_OUT, INTER, VOCAB = 4096, 6144, 14336, 128256


@triton.jit
def _prefetch_l2(ptrs, sizes):
    """cp.async.bulk.prefetch.L2: bring sizes[i] bytes from ptrs[i] into L2 (sm_90; 16-byte units)."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH_CHUNKS: tl.constexpr, CHUNK_BYTES: tl.constexpr,
                 LATE_TRIGGER: tl.constexpr, EARLY_W: tl.constexpr):
    pid = tl.program_id(0)
    if PREFETCH_CHUNKS > 0:  # this program's rows are one contiguous span of BLOCK_N * K elements
        span = w_ptr + pid.to(tl.int64) * BLOCK_N * K
        chunks = tl.arange(0, PREFETCH_CHUNKS)
        _prefetch_l2(span + chunks * (CHUNK_BYTES // 2), tl.full([PREFETCH_CHUNKS], CHUNK_BYTES, tl.int32))
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    lanes = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows[:, None].to(tl.int64) * K + lanes[None, :]  # [BLOCK_N, BLOCK_K] at k = 0
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    k_start = 0
    if EARLY_W:  # the first weight tile does not depend on the previous kernel: load it before the wait
        w0 = tl.load(w_tile, eviction_policy="evict_first")
        k_start = BLOCK_K
    if PDL:
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()
    if EARLY_W:
        acc += w0.to(tl.float32) * _gemv_input(x_ptr, K, lanes, SILU_MUL)[None, :]
    for k0 in range(k_start, K, BLOCK_K):
        w = tl.load(w_tile + k0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * _gemv_input(x_ptr, K, k0 + lanes, SILU_MUL)[None, :]
    if PDL and LATE_TRIGGER:  # the next kernel launches during this one's last wave, not its first
        gdc_launch_dependents()
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


@triton.jit
def _gemv_input(x_ptr, K, cols, SILU_MUL: tl.constexpr):
    if SILU_MUL:  # x is [2K]: gate then up
        g = tl.load(x_ptr + cols).to(tl.float32)
        u = tl.load(x_ptr + K + cols).to(tl.float32)
        x = (g * tl.sigmoid(g)).to(x_ptr.dtype.element_ty).to(tl.float32) * u
    else:
        x = tl.load(x_ptr + cols).to(tl.float32)
    return x


@triton.jit
def _norm_kernel(x_ptr, res_ptr, out_ptr, N: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr):
    """RMSNorm stand-in (one program): out = norm(x (+ res))."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.float32)
    if ADD:
        x += tl.load(res_ptr + offs).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x) / N + 1e-6)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _attn_kernel(qkv_ptr, kv_ptr, out_ptr, ROWS: tl.constexpr, HEAD: tl.constexpr, PDL: tl.constexpr):
    """Attention stand-in: program p reads ROWS x HEAD cache elements and q's head p // 2."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    p = tl.program_id(0)
    d = tl.arange(0, HEAD)
    q = tl.load(qkv_ptr + (p // 2) * HEAD + d).to(tl.float32)
    kv = tl.load(kv_ptr + p * ROWS * HEAD + tl.arange(0, ROWS)[:, None] * HEAD + d[None, :]).to(tl.float32)
    s = tl.sum(kv * q[None, :], axis=1)  # [ROWS]
    o = tl.sum(kv * s[:, None], axis=0)
    tl.atomic_add(out_ptr + (p // 2) * HEAD + d, o * 1e-6 + q * 0.5)


class Chain:
    def __init__(self, layers: int, device: str):
        g = torch.Generator(device).manual_seed(0)

        def w(n, k):
            return (torch.randn(n, k, generator=g, device=device, dtype=torch.bfloat16) * 0.02)

        self.layers = [dict(qkv=w(Q_OUT, HIDDEN), o=w(HIDDEN, HIDDEN), gate_up=w(2 * INTER, HIDDEN),
                            down=w(HIDDEN, INTER)) for _ in range(layers)]
        self.lm_head = w(VOCAB, HIDDEN)
        self.kv = torch.randn(layers, 32 * 256 * 128, generator=g, device=device, dtype=torch.bfloat16)
        self.x = torch.randn(HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
        self.bytes = sum(t.numel() * 2 for layer in self.layers for t in layer.values()) + self.lm_head.numel() * 2

    def run(self, gemv, pdl: bool):
        h = self.x
        res = torch.zeros_like(h)
        for i, layer in enumerate(self.layers):
            n1 = torch.empty_like(h)
            _norm_kernel[(1,)](h, res, n1, N=HIDDEN, ADD=True, PDL=pdl, launch_pdl=pdl)
            res = h
            qkv = gemv(n1, layer["qkv"], False)
            a = torch.zeros(HIDDEN, device=h.device, dtype=torch.float32)
            _attn_kernel[(64,)](qkv, self.kv[i], a, ROWS=64, HEAD=128, PDL=pdl, launch_pdl=pdl)
            a = a.to(h.dtype)
            o = gemv(a, layer["o"], False)
            n2 = torch.empty_like(h)
            _norm_kernel[(1,)](o, res, n2, N=HIDDEN, ADD=True, PDL=pdl, launch_pdl=pdl)
            res = o
            gu = gemv(n2, layer["gate_up"], False)
            h = gemv(gu, layer["down"], True)
        n = torch.empty_like(h)
        _norm_kernel[(1,)](h, res, n, N=HIDDEN, ADD=True, PDL=pdl, launch_pdl=pdl)
        return gemv(n, self.lm_head, False)


def cublas_gemv(x, w, silu_mul):
    if silu_mul:
        g, u = x.chunk(2)
        x = F.silu(g) * u
    return F.linear(x[None], w)[0]


def triton_gemv(block_n=16, block_k=512, warps=4, pdl=False, prefetch_kib=0, late=True, stages=1, early_w=False):
    """block_n None: tiles by shape (2 rows x all of K for K <= 4096, else 4 x 1024)."""
    chunk = 4096

    def call(x, w, silu_mul):
        n, k = w.shape
        bn, bk = (block_n, block_k) if block_n else ((2, k) if k <= 4096 else (4, 1024))
        out = torch.empty(n, device=x.device, dtype=x.dtype)
        span = bn * k * 2
        chunks = min(prefetch_kib * 1024, span) // chunk
        chunks = 1 << (chunks.bit_length() - 1) if chunks else 0  # a power of two for tl.arange
        _gemv_kernel[(n // bn,)](x, w, out, k, BLOCK_N=bn, BLOCK_K=bk, SILU_MUL=silu_mul,
                                 PDL=pdl, PREFETCH_CHUNKS=chunks, CHUNK_BYTES=chunk, LATE_TRIGGER=late,
                                 EARLY_W=early_w, num_warps=warps, num_stages=stages, launch_pdl=pdl)
        return out
    return call


def graph_ms(fn):
    ms, out = graph_replay_ms(fn)
    return ms, out.clone()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--single", action="store_true", help="also time each shape alone, over tile shapes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = {}
    torch.manual_seed(0)
    # 1. each shape alone: 8 GEMVs over distinct weights back to back in one graph (no L2 reuse),
    # time per GEMV; cuBLAS against tile shapes, plain and with PDL
    shapes = {"qkv": (Q_OUT, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}
    tiles = [(16, 512, 4, 1), (8, 512, 4, 1), (4, 4096, 8, 1), (2, 4096, 4, 1), (4, 2048, 4, 1),
             (2, 2048, 4, 1), (8, 1024, 4, 1), (4, 1024, 4, 1), (16, 512, 4, 3), (8, 256, 2, 1)]
    single = {}
    for name, (n, k) in (shapes.items() if args.single else ()):
        count = 2 if name == "lm_head" else 8
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        ref = cublas_gemv(x, ws[0], False).float()

        def seq(gemv):
            y = None
            for w in ws:
                y = gemv(x, w, False)
            return y
        row = {"cublas": 1000 * graph_ms(lambda: seq(cublas_gemv))[0] / count}
        for bn, bk, warps, stages in tiles:
            if n % bn or k % bk:
                continue
            for pdl, early in ((False, False), (True, False), (True, True)):
                tag = f"bn{bn}_bk{bk}_w{warps}_s{stages}" + ("_pdl" if pdl else "") + ("_early_w" if early else "")
                fn = triton_gemv(bn, bk, warps, pdl=pdl, stages=stages, early_w=early)
                try:
                    err = (fn(x, ws[0], False).float() - ref).abs().max().item()
                    row[tag] = round(1000 * graph_ms(lambda: seq(fn))[0] / count, 2)
                except Exception as e:  # noqa: BLE001
                    row[tag] = f"{type(e).__name__}: {e}"[:200]
                    continue
                if err > 0.05:
                    row[tag + "_err"] = err
        row["ideal_us_at_4.3TB/s"] = n * k * 2 / 4.3e12 * 1e6
        single[name] = row
        print(name, {k_: (round(v, 2) if isinstance(v, float) else v) for k_, v in row.items()}, flush=True)
        ws.clear()  # this shape's weights
    result["single"] = single
    # 2. the chain
    chain = Chain(args.layers, "cuda")
    result["chain_bytes"] = chain.bytes
    result["ideal_ms_at_4.3TB/s"] = chain.bytes / 4.3e12 * 1e3
    variants = {
        "cublas": (cublas_gemv, False),
        "cublas_pdl_small": (cublas_gemv, True),
        "triton": (triton_gemv(), False),
        "triton_pdl_early_trigger": (triton_gemv(pdl=True, late=False), True),
        "triton_pdl": (triton_gemv(pdl=True), True),
        "triton_pdl_early_w": (triton_gemv(pdl=True, early_w=True), True),
        "triton_pdl_pf8": (triton_gemv(pdl=True, prefetch_kib=8), True),
        "triton_pdl_pf128": (triton_gemv(pdl=True, prefetch_kib=128), True),
        "triton_byshape": (triton_gemv(None), False),
        "triton_byshape_pdl": (triton_gemv(None, pdl=True), True),
        "triton_byshape_pdl_early_w": (triton_gemv(None, pdl=True, early_w=True), True),
        "triton_byshape_pdl_early_w_w8": (triton_gemv(None, warps=8, pdl=True, early_w=True), True),
    }
    outputs, chain_ms = {}, {}
    for name, (gemv, pdl) in variants.items():
        try:
            ms, out = graph_ms(lambda: chain.run(gemv, pdl))
        except Exception as e:  # noqa: BLE001 (report and go on)
            chain_ms[name] = f"{type(e).__name__}: {e}"[:400]
            print(name, chain_ms[name], flush=True)
            continue
        chain_ms[name] = ms
        outputs[name] = out
        print(f"{name}: {ms:.3f} ms", flush=True)
    base = outputs.get("triton")
    result["same_as_triton"] = {n: bool(torch.equal(o, base)) for n, o in outputs.items()} if base is not None else {}
    if "cublas" in outputs and base is not None:
        result["triton_vs_cublas_max_rel"] = ((outputs["cublas"].float() - base.float()).abs().max()
                                              / base.float().abs().max()).item()
    result["chain_ms"] = chain_ms
    write_result(args.out, "bench_pdl_chain", "pdl_chain", result)
    print(json.dumps({k: v for k, v in result.items() if k != "single"}, indent=1))


if __name__ == "__main__":
    main()
