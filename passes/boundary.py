"""Boundary fusion: [MoE finalize] -> [all-reduce] -> post-norm -> scaled residual -> next norm.

The sandwich-norm boundary of BEAM.md, two per layer, becomes one `fused_boundary` op.
Optional pieces (the MoE finalize, the TP all-reduce, the next norm) are traced as
variants; epsilons, residual scales and the routed scale are captured from the graph.
"""

from beamfx import ops as ir
from beamfx.pattern import F32, Act, FusionPass, dtype_in, kernel_for

PASS = FusionPass(
    "boundary",
    "TP all-reduce + post-norm + depth-scaled residual add + next pre-norm (and the MoE "
    "finalize) -> one fused_boundary op",
)


def fused(
    x,
    residual,
    w_post,
    eps_post,
    x_scale,
    residual_scale,
    group_name=None,
    topk_weights=None,
    routed_scale=1.0,
    w_next=None,
    eps_next=0.0,
):
    if w_next is None:
        return ir.fused_boundary_residual(
            x,
            residual,
            w_post,
            eps_post,
            x_scale,
            residual_scale,
            group_name,
            topk_weights,
            routed_scale,
        )
    return ir.fused_boundary(
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
    )


def sandwich(out, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next):
    h = ir.scaled_residual_add(
        ir.rms_norm(out, w_post, eps_post), residual, x_scale, residual_scale
    )
    return h if w_next is None else (h, ir.rms_norm(h, w_next, eps_next))


KERNEL_ARGS = (
    "x",
    "residual",
    "w_post",
    "w_next",
    "eps_post",
    "eps_next",
    "x_scale",
    "residual_scale",
    "group_name",
    "topk_weights",
    "routed_scale",
)
CONSTRAINTS = [
    dtype_in("residual", ir.torch.bfloat16, ir.torch.float16),
    kernel_for("fused_boundary", *KERNEL_ARGS),
]


@PASS.rule(replace=fused, constraints=CONSTRAINTS)
def dense(
    x: Act["t h"],
    residual: Act["t h"],
    w_post: Act["h"],
    eps_post: float,
    x_scale: float,
    residual_scale: float,
    group_name: str | None = None,
    w_next: Act["h"] | None = None,
    eps_next: float = 0.0,
):
    if group_name is not None:
        x = ir.all_reduce(x, group_name)
    return sandwich(x, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next)


@PASS.rule(replace=fused, constraints=CONSTRAINTS)
def moe(
    x: Act["t k h"],
    topk_weights: F32["t k"],
    routed_scale: float,
    residual: Act["t h"],
    w_post: Act["h"],
    eps_post: float,
    x_scale: float,
    residual_scale: float,
    group_name: str | None = None,
    w_next: Act["h"] | None = None,
    eps_next: float = 0.0,
):
    out = ir.moe_finalize(x, topk_weights, routed_scale)
    if group_name is not None:
        out = ir.all_reduce(out, group_name)
    return sandwich(out, residual, w_post, eps_post, x_scale, residual_scale, w_next, eps_next)
