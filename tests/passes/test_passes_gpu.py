"""The passes on CUDA: the fused ops dispatch to the GPU kernels and keep the numerics."""

import pytest
import torch

from beamfx import ops as ir
from beamfx.kernels.norm.reference import rms_norm
from beamfx.kernels.router.reference import routed_topk
from beamfx.testing import assert_fusion, ulp_at, ulps
from beamfx.testing import strategies as bst

pytestmark = pytest.mark.gpu


def cuda(t):
    return t.cuda()


@pytest.mark.parametrize("t", [1, 7, 64, 1000])
def test_boundary_on_cuda_runs_the_triton_kernel(t):
    x, r = cuda(bst.randn(t, 5120, seed=1)), cuda(bst.randn(t, 5120, seed=2))
    w1, w2 = cuda(bst.randn(5120, seed=3)), cuda(bst.randn(5120, seed=4))

    def sandwich(x, r):
        h = ir.scaled_residual_add(ir.rms_norm(x, w1, 1e-6), r, 0.5, 0.8)
        return h, ir.rms_norm(h, w2, 1e-6)

    # The kernel sums a row in another order than torch: a rare rounding of the post-norm
    # flips, and h = round(t + u) inherits it at the addends' scale. Hold h to 2 ulps there
    # and y to 1 ulp of the next norm of this h; nearly every element bitwise equal.
    res = assert_fusion(sandwich, (x, r), "boundary", matches=1, tolerance=(0.1, 0.0))
    assert ir.FUSED_BOUNDARY.last_provider == "triton"
    (h, y), (h_ref, y_ref) = res.output, res.expected
    scale = h_ref.float().abs() + (r.float() * 0.8).to(torch.bfloat16).float().abs()
    assert ((h.float() - h_ref.float()).abs() <= 2 * ulp_at(scale, h.dtype)).all()
    assert ulps(y, rms_norm(h, w2, 1e-6)).max() <= 1
    assert (h != h_ref).sum() <= h.numel() // 10_000 + 1
    assert (y != y_ref).sum() <= y.numel() // 10_000 + 1


@pytest.mark.parametrize("t", [1, 16, 64, 512])
def test_router_on_cuda_matches_fp64_and_the_reference_routing(t):
    x = cuda(bst.randn(t, 5120, seed=5))
    w = cuda(bst.randn(256, 5120, dtype=torch.float32, seed=6, scale=0.02))
    bias = cuda(bst.randn(256, dtype=torch.float32, seed=7, scale=0.01))

    res = assert_fusion(lambda x: ir.router_logits(x, w) * 1.5, (x,), "router_gemm", matches=1,
                        tolerance=(1e-5, 1e-5))  # fmt: skip
    exact = torch.nn.functional.linear(x.double(), w.double()) * 1.5
    torch.testing.assert_close(res.output.double(), exact, rtol=1e-5, atol=1e-5)

    fused = assert_fusion(lambda x: ir.grouped_topk(ir.router_logits(x, w), bias, 8, 8, 4, True),
                          (x,), "router_gemm", matches=1, tolerance=(1e-5, 1e-5))  # fmt: skip
    weights, ids = fused.output
    ref_weights, ref_ids = routed_topk(x, w, bias, 8, 8, 4, True)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)


def test_mega_moe_on_cuda_matches_the_reference():
    t, experts, hidden, inter = 8, 16, 512, 128
    x = cuda(bst.randn(t, hidden, seed=8))
    w13 = cuda(bst.randn(experts, 2 * inter, hidden, seed=9, scale=hidden**-0.5))
    w2 = cuda(bst.randn(experts, hidden, inter, seed=10, scale=inter**-0.5))
    ids = cuda(torch.randint(0, experts, (t, 4), generator=torch.Generator().manual_seed(0)))
    ids = ids.to(torch.int32)
    weights = cuda(torch.rand(t, 4, generator=torch.Generator().manual_seed(1)))

    def moe(x, weights, ids):
        return ir.moe_finalize(ir.moe_experts(x, w13, w2, ids), weights, 2.5)

    assert_fusion(moe, (x, weights, ids), "mega_moe", matches=1, tolerance=(2e-2, 2e-2))
