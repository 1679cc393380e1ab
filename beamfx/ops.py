"""Beam IR: the plain model's semantic ops and the fused ops, as torch custom ops.

Each op stays one node in a traced graph, so passes match on meaning. Each has exactly
one reference implementation (in `beamfx.kernels.*.reference`) that is its semantics,
its fallback and the test oracle; fast providers register beside it and are chosen at
run time by platform and shape (`Provider.supports` says why one cannot run).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from beamfx.kernels.boundary import reference as boundary_ref
from beamfx.kernels.moe import reference as moe_ref
from beamfx.kernels.norm import gate as gate_ref
from beamfx.kernels.norm import reference as norm_ref
from beamfx.kernels.router import reference as router_ref

NAMESPACE = "beamfx"


@dataclass
class Provider:
    """A fast implementation of an op. `supports(*args)` returns None or why it cannot run."""

    name: str
    fn: Callable
    supports: Callable[..., str | None]


@dataclass
class OpDef:
    """A Beam IR op: its reference (semantics), fast providers, and whether to lower it."""

    name: str
    reference: Callable
    lower: bool
    providers: list[Provider] = field(default_factory=list)
    op: torch._ops.OpOverloadPacket | None = None
    last_provider: str = "reference"
    # Why each provider ahead of `last_provider` declined the last call (`provider_report`).
    last_declined: dict[str, str] = field(default_factory=dict)
    calls: int = 0

    def dispatch(self, *args):
        _install_providers()
        pinned = _PINNED.get(self.name)
        self.calls += 1
        declined = {}
        for p in self.providers:
            if pinned is not None and p.name != pinned:
                continue
            reason = p.supports(*args)
            if reason is None:
                self.last_provider, self.last_declined = p.name, declined
                return p.fn(*args)
            declined[p.name] = reason
        if pinned is not None and pinned != "reference" and pinned not in declined:
            # A pinned name no installed provider has (a typo, or a provider this machine
            # lacks): the reference runs, and the report says so.
            names = ", ".join(p.name for p in self.providers) or "none"
            declined[pinned] = f"no provider {pinned!r} is installed here (installed: {names})"
        self.last_provider, self.last_declined = "reference", declined
        return self.reference(*args)

    def add_provider(self, provider: Provider) -> None:
        self.providers = [p for p in self.providers if p.name != provider.name] + [provider]


REGISTRY: dict[str, OpDef] = {}
_PINNED: dict[str, str] = {}


def provider_report(reset: bool = False) -> dict[str, dict]:
    """Per op run since the last reset: its calls, the provider of the last call, and why
    each provider ahead of it declined (a fallback to the reference says why here)."""
    out = {
        name: {"calls": d.calls, "provider": d.last_provider, "declined": dict(d.last_declined)}
        for name, d in REGISTRY.items()
        if d.calls
    }
    if reset:
        for d in REGISTRY.values():
            d.calls, d.last_provider, d.last_declined = 0, "reference", {}
    return out


@contextlib.contextmanager
def pinned_providers(**choice: str):
    """Run ops only on the named provider (or the reference) inside the block, e.g.
    `pinned_providers(moe_experts="grouped_mm")` for a library baseline in a benchmark."""
    for op in choice:
        if op not in REGISTRY:
            raise ValueError(f"pinned_providers: no op {op!r}; ops: {', '.join(REGISTRY)}")
    saved = dict(_PINNED)
    _PINNED.update(choice)
    try:
        yield
    finally:
        _PINNED.clear()
        _PINNED.update(saved)


# Fast providers per op: "module:attribute" naming a `Provider` (or None where the
# module finds its platform lacking). Imported on first dispatch, so importing beamfx
# stays cheap and CPU-only machines never import GPU libraries.
PROVIDERS: dict[str, list[str]] = {
    "fused_boundary": ["beamfx.kernels.boundary.triton:FUSED_BOUNDARY"],
    "fused_boundary_residual": ["beamfx.kernels.boundary.triton:FUSED_BOUNDARY_RESIDUAL"],
    "attn_gate": ["beamfx.kernels.norm.triton:ATTN_GATE"],
    "router_gemm": [
        "beamfx.kernels.router.cutedsl:ROUTER_GEMM",
        "beamfx.kernels.router.triton:ROUTER_GEMM",
    ],
    "routed_topk": [
        "beamfx.kernels.router.cutedsl:ROUTED_TOPK",
        "beamfx.kernels.router.triton:ROUTED_TOPK",
    ],
    "moe_experts": [
        "beamfx.kernels.moe.triton:MOE_EXPERTS",
        "beamfx.kernels.moe.grouped:MOE_EXPERTS",
    ],
    "moe_experts_nvfp4": [
        "beamfx.kernels.moe.cutedsl:MOE_EXPERTS_NVFP4",
        "beamfx.kernels.moe.triton:MOE_EXPERTS_NVFP4",
    ],
    "mega_moe": ["beamfx.kernels.moe.triton:MEGA_MOE", "beamfx.kernels.moe.grouped:MEGA_MOE"],
    "mega_moe_nvfp4": [
        "beamfx.kernels.moe.flashinfer:MEGA_MOE_NVFP4",
        "beamfx.kernels.moe.cutedsl:MEGA_MOE_NVFP4",
        "beamfx.kernels.moe.triton:MEGA_MOE_NVFP4",
    ],
}
_installed = False


def _install_providers() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    import importlib

    for op_name, specs in PROVIDERS.items():
        for spec in specs:
            module, attr = spec.split(":")
            try:
                provider = getattr(importlib.import_module(module), attr)
            except ModuleNotFoundError as e:
                if e.name != module:  # the module is there, but something it imports is not
                    warnings.warn(f"beamfx provider {spec} unavailable: {e}", stacklevel=2)
                continue
            except Exception as e:  # an import error, or a library's set-up failing
                warnings.warn(f"beamfx provider {spec} unavailable: {e!r}", stacklevel=2)
                continue
            if provider is not None:
                REGISTRY[op_name].add_provider(provider)


def _define(
    name: str,
    reference: Callable,
    fake: Callable,
    *,
    lower: bool = True,
    check: Callable | None = None,
) -> OpDef:
    """The op `beamfx::name`. `check(*args)`, where given, holds the arguments to the op's
    contract in eager calls and while tracing alike (the reference alone may broadcast).

    Every output is contiguous, whatever layout the inputs have, and `fake` must say so:
    Inductor lays out the code after an op by its fake's strides (with `size_asserts` off,
    as vLLM sets it, a wrong stride reads wrong values silently). A reference whose result
    follows an input's layout (a transposed x) is made contiguous here; the fast providers
    write contiguous outputs."""
    opdef = OpDef(name, reference, lower)
    qual = f"{NAMESPACE}::{name}"

    def impl(*args):
        if check is not None:
            check(*args)
        return _contiguous(opdef.dispatch(*args))

    def checked_fake(*args):
        if check is not None:
            check(*args)
        return fake(*args)

    impl.__signature__ = _signature_of(reference)
    checked_fake.__signature__ = impl.__signature__
    torch.library.custom_op(qual, impl, mutates_args=())
    torch.library.register_fake(qual)(checked_fake)
    opdef.op = getattr(getattr(torch.ops, NAMESPACE), name)
    REGISTRY[name] = opdef
    return opdef


def _signature_of(fn: Callable):
    import inspect
    import types
    import typing

    def plain(hint):
        # torch's schema inference warns on PEP 604 unions; spell them typing.Optional.
        args = typing.get_args(hint)
        if isinstance(hint, types.UnionType) and type(None) in args:
            return typing.Optional[next(a for a in args if a is not type(None))]  # noqa: UP045
        return hint

    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    params = [p.replace(annotation=plain(hints[p.name])) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=hints["return"])


def _contiguous(out):
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    return tuple(o.contiguous() for o in out)


def _like(x: torch.Tensor) -> torch.Tensor:
    """A fake output of x's shape, contiguous (see `_define`)."""
    return x.new_empty(x.shape)


