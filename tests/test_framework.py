"""The pass framework itself: pass lists and uuids, a user's own pass, no-ops, explain."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from beamfx import ops as ir
from beamfx.passes import PASSES, UnknownPassError, get_pass, resolve
from beamfx.pattern import (
    F32,
    Act,
    Constraint,
    FusionPass,
    H,
    T,
    dtype_in,
    last_dim_at_most,
    same_size,
    shapes_as_annotated,
)
from beamfx.pipeline import PassManager
from beamfx.testing import assert_fusion, compile_with
from beamfx.testing import strategies as bst

# A pass of one's own, written as a user would: scaled ReLU -> clamp form (same bits).
scaled_relu = FusionPass("scaled_relu", "relu(x) * s -> clamp_min(x, 0) * s")


@scaled_relu.rule(replace=lambda x, s: torch.clamp_min(x, 0.0) * s,
                  constraints=[dtype_in("x", torch.float32)])  # fmt: skip
def relu_scale(x: Act[T, H], s: float):
    return torch.relu(x) * s


@given(lists=st.lists(st.permutations(list(PASSES)).map(lambda p: p[: len(p) // 2 + 1]),
                      min_size=2, max_size=4))  # fmt: skip
def test_uuid_is_a_function_of_the_pass_list(lists):
    for a, b in itertools.combinations(lists, 2):
        same = PassManager(a).uuid() == PassManager(b).uuid()
        assert same == (resolve(a) == resolve(b)), (a, b)


def test_uuid_moves_with_options_and_user_passes():
    base = PassManager(["boundary"]).uuid()
    assert PassManager(["boundary"], canonicalize=False).uuid() != base
    assert PassManager(["boundary", scaled_relu]).uuid() != base


def _limited(limit):
    """A pass from a factory: its constraint's limit lives in a closure, not in the source."""
    p = FusionPass("limited", "relu(x) * s -> clamp_min(x, 0) * s, x at most `limit` wide")

    @p.rule(replace=lambda x, s: torch.clamp_min(x, 0.0) * s,
            constraints=[last_dim_at_most("x", limit)])  # fmt: skip
    def relu_scale(x: Act[T, H], s: float):
        return torch.relu(x) * s

    return p


def test_the_cache_key_holds_what_a_pass_closes_over():
    # Two limits, one source: the same uuid let Inductor's cache serve the graph compiled
    # with the other limit.
    assert PassManager([_limited(4096)]).uuid() != PassManager([_limited(16)]).uuid()
    assert PassManager([_limited(16)]).uuid() == PassManager([_limited(16)]).uuid()


def test_the_cache_key_is_the_same_in_another_process():
    import subprocess
    import sys

    code = "from beamfx.pipeline import PassManager; print(PassManager('all').uuid())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == PassManager("all").uuid()


def test_lower_keys_every_module_it_inlines(monkeypatch):
    import inspect

    from beamfx.kernels import precision
    from beamfx.passes import lower

    before = lower.PASS.source_hash()
    source = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda m: "" if m is precision else source(m))
    assert lower.PASS.source_hash() != before


def test_a_constraint_on_a_name_the_rule_lacks_is_refused():
    # A typo ("X") read as "this variant lacks the argument", so the constraint let every
    # match through.
    p = FusionPass("typo", "relu(x) * s, bf16 only")
    with pytest.raises(ValueError, match=r"dtype\(X\) of rule relu_scale reads 'X'.*\(x, s\)"):

        @p.rule(replace=lambda x, s: x, constraints=[dtype_in("X", torch.bfloat16)])
        def relu_scale(x: Act[T, H], s: float):
            return torch.relu(x) * s


def test_a_users_pass_runs_where_it_is_listed_and_needs_its_own_name():
    assert PassManager([scaled_relu, "boundary"]).names == ["scaled_relu", "boundary"]
    assert PassManager(["all", scaled_relu]).names == [*PASSES, "scaled_relu"]
    # A name taken: the built-in ran never and the user's twice, or one of two was dropped.
    for taken in ("boundary", "lower", "scaled_relu"):
        clash = FusionPass(taken, "a pass of one's own, named like another")
        with pytest.raises(ValueError, match=f"pass '{taken}': a pass of that name is already"):
            PassManager([scaled_relu, "boundary", clash])


def test_compile_refuses_a_second_post_grad_pass():
    import beamfx

    # Inductor runs one post-grad custom pass: the user's was silently replaced.
    with pytest.raises(ValueError, match="options\\['post_grad_custom_post_pass'\\] is set"):
        beamfx.compile(torch.nn.Identity(), options={"post_grad_custom_post_pass": print})


def test_unknown_pass_names_the_valid_ones():
    with pytest.raises(UnknownPassError, match="unknown beamfx pass 'bondary'.*boundary"):
        PassManager("bondary,router_gemm")
    assert resolve("all") == list(PASSES)
    assert resolve("boundary, all") == ["boundary", *[p for p in PASSES if p != "boundary"]]


# x * 1.0 is a no-op that Inductor removes before post-grad passes run: nothing to match.
@given(s=st.floats(-4, 4, allow_nan=False).filter(lambda s: s != 1.0), t=bst.token_counts(),
       seed=st.integers(0, 999))  # fmt: skip
def test_a_users_pass_captures_its_scalar(s, t, seed):
    x = bst.randn(t, 32, dtype=torch.float32, seed=seed)
    res = assert_fusion(lambda x: torch.relu(x) * s + 1, (x,), [scaled_relu], matches=1)
    assert res.matches("scaled_relu") == 1


def _computing_on_s(replace, through=True):
    """A pass whose replacement may compute on s; `through` declares it does not, so the
    Inliner's own check (sentinels, probes) must find out."""
    p = FusionPass("derived", "relu(x) * s, rewritten with arithmetic on s")
    p.rule(replace=replace, constraints=[dtype_in("x", torch.float32)],
           scalars_pass_through=through)(relu_scale)  # fmt: skip
    return p


