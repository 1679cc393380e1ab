"""`beamfx passes` and `beamfx compile`: the report a user reads, and its errors."""

import json

import pytest

from beamfx.cli import main
from beamfx.passes import PASSES


def test_passes_lists_every_pass_with_a_description(capsys):
    assert main(["passes"]) == 0
    out = capsys.readouterr().out
    for name in PASSES:
        assert any(line.startswith(name) and len(line.split()) > 3 for line in out.splitlines())


@pytest.mark.slow
def test_compile_reports_json_with_matches_per_pass(capsys):
    assert main(["compile", "--config", "tiny", "--passes", "all", "--report", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["matches"]["boundary"] == 8  # two per layer, 4 layers
    assert report["matches"]["router_gemm"] == report["matches"]["mega_moe"] == 2
    assert report["ops_after"]["beamfx.fused_boundary"] == 8
    assert report["check"]["agree"]
    # what ran them: on CPU the references, with the GPU providers' reasons
    kernels = report["kernels"]
    assert kernels["fused_boundary"]["calls"] == 8
    assert kernels["fused_boundary"]["provider"] == "reference"
    assert "CUDA" in kernels["mega_moe"]["declined"]["grouped_mm"]


@pytest.mark.slow
def test_compile_explain_names_the_failed_constraint(capsys):
    args = ["compile", "--config", "tiny", "--passes", "boundary", "--dtype", "float32"]
    assert main([*args, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "[dtype(residual)] residual is float32, the kernel takes bfloat16, float16" in out


def test_compile_rejects_a_misspelled_pass_with_the_valid_names(capsys):
    assert main(["compile", "--passes", "boundry"]) == 2
    err = capsys.readouterr().err
    assert "unknown beamfx pass 'boundry'" in err and "boundary" in err


@pytest.mark.parametrize("tp", ["0", "-2", "two"])
def test_compile_rejects_a_rank_count_below_one(tp, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["compile", "--tp", tp])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --tp: must be a whole number of at least 1, got '{tp}'" in err


def _rank_status(rank: int, failing_rank: int) -> int:
    return 1 if rank == failing_rank else 0


@pytest.mark.parametrize("failing_rank, status", [(-1, 0), (1, 1)])
def test_a_ranks_failing_status_reaches_the_caller(failing_rank, status):
    # `beamfx compile --tp 2` exited 0 when the ranks' outputs disagreed: their statuses
    # were dropped.
    from beamfx.cli import spawn_gloo

    assert spawn_gloo(2, _rank_status, failing_rank) == status


def test_layers_of_a_checkpoint_folder_are_not_overridden(tiny_checkpoint, capsys):
    """`--layers 2` with a checkpoint folder ran all its layers and reported matches per
    layer over 2; it is refused now, as is a prompt of no tokens."""
    assert main(["compile", "--config", tiny_checkpoint, "--layers", "2"]) == 2
    assert "checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", "--config", "tiny", "--seq", "0"])
    assert "--seq: must be a whole number of at least 1, got '0'" in capsys.readouterr().err