def _same_shape(op: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """The op's contract: these inputs have one shape (no broadcasting). While tracing, a
    dynamic dim then carries the equality (as an aten add's own check would), which the
    passes' shape constraints prove from."""
    torch._check(a.dim() == b.dim(), lambda: f"{op}: {tuple(a.shape)} against {tuple(b.shape)}")
    for i in range(a.dim()):
        torch._check(a.shape[i] == b.shape[i],
                     lambda: f"{op}: {tuple(a.shape)} against {tuple(b.shape)}")  # fmt: skip


# --- semantic ops: what the plain model calls --------------------------------------------


def _norm_weight(x: torch.Tensor, w: torch.Tensor) -> None:
    """rms_norm's contract: the weight is one row of x's last dim (no broadcasting)."""
    shapes = lambda: f"rms_norm: weight {tuple(w.shape)} against x {tuple(x.shape)}"  # noqa: E731
    torch._check(w.dim() == 1, shapes)
    torch._check(w.shape[0] == x.shape[-1], shapes)


RMS_NORM = _define(
    "rms_norm",
    norm_ref.rms_norm,
    lambda x, w, eps: _like(x),
    check=lambda x, w, eps: _norm_weight(x, w),
)
SILU_MUL = _define(
    "silu_mul",
    norm_ref.silu_mul,
    lambda g, u: _like(g),
    check=lambda g, u: _same_shape("silu_mul", g, u),
)
SCALED_ADD = _define(
    "scaled_residual_add",
    boundary_ref.scaled_residual_add,
    lambda x, r, xs, rs: _like(x),
    check=lambda x, r, xs, rs: _same_shape("scaled_residual_add", x, r),
)
ALL_REDUCE = _define("all_reduce", boundary_ref.all_reduce, lambda x, g: _like(x))
ROUTER_LOGITS = _define(
    "router_logits",
    moe_ref.router_logits,
    lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32),
)