# Replacements traced once per signature with sentinel scalars: one that computes on its
# scalar (1 / s) baked the sentinel's result into every match (outputs off by up to 5).
@pytest.mark.parametrize("replace", [
    lambda x, s: torch.clamp_min(x, 0.0) / (1.0 / s),
    lambda x, s: torch.clamp_min(x, 0.0) * (s if s > 0.5 else -0.75),
    lambda x, s: torch.clamp_min(x, 0.0) * (math.sqrt(s) ** 2 if s > 0 else s),
    lambda x, s: torch.clamp_min(x, 0.0) * torch.full((), s),
], ids=["reciprocal", "branch-on-s", "sqrt", "full"])  # fmt: skip
def test_a_replacement_that_computes_on_its_scalar_gets_each_matchs_value(replace):
    x, y = bst.randn(4, 32, seed=1).float(), bst.randn(4, 32, seed=2).float()
    fn = lambda x, y: (torch.relu(x) * 2.0, torch.relu(y) * -0.75)  # noqa: E731
    tol = (1e-6, 1e-6)  # 1 / (1 / s) and sqrt(s) ** 2 are s to a last bit
    assert_fusion(fn, (x, y), [_computing_on_s(replace)], matches=2, tolerance=tol)


# Each a replacement that departs from the pattern on purpose: the compiled graph must be the
# replacement's own at each match's values (2.0 and -10.0), which a branch or a clamp on s
# decides, though s reaches the graph and the two sentinel traces agree.
SCALAR_LOGIC = {
    "sign": lambda x, s: torch.clamp_min(x, 0.0) * math.copysign(1.0, s),  # 0.0 vs -0.0
    "min": lambda x, s: torch.clamp_min(x, 0.0) * min(s, 1.0),
    "branch": lambda x, s: torch.clamp_min(x, 0.0) * (s if s <= 1.0 else 1.0),
    "max": lambda x, s: torch.clamp_min(x, 0.0) * max(s, -5.0),
}


@pytest.mark.parametrize("name", SCALAR_LOGIC)
@pytest.mark.parametrize("values", [(2.0, -10.0), (0.0, -0.0)], ids=["2,-10", "0,-0"])
def test_the_fused_graph_is_the_replacement_at_each_matchs_values(name, values):
    replace, (a, b) = SCALAR_LOGIC[name], values
    x, y = bst.randn(4, 32, seed=1).float(), bst.randn(4, 32, seed=2).float()
    fn = lambda x, y: (torch.relu(x) * a, torch.relu(y) * b)  # noqa: E731
    own = lambda x, y: (replace(x, a), replace(y, b))  # noqa: E731
    assert_fusion(fn, (x, y), [_computing_on_s(replace)], matches=2, reference=own)


# Reads of s no probe sees (the double itself, a copy, a hash): sound only traced per value,
# the default for a replacement function.
UNSEEN = {
    "float": lambda x, s: torch.clamp_min(x, 0.0) * (s if float(s) <= 1.0 else 2.0),
    "fmod": lambda x, s: torch.clamp_min(x, 0.0) * math.fmod(s, 5.0),
    "in": lambda x, s: torch.clamp_min(x, 0.0) * (0.5 if s in {7.0} else s),
    "is_integer": lambda x, s: torch.clamp_min(x, 0.0) * (3.0 if s.is_integer() else s),
}


@pytest.mark.parametrize("name", UNSEEN)
def test_a_replacement_function_is_traced_per_value_unless_it_says_otherwise(name):
    replace = UNSEEN[name]
    x, y = bst.randn(4, 32, seed=1).float(), bst.randn(4, 32, seed=2).float()
    fn = lambda x, y: (torch.relu(x) * 7.0, torch.relu(y) * 0.25)  # noqa: E731
    own = lambda x, y: (replace(x, 7.0), replace(y, 0.25))  # noqa: E731
    assert_fusion(fn, (x, y), [_computing_on_s(replace, through=None)], matches=2, reference=own)


def test_a_replacement_refusing_the_sentinel_is_traced_per_value():
    """A check on s (or a math domain) raised on the sentinel and failed the compile."""

    def replace(x, s):
        assert s >= 1, "this replacement is for scales of at least 1"
        return torch.clamp_min(x, 0.0) * math.log(s) / math.log(s) * s

    x = bst.randn(4, 32, seed=1).float()
    assert_fusion(lambda x: torch.relu(x) * 2.0, (x,), [_computing_on_s(replace)], matches=1,
                  tolerance=(1e-6, 1e-6))  # fmt: skip


def test_an_int_literal_for_a_float_wildcard_is_traced_as_an_int():
    """relu(x) * 3 (an int) traced with the float sentinel: torch.full made fp32 where the
    replacement at 3 makes bf16, and the splice would have run full(..., 3) as int64."""
    replace = lambda x, s: torch.clamp_min(x, 0.0) * torch.full(x.shape, s)  # noqa: E731
    p = FusionPass("full", "relu(x) * s")
    p.rule(replace=replace, scalars_pass_through=True)(relu_scale)
    x = bst.randn(4, 32, seed=1)  # bf16
    assert_fusion(
        lambda x: torch.relu(x) * 3, (x,), [p], matches=1, reference=lambda x: replace(x, 3)
    )


def test_the_built_in_passes_trace_each_replacement_once_per_signature():
    """Their replacements hand scalars to ops unchanged: 80 layers' scales must not mean 80
    traces (the compile-time budget), and the Inliner's check agrees with their word."""
    from beamfx import pattern
    from beamfx.checkpoint import init_random
    from beamfx.config import preset
    from beamfx.models.beam import BeamForCausalLM

    model = init_random(BeamForCausalLM(preset("tiny", num_hidden_layers=2)), seed=1).eval()
    pattern.INLINER.clear()
    compiled, manager = compile_with(model, "all")
    with torch.no_grad():
        compiled(torch.arange(3, 11).view(1, 8))
    assert manager.summary()["matches"]["boundary"] == 4
    assert not pattern.INLINER._computes_on_scalars
    assert pattern.INLINER._other_sentinels and all(pattern.INLINER._other_sentinels.values())
    # Four boundaries with four pairs of scales, one signature (mega_moe takes the MoE
    # layer's finalize): traced once.
    keys = [k for k in pattern.INLINER._cache if "fused" in getattr(k[0], "__name__", "")]
    assert len(keys) == 1, keys


