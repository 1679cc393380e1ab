"""Reference math for RMSNorm and SwiGLU: fp32 arithmetic, rounded where BEAM.md puts it."""

import torch
import torch.nn.functional as F

from beamfx.kernels.precision import widen


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * w` in fp32, one rounding after the multiply by `w`."""
    xf = widen(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * widen(weight)
    return y.to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: `silu(g) * u` in fp32, one rounding."""
    return (F.silu(widen(gate)) * widen(up)).to(gate.dtype)
