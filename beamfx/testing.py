"""Property-based testing of fusion passes: hypothesis strategies and `assert_fusion`.

Public API for anyone testing a pass, beamfx's or their own:

    from hypothesis import given
    from beamfx.testing import assert_fusion, load_profile, strategies as bst
    from my_passes import MY_PASS  # a FusionPass (or a beamfx pass's name: "boundary")

    load_profile()  # beamfx's hypothesis profiles (usually from a conftest.py)

    @given(t=bst.token_counts(), eps=bst.epsilons())
    def test_my_pass(t, eps):
        x = bst.randn(t, 64)
        assert_fusion(lambda x: my_math(x, eps), (x,), [MY_PASS], matches=1)

`assert_fusion` compiles with and without the pass through `torch.compile` and checks
the exact match count, the numerics against eager (bitwise by default), the inputs after
the run (a function or fused op that writes into an input must write what eager writes;
each run gets its own copies), that running the pass again finds nothing (no unfused
instance left, idempotence), and that the pass manager's uuid is stable and changes with
the pass list.

Hypothesis profiles: `load_profile()` registers "ci" (12 examples, the default) and
"thorough" (300) and loads the one `HYPOTHESIS_PROFILE` names; call it from a conftest.py.
A compile takes seconds, past hypothesis' default deadline: both profiles have none. A
slow test that pins its own count writes `@settings(max_examples=examples(10))`, which the
thorough profile scales up like the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from beamfx.pipeline import PassManager
from beamfx.pipeline import op_counts as op_counts  # re-exported for tests

__all__ = [
    "assert_fusion",
    "examples",
    "load_profile",
    "FusionResult",
    "strategies",
    "compile_with",
    "op_counts",
    "ulps",
    "ulp_at",
]


@dataclass
class FusionResult:
    output: Any
    expected: Any
    manager: PassManager

    def matches(self, name: str) -> int:
        return sum(r.matches(name) for r in self.manager.reports)


PROFILES = {"ci": 12, "thorough": 300}  # examples per test


def load_profile(name: str | None = None) -> str:
    """Register beamfx's hypothesis profiles and load `name` (default: the environment's
    HYPOTHESIS_PROFILE, else "ci"); returns the name loaded."""
    import os

    from hypothesis import HealthCheck, settings

    for key, examples in PROFILES.items():
        settings.register_profile(
            key,
            max_examples=examples,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
            print_blob=True,
        )
    name = name or os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    try:
        settings.get_profile(name)  # beamfx's, or one the project registered itself
    except Exception:
        raise ValueError(
            f"hypothesis profile {name!r} (HYPOTHESIS_PROFILE) is neither beamfx's "
            f"({', '.join(sorted(PROFILES))}) nor registered by this project"
        ) from None
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """`n` examples under the "ci" profile, as many more as the loaded profile has: for a
    test that pins its own `max_examples` (a slow one), so "thorough" still runs it more."""
    from hypothesis import settings

    return max(1, n * settings().max_examples // PROFILES["ci"])


# Inductor options vLLM's CPU platform sets: no size or stride asserts, so an op's fake that
# gets its output's layout wrong gives wrong values, not an error.
VLLM_CPU_INDUCTOR = {"size_asserts": False, "nan_asserts": False, "epilogue_fusion": True}


def compile_with(
    fn: Callable,
    passes: Sequence[str] | str,
    *,
    options: dict[str, Any] | None = None,
    **manager_options: Any,
):
    """`fn` compiled by Inductor with a fresh beamfx pipeline (caches off: every compile
    runs the passes, so reports are complete); `options` are further Inductor options
    (`VLLM_CPU_INDUCTOR`: vLLM's). Returns (compiled, manager)."""
    manager = PassManager(passes, **manager_options)
    options = {
        "emulate_precision_casts": True,
        "fx_graph_cache": False,
        **(options or {}),
        "post_grad_custom_post_pass": manager,
    }
    return torch.compile(fn, options=options, dynamic=False), manager


def assert_fusion(
    fn: Callable,
    args: Sequence[Any],
    passes: Sequence[str] | str,
    *,
    matches: dict[str, int] | int,
    tolerance: str | tuple[float, float] = "bitwise",
    reference: Callable | None = None,
    options: dict[str, Any] | None = None,
) -> FusionResult:
    """Compile `fn(*args)` with `passes` and check the fusion (see the module docstring).

    `matches`: exact count per pass (keyed by name or by the FusionPass; an int when one
    pass is chosen). The reference is eager `fn` unless `reference` is given. `tolerance`
    is "bitwise" or (atol, rtol) for `torch.testing.assert_close`. `options`: further
    Inductor options, such as `VLLM_CPU_INDUCTOR`.
    """
    _check_tolerance(tolerance)
    torch.compiler.reset()
    compiled, manager = compile_with(fn, passes, options=options, verify=True, explain=True)
    want = _wanted(matches, manager)
    # Each run gets its own copies of the inputs: a function that writes into one (an
    # out= buffer, an in-place residual) must not hand the compiled run eager's result.
    eager_args, compiled_args = _copies(args), _copies(args)
    if reference is None:
        expected = fn(*eager_args)
    else:  # the outputs are the reference's; what fn writes into its inputs is eager fn's
        expected = reference(*_copies(args))
        fn(*eager_args)
    output = compiled(*compiled_args)

    why = "\n" + manager.format_text()
    assert manager.reports, f"no graph reached the passes: fn ran without a compiled graph{why}"
    got = {n: sum(r.matches(n) for r in manager.reports) for n in want}
    assert got == want, f"match counts {got} != expected {want}{why}"

    for r in manager.reports:
        for p in r.passes:
            assert not p.rematches, f"pass {p.name} matched again after running{why}"

    _assert_close(output, expected, tolerance)
    _assert_close(compiled_args, eager_args, tolerance, what="input (after the run)")

    assert PassManager(passes).uuid() == manager.uuid(), "uuid is not stable"
    chosen = [passes] if isinstance(passes, str) else list(passes)
    others = [n for n in ("boundary", "router_gemm", "attn_gate") if n not in manager.names]
    if others:
        changed = PassManager([*chosen, others[0]]).uuid()
        assert changed != manager.uuid(), "uuid did not change with the pass list"
    return FusionResult(output, expected, manager)


def _wanted(matches: Any, manager: PassManager) -> dict[str, int]:
    """`matches` as {pass name: count}, every key a stage of the pipeline."""
    if isinstance(matches, bool) or not isinstance(matches, (int, dict)):
        raise TypeError(f"assert_fusion: matches={matches!r}: give an int or {{pass: count}}")
    if isinstance(matches, int):
        if len(manager.names) != 1:
            raise ValueError(
                f"assert_fusion: matches={matches} is for one pass, but passes are "
                f"{manager.names}: give {{pass: count}} for each"
            )
        return {manager.names[0]: matches}
    if not matches:
        raise ValueError("assert_fusion: matches={} checks nothing: name a pass and its count")
    want = {getattr(k, "name", k): v for k, v in matches.items()}
    unknown = [k for k in want if k not in manager.stages]
    if unknown:
        raise ValueError(
            f"assert_fusion: matches names {unknown}, not in the pipeline "
            f"{manager.stages}: a misspelled name would be counted 0 and always agree"
        )
    return want


def _check_tolerance(tolerance: Any) -> None:
    ok = tolerance == "bitwise" or (
        isinstance(tolerance, tuple)
        and len(tolerance) == 2
        and all(isinstance(t, (int, float)) and t >= 0 for t in tolerance)
    )
    if not ok:
        raise ValueError(
            f"assert_fusion: tolerance={tolerance!r}: give 'bitwise' or (atol, rtol), "
            "two numbers >= 0"
        )


def _copies(args: Sequence[Any]) -> list[Any]:
    """Copies of the tensors in `args` with the same sizes and strides (a transposed or
    sliced input stays one); other values as they are."""

    def copy(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        if 0 in a.stride():  # an expanded view: copy what it expands, and expand the copy
            base = a[tuple(slice(0, 1) if st == 0 else slice(None) for st in a.stride())]
            return base.clone().expand(a.shape)
        out = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        return out.copy_(a)

    return [torch.utils._pytree.tree_map(copy, a) for a in args]


def _assert_close(output: Any, expected: Any, tolerance, what: str = "output") -> None:
    outs, out_spec = torch.utils._pytree.tree_flatten(output)
    exps, exp_spec = torch.utils._pytree.tree_flatten(expected)
    assert out_spec == exp_spec, f"{what}s are structured as {out_spec}, expected {exp_spec}"
    for i, (o, e) in enumerate(zip(outs, exps)):
        if not isinstance(o, torch.Tensor) or not isinstance(e, torch.Tensor):
            assert type(o) is type(e) and (o == e or o != o and e != e), (
                f"{what} {i} is {o!r}, expected {e!r}"
            )
            continue
        assert o.dtype == e.dtype and o.shape == e.shape, (
            f"{what} {i} is {o.dtype}{list(o.shape)}, expected {e.dtype}{list(e.shape)}"
        )
        if tolerance == "bitwise":
            if not torch.equal(_bits(o), _bits(e)):
                diff = (o.double() - e.double()).abs().max().item()
                raise AssertionError(
                    f"{what} {i} is not bitwise equal to the reference (max diff {diff})"
                )
        else:
            atol, rtol = tolerance
            torch.testing.assert_close(
                o, e, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what} {i}: {m}"
            )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaNs compare equal, -0.0 differs from 0.0)."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype float tensors (int64). A NaN
    on one side only is as far as two values can be (int64 max); NaN against NaN is 0."""
    if a.dtype != b.dtype:
        raise TypeError(f"ulps: dtypes differ ({a.dtype} vs {b.dtype}); compare like with like")
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}  # fmt: skip
    if a.dtype not in bits:
        raise TypeError(f"ulps: dtype {a.dtype} is not a float dtype: give one of {list(bits)}")
    low = {torch.int16: -(1 << 15), torch.int32: -(1 << 31), torch.int64: -(1 << 63)}[bits[a.dtype]]

    def ordered(t):
        i = t.contiguous().view(bits[t.dtype]).long()
        return torch.where(i < 0, low - i, i)

    far = torch.iinfo(torch.int64).max
    na, nb = a.isnan(), b.isnan()
    oa, ob = ordered(a), ordered(b)
    d = (oa - ob).abs()
    if a.dtype == torch.float64:  # across zero the int64 difference can overflow: in double
        # (the largest double below 2**63: 2**63 itself would wrap to int64 min)
        across = (oa.double().abs() + ob.double().abs()).clamp_max(9223372036854774784.0).long()
        d = torch.where((oa < 0) != (ob < 0), across, d)
    d = torch.where(na & nb, 0, d)
    return torch.where(na != nb, far, d)


def ulp_at(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of 16-bit `dtype` at each |value| (fp32 result). Hold a
    rounded sum to ulps at its addends' scale: where addends cancel, ulps of the sum mean
    nothing (one flipped rounding of an addend moves the sum by the addend's ulp)."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    tiny = torch.finfo(dtype).tiny
    return torch.exp2(torch.floor(torch.log2(magnitude.float().clamp_min(tiny))) - mantissa_bits)


def run_interpreted(test_file: str, keyword: str = "interpreted") -> None:
    """Run `test_file`'s tests named `keyword` under Triton's CPU interpreter, in a fresh
    process (TRITON_INTERPRET is read at import); assert they ran and passed. Ten minutes
    at most, except under HYPOTHESIS_PROFILE=thorough (25 times the examples): no limit."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", test_file, "-k", keyword]
    timeout = None if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 600
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout.splitlines()[-1]


