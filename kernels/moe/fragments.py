"""NVFP4 expert weights repacked once into the MMA fragment layout of `kernels/moe/cutedsl.py`.

The CuTeDSL kernels multiply weights (the A operand, 16 rows x 16 k) by activations with
`mma.sync.m16n8k16` (bf16 in, fp32 accumulate). A thread of a warp holds 8 values of each
16 x 16 tile: lane `l`, `g = l // 4`, `c = l % 4`, values `a0..a7` at rows
`g, g, g+8, g+8, g, g, g+8, g+8` and k `4c, 4c+1, 4c, 4c+1, 4c+2, 4c+3, 4c+2, 4c+3`.
(The MMA's k order is a permutation of the tile's 16 values: the activations are read in
the same order, so each thread reads its four activations with one 8-byte load.)

Repacked so that each thread's 8 codes of a tile are one 32-bit word, and four tiles along
K are one 16-byte load (`codes [E, R, K/64, 32 lanes, 4 tiles]` uint32, R = rows / 16):
- pair `j` of the fragment (`a2j`, `a2j+1`, one bf16x2 register) is decoded into a bf16
  pair equal to `e2m1 * 2^-126` (bf16 subnormals cover 0 and 0.5 exactly): each code's
  sign lands on bit 15 (31) and its magnitude bits (m, e0, e1) on bits 6-8 (22-24).
  The bits of a word are placed (`BITS`) so that pair 0 needs one mask, pair 1 a shift
  and a mask, pair 2 a rotation and a mask, pair 3 a shift, a rotation and two masks: 9
  integer ops a word, 7 of them on the integer pipe (a left shift by at most 6 is an
  `IMAD` on the FMA pipe; no bit layout gives each pair one shift and one mask).
  A row's two scales of a tile are one bf16x2 register; the multiply reads its low or
  high half for both lanes (`.H0_H0` / `.H1_H1` in SASS), so a tile's scales cost one byte
  permute and one shift-add.
- block scales, `scales [E, R, K/64, 8, 4 tiles, 2]` uint8: row `g`'s and row `g+8`'s
  scale of each tile, one byte each, re-encoded as `(e + 9) << 3 | mmm` for a scale
  `2^e * 1.mmm` (every E4M3 value, subnormals included, is such a number with
  `-9 <= e <= 8`). Placed at bf16 bits 4-11 and added to `SCALE_BIAS`, it reads as
  `scale * 2^SCALE_EXP`; one bf16x2 multiply by it gives `e2m1 * scale * 2^(SCALE_EXP -
  126)`, exact (6 significant bits) and a normal bf16 number for every code and scale.
  Negative scales flip their block's code signs; zero scales zero their block's codes.
- FC1's rows are regrouped so that a 16-row tile holds gate rows `8r..8r+7` then up rows
  `8r..8r+7`: the thread with a gate row holds its up row (`g + 8`), and SwiGLU needs no
  exchange.

`decode` inverts all of this with the kernel's integer and bf16 operations, in torch: the
CPU tests check `decode(repack(w)) == e2m1 * scale * 2^(SCALE_EXP - 126)` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from beamfx.kernels.moe.nvfp4 import BLOCK, decode_e2m1, unpack_e2m1

ROWS = 16  # rows of an MMA tile (M)
# Chunks of zeros after the last one of the codes and of the scales: a warp loads its next
# step's `depth` chunks of K from one base address (`load_step`), so where its range is not
# a whole number of steps it reads up to depth - 1 chunks past it, at the end of the
# tensor into this padding.
PAD_CHUNKS = 8
TILE_K = 16  # k of an MMA tile; one E4M3 block
CHUNK_K = 64  # four tiles: one 16-byte load of codes per thread
SCALE_EXP = 110  # the re-encoded scale reads as scale * 2^110
SCALE_BIAS = (SCALE_EXP + 127 - 9) << 7  # added to (byte << 4): bf16 exponent e + 127 + 110
# The kernel's products are e2m1 * scale * 2^-16; the epilogue multiplies by this.
UNDO = 2.0 ** (126 - SCALE_EXP)
# Fragment value a_i -> (row offset, k offset) within a 16 x 16 tile, for lane (g, c).
_ROW = (0, 0, 8, 8, 0, 0, 8, 8)
_K = (0, 1, 0, 1, 2, 3, 2, 3)
# A decoded value's code bits (m, e0, e1, sign) land on bf16 bits 6, 7, 8, 15 (the low
# value of a pair; the high value 16 bits up). Pair j's bits are rotated left by
# _PAIR_ROTATE[j] (one amount per bit) to get there, so in the word they sit that far
# below (mod 32): `BITS[i]` for value a_i of pair i // 2.
_TARGET = (6, 7, 8, 15)
_PAIR_ROTATE = ((0, 0, 0, 0), (4, 4, 4, 4), (10, 10, 10, 10), (6, 6, 14, 6))
BITS = tuple(
    tuple((t + 16 * (i % 2) - r) % 32 for t, r in zip(_TARGET, _PAIR_ROTATE[i // 2]))
    for i in range(8)
)
PAIR_MASK = 0x81C081C0  # sign and magnitude bits of a decoded bf16 pair
PAIR3_MASK_A = 0x80C080C0  # pair 3: m, e0 and sign, shifted left by 6
PAIR3_MASK_B = 0x01000100  # pair 3: e1, rotated left by 14


@dataclass(frozen=True)
class Packed:
    """One weight stack in fragment layout (`rows` real rows, `k` real columns)."""

    codes: torch.Tensor  # [E, R, K/64, 32, 4] int32
    scales: torch.Tensor  # [E, R, K/64, 8, 4, 2] uint8
    rows: int
    k: int


def why_not_shape(rows: int, k: int) -> str | None:
    if rows % ROWS or k % CHUNK_K:
        return (
            f"needs rows % {ROWS} == 0 and K % {CHUNK_K} == 0 for the fragment layout, got "
            f"rows {rows}, K {k}"
        )
    return None


def swiglu_row_order(inter: int) -> torch.Tensor:
    """FC1 row permutation: tile r = gate rows 8r..8r+7, then up rows 8r..8r+7."""
    r = torch.arange(inter // 8).repeat_interleave(16)
    half = torch.arange(16).repeat(inter // 8) // 8
    i = torch.arange(8).repeat(2 * (inter // 8))
    return half * inter + 8 * r + i


def permuted_k(i):
    """Where K index `i` sits in the MMA k order of the fragments (`_K`): within each 16,
    4c + q (q < 2) at 2c + q, 4c + 2 + q at 8 + 2c + q. Integer ops only, so the kernels
    apply it to their own values too."""
    q = i & 3
    return (i & ~15) + ((q >> 1) << 3) + ((i >> 2) & 3) * 2 + (q & 1)


def encode_scales(scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E4M3 scales -> (bytes `(e + 9) << 3 | mmm` of |scale|, negative mask, zero mask)."""
    s = scale.float()
    neg, zero = s < 0, s == 0
    mag = s.abs().clamp(min=2.0**-9)
    mant, ex = torch.frexp(mag)  # mag = mant * 2^ex, mant in [0.5, 1)
    e = ex - 1
    mmm = (mant * 16 - 8).round().to(torch.int32)  # 1.mmm = 2 * mant
    byte = ((e + 9) << 3 | mmm).to(torch.uint8)
    return torch.where(zero, torch.zeros_like(byte), byte), neg, zero


