"""The Triton boundary kernel against the reference contract (kernels/boundary/reference.py).

CPU (CI): `supports()` on fake CUDA tensors, dispatch fallback, and the kernel itself run by
Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before Triton compiles
anything, so it cannot share this process). GPU (`-m gpu`, an H200): random inputs at
Beam's hidden 5120 and other sizes, NaN-filled outputs, within one bf16 ulp.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from beamfx import ops
from beamfx.kernels.boundary import reference
from beamfx.kernels.norm.reference import rms_norm
from beamfx.testing import run_interpreted, ulp_at, ulps

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
triton_kernels = pytest.importorskip("beamfx.kernels.boundary.triton")


def make_inputs(tokens, hidden, topk, dtype, device, seed, scales=(0.3, 0.9), routed=2.5):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

    residual = randn(tokens, hidden, scale=4.0)
    x = randn(tokens, topk, hidden) if topk else randn(tokens, hidden)
    topk_weights = torch.rand(tokens, topk, generator=g).to(device) if topk else None
    w_post, w_next = randn(hidden, scale=0.5) + 1, randn(hidden, scale=0.5) + 1
    xs, rs = scales
    return (x, residual, w_post, w_next, 1e-6, 1e-5, xs, rs, None, topk_weights, routed)


def check_against_reference(args, h, y) -> dict:
    """16-bit outputs. h: the rounded add h = round(t + u) inherits a 1-ulp difference of t
    (a row-sum order flips a rare rounding), so it is held to 2 ulps at the addends' scale
    |h| + |u| (where t and u cancel, plain ulps of h mean nothing). y: within 1 ulp of the
    next norm of this h. Nearly all elements must be bitwise equal: a lost rounding would
    move many. fp32 outputs (no roundings): close in norm."""
    x, residual, w_post, w_next, eps_post, eps_next, xs, rs = args[:8]
    h_ref, y_ref = reference.fused_boundary(*args)
    assert not h.isnan().any() and not y.isnan().any(), "an output element was not written"
    if h.dtype == torch.float32:
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5 * h_ref.abs().max().item())
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5 * y_ref.abs().max().item())
        return {}
    u = (residual.float() * rs).to(h.dtype)
    scale = h_ref.float().abs() + u.float().abs()
    h_err = (h.float() - h_ref.float()).abs()
    assert (h_err <= 2 * ulp_at(scale, h.dtype)).all(), f"h off by {h_err.max()}"
    y_step_ulps = ulps(y, rms_norm(h, w_next, eps_next))
    assert y_step_ulps.max() <= 1, f"y off by {y_step_ulps.max()} ulps from rms_norm(h)"
    stats = {
        "h_differ": (h != h_ref).sum().item(),
        "y_differ": (y != y_ref).sum().item(),
        "h_max_abs": h_err.max().item(),
    }
    allowed = max(1, h.numel() // 100)
    assert stats["h_differ"] <= allowed and stats["y_differ"] <= allowed, stats
    return stats


def run_into(args, **launch):
    x, residual, w_post, w_next, eps_post, eps_next, xs, rs, _, topk_weights, routed = args
    h = torch.full_like(residual, float("nan"))
    y = torch.full_like(residual, float("nan"))
    triton_kernels.boundary_into(
        h, y, x, residual, w_post, w_next, eps_post, eps_next, xs, rs, topk_weights, routed,
        **launch,
    )  # fmt: skip
    return h, y


# --- CPU: supports() and dispatch -------------------------------------------------------


def fake_args(tokens=4, hidden=5120, topk=0, dtype=torch.bfloat16, device="cuda"):
    """Fake tensors (no data, no GPU needed): what supports() sees while compiling."""
    with FakeTensorMode():
        residual = torch.empty(tokens, hidden, dtype=dtype, device=device)
        x = torch.empty(tokens, topk, hidden, dtype=dtype, device=device) if topk else residual
        tw = torch.empty(tokens, topk, device=device) if topk else None
        w = torch.empty(hidden, dtype=dtype, device=device)
    return (x, residual, w, w, 1e-6, 1e-6, 0.5, 0.8, None, tw, 1.0)


@pytest.mark.skipif(triton_kernels.triton is None, reason="triton not installed")
@pytest.mark.parametrize(
    "case, expected",
    [
        (dict(), None),
        (dict(topk=8), None),
        (dict(hidden=8192, dtype=torch.float16), None),
        (dict(hidden=16384 + 16), "hidden 16400 > 16384"),
        (dict(dtype=torch.float64), "residual dtype torch.float64"),
        (dict(topk=17), "top-k 17 > 16"),
        (dict(device="cpu"), "device cpu is not cuda"),
    ],
)
def test_supports_names_the_limit(case, expected):
    args = fake_args(**case)
    reason = triton_kernels.supports_fused_boundary(*args)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason
    # The residual-only op reads the same limits.
    x, r, wp, _, ep, _, xs, rs, g, tw, scale = args
    assert triton_kernels.supports_fused_boundary_residual(x, r, wp, ep, xs, rs, g, tw, scale) == (
        reason
    )


@pytest.mark.skipif(triton_kernels.triton is None, reason="triton not installed")
def test_supports_rejects_mismatched_shapes():
    x, r, wp, wn, *rest = fake_args()
    with FakeTensorMode():
        short = torch.empty(100, dtype=torch.bfloat16, device="cuda")
        other = torch.empty(3, 5120, dtype=torch.bfloat16, device="cuda")
        half = torch.empty(4, 5120, dtype=torch.float16, device="cuda")
        rows = torch.empty(4, 2, 5120, dtype=torch.bfloat16, device="cuda")
        tw = torch.empty(4, 8, device="cuda")
    supports = triton_kernels.supports_fused_boundary
    assert "w_next (100,)" in supports(x, r, wp, short, *rest)
    assert "does not match residual" in supports(other, r, wp, wn, *rest)
    assert "x dtype torch.float16" in supports(half, r, wp, wn, *rest)
    assert "expert rows (4, 2, 5120)" in supports(rows, r, wp, wn, *rest[:5], tw, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cpu_dispatch_falls_back_to_reference():
    assert triton_kernels.FUSED_BOUNDARY is None
    args = make_inputs(3, 64, 0, torch.bfloat16, "cpu", seed=0)
    h, y = ops.fused_boundary(*args)
    assert ops.FUSED_BOUNDARY.last_provider == "reference"
    h_ref, y_ref = reference.fused_boundary(*args)
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


# --- CPU: the kernel under Triton's interpreter ------------------------------------------


@pytest.mark.skipif(
    INTERPRETED or triton_kernels.triton is None, reason="runs the interpreted tests below"
)
def test_kernel_under_triton_interpreter():
    run_interpreted(__file__)


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


@needs_interpreter
@settings(deadline=None)
@given(
    tokens=st.integers(1, 9),
    hidden=st.sampled_from([16, 48, 64, 200, 320, 512, 1024, 1280]),
    topk=st.sampled_from([0, 0, 1, 4, 8]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    scales=st.tuples(st.floats(0.05, 1.0), st.floats(0.05, 1.0)),
    programs=st.sampled_from([None, 1, 2]),
    split=st.booleans(),
    row2d=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_interpreted_kernel_matches_reference(
    tokens, hidden, topk, dtype, scales, programs, split, row2d, seed
):
    args = make_inputs(tokens, hidden, topk, dtype, "cpu", seed, scales=scales)
    h, y = run_into(args, programs=programs, split=split, row2d=row2d)
    check_against_reference(args, h, y)


@pytest.mark.parametrize(
    "rows, topk, dtype, expected",
    [(1, 0, torch.bfloat16, (16, 1, True, True)), (132, 0, torch.bfloat16, (16, 132, True, True)),
     (1024, 0, torch.bfloat16, (16, 264, True, True)),
     (4096, 0, torch.bfloat16, (16, 264, True, False)),
     (1, 0, torch.float32, (16, 1, False, False)), (64, 8, torch.bfloat16, (32, 64, False, False))],
)  # fmt: skip
def test_launch_config_at_hidden_5120(rows, topk, dtype, expected):
    """(warps, programs, exact tiles, 2-D tiles): exact tiles at few rows only as 2-D tiles
    (in 1-D one padded tile was faster), 2-D tiles below ROW2D_BELOW_ROWS, never for the
    finalize (bench/NOTES.md, boundary run 9)."""
    cpu = torch.device("cpu")  # 132 SMs assumed off a GPU
    assert triton_kernels._launch_config(rows, 5120, topk, dtype, cpu) == expected


@pytest.mark.parametrize(
    "block_a, block_b, warps, dtype, expected",
    [(4096, 1024, 16, torch.bfloat16, True), (8192, 0, 16, torch.bfloat16, False),
     (1024, 256, 4, torch.bfloat16, True), (4096, 1024, 8, torch.bfloat16, False),
     (1024, 256, 4, torch.float32, False), (64, 0, 4, torch.bfloat16, False),
     (4096, 64, 16, torch.bfloat16, False), (512, 0, 4, torch.bfloat16, True)],
)  # fmt: skip
def test_rows_as_2d_tiles_only_where_a_thread_loads_its_values_at_once(
    block_a, block_b, warps, dtype, expected
):
    assert triton_kernels.rows_as_2d(block_a, block_b, warps, dtype) is expected


@needs_interpreter
@pytest.mark.parametrize("hidden, tokens", [(1280, 3), (5120, 2), (5120, 140)])
def test_interpreted_rows_as_2d_tiles_with_both_tiles(hidden, tokens):
    """The 2-D path with two tiles, few rows and many (the hypothesis test may not draw it)."""
    args = make_inputs(tokens, hidden, 0, torch.bfloat16, "cpu", seed=hidden + tokens)
    warps = triton_kernels._launch_config(tokens, hidden, 0, torch.bfloat16, args[0].device)[0]
    a, b = triton_kernels.row_tiles(hidden, split=True)
    assert b and triton_kernels.rows_as_2d(a, b, warps, torch.bfloat16)
    h, y = run_into(args, split=True, row2d=True)
    check_against_reference(args, h, y)


@pytest.mark.parametrize(
    "hidden, tiles",
    [(5120, (4096, 1024)), (4096, (4096, 0)), (7168, (8192, 0)), (6144, (4096, 2048)),
     (2880, (2048, 1024)), (200, (256, 0)), (48, (32, 16)), (1, (1, 0))],
)  # fmt: skip
def test_row_tiles(hidden, tiles):
    assert triton_kernels.row_tiles(hidden, split=True) == tiles
    whole = 1 << (hidden - 1).bit_length()
    assert triton_kernels.row_tiles(hidden, split=False) == (whole, 0)


@needs_interpreter
@pytest.mark.parametrize("topk", [0, 8])
def test_interpreted_residual_only_and_entry_points(topk):
    args = make_inputs(5, 320, topk, torch.bfloat16, "cpu", seed=topk)
    h, y = triton_kernels.fused_boundary(*args)
    check_against_reference(args, h, y)
    x, r, wp, _, ep, _, xs, rs, g, tw, scale = args
    h_only = triton_kernels.fused_boundary_residual(x, r, wp, ep, xs, rs, g, tw, scale)
    assert torch.equal(h_only, h)
    assert torch.equal(
        h_only, reference.fused_boundary_residual(x, r, wp, ep, xs, rs, g, tw, scale)
    )


@needs_interpreter
def test_interpreted_keeps_every_rounding():
    # Values chosen so that skipping the rounding after rms*w flips many results: the
    # kernel must equal the contract bitwise, not an fp32 chain.
    args = make_inputs(4, 1024, 0, torch.bfloat16, "cpu", seed=7, scales=(0.7071, 0.7071))
    h, y = run_into(args)
    h_ref, y_ref = reference.fused_boundary(*args)
    x, r, wp, _, ep, _, xs, rs = args[:8]
    xf = x.float()
    t = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ep) * wp.float()
    h_fp32_chain = (t * xs + r.float() * rs).to(torch.bfloat16)  # what Inductor computes
    assert (h_fp32_chain != h_ref).any(), "the test inputs must separate the two"
    assert torch.equal(h, h_ref)


# --- GPU: an H200 --------------------------------------------------------------------------

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("hidden", [1024, 2048, 2880, 4096, 5120, 7168, 8192, 16384])
@pytest.mark.parametrize("tokens", [1, 7, 64, 333])
@pytest.mark.parametrize("topk", [0, 8])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("row2d", [None, False])
def test_gpu_matches_reference(hidden, tokens, topk, split, row2d):
    args = make_inputs(tokens, hidden, topk, torch.bfloat16, "cuda", seed=hidden + tokens)
    h, y = run_into(args, split=split, row2d=row2d)
    check_against_reference(args, h, y)


@gpu
@pytest.mark.parametrize("tokens, topk", [(1, 0), (64, 0), (4099, 0), (64, 8)])
def test_gpu_programmatic_dependent_launch(tokens, topk):
    # Launched with PDL, the kernel waits for the previous kernel before reading its rows:
    # back-to-back calls, each reading what the one before wrote, match the reference.
    args = make_inputs(tokens, 5120, topk, torch.bfloat16, "cuda", seed=tokens)
    h, y = run_into(args, pdl=True)
    check_against_reference(args, h, y)
    if topk == 0:
        for _ in range(3):
            h2, y2 = run_into((y, h, *args[2:]), pdl=True)
            check_against_reference((y, h, *args[2:]), h2, y2)
            h, y = h2, y2


@gpu
def test_gpu_noncontiguous_norm_weights():
    # Strided weights are copied per call; the copy is a kernel launched just before, so
    # that launch must go without PDL (the kernel reads its weights before the wait).
    args = list(make_inputs(64, 5120, 0, torch.bfloat16, "cuda", seed=11))
    args[2] = torch.stack([args[2], torch.zeros_like(args[2])], 1)[:, 0]  # stride 2
    args[3] = torch.stack([args[3], torch.zeros_like(args[3])], 1)[:, 0]
    assert not args[2].is_contiguous()
    for _ in range(3):
        h, y = run_into(tuple(args), pdl=True)
        check_against_reference(tuple(args), h, y)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    args = make_inputs(65, 5120, 0, dtype, "cuda", seed=3)
    h, y = run_into(args)
    check_against_reference(args, h, y)


@gpu
@pytest.mark.parametrize("programs", [1, 7, None])
def test_gpu_persistent_grid(programs):
    # More rows than programs: each program walks several rows.
    args = make_inputs(4099, 5120, 0, torch.bfloat16, "cuda", seed=11)
    h, y = run_into(args, programs=programs)
    check_against_reference(args, h, y)
    h, y = run_into(args, programs=programs, split=False)
    check_against_reference(args, h, y)


@gpu
def test_gpu_op_dispatches_to_triton():
    args = make_inputs(16, 5120, 8, torch.bfloat16, "cuda", seed=5)
    h, y = ops.fused_boundary(*args)
    assert ops.FUSED_BOUNDARY.last_provider == "triton"
    check_against_reference(args, h, y)
    x, r, wp, _, ep, _, xs, rs, g, tw, scale = args
    h_only = ops.fused_boundary_residual(x, r, wp, ep, xs, rs, g, tw, scale)
    assert ops.FUSED_BOUNDARY_RESIDUAL.last_provider == "triton"
    assert torch.equal(h_only, h)
