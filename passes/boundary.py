"""Boundary fusion: [MoE finalize] -> [all-reduce] -> post-norm -> scaled residual -> next norm.

The sandwich-norm boundary of BEAM.md, two per layer, becomes one `fused_boundary` op.
Optional pieces (the MoE finalize, the TP all-reduce, the next norm) are traced as
variants; epsilons, residual scales and the routed scale are captured from the graph.
"""

import torch

from beamfx import ops as ir
from beamfx.pattern import F32, Act, FusionPass, H, K, T, dtype_in, kernel_for, shapes_as_annotated

PASS = FusionPass(
    "boundary",
    "TP all-reduce + post-norm + depth-scaled residual add + next pre-norm (and the MoE "
    "finalize) -> one fused_boundary op",
)


def sandwich(out, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next):
    t = ir.rms_norm(out, w_post, eps_post)
    h = ir.scaled_residual_add(t, residual, x_scale, residual_scale)
    return h if w_next is None else (h, ir.rms_norm(h, w_next, eps_next))


def fused(x, residual, w_post, eps_post, x_scale, residual_scale, group_name=None,
          topk_weights=None, routed_scale=1.0, w_next=None, eps_next=0.0):  # fmt: skip
    reduce = (group_name, topk_weights, routed_scale)
    scales = (x_scale, residual_scale)
    if w_next is None:
        return ir.fused_boundary_residual(x, residual, w_post, eps_post, *scales, *reduce)
    return ir.fused_boundary(x, residual, w_post, w_next, eps_post, eps_next, *scales, *reduce)


CONSTRAINTS = [
    dtype_in("residual", torch.bfloat16, torch.float16),
    kernel_for("fused_boundary", "x", "residual", "w_post", "w_next", "eps_post", "eps_next",
               "x_scale", "residual_scale", "group_name", "topk_weights", "routed_scale"),
]  # fmt: skip


# `fused` hands every scalar to the op unchanged: traced once per signature, not per layer.
@PASS.rule(replace=fused, scalars_pass_through=True,
           constraints=[*CONSTRAINTS, shapes_as_annotated("x", "residual", "w_post",
                                                          "w_next")])  # fmt: skip
def dense(x: Act[T, H], residual: Act[T, H], w_post: Act[H], eps_post: float, x_scale: float,
          residual_scale: float, group_name: str | None = None, w_next: Act[H] | None = None,
          eps_next: float = 0.0):  # fmt: skip
    if group_name is not None:
        x = ir.all_reduce(x, group_name)
    return sandwich(x, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next)


@PASS.rule(replace=fused, scalars_pass_through=True,
           constraints=[*CONSTRAINTS, shapes_as_annotated("x", "topk_weights", "residual",
                                                          "w_post", "w_next")])  # fmt: skip
def moe(x: Act[T, K, H], topk_weights: F32[T, K], routed_scale: float, residual: Act[T, H],
        w_post: Act[H], eps_post: float, x_scale: float, residual_scale: float,
        group_name: str | None = None, w_next: Act[H] | None = None,
        eps_next: float = 0.0):  # fmt: skip
    out = ir.moe_finalize(x, topk_weights, routed_scale)
    if group_name is not None:
        out = ir.all_reduce(out, group_name)
    return sandwich(out, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next)
