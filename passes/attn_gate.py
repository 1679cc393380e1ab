"""Attention output gate: `out * sigmoid(gate + bias[head])`, written in plain torch by the
model, becomes one `attn_gate` op that keeps the contract's three roundings.

The pattern is the model's own torch code (no Beam IR op needed): Inductor would fuse
it too, but drops the roundings between the add, the sigmoid and the product.
"""

import torch

from beamfx import ops as ir
from beamfx.pattern import Act, D, FusionPass, N, T, dtype_in, shapes_as_annotated

PASS = FusionPass(
    "attn_gate",
    "attention output gate out * sigmoid(gate + bias) -> attn_gate",
    anchors=[torch.ops.aten.sigmoid.default],
)


@PASS.rule(replace=ir.attn_gate, constraints=[dtype_in("out", torch.bfloat16, torch.float16),
           shapes_as_annotated("out", "gate", "bias")])  # fmt: skip
def gate(out: Act[T, N, D], gate: Act[T, N, D], bias: Act[N]):
    return out * torch.sigmoid(gate + bias.view(1, -1, 1))
