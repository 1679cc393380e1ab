"""Accumulation precision of the references: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64.

The fp64 case lets the same reference code serve as the high-precision model.
"""

import torch


def widen(x: torch.Tensor) -> torch.Tensor:
    """`x` in its accumulation dtype (at least fp32)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
