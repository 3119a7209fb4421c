"""A packed int4 word's dot product with x in half-precision pairs: the int4 MoE GEMV's inner step
(triton_int4_gemv.py, launch option F16_DOT) in about two instructions a weight instead of five.

At one token the int4 GEMV is bound by the instructions it issues per weight, not by its bytes: the
float32 path (_nibble_pair) spends a shift, two logic ops and two float32 FMAs a nibble pair, plus
x's lanes moved into the tile's layout. Here each 32-bit word of 8 nibbles (column 8 j + i is
nibble i, stored as u = q + 8) is taken two nibbles at a time into f16x2 registers by the
"magic number" construction: (w & 0x000F000F) | 0x64006400 holds the f16 pair (1024 + u_0,
1024 + u_4) exactly, (w & 0x00F000F0) | 0x64006400 the pair (1024 + 16 u_1, 1024 + 16 u_5), and
the same on w >> 8 gives nibbles 2, 6 and 3, 7. One packed subtraction of (1032, 1032) or
(1152, 1152) leaves q or 16 q exactly (small integers), and four packed FMAs against x's f16 pairs
(x_0, x_4), (x_1 / 16, x_5 / 16), (x_2, x_6), (x_3 / 16, x_7 / 16) sum the word's 8 products into
one f16 pair, which is widened and added in float32: word_dot = sum_i q_i x_i.

Range and rounding: x is divided by a power of two per tile (x_scale: the tile's largest |x|
brought into [64, 128)), so no product or 4-term f16 sum can overflow (|16 q x / 16| <= 8 * 128,
four of them < 2^13) and every x at least 2^-20 of the tile's largest keeps its 11 significant
bits; the caller multiplies each word's dot by its group scale times x_scale in float32. Each
product is rounded to f16 (11 bits) and a word's four pair sums too: errors of the order of the
twin's own bf16 rounding of the dequantized weights (2^-9), so F16_DOT is for bf16 / fp16 models;
float32 models keep the float32 path.

On the GPU the word step is one inline PTX block per word (tl.inline_asm_elementwise); under
Triton's interpreter (CPU tests) the same arithmetic in f16 tensors: each product and sum rounded
to f16 as the packed instructions round them (the f16 FMA's single rounding taken as a product
then a sum, each rounded: the tests' tolerance covers the difference).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The interpreter cannot run inline PTX: kernels take the f16-tensor twin of the word step there.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

def _group_dot_ptx() -> str:
    """The PTX of one group's dot: operand 0 the float32 result, 1-4 the group's words, 5-20 x's f16
    pairs (word j's pairs at 5 + 4 j .. 8 + 4 j, in the order (0, 4), (1, 5), (2, 6), (3, 7))."""
    lines = [".reg .b32 w2, a, b, c, d, acc, lo_bias, hi_bias;", ".reg .b16 h0, h1;", ".reg .f32 f0, f1;",
             "mov.b32 lo_bias, 0x64086408;", "mov.b32 hi_bias, 0x64806480;"]
    for j in range(4):
        word, pairs = f"${1 + j}", [f"${5 + 4 * j + p}" for p in range(4)]
        lines += [f"lop3.b32 a, {word}, 0x000F000F, 0x64006400, 0xEA;",
                  f"lop3.b32 b, {word}, 0x00F000F0, 0x64006400, 0xEA;",
                  f"shr.b32 w2, {word}, 8;",
                  "lop3.b32 c, w2, 0x000F000F, 0x64006400, 0xEA;",
                  "lop3.b32 d, w2, 0x00F000F0, 0x64006400, 0xEA;",
                  "sub.f16x2 a, a, lo_bias;", "sub.f16x2 b, b, hi_bias;",
                  "sub.f16x2 c, c, lo_bias;", "sub.f16x2 d, d, hi_bias;",
                  f"mul.rn.f16x2 acc, a, {pairs[0]};" if j == 0 else f"fma.rn.f16x2 acc, a, {pairs[0]}, acc;",
                  f"fma.rn.f16x2 acc, b, {pairs[1]}, acc;",
                  f"fma.rn.f16x2 acc, c, {pairs[2]}, acc;",
                  f"fma.rn.f16x2 acc, d, {pairs[3]}, acc;"]
    lines += ["mov.b32 {h0, h1}, acc;", "cvt.f32.f16 f0, h0;", "cvt.f32.f16 f1, h1;", "add.f32 $0, f0, f1;"]
    return "{\n" + "\n".join(lines) + "\n}"


_GROUP_DOT_PTX = tl.constexpr(_group_dot_ptx())
_GROUP_DOT_CONSTRAINTS = tl.constexpr("=r," + ",".join(["r"] * 20))


@triton.jit
def _f16_pair(lo, hi):
    """lo, hi float32 tensors (same shape) rounded to f16 and packed into int32 words: lo in bits
    0-15, hi in bits 16-31 (the f16x2 register layout)."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return lo_bits | (hi_bits << 16)


@triton.jit
def _pair_half(pair, HIGH: tl.constexpr):
    """The f16 in bits 0-15 (HIGH 0) or 16-31 (HIGH 1) of int32 words, as float16."""
    bits = (pair >> 16) if HIGH else pair
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def group_tile(packed_rows, scale_rows, k0, row_valid, num_words, num_groups, BLOCK_K: tl.constexpr):
    """The tile at columns k0 .. k0 + BLOCK_K as (its groups' four words (w0, w1, w2, w3), each
    [BLOCK_N, GROUPS] int32 (word j of group g: columns 32 g + 8 j .. + 8), the group scales
    [BLOCK_N, GROUPS] (the scales' dtype)); 0 past the rows' end. packed_rows / scale_rows
    [BLOCK_N, 1]: the rows' pointers."""
    group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    word = group[:, None] * 4 + tl.arange(0, 4)[None, :]  # [GROUPS, 4]
    packed = tl.load(packed_rows[:, :, None] + word[None, :, :],
                     mask=row_valid[:, None, None] & (word < num_words)[None, :, :], other=0,
                     eviction_policy="evict_first")  # [BLOCK_N, GROUPS, 4] int32
    scales = tl.load(scale_rows + group[None, :], mask=row_valid[:, None] & (group < num_groups)[None, :],
                     other=0.0)  # [BLOCK_N, GROUPS]
    even, odd = tl.split(tl.reshape(packed, (packed.shape[0], packed.shape[1], 2, 2)))  # words 0, 2 / 1, 3
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return (w0, w1, w2, w3), scales


@triton.jit
def _x_pair(x_row_ptr, column, K, factor, dtype: tl.constexpr):
    """(x[column], x[column + 4]) (read in dtype, 0 past K) times factor, as f16x2 words [GROUPS]."""
    lo = tl.load(x_row_ptr + column, mask=column < K, other=0.0).to(dtype).to(tl.float32)
    hi = tl.load(x_row_ptr + column + 4, mask=column + 4 < K, other=0.0).to(dtype).to(tl.float32)
    return _f16_pair(lo * factor, hi * factor)


@triton.jit
def _x_word_pairs(x_row_ptr, first_column, K, inverse, dtype: tl.constexpr):
    """The four f16x2 pairs [GROUPS] int32 of the words starting at first_column [GROUPS]: (x_0, x_4),
    (x_1 / 16, x_5 / 16), (x_2, x_6), (x_3 / 16, x_7 / 16), each x times inverse (a power of two)."""
    sixteenth = inverse * 0.0625
    return (_x_pair(x_row_ptr, first_column, K, inverse, dtype),
            _x_pair(x_row_ptr, first_column + 1, K, sixteenth, dtype),
            _x_pair(x_row_ptr, first_column + 2, K, inverse, dtype),
            _x_pair(x_row_ptr, first_column + 3, K, sixteenth, dtype))


@triton.jit
def x_scale_of(x_row_ptr, k0, K, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """A power of two bringing the largest |x| of columns k0 .. k0 + BLOCK_K into [64, 128) (1 for a
    tile of zeros): x / x_scale keeps every f16 product and sum of a group in range."""
    columns = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_row_ptr + columns, mask=columns < K, other=0.0).to(dtype).to(tl.float32)
    largest = tl.max(tl.abs(x), axis=0)
    return tl.where(largest > 0, tl.exp2(tl.floor(tl.log2(tl.maximum(largest, 1e-30))) - 6.0), 1.0)


@triton.jit
def x_group_pairs(x_row_ptr, k0, K, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """x's columns k0 .. k0 + BLOCK_K (read in dtype, 0 past K) as the 16 f16x2 vectors [BLOCK_K / 32]
    int32 that meet each group's words (word j's four pairs at 4 j .. 4 j + 3, as _x_word_pairs
    orders them), divided by x_scale (x_scale_of); returns (pairs, x_scale), pairs a 16-tuple."""
    x_scale = x_scale_of(x_row_ptr, k0, K, BLOCK_K, dtype)
    inverse = 1.0 / x_scale  # a power of two: exact
    first = k0 + tl.arange(0, BLOCK_K // 32) * 32  # [GROUPS] each group's first column
    p0, p1, p2, p3 = _x_word_pairs(x_row_ptr, first, K, inverse, dtype)
    p4, p5, p6, p7 = _x_word_pairs(x_row_ptr, first + 8, K, inverse, dtype)
    p8, p9, p10, p11 = _x_word_pairs(x_row_ptr, first + 16, K, inverse, dtype)
    p12, p13, p14, p15 = _x_word_pairs(x_row_ptr, first + 24, K, inverse, dtype)
    return (p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15), x_scale


@triton.jit
def _nibble_f16(packed, shift: tl.constexpr, factor: tl.constexpr):
    """(nibble at bit shift - 8) * factor as float16 (exact: small integers)."""
    return ((((packed >> shift) & 0xF) - 8) * factor).to(tl.float16)


@triton.jit
def _word_into(lo, hi, word, x04, x15, x26, x37):
    """lo / hi [BLOCK_N, GROUPS] float16 plus word's products with its pairs, rounded as
    _GROUP_DOT_PTX rounds them (each product and each sum to f16)."""
    lo = lo + _nibble_f16(word, 0, 1) * _pair_half(x04, 0)[None, :]
    hi = hi + _nibble_f16(word, 16, 1) * _pair_half(x04, 1)[None, :]
    lo = lo + _nibble_f16(word, 4, 16) * _pair_half(x15, 0)[None, :]
    hi = hi + _nibble_f16(word, 20, 16) * _pair_half(x15, 1)[None, :]
    lo = lo + _nibble_f16(word, 8, 1) * _pair_half(x26, 0)[None, :]
    hi = hi + _nibble_f16(word, 24, 1) * _pair_half(x26, 1)[None, :]
    lo = lo + _nibble_f16(word, 12, 16) * _pair_half(x37, 0)[None, :]
    hi = hi + _nibble_f16(word, 28, 16) * _pair_half(x37, 1)[None, :]
    return lo, hi


@triton.jit
def group_dots(words, pairs, INTERPRETED: tl.constexpr):
    """sum over a group's 32 columns of q x / x_scale, [BLOCK_N, GROUPS] float32, from group_tile's
    words (a 4-tuple) and x_group_pairs' vectors (a 16-tuple of [GROUPS], broadcast over the rows)."""
    if INTERPRETED:
        lo = tl.zeros(words[0].shape, tl.float16)
        hi = tl.zeros(words[0].shape, tl.float16)
        lo, hi = _word_into(lo, hi, words[0], pairs[0], pairs[1], pairs[2], pairs[3])
        lo, hi = _word_into(lo, hi, words[1], pairs[4], pairs[5], pairs[6], pairs[7])
        lo, hi = _word_into(lo, hi, words[2], pairs[8], pairs[9], pairs[10], pairs[11])
        lo, hi = _word_into(lo, hi, words[3], pairs[12], pairs[13], pairs[14], pairs[15])
        return lo.to(tl.float32) + hi.to(tl.float32)
    else:
        return tl.inline_asm_elementwise(
            _GROUP_DOT_PTX, _GROUP_DOT_CONSTRAINTS,
            [words[0], words[1], words[2], words[3], pairs[0][None, :], pairs[1][None, :], pairs[2][None, :],
             pairs[3][None, :], pairs[4][None, :], pairs[5][None, :], pairs[6][None, :], pairs[7][None, :],
             pairs[8][None, :], pairs[9][None, :], pairs[10][None, :], pairs[11][None, :], pairs[12][None, :],
             pairs[13][None, :], pairs[14][None, :], pairs[15][None, :]],
            dtype=tl.float32, is_pure=True, pack=1)
