"""The CuTeDSL wgmma kernel of `kernels/moe/cutedsl.py` for many pairs (imported only where
CuTeDSL is installed): NVFP4 weights decoded in registers as wgmma's A operand, the
activations (B) staged in shared memory.

The pairs are sorted into blocks of up to `bn` of one expert (`triton.sort_blocks`). A CTA is
one warpgroup and owns one block and `mt` x 64 weight rows (warp w of the warpgroup holds rows
16w..16w+15 of each 64: the 16-row tile of the fragment layout, in the registers `mma.sync`
takes, which are wgmma's too). Its K loop, a chunk of 64 at a time:
- the block's activation rows for chunk c + stages - 1 copy into shared memory (`cp.async`,
  16 bytes a thread at a time) in 128-byte swizzle atoms, the layout wgmma's matrix
  descriptor reads (K-major, 8 rows x 128 bytes, 1024 bytes apart);
- each warp decodes its tiles' codes of chunk c (loaded two chunks ahead into registers);
- 4 x `mt` `wgmma.m64n{bn}k16`, waited before the next chunk (the SM's other CTAs fill the
  gap).
The activations' K is permuted within each 16 as the fragment layout permutes the weights'
(`permute_k` in `cutedsl.py`). FC1's epilogue applies SwiGLU (a thread holds a gate row and
its up row) and writes h in sorted order with K permuted, so FC2's B rows are contiguous;
FC2 writes each pair's bf16 row for the finalize launch.
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
    ld_v2,
    ld_v4,
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
def load_weights(w_at, s_at, ch, mt: cutlass.Constexpr):
    """Codes (4 words) and scales (2 words) of chunk `ch` for each of the warp's `mt` tiles."""
    w = ()
    s = ()
    for m in cutlass.range_constexpr(mt):
        w = w + ld_v4(w_at[m] + Int64(ch) * 512)
        s = s + ld_v2(s_at[m] + Int64(ch) * 64)
    return w, s


@cute.kernel
def gemm_kernel(
    act: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, gscale: Int64,
    out: Int64, k_dim: Int32, rows: Int32, out_stride: Int32, topk: cutlass.Constexpr,
    bn: cutlass.Constexpr, mt: cutlass.Constexpr, stages: cutlass.Constexpr,
    swiglu: cutlass.Constexpr,
):  # fmt: skip
    """One block of pairs x `mt` 64-row slices of the weights. `swiglu` (FC1): B rows are
    the pairs' tokens of `act` (x, K permuted), the output h in sorted order, K permuted;
    else (FC2): B rows are `act` rows in sorted order (h), the output each pair's row."""
    mc, blk, _ = cute.arch.block_idx()  # slices fastest: a block's activations stay in L2
    tid, warp, lane, g, lc = thread_coords()
    base = cute.arch.alloc_smem(Int32, stages * bn * 32, alignment=1024).toint()
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
        per = bn * 8 // WARPGROUP  # copies a thread makes a chunk, 16 rows apart
        stride = 16 * 128
        src = ()
        for q in cutlass.range_constexpr(per):
            r = start + cutlass.min(tid // 8 + 16 * q, cols - 1)
            row = Int64(r)
            if cutlass.const_expr(swiglu):
                row = Int64(ld_s32(order + Int64(r) * 4) // topk)
            src = src + (act + row * k_dim * 2 + u * 16,)
        w_at = ()
        s_at = ()
        for m in cutlass.range_constexpr(mt):
            rt = cutlass.min(mc * mt * 4 + m * 4 + warp, n_tiles - 1)
            tile = Int64(e) * n_tiles + rt
            w_at = w_at + (codes + tile * kc * 512 + lane * 16,)
            s_at = s_at + (scales + tile * kc * 64 + g * 8,)

        for s in cutlass.range_constexpr(ahead):
            if s < kc:
                for q in cutlass.range_constexpr(per):
                    cp_async16(base + s * stage_bytes + q * stride + dst, src[q] + s * 128)
            ptx("cp.async.commit_group;")
        wa, sa = load_weights(w_at, s_at, 0, mt)
        wb, sb = load_weights(w_at, s_at, cutlass.min(1, kc - 1), mt)
        acc = (Float32(0.0),) * (mt * bn // 2)
        for c in cutlass.range(0, kc):
            ptx(f"cp.async.wait_group {ahead - 1};")
            ptx("fence.proxy.async.shared::cta;")
            cute.arch.sync_threads()  # chunk c landed; every warp is past chunk c - 1
            nxt = c + ahead
            if nxt < kc:
                at = base + (nxt % stages) * stage_bytes + dst
                for q in cutlass.range_constexpr(per):
                    cp_async16(at + q * stride, src[q] + nxt * 128)
            ptx("cp.async.commit_group;")
            w, s = wa, sa
            wa, sa = wb, sb
            wb, sb = load_weights(w_at, s_at, cutlass.min(c + 2, kc - 1), mt)
            frags = ()
            for m in cutlass.range_constexpr(mt):
                for i in cutlass.range_constexpr(4):
                    frags = frags + (
                        decode_tile(w[4 * m + i], tile_scales(s[2 * m + i // 2], i % 2)),
                    )
            ptx("wgmma.fence.sync.aligned;")
            stage_at = base + (c % stages) * stage_bytes
            new = ()
            for m in cutlass.range_constexpr(mt):
                part = acc[m * (bn // 2) : (m + 1) * (bn // 2)]
                for i in cutlass.range_constexpr(4):
                    part = wgmma(part, frags[4 * m + i], smem_desc(stage_at + i * 32))
                new = new + part
            acc = new
            ptx("wgmma.commit_group.sync.aligned;")
            ptx("wgmma.wait_group.sync.aligned 0;")

        # epilogue: tile rows g (FC1: gate) and g + 8 (FC1: up), columns 8j + 2 lc + h
        if cutlass.const_expr(swiglu):
            g_gate = ld_f32(gscale + Int64(e) * 8) * frag.UNDO
            g_up = ld_f32(gscale + Int64(e) * 8 + 4) * frag.UNDO
        else:
            g_row = ld_f32(gscale + Int64(e) * 4) * frag.UNDO
        for m in cutlass.range_constexpr(mt):
            rt = mc * mt * 4 + m * 4 + warp
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
def fc1_host(
    x: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    n_blocks: Int32, hidden: Int32, inter: Int32, stream, topk: cutlass.Constexpr,
    bn: cutlass.Constexpr, mt: cutlass.Constexpr, stages: cutlass.Constexpr,
):  # fmt: skip
    slices = (2 * inter + 64 * mt - 1) // (64 * mt)
    gemm_kernel(
        x, order, blocks, codes, scales, g13, h, hidden, 2 * inter, inter, topk, bn, mt,
        stages, True,
    ).launch(grid=[slices, n_blocks, 1], block=[WARPGROUP, 1, 1], stream=stream)  # fmt: skip


@cute.jit
def fc2_host(
    h: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g2: Int64, rows: Int64,
    n_blocks: Int32, hidden: Int32, inter: Int32, stream, bn: cutlass.Constexpr,
    mt: cutlass.Constexpr, stages: cutlass.Constexpr,
):  # fmt: skip
    slices = (hidden + 64 * mt - 1) // (64 * mt)
    gemm_kernel(
        h, order, blocks, codes, scales, g2, rows, inter, hidden, hidden, 1, bn, mt, stages,
        False,
    ).launch(grid=[slices, n_blocks, 1], block=[WARPGROUP, 1, 1], stream=stream)  # fmt: skip
