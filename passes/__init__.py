"""The fusion passes, one module each. `PASSES` names them in the order "all" runs them."""

from __future__ import annotations

import importlib

from beamfx.pattern import FusionPass

# name -> module defining `PASS`; "all" runs them in this order.
PASSES: dict[str, str] = {
    "attn_gate": "beamfx.passes.attn_gate",
    "router_gemm": "beamfx.passes.router_gemm",
    "mega_moe": "beamfx.passes.mega_moe",
    "boundary": "beamfx.passes.boundary",
}
# Always-on stages around the chosen fusions (see beamfx.pipeline).
STAGES: dict[str, str] = {
    "canonicalize": "beamfx.passes.canonicalize",
    "lower": "beamfx.passes.lower",
}


class UnknownPassError(ValueError):
    pass


def get_pass(name: str) -> FusionPass:
    """The pass called `name` (a fusion pass or a stage)."""
    module = PASSES.get(name) or STAGES.get(name)
    if module is None:
        raise UnknownPassError(
            f"unknown beamfx pass {name!r}: choose from {', '.join(PASSES)} (or 'all')"
        )
    return importlib.import_module(module).PASS


def resolve(names: str | list[str] | tuple[str, ...]) -> list[str]:
    """Pass names from a list or a comma-separated string; 'all' means every pass."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        for m in PASSES if n == "all" else [n]:
            if m not in PASSES:  # stages are not for choosing: they always run
                raise UnknownPassError(
                    f"unknown beamfx pass {m!r}: choose from {', '.join(PASSES)} (or 'all')"
                )
            if m not in out:
                out.append(m)
    return out


def descriptions() -> dict[str, str]:
    return {name: get_pass(name).description for name in PASSES}
