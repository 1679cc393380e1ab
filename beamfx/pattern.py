"""The pass-authoring API: a fusion is a plain pattern function, a replacement, constraints.

    boundary = FusionPass("boundary", "post-norm + scaled residual + next norm -> one op")

    @boundary.rule(replace=fused, constraints=[dtype_in("x", torch.bfloat16)])
    def dense(x: Act[T, H], residual: Act[T, H], w_post: Act[H], eps: float,
              group_name: str | None = None):
        if group_name is not None:
            x = ir.all_reduce(x, group_name)
        ...

The engine is Inductor's pattern matcher (`fwd_only`, `fx_to_pattern`,
`register_graph_pattern`, `PatternMatcherPass`, its loop run by `run_matcher` with cheaper
checks first); this module feeds it:
- tensor parameters are annotated with their example shape (`Act[T, H]` takes each
  activation dtype of the rule, `F32[...]`/`I32[...]` are fixed) and traced per dtype;
- scalar parameters (`float`, `int`, `bool`, `str`) are wildcards: traced with a sentinel
  value and captured from the graph, never baked in one pattern per value;
- parameters that default to None are optional pieces: every present/absent combination
  is traced as its own variant; the pattern reads `if x is None`;
- constraints are named predicates over the matched arguments (fake tensors, scalars);
  a failed one leaves the graph unchanged and is recorded for `explain`.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import operator
import os
import types
import typing
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch._inductor import pattern_matcher as pm

from beamfx import pattern_cache

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Example sizes for named dims: distinct, so a pattern that confuses two dims fails to trace.
DIM_SIZES = {"t": 6, "h": 32, "k": 2, "e": 8, "i": 16, "d": 8, "n": 4, "v": 24}


# --- tensor specs in annotations -------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    dims: tuple[str, ...]
    dtype: torch.dtype | None  # None: the rule's activation dtype (a variant axis)

    def __or__(self, other: Any) -> TensorSpec:
        return self  # `Act[H] | None`: optionality comes from the None default

    def example(self, act: torch.dtype) -> torch.Tensor:
        shape = [DIM_SIZES.get(d, 5) for d in self.dims]
        dtype = torch.float32 if self.dtype == "any" else (self.dtype or act)
        if dtype in (torch.int32, torch.int64, torch.uint8):
            return torch.randint(0, DIM_SIZES["e"], shape, dtype=dtype)
        return torch.randn(shape).to(dtype)


@dataclass(frozen=True)
class Dim:
    """A named dimension of a pattern's example tensors."""

    name: str


class _SpecFactory:
    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype

    def __getitem__(self, dims: Dim | tuple[Dim, ...]) -> TensorSpec:
        dims = dims if isinstance(dims, tuple) else (dims,)
        wrong = [d for d in dims if not isinstance(d, Dim)]
        if wrong:
            raise TypeError(
                f"tensor spec dims {wrong!r}: give Dim objects (beamfx.pattern's T, H, K, E, "
                f"I, D, N, or Dim('x')), not {type(wrong[0]).__name__}"
            )
        return TensorSpec(tuple(d.name for d in dims), self.dtype)


# Tokens, hidden, top-k, experts, intermediate, head dim, heads.
T, H, K, E, I, D, N = (Dim(n) for n in "thkeidn")  # noqa: E741
Act = _SpecFactory(None)
F32 = _SpecFactory(torch.float32)
AnyFloat = _SpecFactory("any")  # any floating dtype, not a variant axis (e.g. a weight)
I32 = _SpecFactory(torch.int32)
U8 = _SpecFactory(torch.uint8)  # packed 4-bit codes
FP8 = _SpecFactory(torch.float8_e4m3fn)  # block scales

# Sentinels stand for scalar wildcards while tracing; they must not occur otherwise.
_FLOAT_SENTINELS = [0.0123 + 0.00071 * i for i in range(32)]
_INT_SENTINELS = [7919 + 13 * i for i in range(32)]
_STR_SENTINEL = "__beamfx_{}__"


# --- constraints -----------------------------------------------------------------------


@dataclass(frozen=True)
class Constraint:
    """A named predicate over the matched arguments: `check(args)` is None or why not.
    `args` names the rule parameters it reads, checked when the rule is declared: a name
    the rule lacks is a typo, which would otherwise read as "this variant lacks the
    argument" and let every match through."""

    name: str
    check: Callable[[dict[str, Any]], str | None]
    args: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.args, str):  # one name, not its letters
            object.__setattr__(self, "args", (self.args,))


def _provably(cond) -> bool:
    """A size relation, decided without guards: a symbolic size (a dynamic dim) counts only
    where the shape environment proves it for every size (a rewrite then holds for all)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(cond))


def dtype_in(arg: str, *dtypes: torch.dtype) -> Constraint:
    def check(args):
        dt = args[arg].dtype
        if dt not in dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            return f"{arg} is {str(dt).removeprefix('torch.')}, the kernel takes {names}"
        return None

    return Constraint(f"dtype({arg})", check, (arg,))


def last_dim_at_most(arg: str, limit: int) -> Constraint:
    def check(args):
        n = args[arg].shape[-1]
        return None if _provably(n <= limit) else f"{arg} has last dim {n}, not provably <= {limit}"

    return Constraint(f"size({arg})", check, (arg,))


def same_size(*dims: tuple[str, int]) -> Constraint:
    """The sizes of these (argument, dim) pairs agree, e.g. `same_size(("x", -1), ("w2",
    1))`: a shape relation the rewrite relies on (annotations name dims, they do not check
    them)."""

    def check(args):
        sizes = {f"{a}.shape[{d}]": args[a].shape[d] for a, d in dims}
        first, *rest = sizes.values()
        if all(_provably(first == s) for s in rest):
            return None
        return f"sizes not provably equal: {sizes}"

    name = "same_size(" + ", ".join(f"{a}[{d}]" for a, d in dims) + ")"
    return Constraint(name, check, tuple(a for a, _ in dims))


def shapes_as_annotated(*names: str) -> Constraint:
    """These arguments have the ranks their annotations give, and the dims that annotations
    name alike agree (`x: Act[T, H]`, `residual: Act[T, H]`: the same T and H), decided
    without guards. The matcher sees ops, not shapes: `x * xs + r * rs` with r [1, H] is the
    same graph as with r [T, H], and a kernel that reads r's rows would read past it. Bound
    to the rule's annotations where the rule is declared."""
    return _AnnotatedShapes(f"shapes_as_annotated({', '.join(names)})", _unbound, names)


def _unbound(args):
    raise TypeError("shapes_as_annotated() is bound to a rule's annotations by FusionPass.rule")


@dataclass(frozen=True)
class _AnnotatedShapes(Constraint):
    def bind(self, hints: dict[str, Any], optional: set[str]) -> Constraint:
        specs = {n: hints[n] for n in self.args}
        bad = [n for n, t in specs.items() if not isinstance(t, TensorSpec)]
        if bad:
            raise TypeError(f"{self.name}: {', '.join(bad)} are not tensors (Act[...] etc.)")

        def check(args):
            seen: dict[str, tuple[str, Any]] = {}
            for n, spec in specs.items():
                shape = args[n].shape if args.get(n) is not None else None
                if shape is None:
                    continue  # an absent optional piece
                if len(shape) != len(spec.dims):
                    return f"{n} is {tuple(shape)}, not rank {len(spec.dims)} as {spec.dims}"
                for d, size in zip(spec.dims, shape):
                    if d not in seen:
                        seen[d] = (n, size)
                    elif not _provably(seen[d][1] == size):
                        other, first = seen[d]
                        return (
                            f"dim {d.upper()} is {first} in {other} and {size} in {n}, not "
                            f"provably equal (broadcast or another shape)"
                        )
            return None

        # An absent optional piece is skipped by `check`, not the whole constraint.
        return Constraint(self.name, check, tuple(n for n in self.args if n not in optional))


