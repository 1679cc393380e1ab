"""beamfx: compile-time graph-rewriting fusion passes for vLLM, built first for Beam-1.0."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from beamfx import ops  # noqa: F401  (registers the beamfx:: custom ops)

__version__ = "0.1.0"


def compile(
    model: Any,
    passes: Sequence[str] | str = "all",
    *,
    explain: bool = False,
    options: dict[str, Any] | None = None,
    **torch_compile_kwargs: Any,
):
    """`torch.compile` with beamfx's pass pipeline as Inductor's post-grad custom pass.

    `passes` names fusion passes (see `beamfx passes`), "all", or () for none (Beam IR is
    then lowered back to plain torch code). `options` go to Inductor (by default with
    `emulate_precision_casts`). The returned module carries the pass manager as
    `.beamfx` (reports, `summary()`, `format_text()`).
    """
    import torch

    from beamfx.pipeline import PassManager

    manager = PassManager(passes, explain=explain)
    # Keep the bf16 roundings eager makes between ops that Inductor fuses, so a compiled
    # model gives the outputs the plain model gives (the fused ops keep theirs anyway).
    options = {"emulate_precision_casts": True, **(options or {})}
    if options.get("post_grad_custom_post_pass") is not None:
        raise ValueError(
            "beamfx.compile: options['post_grad_custom_post_pass'] is set, but beamfx's pass "
            "pipeline is that pass (Inductor runs one): add your pass as a FusionPass to "
            "`passes`, or compile with torch.compile yourself"
        )
    options["post_grad_custom_post_pass"] = manager
    compiled = torch.compile(model, options=options, **torch_compile_kwargs)
    compiled.beamfx = manager
    return compiled
