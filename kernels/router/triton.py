"""Triton providers of the MoE router: a low-latency router GEMM (bf16 x fp32 -> fp32
logits) for small token counts, and the grouped top-k routing fused behind it.

Below `SPLIT_MIN_TOKENS` tokens, each program owns whole weight rows and computes its
logits with fp32 FMAs over all of K: no split, no fixup, one launch. It holds the whole row
and, launched with programmatic dependent launch (Hopper and later), reads it before
waiting for the kernel that writes x, so the weight read overlaps that kernel's tail.
From there to 64 tokens (`SPLIT_CONFIGS`), split-K without a fixup: each program reads its
weight tile before the same wait and writes a partial; the routing kernel (or, for the
logits alone, a sum kernel) adds the K splits in a fixed order. Above, split-K whose last
program per output tile sums the partials (one launch). The split kernels cut the fp32
weight exactly into three bf16 pieces (w = w1 + w2 + w3), so the bf16 tensor-core products
are exact and the fp32 accumulation gives fp32-GEMM accuracy; every sum is in one fixed
order (bitwise repeatable). From `PIECES_MIN_TOKENS` tokens, cuBLAS on the same three
pieces: one bf16 GEMM with fp32 output against [w1; w2; w3], whose thirds the reader adds in
order (fp32-GEMM accuracy at bf16 tensor-core speed, x never widened to fp32). Where torch's
bmm has no fp32 output for bf16 inputs, cuBLAS in fp32 (`F.linear(x.float(), w)`) above
`TRITON_MAX_TOKENS`. Every choice is made per call, so no shape recompiles.
`BEAMFX_PDL=0` turns programmatic dependent launch off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from beamfx.kernels.router import reference
from beamfx.kernels.triton_common import INTERPRET as _INTERPRET
from beamfx.kernels.triton_common import PDL as _PDL
from beamfx.kernels.triton_common import before_wait, tl, triton
from beamfx.ops import Provider

# Token counts up to this run the Triton GEMM; above, cuBLAS (measured crossover on an
# H200, bench/NOTES.md). From PIECES_MIN_TOKENS, cuBLAS on the weight's bf16 pieces
# (PiecesConfig) where torch's bmm has an fp32 output for bf16 inputs.
TRITON_MAX_TOKENS = 1024
PIECES_MIN_TOKENS = 256
_BMM_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")
# Below this, cuBLAS as well (none: the whole-row kernel beats cuBLAS's 7.7-8.6 us GEMV at
# 1 token on an H200, bench/results/router.md).
TRITON_MIN_TOKENS = 1
# Routing in Triton needs power-of-two tiles: experts and group sizes.
MAX_EXPERTS = 1024
_MAX_TILES = 2048
# Widest router the kernels take (Beam-1.0: 256 experts).
MAX_EXPERTS = 1024
# Partials the fixup loads at once (x BLOCK_E x BLOCK_T): bounded so they fit registers.
_FIX_ELEMENTS = 4096

if triton is not None:
    from beamfx.kernels.triton_common import dot_bf16 as _dot_bf16
    from beamfx.kernels.triton_common import exp as _exp

    @triton.jit
    def _bf16_pieces(w):
        """w = w1 + w2 + w3 exactly for fp32 w (8 + 8 + 8 mantissa bits), each bf16, so
        products with bf16 are exact in fp32. A bf16 w is its own w1 (w2, w3 unused)."""
        w1 = w.to(tl.bfloat16)
        rest = w.to(tl.float32) - w1.to(tl.float32)
        w2 = rest.to(tl.bfloat16)
        w3 = (rest - w2.to(tl.float32)).to(tl.bfloat16)
        return w1, w2, w3

    @triton.jit
    def _desc_key(v, idx, N: tl.constexpr):
        """int64 keys whose signed order is (v descending, then idx ascending): v's fp32 bits
        made order-preserving in the high word (zeros of either sign equal), N-1-idx low."""
        bits = tl.where(v == 0.0, 0, v.to(tl.int32, bitcast=True))
        mono = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (mono.to(tl.int64) << 32) | (N - 1 - idx).to(tl.int64)

    @triton.jit
    def _key_index(key, N: tl.constexpr):
        return N - 1 - (key & 0xFFFFFFFF).to(tl.int32)

    @triton.jit
    def _thread_major(keys, ROWS: tl.constexpr, E: tl.constexpr):
        """The same keys reordered (free: a relabeling of the layout) so that the values a
        thread holds come first. A row of fp32 loads 4 contiguous values to a thread, 128 to
        a warp, then repeats: with the repeats innermost, the top-k network's first stages
        run in registers, not in warp shuffles. Any order is correct; this one is faster."""
        if E >= 256:
            keys = tl.reshape(keys, (ROWS, E // 128, 32, 4))
            keys = tl.reshape(tl.permute(keys, (0, 2, 1, 3)), (ROWS, E))
        return keys

    @triton.jit
    def _top_keys(keys, K: tl.constexpr):
        """The K largest keys of each row, largest first (bitonic top-k; K a power of two)."""
        if K == 1:
            return tl.max(keys, axis=1, keep_dims=True)
        else:
            return tl.topk(keys, K)

    @triton.jit
    def _route_sorted(
        logits,
        bias,
        ROWS: tl.constexpr,
        E: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        """`_route` by bitonic top-k over packed (score, index) keys: one sort network per
        selection instead of one argmax round per pick. Same results, ties to the lower
        index."""
        GROUP: tl.constexpr = E // N_GROUP
        scores = tl.math.div_rn(1.0, 1.0 + _exp(-logits))
        biased = scores + bias[None, :]
        experts = tl.arange(0, E)
        keys = _desc_key(biased, experts[None, :], E)
        if TOPK_GROUP < N_GROUP:
            # Group score: sum of the top-2 biased scores; the best TOPK_GROUP groups.
            if GROUP >= 2:
                group_score = tl.sum(tl.topk(tl.reshape(biased, (ROWS, N_GROUP, GROUP)), 2), axis=2)
            else:
                group_score = biased
            groups = tl.arange(0, N_GROUP)
            # All groups sorted (N_GROUP is a power of two; TOPK_GROUP need not be).
            best = _top_keys(_desc_key(group_score, groups[None, :], N_GROUP), N_GROUP)
            picked = (groups[None, :] < TOPK_GROUP).to(tl.int32) << _key_index(best, N_GROUP)
            kept = tl.sum(picked, axis=1)  # a bit per kept group (distinct bits: a sum is an or)
            in_kept = ((kept[:, None] >> (experts[None, :] // GROUP)) & 1) != 0
            keys = tl.where(in_kept, keys, -0x7FFFFFFFFFFFFFFF - 1)
        top = _top_keys(_thread_major(keys, ROWS, E), K_POW2)
        ids = _key_index(top, E)
        slots = tl.arange(0, K_POW2)
        weights = tl.gather(scores, ids, axis=1)
        weights = tl.where(slots[None, :] < TOP_K, weights, 0.0)
        if RENORM:
            weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None])
        return weights, ids

    @triton.jit
    def _route(
        logits,
        bias,
        ROWS: tl.constexpr,
        E: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        """Grouped sigmoid top-k of a [ROWS, E] fp32 logits tile (reference.grouped_topk):
        returns (weights, ids) tiles [ROWS, K_POW2]; columns >= TOP_K are padding."""
        GROUP: tl.constexpr = E // N_GROUP
        scores = tl.math.div_rn(1.0, 1.0 + _exp(-logits))
        biased = scores + bias[None, :]
        # Group score: sum of the top-2 biased scores of the group.
        grouped = tl.reshape(biased, (ROWS, N_GROUP, GROUP))
        top1, top1_at = tl.max(grouped, axis=2, return_indices=True)
        if GROUP >= 2:
            in_group = tl.arange(0, GROUP)
            rest = tl.where(in_group[None, None, :] == top1_at[:, :, None], -float("inf"), grouped)
            group_score = top1 + tl.max(rest, axis=2)
        else:
            group_score = top1
        # The best TOPK_GROUP groups, as a bit mask per row.
        groups = tl.arange(0, N_GROUP)
        kept = tl.zeros([ROWS], dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            _, best = tl.max(group_score, axis=1, return_indices=True)
            kept = kept | (1 << best)
            group_score = tl.where(groups[None, :] == best[:, None], -float("inf"), group_score)
        experts = tl.arange(0, E)
        in_kept = ((kept[:, None] >> (experts[None, :] // GROUP)) & 1) != 0
        candidates = tl.where(in_kept, biased, -float("inf"))
        # Top-k experts among the kept groups; weights are the unbiased scores.
        slots = tl.arange(0, K_POW2)
        ids = tl.zeros([ROWS, K_POW2], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            _, best = tl.max(candidates, axis=1, return_indices=True)
            ids = tl.where(slots[None, :] == j, best[:, None], ids)
            candidates = tl.where(experts[None, :] == best[:, None], -float("inf"), candidates)
        weights = tl.gather(scores, ids, axis=1)
        weights = tl.where(slots[None, :] < TOP_K, weights, 0.0)
        if RENORM:
            weights = tl.math.div_rn(weights, tl.sum(weights, axis=1)[:, None])
        return weights, ids

    @triton.jit
    def _route_rows(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        row0,
        n_tokens,
        row_stride,
        split_stride,
        ROWS: tl.constexpr,
        E: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
        PDL: tl.constexpr = False,
        SPLITS: tl.constexpr = 1,
        SORTED: tl.constexpr = False,
        PIECES: tl.constexpr = 1,
    ):
        # logits_ptr: SPLITS partial sums of [n_tokens, E], added here in split order. Split
        # i sits at (i // PIECES) * split_stride + (i % PIECES) * E; rows row_stride apart.
        rows = row0 + tl.arange(0, ROWS)
        experts = tl.arange(0, E)
        row_ok = rows < n_tokens
        bias = tl.load(bias_ptr + experts).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
        at = logits_ptr + rows[:, None].to(tl.int64) * row_stride + experts[None, :]
        # .cg: the logits may come from other programs of this launch; bypass L1.
        logits = tl.load(at, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        for split in tl.static_range(1, SPLITS):
            off = (split // PIECES) * split_stride + (split % PIECES) * E
            logits += tl.load(at + off, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        if SORTED:
            weights, ids = _route_sorted(
                logits, bias, ROWS, E, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM
            )
        else:
            weights, ids = _route(logits, bias, ROWS, E, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM)
        slots = tl.arange(0, K_POW2)
        out = rows[:, None] * TOP_K + slots[None, :]
        ok = row_ok[:, None] & (slots[None, :] < TOP_K)
        tl.store(weights_ptr + out, weights, mask=ok)
        tl.store(ids_ptr + out, ids, mask=ok)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _route_kernel(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        n_tokens,
        row_stride,
        split_stride,
        ROWS: tl.constexpr,
        E: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
        PDL: tl.constexpr,
        SPLITS: tl.constexpr,
        SORTED: tl.constexpr,
        PIECES: tl.constexpr,
    ):
        row0 = tl.program_id(0) * ROWS
        _route_rows(
            logits_ptr, bias_ptr, weights_ptr, ids_ptr, row0, n_tokens, row_stride,
            split_stride, ROWS, E, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM, PDL, SPLITS,
            SORTED, PIECES,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["n_tokens", "row_stride", "split_stride"])
    def _sum_splits_kernel(
        part_ptr, out_ptr, n_tokens, n_cols, row_stride, split_stride, SPLITS: tl.constexpr,
        PIECES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # out[t, c] = part[0][t, c] + part[1][t, c] + ... in split order (one fixed sum every
        # run); part[i][t, c] at (i // PIECES) * split_stride + (i % PIECES) * n_cols +
        # t * row_stride + c.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_tokens * n_cols
        row = offs // n_cols
        at = part_ptr + row.to(tl.int64) * row_stride + (offs - row * n_cols)
        if PDL:
            tl.extra.cuda.gdc_wait()
        acc = tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
        for split in tl.static_range(1, SPLITS):
            off = (split // PIECES) * split_stride + (split % PIECES) * n_cols
            acc += tl.load(at + off, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + offs, acc, mask=ok)

    @triton.jit
    def _pieces_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr):
        # out[0], out[1], out[2] (n apart): the three bf16 pieces of the fp32 w.
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        w1, w2, w3 = _bf16_pieces(tl.load(w_ptr + offs, mask=ok, other=0.0))
        tl.store(out_ptr + offs, w1, mask=ok)
        tl.store(out_ptr + n + offs, w2, mask=ok)
        tl.store(out_ptr + 2 * n + offs, w3, mask=ok)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _router_split_kernel(
        x_ptr,
        w_ptr,
        part_ptr,
        n_tokens,
        n_experts,
        HIDDEN: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_T: tl.constexpr,
        K_CHUNK: tl.constexpr,
        W_PIECES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Program (e, s, t) writes part[s, t-tile, e-tile] = x[t-tile, K chunk s] @
        # w[e-tile, K chunk s]^T; whoever reads the logits adds the splits (no fixup here).
        # The whole weight tile is loaded and split into its bf16 pieces at once, before
        # the wait for the kernel that writes x (programmatic dependent launch).
        pid_e = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_t = tl.program_id(2)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_k = pid_s * K_CHUNK + tl.arange(0, K_CHUNK)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        e_ok = offs_e < n_experts
        k_ok = offs_k < HIDDEN
        t_ok = offs_t < n_tokens
        w = tl.load(
            w_ptr + offs_e[:, None].to(tl.int64) * HIDDEN + offs_k[None, :],
            mask=e_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        w1, w2, w3 = _bf16_pieces(w)
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        xt = tl.load(
            x_ptr + offs_t[None, :].to(tl.int64) * HIDDEN + offs_k[:, None],
            mask=t_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        zero = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
        acc = _dot_bf16(w1, xt, zero)
        if W_PIECES == 3:
            # Three independent MMA chains (a third of the dependent depth), smallest first.
            acc = (_dot_bf16(w3, xt, zero) + _dot_bf16(w2, xt, zero)) + acc
        out = pid_s * n_tokens * n_experts + offs_t[None, :] * n_experts + offs_e[:, None]
        tl.store(part_ptr + out, acc, mask=e_ok[:, None] & t_ok[None, :])

    @triton.jit
    def _route_when_last(
        logits_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        route_count_ptr,
        n_tokens,
        BLOCK_T: tl.constexpr,
        ROWS: tl.constexpr,
        E: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        # The program that finishes the last expert tile of these tokens routes them.
        pid_t = tl.program_id(2)
        tl.debug_barrier()
        done = tl.atomic_add(route_count_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            rows_here = tl.minimum(BLOCK_T, n_tokens - pid_t * BLOCK_T)
            for sub in tl.range(0, rows_here, ROWS):  # a loop, not unrolled: compile time
                _route_rows(
                    logits_ptr, bias_ptr, weights_ptr, ids_ptr, pid_t * BLOCK_T + sub,
                    n_tokens, E, 0, ROWS, E, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM,
                )  # fmt: skip
            tl.atomic_xchg(route_count_ptr + pid_t, 0)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _router_gemm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        part_ptr,
        tile_count_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        route_count_ptr,
        n_tokens,
        hidden,
        n_experts,
        n_splits,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        SPLIT_K: tl.constexpr,
        SPLIT_POW2: tl.constexpr,
        FIX_SPLITS: tl.constexpr,
        W_PIECES: tl.constexpr,
        ROUTE: tl.constexpr,
        ROUTE_ROWS: tl.constexpr,
        E_ROUTE: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        # Program (e, s, t) computes logits^T[e-tile, t-tile] over K chunk s: the weight
        # tile is the MMA's M side (>= 16 rows) however few tokens there are.
        pid_e = tl.program_id(0)
        pid_s = tl.program_id(1)
        pid_t = tl.program_id(2)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        e_ok = offs_e < n_experts
        t_ok = offs_t < n_tokens
        acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
        # Triton pipelines this loop's loads (cp.async, NUM_STAGES deep) under the MMAs.
        for kk in tl.range(0, K_CHUNK, BLOCK_K, num_stages=NUM_STAGES):
            offs_k = pid_s * K_CHUNK + kk + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            w = tl.load(
                w_ptr + offs_e[:, None].to(tl.int64) * hidden + offs_k[None, :],
                mask=e_ok[:, None] & k_ok[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            xt = tl.load(
                x_ptr + offs_t[None, :].to(tl.int64) * hidden + offs_k[:, None],
                mask=t_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            w1, w2, w3 = _bf16_pieces(w)
            acc = _dot_bf16(w1, xt, acc)
            if W_PIECES == 3:
                acc = _dot_bf16(w2, xt, acc)
                acc = _dot_bf16(w3, xt, acc)
        out = offs_t[None, :] * n_experts + offs_e[:, None]
        ok = e_ok[:, None] & t_ok[None, :]
        if SPLIT_K:
            tl.store(part_ptr + pid_s * n_tokens * n_experts + out, acc, mask=ok)
            # Release the partial to the tile's last finisher, which sums all of them.
            tl.debug_barrier()
            tile = pid_t * tl.num_programs(0) + pid_e
            arrived = tl.atomic_add(tile_count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == n_splits - 1:
                # Fixed order (chunks of FIX_SPLITS partials): the same sum every run.
                logits = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)
                for s0 in tl.static_range(0, SPLIT_POW2, FIX_SPLITS):
                    splits = s0 + tl.arange(0, FIX_SPLITS)
                    parts = tl.load(
                        part_ptr + splits[:, None, None] * n_tokens * n_experts + out[None, :, :],
                        mask=(splits < n_splits)[:, None, None] & ok[None, :, :],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    logits += tl.sum(parts, axis=0)
                tl.store(out_ptr + out, logits, mask=ok)
                tl.atomic_xchg(tile_count_ptr + tile, 0)
                if ROUTE:
                    _route_when_last(
                        out_ptr, bias_ptr, weights_ptr, ids_ptr, route_count_ptr, n_tokens,
                        BLOCK_T, ROUTE_ROWS, E_ROUTE, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM,
                    )  # fmt: skip
        else:
            tl.store(out_ptr + out, acc, mask=ok)
            if ROUTE:
                _route_when_last(
                    out_ptr, bias_ptr, weights_ptr, ids_ptr, route_count_ptr, n_tokens,
                    BLOCK_T, ROUTE_ROWS, E_ROUTE, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM,
                )  # fmt: skip

    @triton.jit
    def _gemv_w(w_ptr, e, e_ok, k, HIDDEN: tl.constexpr):
        return tl.load(
            w_ptr + e[:, None].to(tl.int64) * HIDDEN + k[None, :],
            mask=e_ok[:, None] & (k < HIDDEN)[None, :],
            other=0.0,
            eviction_policy="evict_first",
        ).to(tl.float32)

    @triton.jit
    def _gemv_x(x_ptr, t, t_ok, k, HIDDEN: tl.constexpr):
        # Four activations per thread, as the fp32 weight: the same register layout.
        xk = tl.max_contiguous(k, 4)
        return tl.load(
            x_ptr + t[:, None].to(tl.int64) * HIDDEN + xk[None, :],
            mask=t_ok[:, None] & (k < HIDDEN)[None, :],
            other=0.0,
        ).to(tl.float32)

    @triton.jit
    def _gemv_broadcast(
        x_ptr,
        w_ptr,
        t,
        e,
        n_tokens,
        n_experts,
        HIDDEN: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_B: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """logits[t, e] over the whole row: each weight row and each activation row loaded
        once, as [1, E, K] and [T, 1, K] tiles of one layout (four K a thread), so the
        product [T, E, K] is a broadcast in registers. The weight is read before the
        programmatic-dependent-launch wait."""
        t3 = t[:, None, None]
        e3 = e[None, :, None]
        ka = tl.max_contiguous(tl.arange(0, BLOCK_K), 4)[None, None, :]
        w_ok = e3 < n_experts
        x_ok = t3 < n_tokens
        wa = tl.load(w_ptr + e3.to(tl.int64) * HIDDEN + ka, mask=w_ok & (ka < HIDDEN), other=0.0,
                     eviction_policy="evict_first")  # fmt: skip
        if BLOCK_B > 0:
            kb = tl.max_contiguous(BLOCK_K + tl.arange(0, BLOCK_B), 4)[None, None, :]
            wb = tl.load(w_ptr + e3.to(tl.int64) * HIDDEN + kb, mask=w_ok & (kb < HIDDEN),
                         other=0.0, eviction_policy="evict_first")  # fmt: skip
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        xa = tl.load(x_ptr + t3.to(tl.int64) * HIDDEN + ka, mask=x_ok & (ka < HIDDEN), other=0.0)
        logits = tl.sum(xa.to(tl.float32) * wa.to(tl.float32), axis=2)
        if BLOCK_B > 0:
            xb = tl.load(x_ptr + t3.to(tl.int64) * HIDDEN + kb, mask=x_ok & (kb < HIDDEN),
                         other=0.0)  # fmt: skip
            logits += tl.sum(xb.to(tl.float32) * wb.to(tl.float32), axis=2)
        return logits

    @triton.jit(do_not_specialize=["n_tokens"])
    def _router_gemv_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        route_count_ptr,
        n_tokens,
        n_experts,
        HIDDEN: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_B: tl.constexpr,
        ONE_SHOT: tl.constexpr,
        BROADCAST: tl.constexpr,
        PDL: tl.constexpr,
        ROUTE: tl.constexpr,
        E_ROUTE: tl.constexpr,
        N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        TOP_K: tl.constexpr,
        K_POW2: tl.constexpr,
        RENORM: tl.constexpr,
    ):
        # Program (e, 0, t) owns whole weight rows: logits[t-tile, e-tile] in fp32 FMAs over
        # all of K, no split and no fixup. Its rows are (token, expert) pairs, so the weight
        # and activation tiles share one layout (no shared-memory round trip per K step).
        # The K loop is unrolled: the loads are issued ahead of the FMAs that need them.
        # ONE_SHOT holds the whole row (a BLOCK_K tile + a BLOCK_B tile) and, with PDL
        # (programmatic dependent launch), reads it before waiting for the kernel that
        # writes x: the weight read overlaps that kernel's tail.
        # BROADCAST (with ONE_SHOT): each row loaded once, the [tokens x experts] product a
        # broadcast in registers (`_gemv_broadcast`), not one (token, expert) pair a row.
        pid_e = tl.program_id(0)
        pid_t = tl.program_id(2)
        if BROADCAST:
            tb = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
            eb = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
            lg = _gemv_broadcast(x_ptr, w_ptr, tb, eb, n_tokens, n_experts, HIDDEN, BLOCK_K,
                                 BLOCK_B, PDL)  # fmt: skip
            tl.store(out_ptr + tb[:, None] * n_experts + eb[None, :], lg,
                     mask=(tb[:, None] < n_tokens) & (eb[None, :] < n_experts))  # fmt: skip
        else:
            R: tl.constexpr = BLOCK_E * BLOCK_T
            rows = tl.arange(0, R)
            e = pid_e * BLOCK_E + rows % BLOCK_E
            t = pid_t * BLOCK_T + rows // BLOCK_E
            e_ok = e < n_experts
            t_ok = t < n_tokens
            if ONE_SHOT:
                ka = tl.arange(0, BLOCK_K)
                kb = BLOCK_K + tl.arange(0, BLOCK_B if BLOCK_B > 0 else 1)
                wa = _gemv_w(w_ptr, e, e_ok, ka, HIDDEN)
                if BLOCK_B > 0:
                    wb = _gemv_w(w_ptr, e, e_ok, kb, HIDDEN)
                if PDL:
                    tl.extra.cuda.gdc_wait()
                    tl.extra.cuda.gdc_launch_dependents()
                acc = _gemv_x(x_ptr, t, t_ok, ka, HIDDEN) * wa
                logits = tl.sum(acc, axis=1)
                if BLOCK_B > 0:
                    logits += tl.sum(_gemv_x(x_ptr, t, t_ok, kb, HIDDEN) * wb, axis=1)
            else:
                if PDL:
                    tl.extra.cuda.gdc_wait()
                    tl.extra.cuda.gdc_launch_dependents()
                acc = tl.zeros([R, BLOCK_K], dtype=tl.float32)
                for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    acc += _gemv_x(x_ptr, t, t_ok, k, HIDDEN) * _gemv_w(w_ptr, e, e_ok, k, HIDDEN)
                logits = tl.sum(acc, axis=1)
            tl.store(out_ptr + t * n_experts + e, logits, mask=t_ok & e_ok)
        if ROUTE:
            _route_when_last(
                out_ptr, bias_ptr, weights_ptr, ids_ptr, route_count_ptr, n_tokens,
                BLOCK_T, 1, E_ROUTE, N_GROUP, TOPK_GROUP, TOP_K, K_POW2, RENORM,
            )  # fmt: skip


@dataclass(frozen=True)
class GemvConfig:
    """Tiling of the few-token router kernel: whole weight rows per program, fp32 FMAs."""

    block_e: int
    block_t: int
    block_k: int  # K step; with one_shot, the row's first tile (the rest: a second tile)
    num_warps: int
    one_shot: bool = False
    # Programmatic dependent launch: one_shot reads the weight before waiting for the
    # kernel that writes x; the K loop waits first (only the launch overlaps).
    pdl: bool = False
    # With one_shot: each weight and activation row loaded once and the product broadcast
    # in registers, rather than a (token, expert) pair per row (block_e x block_t loads).
    broadcast: bool = False

    def __post_init__(self):
        if self.broadcast and not self.one_shot:
            raise ValueError(
                f"GemvConfig: broadcast=True needs one_shot=True (got {self!r}); the K loop "
                "has no broadcast form"
            )


@dataclass(frozen=True)
class GemmConfig:
    """Tiling of the router GEMM: an expert tile x a K chunk per program (split-K)."""

    block_e: int
    k_chunk: int
    block_k: int
    num_warps: int
    num_stages: int = 3
    max_block_t: int = 64


@dataclass(frozen=True)
class SplitConfig:
    """Tiling of the split-K router kernel without a fixup: an expert tile x a K chunk x a
    token tile per program, its weight tile loaded whole (and, with pdl, before the wait for
    the kernel that writes x). The kernel that reads the logits adds the K splits in order:
    the routing kernel, or a small sum kernel for the logits alone."""

    block_e: int
    k_chunk: int
    num_warps: int
    max_block_t: int = 64
    pdl: bool = True


@dataclass(frozen=True)
class PiecesConfig:
    """Many tokens: cuBLAS on the weight's exact bf16 pieces. One small kernel writes the
    fp32 weight's three pieces ([3 x experts, hidden], bf16); one bf16 GEMM with fp32
    output gives [tokens, 3 x experts], whose thirds the reader adds in order. The products
    are exact and cuBLAS accumulates in fp32, so this keeps fp32-GEMM accuracy at bf16
    tensor-core speed, and x is never widened. A bf16 weight is its own single piece."""

    block: int = 4096  # weight values per program of the pieces kernel
    # x and the pieces cut along K into this many chunks (one batched GEMM), their products
    # added by the reader in fp32: shorter tensor-core accumulations are closer to fp32
    # (whose adds there are not IEEE-rounded).
    k_chunks: int = 1


# The pieces GEMM from PIECES_MIN_TOKENS tokens, K in four chunks. Measured on an H200
# (bench/NOTES.md): in one chunk (cuBLAS's tensor-core sums over all of K = 5120) 4-77
# logits a call sat off the fp64 product by more than 1e-5 + 1e-5 relative at 512-8192
# tokens (5.6e-6 in norm); in two, none in the benchmark (2.7e-6), but 4 of 131072 off the
# fp32 reference by more than that in a pass test; in four, 1.3e-6 in norm (the split-K
# Triton kernel: 1.8e-6), for 161 against 117 us at 8192 tokens (cuBLAS fp32: 544).
PIECES_CONFIG = PiecesConfig(k_chunks=4)


# By token count (first whose bound holds); measured on an H200 (bench/NOTES.md).
GEMM_CONFIGS: list[tuple[int, GemmConfig]] = [
    # Few tokens: 320 programs, each with its whole 16 KB weight chunk in flight (stages =
    # iterations + 1): the weight read is latency-bound, not compute-bound.
    (
        16,
        GemmConfig(block_e=16, k_chunk=256, block_k=64, num_warps=4, num_stages=5, max_block_t=16),
    ),
    (64, GemmConfig(block_e=16, k_chunk=256, block_k=64, num_warps=4, num_stages=5)),
    (1 << 62, GemmConfig(block_e=64, k_chunk=512, block_k=64, num_warps=4, num_stages=3)),
]
# Rows a routing program holds at once (registers: ROWS x experts fp32 tiles). Measured on
# an H200: one row per one-warp program, in a second kernel, beat routing inside the GEMM's
# last programs (which serializes the rows of a token block).
ROUTE_ROWS = 1
ROUTE_WARPS = 1
# The routing kernel launched with programmatic dependent launch: its launch and the bias
# load overlap the GEMM before it.
ROUTE_PDL = True
FUSED_ROUTING = False


# Few tokens: whole weight rows per program (GemvConfig), by token count (first whose bound
# holds), up to GEMV_MAX_TOKENS; the split-K MMA kernel above. Measured on an H200
# (bench/NOTES.md, router run 13): each row loaded once and the product broadcast, 4 warps,
# 2.11 / 2.28 / 3.16 / 4.27 us at 1 / 2 / 4 / 8 tokens against 2.32 / 2.63 / 3.32 / 5.59
# with a (token, expert) pair a row, which stays at 16 (the broadcast tile: 6.1-13.4 us).
_WHOLE_ROW = dict(block_k=4096, num_warps=4, one_shot=True, pdl=True, broadcast=True)
GEMV_CONFIGS: list[tuple[int, GemvConfig]] = [
    (1, GemvConfig(block_e=4, block_t=1, **_WHOLE_ROW)),
    (2, GemvConfig(block_e=4, block_t=2, **_WHOLE_ROW)),
    (4, GemvConfig(block_e=2, block_t=4, **_WHOLE_ROW)),
    (8, GemvConfig(block_e=2, block_t=8, **_WHOLE_ROW)),
    (16, GemvConfig(block_e=1, block_t=8, block_k=512, num_warps=4, pdl=True)),
]
GEMV_MAX_TOKENS = 16


# Split-K without a fixup (SplitConfig), by token count (first whose bound holds), from
# SPLIT_MIN_TOKENS up; ahead of the tables above.
# Measured on an H200 (bench/results/router_split_sweep.json, router.md): at 16-64 tokens
# the widest expert tile wins for routing (10.9-12.7 us against 14.9-18.4 for the kernels
# before); at 8 tokens the whole-row kernel (9.7 us routed, 5.6 for the logits, against
# 10.5 and 8.1 split); below 8 the whole-row kernel by far (2.4-3.8 us for the logits
# against ~7 split). vLLM pads decode batches to its CUDA-graph sizes (1, 2, 4, 8, 16, ...).
SPLIT_MIN_TOKENS = 9
SPLIT_CONFIGS: list[tuple[int, SplitConfig]] = [(64, SplitConfig(64, 256, 4))]
# The K splits the readers add (unrolled), at most.
MAX_SPLITS = 64
# Route by bitonic top-k over packed (score, index) keys (Triton's tl.topk), not argmax
# rounds: the routing kernel alone 2.9-3.0 us against 3.2-3.4 on an H200.
ROUTE_SORTED = triton is not None and hasattr(tl, "topk")


def _gemm_config(n_tokens: int) -> GemmConfig | GemvConfig | SplitConfig:
    """The Triton kernel's tiling at this token count."""
    split = next((c for bound, c in SPLIT_CONFIGS if n_tokens <= bound), None)
    if split is not None and n_tokens >= SPLIT_MIN_TOKENS:
        return split
    return _one_launch_config(n_tokens)


