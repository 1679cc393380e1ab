"""Triton provider of the sublayer boundary: [MoE finalize] -> post-norm -> scaled residual
-> next norm in one launch, keeping every bf16 rounding of the contract (BEAM.md).

Inductor's own fusion of this math drops the intermediate roundings; this kernel keeps
them, so it can replace the reference bit for bit up to the order of the row sums.
With a process group the finalize and the all-reduce run first through the reference
(`reduce_sublayer`), and the kernel reads the reduced rows: a future one-shot fused
all-reduce replaces exactly that step.
"""

from __future__ import annotations

import torch

from beamfx.kernels.boundary import reference
from beamfx.kernels.triton_common import INTERPRET as _INTERPRET
from beamfx.kernels.triton_common import PDL as _PDL
from beamfx.kernels.triton_common import before_wait, tl, triton
from beamfx.ops import Provider

# Widest row the kernel holds in registers (one program per row).
MAX_HIDDEN = 16384
# Most expert rows per token that the finalize unrolls.
MAX_TOPK = 16
# On the many-row path, hold a row that is not a power of two as two exact tiles (4096 +
# 1024 at hidden 5120) rather than one padded tile: fewer registers per row, so two
# programs fit an SM (bench/NOTES.md).
SPLIT_ROWS = True
# Hold each tile as [threads, values a thread] so a thread adds its own values of both tiles
# before the block-wide sum: one block reduction a norm instead of one a tile (6 barriers a
# row instead of 12). On an H100 at hidden 5120 (bench/NOTES.md, boundary run 9): 4-6%
# faster at 1-1024 rows, within 1% either way at 4096-16384 (2048 not measured), hence
# below ROW2D_BELOW_ROWS only. Only where the tiles divide over the threads, not for the finalize.
ROW2D = True
ROW2D_BELOW_ROWS = 4096
# Launch with programmatic dependent launch (Hopper and later): the norm weights load
# before the wait on the previous kernel; 2.06 vs 3.01 us at 1 token, 2.90 vs 3.64 at 64
# on an H200, level from 1024 tokens (bench/results/boundary.md). BEAMFX_PDL=0 turns it off.
PDL = True
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {}