def same_device(*names: str) -> Constraint:
    def check(args):
        devs = {str(args[n].device) for n in names if args.get(n) is not None}
        return None if len(devs) <= 1 else f"{', '.join(names)} span devices {sorted(devs)}"

    return Constraint("same_device", check)  # reads those present


def kernel_for(op_name: str, *arg_names: str) -> Constraint:
    """A provider of the fused op accepts these arguments on their device.

    On CPU the reference is the kernel (run eagerly, it keeps every rounding); on a GPU
    a fast provider must accept them, or fusing would only add a slow reference call.
    """

    def check(args):
        from beamfx import ops

        opdef = ops.REGISTRY[op_name]
        values = [args.get(n) for n in arg_names]
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        if device.type == "cpu":
            return None
        ops._install_providers()
        reasons = [f"{p.name}: {p.supports(*values)}" for p in opdef.providers]
        if any(p.supports(*values) is None for p in opdef.providers):
            return None
        return f"no {device.type} kernel for {op_name} (" + "; ".join(reasons or ["none"]) + ")"

    return Constraint(f"kernel({op_name})", check)  # reads those present


# --- rules and passes --------------------------------------------------------------------


@dataclass
class Rejection:
    """Why a candidate did not fuse: a failed constraint, or where the pattern diverged."""

    pass_name: str
    rule: str
    node: str
    reason: str
    constraint: str | None = None

    def describe(self) -> str:
        """`node (pass/rule): [constraint] reason`, as reports print it."""
        where = f"[{self.constraint}] " if self.constraint else ""
        return f"{self.node} ({self.pass_name}/{self.rule}): {where}{self.reason}"


@dataclass
class _Variant:
    rule: Rule
    present: tuple[str, ...]  # the optional parameters this variant has
    names: list[str]  # its parameters, in order
    pattern: pm.PatternExpr
    act_dtypes: set[torch.dtype] = field(default_factory=set)  # traced to this same pattern

    @property
    def label(self) -> str:
        return self.rule.name + "".join(f"+{p}" for p in self.present)


@dataclass
class Rule:
    name: str
    search: Callable
    replace: Callable
    constraints: Sequence[Constraint]
    dtypes: Sequence[torch.dtype]
    specs: dict[str, Any]
    variants: list[_Variant] = field(default_factory=list)
    # The replacement hands its float scalars to ops unchanged: traced once per signature
    # with sentinels, not once per value (see `FusionPass.rule`).
    scalars_pass_through: bool = False

    def optional(self) -> list[str]:
        sig = inspect.signature(self.search)
        return [n for n, p in sig.parameters.items() if p.default is None]

    def defaults(self) -> dict[str, Any]:
        sig = inspect.signature(self.search)
        return {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}


