"""beamfx.testing itself: a checker that passes a wrong pass is the worst bug a test kit has.

Each test here feeds `assert_fusion` (or a helper) a case it must refuse, and one it must
accept, so that neither side can hold by accident.
"""

import pytest
import torch
from hypothesis import given, settings

from beamfx.pattern import Act, FusionPass, H, T, dtype_in
from beamfx.testing import assert_fusion, examples, load_profile, ulps
from beamfx.testing import strategies as bst


def _relu_pass(name: str, off: float = 0.0) -> FusionPass:
    """relu(x) * s -> clamp_min(x, 0) * s (+ off: a deliberately wrong rewrite)."""
    p = FusionPass(name, "relu(x) * s, rewritten")

    @p.rule(replace=lambda x, s: torch.clamp_min(x, 0.0) * s + off,
            constraints=[dtype_in("x", torch.float32)])  # fmt: skip
    def relu_scale(x: Act[T, H], s: float):
        return torch.relu(x) * s

    return p


GOOD, OFF = _relu_pass("good"), _relu_pass("off", off=1e-3)
X = bst.randn(4, 32, seed=1).float()


def _into_out(x, out):
    out.copy_(torch.relu(x) * 2.0)
    return out


def _in_place(x, r):
    r.add_(torch.relu(x) * 2.0)
    return x + 1.0


def test_a_function_writing_into_an_input_is_checked_on_its_own_copies():
    # The reference used to return the out= buffer itself, which the compiled run then
    # overwrote: the output was compared with itself, and the wrong pass passed.
    out = torch.zeros(4, 32)
    with pytest.raises(AssertionError, match="output 0 is not bitwise equal"):
        assert_fusion(_into_out, (X, out), [OFF], matches=1)
    assert_fusion(_into_out, (X, out), [GOOD], matches=1)
    assert torch.equal(out, torch.zeros(4, 32))  # the caller's tensors are left alone
    # The input it writes is compared too: here the output alone shows nothing.
    r = bst.randn(4, 32, seed=2).float()
    with pytest.raises(AssertionError, match="input .after the run. 1 is not bitwise"):
        assert_fusion(_in_place, (X, r), [OFF], matches=1, tolerance="bitwise")
    # Before: eager's writes reached the compiled run's inputs, so a correct pass failed.
    assert_fusion(_in_place, (X, r), [GOOD], matches=1)


def test_written_inputs_are_checked_against_fn_when_a_reference_gives_the_outputs():
    # The reference is pure: the input fn writes was compared with the reference's copy,
    # which it never wrote, and a correct pass failed.
    out = torch.zeros(4, 32)
    assert_fusion(_into_out, (X, out), [GOOD], matches=1, reference=lambda x, o: torch.relu(x) * 2)


def test_ulps_across_zero_in_fp64_is_far_not_negative():
    for a, b in ((2.0, -2.0), (float("inf"), float("-inf")), (1e300, -1e300)):
        d = ulps(torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64))
        assert d.item() > 2**62, (a, b, d)


def test_an_expanded_input_stays_expanded_in_the_copies():
    seen = []

    def fn(x):
        seen.append(x.stride())
        return torch.relu(x) * 2.0

    row = bst.randn(1, 32, seed=4).float()
    assert_fusion(fn, (row.expand(4, 32),), [GOOD], matches=1)
    assert set(seen) == {(0, 1)}


def test_a_transposed_input_keeps_its_strides_in_the_copies():
    seen = []

    def fn(x):
        seen.append(x.stride())
        return torch.relu(x) * 2.0

    xt = bst.randn(32, 4, seed=3).float().t()
    assert_fusion(fn, (xt,), [GOOD], matches=1)
    assert set(seen) == {(1, 4)}


@pytest.mark.parametrize("matches, error", [
    ({"godo": 1}, r"matches names \['godo'\], not in the pipeline"),
    ({}, r"matches=\{\} checks nothing"),
    (1, r"matches=1 is for one pass, but passes are \['good', 'off'\]"),
    (True, "give an int or"),
])  # fmt: skip
def test_match_counts_that_could_not_fail_are_refused(matches, error):
    with pytest.raises((ValueError, TypeError), match=error):
        assert_fusion(lambda x: torch.relu(x) * 2.0, (X,), [GOOD, OFF], matches=matches)


def test_match_counts_are_keyed_by_name_or_by_the_pass():
    fn = lambda x: torch.relu(x) * 2.0  # noqa: E731
    assert_fusion(fn, (X,), [GOOD], matches={GOOD: 1, "lower": 0})
    with pytest.raises(AssertionError, match=r"match counts \{'good': 1\} != expected"):
        assert_fusion(fn, (X,), [GOOD], matches={GOOD: 0})


def test_a_misspelled_tolerance_is_refused():
    with pytest.raises(ValueError, match=r"tolerance='bitwize'.*'bitwise' or \(atol, rtol\)"):
        assert_fusion(lambda x: torch.relu(x) * 2.0, (X,), [GOOD], matches=1, tolerance="bitwize")


