"""The CuTeDSL wgmma kernel of `kernels/moe/cutedsl.py` for many pairs (imported only where
CuTeDSL is installed): NVFP4 weights decoded in registers as wgmma's A operand, the
activations (B) and the weights' codes and scales staged in shared memory.

The pairs are sorted into blocks of up to `bn` of one expert (`triton.sort_blocks`). A CTA is
`wgs` warpgroups and owns one block and `mt` x 64 weight rows a warpgroup (warp w of a
warpgroup holds rows 16w..16w+15 of each 64: the 16-row tile of the fragment layout, in the
registers `mma.sync` takes, which are wgmma's too). Its K loop, a chunk of 64 at a time:
- chunk c + stages - 1 copies into shared memory (`cp.async`, 16 bytes a thread at a time,
  one commit group a chunk): the block's activation rows in 128-byte swizzle atoms, the
  layout wgmma's matrix descriptor reads (K-major, 8 rows x 128 bytes, 1024 bytes apart),
  and each warp's codes (512 bytes a tile) and scales (64);
- each warp reads its tiles' codes and scales of chunk c from shared memory and decodes them;
- 4 x `mt` `wgmma.m64n{bn}k16` a warpgroup, waited before the next chunk (the SM's other
  CTAs fill the gap).
Both warpgroups of a CTA read the same activation stages, so a block's activations cross
from L2 once a CTA of 64 x `mt` x `wgs` rows. The activations' K is permuted within each 16
as the fragment layout permutes the weights' (`permute_k` in `cutedsl.py`). FC1's epilogue
applies SwiGLU (a thread holds a gate row and its up row) and writes h in sorted order with K
permuted, so FC2's B rows are contiguous; FC2 writes each pair's bf16 row for the finalize
launch. FC2's CTA may take `walk` slices of the hidden rows in turn, its copies for the next
slice's K in flight during this slice's last chunks, and with `stage_out` its rows go through
shared memory first, each warp then writing a pair's 64 x `mt` x `wgs` columns 16 bytes a
store (2-byte stores straight from the accumulators otherwise) (MoE run 21).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from beamfx.kernels.moe import fragments as frag
from beamfx.kernels.moe.cutedsl_kernels import (
    _asm,
    decode_tile,
    ld_f32,
    ld_s32,
    ld_shared_v2,
    ld_shared_v4,
    round_bf16,
    st_bf16,
    thread_coords,
    tile_scales,
)

WARPGROUP = 128  # threads of a CTA


@dsl_user_op
def cp_async16(smem, src, *, loc=None, ip=None):
    _asm([], [Int32(smem), Int64(src)], "cp.async.cg.shared.global [$0], [$1], 16;", "r,l",
         True, loc, ip)  # fmt: skip


@dsl_user_op
def st_shared_bf16(addr, value, *, loc=None, ip=None):
    _asm([], [Int32(addr), Float32(value)],
         "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; st.shared.b16 [$0], h; }",
         "r,f", True, loc, ip)  # fmt: skip


@dsl_user_op
def st_v4(addr, v, *, loc=None, ip=None):
    _asm([], [Int64(addr), *v], "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r", True,
         loc, ip)  # fmt: skip


@dsl_user_op
def ptx(text, *, loc=None, ip=None):
    """One PTX statement without operands, kept in program order: `cp.async.commit_group`,
    `cp.async.wait_group N` (until at most N of this thread's copy groups are in flight),
    `fence.proxy.async.shared::cta` (the copies' shared-memory writes made visible to
    wgmma's reads), `wgmma.fence`, `wgmma.commit_group`, `wgmma.wait_group N`."""
    _asm([], [], text, "", True, loc, ip)


@dsl_user_op
def smem_desc(addr, *, loc=None, ip=None):
    """wgmma matrix descriptor of a K-major bf16 operand at shared address `addr`: 128-byte
    swizzle (layout type 1), 8-row atoms 1024 bytes apart (stride 64 x 16), leading
    offset unused (1)."""
    return _asm(
        [Int64], [Int32(addr)],
        "{ .reg .b32 lo, hi; shr.u32 lo, $1, 4; and.b32 lo, lo, 0x3FFF; "
        "or.b32 lo, lo, 0x10000; mov.b32 hi, 0x40000040; mov.b64 $0, {lo, hi}; }",
        "=l,r", False, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def wgmma(acc, a, desc, *, loc=None, ip=None):
    """acc += A (registers: this warp's 16 x 16 fragment) x B (shared memory, `desc`):
    `wgmma.m64n{2 len(acc)}k16`, bf16 in, fp32 accumulate."""
    m = len(acc)
    d = ", ".join(f"${i}" for i in range(m))
    a_regs = ", ".join(f"${m + i}" for i in range(4))
    ptx = (
        f"{{ .reg .pred p; setp.ne.b32 p, ${m + 5}, 0; "
        f"wgmma.mma_async.sync.aligned.m64n{2 * m}k16.f32.bf16.bf16 {{{d}}}, {{{a_regs}}}, "
        f"${m + 4}, p, 1, 1, 0; }}"
    )
    cons = ",".join(["=f"] * m + ["r"] * 4 + ["l", "r"] + [str(i) for i in range(m)])
    return _asm([Float32] * m, [*a, Int64(desc), Int32(1), *acc], ptx, cons, True, loc, ip)


@cute.jit
def copy_chunk(
    n, at_x, src, at_w, w_src, s_src, lane, warp, per: cutlass.Constexpr,
    stride: cutlass.Constexpr, mt: cutlass.Constexpr, wpc: cutlass.Constexpr,
):  # fmt: skip
    """Start chunk n's copies into its stage (not committed): this thread's `per` 16-byte
    units of the block's activation rows (at `at_x`, `stride` apart), its own 16 bytes of
    the warp's codes (512 a tile) and, lanes 0-3, the warp's scales (64 a tile) (at `at_w`)."""
    for q in cutlass.range_constexpr(per):
        cp_async16(at_x + q * stride, src[q] + n * 128)
    for m in cutlass.range_constexpr(mt):
        cp_async16(at_w + (m * wpc + warp) * 512 + lane * 16, w_src[m] + Int64(n) * 512)
    if lane < 4:
        for m in cutlass.range_constexpr(mt):
            at_s = at_w + mt * wpc * 512 + (m * wpc + warp) * 64 + lane * 16
            cp_async16(at_s, s_src[m] + Int64(n) * 64)


@cute.jit
def read_weights(at, lane, warp, g, mt: cutlass.Constexpr, wpc: cutlass.Constexpr):
    """The warp's codes and scales of one chunk from the weights' stage at `at`."""
    w = ()
    s = ()
    for m in cutlass.range_constexpr(mt):
        w = w + ld_shared_v4(at + (m * wpc + warp) * 512 + lane * 16)
        s = s + ld_shared_v2(at + mt * wpc * 512 + (m * wpc + warp) * 64 + g * 8)
    return w, s


@cute.jit
def chunk_mma(acc, frags, stage_at, mt: cutlass.Constexpr, bn: cutlass.Constexpr):
    """acc += this chunk's A fragments x the stage at `stage_at`: 4 x `mt` wgmmas, one
    commit group (not waited here)."""
    ptx("wgmma.fence.sync.aligned;")
    new = ()
    for m in cutlass.range_constexpr(mt):
        part = acc[m * (bn // 2) : (m + 1) * (bn // 2)]
        for i in cutlass.range_constexpr(4):
            f = 16 * m + 4 * i
            part = wgmma(part, frags[f : f + 4], smem_desc(stage_at + i * 32))
        new = new + part
    ptx("wgmma.commit_group.sync.aligned;")
    return new


@cute.jit
def decode_chunk(w, s, mt: cutlass.Constexpr):
    """The A fragments of one chunk, 4 registers a 16 x 16 tile, tiles in wgmma order."""
    frags = ()
    for m in cutlass.range_constexpr(mt):
        for i in cutlass.range_constexpr(4):
            frags = frags + decode_tile(w[4 * m + i], tile_scales(s[2 * m + i // 2], i % 2))
    return frags


@cute.kernel
def gemm_kernel(
    act: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, gscale: Int64,
    out: Int64, k_dim: Int32, rows: Int32, out_stride: Int32, topk: cutlass.Constexpr,
    bn: cutlass.Constexpr, mt: cutlass.Constexpr, stages: cutlass.Constexpr,
    swiglu: cutlass.Constexpr, wgs: cutlass.Constexpr, walk: cutlass.Constexpr,
    stage_out: cutlass.Constexpr,
):  # fmt: skip
    """One block of pairs x `walk` slices of the weights, `wgs` x `mt` x 64 rows each, taken
    one after the other (the copies run on from one slice's K into the next's). `swiglu`
    (FC1): B rows are the pairs' tokens of `act` (x, K permuted), the output h in sorted
    order, K permuted; else (FC2): B rows are `act` rows in sorted order (h), the output
    each pair's row (`stage_out`: through shared memory, 16 bytes a store)."""
    mw, blk, _ = cute.arch.block_idx()  # slices fastest: a block's activations stay in L2
    tid, warp, lane, g, lc = thread_coords()
    wpc = 4 * wgs  # warps a CTA
    wstage = mt * wpc * 576  # bytes of weights a stage: codes 512 and scales 64 a tile
    words = stages * (bn * 32 + wstage // 4)
    pitch = mt * wpc * 32 + 16  # bytes a pair's rows take in the output stage (+16: banks)
    if cutlass.const_expr(stage_out):
        words = words + bn * pitch // 4
    base = cute.arch.alloc_smem(Int32, words, alignment=1024).toint()
    ahead = stages - 1  # chunks the copies run ahead
    e = ld_s32(blocks + Int64(blk) * 12)
    if e >= 0:
        start = ld_s32(blocks + Int64(blk) * 12 + 4)
        cols = cutlass.min(ld_s32(blocks + Int64(blk) * 12 + 8) - start, bn)
        kc = k_dim // 64
        n_tiles = rows // 16
        stage_bytes = bn * 128
        # this thread's copies: 16 bytes (unit u of 8 in a 128-byte row) of rows n_q
        u = tid % 8
        dst = (tid // 8) * 128 + ((u ^ ((tid // 8) % 8)) * 16)
        per = bn * 8 // (WARPGROUP * wgs)  # copies a thread makes a chunk
        stride = 4 * wpc * 128  # between them: the CTA's threads cover 4 x wpc rows
        src = ()
        for q in cutlass.range_constexpr(per):
            r = start + cutlass.min(tid // 8 + 4 * wpc * q, cols - 1)
            row = Int64(r)
            if cutlass.const_expr(swiglu):
                row = Int64(ld_s32(order + Int64(r) * 4) // topk)
            src = src + (act + row * k_dim * 2 + u * 16,)
        w_at, s_at = weight_srcs(codes, scales, e, mw * walk, n_tiles, kc, lane, warp, mt, wpc)
        wbase = base + stages * stage_bytes
        chunks = walk * kc  # this CTA's K loop, slice after slice
        srcs = (src, w_at, s_at, codes, scales, e, mw * walk, n_tiles, kc)
        for n in cutlass.range_constexpr(ahead):
            if n < chunks:
                copy_walk(n, base + n * stage_bytes + dst, wbase + n * wstage, srcs, lane, warp,
                          per, stride, mt, wpc, walk)  # fmt: skip
            ptx("cp.async.commit_group;")
        for sw in cutlass.range_constexpr(walk):
            acc = (Float32(0.0),) * (mt * bn // 2)
            for c in cutlass.range(sw * kc, sw * kc + kc):
                ptx(f"cp.async.wait_group {ahead - 1};")
                ptx("fence.proxy.async.shared::cta;")
                cute.arch.sync_threads()  # chunk c landed; every warp is past chunk c - 1
                n = c + ahead
                if n < chunks:  # into the stage chunk c - 1 used
                    st = n % stages
                    copy_walk(n, base + st * stage_bytes + dst, wbase + st * wstage, srcs, lane,
                              warp, per, stride, mt, wpc, walk)  # fmt: skip
                ptx("cp.async.commit_group;")
                w, s = read_weights(wbase + (c % stages) * wstage, lane, warp, g, mt, wpc)
                frags = decode_chunk(w, s, mt)
                acc = chunk_mma(acc, frags, base + (c % stages) * stage_bytes, mt, bn)
                ptx("wgmma.wait_group.sync.aligned 0;")
            mc = (mw * walk + sw) * mt
            if cutlass.const_expr(stage_out):
                out_at = wbase + stages * wstage
                staged_rows(acc, out, order, gscale, e, start, cols, out_stride, mc, n_tiles,
                            out_at, tid, warp, g, lc, bn, mt, wpc, pitch)  # fmt: skip
            else:
                epilogue(acc, out, order, gscale, e, start, cols, out_stride, mc, n_tiles, warp,
                         g, lc, swiglu, bn, mt, wpc)  # fmt: skip


@cute.jit
def copy_walk(n, at_x, at_w, srcs, lane, warp, per: cutlass.Constexpr, stride: cutlass.Constexpr,
              mt: cutlass.Constexpr, wpc: cutlass.Constexpr, walk: cutlass.Constexpr):  # fmt: skip
    """`copy_chunk` of chunk n of the CTA's walk: chunk n % kc of its slice n // kc (`srcs`:
    the activations' and first slice's weights' sources, and what the others' take)."""
    src, w_at, s_at, codes, scales, e, first, n_tiles, kc = srcs
    if cutlass.const_expr(walk > 1):
        sl = n // kc
        w_n, s_n = weight_srcs(codes, scales, e, first + sl, n_tiles, kc, lane, warp, mt, wpc)
        copy_chunk(n - sl * kc, at_x, src, at_w, w_n, s_n, lane, warp, per, stride, mt, wpc)
    else:
        copy_chunk(n, at_x, src, at_w, w_at, s_at, lane, warp, per, stride, mt, wpc)


@cute.jit
def weight_srcs(codes, scales, e, sl, n_tiles, kc, lane, warp, mt: cutlass.Constexpr,
                wpc: cutlass.Constexpr):  # fmt: skip
    """This thread's sources of slice `sl`'s codes and scales, a tile at a time (rows past
    the weights read the last tile; the epilogue drops them)."""
    w_at = ()
    s_at = ()
    for m in cutlass.range_constexpr(mt):
        rt = cutlass.min(sl * mt * wpc + m * wpc + warp, n_tiles - 1)
        tile = Int64(e) * n_tiles + rt
        w_at = w_at + (codes + tile * kc * 512 + lane * 16,)
        s_at = s_at + (scales + tile * kc * 64 + lane * 16,)
    return w_at, s_at


@cute.jit
def epilogue(acc, out, order, gscale, e, start, cols, out_stride, mc, n_tiles, warp, g, lc,
             swiglu: cutlass.Constexpr, bn: cutlass.Constexpr, mt: cutlass.Constexpr,
             wpc: cutlass.Constexpr):  # fmt: skip
    """Tile rows g (FC1: gate) and g + 8 (FC1: up), columns 8j + 2 lc + h, of the slice whose
    first tile is `mc` x `wpc`: FC1 SwiGLU into h, FC2 each pair's row."""
    if cutlass.const_expr(swiglu):
        g_gate = ld_f32(gscale + Int64(e) * 8) * frag.UNDO
        g_up = ld_f32(gscale + Int64(e) * 8 + 4) * frag.UNDO
    else:
        g_row = ld_f32(gscale + Int64(e) * 4) * frag.UNDO
    for m in cutlass.range_constexpr(mt):
        rt = mc * wpc + m * wpc + warp
        if rt < n_tiles:
            for j in cutlass.range_constexpr(bn // 8):
                for h in cutlass.range_constexpr(2):
                    col = 8 * j + 2 * lc + h
                    v0 = acc[m * (bn // 2) + 4 * j + h]
                    v1 = acc[m * (bn // 2) + 4 * j + 2 + h]
                    if col < cols:
                        if cutlass.const_expr(swiglu):
                            gate = round_bf16(v0 * g_gate)
                            up = round_bf16(v1 * g_up)
                            a = gate / (1.0 + cute.math.exp(-gate)) * up
                            i = frag.permuted_k(rt * 8 + g)
                            st_bf16(out + (Int64(start + col) * out_stride + i) * 2, a)
                        else:
                            pair = ld_s32(order + Int64(start + col) * 4)
                            at = out + (Int64(pair) * out_stride + rt * 16 + g) * 2
                            st_bf16(at, v0 * g_row)
                            st_bf16(at + 16, v1 * g_row)


@cute.jit
def staged_rows(acc, out, order, gscale, e, start, cols, out_stride, mc, n_tiles, at, tid,
                warp, g, lc, bn: cutlass.Constexpr, mt: cutlass.Constexpr,
                wpc: cutlass.Constexpr, pitch: cutlass.Constexpr):  # fmt: skip
    """FC2's `epilogue` through shared memory at `at` (its own, apart from the stages the next
    slice's copies fill): each pair's bf16 rows of the slice gathered in a column `pitch`
    bytes apart, then written 16 bytes a thread, a warp a pair."""
    g_row = ld_f32(gscale + Int64(e) * 4) * frag.UNDO
    cute.arch.sync_threads()  # every thread is past the last slice's reads of the stage
    for m in cutlass.range_constexpr(mt):
        r0 = (m * wpc + warp) * 16 + g
        for j in cutlass.range_constexpr(bn // 8):
            for h in cutlass.range_constexpr(2):
                col_at = at + (8 * j + 2 * lc + h) * pitch
                st_shared_bf16(col_at + r0 * 2, acc[m * (bn // 2) + 4 * j + h] * g_row)
                st_shared_bf16(col_at + r0 * 2 + 16, acc[m * (bn // 2) + 4 * j + 2 + h] * g_row)
    cute.arch.sync_threads()
    segs = mt * wpc * 2  # 16-byte units in a pair's rows of the slice
    rows_left = n_tiles * 16 - mc * wpc * 16
    for q in cutlass.range_constexpr(bn * segs // (32 * wpc)):
        u = tid + q * 32 * wpc
        col = u // segs
        seg = u % segs
        if col < cols and seg * 8 < rows_left:
            pair = ld_s32(order + Int64(start + col) * 4)
            v = ld_shared_v4(at + col * pitch + seg * 16)
            st_v4(out + (Int64(pair) * out_stride + mc * wpc * 16 + seg * 8) * 2, v)


def launch_args(slices, n_blocks, wgs, ctas, stream) -> dict:
    """Grid [slices, blocks] (slices fastest), `wgs` warpgroups a CTA, registers capped for
    `ctas` CTAs an SM (with the shared-memory carveout at its largest so they fit)."""
    carveout = 100 if ctas > 1 else None
    return dict(grid=[slices, n_blocks, 1], block=[WARPGROUP * wgs, 1, 1], stream=stream,
                min_blocks_per_mp=ctas, preferred_smem_carveout=carveout)  # fmt: skip


@cute.jit
def fc1_host(
    x: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    n_blocks: Int32, hidden: Int32, inter: Int32, stream, topk: cutlass.Constexpr,
    bn: cutlass.Constexpr, mt: cutlass.Constexpr, stages: cutlass.Constexpr,
    ctas: cutlass.Constexpr, wgs: cutlass.Constexpr,
):  # fmt: skip
    """FC1 + SwiGLU (its K, hidden, is long enough that a CTA takes one slice)."""
    slices = (2 * inter + 64 * mt * wgs - 1) // (64 * mt * wgs)
    gemm_kernel(
        x, order, blocks, codes, scales, g13, h, hidden, 2 * inter, inter, topk, bn, mt,
        stages, True, wgs, 1, False,
    ).launch(**launch_args(slices, n_blocks, wgs, ctas, stream))  # fmt: skip


@cute.jit
def fc2_host(
    h: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g2: Int64, rows: Int64,
    n_blocks: Int32, hidden: Int32, inter: Int32, stream, bn: cutlass.Constexpr,
    mt: cutlass.Constexpr, stages: cutlass.Constexpr, ctas: cutlass.Constexpr,
    wgs: cutlass.Constexpr, walk: cutlass.Constexpr, stage_out: cutlass.Constexpr,
):  # fmt: skip
    """FC2, each CTA `walk` slices of the hidden rows in turn."""
    slices = (hidden + 64 * mt * wgs - 1) // (64 * mt * wgs)
    gemm_kernel(
        h, order, blocks, codes, scales, g2, rows, inter, hidden, hidden, 1, bn, mt, stages,
        False, wgs, walk, stage_out,
    ).launch(**launch_args((slices + walk - 1) // walk, n_blocks, wgs, ctas, stream))  # fmt: skip
