"""Triton provider of the attention output gate (`gate.attn_gate`): one elementwise launch
that keeps the contract's three roundings (after the bias add, the sigmoid, the product).

Without it the op runs its reference eagerly on the GPU: four widening copies, three
narrowing ones and the fp32 arithmetic between them, ~10 launches a layer.
"""

from __future__ import annotations

import torch

from beamfx.kernels.triton_common import INTERPRET as _INTERPRET
from beamfx.kernels.triton_common import PDL as _PDL
from beamfx.kernels.triton_common import tl, triton
from beamfx.ops import Provider

_DTYPES = (torch.bfloat16, torch.float16)
# Rows (token, head) per program: 8 x 128 values at Beam's head_dim.
ELEMENTS_PER_PROGRAM = 1024

if triton is not None:
    from beamfx.kernels.triton_common import exp as _exp
    from beamfx.kernels.triton_common import round_to as _round

    @triton.jit(do_not_specialize=["n_rows"])
    def _attn_gate_kernel(
        out_ptr,
        gate_ptr,
        bias_ptr,
        y_ptr,
        n_rows,
        HEADS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_D: tl.constexpr,
        DTYPE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        # Rows are (token, head) pairs of D values; row r takes bias[r % HEADS].
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (cols < D)[None, :]
        bias = tl.load(bias_ptr + rows % HEADS, mask=row_ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_wait()
        at = rows[:, None].to(tl.int64) * D + cols[None, :]
        g = tl.load(gate_ptr + at, mask=ok, other=0.0).to(tl.float32)
        o = tl.load(out_ptr + at, mask=ok, other=0.0).to(tl.float32)
        z = _round(g + bias[:, None], DTYPE)
        s = _round(tl.math.div_rn(1.0, 1.0 + _exp(-z)), DTYPE)  # torch.sigmoid in fp32
        y = _round(o * s, DTYPE)
        tl.store(y_ptr + at, y.to(DTYPE), mask=ok)


def attn_gate(out: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`kernels.norm.gate.attn_gate` in one launch. out, gate: [T, heads, D]; bias: [heads]."""
    tokens, heads, d = out.shape
    y = torch.empty_like(out)
    n_rows = tokens * heads
    if n_rows == 0:
        return y
    block_d = triton.next_power_of_2(d)
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_d)
    pdl = _PDL and out.device.type == "cuda"
    _attn_gate_kernel[(triton.cdiv(n_rows, block_r),)](
        out,
        gate,
        bias,
        y,
        n_rows,
        HEADS=heads,
        D=d,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        DTYPE=tl.bfloat16 if out.dtype == torch.bfloat16 else tl.float16,
        PDL=pdl,
        num_warps=4,
        **({"launch_pdl": True} if pdl else {}),
    )
    return y


def supports_attn_gate(out, gate, bias, *, need_cuda: bool = True) -> str | None:
    """None if the kernel runs these arguments (device, dtype and layout only), else why."""
    if triton is None:
        return "triton is not installed"
    if need_cuda and out.device.type != "cuda":
        return f"device {out.device.type} is not cuda"
    if out.dim() != 3 or gate.shape != out.shape or bias.shape != (out.shape[1],):
        return f"shapes out {tuple(out.shape)}, gate {tuple(gate.shape)}, bias {tuple(bias.shape)}"
    if out.dtype not in _DTYPES or gate.dtype != out.dtype:
        return f"dtypes out {out.dtype}, gate {gate.dtype}: both bf16 or both fp16"
    if not (out.is_contiguous() and gate.is_contiguous() and bias.is_contiguous()):
        return "out, gate and bias must be contiguous"
    if gate.device != out.device or bias.device != out.device:
        return "out, gate and bias on different devices"
    return None


_AVAILABLE = triton is not None and not _INTERPRET and torch.cuda.is_available()
ATTN_GATE = Provider("triton", attn_gate, supports_attn_gate) if _AVAILABLE else None
