"""The tiny model compiled on the GPU with every pass: what fuses, which kernels run, and
the logits against eager.

TP=1 on one GPU. TP=2 on two GPUs over NCCL: each rank finalizes its local experts, the
functional all-reduce sums the ranks over NCCL, and the fused boundary kernel runs on the
reduced rows (the CPU suite runs the same over gloo, `test_tp.py`).

Tolerance: logits within 3% of max |logit| of eager (as the CPU report's check): the
kernels keep the contract's roundings, but the experts' GEMMs sum in another order.
"""

import pytest
import torch

from beamfx.checkpoint import load_checkpoint
from beamfx.cli import spawn_group
from beamfx.models.beam import Parallel
from beamfx.report import LOGITS_RTOL
from beamfx.testing import compile_with

pytestmark = pytest.mark.gpu

# The tiny preset: 4 layers (2 MoE), two boundaries a layer.
MATCHES = {"attn_gate": 4, "router_gemm": 2, "mega_moe": 2, "boundary": 8}
# A Triton kernel of each fused op's family must run (names as the profiler reports them).
KERNELS = {
    "boundary": ("_boundary_kernel",),
    "router": ("_router_", "_route_kernel"),
    "experts": ("_fc1_", "_fc2_"),
    "attention gate": ("_attn_gate_kernel",),
}


def _run(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    with torch.no_grad():
        eager = model(ids)
        torch.compiler.reset()
        compiled, manager = compile_with(model, "all")
        fused = compiled(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            again = compiled(ids)
            torch.cuda.synchronize()
    torch.compiler.reset()
    return {
        "eager": eager.float().cpu(),
        "fused": fused.float().cpu(),
        "again": again.float().cpu(),
        "matches": manager.summary()["matches"],
        "kernels": sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"}),
    }


def _check(res: dict) -> None:
    for name, n in MATCHES.items():
        assert res["matches"][name] == n, res["matches"]
    for family, parts in KERNELS.items():
        assert any(p in k for k in res["kernels"] for p in parts), (family, res["kernels"])
    assert torch.equal(res["fused"], res["again"])  # repeatable
    scale = res["eager"].abs().max().item()
    diff = (res["fused"] - res["eager"]).abs().max().item()
    assert diff <= LOGITS_RTOL * scale, (diff, scale)


def test_tiny_model_compiled_on_one_gpu_fuses_and_matches_eager(tiny_checkpoint, tiny_prompt):
    model = load_checkpoint(tiny_checkpoint).eval().cuda()
    _check(_run(model, tiny_prompt.cuda()))


def _tp_rank(rank: int, checkpoint: str, ids: torch.Tensor, out_dir: str) -> None:
    par = Parallel.from_default_group()
    model = load_checkpoint(checkpoint, par).eval().cuda()
    torch.save(_run(model, ids.cuda()), f"{out_dir}/rank{rank}.pt")


def test_tiny_model_at_tp2_over_nccl_fuses_and_matches_eager(
    tiny_checkpoint, tiny_prompt, tmp_path
):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"TP=2 over NCCL needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    spawn_group(2, _tp_rank, tiny_checkpoint, tiny_prompt, str(tmp_path), backend="nccl")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for res in ranks:
        _check(res)
        assert torch.equal(res["fused"], ranks[0]["fused"])  # the ranks agree exactly
    # The all-reduce sits between each boundary's finalize and its fused kernel: the NCCL
    # all-reduce kernel runs too.
    assert any("nccl" in k.lower() for k in ranks[0]["kernels"]), ranks[0]["kernels"]
