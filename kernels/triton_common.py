"""Triton pieces the kernel families share: the import guard, whether Triton's interpreter
runs (the CPU tests), programmatic dependent launch, and the helpers whose interpreter form
differs so that CPU runs keep the contract's roundings bit for bit.

`triton` is None where Triton (or its libdevice) is missing: the references serve there.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # no Triton on this platform
    triton = tl = libdevice = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Programmatic dependent launch: Hopper and later, with a Triton that exposes it.
# BEAMFX_PDL=0 turns it off.
PDL = (
    os.environ.get("BEAMFX_PDL", "1") != "0"
    and triton is not None
    and not INTERPRET
    and hasattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait")
    and torch.cuda.is_available()
    and torch.cuda.get_device_capability()[0] >= 9
)


def before_wait(*tensors: torch.Tensor | None) -> tuple[list, bool]:
    """The operands a PDL-launched kernel reads before `griddepcontrol.wait` (weights), made
    contiguous, and whether any had to be copied: a copy is written by a kernel launched
    just now, which the PDL kernel may overlap, so such a call must launch without PDL."""
    out = [t if t is None or t.is_contiguous() else t.contiguous() for t in tensors]
    return out, any(o is not t for o, t in zip(out, tensors))


if triton is not None:
    if INTERPRET:
        # The interpreter truncates fp32 -> bf16, multiplies bf16 tiles as their raw bits
        # and lacks libdevice: round by hand, widen dot operands (their products are exact
        # in fp32 either way), and take numpy's exp.

        @triton.jit
        def round_bf16(v):
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)

        @triton.jit
        def round_to(v, OUT_DTYPE: tl.constexpr):
            if tl.bfloat16 == OUT_DTYPE:
                return round_bf16(v)
            else:
                return v.to(OUT_DTYPE).to(tl.float32)

        @triton.jit
        def dot_bf16(a, b, acc):
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

        @triton.jit
        def exp(v):
            return tl.exp(v)

    else:

        @triton.jit
        def round_bf16(v):
            """fp32 `v` rounded to nearest even bf16, kept in fp32."""
            return v.to(tl.bfloat16).to(tl.float32)

        @triton.jit
        def round_to(v, OUT_DTYPE: tl.constexpr):
            """fp32 `v` rounded to nearest even in OUT_DTYPE, kept in fp32."""
            return v.to(OUT_DTYPE).to(tl.float32)

        @triton.jit
        def dot_bf16(a, b, acc):
            """acc + a @ b: bf16 tensor-core products, exact, accumulated in fp32."""
            return tl.dot(a, b, acc)

        @triton.jit
        def exp(v):
            """fp32 exp as CUDA's expf (torch.sigmoid uses it), not the fast ex2 form."""
            return libdevice.exp(v)