if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    from beamfx.kernels.triton_common import round_to as _round

    @triton.jit
    def _load_row(ptr, base, cols_a, cols_b, hidden, HAS_B: tl.constexpr, POLICY: tl.constexpr):
        """A row as two register tiles: cols_a (a power of two) and cols_b (the rest, when
        HAS_B), so hidden 5120 is held as 4096 + 1024 rather than padded to 8192."""
        a = tl.load(ptr + base + cols_a, mask=cols_a < hidden, other=0.0, eviction_policy=POLICY)
        b = a
        if HAS_B:
            b = tl.load(
                ptr + base + cols_b, mask=cols_b < hidden, other=0.0, eviction_policy=POLICY
            )
        return a, b

    @triton.jit
    def _store_row(ptr, base, cols_a, cols_b, hidden, a, b, HAS_B: tl.constexpr):
        tl.store(ptr + base + cols_a, a, mask=cols_a < hidden)
        if HAS_B:
            tl.store(ptr + base + cols_b, b, mask=cols_b < hidden)

    @triton.jit
    def _row_cols(BLOCK: tl.constexpr, THREADS: tl.constexpr, ROW2D: tl.constexpr):
        """Column offsets of a tile: 1-D, or with ROW2D as [THREADS, BLOCK / THREADS], so
        each thread holds one row of the 2-D tile (the same columns it holds in 1-D)."""
        if ROW2D:
            per: tl.constexpr = BLOCK // THREADS
            return tl.arange(0, THREADS)[:, None] * per + tl.arange(0, per)[None, :]
        else:
            return tl.arange(0, BLOCK)

    @triton.jit
    def _sum_squares(a, b, HAS_B: tl.constexpr, ROW2D: tl.constexpr):
        """Sum of squares over both tiles. With ROW2D each thread first adds its own values
        of both tiles, so the row costs one block-wide reduction instead of two."""
        if ROW2D:
            part = tl.sum(a * a, axis=1)
            if HAS_B:
                part += tl.sum(b * b, axis=1)
            return tl.sum(part, axis=0)
        else:
            total = tl.sum(a * a, axis=0)
            if HAS_B:
                total += tl.sum(b * b, axis=0)
            return total

    @triton.jit
    def _rms_scale(a, b, wa, wb, inv_hidden, eps, HAS_B: tl.constexpr, ROW2D: tl.constexpr):
        """`v * rsqrt(mean(v^2) + eps) * w` in fp32 over both tiles (masked lanes hold
        zeros); the mean is a multiply by fp32(1/H), as torch's CUDA mean does."""
        total = _sum_squares(a, b, HAS_B, ROW2D)
        inv = tl.math.rsqrt(total * inv_hidden + eps)
        return a * inv * wa, b * inv * wb

    @triton.jit
    def _finish_row(
        xa,
        xb,
        ra,
        rb,
        base,
        h_ptr,
        y_ptr,
        cols_a,
        cols_b,
        hidden,
        wpa,
        wpb,
        wna,
        wnb,
        inv_hidden,
        eps_post,
        eps_next,
        x_scale,
        residual_scale,
        HAS_NEXT: tl.constexpr,
        HAS_B: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        ROW2D: tl.constexpr,
    ):
        """From the reduced row (fp32 values of OUT_DTYPE) and the residual row: the
        contract's roundings in its order (BEAM.md, "Decoder layer"), then the stores."""
        ta, tb = _rms_scale(xa, xb, wpa, wpb, inv_hidden, eps_post, HAS_B, ROW2D)
        ta = _round(_round(ta, OUT_DTYPE) * x_scale, OUT_DTYPE)
        tb = _round(_round(tb, OUT_DTYPE) * x_scale, OUT_DTYPE)
        ha = _round(ta + _round(ra.to(tl.float32) * residual_scale, OUT_DTYPE), OUT_DTYPE)
        hb = _round(tb + _round(rb.to(tl.float32) * residual_scale, OUT_DTYPE), OUT_DTYPE)
        _store_row(h_ptr, base, cols_a, cols_b, hidden, ha.to(OUT_DTYPE), hb.to(OUT_DTYPE), HAS_B)
        if HAS_NEXT:
            ya, yb = _rms_scale(ha, hb, wna, wnb, inv_hidden, eps_next, HAS_B, ROW2D)
            ya = _round(ya, OUT_DTYPE).to(OUT_DTYPE)
            yb = _round(yb, OUT_DTYPE).to(OUT_DTYPE)
            _store_row(y_ptr, base, cols_a, cols_b, hidden, ya, yb, HAS_B)

    @triton.jit(do_not_specialize=["n_rows"])
    def _boundary_kernel(
        x_ptr,
        topk_w_ptr,
        r_ptr,
        w_post_ptr,
        w_next_ptr,
        h_ptr,
        y_ptr,
        n_rows,
        hidden,
        inv_hidden,
        eps_post,
        eps_next,
        x_scale,
        residual_scale,
        routed_scale,
        TOPK: tl.constexpr,
        HAS_NEXT: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
        BLOCK_A: tl.constexpr,
        BLOCK_B: tl.constexpr,
        PREFETCH: tl.constexpr,
        PDL: tl.constexpr,
        ROW2D: tl.constexpr,
        THREADS: tl.constexpr,
    ):
        # Each program walks rows pid, pid + grid, ...; the norm weights stay in registers.
        # A row is a BLOCK_A tile plus (BLOCK_B > 0) a BLOCK_B tile after it.
        HAS_B: tl.constexpr = BLOCK_B > 0
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        cols_a = _row_cols(BLOCK_A, THREADS, ROW2D)
        if HAS_B:
            cols_b = BLOCK_A + _row_cols(BLOCK_B, THREADS, ROW2D)
        else:
            cols_b = cols_a  # not read
        # Streamed rows are read once (evict_first); the norm weights stay in L2 (evict_last).
        wpa, wpb = _load_row(w_post_ptr, 0, cols_a, cols_b, hidden, HAS_B, "evict_last")
        wpa, wpb = wpa.to(tl.float32), wpb.to(tl.float32)
        wna, wnb = wpa, wpb
        if HAS_NEXT:
            wna, wnb = _load_row(w_next_ptr, 0, cols_a, cols_b, hidden, HAS_B, "evict_last")
            wna, wnb = wna.to(tl.float32), wnb.to(tl.float32)
        if PDL:
            # Programmatic dependent launch: the weights (never written by a kernel) are in
            # flight while the kernel that writes x and r finishes; wait for it only now.
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if TOPK == 0 and PREFETCH:
            # Software pipelining by hand: the next row's loads fly while this row computes.
            first = tl.cast(pid, tl.int64) * hidden  # the grid has at most n_rows programs
            xa_next, xb_next = _load_row(x_ptr, first, cols_a, cols_b, hidden, HAS_B, "evict_first")
            ra_next, rb_next = _load_row(r_ptr, first, cols_a, cols_b, hidden, HAS_B, "evict_first")
            for row in tl.range(pid, n_rows, step):
                base = tl.cast(row, tl.int64) * hidden
                xa, xb, ra, rb = xa_next, xb_next, ra_next, rb_next
                ahead = base + step * hidden
                width = tl.where(row + step < n_rows, hidden, 0)
                xa_next, xb_next = _load_row(
                    x_ptr, ahead, cols_a, cols_b, width, HAS_B, "evict_first"
                )
                ra_next, rb_next = _load_row(
                    r_ptr, ahead, cols_a, cols_b, width, HAS_B, "evict_first"
                )
                _finish_row(
                    xa.to(tl.float32), xb.to(tl.float32), ra, rb, base, h_ptr, y_ptr, cols_a,
                    cols_b, hidden, wpa, wpb, wna, wnb, inv_hidden, eps_post, eps_next, x_scale,
                    residual_scale, HAS_NEXT, HAS_B, OUT_DTYPE, ROW2D,
                )  # fmt: skip
        else:
            for row in tl.range(pid, n_rows, step):
                row64 = tl.cast(row, tl.int64)
                base = row64 * hidden
                ra, rb = _load_row(r_ptr, base, cols_a, cols_b, hidden, HAS_B, "evict_first")
                if TOPK == 0:
                    xa, xb = _load_row(x_ptr, base, cols_a, cols_b, hidden, HAS_B, "evict_first")
                    xa, xb = xa.to(tl.float32), xb.to(tl.float32)
                else:
                    # MoE finalize: fp32 weighted sum of the k expert rows, routed scale, one
                    # rounding.
                    acc_a = tl.zeros([BLOCK_A], dtype=tl.float32)
                    acc_b = tl.zeros([BLOCK_B if HAS_B else 1], dtype=tl.float32)
                    for j in tl.static_range(TOPK):
                        wj = tl.load(topk_w_ptr + row64 * TOPK + j).to(tl.float32)
                        xja, xjb = _load_row(x_ptr, (row64 * TOPK + j) * hidden, cols_a, cols_b,
                                             hidden, HAS_B, "evict_first")  # fmt: skip
                        acc_a += xja.to(tl.float32) * wj
                        if HAS_B:
                            acc_b += xjb.to(tl.float32) * wj
                    xa = _round(acc_a * routed_scale, OUT_DTYPE)
                    xb = _round(acc_b * routed_scale, OUT_DTYPE)
                _finish_row(
                    xa, xb, ra, rb, base, h_ptr, y_ptr, cols_a, cols_b, hidden, wpa, wpb, wna,
                    wnb, inv_hidden, eps_post, eps_next, x_scale, residual_scale, HAS_NEXT, HAS_B,
                    OUT_DTYPE, ROW2D,
                )  # fmt: skip


