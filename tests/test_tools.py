"""The benchmark scripts run (on CPU, at tiny sizes): what a GPU run executes is sound."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_layer_benchmark_runs_every_variant(tmp_path):
    cmd = [sys.executable, "tools/bench_layer.py", "--config", "tiny", "--tokens", "2",
           "--prefill", "8", "--tp", "1", "--experts", "bf16", "nvfp4",
           "--finalize-in-boundary", "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    rows = json.loads((tmp_path / "layer_cpu.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2  # experts x layer kinds x (decode, prefill)
    for r in rows:
        assert all(r[v]["us"] > 0 for v in ("eager", "torch.compile", "beamfx"))
        # The beamfx row runs every fusion: nothing of the routing or MoE is left unfused.
        moe = "beamfx.mega_moe_nvfp4" if r["experts"] == "nvfp4" else "beamfx.mega_moe"
        want = {"beamfx.routed_topk": 1, moe: 1, "beamfx.fused_boundary": 2,
                "beamfx.attn_gate": 1}  # fmt: skip
        assert r["beamfx"]["ops"] == want, r["beamfx"]["ops"]
        # The baseline fuses nothing of beamfx's: only the opaque experts op is left.
        experts = "beamfx.moe_experts_nvfp4" if r["experts"] == "nvfp4" else "beamfx.moe_experts"
        assert r["torch.compile"]["ops"] == {experts: 1}, r["torch.compile"]["ops"]
        # Boundary first: it takes the finalize, the experts stay unfused and write k rows.
        other = r["beamfx, finalize in boundary"]["ops"]
        assert other == {**{k: v for k, v in want.items() if k != moe}, experts: 1}, other


@pytest.mark.slow
def test_compile_time_benchmark_counts_the_expected_matches(tmp_path):
    cmd = [sys.executable, "tools/bench_compile.py", "--layers", "2", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    (row,) = json.loads((tmp_path / "compile.json").read_text())["rows"]
    # beam-1.0-shaped, 2 layers: layer 0 dense, layer 1 MoE.
    assert row["matches"]["boundary"] == 4
    assert row["matches"]["mega_moe"] == row["matches"]["router_gemm"] == 1
