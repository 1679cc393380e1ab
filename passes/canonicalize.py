"""Canonicalize: raise plain-torch decompositions of Beam IR math back into Beam IR ops.

A model written in plain torch (as HF code is) traces to decomposed aten; each pattern
here is the op's own reference function, traced per dtype, so what is raised is exactly
the op's semantics. The fusion passes then match on meaning in either front end.
Grouped top-k routing is not raised: its decomposition bakes token counts into views.
The router GEMM is raised only from low-precision activations upcast to fp32: a plain
fp32 linear is every other projection of an fp32 model too.
"""

import torch

from beamfx import ops
from beamfx.pattern import (  # noqa: E741
    F32,
    Act,
    E,
    FusionPass,
    H,
    I,
    K,
    T,
    same_size,
    shapes_as_annotated,
)

PASS = FusionPass("canonicalize", "plain-torch decompositions of Beam IR math -> Beam IR ops")

RAISE = {
    "rms_norm": dict(x=Act[T, H], weight=Act[H], eps=float),
    "silu_mul": dict(gate=Act[T, I], up=Act[T, I]),
    "scaled_residual_add": dict(
        x=Act[T, H], residual=Act[T, H], x_scale=float, residual_scale=float
    ),
    "moe_finalize": dict(rows=Act[T, K, H], topk_weights=F32[T, K], routed_scale=float),
    "router_logits": dict(x=Act[T, H], weight=F32[E, H]),
    "all_reduce": dict(x=Act[T, H], group_name=str),
}

DTYPES = {"router_logits": (torch.bfloat16, torch.float16)}
# The ops whose output takes one input's shape: a broadcast other input stays plain torch.
SHAPES = {
    # The weight one row of x's width (x may have any rank: q/k norms are [T, heads, D]).
    "rms_norm": [shapes_as_annotated("weight"), same_size(("x", -1), ("weight", 0))],
    "silu_mul": [shapes_as_annotated("gate", "up")],
    "scaled_residual_add": [shapes_as_annotated("x", "residual")],
    "moe_finalize": [shapes_as_annotated("rows", "topk_weights")],
}

for _name, _specs in RAISE.items():
    _op = ops.REGISTRY[_name]
    _dtypes = DTYPES.get(_name, (torch.bfloat16, torch.float16, torch.float32))
    _constraints = SHAPES.get(_name, [])
    PASS.rule(replace=_op.op, specs=_specs, name=_name, dtypes=_dtypes, constraints=_constraints)(
        _op.reference
    )