class FusionPass:
    """A named graph pass made of rules; runs Inductor's pattern matcher over a graph."""

    def __init__(self, name: str, description: str, anchors: Sequence[Any] = ()):
        self.name = name
        self.description = description
        self.anchor_ops = tuple(anchors)
        self.rules: list[Rule] = []
        self.rejections: list[Rejection] = []
        self._matcher: pm.PatternMatcherPass | None = None

    def rule(
        self,
        replace: Callable,
        constraints: Sequence[Constraint] = (),
        dtypes: Sequence[torch.dtype] = ACTIVATION_DTYPES,
        specs: dict[str, Any] | None = None,
        name: str | None = None,
        scalars_pass_through: bool | None = None,
    ) -> Callable[[Callable], Callable]:
        """Register `search -> replace`. `specs` overrides parameter annotations.

        A replacement function is traced once per distinct value of its float scalars,
        whatever it does with them. `scalars_pass_through=True` says it only hands them to
        ops unchanged (as an op replacement does; the default for one): it is then traced
        once per signature with sentinel values, after a check that those reach the graph
        and that a second trace with probes does no arithmetic on them (where the check
        fails, it is traced per value after all)."""

        def decorator(search: Callable) -> Callable:
            hints = dict(specs) if specs else _annotations(search)
            params = list(inspect.signature(search).parameters)
            for c in constraints:
                unknown = [a for a in c.args if a not in params]
                if unknown:
                    raise ValueError(
                        f"{self.name}: constraint {c.name} of rule {search.__name__} reads "
                        f"{', '.join(map(repr, unknown))}, which is not a parameter of "
                        f"{search.__name__} ({', '.join(params)}); name one of those"
                    )
            optional = {
                n for n, p in inspect.signature(search).parameters.items() if p.default is None
            }
            bound = [
                c.bind(hints, optional) if isinstance(c, _AnnotatedShapes) else c
                for c in constraints
            ]
            replacement = _as_op(replace)
            through = scalars_pass_through
            if through is None:
                through = isinstance(
                    replacement, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
                )
            rule = Rule(name or search.__name__, search, replacement, bound, dtypes, hints,
                        scalars_pass_through=bool(through))  # fmt: skip
            self.rules.append(rule)
            self._matcher = None
            return search

        return decorator

    # --- registration with Inductor -------------------------------------------------------

    def matcher(self) -> pm.PatternMatcherPass:
        if self._matcher is None:
            matcher = pm.PatternMatcherPass(pass_name=f"beamfx.{self.name}")
            graphs = pattern_cache.open_cache(self.name)
            for rule in self.rules:
                rule.variants = list(_trace_variants(rule, graphs))
            graphs.save()
            # The largest pattern wins: a node is offered to the variants that cover the
            # most ops first (with the all-reduce and finalize before without them).
            variants = [v for rule in self.rules for v in rule.variants]
            variants.sort(key=lambda v: -_size(v.pattern))
            for v in variants:
                self._register(v, matcher)
            # Per variant (in registration order), the target sets of its ops: a graph
            # must hold a node of each set for the variant to match there.
            self._variant_ops = [(v, _op_sets(v.pattern)) for v in variants]
            self._sub_matchers = {}
            self._matcher = matcher
        return self._matcher

    def _register(self, v: _Variant, matcher: pm.PatternMatcherPass) -> None:
        replace = _positional(v.rule.replace, v.names, v.present, v.rule)
        pm.register_graph_pattern(v.pattern, extra_check=self._checker(v), pass_dict=matcher)(
            _replacer(
                replace,
                v.names,
                v.rule.specs,
                f"pass {self.name}, rule {v.rule.name}",
                v.rule.scalars_pass_through,
            )  # fmt: skip
        )

    def _checker(self, variant: _Variant) -> Callable[[pm.Match], bool]:
        scalars = {n: t for n, t in variant.rule.specs.items() if t in (float, int, bool, str)}
        tensor_specs = {
            n: t
            for n, t in variant.rule.specs.items()
            if isinstance(t, TensorSpec) and n in variant.names
        }

        covered = _pattern_kwargs(variant.pattern)

        def reject(match: pm.Match, why: str, what: str) -> bool:
            node = match.output_nodes()[0]
            self.rejections.append(Rejection(self.name, variant.label, node.name, why, what))
            return False

        def check(match: pm.Match) -> bool:
            # Inductor's matcher ignores a node's keyword arguments that the pattern does not
            # name (`add(a, b, alpha=2)` matches `add(a, b)`): one off its schema's default
            # computes something else, so the match is refused.
            for node in match.nodes:
                extra = _uncovered_kwargs(node, covered)
                if extra:
                    why = f"{node.name} has keyword arguments the pattern does not cover: {extra}"
                    return reject(match, why, "keyword arguments")
            # A scalar wildcard binds constants only: a tensor there is another computation.
            for n, t in scalars.items():
                if n not in match.kwargs:
                    continue
                v = match.kwargs[n]
                if isinstance(v, torch.fx.Node):
                    why = (f"{n} is computed in the graph ({v.name}); the rule's {n}: "
                           f"{t.__name__} binds a constant")  # fmt: skip
                    return reject(match, why, "scalar")
                if not _is(v, t):
                    why = f"{n} is {v!r}; the rule's {n}: {t.__name__} binds a {t.__name__}"
                    return reject(match, why, "scalar")
            # Dtypes are part of a variant: the fp32 variant of a pattern that has no casts
            # must not claim the same ops computed in bf16.
            acts = {}
            for n, spec in tensor_specs.items():
                node = match.kwargs.get(n)
                if node is None:
                    continue  # an optional piece this variant lacks
                # A tensor wildcard binds tensors only: a number (a literal, or a dynamic size
                # as a SymInt) where the pattern multiplies by a tensor is another computation.
                val = node.meta.get("val") if isinstance(node, torch.fx.Node) else node
                if val is None:
                    continue
                if not isinstance(val, torch.Tensor):
                    return reject(match, f"{n} is a {type(val).__name__}, not a tensor", "tensor")
                if spec.dtype is None:
                    acts[n] = val.dtype
                elif spec.dtype == "any":
                    if not val.dtype.is_floating_point:
                        return reject(match, f"{n} is {val.dtype}, not a float", "dtype")
                elif val.dtype != spec.dtype:
                    why = f"{n} is {val.dtype}; the rule needs {spec.dtype}"
                    return reject(match, why, "dtype")
            found = ", ".join(f"{n} {d}" for n, d in acts.items())
            if len(set(acts.values())) > 1:
                return reject(match, f"activations of more than one dtype: {found}", "dtype")
            if not set(acts.values()) <= set(variant.rule.dtypes):
                traced = ", ".join(str(d) for d in variant.rule.dtypes)
                why = f"activations {found}: the rule is traced for {traced} only"
                return reject(match, why, "dtype")
            if not set(acts.values()) <= variant.act_dtypes:
                return False  # another variant of the rule covers this dtype
            args = {
                k: (v.meta.get("val") if isinstance(v, torch.fx.Node) else v)
                for k, v in match.kwargs.items()
            }
            for c in variant.rule.constraints:
                if any(args.get(a) is None for a in c.args):
                    continue  # this variant lacks (or has None for) an argument it reads
                try:
                    why = c.check(args)
                except Exception as e:  # a constraint that cannot decide proves nothing
                    why = f"the constraint raised {type(e).__name__}: {e}"
                if why is not None:
                    return reject(match, why, c.name)
            return True

        return check

    # --- running --------------------------------------------------------------------------

    def __call__(self, graph: torch.fx.Graph) -> int:
        return self.apply(graph)

    def apply(self, graph: torch.fx.Graph) -> int:
        """Rewrite every match in `graph`; return the number of matches replaced."""
        self.rejections = []
        matcher = self._matcher_for(graph)
        if matcher is None:
            return 0
        return run_matcher(matcher, graph)  # the rewrites remove what they leave dead

    def _matcher_for(self, graph: torch.fx.Graph) -> pm.PatternMatcherPass | None:
        """The matcher over the variants that can match in `graph`: those whose every op,
        and every edge between two of them, occurs there. Inductor's matcher offers each
        node of an anchor op to every pattern rooted there (type-checking the node first),
        so variants that cannot match still cost a scan; the filtered matchers are kept
        per set of variants."""
        full = self.matcher()
        index = _GraphIndex(graph)
        live = tuple(i for i, (v, ops_) in enumerate(self._variant_ops) if index.can_match(ops_))
        if not live:
            return None
        if len(live) == len(self._variant_ops):
            return full
        if live not in self._sub_matchers:
            matcher = pm.PatternMatcherPass(pass_name=f"beamfx.{self.name}")
            for i in live:
                self._register(self._variant_ops[i][0], matcher)
            self._sub_matchers[live] = matcher
        return self._sub_matchers[live]

    def anchors(self) -> set[Any]:
        """The ops `explain` reports on: declared, else the roots of the rules' patterns."""
        self.matcher()
        if self.anchor_ops:
            return set(self.anchor_ops)
        return {_root_target(v.pattern) for r in self.rules for v in r.variants}

    def explain(self, graph: torch.fx.Graph) -> list[Rejection]:
        """Why each remaining candidate (a node of an anchor op) did not fuse.

        A failed constraint is reported as recorded during matching (the largest variant
        that reached it); otherwise the pattern matcher's own account of where the
        closest variant diverged from the graph.
        """
        anchors = self.anchors()
        out: list[Rejection] = []
        alive = {n.name for n in graph.nodes}  # a node another variant fused is gone
        for r in self.rejections:
            if r.node in alive and r.node not in {o.node for o in out}:
                out.append(r)
        done = {r.node for r in out}
        for node in graph.nodes:
            if node.op != "call_function" or node.target not in anchors or node.name in done:
                continue
            fails = []
            for rule in self.rules:
                for v in rule.variants:
                    root = _root_pattern(v.pattern)
                    for cand in _near(node, getattr(root, "fns", ())):
                        result = root.match(cand)
                        if not pm.is_match(result):
                            fails.append(f"{v.label}: {result}")
            if fails:
                fails.sort(key=len)
                out.append(Rejection(self.name, "*", node.name, "pattern diverged: " + fails[0]))
        return out

    def source_hash(self) -> str:
        """Hash of the code of every rule, replacement and constraint, with the values they
        close over (part of the compile cache key: a pass built by a factory, say
        `last_dim_at_most("x", limit)`, must key each limit apart)."""
        h = hashlib.sha256(self.name.encode())
        h.update(repr(sorted(map(str, self.anchor_ops))).encode())
        for rule in self.rules:
            # The specs set the traced shapes and dtypes (and so what matches), whether
            # annotations or a `specs=` override gave them.
            h.update(f"{rule.name}:{sorted((k, repr(v)) for k, v in rule.specs.items())}".encode())
            h.update(f"pass-through:{rule.scalars_pass_through}".encode())
            for fn in (rule.search, rule.replace):
                try:
                    h.update(inspect.getsource(inspect.getmodule(fn)).encode())
                except (OSError, TypeError):
                    h.update(fn.__qualname__.encode())
                h.update(_identity(fn).encode())
            for c in rule.constraints:
                h.update(f"{c.name}:{_identity(c.check)}".encode())
            h.update(repr([str(d) for d in rule.dtypes]).encode())
        return h.hexdigest()


# What `run_matcher` takes from Inductor's pattern matcher module.
_MATCHER_HELPERS = (
    "should_compute_mutation_region_ids",
    "compute_mutation_region_ids",
    "get_mutation_region_id",
    "is_mutation_op",
    "is_match",
    "counters",
)


