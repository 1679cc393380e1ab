"""bf16 MoE experts on `torch._grouped_mm`: the strong library baseline, and a provider.

`torch._grouped_mm(a [M, K], b [G, K, N], offs)` multiplies row group g of `a` by `b[g]`;
`offs` (int32, [G]) holds each group's END row, so the rows must be sorted by group.
Present in torch 2.9 through 2.14 (checked on 2.11, 2.13 and 2.14.1); bf16 only; on CUDA it needs
compute capability 8.0+ (a CUTLASS kernel on 9.0+, a loop below), strides that are
multiples of 16 bytes (H and I multiples of 8) and `b` either row- or column-major in its
last two dims (the `[E, N, K]` expert weights are passed transposed, column-major). Rows
are sorted here with `torch.sort`; three copies move them in and out of expert order.
"""

from __future__ import annotations

import torch

from beamfx.kernels.moe import reference
from beamfx.kernels.norm.reference import silu_mul
from beamfx.ops import Provider


def _sorted_rows(topk_ids: torch.Tensor, num_experts: int):
    """The pairs in expert order, and each expert's end row; a pair whose id is outside
    [0, E) sorts after them all (past the last end), with `valid` False."""
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < num_experts)
    sorted_ids, order = torch.sort(torch.where(valid, flat, num_experts), stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, bounds).to(torch.int32)
    return order, ends, valid


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`moe_experts` semantics (rows [T, k, H]) with two grouped GEMMs; a pair whose id is
    outside [0, E) gets a row of zeros, as the reference gives."""
    t, k = topk_ids.shape
    if t * k == 0:
        return x.new_zeros(t, k, w2.shape[1])
    order, ends, valid = _sorted_rows(topk_ids, w13.shape[0])
    inter = w13.shape[1] // 2
    xs = x[order // k]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends)
    h = silu_mul(gu[:, :inter], gu[:, inter:])
    ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)
    rows = torch.empty_like(ys)
    rows[order] = ys
    # Rows past the last group's end are not written by the grouped GEMMs.
    rows = torch.where(valid.unsqueeze(-1), rows, 0)
    return rows.view(t, k, -1)


def mega_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routed_scale: float,
) -> torch.Tensor:
    rows = moe_experts(x, w13, w2, topk_ids)
    return reference.moe_finalize(rows, topk_weights, routed_scale)


def _why_not(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm (added in 2.8)"
    if x.device.type != "cuda":
        return f"serves CUDA tensors only (CPU has faster paths), got {x.device}"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "torch._grouped_mm needs compute capability 8.0 or newer"
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return f"torch._grouped_mm is bf16 only, got {x.dtype}, {w13.dtype}, {w2.dtype}"
    if x.shape[-1] % 8 or w2.shape[-1] % 8:
        return "torch._grouped_mm needs H and I multiples of 8 (16-byte strides)"
    return reference.why_not_layout(x, ids, w13, w2)


MOE_EXPERTS = Provider("grouped_mm", moe_experts, lambda x, w13, w2, ids: _why_not(x, w13, w2, ids))
MEGA_MOE = Provider(
    "grouped_mm", mega_moe, lambda x, wt, ids, w13, w2, s: _why_not(x, w13, w2, ids)
)