def _topk_fake(logits, bias, top_k, n_group, topk_group, renormalize):
    t = logits.shape[0]
    return (
        logits.new_empty(t, top_k, dtype=torch.float32),
        logits.new_empty(t, top_k, dtype=torch.int32),
    )


def _topk_fake_x(x, w, bias, top_k, n_group, topk_group, renormalize):
    return _topk_fake(x, bias, top_k, n_group, topk_group, renormalize)


GROUPED_TOPK = _define("grouped_topk", moe_ref.grouped_topk, _topk_fake)
# Data-dependent (a loop over the experts that tokens chose): never lowered to aten; its
# fast providers are grouped GEMMs.
MOE_EXPERTS = _define(
    "moe_experts",
    moe_ref.moe_experts,
    lambda x, w13, w2, ids: x.new_empty(ids.shape[0], ids.shape[1], w2.shape[1]),
    lower=False,
)
MOE_FINALIZE = _define(
    "moe_finalize",
    moe_ref.moe_finalize,
    lambda rows, w, s: rows.new_empty(rows.shape[0], rows.shape[2]),
    # rows [T, k, H] and weights [T, k]: the output takes rows' tokens.
    check=lambda rows, w, s: _same_shape("moe_finalize", rows[..., 0], w),
)


# --- fused ops: what the passes rewrite to ------------------------------------------------


FUSED_BOUNDARY = _define(
    "fused_boundary",
    boundary_ref.fused_boundary,
    lambda x, r, *rest: (_like(r), _like(r)),
    lower=False,
)
FUSED_BOUNDARY_RESIDUAL = _define(
    "fused_boundary_residual",
    boundary_ref.fused_boundary_residual,
    lambda x, r, *rest: _like(r),
    lower=False,
)


ATTN_GATE = _define(
    "attn_gate", gate_ref.attn_gate, lambda out, gate, bias: _like(out), lower=False
)
ROUTER_GEMM = _define(
    "router_gemm",
    moe_ref.router_logits,
    lambda x, w: x.new_empty(*x.shape[:-1], w.shape[0], dtype=torch.float32),
    lower=False,
)
ROUTED_TOPK = _define("routed_topk", router_ref.routed_topk, _topk_fake_x, lower=False)


def semantic_ops() -> list[OpDef]:
    """The ops of the plain model (the ones `lower` turns back into torch code)."""
    return [d for d in REGISTRY.values() if d.lower]


# Python entry points with the reference's signature, so models read like the math.
rms_norm = RMS_NORM.op
silu_mul = SILU_MUL.op
scaled_residual_add = SCALED_ADD.op
all_reduce = ALL_REDUCE.op
router_logits = ROUTER_LOGITS.op
grouped_topk = GROUPED_TOPK.op
moe_experts = MOE_EXPERTS.op
moe_finalize = MOE_FINALIZE.op
fused_boundary = FUSED_BOUNDARY.op
fused_boundary_residual = FUSED_BOUNDARY_RESIDUAL.op
router_gemm = ROUTER_GEMM.op
attn_gate = ATTN_GATE.op
routed_topk = ROUTED_TOPK.op


# --- MoE experts on NVFP4 weights, and the fused MoE (experts + finalize) -----------------
# Semantic: the plain model's experts when the checkpoint is ModelOpt NVFP4.
MOE_EXPERTS_NVFP4 = _define(
    "moe_experts_nvfp4",
    moe_ref.moe_experts_nvfp4,
    lambda x, w13, s13, g13, w2, *rest: x.new_empty(*rest[-1].shape, w2.shape[1]),
    lower=False,
)
# Fused: what a pass rewrites `moe_finalize(moe_experts*(...), weights, scale)` into.
MEGA_MOE = _define(
    "mega_moe", moe_ref.mega_moe, lambda x, w, ids, w13, w2, s: _like(x), lower=False
)
MEGA_MOE_NVFP4 = _define(
    "mega_moe_nvfp4", moe_ref.mega_moe_nvfp4, lambda x, w, ids, *rest: _like(x), lower=False
)
moe_experts_nvfp4 = MOE_EXPERTS_NVFP4.op
mega_moe = MEGA_MOE.op
mega_moe_nvfp4 = MEGA_MOE_NVFP4.op
