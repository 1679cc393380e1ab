"""Reference of Beam's attention output gate: `out * sigmoid(gate + bias[head])`.

Rounded to the activation dtype after the bias add, after the sigmoid, and after the
product (BEAM.md, "Attention"), which is what eager bf16 ops do one at a time.
"""

import torch

from beamfx.kernels.precision import widen


def attn_gate(out: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """out, gate: [T, heads, D]; bias: [heads]."""
    z = (widen(gate) + widen(bias).view(1, -1, 1)).to(gate.dtype)
    s = torch.sigmoid(widen(z)).to(gate.dtype)
    return (widen(out) * widen(s)).to(out.dtype)
