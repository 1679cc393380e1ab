"""The CuTeDSL kernels of `kernels/moe/cutedsl.py` (imported only where CuTeDSL is installed).

Loads, the decode, the MMA and bf16 rounding are inline PTX; `fragments.py` has the layout.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from beamfx.kernels.moe import fragments as frag

SCALE_PAIR_BIAS = frag.SCALE_BIAS | frag.SCALE_BIAS << 16


def _asm(rets, args, ptx, cons, side_effects, loc, ip):
    vals = [a.ir_value(loc=loc, ip=ip) for a in args]
    kw = dict(
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    if not rets:
        llvm.inline_asm(None, vals, ptx, cons, **kw)
        return ()
    if len(rets) == 1:
        return (rets[0](llvm.inline_asm(rets[0].mlir_type, vals, ptx, cons, **kw)),)
    st = llvm.StructType.get_literal([r.mlir_type for r in rets])
    res = llvm.inline_asm(st, vals, ptx, cons, **kw)
    return tuple(
        r(llvm.extractvalue(r.mlir_type, res, [i], loc=loc, ip=ip)) for i, r in enumerate(rets)
    )


@dsl_user_op
def ld_v4(addr, *, loc=None, ip=None):  # 16 bytes of codes, streamed (no L1 allocation)
    return _asm(
        [Int32] * 4,
        [Int64(addr)],
        "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l",
        False,
        loc,
        ip,
    )


@dsl_user_op
def ld_v2(addr, offset=0, *, loc=None, ip=None):
    """8 bytes at `addr + offset` (a constant: it folds into the load's immediate)."""
    return _asm(
        [Int32] * 2, [Int64(addr)], f"ld.global.nc.v2.u32 {{$0, $1}}, [$2+{offset}];",
        "=r,=r,l", False, loc, ip,
    )  # fmt: skip


@dsl_user_op
def ld_v4_early(addr, *, loc=None, ip=None):
    """`ld_v4` for the loads issued before `griddepcontrol.wait`: volatile and coherent, so
    that ptxas keeps them there (it moves `.nc` loads, and the wait, freely)."""
    return _asm(
        [Int32] * 4, [Int64(addr)], "ld.global.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def ld_v2_early(addr, *, loc=None, ip=None):
    return _asm(
        [Int32] * 2, [Int64(addr)], "ld.global.v2.u32 {$0, $1}, [$2];", "=r,=r,l", True, loc, ip
    )


@dsl_user_op
def ld_act(addr, offset=0, *, loc=None, ip=None):
    """`ld_v2` for activations in a kernel that waits for the previous launch (which wrote
    them): not `.nc`, which ptxas would be free to move above `griddepcontrol.wait`."""
    return _asm(
        [Int32] * 2, [Int64(addr)], f"ld.global.v2.u32 {{$0, $1}}, [$2+{offset}];",
        "=r,=r,l", False, loc, ip,
    )  # fmt: skip


@dsl_user_op
def st_shared_v4(addr, v, *, loc=None, ip=None):
    _asm([], [Int32(addr), *v], "st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r", True,
         loc, ip)  # fmt: skip


@dsl_user_op
def ld_shared_v4(addr, *, loc=None, ip=None):
    return _asm([Int32] * 4, [Int32(addr)], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
                "=r,=r,=r,=r,r", True, loc, ip)  # fmt: skip


@dsl_user_op
def ld_shared_v2(addr, offset=0, *, loc=None, ip=None):
    return _asm(
        [Int32] * 2, [Int32(addr)], f"ld.shared.v2.u32 {{$0, $1}}, [$2+{offset}];", "=r,=r,r",
        True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def ld_s32(addr, *, loc=None, ip=None):
    return _asm([Int32], [Int64(addr)], "ld.global.nc.s32 $0, [$1];", "=r,l", False, loc, ip)[0]


@dsl_user_op
def ld_f32(addr, *, loc=None, ip=None):
    return _asm([Float32], [Int64(addr)], "ld.global.nc.f32 $0, [$1];", "=f,l", False, loc, ip)[0]


@dsl_user_op
def ld_f32_early(addr, *, loc=None, ip=None):
    """`ld_f32` issued where it stands (volatile, coherent): a load whose value is needed
    only after a long loop, started before it so that its round trip hides there."""
    return _asm([Float32], [Int64(addr)], "ld.global.f32 $0, [$1];", "=f,l", True, loc, ip)[0]


@dsl_user_op
def st_bf16(addr, value, *, loc=None, ip=None):
    _asm(
        [],
        [Int64(addr), Float32(value)],
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; st.global.b16 [$0], h; }",
        "l,f",
        True,
        loc,
        ip,
    )


@dsl_user_op
def round_bf16(value, *, loc=None, ip=None):
    return _asm(
        [Float32],
        [Float32(value)],
        "{ .reg .b16 h; cvt.rn.bf16.f32 h, $1; mov.b32 $0, {0, h}; }",
        "=f,f",
        False,
        loc,
        ip,
    )[0]


@dsl_user_op
def tile_scales(word, half, *, loc=None, ip=None):
    """Bytes 2 * half (row g) and 2 * half + 1 (row g + 8) of `word` (re-encoded scales) ->
    one bf16x2 (scale of row g, scale of row g + 8), each times 2^SCALE_EXP."""
    selector = 0x4040 | (2 * half + 1) << 8 | 2 * half
    return _asm(
        [Int32],
        [Int32(word)],
        f"{{ .reg .b32 t; prmt.b32 t, $1, 0, {selector}; "
        f"mad.lo.u32 $0, t, 16, {SCALE_PAIR_BIAS}; }}",
        "=r,r",
        False,
        loc,
        ip,
    )[0]


@dsl_user_op
def decode_tile(word, scales, *, loc=None, ip=None):
    """8 codes -> the A fragment (4 bf16 pairs) times the rows' scales (`scales` from
    `tile_scales`: its low half multiplies row g's pairs 0 and 2, its high half row g + 8's
    pairs 1 and 3; ptxas reads the halves in the multiply, `.H0_H0` / `.H1_H1`).
    `fragments.py` has the layout and the same integer ops in torch (`decode_pair`)."""
    m = frag.PAIR_MASK
    body = [
        "mov.b32 {sl, sh}, $5; mov.b32 lo, {sl, sl}; mov.b32 hi, {sh, sh};",
        f"and.b32 a, $4, {m}; mul.rn.bf16x2 $0, a, lo;",
        f"shl.b32 a, $4, 4; and.b32 a, a, {m}; mul.rn.bf16x2 $1, a, hi;",
        f"shf.l.wrap.b32 a, $4, $4, 10; and.b32 a, a, {m}; mul.rn.bf16x2 $2, a, lo;",
        f"shl.b32 a, $4, 6; and.b32 a, a, {frag.PAIR3_MASK_A}; "
        f"shf.l.wrap.b32 b, $4, $4, 14; and.b32 b, b, {frag.PAIR3_MASK_B}; or.b32 a, a, b; "
        "mul.rn.bf16x2 $3, a, hi;",
    ]
    return _asm(
        [Int32] * 4,
        [Int32(word), Int32(scales)],
        "{ .reg .b32 a, b, lo, hi; .reg .b16 sl, sh; " + " ".join(body) + " }",
        "=&r,=&r,=&r,=&r,r,r",  # early clobber: outputs are written before the last read
        False,
        loc,
        ip,
    )


@dsl_user_op
def mma(a, b0, b1, acc, *, loc=None, ip=None):
    return _asm(
        [Float32] * 4,
        [*a, Int32(b0), Int32(b1), *acc],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        False,
        loc,
        ip,
    )


@cute.jit
def thread_coords():
    """(thread, warp, lane, MMA group g = lane / 4, lane in group c = lane % 4)."""
    tid, _, _ = cute.arch.thread_idx()
    lane = tid % 32
    return tid, tid // 32, lane, lane // 4, lane % 4


@cute.jit
def wait_and_release():
    """Wait for the previous launch, then let the next one (FC2) start its prologue."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@cute.jit
def load_chunks(w_at, s_at, first, last, depth: cutlass.Constexpr, early: cutlass.Constexpr):
    """Codes (4 words) and scales (2 words) of chunks first .. first + depth - 1, each
    clamped to `last` (a repeated load, not a branch). `early`: loads that must stay ahead
    of a following `griddepcontrol.wait`."""
    w = ()
    s = ()
    for d in cutlass.range_constexpr(depth):
        ch = cutlass.min(first + d, last)
        if cutlass.const_expr(early):
            w = w + ld_v4_early(w_at + Int64(ch) * 512)
            s = s + ld_v2_early(s_at + Int64(ch) * 64)
        else:
            w = w + ld_v4(w_at + Int64(ch) * 512)
            s = s + ld_v2(s_at + Int64(ch) * 64)
    return w, s


@cute.jit
def load_step(w_at, s_at, nxt, c_begin, c_end, depth: cutlass.Constexpr):
    """The next step's chunks nxt .. nxt + depth - 1 from one base address and constant
    offsets (no clamp a chunk: about 2 integer ops a tile fewer in SASS). Past the range
    (the last step) the warp's first chunks again, read a moment ago (L2), instead of
    weights no one uses; their registers are not read. In a last partial step the chunks
    past `c_end` are the next tile's or, at the end, the padding (`fragments.PAD_CHUNKS`)."""
    ch = nxt if nxt < c_end else c_begin
    w_first = w_at + Int64(ch) * 512
    s_first = s_at + Int64(ch) * 64
    w = ()
    s = ()
    for d in cutlass.range_constexpr(depth):
        w = w + ld_v4(w_first + d * 512)
        s = s + ld_v2(s_first, d * 64)
    return w, s


def warp_buffer(warp, warps, stage):
    """This warp's shared-memory address for `stage` chunks (128 bytes each) of staged
    activations, or None when `stage` is 0 (a compile-time constant)."""
    if stage == 0:
        return None
    base = cute.arch.alloc_smem(Int32, warps * stage * 32, alignment=16).toint()
    return base + warp * stage * 128


@cute.jit
def stage_row(x_at, sbuf, lane, c_begin, c_end, pdl: cutlass.Constexpr):
    """Copy this warp's activations of chunks [c_begin, c_end) (128 bytes each) into its
    shared-memory buffer at `sbuf`: 16 bytes a lane at a time, all loads independent, so
    the slice costs one round trip to L2 instead of one per MMA tile."""
    cute.arch.sync_warp()  # the warp's previous reads of the buffer are done
    src = x_at + Int64(c_begin * 128)
    for off in cutlass.range(lane * 16, (c_end - c_begin) * 128, 512):
        v = ld_v4_early(src + Int64(off)) if cutlass.const_expr(pdl) else ld_v4(src + Int64(off))
        st_shared_v4(sbuf + off, v)
    cute.arch.sync_warp()


@cute.jit
def dot_rows(
    w_at, s_at, x_at, lane_c, c_begin, c_end, depth: cutlass.Constexpr, wait: cutlass.Constexpr,
    pdl: cutlass.Constexpr, sbuf=None, lane=None, step_loads: cutlass.Constexpr = False,
):  # fmt: skip
    """Sum over chunks [c_begin, c_end) of a 16-row tile times one activation row:
    (row g, row g + 8) of this lane, fp32, the scales' 2^-16 left in. `depth` chunks a
    step are in flight while the previous step's are multiplied. With `wait`, the first
    step's weights load before the wait for the previous launch (programmatic dependent
    launch), which wrote the activations. `pdl`: the kernel waits (here or before), so the
    activations load coherently (`ld_act`); else through the non-coherent path.
    `sbuf` (a shared-memory address, with `lane`): the activations are first staged there
    (`stage_row`) and each MMA tile reads them from shared memory; else from global memory,
    where ptxas places each load just before its MMA (one L2 round trip a tile).
    `step_loads`: the next step's chunks load from one base address (`load_step`) instead
    of one clamped address a chunk (`load_chunks`)."""
    acc = (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
    last = c_end - 1
    w, s = load_chunks(w_at, s_at, c_begin, last, depth, wait)
    if cutlass.const_expr(wait):
        cute.arch.griddepcontrol_wait()
    if cutlass.const_expr(sbuf is not None):
        stage_row(x_at, sbuf, lane, c_begin, c_end, pdl)
    for base in cutlass.range(c_begin, c_end, depth):
        if cutlass.const_expr(step_loads):
            w_n, s_n = load_step(w_at, s_at, base + depth, c_begin, c_end, depth)
        else:
            w_n, s_n = load_chunks(w_at, s_at, base + depth, last, depth, False)
        for d in cutlass.range_constexpr(depth):
            if base + d < c_end:
                x_ch = x_at + Int64((base + d) * 128 + lane_c * 8)
                for i in cutlass.range_constexpr(4):
                    if cutlass.const_expr(sbuf is not None):
                        xb = ld_shared_v2(sbuf + (base + d - c_begin) * 128 + lane_c * 8, i * 32)
                    elif cutlass.const_expr(pdl):
                        xb = ld_act(x_ch, i * 32)
                    else:
                        xb = ld_v2(x_ch, i * 32)
                    a = decode_tile(w[4 * d + i], tile_scales(s[2 * d + i // 2], i % 2))
                    acc = mma(a, xb[0], xb[1], acc)
        w = w_n
        s = s_n
    return acc


@cute.kernel
def fc1_kernel(
    x: Int64, ids: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    hidden: Int32, inter: Int32, topk: cutlass.Constexpr, warps: cutlass.Constexpr,
    depth: cutlass.Constexpr, pdl: cutlass.Constexpr, stage: cutlass.Constexpr,
    step_loads: cutlass.Constexpr,
):  # fmt: skip
    """`stage`: chunks of K a warp stages in shared memory (0: none; see `dot_rows`);
    `step_loads`: see `dot_rows`."""
    pair, rt, _ = cute.arch.block_idx()
    tid, warp, lane, g, lc = thread_coords()
    sbuf = warp_buffer(warp, warps, stage)
    if cutlass.const_expr(pdl):  # ids and activations come from the previous launch
        wait_and_release()
    e = ld_s32(ids + Int64(pair) * 4)
    # the expert's global scales, needed after the K loop: their round trip hides in it
    g_gate = ld_f32_early(g13 + Int64(e) * 8)
    g_up = ld_f32_early(g13 + Int64(e) * 8 + 4)
    kc = hidden // 64
    per = (kc + warps - 1) // warps
    c_begin = warp * per
    c_end = cutlass.min(c_begin + per, kc)
    tile = Int64(e) * (inter // 8) + rt
    acc = (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
    if c_begin < c_end:
        acc = dot_rows(
            codes + tile * kc * 512 + lane * 16,
            scales + tile * kc * 64 + g * 8,
            x + Int64(pair // topk) * hidden * 2,
            lc,
            c_begin,
            c_end,
            depth,
            False,
            pdl,
            sbuf,
            lane,
            step_loads,
        )
    # one MMA column suffices (all hold the token): only rows g (gate) and g + 8 (up) meet
    red = cute.make_tensor(cute.arch.alloc_smem(Float32, warps * 64), cute.make_layout(warps * 64))
    red[warp * 64 + lane] = acc[0]
    red[warp * 64 + 32 + lane] = acc[2]
    cute.arch.sync_threads()
    if warp == 0 and lc == 0:
        gate = Float32(0.0)
        up = Float32(0.0)
        for w in cutlass.range_constexpr(warps):
            gate = gate + red[w * 64 + lane]
            up = up + red[w * 64 + 32 + lane]
        gate = round_bf16(gate * frag.UNDO * g_gate)
        up = round_bf16(up * frag.UNDO * g_up)
        act = gate / (1.0 + cute.math.exp(-gate)) * up
        st_bf16(h + (Int64(pair) * inter + rt * 8 + g) * 2, act)


@cute.kernel
def fc2_kernel(
    hbuf: Int64, ids: Int64, codes: Int64, scales: Int64, g2: Int64, weights: Int64,
    out: Int64, routed_scale: Float32, hidden: Int32, inter: Int32,
    topk: cutlass.Constexpr, warps: cutlass.Constexpr, combine: cutlass.Constexpr,
    depth: cutlass.Constexpr, pdl: cutlass.Constexpr, stage: cutlass.Constexpr,
    step_loads: cutlass.Constexpr,
):  # fmt: skip
    """`stage`: chunks of K (all of it) a warp stages in shared memory (0: none);
    `step_loads`: see `dot_rows`."""
    tok, rt, _ = cute.arch.block_idx()
    tid, warp, lane, g, lc = thread_coords()
    sbuf = warp_buffer(warp, warps, stage)
    kc = inter // 64
    tiles = hidden // 16
    rows = cute.make_tensor(cute.arch.alloc_smem(Float32, topk * 16), cute.make_layout(topk * 16))
    for j in cutlass.range(warp, topk, warps):
        pair = Int64(tok) * topk + j
        e = ld_s32(ids + pair * 4)
        # the expert's global scale and the pair's weight, needed after the K loop
        ge = ld_f32_early(g2 + Int64(e) * 4) * frag.UNDO
        wt = Float32(1.0)
        if cutlass.const_expr(combine):
            wt = ld_f32_early(weights + pair * 4)
        tile = Int64(e) * tiles + rt
        acc = dot_rows(
            codes + tile * kc * 512 + lane * 16,
            scales + tile * kc * 64 + g * 8,
            hbuf + pair * inter * 2,
            lc,
            0,
            kc,
            depth,
            pdl,
            pdl,
            sbuf,
            lane,
            step_loads,
        )
        lo = round_bf16(acc[0] * ge)
        hi = round_bf16(acc[2] * ge)
        if lc == 0:
            if cutlass.const_expr(combine):
                rows[j * 16 + g] = lo * wt
                rows[j * 16 + g + 8] = hi * wt
            else:
                at = out + (pair * hidden + rt * 16 + g) * 2
                st_bf16(at, lo)
                st_bf16(at + 16, hi)
    if cutlass.const_expr(combine):
        cute.arch.sync_threads()
        if tid < 16:
            total = Float32(0.0)
            for j in cutlass.range_constexpr(topk):
                total = total + rows[j * 16 + tid]
            st_bf16(out + (Int64(tok) * hidden + rt * 16 + tid) * 2, total * routed_scale)


@cute.jit
def warp_sum(acc, red, warp, lane, warps: cutlass.Constexpr):
    """The four accumulators summed over the CTA's warps, in warp order (valid in warp 0)."""
    for i in cutlass.range_constexpr(4):
        red[warp * 128 + i * 32 + lane] = acc[i]
    cute.arch.sync_threads()
    total = [Float32(0.0)] * 4
    for w in cutlass.range_constexpr(warps):
        for i in cutlass.range_constexpr(4):
            total[i] = total[i] + red[w * 128 + i * 32 + lane]
    return total[0], total[1], total[2], total[3]


@cute.jit
def split_k_dot(codes, scales, act, tile, kc, warp, lane, warps: cutlass.Constexpr,
                depth: cutlass.Constexpr, wait: cutlass.Constexpr,
                pdl: cutlass.Constexpr):  # fmt: skip
    """Tile `tile` (16 rows, `kc` chunks) times one activation row an MMA column (`act`,
    this lane's), K split over the CTA's warps: the accumulators summed (valid in warp 0)."""
    per = (kc + warps - 1) // warps
    c_begin = warp * per
    c_end = cutlass.min(c_begin + per, kc)
    acc = (Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0))
    if c_begin < c_end:
        acc = dot_rows(
            codes + tile * kc * 512 + lane * 16,
            scales + tile * kc * 64 + (lane // 4) * 8,
            act,
            lane % 4,
            c_begin,
            c_end,
            depth,
            wait,
            pdl,
        )
    red = cute.make_tensor(
        cute.arch.alloc_smem(Float32, warps * 128), cute.make_layout(warps * 128)
    )
    return warp_sum(acc, red, warp, lane, warps)


@cute.jit
def group_columns(order, blocks, blk, g):
    """A block of up to 8 pairs of one expert (`sort_blocks`): (expert, first sorted
    position, columns, the pair of MMA column g; past the last column, the last pair; in a
    block past the last real one, (-1, 0, 0), the first pair, so the load stays in bounds)."""
    e = ld_s32(blocks + Int64(blk) * 12)
    start = ld_s32(blocks + Int64(blk) * 12 + 4)
    cols = cutlass.min(ld_s32(blocks + Int64(blk) * 12 + 8) - start, 8)
    pair = ld_s32(order + Int64(start + cutlass.max(cutlass.min(g, cols - 1), 0)) * 4)
    return e, start, cols, pair


@cute.kernel
def fc1_grouped_kernel(
    x: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    hidden: Int32, inter: Int32, topk: cutlass.Constexpr, warps: cutlass.Constexpr,
    depth: cutlass.Constexpr, pdl: cutlass.Constexpr,
):  # fmt: skip
    """FC1 + SwiGLU for a block of up to 8 pairs sharing an expert: one MMA column a pair,
    so the expert's weights are read once for all of them."""
    blk, rt, _ = cute.arch.block_idx()
    tid, warp, lane, g, lc = thread_coords()
    if cutlass.const_expr(pdl):  # ids and activations come from the previous launch
        wait_and_release()
    e, start, cols, col_pair = group_columns(order, blocks, blk, g)
    if e >= 0:
        tile = Int64(e) * (inter // 8) + rt
        x_at = x + Int64(col_pair // topk) * hidden * 2
        total = split_k_dot(
            codes, scales, x_at, tile, hidden // 64, warp, lane, warps, depth, False, pdl
        )
        if warp == 0:
            g_gate = ld_f32(g13 + Int64(e) * 8) * frag.UNDO
            g_up = ld_f32(g13 + Int64(e) * 8 + 4) * frag.UNDO
            for n in cutlass.range_constexpr(2):  # columns 2c, 2c + 1 of rows g, g + 8
                if 2 * lc + n < cols:
                    pair = ld_s32(order + Int64(start + 2 * lc + n) * 4)
                    gate = round_bf16(total[n] * g_gate)
                    up = round_bf16(total[2 + n] * g_up)
                    act = gate / (1.0 + cute.math.exp(-gate)) * up
                    st_bf16(h + (Int64(pair) * inter + rt * 8 + g) * 2, act)


@cute.kernel
def fc2_grouped_kernel(
    hbuf: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g2: Int64,
    rows: Int64, hidden: Int32, inter: Int32, warps: cutlass.Constexpr,
    depth: cutlass.Constexpr, pdl: cutlass.Constexpr,
):  # fmt: skip
    """FC2 for a block of up to 8 pairs sharing an expert: each pair's bf16 row, [P, H]
    (the finalize is a separate launch)."""
    blk, rt, _ = cute.arch.block_idx()
    tid, warp, lane, g, lc = thread_coords()
    e, start, cols, col_pair = group_columns(order, blocks, blk, g)
    if e >= 0:
        tile = Int64(e) * (hidden // 16) + rt
        h_at = hbuf + Int64(col_pair) * inter * 2
        total = split_k_dot(
            codes, scales, h_at, tile, inter // 64, warp, lane, warps, depth, pdl, pdl
        )
        if warp == 0:
            ge = ld_f32(g2 + Int64(e) * 4) * frag.UNDO
            for n in cutlass.range_constexpr(2):
                if 2 * lc + n < cols:
                    pair = ld_s32(order + Int64(start + 2 * lc + n) * 4)
                    at = rows + (Int64(pair) * hidden + rt * 16 + g) * 2
                    st_bf16(at, total[n] * ge)
                    st_bf16(at + 16, total[2 + n] * ge)


@cute.jit
def fc1_grouped_host(
    x: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    n_blocks: Int32, hidden: Int32, inter: Int32, stream,
    topk: cutlass.Constexpr, warps: cutlass.Constexpr, depth: cutlass.Constexpr,
    pdl: cutlass.Constexpr,
):  # fmt: skip
    fc1_grouped_kernel(
        x, order, blocks, codes, scales, g13, h, hidden, inter, topk, warps, depth, pdl
    ).launch(grid=[n_blocks, inter // 8, 1], block=[32 * warps, 1, 1], stream=stream, use_pdl=pdl)


@cute.jit
def fc2_grouped_host(
    hbuf: Int64, order: Int64, blocks: Int64, codes: Int64, scales: Int64, g2: Int64,
    rows: Int64, n_blocks: Int32, hidden: Int32, inter: Int32, stream,
    warps: cutlass.Constexpr, depth: cutlass.Constexpr, pdl: cutlass.Constexpr,
):  # fmt: skip
    fc2_grouped_kernel(
        hbuf, order, blocks, codes, scales, g2, rows, hidden, inter, warps, depth, pdl
    ).launch(grid=[n_blocks, hidden // 16, 1], block=[32 * warps, 1, 1], stream=stream, use_pdl=pdl)


@cute.jit
def fc1_host(
    x: Int64, ids: Int64, codes: Int64, scales: Int64, g13: Int64, h: Int64,
    pairs: Int32, hidden: Int32, inter: Int32, stream,
    topk: cutlass.Constexpr, warps: cutlass.Constexpr, depth: cutlass.Constexpr,
    pdl: cutlass.Constexpr, stage: cutlass.Constexpr, step_loads: cutlass.Constexpr,
):  # fmt: skip
    fc1_kernel(
        x, ids, codes, scales, g13, h, hidden, inter, topk, warps, depth, pdl, stage, step_loads
    ).launch(
        grid=[pairs, inter // 8, 1], block=[32 * warps, 1, 1], stream=stream, use_pdl=pdl
    )  # fmt: skip


@cute.jit
def fc2_host(
    hbuf: Int64, ids: Int64, codes: Int64, scales: Int64, g2: Int64, weights: Int64,
    out: Int64, routed_scale: Float32, tokens: Int32, hidden: Int32, inter: Int32, stream,
    topk: cutlass.Constexpr, warps: cutlass.Constexpr, combine: cutlass.Constexpr,
    depth: cutlass.Constexpr, pdl: cutlass.Constexpr, stage: cutlass.Constexpr,
    step_loads: cutlass.Constexpr,
):  # fmt: skip
    fc2_kernel(
        hbuf, ids, codes, scales, g2, weights, out, routed_scale, hidden, inter,
        topk, warps, combine, depth, pdl, stage, step_loads,
    ).launch(
        grid=[tokens, hidden // 16, 1], block=[32 * warps, 1, 1], stream=stream, use_pdl=pdl
    )  # fmt: skip