def run_matcher(matcher: pm.PatternMatcherPass, graph: torch.fx.Graph) -> int:
    """`matcher.apply(graph)` (Inductor's `PatternMatcherPass.apply`), with each candidate
    node matched before Inductor's backend type check instead of after it.

    Inductor type-checks every node of a pattern's root op (its inputs' and outputs' fake
    tensors: complex, sparse, fp8 support) before trying a pattern there; a pattern
    rooted at a common op (a `mul`) pays that on every `mul` of the graph, about a fifth
    of beamfx's pass time. Here the check runs on matched nodes only, so the same
    rewrites happen: the same candidates in the same order, the same mutation-region and
    stream guards, the same `extra_check`. Mutation regions are recomputed where a rewrite
    erased or spliced in a mutating op (beamfx's replacements are functional: never, so
    far). Inductor's own loop runs instead for call-module patterns, under
    `TORCHINDUCTOR_PATTERN_MATCH_DEBUG` (its per-pattern debug counters), and on a torch
    whose matcher lacks a helper this loop uses.
    """
    if not matcher.patterns:
        return 0
    try:
        from torch._inductor.lowering import (
            fallback_node_due_to_unsupported_type as unsupported_type,
        )
        from torch.fx.experimental.symbolic_shapes import guard_or_false
        from torch.fx.passes.graph_transform_observer import GraphTransformObserver

        helpers = all(hasattr(pm, name) for name in _MATCHER_HELPERS)
    except ImportError:
        helpers = False
    if (
        not helpers
        or any(op == "call_module" for op, _ in matcher.patterns)
        or os.environ.get("TORCHINDUCTOR_PATTERN_MATCH_DEBUG")
    ):
        return matcher.apply(graph)

    if pm.should_compute_mutation_region_ids(graph):
        pm.compute_mutation_region_ids(graph)
    nodes = [graph.find_nodes(op=op, target=t, sort=False) for op, t in matcher.patterns]
    count = 0
    observe = GraphTransformObserver(graph.owning_module, matcher.pass_name or "pattern_matcher")
    with observe if graph.owning_module is not None else nullcontext():
        for node in sorted(itertools.chain.from_iterable(nodes), reverse=True):
            unsupported = None  # Inductor's type check, once, on the first match
            inputs = None
            for entry in matcher.patterns[(node.op, node.target)]:
                if node._erased:
                    break
                needs = _input_ops(entry.pattern)
                if needs:
                    inputs = inputs or {i.target for i in node.all_input_nodes}
                    if not all(inputs & fns for fns in needs):
                        continue  # an input op the pattern's root needs is missing
                m = entry.pattern.match(node)
                if not pm.is_match(m):
                    continue
                if unsupported is None:
                    unsupported = unsupported_type(node, allow_cpu_inputs=False)
                if unsupported:
                    break  # Inductor skips the node before any pattern
                if len({pm.get_mutation_region_id(graph, n) for n in m.nodes}) != 1:
                    continue  # the match crosses a mutation
                if len({n.meta.get("custom", {}).get("stream", 0) for n in m.nodes}) != 1:
                    continue  # or a stream boundary
                if not guard_or_false(entry.extra_check(m)):
                    continue
                erases_mutation = any(pm.is_mutation_op(n) for n in m.nodes)
                spliced = INLINER.mutating_splices
                entry.apply(m, graph, node)
                if erases_mutation or INLINER.mutating_splices != spliced:
                    pm.compute_mutation_region_ids(graph)
                count += 1
                counters = pm.counters[getattr(pm, "backend", "inductor")]
                counters["pattern_matcher_count"] += 1
                counters["pattern_matcher_nodes"] += len(m.nodes)
    return count


# --- internals ---------------------------------------------------------------------------


_INPUT_OPS: dict[int, tuple[pm.PatternExpr, tuple[frozenset, ...]]] = {}


def _input_ops(pattern: pm.PatternExpr) -> tuple[frozenset, ...]:
    """The ops a candidate's direct inputs must include for `pattern` to match there: one
    target set per call pattern among the root's arguments (a necessary condition, far
    cheaper to test than Inductor's matcher, which flattens the node's arguments)."""
    hit = _INPUT_OPS.get(id(pattern))
    if hit is None or hit[0] is not pattern:
        root = pattern.outputs[0] if isinstance(pattern, pm.MultiOutputPattern) else pattern
        children = pm.pytree.tree_leaves((getattr(root, "args", ()), getattr(root, "kwargs", {})))
        needs = tuple(
            frozenset(c.fns)
            for c in children
            if isinstance(c, pm.CallFunction) and c.op == "call_function"
        )
        hit = _INPUT_OPS[id(pattern)] = (pattern, needs)
    return hit[1]


class Inliner:
    """Replacement graphs traced once per signature and reused, with scalars substituted.

    Inductor's `replace_by_example` traces the replacement at every match; an 80-layer
    model has hundreds of matches of a few signatures. Here the replacement is traced
    once per (tensor metadata, fake mode) with sentinel scalars, and each use copies the
    graph with the match's scalars put in place of the sentinels.
    """

    MAX_ENTRIES = 512

    def __init__(self) -> None:
        # key -> (the fake mode it was traced in, graph); a graph's fake tensors belong to
        # its mode, so an entry serves only graphs of the same mode (vLLM's pieces share one).
        self._cache: dict[Any, tuple[Any, torch.fx.GraphModule]] = {}
        # Signatures whose replacement computes on its scalars: traced per value.
        self._computes_on_scalars: set[Any] = set()
        self._other_sentinels: dict[Any, bool] = {}
        # Replacements spliced in that hold a mutating op (`run_matcher` then recomputes
        # the graph's mutation regions).
        self.mutating_splices = 0

    def clear(self) -> None:
        self._cache.clear()
        self._computes_on_scalars.clear()
        self._other_sentinels.clear()

    def _passes_scalars_through(self, fn, mode, gm, traced, values, sentinels) -> bool:
        """Whether the replacement `gm` (traced with sentinel scalars) serves every value:
        each sentinel reaches the graph (else a scalar is used in Python only: a branch, a
        derived constant), and a trace with other sentinels, each a float that records any
        arithmetic or comparison on it, is the same graph and did none."""
        if not _sentinels_reach(gm, sentinels):
            return False
        # Asked once per signature (tensor metadata too: a replacement may compute on a
        # scalar at some shapes only), whatever the fake mode (one per graph outside vLLM).
        signature = (fn, tuple(values))
        if signature not in self._other_sentinels:
            self._other_sentinels[signature] = _same_for_other_sentinels(fn, mode, gm, traced,
                                                                         sentinels)  # fmt: skip
        return self._other_sentinels[signature]

    def replace(self, match: pm.Match, fn: Callable, args: list[Any], specs: dict[str, Any],
                names: list[str], label: str = "a replacement",
                pass_through: bool = False) -> None:  # fmt: skip
        from torch._inductor.virtualized import V

        sentinels, values, traced = {}, [], []
        floats = iter(_FLOAT_SENTINELS)
        for name, a in zip(names, args):
            if isinstance(a, torch.fx.Node):
                traced.append(a.meta["val"])
                values.append(("t", _meta_key(a.meta["val"])))
                continue
            kind = specs.get(name)
            # Floats only carry values; ints and bools can set shapes (top-k, group counts)
            # and a string is compared more than computed on (a group name, a mode), so
            # those are traced as they are and key the cache.
            # (A float wildcard may hold an int literal: traced as it is, an int.)
            s = next(floats) if kind is float and type(a) is float and pass_through else None
            if s is None or isinstance(a, bool) or a is None:
                traced.append(a)
                values.append(_value_key(a))
            else:
                sentinels[s] = a
                traced.append(s)
                values.append(("s", kind.__name__))
        mode = V.fake_mode
        if not isinstance(mode, torch._subclasses.FakeTensorMode):
            # Outside Inductor (a graph traced by hand): the inputs' own fake mode, if any.
            mode = torch._guards.detect_fake_mode(traced)
        key = (fn, id(mode), tuple(values))
        if key in self._computes_on_scalars:
            key, traced, sentinels = _by_value(fn, mode, values, traced, sentinels)
        owner, gm = self._cache.get(key, (None, None))
        if gm is None or owner is not mode:
            try:
                gm = _trace_replacement(fn, mode, traced)
            except Exception:
                if not sentinels:
                    raise
                gm = None  # it refused a sentinel (a check, a math domain): per value
            if sentinels and (
                gm is None
                or not self._passes_scalars_through(fn, mode, gm, traced, values, sentinels)
            ):
                # The replacement computes on a scalar (`1 / s`, `s if s > 0 else ...`)
                # rather than passing it to ops: its graph holds for the sentinel only.
                # Traced with the match's own values, keyed on them.
                self._computes_on_scalars.add(key)
                key, traced, sentinels = _by_value(fn, mode, values, traced, sentinels)
                gm = _trace_replacement(fn, mode, traced)
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            self._cache[key] = (mode, gm)
        _check_replacement(match, gm, label)
        if _mutates(gm):
            self.mutating_splices += 1
        _splice(match, gm, args, sentinels)


