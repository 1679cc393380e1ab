"""Triton MoE experts for Hopper: bf16 activations, bf16 or NVFP4 (W4A16) expert weights.

Two launches per MoE layer, no routing pre-pass at small token counts:
1. FC1 + SwiGLU: a program owns one expert and one tile of the intermediate dimension; it
   multiplies that expert's token rows by the gate and up tiles (NVFP4 decoded in registers
   to bf16, exactly: an E2M1 value times an E4M3 scale has at most 6 significant bits),
   applies the global scales, rounds gate/up to bf16, and writes `silu(g) * u` (bf16).
2. FC2 + combine: a program owns one expert and one tile of the hidden dimension; it
   rounds each row to bf16 (the `moe_experts` contract), multiplies by the routing weight
   and adds into an fp32 accumulator with atomics. The program that adds a token's last
   (k-th) row, found by a per-(token, tile) arrival counter, multiplies by the routed
   scale and writes the bf16 output: finalize costs no launch. FC1 zeroes the accumulator.
   Without combine (the `moe_experts*` ops) FC2 writes the bf16 rows instead.

Finding an expert's rows: up to `SCAN_MAX_PAIRS` (token, slot) pairs, program m stands for
pair m and works only if m is the first pair routed to its expert; it then gathers that
expert's pairs by a prefix count over all pair ids (cheap at decode sizes). Above that,
one small launch (`sort_blocks`) sorts the pairs by expert into blocks of `BM` rows (one
program per block).
The fp32 sums of the combine arrive in any order: results match the reference to fp32
rounding before the final bf16 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch._subclasses.fake_tensor import is_fake

from beamfx.kernels.moe.reference import why_not_layout
from beamfx.kernels.triton_common import INTERPRET as _INTERPRET
from beamfx.kernels.triton_common import tl, triton
from beamfx.ops import Provider

# Pairs (tokens x top-k) up to which programs find their rows by scanning the ids.
SCAN_MAX_PAIRS = 1024
# Sorting pairs into blocks (`sort_blocks`, `sort_path`): one program for one chunk
# (SORT_CHUNK pairs; 3.6-7.9 us at 64-1024 pairs on an H200, bench/NOTES.md MoE run 13), three
# launches over chunks beyond while the (chunk, bin) table fits one program (SORT_TABLE_CELLS:
# 65536 pairs at 256 experts; 12.8-22.7 us at 2048-65536 pairs against the torch ops' 70-95,
# run 16), the torch ops beyond that or above SORT_MAX_EXPERTS experts. SORT_CHUNKED_ON_GPU
# off gives the one program up to SORT_ONE_PROGRAM_PAIRS instead (16.3 us at 2048 pairs,
# 48.6 at 4096).
SORT_ONE_PROGRAM_PAIRS = 4096
SORT_CHUNK = 1024
# Triton 3.6 on an H100 gives the offsets kernel a table of 128 x 512 cells 256 KiB of shared
# memory (over the 227 KiB limit: OutOfResources at 65537 pairs, 256 experts); 64 x 512 and
# 16 x 2048 fit. Triton 3.9 needs 256 bytes for either.
SORT_TABLE_CELLS = 1 << 15
SORT_MAX_CHUNKS = 128  # 131072 pairs: the most run on a GPU (the padding blocks grow with it)
SORT_MAX_EXPERTS = 1024
SORT_CHUNKED_ON_GPU = True


@dataclass(frozen=True)
class Config:
    """Tile sizes of the two launches (BM rows; FC1 tiles the intermediate, FC2 the hidden)."""

    scan: bool
    bm: int
    bn1: int
    bk1: int
    bn2: int
    bk2: int
    warps1: int = 4
    warps2: int = 4
    stages1: int = 3
    stages2: int = 3
    # NVFP4 decode: 0 = per code through fp16 and fp32; 1 = per 32-bit word (8 codes) into
    # bf16 pairs, scaled with one bf16x2 multiply per pair (see `_fp4_tile_words`). Measured
    # on an H200 (bench/NOTES.md): 1 wins at sorted-block sizes (1.2-1.5x), 0 at decode.
    decode: int = 0
    # NVFP4 at few pairs: whole rows per program in fp32 FMAs (`_fc1_fma_kernel`), no MMA;
    # bn1 / bn2 rows a program, bk1 / bk2 values per K step.
    fma: bool = False
    # The combine without fp32 atomics: FC2 writes each pair's bf16 row and a third launch
    # (`_finalize_kernel`) sums a token's k rows (the MMA kernels; the FMA ones never use
    # atomics). On for sorted blocks: 3-17% faster there on an H200 (bench/NOTES.md).
    combine_rows: bool = False


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


# NVFP4 calls run the fp32-FMA kernels (`fma_config`) up to FMA_MAX_PAIRS (token, expert)
# pairs, and up to FMA_MAX_PAIRS_NARROW when the experts are narrow (intermediate below
# FMA_NARROW_INTER). Measured on an H200 (bench/NOTES.md, MoE run 5), forced against the MMA
# kernels: faster at 8-256 pairs (1.2-3.2x); at 512 pairs slower with 1536-wide experts
# (TP1: 3574 vs 3191 us), faster with 192-wide ones (TP8: 468 vs 527 us).
FMA_MAX_PAIRS = 256
FMA_MAX_PAIRS_NARROW = 512
FMA_NARROW_INTER = 1024


def fma_config(inter: int) -> Config:
    """The NVFP4 fp32-FMA kernels' tiles, swept on an H200: FC1 4 gate + 4 up rows and 1024
    values a K step on 4 warps; FC2 the k experts' rows, 16 rows and 128 values a K step on
    4 warps for long rows (inter >= 1024), else 8 rows and 64 values on 2 warps. Small
    programs, many of them: more loads in flight across the GPU."""
    if inter >= 1024:
        bn2, bk2, warps2 = 16, 128, 4
    else:
        bn2, bk2, warps2 = 8, 64, 2
    return Config(
        scan=True, bm=1, bn1=4, bk1=1024, bn2=bn2, bk2=bk2, warps1=4, warps2=warps2, fma=True
    )


# bf16 sorted blocks of 128 rows with wide tiles (FC1 128 x 128, FC2 128 x 256, 8 warps)
# once the experts average this many rows and are at least this wide. Measured on an H200
# (bench/results/moe_sorted_sweep.json), Beam-1.0 TP1 shapes: 5203 against 6366 us at 128
# rows an expert (4096 tokens), 3502 against 3154 at 16 (512 tokens); at TP8's 192-wide
# experts 956 against 983 (not taken). The NVFP4 kernels lost with 128-row blocks (7720
# against 7032 us at 4096 tokens; 128 x 256 FC2 tiles failed to compile).
WIDE_TILE_ROWS = 128
WIDE_TILE_MIN_INTER = 1024


def pick_config(pairs: int, hidden: int, inter: int, fp4: bool, experts: int = 0) -> Config:
    """Tiles by regime: decode-sized (scan, 16-row tiles, long K steps) or sorted blocks."""
    narrow = inter < FMA_NARROW_INTER
    if fp4 and pairs <= (FMA_MAX_PAIRS_NARROW if narrow else FMA_MAX_PAIRS):
        return fma_config(inter)
    return mma_config(pairs, hidden, inter, fp4, experts)


def mma_config(pairs: int, hidden: int, inter: int, fp4: bool, experts: int = 0) -> Config:
    """The tensor-core kernels' tiles (`pick_config` without the NVFP4 FMA path);
    `experts` (0: unknown) picks the wide bf16 tiles when their rows fill 128-row blocks."""
    if pairs <= SCAN_MAX_PAIRS:
        bk = 256 if fp4 else 128
        return Config(
            scan=True,
            bm=16,
            bn1=_pow2_divisor(inter, 32),
            bk1=_pow2_divisor(hidden, bk),
            bn2=_pow2_divisor(hidden, 64),
            bk2=_pow2_divisor(inter, bk),
        )
    sorted_blocks = Config(
        scan=False,
        bm=64,
        bn1=_pow2_divisor(inter, 64),
        bk1=_pow2_divisor(hidden, 64),
        bn2=_pow2_divisor(hidden, 128),
        bk2=_pow2_divisor(inter, 64),
        warps1=4,
        warps2=8,
        decode=1,
        combine_rows=True,
    )
    wide = not fp4 and experts > 0 and inter >= WIDE_TILE_MIN_INTER
    if wide and pairs >= WIDE_TILE_ROWS * experts:
        return replace(
            sorted_blocks,
            bm=128,
            bn1=_pow2_divisor(inter, 128),
            bn2=_pow2_divisor(hidden, 256),
            warps1=8,
        )
    return sorted_blocks


if triton is not None:
    from beamfx.kernels.triton_common import dot_bf16 as _dot
    from beamfx.kernels.triton_common import round_bf16 as _round_bf16

    @triton.jit
    def _e4m3_to_f32(s8):
        """Values of E4M3 (fn) bytes, exact: sign, 4-bit exponent (bias 7), 3-bit mantissa."""
        s = s8.to(tl.int32)
        e = (s >> 3) & 0xF
        m = s & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        return tl.where((s & 0x80) != 0, -v, v)

    if _INTERPRET:

        @triton.jit
        def _mul_bf16x2(a, b):
            """Two bf16 products per uint32 (lanes lo, hi); exact here, so fp32 serves."""
            lo = (a << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32 by bits: exact
            hi = (a & 0xFFFF0000).to(tl.float32, bitcast=True)
            s = (b << 16).to(tl.float32, bitcast=True)
            lo = _round_bf16(lo * s).to(tl.uint32, bitcast=True) >> 16
            hi = _round_bf16(hi * s).to(tl.uint32, bitcast=True) & 0xFFFF0000
            return hi | lo

    else:

        @triton.jit
        def _mul_bf16x2(a, b):
            """Two bf16 products per uint32 (lanes lo, hi): one `mul.rn.bf16x2`, subnormals kept."""
            return tl.inline_asm_elementwise(
                "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1
            )

    @triton.jit
    def _fp4_pair(p, SHIFT_M: tl.constexpr, SHIFT_S: tl.constexpr):
        """bf16 bits of the codes at bits q and q+16 of `p`: magnitude to bits 6-8, sign to 15.

        E2M1 (exponent e, mantissa m) placed there reads as a bf16 of value e2m1 * 2^-126
        (e = 0 lands on bf16's subnormals, as E2M1's own), so no table is needed.
        """
        if SHIFT_M >= 0:
            m = p << SHIFT_M
        else:
            m = p >> -SHIFT_M
        return (m & 0x01C001C0) | ((p << SHIFT_S) & 0x80008000)

    @triton.jit
    def _halves(v):
        """The two bf16 lanes of uint32 `v`, joined as [..., 2] (lo first)."""
        lo = (v & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (v >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.join(lo, hi)

    @triton.jit
    def _fp4_tile_words(
        w_ptr, s_ptr, row0, k0, stride_wn, stride_sn, BN: tl.constexpr, BK: tl.constexpr
    ):
        """NVFP4 W[row0:row0+BN, k0:k0+BK] as bf16 `e2m1 * scale * 2^-7` (exact), [BN, BK].

        One 32-bit load holds 8 codes (k0..k7 at bits 4k); four shift-and-mask steps turn it
        into the bf16 pairs (k, k+4), one `mul.rn.bf16x2` by `scale * 2^119` scales each
        pair, and joins put k back in order. The 2^7 goes into the global scale.
        """
        BW: tl.constexpr = BK // 8
        rn = row0 + tl.arange(0, BN)
        words = w_ptr.to(tl.pointer_type(tl.uint32))
        rw = k0 // 8 + tl.arange(0, BW)
        p = tl.load(words + rn[:, None] * (stride_wn // 4) + rw[None, :])
        rs = k0 // 16 + tl.arange(0, BK // 16)
        scale = _e4m3_to_f32(tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]))
        sbits = (scale * 6.646139978924579e35).to(tl.bfloat16).to(tl.uint16, bitcast=True)
        sbits = sbits.to(tl.uint32)
        sbits = sbits | (sbits << 16)
        s2 = tl.join(sbits, sbits).reshape(BN, BW)  # words 2j, 2j+1 share scale j
        a = _halves(_mul_bf16x2(_fp4_pair(p, 6, 12), s2))  # k0, k4
        b = _halves(_mul_bf16x2(_fp4_pair(p, 2, 8), s2))  # k1, k5
        c = _halves(_mul_bf16x2(_fp4_pair(p, -2, 4), s2))  # k2, k6
        d = _halves(_mul_bf16x2(_fp4_pair(p, -6, 0), s2))  # k3, k7
        # [.., a, b, c] with k = 4a + 2b + c: c picks even/odd k, b picks +2, a picks +4.
        w = tl.join(tl.join(a, c), tl.join(b, d))
        return w.reshape(BN, BK)

    @triton.jit
    def _weight_tile(
        w_ptr,
        s_ptr,
        row0,
        k0,
        stride_wn,
        stride_sn,
        BN: tl.constexpr,
        BK: tl.constexpr,
        FP4: tl.constexpr,
        DECODE: tl.constexpr = 0,
    ):
        """W[row0:row0+BN, k0:k0+BK] as bf16, transposed to [BK, BN]."""
        rn = row0 + tl.arange(0, BN)
        if FP4 and DECODE == 1:
            w = _fp4_tile_words(w_ptr, s_ptr, row0, k0, stride_wn, stride_sn, BN, BK)
        elif FP4:
            rk = k0 // 2 + tl.arange(0, BK // 2)
            packed = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :]).to(tl.int32)
            codes = tl.join(packed & 0xF, packed >> 4).reshape(BN, BK)  # k = 2j (low), 2j+1
            # E2M1 bits placed in an fp16: every code (0.5 as a subnormal) is value * 2^-14.
            bits = ((codes & 7) << 9) | ((codes & 8) << 12)
            vals = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            rs = k0 // 16 + tl.arange(0, BK // 16)
            scale = _e4m3_to_f32(tl.load(s_ptr + rn[:, None] * stride_sn + rs[None, :]))
            w = vals.reshape(BN, BK // 16, 16) * (scale * 16384.0)[:, :, None]
            w = w.reshape(BN, BK).to(tl.bfloat16)  # exact
        else:
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :])
        return tl.trans(w)

    @triton.jit
    def _scan_rows(ids_ptr, p, n_pairs, P_PAD: tl.constexpr):
        """Expert of pair p, whether p is its first pair, the id match mask and prefix counts."""
        q = tl.arange(0, P_PAD)
        ids = tl.load(ids_ptr + q, mask=q < n_pairs, other=-1)
        e = tl.load(ids_ptr + p)
        match = ids == e
        first = tl.sum((match & (q < p)).to(tl.int32), axis=0) == 0
        return e, first, match, tl.cumsum(match.to(tl.int32), axis=0), q

    @triton.jit
    def _scan_chunk(match, rank, q, c, count, BM: tl.constexpr):
        """Pair indices of the expert's rows c*BM .. c*BM+BM-1 (by rank), and their mask."""
        want = c * BM + tl.arange(0, BM) + 1
        sel = (rank[None, :] == want[:, None]) & match[None, :]
        pairs = tl.sum(tl.where(sel, q[None, :], 0), axis=1)
        return pairs, want <= count

    @triton.jit
    def _fc1_tile(
        x_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        h_ptr,
        e,
        pairs,
        rmask,
        pid_n,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        FP4: tl.constexpr,
        STAGES: tl.constexpr,
        DECODE: tl.constexpr,
        G_MULT: tl.constexpr,
    ):
        tok = (pairs // TOPK).to(tl.int64)
        offs_k = tl.arange(0, BK)
        n0 = pid_n * BN
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for k0 in tl.range(0, hidden, BK, num_stages=STAGES):
            a = tl.load(
                x_ptr + tok[:, None] * hidden + (k0 + offs_k)[None, :],
                mask=rmask[:, None],
                other=0.0,
            )
            w_g = _weight_tile(w_e, s_e, n0, k0, stride_wn, stride_sn, BN, BK, FP4, DECODE)
            acc_g = _dot(a, w_g, acc_g)
            w_u = _weight_tile(w_e, s_e, inter + n0, k0, stride_wn, stride_sn, BN, BK, FP4, DECODE)
            acc_u = _dot(a, w_u, acc_u)
        if FP4:
            acc_g = acc_g * (tl.load(g_ptr + 2 * e) * G_MULT)
            acc_u = acc_u * (tl.load(g_ptr + 2 * e + 1) * G_MULT)
        gate = _round_bf16(acc_g)
        up = _round_bf16(acc_u)
        h = _round_bf16(gate * tl.sigmoid(gate) * up)
        offs_n = n0 + tl.arange(0, BN)
        tl.store(
            h_ptr + pairs[:, None].to(tl.int64) * inter + offs_n[None, :],
            h.to(tl.bfloat16),
            mask=rmask[:, None],
        )

    @triton.jit
    def _fc1_kernel(
        x_ptr,
        ids_ptr,
        order_ptr,
        blocks_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        h_ptr,
        zero_ptr,
        n_zero,
        n_pairs,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        SCAN: tl.constexpr,
        P_PAD: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        FP4: tl.constexpr,
        STAGES: tl.constexpr,
        ZERO_BLOCK: tl.constexpr,
        DECODE: tl.constexpr,
        G_MULT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        # Zero FC2's combine accumulator and arrival counters (stream order puts this first).
        lin = pid_m * tl.num_programs(1) + pid_n
        step = tl.num_programs(0) * tl.num_programs(1) * ZERO_BLOCK
        for z in range(lin * ZERO_BLOCK, n_zero, step):
            offs = z + tl.arange(0, ZERO_BLOCK)
            tl.store(zero_ptr + offs, tl.zeros((ZERO_BLOCK,), tl.int32), mask=offs < n_zero)
        if SCAN:
            e, first, match, rank, q = _scan_rows(ids_ptr, pid_m, n_pairs, P_PAD)
            if first:
                count = tl.sum(match.to(tl.int32), axis=0)
                for c in range(0, tl.cdiv(count, BM)):
                    pairs, rmask = _scan_chunk(match, rank, q, c, count, BM)
                    _fc1_tile(
                        x_ptr,
                        w_ptr,
                        s_ptr,
                        g_ptr,
                        h_ptr,
                        e,
                        pairs,
                        rmask,
                        pid_n,
                        hidden,
                        inter,
                        stride_we,
                        stride_wn,
                        stride_se,
                        stride_sn,
                        TOPK,
                        BM,
                        BN,
                        BK,
                        FP4,
                        STAGES,
                        DECODE,
                        G_MULT,
                    )
        else:
            e = tl.load(blocks_ptr + 3 * pid_m)
            if e >= 0:
                r = tl.load(blocks_ptr + 3 * pid_m + 1) + tl.arange(0, BM)
                rmask = r < tl.load(blocks_ptr + 3 * pid_m + 2)
                pairs = tl.load(order_ptr + r, mask=rmask, other=0)
                _fc1_tile(
                    x_ptr,
                    w_ptr,
                    s_ptr,
                    g_ptr,
                    h_ptr,
                    e,
                    pairs,
                    rmask,
                    pid_n,
                    hidden,
                    inter,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    TOPK,
                    BM,
                    BN,
                    BK,
                    FP4,
                    STAGES,
                    DECODE,
                    G_MULT,
                )

    @triton.jit
    def _fc2_tile(
        h_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        topk_w_ptr,
        out_ptr,
        acc_ptr,
        cnt_ptr,
        routed_scale,
        e,
        pairs,
        rmask,
        pid_n,
        n_tiles,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        FP4: tl.constexpr,
        COMBINE: tl.constexpr,
        STAGES: tl.constexpr,
        DECODE: tl.constexpr,
        G_MULT: tl.constexpr,
    ):
        offs_k = tl.arange(0, BK)
        n0 = pid_n * BN
        w_e = w_ptr + e.to(tl.int64) * stride_we
        s_e = s_ptr + e.to(tl.int64) * stride_se
        rows64 = pairs.to(tl.int64)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in tl.range(0, inter, BK, num_stages=STAGES):
            a = tl.load(
                h_ptr + rows64[:, None] * inter + (k0 + offs_k)[None, :],
                mask=rmask[:, None],
                other=0.0,
            )
            w = _weight_tile(w_e, s_e, n0, k0, stride_wn, stride_sn, BN, BK, FP4, DECODE)
            acc = _dot(a, w, acc)
        if FP4:
            acc = acc * (tl.load(g_ptr + e) * G_MULT)
        rows = _round_bf16(acc)  # each expert row is rounded to bf16, as `moe_experts` does
        offs_n = n0 + tl.arange(0, BN)
        if COMBINE:
            tok = (pairs // TOPK).to(tl.int64)
            weight = tl.load(topk_w_ptr + pairs, mask=rmask, other=0.0).to(tl.float32)
            dst = tok[:, None] * hidden + offs_n[None, :]
            tl.atomic_add(acc_ptr + dst, rows * weight[:, None], mask=rmask[:, None], sem="relaxed")
            # Every thread's adds precede the arrival count (barrier, then a release).
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tok * n_tiles + pid_n, 1, mask=rmask, sem="acq_rel")
            last = rmask & (arrived == TOPK - 1)
            tl.debug_barrier()
            total = tl.load(acc_ptr + dst, mask=last[:, None], other=0.0, cache_modifier=".cg")
            tl.store(
                out_ptr + dst, _round_bf16(total * routed_scale).to(tl.bfloat16), mask=last[:, None]
            )
        else:
            tl.store(
                out_ptr + rows64[:, None] * hidden + offs_n[None, :],
                rows.to(tl.bfloat16),
                mask=rmask[:, None],
            )

    @triton.jit
    def _fc2_kernel(
        h_ptr,
        ids_ptr,
        order_ptr,
        blocks_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        topk_w_ptr,
        out_ptr,
        acc_ptr,
        cnt_ptr,
        routed_scale,
        n_pairs,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        SCAN: tl.constexpr,
        P_PAD: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
        FP4: tl.constexpr,
        COMBINE: tl.constexpr,
        STAGES: tl.constexpr,
        DECODE: tl.constexpr,
        G_MULT: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        n_tiles = tl.num_programs(1)
        if SCAN:
            e, first, match, rank, q = _scan_rows(ids_ptr, pid_m, n_pairs, P_PAD)
            if first:
                count = tl.sum(match.to(tl.int32), axis=0)
                for c in range(0, tl.cdiv(count, BM)):
                    pairs, rmask = _scan_chunk(match, rank, q, c, count, BM)
                    _fc2_tile(
                        h_ptr,
                        w_ptr,
                        s_ptr,
                        g_ptr,
                        topk_w_ptr,
                        out_ptr,
                        acc_ptr,
                        cnt_ptr,
                        routed_scale,
                        e,
                        pairs,
                        rmask,
                        pid_n,
                        n_tiles,
                        hidden,
                        inter,
                        stride_we,
                        stride_wn,
                        stride_se,
                        stride_sn,
                        TOPK,
                        BM,
                        BN,
                        BK,
                        FP4,
                        COMBINE,
                        STAGES,
                        DECODE,
                        G_MULT,
                    )
        else:
            e = tl.load(blocks_ptr + 3 * pid_m)
            if e >= 0:
                r = tl.load(blocks_ptr + 3 * pid_m + 1) + tl.arange(0, BM)
                rmask = r < tl.load(blocks_ptr + 3 * pid_m + 2)
                pairs = tl.load(order_ptr + r, mask=rmask, other=0)
                _fc2_tile(
                    h_ptr,
                    w_ptr,
                    s_ptr,
                    g_ptr,
                    topk_w_ptr,
                    out_ptr,
                    acc_ptr,
                    cnt_ptr,
                    routed_scale,
                    e,
                    pairs,
                    rmask,
                    pid_n,
                    n_tiles,
                    hidden,
                    inter,
                    stride_we,
                    stride_wn,
                    stride_se,
                    stride_sn,
                    TOPK,
                    BM,
                    BN,
                    BK,
                    FP4,
                    COMBINE,
                    STAGES,
                    DECODE,
                    G_MULT,
                )


if triton is not None:
    # --- NVFP4 at decode sizes: whole rows per program, fp32 FMAs, no MMA ------------------
    # A few tokens leave the MMA's 16 rows mostly padding, and decoding into its operand
    # layout is the cost. Here a thread decodes the 32-bit words it loaded (8 codes each)
    # into fp32 and multiplies them straight into the activations of those columns, loaded
    # once per thread and shared by the rows it holds; the rows are summed once at the end.
    # Loads run one K step ahead of the FMAs (decode-sized calls have a few K steps per
    # program and little else to hide DRAM latency behind).

    @triton.jit
    def _act_f32(a, HI: tl.constexpr):
        """One bf16 of the uint32 activation pairs `a` (scaled by `_act_pairs`), as fp32."""
        if HI:
            return (a & 0xFFFF0000).to(tl.float32, bitcast=True)
        else:
            return (a << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _act_pairs(a):
        """bf16 pairs times 2^64, exact (so that their products with the codes' 2^-126 stay
        clear of fp32's subnormals): one bf16x2 multiply a pair."""
        return _mul_bf16x2(a, tl.full(a.shape, 0x5F805F80, tl.uint32))

    @triton.jit
    def _fp4_code_f32(words, C: tl.constexpr):
        """Code C of each word as fp32 `e2m1 * 2^-126` (E2M1's e = 0 on fp32's subnormals):
        its sign shifted to bit 31, an arithmetic shift by 6 puts the magnitude at bits
        22-24 (exponent's low two bits, mantissa's top) and the mask clears the rest."""
        v = words.to(tl.int32, bitcast=True)
        if C < 7:
            v = v << (28 - 4 * C)
        return ((v >> 6) & -2118123520).to(tl.float32, bitcast=True)  # 0x81C00000

    @triton.jit
    def _fp4_words_dot(words, sbytes, a0, a1, a2, a3):
        """Per word: sum_i code_i * act_i * scale * 2^-62 in fp32 (`a_q`: the bf16 pair of
        values 2q, 2q+1 of the word's 8 columns, from `_act_pairs`; `sbytes`: the word's
        E4M3 scale byte)."""
        part = _fp4_code_f32(words, 0) * _act_f32(a0, False)
        part += _fp4_code_f32(words, 1) * _act_f32(a0, True)
        part += _fp4_code_f32(words, 2) * _act_f32(a1, False)
        part += _fp4_code_f32(words, 3) * _act_f32(a1, True)
        part += _fp4_code_f32(words, 4) * _act_f32(a2, False)
        part += _fp4_code_f32(words, 5) * _act_f32(a2, True)
        part += _fp4_code_f32(words, 6) * _act_f32(a3, False)
        part += _fp4_code_f32(words, 7) * _act_f32(a3, True)
        sb = sbytes.to(tl.uint32)
        scale = (((sb & 0x7F) << 20) | ((sb & 0x80) << 24)).to(tl.float32, bitcast=True)
        return part * (scale * 1.329227995784916e36)  # E4M3 bits read as e4m3 * 2^-120

    @triton.jit
    def _fma_step_loads(
        w_rows, s_rows, a_rows, row_ok, a_ok, wi, n_words, ONE_ROW: tl.constexpr,
        EVEN: tl.constexpr,
    ):  # fmt: skip
        """One K step's weight words, scale bytes and activation pairs (a_q: 32-bit word q of
        each column's 8 activations) for the words `wi` of the rows."""
        col_ok = wi < n_words
        w_ptrs = w_rows + wi[None, None, :]
        s_ptrs = s_rows + (wi // 2)[None, None, :]
        if ONE_ROW:  # one activation row, shared by every weight row
            a_ptrs = a_rows + 4 * wi
            a_mask = col_ok
        else:  # activation row i for the weight rows [i, :]
            a_ptrs = a_rows[:, None] + 4 * wi[None, :]
            a_mask = a_ok[:, None] & col_ok[None, :]
        if EVEN:
            words = tl.load(w_ptrs)
            sb = tl.load(s_ptrs)
            a0 = tl.load(a_ptrs)
            a1 = tl.load(a_ptrs + 1)
            a2 = tl.load(a_ptrs + 2)
            a3 = tl.load(a_ptrs + 3)
        else:
            ok = row_ok[:, :, None] & col_ok[None, None, :]
            words = tl.load(w_ptrs, mask=ok, other=0)
            sb = tl.load(s_ptrs, mask=ok, other=0)
            a0 = tl.load(a_ptrs, mask=a_mask, other=0)
            a1 = tl.load(a_ptrs + 1, mask=a_mask, other=0)
            a2 = tl.load(a_ptrs + 2, mask=a_mask, other=0)
            a3 = tl.load(a_ptrs + 3, mask=a_mask, other=0)
        return words, sb, a0, a1, a2, a3

    @triton.jit
    def _fma_step(acc, words, sb, a0, a1, a2, a3, ONE_ROW: tl.constexpr):
        """acc + one K step's per-word partial dot products (`_fp4_words_dot`)."""
        a0, a1, a2, a3 = _act_pairs(a0), _act_pairs(a1), _act_pairs(a2), _act_pairs(a3)
        if ONE_ROW:
            return acc + _fp4_words_dot(
                words, sb, a0[None, None, :], a1[None, None, :], a2[None, None, :],
                a3[None, None, :],
            )  # fmt: skip
        else:
            return acc + _fp4_words_dot(
                words, sb, a0[:, None, :], a1[:, None, :], a2[:, None, :], a3[:, None, :]
            )

    @triton.jit
    def _fma_rows_dot(
        w_rows, s_rows, a_rows, row_ok, a_ok, n_words, BW: tl.constexpr, ONE_ROW: tl.constexpr,
        EVEN: tl.constexpr,
    ):  # fmt: skip
        """[A, R] fp32 dot products, times 2^-62, of NVFP4 weight rows ([A, R, 1] pointers:
        `w_rows` to codes as 32-bit words, `s_rows` to scale bytes) with bf16 activation rows
        read as 32-bit pairs: one row for all (ONE_ROW: `a_rows` a pointer), or row i for the
        weight rows [i, :] (`a_rows` [A] pointers, `a_ok` [A] their mask). `row_ok` [A, R]:
        the weight rows' mask (EVEN: all rows and K steps full, no masks). Each K step loads
        the next step's operands before its own FMAs."""
        j = tl.arange(0, BW)
        acc = tl.zeros((w_rows.shape[0], w_rows.shape[1], BW), tl.float32)
        words, sb, a0, a1, a2, a3 = _fma_step_loads(
            w_rows, s_rows, a_rows, row_ok, a_ok, j, n_words, ONE_ROW, EVEN
        )
        for w0 in range(BW, n_words, BW):
            words_n, sb_n, a0_n, a1_n, a2_n, a3_n = _fma_step_loads(
                w_rows, s_rows, a_rows, row_ok, a_ok, w0 + j, n_words, ONE_ROW, EVEN
            )
            acc = _fma_step(acc, words, sb, a0, a1, a2, a3, ONE_ROW)
            words, sb, a0, a1, a2, a3 = words_n, sb_n, a0_n, a1_n, a2_n, a3_n
        acc = _fma_step(acc, words, sb, a0, a1, a2, a3, ONE_ROW)
        return tl.sum(acc, axis=2)

    @triton.jit(do_not_specialize=["n_pairs"])
    def _fc1_fma_kernel(
        x_ptr,
        ids_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        h_ptr,
        n_pairs,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        BN: tl.constexpr,
        BW: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        # Program (pair, n-tile): gate and up rows n0..n0+BN of the pair's expert, SwiGLU.
        # EVEN: the tiles divide the rows and the K steps the words (no masks).
        p = tl.program_id(0)
        n0 = tl.program_id(1) * BN
        e = tl.load(ids_ptr + p).to(tl.int64)
        tok = (p // TOPK).to(tl.int64)
        gu = tl.arange(0, 2)
        rn = n0 + tl.arange(0, BN)
        rows = gu[:, None] * inter + rn[None, :]  # [2, BN]: gate rows, up rows
        row_ok = (rn < inter)[None, :] & (gu < 2)[:, None]
        w_rows = w_ptr.to(tl.pointer_type(tl.uint32)) + e * (stride_we // 4)
        w_rows += (rows * (stride_wn // 4))[:, :, None]
        s_rows = s_ptr + e * stride_se + (rows * stride_sn)[:, :, None]
        x_words = x_ptr.to(tl.pointer_type(tl.uint32)) + tok * (hidden // 2)
        dots = _fma_rows_dot(w_rows, s_rows, x_words, row_ok, None, hidden // 8, BW, True, EVEN)
        # 2^62 undoes the codes' 2^-126 and the activations' 2^64
        gu_out = dots * 4.611686018427388e18 * tl.load(g_ptr + 2 * e + gu)[:, None]
        gate, up = tl.split(tl.permute(_round_bf16(gu_out), 1, 0))
        h = _round_bf16(gate * tl.sigmoid(gate) * up)
        tl.store(h_ptr + p.to(tl.int64) * inter + rn, h.to(tl.bfloat16), mask=rn < inter)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _fc2_fma_kernel(
        h_ptr,
        ids_ptr,
        w_ptr,
        s_ptr,
        g_ptr,
        topk_w_ptr,
        out_ptr,
        routed_scale,
        n_tokens,
        hidden,
        inter,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        TOPK: tl.constexpr,
        K_PAD: tl.constexpr,
        BN: tl.constexpr,
        BW: tl.constexpr,
        COMBINE: tl.constexpr,
        EVEN: tl.constexpr,
    ):
        # Program (token, n-tile): output rows n0..n0+BN of each of the token's k experts at
        # once, each rounded to bf16 (the expert rows of the contract); then their weighted
        # sum in fp32 times the routed scale, one rounding (the finalize), or the k rows.
        t = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BN
        slot = tl.arange(0, K_PAD)
        slot_ok = slot < TOPK
        pr = t * TOPK + slot  # the token's pairs
        e = tl.load(ids_ptr + pr, mask=slot_ok, other=0).to(tl.int64)
        rn = n0 + tl.arange(0, BN)
        row_ok = slot_ok[:, None] & (rn < hidden)[None, :]
        w_rows = w_ptr.to(tl.pointer_type(tl.uint32)) + e[:, None] * (stride_we // 4)
        w_rows = (w_rows + rn[None, :] * (stride_wn // 4))[:, :, None]
        s_rows = (s_ptr + e[:, None] * stride_se + rn[None, :] * stride_sn)[:, :, None]
        h_words = h_ptr.to(tl.pointer_type(tl.uint32)) + pr * (inter // 2)
        dots = _fma_rows_dot(w_rows, s_rows, h_words, row_ok, slot_ok, inter // 8, BW, False, EVEN)
        g2 = tl.load(g_ptr + e, mask=slot_ok, other=0.0)
        rows = _round_bf16(dots * 4.611686018427388e18 * g2[:, None])
        if COMBINE:
            wt = tl.load(topk_w_ptr + pr, mask=slot_ok, other=0.0)
            total = tl.sum(rows * wt[:, None], axis=0)
            out = _round_bf16(total * routed_scale).to(tl.bfloat16)
            tl.store(out_ptr + t * hidden + rn, out, mask=rn < hidden)
        else:
            dst = out_ptr + pr[:, None] * hidden + rn[None, :]
            tl.store(dst, rows.to(tl.bfloat16), mask=row_ok)

    @triton.jit
    def _finalize_kernel(
        rows_ptr, w_ptr, out_ptr, routed_scale, hidden,
        TOPK: tl.constexpr, K_PAD: tl.constexpr, BH: tl.constexpr,
    ):  # fmt: skip
        # Program (token, column tile): sum_j w[t, j] * rows[t, j] in fp32 (the rows are the
        # experts' bf16 outputs), times the routed scale, one rounding.
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BH + tl.arange(0, BH)
        slot = tl.arange(0, K_PAD)
        ok = (slot < TOPK)[:, None] & (cols < hidden)[None, :]
        r = tl.load(rows_ptr + (t * TOPK + slot)[:, None] * hidden + cols[None, :], mask=ok)
        w = tl.load(w_ptr + t * TOPK + slot, mask=slot < TOPK, other=0.0)
        total = tl.sum(tl.where(ok, r.to(tl.float32), 0.0) * w[:, None], axis=0)
        out = _round_bf16(total * routed_scale).to(tl.bfloat16)
        tl.store(out_ptr + t * hidden + cols, out, mask=cols < hidden)

    @triton.jit
    def _store_blocks(blocks_ptr, b, expert, start, end, mask):
        # Rows b of blocks [NB, 3] = (expert, start, end), where mask.
        tl.store(blocks_ptr + 3 * b, expert, mask=mask)
        tl.store(blocks_ptr + 3 * b + 1, start, mask=mask)
        tl.store(blocks_ptr + 3 * b + 2, end, mask=mask)

    @triton.jit
    def _store_padding_blocks(blocks_ptr, real, n_blocks, NB_PAD: tl.constexpr):
        # The blocks after the `real` ones, up to the bound n_blocks: (-1, 0, 0).
        j = tl.arange(0, NB_PAD)
        zero = tl.zeros([NB_PAD], tl.int32)
        _store_blocks(blocks_ptr, j, zero - 1, zero, zero, (j >= real) & (j < n_blocks))

    @triton.jit
    def _sort_blocks_kernel(
        ids_ptr, order_ptr, blocks_ptr, n, num_experts, n_blocks,
        BM: tl.constexpr, N_PAD: tl.constexpr, E_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    ):  # fmt: skip
        # One program. Keys (expert, index) sort stably (ids below 0 first, from
        # num_experts last: in no block); a histogram counts each expert's pairs; the sorted
        # pair at rank r of its expert's run starts that expert's block r / BM when
        # r % BM == 0, and writes it.
        i = tl.arange(0, N_PAD)
        real = i < n
        ids = tl.load(ids_ptr + i, mask=real, other=0)
        ok = real & (ids >= 0) & (ids < num_experts)
        key_id = tl.where(ids < 0, -1, tl.minimum(ids, num_experts))
        keys = tl.sort(tl.where(real, key_id + 1, num_experts + 2) * N_PAD + i)
        e = keys // N_PAD - 1
        tl.store(order_ptr + i, keys % N_PAD, mask=real)
        counts = tl.histogram(tl.where(ok, ids, num_experts), E_PAD)
        counts = tl.where(tl.arange(0, E_PAD) < num_experts, counts, 0)
        first = tl.cumsum(counts, 0) - counts + tl.sum((real & (ids < 0)).to(tl.int32), 0)
        n_blk = (counts + BM - 1) // BM
        first_blk = tl.cumsum(n_blk, 0) - n_blk
        valid = (e >= 0) & (e < num_experts)
        ec = tl.where(valid, e, 0)
        run = tl.gather(first, ec, 0)
        end = run + tl.gather(counts, ec, 0)
        rank = i - run
        b = tl.gather(first_blk, ec, 0) + rank // BM
        starts = valid & (rank % BM == 0)
        _store_blocks(blocks_ptr, b, e, i, end, starts)
        _store_padding_blocks(blocks_ptr, tl.sum(n_blk, 0), n_blocks, NB_PAD)

    @triton.jit
    def _sort_bins(ids_ptr, c, n, num_experts, CHUNK: tl.constexpr):
        # Chunk c's pairs as sort bins: 0 below expert 0, e + 1 for expert e, num_experts + 1
        # from num_experts (in no block), num_experts + 2 past the last pair.
        i = c * CHUNK + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < n, other=0)
        bins = tl.where(ids < 0, 0, tl.minimum(ids, num_experts) + 1)
        return tl.where(i < n, bins, num_experts + 2)

    @triton.jit
    def _sort_count_kernel(ids_ptr, hist_ptr, n, num_experts, CHUNK: tl.constexpr,
                           B_PAD: tl.constexpr):  # fmt: skip
        # Program c: chunk c's histogram over the bins.
        c = tl.program_id(0)
        bins = _sort_bins(ids_ptr, c, n, num_experts, CHUNK)
        tl.store(hist_ptr + c * B_PAD + tl.arange(0, B_PAD), tl.histogram(bins, B_PAD))

    @triton.jit
    def _sort_offsets_kernel(
        hist_ptr, meta_ptr, blocks_ptr, n_chunks, num_experts, n_blocks,
        BM: tl.constexpr, C_PAD: tl.constexpr, B_PAD: tl.constexpr, NB_PAD: tl.constexpr,
    ):  # fmt: skip
        # One program: where each (chunk, bin) starts in the sorted order (bins in order,
        # chunks in order within a bin), each bin's start and size, each expert's first
        # block; the blocks past the last real one.
        c = tl.arange(0, C_PAD)[:, None]
        b = tl.arange(0, B_PAD)
        inside = (c < n_chunks) & (b <= num_experts + 1)[None, :]
        h = tl.load(hist_ptr + c * B_PAD + b[None, :], mask=inside, other=0)
        total = tl.sum(h, 0)
        start = tl.cumsum(total, 0) - total
        base = start[None, :] + tl.cumsum(h, 0) - h
        tl.store(hist_ptr + c * B_PAD + b[None, :], base, mask=c < n_chunks)
        n_blk = tl.where((b >= 1) & (b <= num_experts), (total + BM - 1) // BM, 0)
        tl.store(meta_ptr + b, start)
        tl.store(meta_ptr + B_PAD + b, total)
        tl.store(meta_ptr + 2 * B_PAD + b, tl.cumsum(n_blk, 0) - n_blk)
        _store_padding_blocks(blocks_ptr, tl.sum(n_blk, 0), n_blocks, NB_PAD)

    @triton.jit
    def _sort_scatter_kernel(
        ids_ptr, base_ptr, meta_ptr, order_ptr, blocks_ptr, n, num_experts,
        BM: tl.constexpr, CHUNK: tl.constexpr, B_PAD: tl.constexpr,
    ):  # fmt: skip
        # Program c: chunk c's pairs sorted by (bin, index); a pair's place is its
        # (chunk, bin)'s start plus its rank in the chunk's run of that bin; a pair at rank
        # r % BM == 0 of its expert writes the block it starts.
        c = tl.program_id(0)
        bins = _sort_bins(ids_ptr, c, n, num_experts, CHUNK)
        keys = tl.sort(bins * CHUNK + tl.arange(0, CHUNK))
        kb = keys // CHUNK
        counts = tl.histogram(bins, B_PAD)
        rank = tl.arange(0, CHUNK) - tl.gather(tl.cumsum(counts, 0) - counts, kb, 0)
        keep = kb <= num_experts + 1
        pos = tl.load(base_ptr + c * B_PAD + kb, mask=keep, other=0) + rank
        tl.store(order_ptr + pos, c * CHUNK + keys % CHUNK, mask=keep)
        start = tl.load(meta_ptr + kb, mask=keep, other=0)
        size = tl.load(meta_ptr + B_PAD + kb, mask=keep, other=0)
        first_blk = tl.load(meta_ptr + 2 * B_PAD + kb, mask=keep, other=0)
        r = pos - start
        starts = (kb >= 1) & (kb <= num_experts) & (r % BM == 0)
        blk = first_blk + r // BM
        _store_blocks(blocks_ptr, blk, kb - 1, pos, start + size, starts)


def finalize_rows(
    rows: torch.Tensor, topk_weights: torch.Tensor, routed_scale: float
) -> torch.Tensor:
    """The MoE finalize of the experts' rows [T, k, H] (bf16): weighted sum in fp32 times the
    routed scale, rounded once to bf16, [T, H]."""
    t, k, hidden = rows.shape
    out = torch.empty(t, hidden, device=rows.device, dtype=torch.bfloat16)
    if t == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _finalize_kernel[(t, triton.cdiv(hidden, block))](
        rows.contiguous(), topk_weights.reshape(-1).float().contiguous(), out,
        float(routed_scale), hidden, TOPK=k, K_PAD=triton.next_power_of_2(k), BH=block,
        num_warps=4,
    )  # fmt: skip
    return out


def sort_blocks(flat_ids: torch.Tensor, num_experts: int, bm: int):
    """Pairs sorted by expert, and blocks [NB, 3] = (expert, start, end) of <= bm rows.

    NB is a bound from shapes alone (no host sync, CUDA-graph safe): one partial block per
    expert plus the full ones; the blocks past the last real one are (-1, 0, 0). Ids outside
    [0, num_experts) are in no block (sorted first if negative, last if not). Triton kernels
    (`sort_path`: one launch to SORT_ONE_PROGRAM_PAIRS pairs, three beyond) or ~10 torch
    ops; all give the same tensors (a stable sort; the kernels take every id below 0 as -1
    and every id from num_experts as num_experts, which orders out-of-range ids differently
    only when they differ among themselves).
    """
    n = flat_ids.numel()
    bound = (n + bm - 1) // bm + min(num_experts, n)
    path = sort_path(flat_ids, num_experts)
    if path == "torch":
        return sort_blocks_torch(flat_ids, num_experts, bm)
    dev = flat_ids.device
    ids = flat_ids.to(torch.int32).contiguous()
    order = torch.empty(n, device=dev, dtype=torch.int32)
    blocks = torch.empty(bound, 3, device=dev, dtype=torch.int32)
    if n == 0:
        return order, blocks
    nb_pad = triton.next_power_of_2(bound)
    if path == "one program":
        _sort_blocks_kernel[(1,)](
            ids, order, blocks, n, num_experts, bound, BM=bm, N_PAD=triton.next_power_of_2(n),
            E_PAD=triton.next_power_of_2(num_experts + 1), NB_PAD=nb_pad,
            num_warps=8 if n <= 1024 else 16,
        )  # fmt: skip
        return order, blocks
    chunks, b_pad = triton.cdiv(n, SORT_CHUNK), _sort_bins_pad(num_experts)
    table = torch.empty(chunks * b_pad + 3 * b_pad, device=dev, dtype=torch.int32)
    hist, meta = table[: chunks * b_pad], table[chunks * b_pad :]
    _sort_count_kernel[(chunks,)](ids, hist, n, num_experts, CHUNK=SORT_CHUNK, B_PAD=b_pad)
    _sort_offsets_kernel[(1,)](
        hist, meta, blocks, chunks, num_experts, bound, BM=bm,
        C_PAD=triton.next_power_of_2(chunks), B_PAD=b_pad, NB_PAD=nb_pad, num_warps=16,
    )  # fmt: skip
    _sort_scatter_kernel[(chunks,)](
        ids, hist, meta, order, blocks, n, num_experts, BM=bm, CHUNK=SORT_CHUNK, B_PAD=b_pad,
        num_warps=8,
    )  # fmt: skip
    return order, blocks


def _sort_bins_pad(num_experts: int) -> int:
    return triton.next_power_of_2(num_experts + 3)  # below 0, experts, from E, padding


def sort_path(flat_ids: torch.Tensor, num_experts: int) -> str:
    """Which `sort_blocks` runs: "one program", "chunked" (three launches) or "torch"."""
    n = flat_ids.numel()
    if triton is None or not (flat_ids.is_cuda or _INTERPRET) or num_experts > SORT_MAX_EXPERTS:
        return "torch"
    chunks = -(-n // SORT_CHUNK)
    fits = chunks <= SORT_MAX_CHUNKS and (
        triton.next_power_of_2(chunks) * _sort_bins_pad(num_experts) <= SORT_TABLE_CELLS
    )
    if chunks > 1 and fits and (_INTERPRET or SORT_CHUNKED_ON_GPU):
        return "chunked"
    return "one program" if n <= SORT_ONE_PROGRAM_PAIRS else "torch"


def sort_blocks_torch(flat_ids: torch.Tensor, num_experts: int, bm: int):
    """`sort_blocks` in torch ops (any size, any device)."""
    n = flat_ids.numel()
    sorted_ids, order = torch.sort(flat_ids, stable=True)
    dev = flat_ids.device
    offsets = torch.searchsorted(
        sorted_ids, torch.arange(num_experts + 1, device=dev, dtype=sorted_ids.dtype)
    )
    counts = offsets[1:] - offsets[:-1]
    n_blocks = (counts + bm - 1) // bm
    block_end = torch.cumsum(n_blocks, 0)
    bound = (n + bm - 1) // bm + min(num_experts, n)
    b = torch.arange(bound, device=dev)
    expert = torch.searchsorted(block_end, b, right=True)
    valid = expert < num_experts
    ec = expert.clamp(max=num_experts - 1)
    start = offsets[ec] + (b - (block_end[ec] - n_blocks[ec])) * bm
    blocks = torch.stack((torch.where(valid, expert, -1), start, offsets[ec + 1]), 1)
    blocks[:, 1:] *= valid[:, None]  # past the last real block: (-1, 0, 0)
    return order.to(torch.int32), blocks.to(torch.int32).contiguous()


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scales: tuple[torch.Tensor, ...] | None = None,
    topk_weights: torch.Tensor | None = None,
    routed_scale: float = 1.0,
    config: Config | None = None,
) -> torch.Tensor:
    """Experts on bf16 `x [T, H]`: combined `[T, H]` if `topk_weights` is given, else rows.

    `scales = (w13_scale, w13_global, w2_scale, w2_global)` makes `w13`/`w2` NVFP4 (packed
    uint8, `kernels/moe/nvfp4.py` layout); None means bf16 weights `[E, 2I, H]`, `[E, H, I]`.
    """
    fp4 = scales is not None
    t, k = topk_ids.shape
    n_pairs, hidden = t * k, x.shape[1]
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    combine = topk_weights is not None
    dev = x.device
    if n_pairs == 0:
        return x.new_zeros(t, hidden) if combine else x.new_zeros(t, k, hidden)
    cfg = config or pick_config(n_pairs, hidden, inter, fp4, num_experts)
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    if cfg.fma and fp4:
        return _moe_fma(x, ids, t, k, w13, w2, scales, topk_weights, routed_scale, cfg)
    if combine and cfg.combine_rows:
        rows = moe(x, topk_ids, w13, w2, scales, None, config=cfg)
        return finalize_rows(rows, topk_weights, routed_scale)
    if cfg.scan:
        order = blocks = ids  # unused
        grid_m = n_pairs
    else:
        order, blocks = sort_blocks(ids, num_experts, cfg.bm)
        grid_m = blocks.shape[0]
    if fp4:
        s13, g13, s2, g2 = scales
        s13, s2 = s13.view(torch.uint8), s2.view(torch.uint8)
        g13, g2 = g13.float().contiguous(), g2.float().contiguous()
    else:
        s13, g13, s2, g2 = w13, w13, w2, w2  # unused
    x = x.contiguous()
    h = torch.empty(n_pairs, inter, device=dev, dtype=torch.bfloat16)
    n_tiles2 = hidden // cfg.bn2
    if combine:
        work = torch.empty(t * hidden + t * n_tiles2, device=dev, dtype=torch.int32)
        acc, counts = work[: t * hidden].view(torch.float32), work[t * hidden :]
        out = torch.empty(t, hidden, device=dev, dtype=torch.bfloat16)
        weights = topk_weights.reshape(-1).contiguous()
    else:
        work = acc = counts = weights = ids  # unused
        out = torch.empty(t, k, hidden, device=dev, dtype=torch.bfloat16)
    p_pad = triton.next_power_of_2(n_pairs) if cfg.scan else 1
    decode = cfg.decode if fp4 else 0
    g_mult = 128.0 if decode == 1 else 1.0  # the words decode leaves 2^7 to the global scale
    _fc1_kernel[(grid_m, inter // cfg.bn1)](
        x,
        ids,
        order,
        blocks,
        w13,
        s13,
        g13,
        h,
        work,
        work.numel() if combine else 0,
        n_pairs,
        hidden,
        inter,
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        TOPK=k,
        SCAN=cfg.scan,
        P_PAD=p_pad,
        BM=cfg.bm,
        BN=cfg.bn1,
        BK=cfg.bk1,
        FP4=fp4,
        STAGES=cfg.stages1,
        ZERO_BLOCK=1024,
        DECODE=decode,
        G_MULT=g_mult,
        num_warps=cfg.warps1,
    )
    _fc2_kernel[(grid_m, n_tiles2)](
        h,
        ids,
        order,
        blocks,
        w2,
        s2,
        g2,
        weights,
        out,
        acc,
        counts,
        float(routed_scale),
        n_pairs,
        hidden,
        inter,
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        TOPK=k,
        SCAN=cfg.scan,
        P_PAD=p_pad,
        BM=cfg.bm,
        BN=cfg.bn2,
        BK=cfg.bk2,
        FP4=fp4,
        COMBINE=combine,
        STAGES=cfg.stages2,
        DECODE=decode,
        G_MULT=g_mult,
        num_warps=cfg.warps2,
    )
    return out


def _moe_fma(x, ids, t, k, w13, w2, scales, topk_weights, routed_scale, cfg: Config):
    """NVFP4 experts in fp32 FMAs: FC1 + SwiGLU per (pair, row tile), FC2 + finalize per
    (token, row tile); two launches, no atomics."""
    s13, g13, s2, g2 = scales
    h = fma_fc1(x, ids, k, w13, s13, g13, cfg)
    return fma_fc2(h, ids, t, k, w2, s2, g2, topk_weights, routed_scale, x.shape[1], cfg)


def fma_fc1(x, ids, k, w13, s13, g13, cfg: Config) -> torch.Tensor:
    """The FMA path's first launch: SwiGLU(x W1, x W3) per (token, expert) pair, [P, I] bf16
    (`ids`: the flat expert ids of the pairs, k per token)."""
    s13, g13 = s13.view(torch.uint8), g13.float().contiguous()
    n_pairs, hidden = ids.numel(), x.shape[1]
    inter = w13.shape[1] // 2
    x = x.contiguous()
    if x.data_ptr() % 4:  # activations are read as 32-bit pairs
        x = x.clone()
    h = torch.empty(n_pairs, inter, device=x.device, dtype=torch.bfloat16)
    bw1 = min(cfg.bk1 // 8, triton.next_power_of_2(hidden // 8))
    _fc1_fma_kernel[(n_pairs, triton.cdiv(inter, cfg.bn1))](
        x, ids, w13, s13, g13, h, n_pairs, hidden, inter,
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        TOPK=k, BN=cfg.bn1, BW=bw1, EVEN=inter % cfg.bn1 == 0 and hidden % (8 * bw1) == 0,
        num_warps=cfg.warps1,
    )  # fmt: skip
    return h


def fma_fc2(h, ids, t, k, w2, s2, g2, topk_weights, routed_scale, hidden, cfg: Config):
    """The FMA path's second launch: the pairs' rows h W2, finalized per token (combined
    [T, H] when `topk_weights` is given, else the rows [T, k, H])."""
    s2, g2 = s2.view(torch.uint8), g2.float().contiguous()
    inter = h.shape[1]
    combine = topk_weights is not None
    if combine:
        out = torch.empty(t, hidden, device=h.device, dtype=torch.bfloat16)
        weights = topk_weights.reshape(-1).float().contiguous()
    else:
        out = torch.empty(t, k, hidden, device=h.device, dtype=torch.bfloat16)
        weights = g2
    bw2 = min(cfg.bk2 // 8, triton.next_power_of_2(inter // 8))
    _fc2_fma_kernel[(t, triton.cdiv(hidden, cfg.bn2))](
        h, ids, w2, s2, g2, weights, out, float(routed_scale), t, hidden, inter,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        TOPK=k, K_PAD=triton.next_power_of_2(k), BN=cfg.bn2, BW=bw2, COMBINE=combine,
        EVEN=k & (k - 1) == 0 and hidden % cfg.bn2 == 0 and inter % (8 * bw2) == 0,
        num_warps=cfg.warps2,
    )  # fmt: skip
    return out


LAUNCHES = 2  # per call at <= SCAN_MAX_PAIRS pairs; above, plus the sort (`sort_path`: 1
# or 3 launches, ~10 torch ops beyond)


# --- providers ----------------------------------------------------------------------------


def _why_not(x, topk_ids, w13, w2, scales=None) -> str | None:
    """Device, dtypes, and the experts' layout (`why_not_layout`); `scales` for NVFP4."""
    if triton is None:
        return "Triton is not installed"
    if x.device.type != "cuda" and not _INTERPRET:
        return f"needs a CUDA tensor, got device {x.device}"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0):
        return "needs compute capability 8.0 or newer (bf16 tensor cores)"
    if x.dtype != torch.bfloat16:
        return f"needs bf16 activations, got {x.dtype}"
    reason = why_not_layout(x, topk_ids, w13, w2, scales)
    if reason:
        return reason
    hidden, inter = x.shape[-1], w13.shape[1] // 2
    if hidden % 64 or inter % 32:
        return f"needs hidden % 64 == 0 and moe_intermediate % 32 == 0, got {hidden}, {inter}"
    if topk_ids.dtype not in (torch.int32, torch.int64):
        return f"needs integer topk_ids, got {topk_ids.dtype}"
    return None


def _byte_offset(w: torch.Tensor) -> int:
    """The tensor's address, or where it has none (a fake tensor while compiling: its
    storage is allocated aligned), its offset into its storage, in bytes."""
    if is_fake(w):
        return w.storage_offset() * w.element_size()
    return w.data_ptr()


def _why_not_weights(fp4: bool, w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    want = torch.uint8 if fp4 else torch.bfloat16
    if w13.dtype != want or w2.dtype != want:
        return f"needs {want} expert weights, got {w13.dtype} and {w2.dtype}"
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return "needs expert weights contiguous along K"
    if fp4:  # the kernels read the codes as 32-bit words
        for name, w in (("w13", w13), ("w2", w2)):
            bad = [st for st in w.stride()[:-1] if st % 4]
            if _byte_offset(w) % 4 or bad:
                return (
                    f"needs NVFP4 {name} at a 4-byte aligned address with row strides a "
                    f"multiple of 4 bytes, got address offset {_byte_offset(w) % 4} and strides "
                    f"{tuple(w.stride())}; pass a contiguous copy (`.contiguous()` or `.clone()`)"
                )
    return None


def moe_experts(x, w13, w2, topk_ids):
    return moe(x, topk_ids, w13, w2)


def supports_moe_experts(x, w13, w2, topk_ids):
    return _why_not(x, topk_ids, w13, w2) or _why_not_weights(False, w13, w2)


def mega_moe(x, topk_weights, topk_ids, w13, w2, routed_scale):
    return moe(x, topk_ids, w13, w2, topk_weights=topk_weights, routed_scale=routed_scale)


def supports_mega_moe(x, topk_weights, topk_ids, w13, w2, routed_scale):
    return supports_moe_experts(x, w13, w2, topk_ids)


def moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids):
    return moe(x, topk_ids, w13, w2, (w13_scale, w13_global, w2_scale, w2_global))


def supports_moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, ids):
    scales = (w13_scale, w13_global, w2_scale, w2_global)
    return _why_not(x, ids, w13, w2, scales) or _why_not_weights(True, w13, w2)


def mega_moe_nvfp4(
    x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, routed_scale
):
    return moe(
        x,
        topk_ids,
        w13,
        w2,
        (w13_scale, w13_global, w2_scale, w2_global),
        topk_weights,
        routed_scale,
    )


def supports_mega_moe_nvfp4(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, *rest):
    return supports_moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, *rest[:2], topk_ids)


_AVAILABLE = triton is not None and not _INTERPRET and torch.cuda.is_available()
MOE_EXPERTS = Provider("triton", moe_experts, supports_moe_experts) if _AVAILABLE else None
MEGA_MOE = Provider("triton", mega_moe, supports_mega_moe) if _AVAILABLE else None
MOE_EXPERTS_NVFP4 = (
    Provider("triton", moe_experts_nvfp4, supports_moe_experts_nvfp4) if _AVAILABLE else None
)
MEGA_MOE_NVFP4 = Provider("triton", mega_moe_nvfp4, supports_mega_moe_nvfp4) if _AVAILABLE else None
