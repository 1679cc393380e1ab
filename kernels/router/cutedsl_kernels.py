"""The CuTeDSL kernel of `kernels/router/cutedsl.py` (imported only where CuTeDSL is
installed). Loads, the weight's split into bf16 pieces, the MMAs, the cluster's shared-memory
exchange, the arrival counter and the routing's warp operations are inline PTX.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from beamfx.kernels.moe.cutedsl_kernels import _asm, ld_v4_early, mma
from beamfx.kernels.router.cutedsl import sort_network

MASKED = -(2**31)  # the key of a masked or taken expert: below every float's key
X_AHEAD_LOADS = 16  # activation loads (16 bytes) a lane issues at once after the wait


# --- loads, stores, the weight's pieces -------------------------------------------------------


@dsl_user_op
def ld_x4(addr, *, loc=None, ip=None):
    """16 bytes of activations (8 bf16: four MMA B registers of two K steps). Not `.nc`:
    the previous launch wrote them, and ptxas moves non-coherent loads above the wait."""
    return _asm(
        [Int32] * 4, [Int64(addr)], "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def ld_l2_v4(addr, *, loc=None, ip=None):
    """4 floats written by other CTAs of this launch (read at L2, after the acquire)."""
    return _asm(
        [Float32] * 4, [Int64(addr)], "ld.global.cg.v4.f32 {$0, $1, $2, $3}, [$4];",
        "=f,=f,=f,=f,l", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def ld_l2(addr, *, loc=None, ip=None):
    return _asm([Float32], [Int64(addr)], "ld.global.cg.f32 $0, [$1];", "=f,l", True, loc, ip)[0]


@dsl_user_op
def st_f32(addr, value, *, loc=None, ip=None):
    _asm([], [Int64(addr), Float32(value)], "st.global.f32 [$0], $1;", "l,f", True, loc, ip)


@dsl_user_op
def st_s32(addr, value, *, loc=None, ip=None):
    _asm([], [Int64(addr), Int32(value)], "st.global.s32 [$0], $1;", "l,r", True, loc, ip)


@dsl_user_op
def pieces(w0, w1, *, loc=None, ip=None):
    """Two fp32 weights (their bits) -> three bf16 pairs (hi, mid, lo), w = hi + mid + lo
    exactly: hi is w truncated to bf16, mid the rest truncated, lo what is left (at most 8
    significant bits). bf16 x bf16 products are exact in the MMA."""
    return _asm(
        [Int32] * 3,
        [Int32(w0), Int32(w1)],
        "{ .reg .b32 h0, h1, r0, r1, m0, m1, l0, l1; "
        "and.b32 h0, $3, 0xFFFF0000; and.b32 h1, $4, 0xFFFF0000; "
        "sub.f32 r0, $3, h0; sub.f32 r1, $4, h1; "
        "and.b32 m0, r0, 0xFFFF0000; and.b32 m1, r1, 0xFFFF0000; "
        "sub.f32 l0, r0, m0; sub.f32 l1, r1, m1; "
        "prmt.b32 $0, $3, $4, 0x7632; prmt.b32 $1, r0, r1, 0x7632; "
        "prmt.b32 $2, l0, l1, 0x7632; }",
        "=r,=r,=r,r,r",
        False,
        loc,
        ip,
    )


# --- the cluster: shared memory, barriers, the arrival counter ----------------------------------


@dsl_user_op
def st_shared(addr, value, *, loc=None, ip=None):
    _asm([], [Int32(addr), Float32(value)], "st.shared.f32 [$0], $1;", "r,f", True, loc, ip)


@dsl_user_op
def ld_peer(addr, rank, *, loc=None, ip=None):
    """The float at `addr` in the shared memory of the cluster's CTA `rank`."""
    return _asm(
        [Float32], [Int32(addr), Int32(rank)],
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $1, $2; ld.shared::cluster.f32 $0, [a]; }",
        "=f,r,r", True, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def st_peer_s32(addr, rank, value, *, loc=None, ip=None):
    _asm(
        [], [Int32(addr), Int32(rank), Int32(value)],
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $0, $1; st.shared::cluster.u32 [a], $2; }",
        "r,r,r", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def st_async_peer(addr, mbar, rank, value, *, loc=None, ip=None):
    """`value` into the float at `addr` in the shared memory of the cluster's CTA `rank`,
    counted (4 bytes) on that CTA's mbarrier at `mbar`: no fence, no cluster barrier."""
    _asm(
        [], [Int32(addr), Int32(mbar), Int32(rank), Float32(value)],
        "{ .reg .b32 a, m; mapa.shared::cluster.u32 a, $0, $2; mapa.shared::cluster.u32 m, $1, $2;"
        " st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [a], $3, [m]; }",
        "r,r,r,f", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def st_async_peer_v4(addr, mbar, rank, v0, v1, v2, v3, *, loc=None, ip=None):
    """`st_async_peer` of four floats, 16 bytes at a 16-byte aligned `addr`, one store."""
    _asm(
        [], [Int32(addr), Int32(mbar), Int32(rank), Float32(v0), Float32(v1), Float32(v2),
             Float32(v3)],
        "{ .reg .b32 a, m; mapa.shared::cluster.u32 a, $0, $2; mapa.shared::cluster.u32 m, $1, $2;"
        " st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32"
        " [a], {$3, $4, $5, $6}, [m]; }",
        "r,r,r,f,f,f,f", True, loc, ip,
    )  # fmt: skip


def vec_slot(o):
    """Where form 3 keeps output `o` (token o // 16 of the CTA's share, expert o % 16) among
    a sender's partials: a thread's four C values (tokens 2c, 2c + 1 of a tile, experts g,
    g + 8) side by side, so one 16-byte store sends them."""
    tl = o // 16
    e = o % 16
    return ((tl // 2) * 8 + e % 8) * 4 + tl % 2 + 2 * (e // 8)


@dsl_user_op
def mbar_init(mbar, *, loc=None, ip=None):
    """One arrival a phase; the init made visible to the cluster's async stores."""
    _asm([], [Int32(mbar)],
         "mbarrier.init.shared::cta.b64 [$0], 1; fence.mbarrier_init.release.cluster;", "r",
         True, loc, ip)  # fmt: skip


@dsl_user_op
def mbar_expect(mbar, nbytes, *, loc=None, ip=None):
    ptx = "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;"
    _asm([], [Int32(mbar), Int32(nbytes)], ptx, "r,r", True, loc, ip)


@dsl_user_op
def mbar_wait(mbar, *, loc=None, ip=None):
    """Wait for the first phase of the mbarrier at `mbar` (its bytes all in)."""
    _asm(
        [], [Int32(mbar)],
        "{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [$0], 0;"
        " @!p bra WAIT; }",
        "r", True, loc, ip,
    )  # fmt: skip


@dsl_user_op
def st_shared_s32(addr, value, *, loc=None, ip=None):
    _asm([], [Int32(addr), Int32(value)], "st.shared.u32 [$0], $1;", "r,r", True, loc, ip)


@dsl_user_op
def ld_shared_f32(addr, *, loc=None, ip=None):
    return _asm([Float32], [Int32(addr)], "ld.shared.f32 $0, [$1];", "=f,r", True, loc, ip)[0]


@dsl_user_op
def ld_shared_s32(addr, *, loc=None, ip=None):
    return _asm([Int32], [Int32(addr)], "ld.shared.u32 $0, [$1];", "=r,r", True, loc, ip)[0]


@dsl_user_op
def cluster_sync(relaxed=False, *, loc=None, ip=None):
    """Every thread of the cluster: arrive (release), wait (acquire). `relaxed` (no memory
    ordering: wrong for the exchange) only times the release's cost (`probe` 2)."""
    arrive = (
        "barrier.cluster.arrive.relaxed.aligned;" if relaxed else "barrier.cluster.arrive.aligned;"
    )
    _asm([], [], arrive + " barrier.cluster.wait.aligned;", "", True, loc, ip)


@dsl_user_op
def cluster_arrive_relaxed(*, loc=None, ip=None):
    """This thread's arrival at the cluster barrier, without memory ordering: for a barrier
    that only keeps every CTA's shared memory alive until its peers are done reading it."""
    _asm([], [], "barrier.cluster.arrive.relaxed.aligned;", "", True, loc, ip)


@dsl_user_op
def cluster_wait(*, loc=None, ip=None):
    _asm([], [], "barrier.cluster.wait.aligned;", "", True, loc, ip)


@dsl_user_op
def fence_gpu(*, loc=None, ip=None):
    _asm([], [], "fence.acq_rel.gpu;", "", True, loc, ip)


@dsl_user_op
def arrive(counter, *, loc=None, ip=None):
    """One arrival on the launch's counter: the count before it (acquire + release)."""
    return _asm(
        [Int32], [Int64(counter)], "atom.add.acq_rel.gpu.global.u32 $0, [$1], 1;", "=r,l",
        True, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def reset(counter, *, loc=None, ip=None):
    _asm([], [Int64(counter)], "st.relaxed.gpu.global.u32 [$0], 0;", "l", True, loc, ip)


@dsl_user_op
def cluster_rank(*, loc=None, ip=None):
    return _asm([Int32], [], "mov.u32 $0, %cluster_ctarank;", "=r", False, loc, ip)[0]


# --- routing: order-preserving keys and warp operations ----------------------------------------


@dsl_user_op
def bits(value, *, loc=None, ip=None):
    return _asm([Int32], [Float32(value)], "mov.b32 $0, $1;", "=r,f", False, loc, ip)[0]


@dsl_user_op
def from_bits(value, *, loc=None, ip=None):
    return _asm([Float32], [Int32(value)], "mov.b32 $0, $1;", "=f,r", False, loc, ip)[0]


@dsl_user_op
def key_of(value, *, loc=None, ip=None):
    """A float's bits made order-preserving as a signed int (an involution: the same
    operation takes a key back to the float's bits)."""
    return _asm(
        [Int32], [Int32(value)],
        "{ .reg .b32 t; shr.s32 t, $1, 31; and.b32 t, t, 0x7FFFFFFF; xor.b32 $0, $1, t; }",
        "=r,r", False, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def float_of(key, *, loc=None, ip=None):
    """The float whose `key_of` is `key`."""
    return from_bits(key_of(key, loc=loc, ip=ip), loc=loc, ip=ip)


@dsl_user_op
def exchange(ka, kb, ia, ib, sa, sb, *, loc=None, ip=None):
    """A compare-exchange of (key, expert, score) triples: the larger key first."""
    return _asm(
        [Int32] * 6,
        [Int32(ka), Int32(kb), Int32(ia), Int32(ib), Int32(sa), Int32(sb)],
        "{ .reg .pred p; setp.gt.s32 p, $7, $6; "
        "selp.b32 $0, $7, $6, p; selp.b32 $1, $6, $7, p; "
        "selp.b32 $2, $9, $8, p; selp.b32 $3, $8, $9, p; "
        "selp.b32 $4, $11, $10, p; selp.b32 $5, $10, $11, p; }",
        "=&r,=&r,=&r,=&r,=&r,=&r,r,r,r,r,r,r",
        False,
        loc,
        ip,
    )


@dsl_user_op
def max_s32(a, b, *, loc=None, ip=None):
    return _asm([Int32], [Int32(a), Int32(b)], "max.s32 $0, $1, $2;", "=r,r,r", False, loc, ip)[0]


@dsl_user_op
def min_s32(a, b, *, loc=None, ip=None):
    return _asm([Int32], [Int32(a), Int32(b)], "min.s32 $0, $1, $2;", "=r,r,r", False, loc, ip)[0]


@dsl_user_op
def shfl_xor(value, mask, *, loc=None, ip=None):
    return _asm(
        [Int32], [Int32(value)], f"shfl.sync.bfly.b32 $0, $1, {mask}, 0x1f, 0xffffffff;",
        "=r,r", True, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def shfl_idx(value, lane, *, loc=None, ip=None):
    return _asm(
        [Int32], [Int32(value), Int32(lane)], "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
        "=r,r,r", True, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def beats(score, other, group, other_group, *, loc=None, ip=None):
    """1 if group `other_group` (score `other`) ranks ahead of `group`: a higher score, or
    the same score and a lower index."""
    return _asm(
        [Int32], [Float32(score), Float32(other), Int32(group), Int32(other_group)],
        "{ .reg .pred p, q, e; setp.gt.f32 p, $2, $1; setp.eq.f32 e, $2, $1; "
        "setp.lt.s32 q, $4, $3; and.pred e, e, q; or.pred p, p, e; selp.s32 $0, 1, 0, p; }",
        "=r,f,f,r,r", False, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def pick(cond, a, b, *, loc=None, ip=None):
    """`a` where `cond` is nonzero, else `b`."""
    return _asm(
        [Int32], [Int32(cond), Int32(a), Int32(b)],
        "{ .reg .pred p; setp.ne.s32 p, $1, 0; selp.b32 $0, $2, $3, p; }",
        "=r,r,r,r", False, loc, ip,
    )[0]  # fmt: skip


@dsl_user_op
def warp_argmax(key, *, loc=None, ip=None):
    """The lowest lane holding the warp's largest key."""
    return _asm(
        [Int32], [Int32(key)],
        "{ .reg .b32 m, b; .reg .pred p; redux.sync.max.s32 m, $1, 0xffffffff; "
        "setp.eq.s32 p, $1, m; vote.sync.ballot.b32 b, p, 0xffffffff; "
        "brev.b32 b, b; bfind.shiftamt.u32 $0, b; }",
        "=r,r", True, loc, ip,
    )[0]  # fmt: skip


# --- the kernel --------------------------------------------------------------------------------


@cute.jit
def ld_row(row, n: cutlass.Constexpr):
    """`n` (1, 2 or a multiple of 4) floats from `row`, read at L2 (other CTAs wrote them)."""
    vals = []
    for v in cutlass.range_constexpr(n // 4):
        vals.extend(ld_l2_v4(row + 16 * v))
    for i in cutlass.range_constexpr(n % 4):
        vals.append(ld_l2(row + 4 * i))
    return vals


@cute.jit
def sigmoid(v):
    return Float32(1.0) / (Float32(1.0) + cute.math.exp(-v))


@cute.jit
def route_token(
    logits, scored, bias, weights, ids, t, lane,
    experts: cutlass.Constexpr, n_group: cutlass.Constexpr, topk_group: cutlass.Constexpr,
    top_k: cutlass.Constexpr, renorm: cutlass.Constexpr, probe: cutlass.Constexpr,
):  # fmt: skip
    """Grouped sigmoid top-k of token `t`'s logits (`reference.grouped_topk`) by one warp:
    lane l holds experts [l * per, (l + 1) * per), sorted by biased score; the groups'
    top-2 sums meet by butterfly shuffles; each of the top-k rounds takes the warp's best
    head (`redux.sync`) and its lane moves on; lane j < top_k writes the j-th choice.
    A warp's routing is a chain of dependent steps (~2 us a token on an H200), so what
    can leave it does: the CTAs that sum the logits also score them (`scored`: each
    expert's biased key and sigmoid, [token][expert][2]), so the warp starts from the keys;
    one division a lane for the weights rather than top_k in series. `probe` 7 (benchmarks
    and the same-bits test) keeps the former form: the warp scores the logits itself (every
    exp before the first division: an IEEE division is a branch in SASS, which the
    scheduler does not move work across). The same operations on the same values: the
    same bits."""
    per = experts // 32
    lanes_per_group = 32 // n_group
    if cutlass.const_expr(probe == 7):
        idx = [lane * per + i for i in range(per)]
        bias_v = [ld_l2(bias + (lane * per + i) * 4) for i in range(per)]
        vals = ld_row(logits + (Int64(t) * experts + lane * per) * 4, per)
        denominators = [Float32(1.0) + cute.math.exp(-vals[i]) for i in range(per)]
        s_v = [Float32(1.0) / denominators[i] for i in range(per)]
        keys = [key_of(bits(s_v[i] + bias_v[i])) for i in range(per)]
        sc = [bits(s_v[i]) for i in range(per)]
    else:
        pairs = ld_row(scored + (Int64(t) * experts + lane * per) * 8, 2 * per)
        # Each half of the sort takes a key of every 16-byte load (two experts' pairs): ptxas
        # sinks a load to its first use, which for the natural order is after the first
        # half's sort (an L2 round trip each, in series). Any order sorts the same.
        loads = per // 2
        order = [2 * (i % loads) + i // loads for i in range(per)] if per >= 4 else range(per)
        idx = [lane * per + m for m in order]
        keys = [bits(pairs[2 * m]) for m in order]
        sc = [bits(pairs[2 * m + 1]) for m in order]
    net = sort_network(per)
    for n in cutlass.range_constexpr(len(net)):
        a, b = net[n]
        keys[a], keys[b], idx[a], idx[b], sc[a], sc[b] = exchange(
            keys[a], keys[b], idx[a], idx[b], sc[a], sc[b]
        )
    if cutlass.const_expr(topk_group < n_group):
        first = keys[0]
        second = keys[1] if cutlass.const_expr(per > 1) else Int32(MASKED)
        for b in cutlass.range_constexpr(lanes_per_group.bit_length() - 1):
            o1 = shfl_xor(first, 1 << b)  # top-2 of the group across its lanes
            o2 = shfl_xor(second, 1 << b)
            second = max_s32(min_s32(first, o1), max_s32(second, o2))
            first = max_s32(first, o1)
        score = float_of(first)
        if cutlass.const_expr(experts // n_group > 1):
            score = score + float_of(second)
        group = lane // lanes_per_group
        ahead = Int32(0)
        for g in cutlass.range_constexpr(n_group):
            other = from_bits(shfl_idx(bits(score), g * lanes_per_group))
            ahead = ahead + beats(score, other, group, g)
        kept = Int32(1)
        if ahead >= topk_group:
            kept = Int32(0)
        for i in cutlass.range_constexpr(per):
            keys[i] = pick(kept, keys[i], Int32(MASKED))
    chosen = []
    chosen_s = []
    for _ in cutlass.range_constexpr(top_k):
        winner = warp_argmax(keys[0])
        chosen.append(shfl_idx(idx[0], winner))
        chosen_s.append(from_bits(shfl_idx(sc[0], winner)))
        won = Int32(0)
        if lane == winner:
            won = Int32(1)
        for i in cutlass.range_constexpr(per - 1):
            keys[i] = pick(won, keys[i + 1], keys[i])
            idx[i] = pick(won, idx[i + 1], idx[i])
            sc[i] = pick(won, sc[i + 1], sc[i])
        keys[per - 1] = pick(won, Int32(MASKED), keys[per - 1])
    total = Float32(1.0)
    if cutlass.const_expr(renorm):
        total = chosen_s[0]
        for j in cutlass.range_constexpr(1, top_k):
            total = total + chosen_s[j]
    mine = chosen[0]
    mine_s = bits(chosen_s[0])
    for j in cutlass.range_constexpr(1, top_k):
        is_j = Int32(0)
        if lane == j:
            is_j = Int32(1)
        mine = pick(is_j, chosen[j], mine)
        mine_s = pick(is_j, bits(chosen_s[j]), mine_s)
    if lane < top_k:
        w = from_bits(mine_s)
        if cutlass.const_expr(renorm):
            w = w / total
        st_f32(weights + (Int64(t) * top_k + lane) * 4, w)
        st_s32(ids + (Int64(t) * top_k + lane) * 4, mine)


@cute.kernel
def router_kernel(
    x: Int64, w: Int64, logits: Int64, scored: Int64, bias: Int64, weights: Int64, ids: Int64,
    counter: Int64, tokens: Int32, hidden: cutlass.Constexpr, experts: cutlass.Constexpr,
    n_tiles: cutlass.Constexpr, warps: cutlass.Constexpr, cluster: cutlass.Constexpr,
    fp32_weight: cutlass.Constexpr, chains: cutlass.Constexpr, pdl: cutlass.Constexpr,
    route: cutlass.Constexpr, n_group: cutlass.Constexpr, topk_group: cutlass.Constexpr,
    top_k: cutlass.Constexpr, renorm: cutlass.Constexpr, few: cutlass.Constexpr,
    probe: cutlass.Constexpr, exchange_form: cutlass.Constexpr,
):  # fmt: skip
    """Logits of 16 experts (block x) over a 1/`cluster` share of K (the cluster's rank);
    each warp takes 1/`warps` of that share, 32 of K a step. Partials meet in the cluster's
    shared memory, summed in a fixed order. With `route`, the cluster of the last CTA to
    finish routes every token (one warp a token). The CTAs that sum a routed launch's
    logits also score them into `scored` (see `route_token`).

    With `few` (at most one token a warp of a CTA) the last CTA routes them with its own
    warps: its cluster's second barrier then only keeps shared memory alive for the peers'
    reads, so it is relaxed, and waited on at exit rather than before the routing. (Two
    tokens a warp in series cost more than the flags save: 9.25 against 7.15 us at 8.)

    `probe` (benchmarks only; 0 otherwise) leaves a stage out to time it: 1 the exchange
    (each warp stores its own partial), 2 the barriers' memory ordering, 3 the routing
    (the arrival and the flags kept), 4 the early release of the next PDL launch, 5 the
    last CTA's own routing with `few` (the cluster flagged through a second full
    barrier, as for more tokens), 7 the routing's former form (see `route_token`), 9 a
    fence in every thread before the arrival and before the routing's reads, as before
    router run 19 (4, 5, 7 and 9: results right, they time what a step gains; 6, router
    run 17's earlier form, is gone; 10-12, router run 20's exchange forms, are
    `exchange_form` now)."""
    tile, _, _ = cute.arch.block_idx()
    tid, _, _ = cute.arch.thread_idx()
    warp = tid // 32
    lane = tid % 32
    g = lane // 4
    c = lane % 4
    rank = cluster_rank()
    share = hidden // (cluster * warps)
    steps = share // 32
    k0 = (rank * warps + warp) * share + 8 * c
    wbytes = 4 if cutlass.const_expr(fp32_weight) else 2
    row0 = w + (Int64(tile * 16 + g) * hidden + k0) * wbytes
    row8 = row0 + 8 * hidden * wbytes
    # The weight (the bulk of the bytes) is read before the wait for the previous launch.
    wr = []
    for s in cutlass.range_constexpr(steps):
        if cutlass.const_expr(fp32_weight):
            wr.append(ld_v4_early(row0 + s * 128) + ld_v4_early(row0 + s * 128 + 16))
            wr.append(ld_v4_early(row8 + s * 128) + ld_v4_early(row8 + s * 128 + 16))
        else:
            wr.append(ld_v4_early(row0 + s * 64))
            wr.append(ld_v4_early(row8 + s * 64))
    # Partials [warp][token][expert] in shared memory (or with `push`, the partials this CTA
    # sums, [rank][warp][output], sent by their CTAs); then a flag word and an mbarrier.
    cols = n_tiles * 8
    share_out = cols * 16 // cluster  # outputs a CTA sums
    part = cute.arch.alloc_smem(Float32, warps * cols * 16 + 4, alignment=16).toint()
    flag = part + warps * cols * 16 * 4
    mbar = flag + 8
    # The exchange's form (`Config.exchange`): 0 pulled, 1 pushed, 2 pushed and no cluster
    # barrier at exit (nothing reads a peer's shared memory then; where the last CTA flags
    # its cluster, the barrier after the flags stays).
    push = exchange_form > 0
    exit_barrier = exchange_form < 2
    # Form 3: form 2 with a thread's four values of a tile sent in one 16-byte store. An
    # even number of tiles only: a CTA then sums an even number of tokens (n_tiles), so a
    # thread's two tokens (2c, 2c + 1) go to the same CTA. (Otherwise: form 2.)
    vec = exchange_form == 3 and n_tiles % 2 == 0
    if cutlass.const_expr(push):
        if tid == 0:
            mbar_init(mbar)
        cluster_arrive_relaxed()  # waited before the first send: the peers' mbarriers are set

    # The fp32 weight as MMA A fragments, three bf16 pieces each: (step, half) -> four
    # registers' (hi, mid, lo). (Split before the wait, ptxas moves it after: the SASS.)
    def split(s, u):
        r0 = wr[2 * s]
        r8 = wr[2 * s + 1]
        return (pieces(r0[4 * u], r0[4 * u + 1]), pieces(r8[4 * u], r8[4 * u + 1]),
                pieces(r0[4 * u + 2], r0[4 * u + 3]),
                pieces(r8[4 * u + 2], r8[4 * u + 3]))  # fmt: skip

    if cutlass.const_expr(pdl):
        cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(probe != 4):
            # The next PDL launch may start now, its prologue (weight loads) overlapping
            # this grid; its own wait still orders its reads of our outputs after us.
            cute.arch.griddepcontrol_launch_dependents()
    zero = Float32(0.0)
    acc = [[zero, zero, zero, zero] for _ in range(n_tiles * chains)]
    x_rows = [x + (Int64(cutlass.min(j * 8 + g, tokens - 1)) * hidden + k0) * 2
              for j in range(n_tiles)]  # fmt: skip
    # Activations `ahead` steps ahead of the MMAs (all of them for few tokens): one L2 round
    # trip after the wait, not one a step.
    ahead = steps if cutlass.const_expr(n_tiles * steps <= X_AHEAD_LOADS) else 1
    xs = [[ld_x4(x_rows[j] + s * 64) for j in range(n_tiles)] for s in range(ahead)]
    for s in cutlass.range_constexpr(steps):
        if cutlass.const_expr(s + ahead < steps):
            xs.append([ld_x4(x_rows[j] + (s + ahead) * 64) for j in range(n_tiles)])
        frags = [split(s, u) for u in range(2)] if cutlass.const_expr(fp32_weight) else []
        for j in cutlass.range_constexpr(n_tiles):
            xv = xs[s][j]
            for u in cutlass.range_constexpr(2):
                r0 = wr[2 * s]
                r8 = wr[2 * s + 1]
                if cutlass.const_expr(fp32_weight):
                    a0, a1, a2, a3 = frags[u]
                    for p in cutlass.range_constexpr(3):
                        # hi apart from mid + lo (2 chains), and the two K halves (4)
                        ch = (0 if p == 0 or chains == 1 else 1) + (2 * u if chains == 4 else 0)
                        chain = ch * n_tiles + j
                        acc[chain] = list(
                            mma(
                                (a0[p], a1[p], a2[p], a3[p]), xv[2 * u], xv[2 * u + 1], acc[chain]
                            )  # fmt: skip
                        )
                else:
                    a = (r0[2 * u], r8[2 * u], r0[2 * u + 1], r8[2 * u + 1])
                    acc[j] = list(mma(a, xv[2 * u], xv[2 * u + 1], acc[j]))
    # C fragment: rows g, g + 8 (experts), columns 2c, 2c + 1 (tokens).
    relaxed = probe == 2
    if cutlass.const_expr(push):
        cluster_wait()
    for j in cutlass.range_constexpr(n_tiles):
        v = acc[j]
        if cutlass.const_expr(fp32_weight):
            for ch in cutlass.range_constexpr(1, chains):
                more = acc[ch * n_tiles + j]
                v = [v[i] + more[i] for i in range(4)]
        if cutlass.const_expr(vec):
            tok = j * 8 + 2 * c
            if tok < tokens:  # tok + 1 may be padding: its slot is sent, never summed
                to = ((rank * warps + warp) * share_out + vec_slot(tok % n_tiles * 16 + g)) * 4
                st_async_peer_v4(part + to, mbar, tok // n_tiles, v[0], v[1], v[2], v[3])
        for i in cutlass.range_constexpr(0 if vec else 4):
            tok = j * 8 + 2 * c + i % 2
            e = g + 8 * (i // 2)
            if cutlass.const_expr(probe == 1):
                if tok < tokens:
                    st_f32(logits + (Int64(tok) * experts + tile * 16 + e) * 4, v[i])
            elif cutlass.const_expr(push):
                if tok < tokens:
                    at = tok * 16 + e
                    to = ((rank * warps + warp) * share_out + at % share_out) * 4
                    st_async_peer(part + to, mbar, at // share_out, v[i])
            else:
                st_shared(part + ((warp * cols + tok) * 16 + e) * 4, v[i])
    if cutlass.const_expr(probe == 1):
        return
    scores_here = route and probe != 7
    b = Float32(0.0)
    if cutlass.const_expr(scores_here):
        # The bias of this thread's expert in the sums below (share_out and the stride are
        # whole tiles of 16): loaded before the barrier, so it is in by the sums' end.
        b = ld_l2(bias + (tile * 16 + tid % 16) * 4)
    if cutlass.const_expr(route):  # noqa: SIM102 (a static if around a dynamic one)
        if tid == 0:
            # Before this thread's arrival below: its release orders the reset before the
            # last CTA's flag, which comes after that CTA's acquiring arrival.
            st_shared_s32(flag, 0)
    if cutlass.const_expr(push):
        # Outputs of real tokens only are sent: this CTA waits for those it sums, if any.
        sent = tokens + tokens % 2 if vec else tokens  # form 3 sends tokens in pairs
        owned = cutlass.max(cutlass.min(sent * 16 - rank * share_out, share_out), 0)
        if owned > 0:
            if tid == 0:
                mbar_expect(mbar, owned * cluster * warps * 4)
            mbar_wait(mbar)
    else:
        cluster_sync(relaxed)
    # This CTA's share of the tile's [cols x 16] outputs: the sum over the cluster's CTAs
    # and their warps, in that order.
    for o in cutlass.range(tid, share_out, warps * 32):
        at = rank * share_out + o
        tok = at // 16
        expert = tile * 16 + at % 16
        total = Float32(0.0)
        if cutlass.const_expr(push):
            if tok < tokens:
                slot = vec_slot(o) if vec else o
                for q in cutlass.range_constexpr(cluster):
                    for wp in cutlass.range_constexpr(warps):
                        total = total + ld_shared_f32(
                            part + ((q * warps + wp) * share_out + slot) * 4
                        )
        else:
            for q in cutlass.range_constexpr(cluster):
                for wp in cutlass.range_constexpr(warps):
                    total = total + ld_peer(part + ((wp * cols) * 16 + at) * 4, q)
        if tok < tokens:
            st_f32(logits + (Int64(tok) * experts + expert) * 4, total)
            if cutlass.const_expr(scores_here):
                s = sigmoid(total)
                at_s = scored + (Int64(tok) * experts + expert) * 8
                st_s32(at_s, key_of(bits(s + b)))
                st_s32(at_s + 4, bits(s))
    # With few tokens the last CTA routes alone: no flags for its peers, and the barrier that
    # keeps this CTA's partials readable until its peers are done is relaxed, waited at exit.
    local = route and few and probe != 5
    # Without the cluster's flags (the logits alone, or the last CTA routing alone), the exit
    # barrier only keeps this CTA's shared memory alive for its peers' reads: split around
    # the work below, and left out where nothing reads a peer's (`exit_barrier`).
    keep_alive = (local or not route) and exit_barrier
    if cutlass.const_expr(route):
        # Each CTA counts its arrival once its logits are out; the last of the launch sees
        # every logit, and routes them (few tokens) or flags its cluster to (more). The
        # ordering is cooperative groups' grid sync: the CTA barrier orders every thread's
        # stores before thread 0's arrival, whose release (acq_rel, GPU scope) makes them
        # visible to the CTA whose arrival acquires it; that CTA's barrier (or its cluster's,
        # release/acquire) orders its threads' reads after. No fence in every thread (`probe`
        # 9 keeps them: 0.7-1.0 us a routed call at 1-16 tokens, router run 19).
        if cutlass.const_expr(probe == 9):
            fence_gpu()
        cute.arch.sync_threads()
        if tid == 0:  # noqa: SIM102 (the arrival only in thread 0)
            if arrive(counter) == experts // 16 * cluster - 1:
                reset(counter)
                if cutlass.const_expr(local):
                    st_shared_s32(flag, 1)
                else:
                    for q in cutlass.range_constexpr(cluster):
                        st_peer_s32(flag, q, 1)
    if cutlass.const_expr(keep_alive):
        cluster_arrive_relaxed()
    elif cutlass.const_expr(route and not local):
        cluster_sync(relaxed)
    if cutlass.const_expr(route and probe != 3):
        if cutlass.const_expr(local):
            cute.arch.sync_threads()  # the flag, set by this CTA's thread 0
        if ld_shared_s32(flag) != 0:
            if cutlass.const_expr(probe == 9):
                fence_gpu()
            first, stride = (warp, warps) if local else (rank * warps + warp, cluster * warps)
            for t in cutlass.range(first, tokens, stride):
                route_token(logits, scored, bias, weights, ids, t, lane, experts, n_group,
                            topk_group, top_k, renorm, probe)  # fmt: skip
    if cutlass.const_expr(keep_alive):
        cluster_wait()


@cute.jit
def router_host(
    x: Int64, w: Int64, logits: Int64, scored: Int64, bias: Int64, weights: Int64, ids: Int64,
    counter: Int64, tokens: Int32, stream, hidden: cutlass.Constexpr, experts: cutlass.Constexpr,
    n_tiles: cutlass.Constexpr, warps: cutlass.Constexpr, cluster: cutlass.Constexpr,
    fp32_weight: cutlass.Constexpr, chains: cutlass.Constexpr, pdl: cutlass.Constexpr,
    route: cutlass.Constexpr, n_group: cutlass.Constexpr, topk_group: cutlass.Constexpr,
    top_k: cutlass.Constexpr, renorm: cutlass.Constexpr, few: cutlass.Constexpr,
    probe: cutlass.Constexpr, exchange_form: cutlass.Constexpr,
):  # fmt: skip
    router_kernel(
        x, w, logits, scored, bias, weights, ids, counter, tokens, hidden, experts, n_tiles, warps,
        cluster, fp32_weight, chains, pdl, route, n_group, topk_group, top_k, renorm, few, probe,
        exchange_form,
    ).launch(
        grid=[experts // 16, cluster, 1], block=[32 * warps, 1, 1], cluster=[1, cluster, 1],
        stream=stream, use_pdl=pdl,
    )  # fmt: skip