def _trace_replacement(fn: Callable, mode: Any, inputs: list[Any]) -> torch.fx.GraphModule:
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # Only the graph is read (copied in): lazy modules skip generating Python code.
    with mode or nullcontext(), _use_lazy_graph_module(True):
        return pm.fwd_only(fn, inputs)


# A second set of sentinels, of the other sign (so that math.sqrt and its kin, which read
# the double without a dunder, fail or give another constant): a replacement traced with
# both gives one graph, up to the sentinels, only if it passes its scalars to ops unchanged.
_ALT_FLOAT = {f: -3.17 - 0.011 * i for i, f in enumerate(_FLOAT_SENTINELS)}


class _Probe(float):
    """A float that records arithmetic and comparisons on it (`1 / s`, `min(s, 1.0)`,
    `if s > 1`): ops take its value without calling any of them."""

    __hash__ = float.__hash__
    used: list[str] = []


def _recording(name: str):
    method = getattr(float, name)

    def call(self, *args):
        _Probe.used.append(name)
        return method(float(self), *args)

    return call


for _name in (
    "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__bool__", "__add__",
    "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
    "__neg__", "__pos__", "__abs__", "__int__", "__round__", "__trunc__", "__floor__",
    "__ceil__", "__divmod__", "__rdivmod__",
):  # fmt: skip
    setattr(_Probe, _name, _recording(_name))


def _same_for_other_sentinels(fn, mode, gm, traced, sentinels) -> bool:
    probes = [_Probe(_ALT_FLOAT[a]) if _is_sentinel(a, sentinels) else a for a in traced]
    _Probe.used = []
    try:
        other = _trace_replacement(fn, mode, probes)
    except Exception:  # e.g. math.sqrt of the negative sentinel
        return False
    if _Probe.used:
        return False
    return _same_graph(gm, other, sentinels)


def _sentinels_reach(gm: torch.fx.GraphModule, sentinels: dict[Any, Any]) -> bool:
    found = {
        a
        for n in gm.graph.nodes
        for a in pm.pytree.tree_leaves((n.args, n.kwargs), is_leaf=_is_node)
        if _is_sentinel(a, sentinels)
    }
    return len(found) == len(sentinels)


def _is_sentinel(a: Any, sentinels: dict[Any, Any]) -> bool:
    return isinstance(a, float) and a in sentinels


def _value_key(a: Any) -> tuple:
    """A scalar as a cache key, by type and repr: 0.0 == -0.0 and 1 == 1.0, but a replacement
    computing 1 / s tells them apart."""
    return ("v", type(a).__name__, repr(a))


def _by_value(fn, mode, values, traced, sentinels):
    """The cache key and inputs of a replacement traced with the match's own scalars."""
    real = [sentinels[a] if _is_sentinel(a, sentinels) else a for a in traced]
    keyed = [_value_key(r) if v[0] == "s" else v for v, r in zip(values, real)]
    return (fn, id(mode), tuple(keyed)), real, {}


def _same_graph(a: torch.fx.GraphModule, b: torch.fx.GraphModule, sentinels: dict) -> bool:
    """Whether `a` (traced with `sentinels`) and `b` (with their `_alt`s) are one graph up to
    the sentinels: same nodes, targets and arguments, each sentinel where the other's is."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    if len(na) != len(nb):
        return False
    ia, ib = {n: i for i, n in enumerate(na)}, {n: i for i, n in enumerate(nb)}
    names = {s: i for i, s in enumerate(sentinels)}
    alts = {_ALT_FLOAT[s]: i for s, i in names.items()}

    def norm(x: Any, index: dict, marks: dict) -> Any:
        if isinstance(x, torch.fx.Node):
            return ("node", index[x])
        if isinstance(x, float) and x in marks:
            return ("scalar", marks[x])
        return x

    for x, y in zip(na, nb):
        if (x.op, x.target) != (y.op, y.target):
            return False
        args_x = pm.pytree.tree_map(lambda v: norm(v, ia, names), (x.args, x.kwargs),
                                    is_leaf=_is_node)  # fmt: skip
        args_y = pm.pytree.tree_map(lambda v: norm(v, ib, alts), (y.args, y.kwargs),
                                    is_leaf=_is_node)  # fmt: skip
        # An attribute (a constant, a higher-order op's subgraph) may hold a scalar where
        # the arguments cannot show it: not proven the same, so traced per value.
        if args_x != args_y or x.op == "get_attr":
            return False
    return True


# Metadata a new output node takes from the node it replaces (as Inductor's replacement).
_COPY_META = (*getattr(torch.fx.proxy, "_COPY_META_FIELDS", ()), "stack_trace")
# And a copied node from the traced replacement node: the same, its fake value, and the
# eager input values Inductor reads for custom ops' strides.
_TRACED_META = (*_COPY_META, "val", "tensor_meta", "eager_input_vals")


def _splice(
    match: pm.Match, gm: torch.fx.GraphModule, args: list[Any], sentinels: dict[Any, Any]
) -> None:
    """Put the traced replacement `gm` in place of `match`, its sentinel scalars replaced by
    `sentinels`' values, as Inductor's `Match.replace_with_graph` does, without its
    per-node interpreter and its scan of the whole graph for the first output of a
    multi-output match (nodes compare by position): the replacement's nodes are copied
    with their traced metadata (and the match's scalars) before the match's first output,
    the outputs' users moved to the copies, the matched nodes erased. Replacements beyond
    plain calls, and activation-checkpoint tags, go to Inductor's."""
    outputs = match.output_nodes()
    old = [o for o in outputs if o is not None]
    if any(n.op not in ("placeholder", "call_function", "output") for n in gm.graph.nodes) or any(
        "recompute" in o.meta or "ac_graph_id" in o.meta for o in old
    ):
        with _substituted(gm, sentinels) as replacement:
            match.replace_with_graph(replacement, args)
        return
    graph = match.graph
    env: dict[torch.fx.Node, Any] = {}

    def value(a: Any) -> Any:  # an argument of a replacement node, in the graph
        return env[a] if isinstance(a, torch.fx.Node) else _unsentinel(a, sentinels)

    supplied = iter(args)
    added: dict[torch.fx.Node, None] = {}
    result: Any = None
    anchor = _first(graph, old)
    # An input of the match made after its first output (a weight computed late): the
    # copies read it before it is defined until the graph is sorted again, below.
    inputs: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, inputs.append)
    late = any(_first(graph, [anchor, a]) is anchor for a in inputs)
    with graph.inserting_before(anchor):
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(supplied)
            elif n.op == "call_function":
                new_args, new_kwargs = torch.fx.node.map_aggregate((n.args, n.kwargs), value)
                new = graph.call_function(n.target, new_args, new_kwargs)
                new.meta.update((k, v) for k, v in n.meta.items() if k in _TRACED_META)
                env[n] = added[new] = new
            else:
                result = torch.fx.node.map_aggregate(n.args[0], value)

    def outside(user: torch.fx.Node) -> bool:
        return user not in added

    def replace(o: torch.fx.Node | None, new: Any) -> None:
        if o is None:
            return
        if isinstance(new, (list, tuple)):
            # One node of a multi-output op, replaced by several: its getitem users take
            # the matching one.
            for user in list(o.users):
                if user.target is operator.getitem and len(user.args) == 2:
                    replace(user, new[user.args[1]])
                else:
                    user.replace_input_with(o, new)
        else:
            if isinstance(new, torch.fx.Node):
                new.meta.update((k, v) for k, v in o.meta.items() if k in _COPY_META)
                for key in ("val", "tensor_meta"):
                    if key not in new.meta and key in o.meta:
                        new.meta[key] = o.meta[key]
            o.replace_all_uses_with(new, delete_user_cb=outside)
        if not o.users:
            graph.erase_node(o)

    values = list(result) if isinstance(result, (list, tuple)) else [result]
    if len(outputs) == len(values):
        for o, new in zip(outputs, values):
            replace(o, new)
    else:
        replace(outputs[0], values)
    match.erase_nodes()
    for n in reversed(added):
        if not n.users and not n.is_impure():
            graph.erase_node(n)
    if late:
        pm.stable_topological_sort(graph)


