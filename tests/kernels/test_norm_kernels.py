"""The Triton attention output gate (kernels/norm/triton.py) against its reference.

CPU (CI): supports() and the kernel under Triton's interpreter in a subprocess (within one
ulp: the interpreter's exp is numpy's). GPU (`-m gpu`, an H200): bitwise equal to the
reference run eagerly, Beam's [T, 48, 128] and other shapes, bf16 and fp16.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from beamfx import ops
from beamfx.kernels.norm import gate as reference
from beamfx.testing import examples, run_interpreted, ulps

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
nt = pytest.importorskip("beamfx.kernels.norm.triton")
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


def make_gate(tokens, heads, d, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    out = (torch.randn(tokens, heads, d, generator=g) * 2).to(dtype).to(device)
    gate = (torch.randn(tokens, heads, d, generator=g) * 3).to(dtype).to(device)
    bias = torch.randn(heads, generator=g).to(dtype).to(device)
    return out, gate, bias


@pytest.mark.parametrize(
    "args, expected",
    [
        ((torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(4)), "bf16 or both fp16"),
        (
            (torch.zeros(2, 4, 8, dtype=torch.bfloat16),) * 2 + (torch.zeros(3),),
            "bias (3,)",
        ),
        (
            (torch.zeros(2, 8, 4, dtype=torch.bfloat16).transpose(1, 2),) * 2 + (torch.zeros(4),),
            "contiguous",
        ),
    ],
)
def test_supports_names_the_limit(args, expected):
    if nt.triton is None:
        pytest.skip("triton not installed")
    why = nt.supports_attn_gate(*args, need_cuda=False)
    assert why is not None and expected in why


def test_cpu_dispatch_runs_the_reference():
    out, gate, bias = make_gate(3, 4, 16, torch.bfloat16, "cpu", seed=0)
    assert torch.equal(ops.attn_gate(out, gate, bias), reference.attn_gate(out, gate, bias))
    assert ops.ATTN_GATE.last_provider == "reference"


@pytest.mark.skipif(INTERPRETED or nt.triton is None, reason="runs the interpreted tests below")
def test_kernel_under_triton_interpreter():
    run_interpreted(__file__)


@needs_interpreter
@settings(deadline=None, max_examples=examples(12))
@given(
    tokens=st.integers(1, 9),
    heads=st.sampled_from([1, 3, 8]),
    d=st.sampled_from([16, 24, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_interpreted_gate_matches_reference(tokens, heads, d, dtype, seed):
    out, gate, bias = make_gate(tokens, heads, d, dtype, "cpu", seed)
    want = reference.attn_gate(out, gate, bias)
    got = nt.attn_gate(out, gate, bias)
    assert got.dtype == dtype and got.shape == out.shape
    # The interpreter's exp is numpy's, not CUDA's expf: at most one ulp apart, rarely.
    assert ulps(got, want).max() <= 1
    assert (got == want).float().mean() > 0.99


# --- GPU: an H200 --------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 8192])
@pytest.mark.parametrize("heads, d", [(48, 128), (6, 128), (5, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gate_is_the_reference_bitwise(tokens, heads, d, dtype):
    out, gate, bias = make_gate(tokens, heads, d, dtype, "cuda", seed=tokens + heads)
    want = reference.attn_gate(out, gate, bias)
    got = ops.attn_gate(out, gate, bias)
    assert ops.ATTN_GATE.last_provider == "triton"
    assert torch.equal(got, want), f"{ulps(got, want).max()} ulps apart"