def test_outputs_are_compared_leaf_by_leaf_in_any_structure():
    def nested(x):
        y = torch.relu(x) * 2.0
        return {"y": y, "pair": (y + 1, None), "n": 3}

    assert_fusion(nested, (X,), [GOOD], matches=1)
    with pytest.raises(AssertionError, match="output 0 is not bitwise equal"):
        assert_fusion(nested, (X,), [OFF], matches=1)
    with pytest.raises(AssertionError, match=r"output 0 is torch.float32\[4, 32\], expected "
                       r"torch.float32\[32\]"):  # fmt: skip
        assert_fusion(lambda x: torch.relu(x) * 2.0, (X,), [GOOD], matches=1,
                      reference=lambda x: x[0])  # fmt: skip


def test_ulps_puts_a_one_sided_nan_furthest():
    nan, one = torch.tensor([float("nan")]), torch.tensor([1.0])
    far = torch.iinfo(torch.int64).max
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        a, b = nan.to(dtype), one.to(dtype)
        assert ulps(a, b).item() == far and ulps(b, a).item() == far
        assert ulps(a, a).item() == 0
        assert ulps(b, b + torch.finfo(dtype).eps).item() == 1
    with pytest.raises(TypeError, match="torch.int32 is not a float dtype"):
        ulps(torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))


@given(routing=bst.routing(max_experts=4))
def test_routing_stays_within_max_experts(routing):
    experts, top_k, n_group, topk_group = routing
    assert experts <= 4 and experts % n_group == 0 and top_k <= topk_group * experts // n_group


def test_randn_has_no_zeros_even_far_below_its_dtypes_range():
    for seed in range(3):
        x = bst.randn(4096, dtype=torch.float16, scale=1e-4, seed=seed)
        assert (x != 0).all()


def test_profiles_come_with_the_kit():
    import os

    from beamfx.testing import PROFILES

    try:
        assert load_profile("thorough") == "thorough"
        assert settings().max_examples == 300 and settings().deadline is None
        assert examples(10) == 250  # a test pinned to 10 runs 25 times as many too
        settings.register_profile("mine", max_examples=3)
        assert load_profile("mine") == "mine" and settings().max_examples == 3
        with pytest.raises(ValueError, match="'thourough'.*neither beamfx's .ci, thorough."):
            load_profile("thourough")
    finally:
        name = load_profile()
    assert name == os.environ.get("HYPOTHESIS_PROFILE", "ci")
    assert settings().max_examples == PROFILES.get(name, settings().max_examples)
    if name == "ci":
        assert examples(10) == 10


def test_a_zero_of_the_other_sign_is_not_bitwise_equal():
    """-0.0 and 0.0 compare equal as numbers: the bitwise check compares bits, so a pass
    that loses the sign of zero fails it (a mutation comparing values passed it)."""
    p = FusionPass("signless", "relu(x) * s, with +0.0 where eager gives -0.0")

    @p.rule(replace=lambda x, s: torch.where(x > 0, x * s, 0.0),
            constraints=[dtype_in("x", torch.float32)])  # fmt: skip
    def relu_scale(x: Act[T, H], s: float):
        return torch.relu(x) * s

    assert (torch.relu(X) * -2.0).signbit().any()  # eager's zeros here are -0.0
    with pytest.raises(AssertionError, match="output 0 is not bitwise equal"):
        assert_fusion(lambda x: torch.relu(x) * -2.0, (X,), [p], matches=1)


def test_a_pass_whose_replacement_is_its_own_pattern_fails():
    """A replacement that re-creates what the rule matches would loop in a pipeline that
    reruns passes: assert_fusion fails it (a mutation that skipped the check survived)."""
    p = FusionPass("again", "relu(x) * s -> relu(x) * s, its own pattern again")

    @p.rule(replace=lambda x, s: torch.relu(x) * s, constraints=[dtype_in("x", torch.float32)])
    def relu_scale(x: Act[T, H], s: float):
        return torch.relu(x) * s

    with pytest.raises(AssertionError, match="pass again matched again after running"):
        assert_fusion(lambda x: torch.relu(x) * 2.0, (X,), [p], matches=1)


def test_a_uuid_that_ignores_the_pass_list_fails(monkeypatch):
    """vLLM keys its compile cache on the pass's uuid: one that stayed the same across pass
    lists would serve a graph compiled with other passes. assert_fusion checks that it
    moves (a mutation that skipped the check survived)."""
    from beamfx.pipeline import PassManager

    monkeypatch.setattr(PassManager, "uuid", lambda self: "same for every pass list")
    with pytest.raises(AssertionError, match="uuid did not change with the pass list"):
        assert_fusion(lambda x: torch.relu(x) * 2.0, (X,), [GOOD], matches=1)
