"""Triton provider of the sublayer boundary: [MoE finalize] -> post-norm -> scaled residual
-> next norm in one launch, keeping every bf16 rounding of the contract (BEAM.md).

Inductor's own fusion of this math drops the intermediate roundings; this kernel keeps
them, so it can replace the reference bit for bit up to the order of the row sums.
With a process group the finalize and the all-reduce run first through the reference
(`reduce_sublayer`), and the kernel reads the reduced rows: a future one-shot fused
all-reduce replaces exactly that step.
"""

from __future__ import annotations

import os

import torch

from beamfx.kernels.boundary import reference
from beamfx.ops import Provider

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform: the reference serves
    triton = None

# Widest row the kernel holds in registers (one program per row).
MAX_HIDDEN = 16384
# Most expert rows per token that the finalize unrolls.
MAX_TOPK = 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL_DTYPES = {}

if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    if os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter truncates fp32 -> bf16; round to nearest even by hand there, so
        # CPU runs of this kernel keep the contract's roundings bit for bit.
        @triton.jit
        def _round(v, OUT_DTYPE: tl.constexpr):
            if tl.bfloat16 == OUT_DTYPE:
                bits = v.to(tl.uint32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
                return bits.to(tl.float32, bitcast=True)
            else:
                return v.to(OUT_DTYPE).to(tl.float32)
    else:

        @triton.jit
        def _round(v, OUT_DTYPE: tl.constexpr):
            """fp32 `v` rounded to nearest even in OUT_DTYPE, kept in fp32."""
            return v.to(OUT_DTYPE).to(tl.float32)

    @triton.jit
    def _rms_scale(v, w, inv_hidden, eps):
        """`v * rsqrt(mean(v^2) + eps) * w` in fp32 (masked lanes hold zeros); the mean is a
        multiply by fp32(1/H), as torch's CUDA mean does."""
        mean = tl.sum(v * v, axis=0) * inv_hidden
        return v * tl.math.rsqrt(mean + eps) * w

    @triton.jit
    def _finish_row(
        x,
        r,
        row64,
        h_ptr,
        y_ptr,
        cols,
        mask,
        hidden,
        w_post,
        w_next,
        inv_hidden,
        eps_post,
        eps_next,
        x_scale,
        residual_scale,
        HAS_NEXT: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
    ):
        """From the reduced row (fp32 values of OUT_DTYPE) and the residual row: the
        contract's roundings in its order (BEAM.md, "Decoder layer"), then the stores."""
        t = _round(_rms_scale(x, w_post.to(tl.float32), inv_hidden, eps_post), OUT_DTYPE)
        t = _round(t * x_scale, OUT_DTYPE)
        u = _round(r.to(tl.float32) * residual_scale, OUT_DTYPE)
        h = _round(t + u, OUT_DTYPE)
        tl.store(h_ptr + row64 * hidden + cols, h.to(OUT_DTYPE), mask=mask)
        if HAS_NEXT:
            y = _round(_rms_scale(h, w_next.to(tl.float32), inv_hidden, eps_next), OUT_DTYPE)
            tl.store(y_ptr + row64 * hidden + cols, y.to(OUT_DTYPE), mask=mask)

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
        BLOCK_H: tl.constexpr,
        PREFETCH: tl.constexpr,
    ):
        # Each program walks rows pid, pid + grid, ...; the norm weights stay in registers.
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        mask = cols < hidden
        # Streamed rows are read once (evict_first); the norm weights stay in L2 (evict_last).
        w_post = tl.load(w_post_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        w_next = w_post
        if HAS_NEXT:
            w_next = tl.load(w_next_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        if TOPK == 0 and PREFETCH:
            # Software pipelining by hand: the next row's loads fly while this row computes.
            first = tl.cast(pid, tl.int64) * hidden + cols  # the grid has at most n_rows
            x_next = tl.load(x_ptr + first, mask=mask, other=0.0, eviction_policy="evict_first")
            r_next = tl.load(r_ptr + first, mask=mask, other=0.0, eviction_policy="evict_first")
            for row in tl.range(pid, n_rows, step):
                row64 = tl.cast(row, tl.int64)
                x = x_next
                r = r_next
                ahead = (row64 + step) * hidden + cols
                ok = cols < tl.where(row64 + step < n_rows, hidden, 0)
                x_next = tl.load(x_ptr + ahead, mask=ok, other=0.0, eviction_policy="evict_first")
                r_next = tl.load(r_ptr + ahead, mask=ok, other=0.0, eviction_policy="evict_first")
                _finish_row(
                    x.to(tl.float32), r, row64, h_ptr, y_ptr, cols, mask, hidden, w_post,
                    w_next, inv_hidden, eps_post, eps_next, x_scale, residual_scale, HAS_NEXT,
                    OUT_DTYPE,
                )  # fmt: skip
        else:
            for row in tl.range(pid, n_rows, step):
                row64 = tl.cast(row, tl.int64)
                r = tl.load(
                    r_ptr + row64 * hidden + cols,
                    mask=mask,
                    other=0.0,
                    eviction_policy="evict_first",
                )
                if TOPK == 0:
                    x = tl.load(
                        x_ptr + row64 * hidden + cols,
                        mask=mask,
                        other=0.0,
                        eviction_policy="evict_first",
                    )
                    x = x.to(tl.float32)
                else:
                    # MoE finalize: fp32 weighted sum of the k expert rows, routed scale, one
                    # rounding.
                    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                    for j in tl.static_range(TOPK):
                        wj = tl.load(topk_w_ptr + row64 * TOPK + j).to(tl.float32)
                        xj = tl.load(
                            x_ptr + (row64 * TOPK + j) * hidden + cols,
                            mask=mask,
                            other=0.0,
                            eviction_policy="evict_first",
                        )
                        acc += xj.to(tl.float32) * wj
                    x = _round(acc * routed_scale, OUT_DTYPE)
                _finish_row(
                    x, r, row64, h_ptr, y_ptr, cols, mask, hidden, w_post, w_next, inv_hidden,
                    eps_post, eps_next, x_scale, residual_scale, HAS_NEXT, OUT_DTYPE,
                )  # fmt: skip


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


def _launch_config(n_rows: int, block_h: int, topk: int, device: torch.device) -> tuple[int, int]:
    """(num_warps, programs), measured on an H200 at hidden 5120 (bench/NOTES.md). Few rows:
    one row per program, about 16 elements a thread (lowest latency). Many rows (and the
    k-row finalize, which holds more): 32 warps a row, one program per SM walking rows with
    the next row's loads in flight."""
    sms = _sm_count(device)
    if n_rows <= sms and not topk:
        return min(16, max(4, block_h // 512)), n_rows
    return min(32, max(4, block_h // 256)), min(n_rows, sms)


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
) -> None:
    """Run the kernel into contiguous `h_out` (and `y_out` when `w_next` is given).

    `x` is the reduced sublayer output [T, H], or with `topk_weights` [T, k] the
    unfinalized expert rows [T, k, H] (finalized in the kernel). `num_warps`, `programs`
    and `prefetch` override the launch heuristic (benchmark sweeps only).
    """
    hidden = residual.shape[-1]
    n_rows = residual.numel() // hidden if hidden else 0
    if n_rows == 0:
        return
    x = x.contiguous()
    residual = residual.contiguous()
    w_post = w_post.contiguous()
    w_next = w_next.contiguous() if w_next is not None else None
    topk = 0
    if topk_weights is not None:
        topk = topk_weights.shape[-1]
        topk_weights = topk_weights.contiguous()
    block_h = triton.next_power_of_2(hidden)
    default_warps, default_programs = _launch_config(n_rows, block_h, topk, x.device)
    num_warps = num_warps or default_warps
    programs = min(n_rows, programs or default_programs)
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
        BLOCK_H=block_h,
        PREFETCH=programs < n_rows if prefetch is None else prefetch,
        num_warps=num_warps,
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


_AVAILABLE = (
    triton is not None and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
)
FUSED_BOUNDARY = Provider("triton", fused_boundary, supports_fused_boundary) if _AVAILABLE else None
FUSED_BOUNDARY_RESIDUAL = (
    Provider("triton", fused_boundary_residual, supports_fused_boundary_residual)
    if _AVAILABLE
    else None
)