def test_a_replacement_computing_on_its_scalar_at_some_shapes_is_caught_at_each():
    """math.fabs reads the double (no dunder to see) and gives the sentinel back: only the
    trace with the negative sentinel shows it, at the shapes where the replacement calls it.
    A verdict kept per replacement, from a shape where it did not, served the other."""
    import math

    def replace(x, s):
        return torch.clamp_min(x, 0.0) * (s if x.shape[-1] >= 64 else math.fabs(s))

    p = _computing_on_s(replace)
    wide, narrow = bst.randn(4, 64, seed=1).float(), bst.randn(4, 32, seed=2).float()
    assert_fusion(lambda w: torch.relu(w) * -2.0, (wide,), [p], matches=1)
    both = lambda w, n: (torch.relu(w) * -2.0, torch.relu(n) * -2.0)  # noqa: E731
    own = lambda w, n: (replace(w, -2.0), replace(n, -2.0))  # noqa: E731
    assert_fusion(both, (wide, narrow), [p], matches=2, reference=own)


def test_a_string_a_replacement_branches_on_gets_each_matchs_value():
    """Both string sentinels took the same side of `tag == "double"`: the plain match's
    graph served the double one. Strings are now traced as they are."""

    @torch.library.custom_op("beamfx_test::tagged", mutates_args=())
    def tagged(x: torch.Tensor, tag: str) -> torch.Tensor:
        return x * (2.0 if tag == "double" else 1.0)

    tagged.register_fake(lambda x, tag: torch.empty_like(x))

    def replace(x, tag):
        y = tagged(torch.clamp_min(x, 0.0), tag)
        return y if tag != "double" else y + 100.0  # departs from the pattern on purpose

    p = FusionPass("tags", "tagged(relu(x), tag)")

    @p.rule(replace=replace, constraints=[dtype_in("x", torch.float32)])
    def relu_tag(x: Act[T, H], tag: str):
        return tagged(torch.relu(x), tag)

    x, y = bst.randn(4, 32, seed=1).float(), bst.randn(4, 32, seed=2).float()
    fn = lambda x, y: (tagged(torch.relu(x), "plain"), tagged(torch.relu(y), "double"))  # noqa: E731
    own = lambda x, y: (replace(x, "plain"), replace(y, "double"))  # noqa: E731
    assert_fusion(fn, (x, y), [p], matches=2, reference=own)


def test_a_replacement_with_a_higher_order_op_is_spliced():
    """torch.cond's branches are get_attr subgraphs, which Inductor splices: only a tensor
    constant is refused."""

    def replace(x, s):
        y = torch.clamp_min(x, 0.0)
        return torch.cond(y.sum() > 0, lambda y: y * s, lambda y: y * s, (y,))

    x = bst.randn(4, 32, seed=1).float()
    assert_fusion(lambda x: torch.relu(x) * 2.0, (x,), [_computing_on_s(replace)], matches=1)


def test_a_replacement_that_makes_a_tensor_constant_is_named():
    p = _computing_on_s(lambda x, s: torch.clamp_min(x, 0.0) * torch.tensor(s))
    x = bst.randn(4, 32, seed=1).float()
    with pytest.raises(
        Exception, match=r"pass derived, rule relu_scale: .*makes a tensor constant"
    ):
        compile_with(lambda x: torch.relu(x) * 2.0, [p])[0](x)


def _topk_pass(search):
    p = FusionPass("topk_scaled", "topk of x * s")
    p.rule(replace=lambda x, *a: torch.zeros_like(x))(search)
    return p


def test_scalars_that_cannot_be_wildcards_are_refused_by_name():
    """A bool traced as True where True is the op's default is left out of the trace, so the
    match ignored it (two such bools crashed with no pass named); an int that sets a size
    failed to trace with a bare RuntimeError."""

    def two_bools(x: Act[T, H], a: bool, b: bool):
        return torch.topk(x, 2, -1, a, b).values

    def default_bool(x: Act[T, H], a: bool):
        return torch.topk(x, 2, -1, largest=a).values

    def size_int(x: Act[T, H], k: int):
        return torch.topk(x, k).values

    def two_set_bools(x: Act[T, H], a: bool, b: bool):
        return torch.sort(x, dim=-1, descending=a, stable=b).values

    cases = {
        two_bools: r"pattern two_bools: parameter\(s\) a, b never reach the traced graph",
        default_bool: r"pattern default_bool: parameter\(s\) a never reach",
        two_set_bools: r"pattern two_set_bools: bool parameters \['a', 'b'\] are all traced",
        size_int: r"pattern size_int: tracing it failed .*k=7919.*one rule per value",
    }
    for search, error in cases.items():
        with pytest.raises(TypeError, match=error):
            _topk_pass(search).matcher()


def test_a_users_pass_constraint_is_explained():
    x = bst.randn(4, 32, dtype=torch.bfloat16)
    res = assert_fusion(lambda x: torch.relu(x) * 0.5, (x,), [scaled_relu], matches=0)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert (why.pass_name, why.constraint) == ("scaled_relu", "dtype(x)")


def test_a_scalar_of_another_kind_is_explained():
    """`n: int` does not bind 0.5, nor a scalar the graph computes: both said by explain."""
    p = FusionPass("int_scale", "relu(x) * n, n an int")

    @p.rule(replace=lambda x, n: torch.clamp(x, min=0) * n)
    def relu_times(x: Act[T, H], n: int):
        return torch.relu(x) * n

    x = bst.randn(4, 32, dtype=torch.float32)
    assert_fusion(lambda x: torch.relu(x) * 3, (x,), [p], matches=1)
    res = assert_fusion(lambda x: torch.relu(x) * 0.5, (x,), [p], matches=0)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint == "scalar" and why.reason == "n is 0.5; the rule's n: int binds a int"
    res = assert_fusion(lambda x, y: torch.relu(x) * y.amax(), (x, x), [p], matches=0)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint == "scalar" and "n is computed in the graph" in why.reason


PROGRAMS = st.lists(st.sampled_from([torch.sin, torch.exp, torch.tanh, torch.abs]), min_size=1,
                    max_size=4)  # fmt: skip


