"""The pass manager: canonicalize -> the chosen fusion passes, in order -> lower leftovers.

One `PassManager` is Inductor's post-grad custom pass (standalone through
`beamfx.compile`, or inside vLLM through `beamfx.integrations.vllm`). Its `uuid()` feeds
Inductor's cache key and changes with the pass list, any pass's code, or any option.
It records a report per graph: matches per pass, nodes before/after, and `explain`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import beamfx
from beamfx import passes as registry
from beamfx.pattern import FusionPass, Rejection


@dataclass
class PassReport:
    name: str
    matches: int
    nodes_before: int
    nodes_after: int
    seconds: float
    rematches: int | None = None  # with verify: matches when run again (must be 0)


@dataclass
class GraphReport:
    """What the pipeline did to one graph (vLLM compiles a model as several graphs)."""

    index: int
    passes: list[PassReport] = field(default_factory=list)
    explain: list[Rejection] = field(default_factory=list)
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    # The token counts vLLM compiled this graph for, "(start, end)" (one size where they are
    # equal); None outside vLLM. vLLM compiles each piece of the model once per compile
    # range and compile size, so totals over graphs count each of them.
    compile_range: str | None = None

    def matches(self, name: str) -> int:
        return sum(p.matches for p in self.passes if p.name == name)


class PassManager(CustomGraphPass):
    """Ordered, named passes run as one Inductor post-grad pass."""

    def __init__(
        self,
        passes: Sequence[str | FusionPass] | str = (),
        *,
        canonicalize: bool = True,
        lower: bool = True,
        explain: bool = False,
        verify: bool = False,
    ):
        # Names of beamfx passes, or FusionPass objects of one's own, run in the list's order.
        self.custom: dict[str, FusionPass] = {}
        self.names: list[str] = []
        for item in [passes] if isinstance(passes, str) else passes:
            if isinstance(item, str):
                self.names += [n for n in registry.resolve(item) if n not in self.names]
                continue
            taken = {*registry.PASSES, *registry.STAGES, "all", *self.custom}
            if item.name in taken:
                raise ValueError(
                    f"pass {item.name!r}: a pass of that name is already in the pipeline "
                    f"(beamfx's: {', '.join([*registry.PASSES, *registry.STAGES, 'all'])}; "
                    f"yours so far: {', '.join(self.custom) or 'none'}): give yours another name"
                )
            self.custom[item.name] = item
            self.names.append(item.name)
        self.canonicalize = canonicalize
        self.lower = lower
        self.explain = explain
        self.verify = verify
        self.reports: list[GraphReport] = []

    def __deepcopy__(self, memo) -> PassManager:
        # torch.compile deep-copies its options to record them; the pipeline, its reports
        # and its passes (whose replacements may be torch library objects that cannot be
        # copied) are one object.
        return self

    @property
    def stages(self) -> list[str]:
        return (
            (["canonicalize"] if self.canonicalize else [])
            + self.names
            + (["lower"] if self.lower else [])
        )

    def __call__(self, graph: torch.fx.Graph) -> None:
        report = GraphReport(index=len(self.reports), ops_before=op_counts(graph))
        for name in self.stages:
            p = self._get(name)
            before = len(graph.nodes)
            start = time.perf_counter()
            matches = p.apply(graph)
            report.passes.append(
                PassReport(name, matches, before, len(graph.nodes), time.perf_counter() - start)
            )
            if self.explain and name in self.names:
                report.explain.extend(p.explain(graph))
            if self.verify and name in self.names:
                # Idempotence, and no unfused instance left: a second run finds nothing.
                report.passes[-1].rematches = p.apply(graph)
        if self.verify:
            # Inductor lints the graph after its post-grad passes (this one among them):
            # a second lint on every graph was a twentieth of the pipeline's time.
            graph.lint()
        report.ops_after = op_counts(graph)
        self.reports.append(report)

    def uuid(self) -> str:
        h = hashlib.sha256(beamfx.__version__.encode())
        h.update(_FRAMEWORK_HASH)
        h.update(json.dumps(self.options()).encode())
        for name in self.stages:
            h.update(name.encode())
            h.update(self._get(name).source_hash().encode())
        return h.hexdigest()

    def _get(self, name: str):
        return self.custom.get(name) or registry.get_pass(name)

    def options(self) -> dict[str, Any]:
        return {"passes": self.names, "canonicalize": self.canonicalize, "lower": self.lower}

    # --- reports -------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Totals over every graph compiled so far, plus the per-graph reports."""
        totals = Counter()
        seconds = Counter()
        by_range: dict[str, Counter] = {}
        for r in self.reports:
            for p in r.passes:
                totals[p.name] += p.matches
                seconds[p.name] += p.seconds
            if r.compile_range is not None:
                counts = by_range.setdefault(r.compile_range, Counter(graphs=0))
                counts["graphs"] += 1
                counts.update({p.name: p.matches for p in r.passes})
        return {
            "passes": self.names,
            "graphs": len(self.reports),
            "matches": {n: totals[n] for n in self.stages},
            "seconds": {n: round(seconds[n], 4) for n in self.stages},
            # {compile range: {"graphs": n, pass: matches}}, for the graphs vLLM compiled
            "by_compile_range": {
                k: {n: c[n] for n in ["graphs", *self.stages]} for k, c in by_range.items()
            },
            "per_graph": [asdict(r) for r in self.reports],
        }

    def format_text(self) -> str:
        s = self.summary()
        lines = [f"beamfx passes: {', '.join(self.names) or '(none)'}; graphs: {s['graphs']}"]
        for n in self.stages:
            lines.append(
                f"  {n:<14} matches {s['matches'][n]:>4}   {s['seconds'][n] * 1e3:8.1f} ms"
            )
        if len(s["by_compile_range"]) > 1:
            for key, c in s["by_compile_range"].items():
                fused = ", ".join(f"{n} {c[n]}" for n in self.names)
                lines.append(f"  tokens {key}: {c['graphs']} graph(s); {fused or 'no passes'}")
        for r in self.reports:
            for rej in r.explain:
                lines.append(f"  not fused: graph {r.index} {rej.describe()}")
        return "\n".join(lines)


