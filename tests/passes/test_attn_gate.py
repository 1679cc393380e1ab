"""The attention-gate pass (the tutorial pass): plain torch in, one op out, roundings kept."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from beamfx.kernels.norm.gate import attn_gate
from beamfx.testing import assert_fusion
from beamfx.testing import strategies as bst


def gate(out, g, bias):  # what the plain model writes
    return out * torch.sigmoid(g + bias.view(1, -1, 1))


@given(t=bst.token_counts(), heads=st.integers(1, 8), d=st.sampled_from([16, 64]),
       dtype=bst.activation_dtypes(), seed=st.integers(0, 2**16))  # fmt: skip
def test_gate_fuses_and_keeps_every_rounding(t, heads, d, dtype, seed):
    out, g = (
        bst.randn(t, heads, d, dtype=dtype, seed=seed),
        bst.randn(t, heads, d, dtype=dtype, seed=seed + 1),
    )
    bias = bst.randn(heads, dtype=dtype, seed=seed + 2)
    res = assert_fusion(gate, (out, g, bias), "attn_gate", matches=1)
    assert res.manager.reports[0].ops_after == {"beamfx.attn_gate": 1}
    # Eager bf16 ops round after each op; the reference says the same in fp32 + casts.
    assert torch.equal(attn_gate(out, g, bias), gate(out, g, bias))


def test_fp32_gate_is_left_to_inductor_and_explained():
    out, g, bias = (bst.randn(*s, dtype=torch.float32, seed=i) for i, s in
                    enumerate([(4, 2, 16), (4, 2, 16), (2,)]))  # fmt: skip
    res = assert_fusion(gate, (out, g, bias), "attn_gate", matches=0, tolerance=(1e-6, 1e-6))
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint == "dtype(out)" and "float32" in why.reason
