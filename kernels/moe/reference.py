"""Reference math of Beam's MoE (BEAM.md, "MLP and MoE"): the test oracle and the fallback."""

import torch

from beamfx.kernels.norm.reference import silu_mul
from beamfx.kernels.precision import widen


def check_routing_args(experts: int, bias_shape, top_k, n_group, topk_group) -> None:
    """Raise ValueError unless the routing is defined for these arguments: the groups
    divide the experts, and the kept groups hold top_k experts (else top-k would take a
    dropped group's expert, or fail in a view). Checked where the math runs, not while
    tracing: patterns trace the ops with sentinel values."""
    if tuple(bias_shape) != (experts,):
        raise ValueError(f"routing: correction bias {tuple(bias_shape)} is not ({experts},)")
    if not (n_group >= 1 and experts % n_group == 0 and 1 <= topk_group <= n_group):
        raise ValueError(
            f"routing: n_group {n_group} must divide the {experts} experts and topk_group "
            f"{topk_group} lie in 1..n_group"
        )
    if not 1 <= top_k <= topk_group * (experts // n_group):
        raise ValueError(
            f"routing: top_k {top_k} must lie in 1..{topk_group * (experts // n_group)} (the "
            f"experts of the {topk_group} kept groups)"
        )


def grouped_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped sigmoid routing (noaux_tc): returns (fp32 weights [T, k], int32 ids [T, k]).

    Selection uses `sigmoid(logits) + bias`; each group scores the sum of its top-2 biased
    scores, the best `topk_group` groups survive, and the top-k experts are taken among
    them. The weights are the unbiased sigmoid scores, renormalized if asked.
    """
    check_routing_args(logits.shape[-1], tuple(correction_bias.shape), top_k, n_group, topk_group)
    scores = torch.sigmoid(widen(logits))
    biased = scores + widen(correction_bias)
    t, e = scores.shape
    grouped = biased.view(t, n_group, e // n_group)
    group_scores = grouped.topk(min(2, e // n_group), dim=-1).values.sum(-1)
    keep = group_scores.topk(topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    ids = biased.masked_fill(expert_mask == 0, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits: bf16 activations upcast, times the fp32 (or bf16) weight."""
    return torch.nn.functional.linear(widen(x), widen(weight))


def why_not_layout(x, topk_ids, w13, w2, scales=None) -> str | None:
    """Why the experts' tensors do not fit together in the layout every fast provider
    assumes (see `moe_experts` and `moe_experts_nvfp4`), or None. Shapes, dtypes and
    strides only, so it answers for fake tensors while compiling too. With `scales`
    (w13_scale, w13_global, w2_scale, w2_global) the weights are NVFP4: packed uint8 codes
    and float8_e4m3fn block scales, contiguous along K (the kernels read their bytes); a
    layout the reference takes and a kernel would misread (a scale in another float dtype,
    say) is declined here, and the reference serves it or says what is wrong."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        return f"needs x [T, H] and topk_ids [T, k], got {tuple(x.shape)}, {tuple(topk_ids.shape)}"
    if w13.dim() != 3 or w2.dim() != 3:
        return f"needs 3-D expert weights, got w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)}"
    e, two_i, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    inter = two_i // 2
    per_byte = 2 if scales is not None else 1
    want13, want2 = (e, 2 * inter, hidden // per_byte), (e, hidden, inter // per_byte)
    if two_i % 2 or tuple(w13.shape) != want13 or tuple(w2.shape) != want2:
        return (
            f"needs w13 {want13} and w2 {want2} for hidden {hidden} and {e} experts"
            f"{' (NVFP4: two codes a byte)' if scales is not None else ''}, got "
            f"{tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if scales is None:
        return None
    if inter % 16:
        return f"needs NVFP4 experts' intermediate size a multiple of 16, got {inter}"
    w13_scale, w13_global, w2_scale, w2_global = scales
    for name, s, want in (
        ("w13_scale", w13_scale, (e, 2 * inter, hidden // 16)),
        ("w2_scale", w2_scale, (e, hidden, inter // 16)),
    ):
        if tuple(s.shape) != want:
            return f"needs {name} {want} (one scale per 16 values), got {tuple(s.shape)}"
        if s.dtype != torch.float8_e4m3fn:
            return f"needs float8_e4m3fn {name}, got {s.dtype}"
        if s.stride(-1) != 1:
            return f"needs {name} contiguous along K, got strides {tuple(s.stride())}"
    if tuple(w13_global.shape) != (e, 2) or tuple(w2_global.shape) != (e,):
        return (
            f"needs w13_global [{e}, 2] (gate, up) and w2_global [{e}], got "
            f"{tuple(w13_global.shape)} and {tuple(w2_global.shape)}"
        )
    return None


def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts, unfinalized: rows [T, k, H], row (t, j) = expert ids[t, j] on x[t].

    `w13` [E, 2I, H] stacks gate then up; `w2` is [E, H, I]. Each GEMM output is rounded
    to the activation dtype; the activation is `silu_mul` (one rounding). A pair whose id is
    outside [0, E) (vLLM's -1: an expert not on this rank) gets a row of zeros, as the Triton
    kernels' sorted blocks give; their scan and FMA paths and the CuTeDSL kernels read ids as
    in range (the routing's top-k over E experts gives nothing else).
    """
    t, k = topk_ids.shape
    out = x.new_zeros(t, k, w2.shape[1])
    inter = w13.shape[1] // 2
    for e in topk_ids.unique().tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gu = x[tok] @ w13[e].t()
        out[tok, slot] = silu_mul(gu[:, :inter], gu[:, inter:]) @ w2[e].t()
    return out


def moe_finalize(
    rows: torch.Tensor, topk_weights: torch.Tensor, routed_scale: float
) -> torch.Tensor:
    """Weighted sum of the k expert rows times the routed scale, fp32, one rounding."""
    acc = (widen(rows) * widen(topk_weights).unsqueeze(-1)).sum(1)
    return (acc * routed_scale).to(rows.dtype)


def moe_experts_nvfp4(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """`moe_experts` on NVFP4 experts: dequantize to the activation dtype, then the same math.

    Layout (`kernels/moe/nvfp4.py`): `w13 [E, 2I, H/2]` uint8, `w13_scale [E, 2I, H/16]` E4M3,
    `w13_global [E, 2]` (gate, up), `w2 [E, H, I/2]`, `w2_scale [E, H, I/16]`, `w2_global [E]`.
    """
    from beamfx.kernels.moe.nvfp4 import dequantize_experts

    w13_dense, w2_dense = dequantize_experts(
        w13, w13_scale, w13_global, w2, w2_scale, w2_global, dtype=x.dtype
    )
    return moe_experts(x, w13_dense, w2_dense, topk_ids)


def mega_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routed_scale: float,
) -> torch.Tensor:
    """The whole routed MoE after routing: experts, then finalize (what the fused op computes)."""
    return moe_finalize(moe_experts(x, w13, w2, topk_ids), topk_weights, routed_scale)


def mega_moe_nvfp4(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    routed_scale: float,
) -> torch.Tensor:
    """`mega_moe` on NVFP4 experts (layout of `moe_experts_nvfp4`)."""
    rows = moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids)
    return moe_finalize(rows, topk_weights, routed_scale)