def _one_launch_config(n_tokens: int) -> GemmConfig | GemvConfig:
    """The tiling of the one-launch kernels (whole rows, or split-K with the fixup), which
    `_launch_gemm` runs and fused routing needs."""
    if n_tokens <= GEMV_MAX_TOKENS:
        return next(c for bound, c in GEMV_CONFIGS if n_tokens <= bound)
    return next(c for bound, c in GEMM_CONFIGS if n_tokens <= bound)


def _default_config(n_tokens: int) -> GemmConfig | GemvConfig | SplitConfig | PiecesConfig | None:
    """The provider's choice at this token count; None: plain cuBLAS (the reference)."""
    if n_tokens >= PIECES_MIN_TOKENS and _BMM_OUT_DTYPE:
        return PIECES_CONFIG
    if TRITON_MIN_TOKENS <= n_tokens <= TRITON_MAX_TOKENS:
        return _gemm_config(n_tokens)
    return None


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Arrival counters of the split-K tiles and routing blocks, zero between launches
    (each launch's last arrivals reset them). Allocated once per device, before capture."""
    if device not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "router_gemm: its arrival counters are allocated on the first call, which "
                "is inside CUDA graph capture here; run one call eagerly before capturing"
            )
        _COUNTERS[device] = torch.zeros(2 * _MAX_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _routable(n_experts: int, n_group: int, topk_group: int, top_k: int) -> bool:
    pow2 = lambda v: v > 0 and v & (v - 1) == 0
    return (
        pow2(n_experts)
        and n_experts <= MAX_EXPERTS
        and pow2(n_group)
        and n_group <= 32
        and n_experts % n_group == 0
        and 0 < topk_group <= n_group
        and 0 < top_k <= n_experts
    )


def _launch_gemm(
    x2d: torch.Tensor,
    weight: torch.Tensor,
    logits: torch.Tensor,
    route: tuple | None,
    config: GemmConfig | None = None,
) -> None:
    n_tokens, hidden = x2d.shape
    n_experts = weight.shape[0]
    config = config or _one_launch_config(n_tokens)
    if isinstance(config, GemvConfig):
        _launch_gemv(x2d, weight, logits, route, config)
        return
    block_t = min(config.max_block_t, max(16, triton.next_power_of_2(n_tokens)))
    n_splits = triton.cdiv(hidden, config.k_chunk)
    split_pow2 = triton.next_power_of_2(n_splits)
    grid = (triton.cdiv(n_experts, config.block_e), n_splits, triton.cdiv(n_tokens, block_t))
    if grid[0] * grid[2] > _MAX_TILES:
        raise ValueError(
            f"router_gemm: {grid[0] * grid[2]} output tiles > {_MAX_TILES}; "
            f"use cuBLAS above {TRITON_MAX_TOKENS} tokens"
        )
    counters = _counters(x2d.device)
    partials = logits
    if n_splits > 1:
        partials = torch.empty((n_splits, n_tokens, n_experts), dtype=torch.float32,
                               device=x2d.device)  # fmt: skip
    if route is None:
        bias, weights, ids = logits, logits, logits
        n_group = topk_group = top_k = 1
        renormalize = False
    else:
        bias, weights, ids, top_k, n_group, topk_group, renormalize = route
    _router_gemm_kernel[grid](
        x2d,
        weight,
        logits,
        partials,
        counters,
        bias,
        weights,
        ids,
        counters[_MAX_TILES:],
        n_tokens,
        hidden,
        n_experts,
        n_splits,
        BLOCK_T=block_t,
        BLOCK_E=config.block_e,
        BLOCK_K=config.block_k,
        K_CHUNK=config.k_chunk,
        NUM_STAGES=config.num_stages,
        SPLIT_K=n_splits > 1,
        SPLIT_POW2=split_pow2,
        FIX_SPLITS=max(1, min(split_pow2, _FIX_ELEMENTS // (config.block_e * block_t))),
        W_PIECES=3 if weight.dtype == torch.float32 else 1,
        ROUTE=route is not None,
        ROUTE_ROWS=min(ROUTE_ROWS, block_t),
        E_ROUTE=n_experts if route is not None else 1,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        RENORM=bool(renormalize),
        num_warps=config.num_warps,
    )


def _launch_split(x2d: torch.Tensor, weight: torch.Tensor, config: SplitConfig):
    """Partial logits [splits, tokens, experts] over K chunks; returns (partials, splits)."""
    n_tokens, hidden = x2d.shape
    n_experts = weight.shape[0]
    n_splits = triton.cdiv(hidden, config.k_chunk)
    if n_splits > MAX_SPLITS:
        raise ValueError(
            f"router_gemm: SplitConfig k_chunk {config.k_chunk} cuts hidden {hidden} into "
            f"{n_splits} splits > {MAX_SPLITS}; use a k_chunk >= {triton.cdiv(hidden, MAX_SPLITS)}"
        )
    block_t = min(config.max_block_t, max(16, triton.next_power_of_2(n_tokens)))
    grid = (triton.cdiv(n_experts, config.block_e), n_splits, triton.cdiv(n_tokens, block_t))
    part = torch.empty((n_splits, n_tokens, n_experts), dtype=torch.float32, device=x2d.device)
    pdl = config.pdl and x2d.device.type == "cuda" and _PDL
    _router_split_kernel[grid](
        x2d,
        weight,
        part,
        n_tokens,
        n_experts,
        HIDDEN=hidden,
        BLOCK_E=config.block_e,
        BLOCK_T=block_t,
        K_CHUNK=config.k_chunk,
        W_PIECES=3 if weight.dtype == torch.float32 else 1,
        PDL=pdl,
        num_warps=config.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
    return part, n_splits


def _split_layout(part: torch.Tensor, n_experts: int) -> tuple[int, int, int, int]:
    """(splits, row stride, split stride, pieces) of partial logits [chunks, tokens, pieces
    x experts] (the split kernel: one piece; the pieces GEMM: three) or whole logits
    [tokens, experts]; split i is piece i % pieces of chunk i // pieces."""
    if part.dim() == 2:
        return 1, part.stride(0), 0, 1
    pieces = part.shape[2] // n_experts
    assert part.shape[2] == pieces * n_experts and part.stride(2) == 1, part.shape
    return part.shape[0] * pieces, part.stride(1), part.stride(0), pieces


def _sum_splits(part: torch.Tensor, logits: torch.Tensor) -> None:
    n_tokens, n_experts = logits.shape
    n_splits, row_stride, split_stride, pieces = _split_layout(part, n_experts)
    block = 256  # a token's logits per program at Beam's 256 experts: many programs
    pdl = _PDL and part.device.type == "cuda"
    _sum_splits_kernel[(triton.cdiv(n_tokens * n_experts, block),)](
        part, logits, n_tokens, n_experts, row_stride, split_stride, SPLITS=n_splits,
        PIECES=pieces, BLOCK=block, PDL=pdl, num_warps=2,
        **({"launch_pdl": True} if pdl else {}),
    )  # fmt: skip


def _launch_pieces(x2d: torch.Tensor, weight: torch.Tensor, config: PiecesConfig):
    """Partial logits [chunks, tokens, pieces x experts]: one batched bf16 GEMM (fp32
    output) of x's K chunks with the weight's exact bf16 pieces; returns (partials, splits)."""
    n_tokens, hidden = x2d.shape
    n_experts = weight.shape[0]
    pieces = weight
    if weight.dtype == torch.float32:
        pieces = torch.empty((3 * n_experts, hidden), dtype=torch.bfloat16, device=weight.device)
        n = weight.numel()
        _pieces_kernel[(triton.cdiv(n, config.block),)](weight, pieces, n, BLOCK=config.block)
    chunks = _k_chunks(hidden, config.k_chunks)
    kc = hidden // chunks
    # Views, no copies: x [chunks, tokens, kc] and the pieces [chunks, kc, pieces x experts].
    a = x2d.as_strided((chunks, n_tokens, kc), (kc, x2d.stride(0), 1))
    b = pieces.as_strided((chunks, kc, pieces.shape[0]), (kc, 1, pieces.stride(0)))
    if x2d.device.type == "cuda":
        part = torch.bmm(a, b, out_dtype=torch.float32)
    else:  # CPU (tests under Triton's interpreter): the same exact products, fp32 sums
        part = torch.bmm(a.float(), b.float())
    return part, chunks * (pieces.shape[0] // n_experts)


def _k_chunks(hidden: int, wanted: int) -> int:
    """The most K chunks, up to `wanted`, that cut hidden into 16-byte-aligned equal parts."""
    return next(c for c in range(max(1, wanted), 0, -1) if hidden % (8 * c) == 0 or c == 1)


def _launch_gemv(x2d, weight, logits, route, config: GemvConfig) -> None:
    n_tokens, hidden = x2d.shape
    n_experts = weight.shape[0]
    grid = (triton.cdiv(n_experts, config.block_e), 1, triton.cdiv(n_tokens, config.block_t))
    block_k = min(config.block_k, triton.next_power_of_2(hidden))
    block_b = 0
    if config.one_shot and block_k < hidden:
        # The row as two tiles: block_k, then the rest padded to a power of two; a rest
        # wider than block_k: the row as one padded tile.
        block_b = triton.next_power_of_2(hidden - block_k)
        if block_b > block_k:
            block_k, block_b = triton.next_power_of_2(hidden), 0
    pdl = config.pdl and x2d.device.type == "cuda" and _PDL
    if route is None:
        bias, weights, ids = logits, logits, logits
        n_group = topk_group = top_k = 1
        renormalize = False
        route_count = logits
    else:
        bias, weights, ids, top_k, n_group, topk_group, renormalize = route
        if grid[2] > _MAX_TILES:
            raise ValueError(f"router_gemm: {grid[2]} token tiles > {_MAX_TILES}")
        route_count = _counters(x2d.device)[_MAX_TILES:]
    _router_gemv_kernel[grid](
        x2d,
        weight,
        logits,
        bias,
        weights,
        ids,
        route_count,
        n_tokens,
        n_experts,
        HIDDEN=hidden,
        BLOCK_E=config.block_e,
        BLOCK_T=config.block_t,
        BLOCK_K=block_k,
        BLOCK_B=block_b,
        ONE_SHOT=config.one_shot,
        BROADCAST=config.broadcast,
        PDL=pdl,
        ROUTE=route is not None,
        E_ROUTE=n_experts if route is not None else 1,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        RENORM=bool(renormalize),
        num_warps=config.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def _launch_route(logits, bias, weights, ids, top_k, n_group, topk_group, renormalize, *,
                  pdl: bool = True) -> None:  # fmt: skip
    """Route `logits` [tokens, experts], or the sum of the partials of `_split_layout`.
    `pdl=False`: `bias` was copied just now (it is read before the wait)."""
    n_tokens, n_experts = ids.shape[0], bias.shape[0]
    splits, row_stride, split_stride, pieces = _split_layout(logits, n_experts)
    pdl = pdl and ROUTE_PDL and _PDL and logits.device.type == "cuda"
    _route_kernel[(triton.cdiv(n_tokens, ROUTE_ROWS),)](
        logits,
        bias,
        weights,
        ids,
        n_tokens,
        row_stride,
        split_stride,
        ROWS=ROUTE_ROWS,
        E=n_experts,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k),
        RENORM=bool(renormalize),
        PDL=pdl,
        SPLITS=splits,
        SORTED=ROUTE_SORTED,
        PIECES=pieces,
        num_warps=ROUTE_WARPS,
        **({"launch_pdl": True} if pdl else {}),
    )


def router_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    config: GemmConfig | GemvConfig | SplitConfig | PiecesConfig | None = None,
) -> torch.Tensor:
    """`reference.router_logits`: the Triton kernels from TRITON_MIN_TOKENS tokens (whole
    rows per program up to GEMV_MAX_TOKENS, split-K above), cuBLAS on the weight's bf16
    pieces from PIECES_MIN_TOKENS, chosen per call; plain cuBLAS (the reference) outside
    those ranges.

    `config` forces that path and tiling (benchmarks and tests).
    """
    hidden = x.shape[-1]
    n_tokens = x.numel() // hidden if hidden else 0
    config = config or _default_config(n_tokens)
    if n_tokens == 0 or config is None:
        return reference.router_logits(x, weight)
    logits = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32, device=x.device)
    x2d = x.reshape(n_tokens, hidden).contiguous()
    (weight,), copied = before_wait(weight)
    config = _without_pdl(config) if copied else config
    if isinstance(config, (SplitConfig, PiecesConfig)):
        launch = _launch_split if isinstance(config, SplitConfig) else _launch_pieces
        part, n_splits = launch(x2d, weight, config)
        if n_splits == 1:  # one piece (a bf16 weight), one chunk: the logits themselves
            return part.view(logits.shape)
        _sum_splits(part, logits.view(n_tokens, -1))
    else:
        _launch_gemm(x2d, weight, logits, None, config)
    return logits


def _without_pdl(config):
    """The config launching without programmatic dependent launch (its weight was copied
    just now: `triton_common.before_wait`)."""
    return dataclasses.replace(config, pdl=False) if hasattr(config, "pdl") else config


def routed_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    *,
    fused: bool | None = None,
    config: GemmConfig | GemvConfig | SplitConfig | PiecesConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.routed_topk`: router GEMM and grouped top-k, fused into the GEMM's last
    programs when `fused` (default FUSED_ROUTING), else a second small kernel."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    n_tokens, n_experts = x2d.shape[0], weight.shape[0]
    if not _routable(n_experts, n_group, topk_group, top_k):
        logits = router_gemm(x2d, weight)
        return reference.grouped_topk(logits, correction_bias, top_k, n_group, topk_group,
                                      renormalize)  # fmt: skip
    weights = torch.empty((n_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((n_tokens, top_k), dtype=torch.int32, device=x.device)
    if n_tokens == 0:
        return weights, ids
    (bias,), bias_copied = before_wait(correction_bias)  # the routing reads it first
    fused = FUSED_ROUTING if fused is None else fused
    config = config or _default_config(n_tokens)
    route_args = (bias, weights, ids, top_k, n_group, topk_group, renormalize)
    if isinstance(config, (SplitConfig, PiecesConfig)):
        # The routing kernel adds the K splits (or the weight's pieces): the logits never
        # exist whole.
        (weight,), copied = before_wait(weight)
        config = _without_pdl(config) if copied else config
        launch = _launch_split if isinstance(config, SplitConfig) else _launch_pieces
        part, _ = launch(x2d.contiguous(), weight, config)
        _launch_route(part, *route_args, pdl=not bias_copied)
    elif fused and config is not None:
        logits = torch.empty((n_tokens, n_experts), dtype=torch.float32, device=x.device)
        (weight,), copied = before_wait(weight)
        config = _without_pdl(config) if copied or bias_copied else config
        _launch_gemm(x2d.contiguous(), weight, logits, route_args, config)
    else:
        logits = router_gemm(x2d, weight, config=config)
        _launch_route(logits, *route_args, pdl=not bias_copied)
    return weights, ids


def _check_gemm(x: torch.Tensor, weight: torch.Tensor, *, need_cuda: bool = True) -> str | None:
    if triton is None:
        return "triton is not installed"
    if need_cuda and x.device.type != "cuda":
        return f"device {x.device.type} is not cuda"
    if weight.device != x.device:
        return f"weight on {weight.device}, x on {x.device}"
    if x.dtype != torch.bfloat16:
        return f"x dtype {x.dtype} is not bf16"
    if weight.dtype not in (torch.float32, torch.bfloat16):
        return f"weight dtype {weight.dtype} is not fp32/bf16"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        return f"weight {tuple(weight.shape)} is not [experts, {x.shape[-1]}]"
    if weight.shape[0] > MAX_EXPERTS:
        # Canonicalize also lifts a plain fp32 head on upcast states (a vocabulary, not a
        # router): the output tiles' counters and the weight's bf16 pieces are not for it.
        return f"{weight.shape[0]} experts > {MAX_EXPERTS}: a router's kernel; cuBLAS serves it"
    # The split-K kernel's readers add at most MAX_SPLITS chunks. A symbolic token count
    # (while compiling) is not compared, which would guard the graph on it: the run-time
    # dispatch asks again with the real count.
    tokens, hidden = x.numel() // max(x.shape[-1], 1), x.shape[-1]
    config = _default_config(tokens) if isinstance(tokens, int) else None
    if isinstance(config, SplitConfig) and triton.cdiv(hidden, config.k_chunk) > MAX_SPLITS:
        return (
            f"hidden {hidden} makes {triton.cdiv(hidden, config.k_chunk)} K chunks of "
            f"{config.k_chunk} at {tokens} tokens, past the split kernel's {MAX_SPLITS}"
        )
    return None


def supports_router_gemm(x, weight) -> str | None:
    """None if the provider runs these arguments (device, dtype and shape only), else why."""
    return _check_gemm(x, weight)


def supports_routed_topk(
    x, weight, correction_bias, top_k, n_group, topk_group, renormalize
) -> str | None:
    """None if the provider runs these arguments (device, dtype and shape only), else why."""
    reason = _check_gemm(x, weight)
    if reason is not None:
        return reason
    n_experts = weight.shape[0]
    if tuple(correction_bias.shape) != (n_experts,):
        return f"correction_bias {tuple(correction_bias.shape)} is not ({n_experts},)"
    if correction_bias.device != x.device:  # the kernel reads it by address
        return f"correction_bias on {correction_bias.device}, x on {x.device}"
    if n_group <= 0 or n_experts % n_group or not 0 < topk_group <= n_group:
        return f"n_group {n_group} / topk_group {topk_group} do not split {n_experts} experts"
    if not 0 < top_k <= n_experts // n_group * topk_group:
        return f"top_k {top_k} > experts in {topk_group} groups"
    return None


_AVAILABLE = triton is not None and not _INTERPRET and torch.cuda.is_available()
ROUTER_GEMM = Provider("triton", router_gemm, supports_router_gemm) if _AVAILABLE else None
ROUTED_TOPK = Provider("triton", routed_topk, supports_routed_topk) if _AVAILABLE else None