def row_tiles(hidden: int, split: bool) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B): a row as a power-of-two tile plus a power-of-two remainder tile
    (hidden 5120 = 4096 + 1024), or one padded tile (BLOCK_B = 0) when `split` is off or the
    remainder tile would pad as much as the single one."""
    whole = triton.next_power_of_2(hidden)
    if not split or whole == hidden:
        return whole, 0
    a = whole // 2
    b = triton.next_power_of_2(hidden - a)
    return (a, b) if a + b < whole else (whole, 0)


def rows_as_2d(block_a: int, block_b: int, num_warps: int, dtype: torch.dtype) -> bool:
    """Whether the tiles can be held as [threads, values a thread] (`ROW2D`): both divide
    over the threads, and a thread's values of a tile are one 16-byte load (with more,
    Triton laid the tile across threads: more barriers, not fewer; SASS, sm_90)."""
    threads = 32 * num_warps
    per_load = 16 // dtype.itemsize
    return (
        block_a % threads == 0
        and block_b % threads == 0
        and block_a // threads <= per_load
        and block_b // threads <= per_load
    )


def _check(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor | None,
    group_name: str | None,
    topk_weights: torch.Tensor | None,
    *,
    need_cuda: bool = True,
) -> str | None:
    if triton is None:
        return "triton is not installed"
    if need_cuda and x.device.type != "cuda":
        return f"device {x.device.type} is not cuda"
    if residual.dtype not in _DTYPES:
        return f"residual dtype {residual.dtype} is not bf16/fp16/fp32"
    if x.dtype != residual.dtype:
        return f"x dtype {x.dtype} != residual dtype {residual.dtype}"
    hidden = residual.shape[-1]
    if hidden > MAX_HIDDEN:
        return f"hidden {hidden} > {MAX_HIDDEN}"
    for name, w in (("w_post", w_post), ("w_next", w_next)):
        if w is not None and (tuple(w.shape) != (hidden,) or w.dtype not in _DTYPES):
            return f"{name} {tuple(w.shape)} {w.dtype} is not a ({hidden},) float vector"
    tensors = [x, residual, w_post, w_next, topk_weights]
    if any(t is not None and t.device != x.device for t in tensors):
        return "inputs are on different devices"
    if topk_weights is None:
        if x.shape != residual.shape:
            return f"x {tuple(x.shape)} does not match residual {tuple(residual.shape)}"
        return None
    k = topk_weights.shape[-1]
    if tuple(x.shape) != (*residual.shape[:-1], k, hidden):
        return f"expert rows {tuple(x.shape)} are not [T, k={k}, {hidden}]"
    if tuple(topk_weights.shape[:-1]) != tuple(residual.shape[:-1]):
        return f"topk_weights {tuple(topk_weights.shape)} do not match residual tokens"
    if group_name is None and k > MAX_TOPK:
        return f"top-k {k} > {MAX_TOPK}"
    return None


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _launch_config(
    n_rows: int, hidden: int, topk: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, bool, bool]:
    """(num_warps, programs, split, row2d), measured at hidden 5120 (bench/NOTES.md).
    Few rows: one row per program, 16 warps; the row as exact tiles (4096 + 1024) held as
    rows of 2-D tiles where they divide over the threads (`rows_as_2d`), else one padded
    tile (the exact tiles in 1-D were slower there). Many rows: two 16-warp programs per SM
    walking rows with the next row's loads in flight, the row as exact tiles: 87% of copy
    bandwidth at 16384 rows on an H200; as 2-D tiles below `ROW2D_BELOW_ROWS`. The k-row
    finalize: 32 warps, one program per SM, one padded tile (the split was not faster)."""
    sms = _sm_count(device)
    block_h = triton.next_power_of_2(hidden)
    if topk:
        return min(32, max(4, block_h // 256)), min(n_rows, sms), False, False
    warps = min(16, max(4, block_h // 512))
    row2d = ROW2D and n_rows < ROW2D_BELOW_ROWS
    if n_rows <= sms:
        row2d = row2d and rows_as_2d(*row_tiles(hidden, True), warps, dtype)
        return warps, n_rows, row2d, row2d
    return warps, min(n_rows, 2 * sms), SPLIT_ROWS, row2d


def boundary_into(
    h_out: torch.Tensor,
    y_out: torch.Tensor | None,
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor | None,
    eps_post: float,
    eps_next: float,
    x_scale: float,
    residual_scale: float,
    topk_weights: torch.Tensor | None,
    routed_scale: float,
    *,
    num_warps: int | None = None,
    programs: int | None = None,
    prefetch: bool | None = None,
    split: bool | None = None,
    pdl: bool | None = None,
    row2d: bool | None = None,
) -> None:
    """Run the kernel into contiguous `h_out` (and `y_out` when `w_next` is given).

    `x` is the reduced sublayer output [T, H], or with `topk_weights` [T, k] the
    unfinalized expert rows [T, k, H] (finalized in the kernel). `num_warps`, `programs`,
    `prefetch`, `split` (see `row_tiles`) and `row2d` (`ROW2D`) override the launch
    heuristic (benchmark sweeps only).
    """
    hidden = residual.shape[-1]
    n_rows = residual.numel() // hidden if hidden else 0
    if n_rows == 0:
        return
    x = x.contiguous()
    residual = residual.contiguous()
    (w_post, w_next), copied = before_wait(w_post, w_next)
    topk = 0
    if topk_weights is not None:
        topk = topk_weights.shape[-1]
        topk_weights = topk_weights.contiguous()
    default_warps, default_programs, default_split, default_row2d = _launch_config(
        n_rows, hidden, topk, residual.dtype, x.device
    )
    num_warps = num_warps or default_warps
    programs = min(n_rows, programs or default_programs)
    block_a, block_b = row_tiles(hidden, default_split if split is None else split)
    pdl = (PDL if pdl is None else pdl) and _PDL and x.device.type == "cuda" and not copied
    row2d = (default_row2d if row2d is None else row2d) and topk == 0
    row2d = row2d and rows_as_2d(block_a, block_b, num_warps, residual.dtype)
    _boundary_kernel[(programs,)](
        x,
        topk_weights if topk_weights is not None else x,
        residual,
        w_post,
        w_next if w_next is not None else w_post,
        h_out,
        y_out if y_out is not None else h_out,
        n_rows,
        hidden,
        1.0 / hidden,
        float(eps_post),
        float(eps_next),
        float(x_scale),
        float(residual_scale),
        float(routed_scale),
        TOPK=topk,
        HAS_NEXT=w_next is not None,
        OUT_DTYPE=_TL_DTYPES[residual.dtype],
        BLOCK_A=block_a,
        BLOCK_B=block_b,
        PREFETCH=programs < n_rows if prefetch is None else prefetch,
        PDL=pdl,
        ROW2D=row2d,
        THREADS=32 * num_warps,
        num_warps=num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )


def _reduced(
    x: torch.Tensor,
    group_name: str | None,
    topk_weights: torch.Tensor | None,
    routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the kernel reads: at world size 1 the raw rows (it finalizes them itself); with
    a group, finalize (local experts) and all-reduce first. This step is the seam where a
    one-shot fused all-reduce kernel will go."""
    if group_name is None:
        return x, topk_weights
    return reference.reduce_sublayer(x, group_name, topk_weights, routed_scale), None