def repack(packed: torch.Tensor, scale: torch.Tensor, row_order: torch.Tensor | None = None):
    """ModelOpt NVFP4 `packed [E, N, K/2]` uint8 and `scale [E, N, K/16]` E4M3 -> `Packed`
    (a few experts at a time: the intermediate int64 codes are 16x the packed bytes)."""
    e, n, half_k = packed.shape
    k = 2 * half_k
    reason = why_not_shape(n, k)
    if reason:
        raise ValueError(f"NVFP4 fragment repack: {reason}")
    r, kc = n // ROWS, k // CHUNK_K
    words = _padded((e, r, kc, 32, 4), torch.int32, PAD_CHUNKS * 32 * 4, packed.device)
    scales = _padded((e, r, kc, 8, 4, 2), torch.uint8, PAD_CHUNKS * 8 * 4 * 2, packed.device)
    step = max(1, (1 << 24) // (n * k))
    for e0 in range(0, e, step):
        sl = slice(e0, min(e, e0 + step))
        words[sl], scales[sl] = _repack_experts(packed[sl], scale[sl], row_order)
    return Packed(words, scales, n, k)


def _padded(shape, dtype, pad: int, device) -> torch.Tensor:
    """An empty tensor of `shape` followed in memory by `pad` zeroed elements."""
    numel = 1
    for d in shape:
        numel *= d
    buf = torch.zeros(numel + pad, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def _repack_experts(packed, scale, row_order):
    e, n, half_k = packed.shape
    k = 2 * half_k
    codes = unpack_e2m1(packed).to(torch.int32)  # [E, N, K]
    byte, neg, zero = encode_scales(scale)
    blocks = codes.view(e, n, k // BLOCK, BLOCK)
    blocks = torch.where(neg.unsqueeze(-1), blocks ^ 8, blocks)
    codes = torch.where(zero.unsqueeze(-1), 0, blocks).view(e, n, k)
    if row_order is not None:
        codes, byte = codes[:, row_order], byte[:, row_order]
    r, kc = n // ROWS, k // CHUNK_K
    # [E, R, 16 rows, KC, 4 tiles, 16 k] -> per lane (g, c) and tile, the 8 fragment codes
    t = codes.view(e, r, ROWS, kc, 4, TILE_K)
    dev = packed.device
    g = torch.arange(8, device=dev).view(8, 1, 1)
    c = torch.arange(4, device=dev).view(1, 4, 1)
    rows = (g + torch.tensor(_ROW, device=dev).view(1, 1, 8)).expand(8, 4, 8)
    ks = (4 * c + torch.tensor(_K, device=dev).view(1, 1, 8)).expand(8, 4, 8)
    frag = t[:, :, rows, :, :, ks]  # [8, 4, 8 values, E, R, KC, 4 tiles]
    frag = frag.permute(3, 4, 5, 0, 1, 6, 2)  # [E, R, KC, 8, 4, 4 tiles, 8 values]
    frag = frag.to(torch.int64)
    words = torch.zeros(frag.shape[:-1], dtype=torch.int64, device=dev)
    for i, bits in enumerate(BITS):
        for b, pos in enumerate(bits):
            words |= (frag[..., i] >> b & 1) << pos
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    s = byte.view(e, r, 2, 8, kc, 4)  # [E, R, half (row g / g+8), g, KC, tile]
    return words.reshape(e, r, kc, 32, 4), s.permute(0, 1, 4, 3, 5, 2)


def _rotl(w: torch.Tensor, n: int) -> torch.Tensor:
    return ((w << n) | (w >> (32 - n))) & 0xFFFFFFFF


def decode_pair(w: torch.Tensor, j: int) -> torch.Tensor:
    """Pair j of words `w` (int64 holding uint32) as bf16x2 bits: the kernel's integer ops
    (`shl`, `shf.l.wrap`, `and`)."""
    if j == 0:
        return w & PAIR_MASK
    if j == 1:
        return (w << 4) & PAIR_MASK
    if j == 2:
        return _rotl(w, 10) & PAIR_MASK
    return ((w << 6) & PAIR3_MASK_A) | (_rotl(w, 14) & PAIR3_MASK_B)


def _bf16_bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return (bits.to(torch.int32) << 16).view(torch.float32)


def decode(p: Packed) -> torch.Tensor:
    """Dense [E, rows, K] fp32 values `e2m1 * scale * 2^(SCALE_EXP - 126)`, computed with
    the kernel's operations (shifts, masks, the bf16 scale bias, one bf16 multiply)."""
    e, r, kc = p.codes.shape[:3]
    w = p.codes.to(torch.int64) & 0xFFFFFFFF  # [E, R, KC, 32, 4]
    out = torch.empty(e, r, ROWS, kc, 4, TILE_K)
    sc = p.scales.to(torch.int64)  # [E, R, KC, 8, 4, 2]
    for lane in range(32):
        g, c = divmod(lane, 4)
        for j in range(4):  # pair j: values a_2j (low half) and a_2j+1 (high half)
            pair = decode_pair(w[..., lane, :], j)
            half = j % 2  # pairs 0, 2: row g; 1, 3: row g + 8
            bias = ((sc[..., g, :, half] << 4) + SCALE_BIAS).float()
            scale = _bf16_bits_to_float(bias.to(torch.int32))
            for lo, idx in ((0, 2 * j), (16, 2 * j + 1)):
                code = _bf16_bits_to_float(((pair >> lo) & 0xFFFF).to(torch.int32))
                val = (code * scale).to(torch.bfloat16).float()  # mul.rn.bf16x2
                out[:, :, g + _ROW[idx], :, :, 4 * c + _K[idx]] = val
    return out.view(e, r * ROWS, kc * CHUNK_K)


def expected(packed: torch.Tensor, scale: torch.Tensor, row_order=None) -> torch.Tensor:
    """What `decode(repack(...))` must equal: e2m1 * scale * 2^(SCALE_EXP - 126), fp32."""
    values = decode_e2m1(unpack_e2m1(packed), torch.float64)
    blocks = values.unflatten(-1, (-1, BLOCK)) * scale.double().unsqueeze(-1)
    dense = (blocks.flatten(-2) * 2.0 ** (SCALE_EXP - 126)).float()
    return dense if row_order is None else dense[:, row_order]
