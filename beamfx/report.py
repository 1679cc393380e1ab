"""Compile the plain model with chosen passes and report what fused (`beamfx compile`).

Traces the model once with the passes and once without, checks the outputs agree, and
returns a JSON-able report: per-pass matches per graph, Beam IR ops before and after,
explain entries, pass time, and the output comparison.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from beamfx.config import BeamConfig

# Whole-model tolerance between the fused and unfused compiles, relative to max |logit|:
# fused ops run the contract's exact roundings while the unfused compile runs Inductor's
# kernels (its reductions round differently), so single bf16 flips may show.
LOGITS_RTOL = 0.03


def build_model(cfg: BeamConfig, source: str, dtype: torch.dtype, frontend: str, parallel=None):
    """Random weights for a preset or config file; the checkpoint's weights for a folder."""
    import os

    from beamfx.checkpoint import init_random, load_checkpoint
    from beamfx.models.beam import BeamForCausalLM

    if os.path.isdir(source) and any(f.endswith(".safetensors") for f in os.listdir(source)):
        from beamfx.config import BeamConfigError, load_config

        stored = load_config(source).num_hidden_layers
        if cfg.num_hidden_layers != stored:
            raise BeamConfigError(
                f"--layers {cfg.num_hidden_layers}: checkpoint {source!r} has {stored} layers "
                "and loads whole; drop --layers, or pass a preset or a config.json"
            )
        return load_checkpoint(source, parallel, dtype, frontend)
    return init_random(BeamForCausalLM(cfg, parallel, dtype, frontend), seed=0)


def compile_and_report(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    passes: list[str] | str,
    *,
    explain: bool = False,
) -> dict[str, Any]:
    """Run `model` compiled with `passes` and without; return the report (JSON-able)."""
    from beamfx import ops
    from beamfx.testing import compile_with

    results, kernels = {}, {}
    for label, chosen in (("fused", passes), ("unfused", ())):
        torch.compiler.reset()
        compiled, manager = compile_with(model, chosen, explain=explain and label == "fused")
        ops.provider_report(reset=True)
        start = time.perf_counter()
        with torch.no_grad():
            results[label] = (compiled(input_ids), manager, time.perf_counter() - start)
        kernels[label] = ops.provider_report(reset=True)
    fused, manager, seconds = results["fused"]
    unfused = results["unfused"][0]
    scale = unfused.abs().max().item()
    diff = (fused - unfused).abs().max().item()
    summary = manager.summary()
    return {
        "passes": manager.names,
        "uuid": manager.uuid(),
        "graphs": summary["graphs"],
        "matches": summary["matches"],
        "pass_seconds": summary["seconds"],
        "compile_and_run_seconds": round(seconds, 2),
        "ops_before": _total(r.ops_before for r in manager.reports),
        "ops_after": _total(r.ops_after for r in manager.reports),
        "explain": [asdict(e) | {"graph": r.index} for r in manager.reports for e in r.explain],
        # which implementation ran each Beam IR op in the fused run, and why faster ones
        # declined (`ops.provider_report`)
        "kernels": kernels["fused"],
        "check": {
            "max_abs_diff_vs_unfused": diff,
            "max_abs_logit": scale,
            "tolerance": LOGITS_RTOL * scale,
            "agree": diff <= LOGITS_RTOL * scale,
        },
    }


def _total(counts) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def format_report(report: dict[str, Any], cfg: BeamConfig) -> str:
    lines = [f"beamfx compile: passes {', '.join(report['passes']) or '(none)'}; "
             f"{report['graphs']} graph(s); uuid {report['uuid'][:12]}"]  # fmt: skip
    lines.append(f"  {'pass':<14} {'matches':>7} {'per layer':>9} {'ms':>8}")
    layers = cfg.num_hidden_layers
    for name, n in report["matches"].items():
        ms = report["pass_seconds"][name] * 1e3
        lines.append(f"  {name:<14} {n:>7} {n / layers:>9.2f} {ms:>8.1f}")
    lines.append("  Beam IR ops before -> after:")
    keys = sorted(set(report["ops_before"]) | set(report["ops_after"]))
    for k in keys:
        lines.append(f"    {k:<34} {report['ops_before'].get(k, 0):>4} -> "
                     f"{report['ops_after'].get(k, 0):>4}")  # fmt: skip
    for e in report["explain"]:
        where = f"[{e['constraint']}] " if e["constraint"] else ""
        lines.append(f"  not fused: {e['node']} ({e['pass_name']}/{e['rule']}): {where}"
                     f"{e['reason']}")  # fmt: skip
    lines.append("  kernels (fused run): op -> implementation of its last call")
    for op, k in report.get("kernels", {}).items():
        lines.append(f"    {op:<28} {k['provider']:<10} x{k['calls']}")
        for name, why in k["declined"].items():
            lines.append(f"      {name} declined: {why}")
    c = report["check"]
    verdict = "agree" if c["agree"] else "DISAGREE"
    lines.append(f"  outputs vs the unfused compile: max |diff| {c['max_abs_diff_vs_unfused']:.3g} "
                 f"(tolerance {c['tolerance']:.3g}): {verdict}")  # fmt: skip
    return "\n".join(lines)