def fused_boundary(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor,
    eps_post: float,
    eps_next: float,
    x_scale: float,
    residual_scale: float,
    group_name: str | None,
    topk_weights: torch.Tensor | None,
    routed_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fused_boundary` in one kernel launch (plus the all-reduce when TP > 1)."""
    x, topk_weights = _reduced(x, group_name, topk_weights, routed_scale)
    h = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    y = torch.empty_like(h)
    boundary_into(
        h,
        y,
        x,
        residual,
        w_post,
        w_next,
        eps_post,
        eps_next,
        x_scale,
        residual_scale,
        topk_weights,
        routed_scale,
    )
    return h, y


def fused_boundary_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    eps_post: float,
    x_scale: float,
    residual_scale: float,
    group_name: str | None,
    topk_weights: torch.Tensor | None,
    routed_scale: float,
) -> torch.Tensor:
    """`reference.fused_boundary_residual` in one kernel launch: only the new residual."""
    x, topk_weights = _reduced(x, group_name, topk_weights, routed_scale)
    h = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    boundary_into(
        h,
        None,
        x,
        residual,
        w_post,
        None,
        eps_post,
        0.0,
        x_scale,
        residual_scale,
        topk_weights,
        routed_scale,
    )
    return h


def supports_fused_boundary(
    x,
    residual,
    w_post,
    w_next,
    eps_post,
    eps_next,
    x_scale,
    residual_scale,
    group_name,
    topk_weights,
    routed_scale,
) -> str | None:
    """None if the kernel runs these arguments (device, dtype and shape only), else why not."""
    return _check(x, residual, w_post, w_next, group_name, topk_weights)


def supports_fused_boundary_residual(
    x,
    residual,
    w_post,
    eps_post,
    x_scale,
    residual_scale,
    group_name,
    topk_weights,
    routed_scale,
) -> str | None:
    """None if the kernel runs these arguments (device, dtype and shape only), else why not."""
    return _check(x, residual, w_post, None, group_name, topk_weights)


_AVAILABLE = triton is not None and not _INTERPRET and torch.cuda.is_available()
FUSED_BOUNDARY = Provider("triton", fused_boundary, supports_fused_boundary) if _AVAILABLE else None
FUSED_BOUNDARY_RESIDUAL = (
    Provider("triton", fused_boundary_residual, supports_fused_boundary_residual)
    if _AVAILABLE
    else None
)