def _framework_hash() -> bytes:
    """The code every pass runs through: the matcher glue, this manager, the op registry."""
    import inspect

    from beamfx import ops, pattern

    h = hashlib.sha256()
    for mod in (ops, pattern, registry):
        h.update(inspect.getsource(mod).encode())
    h.update(inspect.getsource(PassManager).encode())
    return h.digest()


# Namespaces of torch's own ops; any other op namespace is a library's or a user's custom
# ops (a pass of one's own replaces with them), counted beside Beam IR.
_TORCH_NAMESPACES = frozenset({
    "aten", "prims", "prim", "rngprims", "debugprims", "_c10d_functional",
    "_c10d_functional_autograd", "c10d_functional", "c10d", "tr_c10d", "symm_mem", "streams",
    "inductor", "_inductor_test", "higher_order", "quantized", "_quantized", "profiler",
    "_dtensor", "fsdp", "_test", "mkldnn", "mkl", "onednn", "quantized_decomposed", "sparse",
    "export", "onnx", "debug_mode_ops", "_native",
})  # fmt: skip


def op_counts(graph: torch.fx.Graph) -> dict[str, int]:
    """How many calls of each custom op the graph holds: Beam IR (`beamfx.*`), a user's own
    ops (any namespace but torch's), and all-reduce collectives."""
    c = Counter()
    targets = Counter(n.target for n in graph.nodes if n.op == "call_function")
    for target, count in targets.items():
        name = _reported_name(target)
        if name is not None:
            c[name] += count
    return dict(sorted(c.items()))


@functools.lru_cache(maxsize=4096)
def _reported_name(target: Any) -> str | None:
    name = str(target)
    if name.startswith("beamfx.") or "all_reduce" in name:
        return name.removesuffix(".default")
    is_op = isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    if is_op and getattr(target, "namespace", "aten") not in _TORCH_NAMESPACES:
        return name.removesuffix(".default")
    return None


_FRAMEWORK_HASH = _framework_hash()
