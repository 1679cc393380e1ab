"""The MegaMoE pass: experts + finalize -> one op, bf16 and NVFP4; composing with boundary."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from beamfx import ops as ir
from beamfx.kernels.moe.nvfp4 import quantize_experts
from beamfx.testing import VLLM_CPU_INDUCTOR, assert_fusion
from beamfx.testing import strategies as bst


def moe_inputs(t, routing, seed, hidden=64, inter=32):
    experts, top_k, n_group, topk_group = routing
    x = bst.randn(t, hidden, seed=seed)
    router = bst.randn(experts, hidden, dtype=torch.float32, seed=seed + 1, scale=0.2)
    bias = bst.randn(experts, dtype=torch.float32, seed=seed + 2, scale=0.1)
    w13 = bst.randn(experts, 2 * inter, hidden, seed=seed + 3, scale=hidden**-0.5)
    w2 = bst.randn(experts, hidden, inter, seed=seed + 4, scale=inter**-0.5)
    weights, ids = ir.grouped_topk(ir.router_logits(x, router), bias, top_k, n_group,
                                   topk_group, True)  # fmt: skip
    return x, weights, ids, w13, w2


@given(t=bst.token_counts(24), routing=bst.routing(), scale=bst.routed_scales(),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_bf16_experts_and_finalize_fuse(t, routing, scale, seed):
    x, weights, ids, w13, w2 = moe_inputs(t, routing, seed)

    def moe(x, weights, ids):
        return ir.moe_finalize(ir.moe_experts(x, w13, w2, ids), weights, scale)

    res = assert_fusion(moe, (x, weights, ids), "mega_moe", matches=1)
    assert res.manager.reports[0].ops_after == {"beamfx.mega_moe": 1}


@given(t=bst.token_counts(12), routing=bst.routing(8), seed=st.integers(0, 2**16))
def test_nvfp4_experts_and_finalize_fuse(t, routing, seed):
    x, weights, ids, w13, w2 = moe_inputs(t, routing, seed)
    q = quantize_experts(w13, w2)

    def moe(x, weights, ids):
        rows = ir.moe_experts_nvfp4(x, q.w13, q.w13_scale, q.w13_global, q.w2, q.w2_scale,
                                    q.w2_global, ids)  # fmt: skip
        return ir.moe_finalize(rows, weights, 2.5)

    res = assert_fusion(moe, (x, weights, ids), "mega_moe", matches=1)
    assert res.manager.reports[0].ops_after == {"beamfx.mega_moe_nvfp4": 1}


def test_experts_that_change_the_width_stay_unfused():
    """The fused op's output has x's shape: experts mapping hidden 64 to 48 are left alone
    (the rewrite failed at run time on the output's size before), and explain says why."""
    x, weights, ids, w13, _ = moe_inputs(4, (8, 2, 4, 2), seed=3)
    w2 = bst.randn(8, 48, 32, seed=9, scale=32**-0.5)

    def moe(x, weights, ids):
        return ir.moe_finalize(ir.moe_experts(x, w13, w2, ids), weights, 2.5)

    res = assert_fusion(moe, (x, weights, ids), "mega_moe", matches=0)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint == "same_size(x[-1], w2[1])" and "64" in why.reason and "48" in why.reason


def test_x_laid_out_otherwise_gives_eagers_output():
    """x a transposed view: the fused op's fake gave its output x's strides where the op
    returns contiguous rows, and Inductor's code after it read wrong values (with vLLM's
    options: no size assert to catch it)."""
    x, weights, ids, w13, w2 = moe_inputs(4, (8, 2, 4, 2), seed=5)

    def moe(x, weights, ids):
        return ir.moe_finalize(ir.moe_experts(x, w13, w2, ids), weights, 2.5) + 1

    x_t = x.t().contiguous().t()
    assert_fusion(moe, (x_t, weights, ids), "mega_moe", matches=1, options=VLLM_CPU_INDUCTOR)


@pytest.mark.parametrize("order", [["mega_moe", "boundary"], ["boundary", "mega_moe"]])
def test_mega_moe_and_boundary_agree_in_either_order(order):
    """mega_moe first takes the finalize; boundary first folds it into the boundary."""
    x, weights, ids, w13, w2 = moe_inputs(6, (8, 2, 2, 1), seed=7)
    r, w = bst.randn(6, 64, seed=8), bst.randn(64, seed=9)

    def layer_end(x, weights, ids, r):
        m = ir.moe_finalize(ir.moe_experts(x, w13, w2, ids), weights, 2.5)
        h = ir.scaled_residual_add(ir.rms_norm(m, w, 1e-6), r, 0.5, 0.8)
        return h, ir.rms_norm(h, w, 1e-6)

    first = order[0]
    res = assert_fusion(layer_end, (x, weights, ids, r), order,
                        matches={first: 1, order[1]: 1 if first == "mega_moe" else 0})  # fmt: skip
    after = res.manager.reports[0].ops_after
    if first == "mega_moe":
        assert after == {"beamfx.mega_moe": 1, "beamfx.fused_boundary": 1}
    else:
        assert after == {"beamfx.moe_experts": 1, "beamfx.fused_boundary": 1}


@pytest.mark.slow
def test_fires_once_per_moe_layer_on_the_tiny_model(tiny_checkpoint, tiny_prompt):
    from beamfx.checkpoint import load_checkpoint

    model = load_checkpoint(tiny_checkpoint)
    res = assert_fusion(model, (tiny_prompt,), "all", tolerance=(0.1, 0.0),
                        matches={"mega_moe": 2, "boundary": 8, "router_gemm": 2,
                                 "attn_gate": 4})  # fmt: skip
    assert res.manager.reports[0].ops_after["beamfx.mega_moe"] == 2