# --- hypothesis strategies ---------------------------------------------------------------


class strategies:  # noqa: N801 (a namespace: `bst.token_counts()`)
    """Hypothesis strategies for fusion tests (import hypothesis lazily)."""

    @staticmethod
    def token_counts(max_tokens: int = 48):
        from hypothesis import strategies as st

        return st.integers(1, max_tokens)

    @staticmethod
    def activation_dtypes():
        from hypothesis import strategies as st

        return st.sampled_from([torch.bfloat16, torch.float16])

    @staticmethod
    def epsilons():
        from hypothesis import strategies as st

        return st.sampled_from([1e-6, 1e-5]) | st.floats(1e-8, 1e-3)

    @staticmethod
    def residual_scales():
        """(x_scale, residual_scale) of the depth-scaled add number n."""
        from hypothesis import strategies as st

        return st.integers(2, 400).map(
            lambda n: (1 / math.sqrt(n), math.sqrt(n - 1) / math.sqrt(n))
        )

    @staticmethod
    def broadcast_partners(shape: tuple[int, ...]):
        """Shapes an operand may take beside one of `shape` and still broadcast to it:
        `shape` itself, with leading dims dropped, or with dims set to 1. The matcher sees ops,
        not shapes, so a fusion test draws these to check a rewrite refuses all but `shape`."""
        from hypothesis import strategies as st

        def partner(keep: int, ones: list[bool]) -> tuple[int, ...]:
            tail = shape[len(shape) - keep :]
            return tuple(1 if one else n for n, one in zip(tail, ones))

        return st.integers(1, len(shape)).flatmap(
            lambda keep: st.lists(st.booleans(), min_size=keep, max_size=keep).map(
                lambda ones: partner(keep, ones)
            )
        ) | st.just(tuple(shape))

    @staticmethod
    def routed_scales():
        from hypothesis import strategies as st

        return st.sampled_from([1.0, 2.5]) | st.floats(0.25, 8.0)

    @staticmethod
    def hidden_sizes():
        from hypothesis import strategies as st

        return st.sampled_from([32, 64, 96, 128, 256])

    @staticmethod
    def tp_sizes():
        from hypothesis import strategies as st

        return st.sampled_from([1, 2])

    @staticmethod
    def routing(max_experts: int = 16):
        """(num_experts, top_k, n_group, topk_group) that the Beam config accepts, with at
        most `max_experts` (>= 2) experts."""
        from hypothesis import strategies as st

        if max_experts < 2:
            raise ValueError(f"routing: max_experts={max_experts}; a routed layer needs 2 or more")

        @st.composite
        def build(draw):
            n_group = draw(st.sampled_from([g for g in (1, 2, 4) if 2 * g <= max_experts]))
            per_group = draw(st.integers(2, max_experts // n_group))
            topk_group = draw(st.integers(1, n_group))
            top_k = draw(st.integers(1, min(8, topk_group * per_group)))
            return n_group * per_group, top_k, n_group, topk_group

        return build()

    @staticmethod
    def beam_configs(max_layers: int = 3):
        """Small, valid Beam configs over layer and MLP types, heads, widths and routing."""
        from hypothesis import strategies as st

        from beamfx.config import BeamConfig

        @st.composite
        def build(draw):
            layers = draw(st.integers(1, max_layers))
            kv_heads = draw(st.sampled_from([1, 2]))
            experts, top_k, n_group, topk_group = draw(strategies.routing(max_experts=8))

            def per_layer(*kinds):
                return draw(st.lists(st.sampled_from(kinds), min_size=layers, max_size=layers))

            return BeamConfig(
                vocab_size=64,
                hidden_size=draw(st.sampled_from([32, 64, 128])),
                intermediate_size=draw(st.sampled_from([32, 64])),
                num_hidden_layers=layers,
                num_attention_heads=kv_heads * draw(st.sampled_from([1, 2, 4])),
                num_key_value_heads=kv_heads,
                head_dim=draw(st.sampled_from([8, 16, 32])),
                sliding_window=draw(st.integers(1, 8)),
                layer_types=per_layer("sliding_attention", "full_attention"),
                mlp_layer_types=per_layer("dense", "sparse"),
                num_experts=experts,
                num_experts_per_tok=min(top_k, 4),
                moe_intermediate_size=draw(st.sampled_from([16, 32])),
                n_group=n_group,
                topk_group=topk_group,
                norm_topk_prob=draw(st.booleans()),
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                final_logit_softcapping=draw(st.sampled_from([None, 30.0])),
                rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
            )

        return build()

    @staticmethod
    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0, scale: float = 1.0):
        """Random test data, deterministic per seed: normal with std `scale`, no zeros
        (values that round to zero in `dtype` become its smallest normal, signed)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g) * scale
        tiny = torch.finfo(dtype).tiny if dtype.is_floating_point else 1
        x = torch.where(x.abs() < tiny, torch.where(x < 0, -tiny, tiny), x)
        return x.to(dtype)