@given(program=PROGRAMS, t=bst.token_counts())
def test_every_pass_leaves_unrelated_graphs_alone(program, t):
    def fn(x):
        for f in program:
            x = f(x)
        return x

    x = bst.randn(t, 16, dtype=torch.float32)
    unfused, _ = compile_with(fn, ())  # Inductor's sin is not eager's to the last bit
    res = assert_fusion(fn, (x,), "all", matches={n: 0 for n in PASSES}, reference=unfused)
    for p in res.manager.reports[0].passes:
        assert p.nodes_before == p.nodes_after, p


def test_explain_says_where_the_pattern_diverged():
    """The post-norm output has a second user, so the boundary cannot take it."""
    x, r, w = bst.randn(4, 32, seed=1), bst.randn(4, 32, seed=2), bst.randn(32, seed=3)

    def leaky(x, r):
        t = ir.rms_norm(x, w, 1e-6)
        h = ir.scaled_residual_add(t, r, 0.5, 0.75)
        return h, ir.rms_norm(h, w, 1e-6), t

    # Unfused, the output is Inductor's own code: bitwise eager on torch 2.13. Torch 2.11's
    # CPU code was off eager by up to 0.0078 (measured: an intermediate bf16 rounding of
    # the norm's output dropped before the residual add; Inductor's, not beamfx's).
    tolerance = (2**-6, 2**-7) if torch.__version__ < "2.13" else "bitwise"
    res = assert_fusion(leaky, (x, r), "boundary", matches=0, tolerance=tolerance)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint is None and why.reason.startswith("pattern diverged")
    assert "multiple_users" in why.reason or "users" in why.reason


def _gate(alpha):
    def fn(out, gate, bias):
        return out * torch.sigmoid(torch.add(gate, bias.view(1, -1, 1), alpha=alpha))

    return fn


def test_a_keyword_argument_the_pattern_does_not_name_blocks_the_match():
    """Inductor's matcher ignores a node's keyword arguments that the pattern does not name:
    `add(gate, bias, alpha=2)` would match the gate's `add(gate, bias)`, and the rewrite
    would drop alpha. The match is refused and explained; alpha at its default fuses."""
    out, gate, bias = bst.randn(4, 4, 8, seed=1), bst.randn(4, 4, 8, seed=2), bst.randn(4, seed=3)
    res = assert_fusion(_gate(2), (out, gate, bias), "attn_gate", matches=0)
    (why,) = [e for r in res.manager.reports for e in r.explain]
    assert why.constraint == "keyword arguments" and "'alpha': 2" in why.reason
    assert_fusion(_gate(1), (out, gate, bias), "attn_gate", matches=1)


