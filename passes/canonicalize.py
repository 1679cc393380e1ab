"""Canonicalize: raise plain-torch decompositions of Beam IR math back into Beam IR ops.

A model written in plain torch (as HF code is) traces to decomposed aten; each pattern
here is the op's own reference function, traced per dtype, so what is raised is exactly
the op's semantics. The fusion passes then match on meaning in either front end.
Grouped top-k routing is not raised: its decomposition bakes token counts into views.
"""

from beamfx import ops
from beamfx.pattern import F32, Act, FusionPass

PASS = FusionPass("canonicalize", "plain-torch decompositions of Beam IR math -> Beam IR ops")

RAISE = {
    "rms_norm": dict(x=Act["t h"], weight=Act["h"], eps=float),
    "silu_mul": dict(gate=Act["t i"], up=Act["t i"]),
    "scaled_residual_add": dict(
        x=Act["t h"], residual=Act["t h"], x_scale=float, residual_scale=float
    ),
    "moe_finalize": dict(rows=Act["t k h"], topk_weights=F32["t k"], routed_scale=float),
    "router_logits": dict(x=Act["t h"], weight=F32["e h"]),
    "all_reduce": dict(x=Act["t h"], group_name=str),
}

for _name, _specs in RAISE.items():
    _op = ops.REGISTRY[_name]
    PASS.rule(replace=_op.op, specs=_specs, name=_name)(_op.reference)