def _first(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> torch.fx.Node:
    """The earliest of `nodes` in `graph`: fx nodes compare by position (their sort key);
    a torch whose nodes do not is answered by a walk of the graph."""
    try:
        return min(nodes)
    except TypeError:
        wanted = set(nodes)
        return next(n for n in graph.nodes if n in wanted)


def _meta_key(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return (str(val.dtype), str(val.device), tuple(map(str, val.shape)),
                tuple(map(str, val.stride())))  # fmt: skip
    return repr(val)


@contextmanager
def _substituted(gm: torch.fx.GraphModule, sentinels: dict[Any, Any]):
    """`gm` with sentinel constants replaced by the match's values, for the block's length.

    Inductor's `replace_with_graph` interprets the replacement node by node, so editing
    arguments in place (and restoring them) avoids building and recompiling a graph
    module per match.
    """

    def sub(a):
        return _unsentinel(a, sentinels)

    saved = []
    for node in _sentinel_nodes(gm) if sentinels else ():
        args = pm.pytree.tree_map(sub, node.args, is_leaf=_is_node)
        kwargs = pm.pytree.tree_map(sub, node.kwargs, is_leaf=_is_node)
        if args != node.args or kwargs != node.kwargs:
            saved.append((node, node.args, node.kwargs))
            node.args, node.kwargs = args, kwargs
    try:
        yield gm
    finally:
        for node, args, kwargs in saved:
            node.args, node.kwargs = args, kwargs


def _unsentinel(a: Any, sentinels: dict[Any, Any]) -> Any:
    """A replacement's argument with a sentinel scalar (a float) put back to the match's
    value."""
    return sentinels.get(a, a) if isinstance(a, float) else a


def _is_node(a: Any) -> bool:
    return isinstance(a, torch.fx.Node)


_SENTINEL_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MUTATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mutates(gm: torch.fx.GraphModule) -> bool:
    if gm not in _MUTATES:
        _MUTATES[gm] = any(pm.is_mutation_op(n) for n in gm.graph.nodes if n.op == "call_function")
    return _MUTATES[gm]


def _sentinel_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes of a cached replacement whose arguments hold a float constant (the only
    places a sentinel can sit), found once per graph."""
    found = _SENTINEL_NODES.get(gm)
    if found is None:
        found = [
            n
            for n in gm.graph.nodes
            if any(
                isinstance(a, float)
                for a in pm.pytree.tree_leaves((n.args, n.kwargs), is_leaf=_is_node)
            )
        ]
        _SENTINEL_NODES[gm] = found
    return found


INLINER = Inliner()


def _replacer(replace: Callable, names: list[str], specs: dict[str, Any], label: str,
              pass_through: bool) -> Callable:  # fmt: skip
    def handler(match: pm.Match, *args: Any, **kwargs: Any) -> None:
        INLINER.replace(match, replace, [kwargs[n] for n in names], specs, names, label,
                        pass_through)  # fmt: skip

    return handler


def _check_replacement(match: pm.Match, gm: torch.fx.GraphModule, label: str) -> None:
    """The traced replacement returns what the matched nodes did: as many tensors, each of
    the same dtype and rank and no size provably different. Otherwise the code after the
    match would read values of another shape or type (or None) without an error."""
    (out,) = gm.graph.find_nodes(op="output")
    if any(
        isinstance(getattr(gm, n.target, None), torch.Tensor)
        for n in gm.graph.find_nodes(op="get_attr")
    ):  # a higher-order op's subgraph is a get_attr too, and Inductor splices those
        raise TypeError(
            f"{label}: the replacement makes a tensor constant (torch.tensor(...) of a value), "
            "which Inductor cannot splice into a graph: pass scalars to ops (x * s), or "
            "make the tensor with torch.full(..., s) inside the replacement"
        )

    def vals(xs) -> list[Any]:
        return [x.meta.get("val") if isinstance(x, torch.fx.Node) else x for x in _leaves(xs)]

    def show(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
        return repr(v)

    old = vals([o for o in match.output_nodes() if o is not None])
    new = vals(out.args[0])
    if not all(isinstance(v, torch.Tensor) for v in old):
        return  # the matched values are not all known: nothing to hold the replacement to

    def differ(a: Any, b: torch.Tensor) -> bool:
        if not isinstance(a, torch.Tensor) or a.dtype != b.dtype or a.dim() != b.dim():
            return True
        return any(_provably(x != y) for x, y in zip(a.shape, b.shape))

    if len(new) != len(old) or any(differ(a, b) for a, b in zip(new, old)):
        raise TypeError(
            f"{label}: the replacement returns ({', '.join(map(show, new)) or 'nothing'}) "
            f"where the pattern gives ({', '.join(map(show, old))}); a replacement must "
            "return what its pattern returns, in the same shapes and dtypes"
        )


def _annotations(fn: Callable) -> dict[str, Any]:
    hints = typing.get_type_hints(fn, include_extras=True)
    out = {}
    for name in inspect.signature(fn).parameters:
        hint = hints.get(name)
        args = typing.get_args(hint)
        if args and type(None) in args:  # `X | None`
            hint = next(a for a in args if a is not type(None))
        if hint is None:
            raise TypeError(
                f"pattern {fn.__qualname__}: parameter {name!r} needs an annotation "
                f"(Act[T, H], F32[...], I32[...], float, int, bool or str)"
            )
        out[name] = hint
    return out


def _positional(fn: Callable, names: list[str], present: tuple[str, ...], rule: Rule):
    """`fn` called with `names` positionally; absent optionals as None, others defaulted."""
    fixed = {n: None for n in rule.optional() if n not in present}
    defaults = rule.defaults()
    params = _params(fn)

    def call(*args):
        kwargs = {**defaults, **fixed, **dict(zip(names, args))}
        return fn(**{k: v for k, v in kwargs.items() if k in params})

    call.__signature__ = inspect.Signature(
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    )
    call.__name__ = call.__qualname__ = f"{fn.__name__}__{'_'.join(present) or 'base'}"
    return call


def _as_op(fn: Callable) -> Callable:
    """torch.library.custom_op's object as its op (`torch.ops.ns.name`), which the matcher
    calls, keys and copies as any registered op; anything else as it is."""
    qualname = getattr(fn, "_qualname", None)
    if isinstance(qualname, str) and hasattr(fn, "_init_fn"):
        namespace, name = qualname.split("::")
        return getattr(getattr(torch.ops, namespace), name)
    return fn


def _leaves(xs: Any) -> list[Any]:
    """The values of a (nested) output, Nones left out."""
    return [x for x in torch.utils._pytree.tree_leaves(xs) if x is not None]


def _returning(fn: Callable, rule: Rule) -> Callable:
    """`fn`, refusing to give nothing (the matcher's tracer fails on it, naming no rule)."""

    def call(*args):
        out = fn(*args)
        if not _leaves(out):
            raise TypeError(
                f"pattern {rule.name} returns nothing: return the tensor(s) it computes, "
                "the values its replacement stands for"
            )
        return out

    call.__signature__ = fn.__signature__
    call.__name__ = call.__qualname__ = fn.__name__
    return call


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (float, int)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _params(fn: Callable) -> set[str]:
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return {a.name for a in fn.default._schema.arguments}
    return set(inspect.signature(fn).parameters)


def _trace_variants(rule: Rule, graphs: pattern_cache.GraphCache):
    """Trace every (optional pieces present) x (activation dtype) variant of a rule."""
    optional = rule.optional()
    seen: set[str] = set()
    read: set[str] = set()
    for k in range(len(optional) + 1):
        for present in itertools.combinations(optional, k):
            by_pattern: dict[str, _Variant] = {}
            for act in rule.dtypes:
                v = _trace_one(rule, present, act, graphs)
                read.update(v.names)
                key = str(v.pattern)
                if key in by_pattern:
                    by_pattern[key].act_dtypes.add(act)
                elif key not in seen:
                    seen.add(key)
                    v.act_dtypes.add(act)
                    by_pattern[key] = v
            yield from by_pattern.values()
    unread = [n for n, t in rule.specs.items() if t in (bool, int, float, str) and n not in read]
    if unread:
        # Its value never reaches the graph: an argument equal to the op's default (a bool
        # traced as True where True is the default) is left out of the trace, and a match
        # would then ignore the argument.
        raise TypeError(
            f"pattern {rule.name}: parameter(s) {', '.join(unread)} never reach the traced "
            "graph (an argument equal to the op's default is left out of a trace, and bools "
            "are traced as True): write the value into the pattern, one rule per value"
        )


def _trace_one(
    rule: Rule, present: tuple[str, ...], act: torch.dtype, graphs: pattern_cache.GraphCache
) -> _Variant:
    absent = set(rule.optional()) - set(present)
    names = [n for n in inspect.signature(rule.search).parameters if n not in absent]
    examples, sentinels, strings = [], {}, {}
    floats, ints = iter(_FLOAT_SENTINELS), iter(_INT_SENTINELS)
    for n in names:
        spec = rule.specs[n]
        if isinstance(spec, TensorSpec):
            examples.append(spec.example(act))
        elif spec is bool:
            examples.append(True)
            sentinels[n] = True
        elif spec is float:
            sentinels[n] = next(floats)
            examples.append(sentinels[n])
        elif spec is int:
            sentinels[n] = next(ints)
            examples.append(sentinels[n])
        elif spec is str:
            strings[_STR_SENTINEL.format(n)] = n
            examples.append(_STR_SENTINEL.format(n))
        else:
            raise TypeError(
                f"pattern {rule.name}: parameter {n!r} has unsupported spec {spec!r}: annotate "
                "it Act[T, H], F32[...], I32[...] (tensors, dims from beamfx.pattern), or float, "
                "int, bool or str"
            )
    key = pattern_cache.entry_key(rule.search, rule.specs, present, act)
    cached = graphs.get(key) if key is not None else None
    if cached is not None:
        names, gm = cached[0], _graph_module(cached[1])
    else:
        try:
            gm = _trace(_returning(_positional(rule.search, names, present, rule), rule),
                        examples)  # fmt: skip
        except Exception as e:
            shown = ", ".join(f"{n}={v!r}" for n, v in sentinels.items() if v is not True)
            raise TypeError(
                f"pattern {rule.name}: tracing it failed ({type(e).__name__}: {e}). It is "
                f"traced on example tensors of its annotated shapes, with its scalars set to "
                f"sentinels ({shown or 'none'}): an int that sets a size (a top-k, a split) "
                "cannot be a wildcard; write the size into the pattern, one rule per value"
            ) from e
        used = _used_names(gm, names, sentinels, strings)
        # Drop parameters this variant never reads (e.g. eps of an absent norm): an unread
        # parameter's placeholder has no users, so erasing it gives the graph a trace
        # without it would give.
        for name, ph in zip(names, gm.graph.find_nodes(op="placeholder")):
            if name not in used:
                gm.graph.erase_node(ph)
        names = used
        if key is not None:
            graphs.put(key, names, gm.graph)
    numeric = {n: v for n, v in sentinels.items() if n in names and v is not True}
    pattern = pm.fx_to_pattern(gm, ignore_types=(), argnames=names, scalar_workaround=numeric)
    bools = {n for n, v in sentinels.items() if n in names and v is True}
    if len(bools) > 1:
        raise TypeError(
            f"pattern {rule.name}: bool parameters {sorted(bools)} are all traced as True and "
            "cannot be told apart in the graph: keep one bool wildcard, write the others "
            "into the pattern (one rule per value)"
        )
    _generalize(pattern, strings, bools)
    return _Variant(rule, present, names, pattern)


def _trace(fn: Callable, examples: list[Any]) -> torch.fx.GraphModule:
    """Trace on fake tensors: ops run their fake impls (collectives need no process group)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    # Only the graph is read (to a pattern): lazy modules skip generating Python code.
    with FakeTensorMode() as mode, _use_lazy_graph_module(True):
        fakes = [mode.from_tensor(e) if isinstance(e, torch.Tensor) else e for e in examples]
        gm = pm.fwd_only(fn, fakes)
    # Inductor turns views into reshapes before post-grad custom passes run; so do we.
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    return gm


def _graph_module(graph: torch.fx.Graph) -> torch.fx.GraphModule:
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

    with _use_lazy_graph_module(True):
        return _make_graph_module(torch.nn.Module(), graph)


def _used_names(gm, names, sentinels, strings) -> list[str]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    used = set()
    for name, ph in zip(names, placeholders):
        if ph.users:
            used.add(name)
    consts = set()
    for node in gm.graph.nodes:
        for a in pm.pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, (int, float, str)) and not isinstance(a, torch.fx.Node):
                consts.add((type(a), a))
    for n, v in sentinels.items():
        if (type(v), v) in consts:
            used.add(n)
    for s, n in strings.items():
        if (str, s) in consts:
            used.add(n)
    return [n for n in names if n in used]


def _generalize(pattern: pm.PatternExpr, strings: dict[str, str], bools: set[str]) -> None:
    """Turn string (and bool) sentinels left as literals into wildcards, in place."""
    if not strings and not bools:
        return
    bool_name = next(iter(bools), None)
    seen: set[int] = set()

    def sub(a):
        if isinstance(a, str) and a in strings:
            return pm.KeywordArg(strings[a])
        if bool_name is not None and a is True:
            return pm.KeywordArg(bool_name)
        if isinstance(a, (list, tuple)):
            return type(a)(sub(x) for x in a)
        walk(a)
        return a

    def walk(p):
        if not isinstance(p, pm.PatternExpr) or id(p) in seen:
            return
        seen.add(id(p))
        if isinstance(p, pm.MultiOutputPattern):
            for o in p.outputs:
                walk(o)
        elif isinstance(p, pm._TargetArgsExpr):
            p.args = tuple(sub(a) for a in p.args)
            p.kwargs = {k: sub(v) for k, v in p.kwargs.items()}
            # Inductor's pytree form where a torch lacks its flat one (a private helper).
            p.flatten = (
                _flatten if hasattr(pm._TargetArgsExpr, "simple_flatten") else p.pytree_flatten
            )
            p.flat_args_kwargs = p.flatten(p.args, p.kwargs)

    walk(pattern)


def _flatten(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Sequence[Any], Any]:
    """Inductor's `pytree_flatten` of a pattern's or a node's arguments, matched the same:
    where none is a container, its flat items and a flat spec, which equals only another
    flat spec of as many arguments and the same keys, as the pytree specs would (pytree's
    walk was a third of the matching time, on nodes whose arguments are all plain)."""
    if any(
        isinstance(a, (tuple, list, dict)) or type(a) in pm.pytree.SUPPORTED_NODES
        for a in itertools.chain(args, kwargs.values())
    ):
        return pm._TargetArgsExpr.pytree_flatten(args, kwargs)
    return pm._TargetArgsExpr.simple_flatten(args, kwargs)


def _identity(value: Any, depth: int = 0) -> str:
    """A text that is the same in every process for the same code and values: a function's
    bytecode, constants, defaults and the values it closes over (recursively); plain
    values by repr; any other object by its type alone (its repr may hold an address)."""
    if depth > 4:
        return "..."
    if isinstance(value, (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return type(value).__name__ + "(" + ",".join(_identity(v, depth + 1) for v in items) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_identity(k, depth + 1)}:{_identity(v, depth + 1)}"
                              for k, v in value.items()) + "}"  # fmt: skip
    if isinstance(value, types.CodeType):
        consts = ",".join(_identity(c, depth + 1) for c in value.co_consts)
        return hashlib.sha256(value.co_code).hexdigest()[:16] + "(" + consts + ")"
    if isinstance(value, functools.partial):
        return "partial(" + _identity((value.func, value.args, value.keywords), depth + 1) + ")"
    if isinstance(value, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        packet = isinstance(value, torch._ops.OpOverloadPacket)
        return f"op:{value._qualified_op_name if packet else value._schema.name}"
    code = getattr(value, "__code__", None)
    if isinstance(code, types.CodeType):
        cells = []
        for cell in getattr(value, "__closure__", None) or ():
            try:
                cells.append(cell.cell_contents)
            except ValueError:  # an empty cell
                cells.append(None)
        parts = (getattr(value, "__qualname__", ""), code, value.__defaults__, tuple(cells))
        return _identity(parts, depth + 1)
    if isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(value)
    return type(value).__qualname__


def _pattern_kwargs(p: pm.PatternExpr) -> dict[object, set[str]]:
    """Per target, the keyword arguments some op of the pattern names (the matcher compares
    those; it ignores the rest)."""
    out: dict[object, set[str]] = {}
    seen, stack = set(), [p]
    while stack:
        q = stack.pop()
        if not isinstance(q, pm.PatternExpr) or id(q) in seen:
            continue
        seen.add(id(q))
        if isinstance(q, pm.MultiOutputPattern):
            stack.extend(q.outputs)
            continue
        if isinstance(q, pm._TargetArgsExpr):
            for fn in q.fns:
                out.setdefault(fn, set()).update(q.kwargs)
            stack.extend(q.flat_args_kwargs[0])
    return out


def _uncovered_kwargs(node: torch.fx.Node, covered: dict[object, set[str]]) -> dict:
    """`node`'s keyword arguments that the pattern does not name and that differ from the
    op schema's default (a default spelled out computes the same)."""
    if node.op != "call_function" or not node.kwargs:
        return {}
    schema = getattr(node.target, "_schema", None)
    defaults = {}
    if schema is not None:
        defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    names = covered.get(node.target, set())
    return {
        k: v
        for k, v in node.kwargs.items()
        if k not in names and not (k in defaults and _same_default(v, defaults[k]))
    }


def _same_default(value, default) -> bool:
    try:
        return bool(value == default) and type(value) is not torch.fx.Node
    except Exception:  # a value that does not compare (a tensor): not the default
        return False


def _size(p: pm.PatternExpr) -> int:
    seen: set[int] = set()

    def count(q) -> int:
        if not isinstance(q, pm.PatternExpr) or id(q) in seen:
            return 0
        seen.add(id(q))
        if isinstance(q, pm.MultiOutputPattern):
            return sum(count(o) for o in q.outputs)
        if isinstance(q, pm._TargetArgsExpr):
            return 1 + sum(count(a) for a in q.flat_args_kwargs[0])
        return 0

    return count(p)


def _op_sets(p: pm.PatternExpr) -> tuple[list[_Ops], list[tuple[_Ops, _Ops]]]:
    """The ops a pattern matches (node kind and target set, `fns`), and every producer ->
    consumer edge between two of them (an arg of one op is the other's output)."""
    ops, edges, seen, stack = set(), set(), set(), [p]
    while stack:
        q = stack.pop()
        if id(q) in seen:
            continue
        seen.add(id(q))
        if isinstance(q, pm.MultiOutputPattern):
            stack.extend(o for o in q.outputs if o is not None)
            continue
        if isinstance(q, pm._TargetExpr):
            ops.add(_Ops(q.op, frozenset(q.fns)))
        for a in [*getattr(q, "args", ()), *getattr(q, "kwargs", {}).values()]:
            for x in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(x, pm.PatternExpr):
                    stack.append(x)
                    if isinstance(q, pm._TargetExpr) and isinstance(x, pm._TargetExpr):
                        edges.add((_Ops(x.op, frozenset(x.fns)), _Ops(q.op, frozenset(q.fns))))
    return list(ops), list(edges)


class _Ops(NamedTuple):
    op: str  # call_function, call_method, ...
    fns: frozenset


class _GraphIndex:
    """Which ops and producer -> consumer edges a graph holds, answered from the graph's
    own (op, target) node index: a necessary condition for a match, far cheaper than
    offering a pattern every node of its root op (Inductor type-checks each first)."""

    def __init__(self, graph: torch.fx.Graph):
        self.graph = graph
        self.memo: dict[Any, bool] = {}

    def _nodes(self, ops: _Ops):
        for fn in ops.fns:
            yield from self.graph.find_nodes(op=ops.op, target=fn, sort=False)

    def has(self, ops: _Ops) -> bool:
        if ops not in self.memo:
            self.memo[ops] = next(self._nodes(ops), None) is not None
        return self.memo[ops]

    def has_edge(self, src: _Ops, dst: _Ops) -> bool:
        key = (src, dst)
        if key not in self.memo:
            self.memo[key] = any(
                i.op == src.op and i.target in src.fns
                for n in self._nodes(dst)
                for i in n.all_input_nodes
            )
        return self.memo[key]

    def can_match(self, ops_edges) -> bool:
        ops, edges = ops_edges
        return all(map(self.has, ops)) and all(self.has_edge(a, b) for a, b in edges)


def _root_pattern(p: pm.PatternExpr) -> pm.PatternExpr:
    root = p.outputs[0] if isinstance(p, pm.MultiOutputPattern) else p
    # A multi-output op is rooted at a getitem; the op itself is the candidate.
    if isinstance(root, pm.CallFunction) and operator.getitem in root.fns:
        root = root.args[0]
    return root


def _near(node: torch.fx.Node, targets, hops: int = 3) -> list[torch.fx.Node]:
    """`node` or its users within a few hops whose op is one of `targets`."""
    frontier, found, seen = [node], [], set()
    for _ in range(hops + 1):
        nxt = []
        for n in frontier:
            if n in seen:
                continue
            seen.add(n)
            if n.target in targets:
                found.append(n)
            nxt.extend(n.users)
        frontier = nxt
    return found[:2]


def _root_target(p: pm.PatternExpr):
    fns = getattr(_root_pattern(p), "fns", [None])
    return fns[0]