def test_canonicalize_keeps_an_add_with_alpha():
    """The always-on canonicalize stage raised `add(a * xs, b * rs, alpha=3)` to
    `scaled_residual_add(a, b, xs, rs)`, alpha lost, with no fusion pass chosen."""
    x, r = bst.randn(4, 32, seed=1), bst.randn(4, 32, seed=2)
    x32, r32 = x.float(), r.float()

    def plain(x, r):
        return torch.add(x * 0.5, r * 0.25, alpha=3.0)

    def sandwich(x, r):
        a = (ir.rms_norm(x, w, 1e-6).float() * 0.5).to(torch.bfloat16)
        b = (r.float() * 0.75).to(torch.bfloat16)
        h = torch.add(a.float(), b.float(), alpha=3.0).to(torch.bfloat16)
        return h, ir.rms_norm(h, w, 1e-6)

    w = bst.randn(32, seed=3)
    for fn, args, passes in ((plain, (x32, r32), ()), (sandwich, (x, r), ("boundary",))):
        torch.compiler.reset()
        compiled, _ = compile_with(fn, passes, verify=True)
        got, want = compiled(*args), fn(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        # Inductor's own fp32 add of two products may differ from eager in the last bit.
        for g, e in zip(got, want, strict=True):
            torch.testing.assert_close(g, e, atol=2**-7, rtol=2**-7)


def test_canonicalize_keeps_math_times_a_number():
    """fp32 `silu(g) * T` with T a dynamic size (a SymInt in the graph) and an RMS norm times
    a number matched canonicalize's tensor wildcards (`up`, `weight`): the checker read a
    SymInt's dtype, or the rewrite built `rms_norm(x, 8.0, eps)`, and the compile failed
    with no pass chosen. A tensor wildcard binds tensors only now."""

    def silu_times_tokens(g):
        return torch.nn.functional.silu(g) * g.shape[0]

    def rms_times_a_number(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * x.shape[-1] ** 0.5

    for fn in (silu_times_tokens, rms_times_a_number):
        torch.compiler.reset()
        x = bst.randn(4, 64, dtype=torch.float32, seed=1)
        torch._dynamo.mark_dynamic(x, 0)
        compiled, manager = compile_with(fn, (), explain=True)
        torch.testing.assert_close(compiled(x), fn(x), atol=1e-5, rtol=1e-5)
        assert manager.reports[0].matches("canonicalize") == 0


def test_an_rms_norm_weight_is_one_row_of_x():
    """`rms_norm(x [T, 1], w [H])` broadcast to [T, H] in its reference while its fake said
    [T, 1]; the op refuses it now, eager and traced, and canonicalize keeps such a plain
    norm (x [T, 1] times w [H]) plain: the compiled output is eager's."""
    x, w = bst.randn(4, 1, dtype=torch.float32, seed=1), bst.randn(32, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight \(32,\) against x \(4, 1\)"):
        ir.rms_norm(x, w, 1e-6)

    def plain(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    torch.compiler.reset()
    compiled, manager = compile_with(plain, ())
    torch.testing.assert_close(compiled(x, w), plain(x, w), atol=1e-6, rtol=1e-6)
    assert manager.reports[0].matches("canonicalize") == 0


def test_explain_names_activations_of_two_dtypes():
    """bf16 activations with fp32 norm weights: the boundary does not fuse, and explain
    says why (it used to report the closest structural divergence of another variant)."""
    x, r, w = bst.randn(4, 32, seed=1), bst.randn(4, 32, seed=2), bst.randn(32, seed=3).float()

    def fn(x, r):
        h = ir.scaled_residual_add(ir.rms_norm(x, w, 1e-6), r, 0.5, 0.75)
        return h, ir.rms_norm(h, w, 1e-6)

    res = assert_fusion(fn, (x, r), "boundary", matches=0)
    reasons = [e for r in res.manager.reports for e in r.explain]
    assert reasons and all(e.constraint == "dtype" for e in reasons), reasons
    assert "activations of more than one dtype" in reasons[0].reason
    assert "w_post torch.float32" in reasons[0].reason


def test_explain_names_an_activation_dtype_no_variant_covers():
    """fp64 activations: no variant of the boundary rule is traced for them, and explain
    said only that the pattern diverged (from the closest variant's structure)."""
    x, r, w = (bst.randn(*s, seed=i).double() for i, s in enumerate([(4, 32), (4, 32), (32,)]))

    def fn(x, r):
        h = ir.scaled_residual_add(ir.rms_norm(x, w, 1e-6), r, 0.5, 0.75)
        return h, ir.rms_norm(h, w, 1e-6)

    compiled, manager = compile_with(fn, ["boundary"], explain=True)
    compiled(x, r)
    assert [rep.matches("boundary") for rep in manager.reports] == [0]
    reasons = [e for r in manager.reports for e in r.explain]
    assert reasons and all(e.constraint == "dtype" for e in reasons), reasons
    assert "torch.float64: the rule is traced for torch.bfloat16" in reasons[0].reason


def test_a_match_whose_input_is_made_after_its_first_output():
    """The next norm's weight is computed after the residual add: the fused op, placed
    where the match began, reads it; the graph is sorted again, so it lints and runs."""
    x, r, w1, w2 = (bst.randn(*s, seed=i) for i, s in enumerate([(4, 32), (4, 32), (32,), (32,)]))

    def fn(x, r, w2):
        h = ir.scaled_residual_add(ir.rms_norm(x, w1, 1e-6), r, 0.5, 0.75)
        wn = w2 * 2
        return h, ir.rms_norm(h, wn, 1e-6)

    assert_fusion(fn, (x, r, w2), "boundary", matches=1)


def test_a_pass_offers_nodes_only_to_variants_whose_ops_and_edges_all_occur():
    """Variants with an op, or an edge between two ops, absent from the graph cannot
    match: they are not scanned."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x = torch.randn(4, 8)
    no_relu = make_fx(lambda x: torch.sigmoid(x) * 2.0)(x).graph
    assert scaled_relu._matcher_for(no_relu) is None
    assert scaled_relu.apply(no_relu) == 0
    # Both ops, but the relu does not feed the multiply: the edge is missing.
    apart = make_fx(lambda x: (torch.relu(x), torch.sigmoid(x) * 2.0))(x).graph
    assert scaled_relu._matcher_for(apart) is None
    assert scaled_relu.apply(apart) == 0
    with_relu = make_fx(lambda x: torch.relu(x) * 2.0)(x).graph
    assert scaled_relu._matcher_for(with_relu) is scaled_relu.matcher()
    assert scaled_relu.apply(with_relu) == 1

    canon = get_pass("canonicalize")
    full = canon.matcher()
    sub = canon._matcher_for(make_fx(lambda a, b: a * 0.5 + b)(x, x).graph)
    assert sub is not None and sub is not full
    count = lambda m: sum(len(v) for v in m.patterns.values())  # noqa: E731
    assert 0 < count(sub) < count(full)


def test_verify_lints_the_graph():
    """With verify the pipeline lints the graph it leaves (inside a compile, Inductor
    lints it after its post-grad passes, this pipeline among them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    class Misplace:  # a broken pass of one's own: moves a node after the output
        name = "misplace"

        def apply(self, graph):
            output = graph.find_nodes(op="output")[0]
            output.append(next(n for n in graph.nodes if n.op == "call_function"))
            return 0

    graph = make_fx(lambda x: torch.relu(x) * 2.0)(torch.randn(4, 8)).graph
    with pytest.raises(RuntimeError, match="before it has been defined"):
        PassManager([Misplace()], canonicalize=False, lower=False, verify=True)(graph)


_LEAVES = st.sampled_from([None, 1, 2.5, "g", True, torch.float32])
_ARGS = st.one_of(_LEAVES, st.lists(_LEAVES, max_size=2), st.tuples(_LEAVES),
                  st.dictionaries(st.sampled_from("ab"), _LEAVES, max_size=1))  # fmt: skip
_KWARGS = st.dictionaries(st.sampled_from(["dim", "keepdim"]), _ARGS, max_size=2)


@given(pattern=st.tuples(st.lists(_ARGS, max_size=3), _KWARGS),
       node=st.tuples(st.lists(_ARGS, max_size=3), _KWARGS))  # fmt: skip
def test_the_matchers_flatten_agrees_with_pytrees(pattern, node):
    """A generalized pattern flattens arguments without pytree where none is a container:
    the same items, and a pattern's spec equals a node's exactly when pytree's would."""
    from torch._inductor import pattern_matcher as pm

    from beamfx.pattern import _flatten

    ours = [_flatten(tuple(a), k) for a, k in (pattern, node)]
    theirs = [pm._TargetArgsExpr.pytree_flatten(tuple(a), k) for a, k in (pattern, node)]
    assert [list(items) for items, _ in ours] == [list(items) for items, _ in theirs]
    assert (ours[0][1] == ours[1][1]) == (theirs[0][1] == theirs[1][1])


@pytest.mark.parametrize("flat_helper", [True, False])
def test_a_generalized_pattern_matches_with_or_without_the_flat_helper(monkeypatch, flat_helper):
    """A string wildcard's pattern matches through `_flatten`, or through Inductor's pytree
    form on a torch whose matcher lacks `simple_flatten`."""
    from torch._inductor import pattern_matcher as pm
    from torch.fx.experimental.proxy_tensor import make_fx

    from beamfx.pattern import _flatten, _generalize

    sub = torch.ops.aten.sub.Tensor
    pattern = pm.CallFunction(sub, pm.KeywordArg("x"), pm.KeywordArg("y"), alpha="sentinel")
    if not flat_helper:
        monkeypatch.delattr(pm._TargetArgsExpr, "simple_flatten")
    _generalize(pattern, {"sentinel": "alpha"}, set())
    assert pattern.flatten == (_flatten if flat_helper else pattern.pytree_flatten)
    graph = make_fx(lambda a, b: torch.sub(a, b, alpha=2))(torch.ones(2), torch.ones(2)).graph
    node = next(n for n in graph.nodes if n.target is sub)
    match = pattern.match(node)
    assert match and match.kwargs["alpha"] == 2, match


def _tiny_model_graph() -> torch.fx.GraphModule:
    """The tiny model traced to aten with Inductor's decompositions (fake weights)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    from beamfx.config import preset
    from beamfx.models.beam import BeamForCausalLM

    model = BeamForCausalLM(preset("tiny"))
    params = dict(model.named_parameters())
    ids = torch.zeros(1, 8, dtype=torch.long)
    forward = lambda p, i: torch.func.functional_call(model, p, (i,))  # noqa: E731
    return make_fx(forward, select_decomp_table(), tracing_mode="fake")(params, ids)


def test_the_match_loop_rewrites_as_inductors_own_loop(monkeypatch):
    """`run_matcher` type-checks candidates after matching them, not before: on the tiny
    model's graph every pass makes the same rewrites as Inductor's `apply`, to the code."""
    import copy

    from beamfx import pattern
    from beamfx.passes import lower

    gm = _tiny_model_graph()
    ours, inductors = copy.deepcopy(gm).graph, copy.deepcopy(gm).graph
    mine = PassManager("all")
    mine(ours)
    with monkeypatch.context() as m:
        for module in (pattern, lower):
            m.setattr(module, "run_matcher", lambda matcher, g: matcher.apply(g))
        theirs = PassManager("all")
        theirs(inductors)
    assert mine.summary()["matches"] == theirs.summary()["matches"]
    assert mine.summary()["matches"]["boundary"] == 8  # it did rewrite
    assert ours.python_code("self").src == inductors.python_code("self").src


def _post_grad_graph(fn, args) -> torch.fx.Graph:
    """`fn` traced to aten on fake tensors, views as reshapes (as Inductor's post-grad
    graphs hold them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(fn, tracing_mode="fake")(*args).graph
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    return graph


def _gate_args(*extra_shapes):
    shapes = [(4, 2, 8), (4, 2, 8), (2,), *extra_shapes]
    return [bst.randn(*s, dtype=torch.bfloat16, seed=i) for i, s in enumerate(shapes)]


def test_the_match_loop_keeps_inductors_mutation_guard():
    """A match that spans a mutating op is not rewritten; the same ops beside it are."""

    def across(out, g, bias, buf):
        s = g + bias.view(1, -1, 1)
        buf.add_(1.0)  # between the gate's add and its sigmoid
        return out * torch.sigmoid(s)

    def before(out, g, bias, buf):
        buf.add_(1.0)
        return out * torch.sigmoid(g + bias.view(1, -1, 1))

    args = _gate_args((3,))
    gate = get_pass("attn_gate")
    assert gate.apply(_post_grad_graph(before, args)) == 1
    assert gate.apply(_post_grad_graph(across, args)) == 0


def test_the_match_loop_falls_back_to_inductors_without_its_helpers(monkeypatch):
    """On a torch whose matcher lacks a helper the loop uses, Inductor's loop runs."""
    from torch._inductor import pattern_matcher as pm

    from beamfx import pattern

    gate = lambda o, g, b: o * torch.sigmoid(g + b.reshape(1, -1, 1))  # noqa: E731
    graph = _post_grad_graph(gate, _gate_args())
    assert not hasattr(pm, "a_helper_of_another_torch")
    monkeypatch.setattr(pattern, "_MATCHER_HELPERS", ("a_helper_of_another_torch",))
    inductors_apply, calls = pm.PatternMatcherPass.apply, []

    def apply(self, graph):
        calls.append(graph)
        return inductors_apply(self, graph)

    monkeypatch.setattr(pm.PatternMatcherPass, "apply", apply)
    assert get_pass("attn_gate").apply(graph) == 1
    assert len(calls) == 1  # through Inductor's loop


def test_provider_report_says_what_ran_and_why_faster_ones_declined():
    opdef = ir.REGISTRY["rms_norm"]
    saved = list(opdef.providers)
    opdef.add_provider(ir.Provider("picky", opdef.reference, lambda x, w, eps: "needs a GPU"))
    try:
        ir.provider_report(reset=True)
        x, w = torch.randn(2, 8), torch.ones(8)
        for _ in range(3):
            ir.rms_norm(x, w, 1e-6)
        report = ir.provider_report(reset=True)
        assert report["rms_norm"] == {
            "calls": 3,
            "provider": "reference",
            "declined": {"picky": "needs a GPU"},
        }
        assert ir.provider_report() == {}  # reset
        with ir.pinned_providers(rms_norm="picky"):  # a pin skips the others, says why
            ir.rms_norm(x, w, 1e-6)
        assert ir.provider_report(reset=True)["rms_norm"]["declined"] == {"picky": "needs a GPU"}
        with ir.pinned_providers(rms_norm="pikcy"):  # a name no provider has: said, not lost
            ir.rms_norm(x, w, 1e-6)
        report = ir.provider_report(reset=True)["rms_norm"]
        assert report["provider"] == "reference"
        assert report["declined"] == {
            "pikcy": "no provider 'pikcy' is installed here (installed: picky)"
        }
    finally:
        opdef.providers = saved


def test_a_provider_whose_import_fails_is_skipped_not_fatal(tmp_path, monkeypatch):
    """A provider module that raises on import (a library's set-up failing, not only a
    missing module) is skipped with a warning; the providers after it still install."""
    (tmp_path / "beamfx_broken_provider.py").write_text("raise RuntimeError('no driver')\n")
    (tmp_path / "beamfx_good_provider.py").write_text(
        "from beamfx.ops import Provider, REGISTRY\n"
        "P = Provider('good', REGISTRY['rms_norm'].reference, lambda x, w, eps: None)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ir, "PROVIDERS", {"rms_norm": ["beamfx_broken_provider:P",
                                                      "beamfx_good_provider:P"]})  # fmt: skip
    monkeypatch.setattr(ir, "_installed", False)
    opdef = ir.REGISTRY["rms_norm"]
    monkeypatch.setattr(opdef, "providers", [])
    with pytest.warns(UserWarning, match=r"beamfx_broken_provider:P unavailable: .*no driver"):
        ir.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)
    assert [p.name for p in opdef.providers] == ["good"] and opdef.last_provider == "good"


def test_before_wait_copies_only_strided_operands():
    from beamfx.kernels.triton_common import before_wait

    flat, strided = torch.ones(8), torch.ones(8, 2)[:, 0]
    (a, b, c), copied = before_wait(flat, None, flat)
    assert a is flat and b is None and c is flat and not copied
    (a, b), copied = before_wait(flat, strided)
    assert a is flat and b.is_contiguous() and torch.equal(b, strided) and copied


def _rows_pass(*constraints):
    p = FusionPass("rows", "relu(x) + y -> relu(x) + y, under size constraints")

    @p.rule(replace=lambda x, y: torch.relu(x) + y, constraints=list(constraints))
    def relu_add(x: Act[T, H], y: Act[T, H]):
        return torch.relu(x) + y

    return p


def _compile_rows(p, x, y, dynamic):
    torch.compiler.reset()
    x, y = x.clone(), y.clone()  # a dynamic mark stays on the tensor
    for t in (x, y) if dynamic else ():
        torch._dynamo.mark_dynamic(t, 0)
    compiled, manager = compile_with(lambda x, y: torch.relu(x) + y, [p], explain=True)
    assert torch.equal(compiled(x, y), torch.relu(x) + y)
    (report,) = manager.reports
    return report.matches("rows"), report.explain


def test_size_constraints_on_dynamic_dims_decide_without_guards():
    """`same_size` hashed the sizes: a dynamic dim (a SymInt) made it raise and the whole
    compile failed. Sizes are compared without guards now: equal symbols fuse, a dynamic
    dim against a static one is refused (not provable for every size) and explained."""
    x, y = bst.randn(6, 6, seed=1).float(), bst.randn(6, 6, seed=2).float()
    rows = _rows_pass(same_size(("x", 0), ("y", 0)))
    assert _compile_rows(rows, x, y, dynamic=True) == (1, [])
    square = _rows_pass(same_size(("x", 0), ("x", 1)), last_dim_at_most("x", 8))
    assert _compile_rows(square, x, y, dynamic=False) == (1, [])
    matches, explain = _compile_rows(square, x, y, dynamic=True)
    (why,) = explain
    assert matches == 0 and why.constraint == "same_size(x[0], x[1])"
    assert "not provably equal" in why.reason


def test_a_constraint_that_raises_refuses_the_match():
    """A pass author's constraint that raises (here on a bad assumption) leaves the graph
    unchanged and says why; it used to propagate out of the compile (or, for KeyError and
    the like, let the match through unchecked)."""

    def needs_a_name(args):
        return None if args["x"].names[0] == "rows" else "x's rows are unnamed"

    x, y = bst.randn(4, 8, seed=1).float(), bst.randn(4, 8, seed=2).float()
    matches, explain = _compile_rows(_rows_pass(Constraint("named", needs_a_name, ("x",))), x, y,
                                     dynamic=False)  # fmt: skip
    (why,) = explain
    assert matches == 0 and why.constraint == "named"
    assert why.reason.startswith("the constraint raised")


def test_shapes_as_annotated_refuses_what_the_annotations_do_not_say():
    """The matcher sees ops: `relu(x) + y` with y [1, H] or [H] broadcast is the rule's graph.
    `shapes_as_annotated` refuses ranks and like-named dims that differ, and says which."""
    x = bst.randn(4, 8, seed=1).float()
    rows = _rows_pass(shapes_as_annotated("x", "y"))
    assert _compile_rows(rows, x, bst.randn(4, 8, seed=2).float(), dynamic=True) == (1, [])
    for shape, why in (((1, 8), "dim T is 4 in x and 1 in y"), ((8,), "y is (8,), not rank 2")):
        matches, explain = _compile_rows(rows, x, bst.randn(*shape, seed=2).float(), False)
        (refused,) = explain
        assert matches == 0 and why in refused.reason, refused.reason
    scaled = FusionPass("scaled", "relu(x) * s, x shaped as annotated")
    with pytest.raises(TypeError, match="s are not tensors"):

        @scaled.rule(replace=lambda x, s: torch.relu(x) * s,
                     constraints=[shapes_as_annotated("x", "s")])  # fmt: skip
        def relu_scale(x: Act[T, H], s: float):
            return torch.relu(x) * s


# --- every op's fake says what the op returns ----------------------------------------------


def _reversed_layout(*shape: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """A [*shape] tensor laid out back to front (a transposed view, as a producer may hand
    over): the layout a fake that copies its input's strides gets wrong."""
    t = bst.randn(*reversed(shape), dtype=dtype, seed=seed)
    return t.permute(*reversed(range(len(shape))))


def _op_examples(group_name: str) -> dict[str, tuple]:
    from beamfx.kernels.moe.nvfp4 import quantize_experts

    t, h, inter, e, k = 4, 32, 16, 4, 2
    x, r = _reversed_layout(t, h, seed=1), _reversed_layout(t, h, seed=2)
    rows = _reversed_layout(t, k, h, seed=3)
    w, w_next = bst.randn(h, seed=4), bst.randn(h, seed=5)
    router_w = bst.randn(e, h, dtype=torch.float32, seed=6)
    bias = bst.randn(e, dtype=torch.float32, seed=7)
    logits = _reversed_layout(t, e, dtype=torch.float32, seed=8)
    tw = _reversed_layout(t, k, dtype=torch.float32, seed=9)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 3]], dtype=torch.int32)
    w13 = bst.randn(e, 2 * inter, h, seed=10, scale=0.2)
    w2 = bst.randn(e, h, inter, seed=11, scale=0.2)
    q = quantize_experts(w13.float(), w2.float())
    fp4 = (q.w13, q.w13_scale, q.w13_global, q.w2, q.w2_scale, q.w2_global)
    gate_out, gate = _reversed_layout(t, 2, 8, seed=12), _reversed_layout(t, 2, 8, seed=13)
    return {
        "rms_norm": (x, w, 1e-6),
        "silu_mul": (x, r),
        "scaled_residual_add": (x, r, 0.5, 0.75),
        "all_reduce": (x, group_name),
        "router_logits": (x, router_w),
        "grouped_topk": (logits, bias, 2, 2, 1, True),
        "moe_experts": (x, w13, w2, ids),
        "moe_finalize": (rows, tw, 2.5),
        "fused_boundary": (rows, r, w, w_next, 1e-6, 1e-5, 0.5, 0.75, group_name, tw, 2.5),
        "fused_boundary_residual": (x, r, w, 1e-6, 0.5, 0.75, None, None, 1.0),
        "attn_gate": (gate_out, gate, bst.randn(2, seed=14)),  # out, gate [T, heads, D]
        "router_gemm": (x, router_w),
        "routed_topk": (x, router_w, bias, 2, 2, 1, True),
        "moe_experts_nvfp4": (x, *fp4, ids),
        "mega_moe": (x, tw, ids, w13, w2, 2.5),
        "mega_moe_nvfp4": (x, tw, ids, *fp4, 2.5),
    }


@pytest.mark.parametrize("name", sorted(ir.REGISTRY))
def test_every_op_fake_describes_its_outputs(name, gloo_world):
    """Inductor lays out the code after an op by its fake's sizes and strides, and vLLM turns
    its size asserts off: a fake that says "like the residual" where the op returns rows laid
    out like x reads wrong values silently. torch's own check (`opcheck`) runs each op on
    inputs laid out back to front, fake against real; every output is contiguous."""
    examples = _op_examples(gloo_world)
    assert set(examples) == set(ir.REGISTRY), "give every op an example here"
    args = examples[name]
    torch.library.opcheck(ir.REGISTRY[name].op, args, test_utils="test_faketensor")
    out = ir.REGISTRY[name].op(*args)
    assert all(o.is_contiguous() for o in ([out] if isinstance(out, torch.Tensor) else out))


# --- a pass writer's mistakes get errors that name them --------------------------------------


def _relu_scale_pass(replace, name="rs", **rule_options):
    p = FusionPass(name, "relu(x) * s -> a replacement")

    @p.rule(replace=replace, **rule_options)
    def relu_scale(x: Act[T, H], s: float):
        return torch.relu(x) * s

    return p


@pytest.mark.parametrize(
    "replace, says",
    [
        (lambda x, s: (torch.relu(x) * s).float(), r"returns \(float32\[4, 32\]\) where the "
         r"pattern gives \(bfloat16\[4, 32\]\)"),
        (lambda x, s: (torch.relu(x) * s).t().contiguous(), r"returns \(bfloat16\[32, 4\]\)"),
        (lambda x, s: None, r"returns \(nothing\) where"),
    ],
)  # fmt: skip
def test_a_replacement_must_return_what_its_pattern_returns(replace, says):
    """A replacement of another dtype or shape, or none, gave wrong outputs (or a None)
    with no error, or an Inductor error naming neither pass nor rule."""
    x = bst.randn(4, 32, seed=1)
    compiled, _ = compile_with(lambda x: torch.relu(x) * 2.0 + 1.0, [_relu_scale_pass(replace)])
    with pytest.raises(Exception, match="pass rs, rule relu_scale: the replacement " + says):
        compiled(x)


def test_pass_writers_mistakes_are_named():
    with pytest.raises(TypeError, match=r"spec dims \['T', 'H'\]: give Dim objects"):
        Act["T", "H"]
    p = FusionPass("nothing", "a pattern with no return")

    @p.rule(replace=lambda x: x)
    def forgot(x: Act[T, H]):
        torch.relu(x)

    with pytest.raises(TypeError, match="pattern forgot returns nothing"):
        p.matcher()
    with pytest.raises(ValueError, match="'all': a pass of that name is already in the pipeline"):
        PassManager([_relu_scale_pass(lambda x, s: torch.relu(x) * s, name="all")])
    mine = _relu_scale_pass(lambda x, s: torch.relu(x) * s)
    with pytest.raises(ValueError, match="yours so far: rs"):
        PassManager([mine, mine])
    assert Constraint("c", lambda args: None, "x").args == ("x",)  # a name, not its letters
    tensor = FusionPass("tensor", "an annotation the tracer cannot make an example of")
    tensor.rule(replace=torch.relu, specs={"x": torch.Tensor})(lambda x: torch.relu(x))
    with pytest.raises(TypeError, match=r"unsupported spec .*: annotate it Act\[T, H\]"):
        tensor.matcher()


def test_a_custom_op_object_as_the_replacement_compiles():
    """torch.compile deep-copies its options; the pass manager (and a replacement that is
    the object torch.library.custom_op returns, which cannot be copied) stays one object."""

    @torch.library.custom_op("beamfx_test::relu_scale", mutates_args=())
    def relu_scale_op(x: torch.Tensor, s: float) -> torch.Tensor:
        return torch.relu(x) * s

    relu_scale_op.register_fake(lambda x, s: torch.empty_like(x))
    x = bst.randn(4, 32, seed=1)
    mine = _relu_scale_pass(relu_scale_op)
    compiled, manager = compile_with(lambda x: torch.relu(x) * 2.0, [mine])
    assert torch.equal(compiled(x), torch.relu(x) * 2.0)
    assert manager.reports[0].matches("rs") == 1
    # The user's op is counted as Beam IR is (a check on ops_after could not fail).
    assert manager.reports[0].ops_after == {"beamfx_test.relu_scale": 1}


def test_the_cache_key_follows_a_rules_specs():
    """Two passes from one factory, one traced for bf16 activations and one for fp32 only,
    had one uuid: Inductor's compile cache served one's graph for the other."""

    def make(spec):
        p = FusionPass("rs", "relu(x) * s")
        p.rule(replace=lambda x, s: torch.relu(x) * s, specs={"x": spec, "s": float})(
            lambda x, s: torch.relu(x) * s
        )
        return p

    assert PassManager([make(Act[T, H])]).uuid() != PassManager([make(F32[T, H])]).uuid()
    assert PassManager([make(Act[T, H])]).uuid() == PassManager([make(Act[T, H])]).uuid()
