"""Lower leftovers: every Beam IR op no fusion claimed becomes its reference torch code again.

Runs last, so Inductor fuses the leftovers like any plain-torch code; a compiled model
with no fusion passes is then the same graph as one written without Beam IR.
"""

from __future__ import annotations

import torch
from torch._inductor import pattern_matcher as pm

from beamfx import ops
from beamfx.pattern import INLINER, run_matcher


class Lower:
    name = "lower"
    description = "Beam IR ops that no pass fused -> their reference torch code"

    def __init__(self):
        self._matcher: pm.PatternMatcherPass | None = None

    def matcher(self) -> pm.PatternMatcherPass:
        if self._matcher is None:
            self._matcher = pm.PatternMatcherPass(pass_name="beamfx.lower")
            for opdef in ops.semantic_ops():
                self._register(opdef)
        return self._matcher

    def _register(self, opdef: ops.OpDef) -> None:
        schema = opdef.op.default._schema
        names = [a.name for a in schema.arguments]
        kinds = {"float": float, "int": int, "SymInt": int, "str": str, "bool": bool}
        specs = {a.name: kinds.get(str(a.type)) for a in schema.arguments}
        pattern = pm.CallFunction(opdef.op.default, *[pm.KeywordArg(n) for n in names])

        # The references hand their float scalars to torch ops unchanged (and the Inliner
        # checks it): each is traced once per signature, not per layer's scales.
        @pm.register_graph_pattern(pattern, pass_dict=self._matcher)
        def lower(match: pm.Match, **kwargs):
            INLINER.replace(match, opdef.reference, [kwargs[n] for n in names], specs, names,
                            f"lower {opdef.name}", pass_through=True)  # fmt: skip

    def apply(self, graph: torch.fx.Graph) -> int:
        return run_matcher(self.matcher(), graph)

    __call__ = apply

    def source_hash(self) -> str:
        import hashlib
        import inspect

        from beamfx.kernels import precision
        from beamfx.kernels.boundary import reference as b
        from beamfx.kernels.moe import nvfp4
        from beamfx.kernels.moe import reference as m
        from beamfx.kernels.norm import gate
        from beamfx.kernels.norm import reference as n
        from beamfx.kernels.router import reference as r

        h = hashlib.sha256()
        # Every reference lowering inlines, and what they call (the widening, the NVFP4
        # decode of the reference MoE).
        for mod in (b, m, n, gate, r, nvfp4, ops, precision):
            h.update(inspect.getsource(mod).encode())
        return h.hexdigest()


PASS = Lower()
