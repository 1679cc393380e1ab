"""Property-based testing of fusion passes: hypothesis strategies and `assert_fusion`.

Public API for anyone testing a pass, beamfx's or their own:

    from hypothesis import given
    from beamfx.testing import assert_fusion, strategies as bst

    @given(t=bst.token_counts(), eps=bst.epsilons())
    def test_my_pass(t, eps):
        x = bst.randn(t, 64)
        assert_fusion(lambda x: my_math(x, eps), (x,), "my_pass", matches=1)

`assert_fusion` compiles with and without the pass through `torch.compile` and checks
the exact match count, the numerics against eager (bitwise by default), that running the
pass again finds nothing (no unfused instance left, idempotence), and that the pass
manager's uuid is stable and changes with the pass list.
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

    `matches`: exact count per pass name (an int means: the single pass named). The
    reference is eager `fn` unless `reference` is given. `tolerance` is "bitwise" or
    (atol, rtol) for `torch.testing.assert_close`. `options`: further Inductor options,
    such as `VLLM_CPU_INDUCTOR`.
    """
    torch.compiler.reset()
    expected = (fn if reference is None else reference)(*args)
    compiled, manager = compile_with(fn, passes, options=options, verify=True, explain=True)
    output = compiled(*args)

    names = manager.names
    want = {names[0]: matches} if isinstance(matches, int) else dict(matches)
    got = {n: sum(r.matches(n) for r in manager.reports) for n in want}
    why = "\n" + manager.format_text()
    assert got == want, f"match counts {got} != expected {want}{why}"

    for r in manager.reports:
        for p in r.passes:
            assert not p.rematches, f"pass {p.name} matched again after running{why}"

    _assert_close(output, expected, tolerance)

    assert PassManager(passes).uuid() == manager.uuid(), "uuid is not stable"
    chosen = [passes] if isinstance(passes, str) else list(passes)
    others = [n for n in ("boundary", "router_gemm", "attn_gate") if n not in names]
    if others:
        changed = PassManager([*chosen, others[0]]).uuid()
        assert changed != manager.uuid(), "uuid did not change with the pass list"
    return FusionResult(output, expected, manager)


def _assert_close(output: Any, expected: Any, tolerance) -> None:
    outs = output if isinstance(output, (tuple, list)) else (output,)
    exps = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(outs) == len(exps), f"{len(outs)} outputs, expected {len(exps)}"
    for i, (o, e) in enumerate(zip(outs, exps)):
        if tolerance == "bitwise":
            diff = (o.double() - e.double()).abs().max().item() if o.numel() else 0.0
            same = o.dtype == e.dtype and o.shape == e.shape and torch.equal(_bits(o), _bits(e))
            assert same, f"output {i} is not bitwise equal to the reference (max diff {diff})"
        else:
            atol, rtol = tolerance
            torch.testing.assert_close(
                o, e, atol=atol, rtol=rtol, msg=lambda m, i=i: f"output {i}: {m}"
            )


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaNs compare equal, -0.0 differs from 0.0)."""
    if not t.is_floating_point():
        return t
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between same-dtype float tensors (int64)."""
    if a.dtype != b.dtype:
        raise TypeError(f"ulps: dtypes differ ({a.dtype} vs {b.dtype}); compare like with like")
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    low = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}[bits[a.dtype]]

    def ordered(t):
        i = t.contiguous().view(bits[t.dtype]).long()
        return torch.where(i < 0, low - i, i)

    return (ordered(a) - ordered(b)).abs()


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
        """(num_experts, top_k, n_group, topk_group) that the Beam config accepts."""
        from hypothesis import strategies as st

        @st.composite
        def build(draw):
            n_group = draw(st.sampled_from([1, 2, 4]))
            per_group = draw(st.integers(2, max(2, max_experts // n_group)))
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
        """Random (never zero) test data, deterministic per seed."""
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(shape, generator=g) * scale).to(dtype)
