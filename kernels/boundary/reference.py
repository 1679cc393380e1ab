"""Reference math of the sandwich-norm boundary (BEAM.md, "Decoder layer").

Every rounding sits where the contract puts it; the fused providers must keep them.
"""

import torch

from beamfx.kernels.moe.reference import moe_finalize
from beamfx.kernels.norm.reference import rms_norm
from beamfx.kernels.precision import widen


def scaled_residual_add(
    x: torch.Tensor, residual: torch.Tensor, x_scale: float, residual_scale: float
) -> torch.Tensor:
    """`round(round(x * xs) + round(r * rs))`, the depth-scaled residual add."""
    t = (widen(x) * x_scale).to(x.dtype)
    u = (widen(residual) * residual_scale).to(residual.dtype)
    return (widen(t) + widen(u)).to(x.dtype)


def boundary(
    x: torch.Tensor,
    residual: torch.Tensor,
    w_post: torch.Tensor,
    w_next: torch.Tensor | None,
    eps_post: float,
    eps_next: float,
    x_scale: float,
    residual_scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(new residual, next sublayer's normalized input) from a reduced sublayer output."""
    h = scaled_residual_add(rms_norm(x, w_post, eps_post), residual, x_scale, residual_scale)
    y = rms_norm(h, w_next, eps_next) if w_next is not None else None
    return h, y


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the ranks of the named process group (a new tensor; the input is kept)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group_name))


def reduce_sublayer(
    x: torch.Tensor,
    group_name: str | None,
    topk_weights: torch.Tensor | None,
    routed_scale: float,
) -> torch.Tensor:
    """[MoE finalize] -> [all-reduce]: the sublayer output as the boundary reads it.

    `x` is the sublayer output [T, H], or with `topk_weights` the unfinalized expert rows
    [T, k, H]. `group_name` None means world size 1 (no all-reduce).
    """
    if topk_weights is not None:
        x = moe_finalize(x, topk_weights, routed_scale)
    if group_name is not None:
        x = all_reduce(x, group_name)
    return x


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
    """The whole boundary as one op: [finalize] -> [all-reduce] -> boundary -> (h, y)."""
    x = reduce_sublayer(x, group_name, topk_weights, routed_scale)
    return boundary(x, residual, w_post, w_next, eps_post, eps_next, x_scale, residual_scale)


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
    """The boundary where no next norm follows: only the new residual."""
    x = reduce_sublayer(x, group_name, topk_weights, routed_scale)
    return boundary(x, residual, w_post, None, eps_post, 0.0, x_scale, residual_scale)[0]
