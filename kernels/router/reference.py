"""Reference math of the router: logits, then routing (one source: kernels.moe.reference)."""

import torch

from beamfx.kernels.moe.reference import grouped_topk, router_logits

__all__ = ["router_logits", "grouped_topk", "routed_topk"]


def routed_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states to (top-k weights, top-k ids): router GEMM followed by routing."""
    logits = router_logits(x, weight)
    return grouped_topk(logits, correction_bias, top_k, n_group, topk_group, renormalize)
