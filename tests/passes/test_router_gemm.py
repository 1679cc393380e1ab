"""The router pass: the GEMM alone, and with the grouped top-k routing after it."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from beamfx import ops as ir
from beamfx.kernels.router.reference import routed_topk
from beamfx.testing import assert_fusion
from beamfx.testing import strategies as bst


@given(t=bst.token_counts(), routing=bst.routing(), renorm=st.booleans(),
       weight_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       act_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_router_and_routing_fuse_into_routed_topk(t, routing, renorm, weight_dtype, act_dtype,
                                                  seed):  # fmt: skip
    """Every activation dtype the rule names (bf16, fp16, fp32) fuses, routing included."""
    experts, top_k, n_group, topk_group = routing
    x = bst.randn(t, 64, dtype=act_dtype, seed=seed)
    w = bst.randn(experts, 64, dtype=weight_dtype, seed=seed + 1, scale=0.2)
    bias = bst.randn(experts, dtype=torch.float32, seed=seed + 2, scale=0.1)

    def route(x):
        logits = ir.router_logits(x, w)
        return ir.grouped_topk(logits, bias, top_k, n_group, topk_group, renorm)

    res = assert_fusion(route, (x,), "router_gemm", matches=1)
    assert res.manager.reports[0].ops_after == {"beamfx.routed_topk": 1}


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_each_activation_dtype_fuses(act_dtype):
    """The rule's activation dtypes, each drawn for sure (the hypothesis tests may not)."""
    x = bst.randn(4, 64, dtype=act_dtype, seed=1)
    w = bst.randn(16, 64, dtype=torch.float32, seed=2, scale=0.2)
    bias = bst.randn(16, dtype=torch.float32, seed=3, scale=0.1)
    route = lambda x: ir.grouped_topk(ir.router_logits(x, w), bias, 4, 4, 2, True)  # noqa: E731
    assert_fusion(route, (x,), "router_gemm", matches=1)
    assert_fusion(lambda x: ir.router_logits(x, w) * 2.0, (x,), "router_gemm", matches=1)


@given(t=bst.token_counts(), experts=st.sampled_from([8, 16, 256]),
       act_dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 999))  # fmt: skip
def test_router_gemm_alone_within_1e_5_of_fp64(t, experts, act_dtype, seed):
    x = bst.randn(t, 128, dtype=act_dtype, seed=seed)
    w = bst.randn(experts, 128, dtype=torch.float32, seed=seed + 1, scale=0.1)

    res = assert_fusion(lambda x: ir.router_logits(x, w) * 2.0, (x,), "router_gemm", matches=1)
    assert res.manager.reports[0].ops_after == {"beamfx.router_gemm": 1}
    exact = torch.nn.functional.linear(x.double(), w.double()) * 2.0
    torch.testing.assert_close(res.output.double(), exact, rtol=1e-5, atol=1e-5)


def test_routing_with_exact_ties_is_the_references_bit_for_bit():
    """Logits with deliberate ties (experts 0 and 1 equal), routed through the fused op:
    on CPU the op runs the reference, so its choices, tie order included, are the
    reference's to the bit (`assert_fusion` checks). A provider that may order ties its
    own way is held to a tie-aware check instead: the GPU tests' `check_routing`."""
    t, experts = 16, 16
    x = bst.randn(t, 64, seed=5)
    w = bst.randn(experts, 64, dtype=torch.float32, seed=6, scale=0.2)
    w[1] = w[0]  # experts 0 and 1 always tie
    bias = torch.zeros(experts)
    fused = assert_fusion(lambda x: ir.grouped_topk(ir.router_logits(x, w), bias, 4, 4, 2, True),
                          (x,), "router_gemm", matches=1)  # fmt: skip
    weights, ids = fused.output
    ref_weights, ref_ids = routed_topk(x, w, bias, 4, 4, 2, True)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    # The tie decides something: some row takes one of the pair and not the other.
    one_of_pair = (ids == 0).any(1) ^ (ids == 1).any(1)
    assert one_of_pair.any()


@pytest.mark.slow
def test_fires_once_per_moe_layer_on_the_tiny_model(tiny_checkpoint, tiny_prompt):
    from beamfx.checkpoint import load_checkpoint

    model = load_checkpoint(tiny_checkpoint)
    moe_layers = model.config.mlp_layer_types.count("sparse")
    res = assert_fusion(model, (tiny_prompt,), "router_gemm", matches=moe_layers,
                        tolerance=(0.1, 0.0))  # fmt: skip
    assert res.matches("router_gemm") == 2
