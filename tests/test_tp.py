"""Tensor parallelism on the CPU: two gloo processes, each loading its shard of the tiny model.

Tolerance: TP=2 logits within 3% of max |logit| of TP=1 (measured 1.5%): each rank sums
half of the o_proj / down_proj products in bf16, so the reduced sum rounds differently.
Compiled TP=2 (contract roundings kept) matches eager TP=2 to 1e-5 (the softcap alone).
"""

import pytest
import torch
from test_model import assert_per_layer_sequence

from beamfx.checkpoint import load_checkpoint
from beamfx.cli import BF16_LOGITS_RTOL, EXACT_LOGITS_TOL, post_grad_graphs, spawn_gloo
from beamfx.models.beam import Parallel

WORLD_SIZE = 2


def _all_reduce_checks(par: Parallel) -> dict[str, torch.Tensor]:
    """The all_reduce Beam IR op and its funcol reference, eagerly and compiled."""
    from beamfx import ops as ir
    from beamfx.kernels.boundary import reference as boundary_ref

    x = torch.full((3, 256), par.rank + 1.0, dtype=torch.bfloat16)
    out = {"op": ir.all_reduce(x, par.group_name), "input_after": x.clone()}
    torch._dynamo.reset()
    out["op_compiled"] = torch.compile(lambda t: ir.all_reduce(t * 2, par.group_name) + 1)(x)
    out["reference_compiled"] = torch.compile(
        lambda t: boundary_ref.all_reduce(t * 2, par.group_name) + 1
    )(x)
    torch._dynamo.reset()
    return out


def _tp_rank(rank: int, checkpoint: str, ids: torch.Tensor, out_dir: str) -> None:
    par = Parallel.from_default_group()
    assert (par.rank, par.world_size) == (rank, WORLD_SIZE)
    results = _all_reduce_checks(par)
    model = load_checkpoint(checkpoint, par).eval()
    with torch.no_grad():
        results["eager"] = model(ids)
        results["eager_torch_front_end"] = model.set_frontend("torch")(ids)
    model.set_frontend("semantic")
    graphs, results["compiled"] = post_grad_graphs(
        model, ids, stop=False, options={"emulate_precision_casts": True}
    )
    results["graphs"] = graphs
    # The boundary pass on this rank's graphs: the all-reduce folded into each boundary.
    from beamfx.testing import compile_with

    torch._dynamo.reset()
    compiled, manager = compile_with(model, ["boundary"])
    with torch.no_grad():
        results["fused"] = compiled(ids)
    results["boundary_matches"] = [r.matches("boundary") for r in manager.reports]
    results["fused_ops_after"] = [r.ops_after for r in manager.reports]
    torch._dynamo.reset()
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def tp_results(tiny_checkpoint, tiny_prompt, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp")
    spawn_gloo(WORLD_SIZE, _tp_rank, tiny_checkpoint, tiny_prompt, str(out_dir))
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def tp1_logits(tiny_checkpoint, tiny_prompt):
    with torch.no_grad():
        return load_checkpoint(tiny_checkpoint).eval()(tiny_prompt)


@pytest.mark.slow
def test_all_reduce_sums_over_gloo_eagerly_and_compiled(tp_results):
    total = sum(r + 1.0 for r in range(WORLD_SIZE))
    for rank, res in enumerate(tp_results):
        assert torch.equal(res["op"], torch.full((3, 256), total, dtype=torch.bfloat16))
        # A new tensor: the op's input is left as it was.
        assert torch.equal(
            res["input_after"], torch.full((3, 256), rank + 1.0, dtype=torch.bfloat16)
        )
        expected = torch.full((3, 256), 2 * total + 1, dtype=torch.bfloat16)
        assert torch.equal(res["op_compiled"], expected)
        assert torch.equal(res["reference_compiled"], expected)


@pytest.mark.slow
def test_tp2_eager_matches_tp1(tp_results, tp1_logits):
    scale = tp1_logits.abs().max().item()
    for res in tp_results:
        assert torch.equal(res["eager"], tp_results[0]["eager"])  # ranks agree exactly
        assert torch.equal(res["eager_torch_front_end"], res["eager"])
        assert (res["eager"] - tp1_logits).abs().max().item() <= BF16_LOGITS_RTOL * scale


@pytest.mark.slow
def test_tp2_compiled_matches_tp2_eager_and_tp1(tp_results, tp1_logits):
    scale = tp1_logits.abs().max().item()
    for res in tp_results:
        assert (res["compiled"] - res["eager"]).abs().max().item() <= EXACT_LOGITS_TOL
        assert (res["compiled"] - tp1_logits).abs().max().item() <= BF16_LOGITS_RTOL * scale


@pytest.mark.slow
def test_tp2_graph_has_two_all_reduces_per_layer(tp_results, tiny_checkpoint):
    from beamfx.config import load_config

    cfg = load_config(tiny_checkpoint)
    for res in tp_results:
        assert_per_layer_sequence(res["graphs"], cfg, world_size=WORLD_SIZE)
        for layer in range(cfg.num_hidden_layers):
            assert res["graphs"][0].counts(layer)["all_reduce"] == 2


@pytest.mark.slow
def test_tp2_boundary_fuses_twice_a_layer_with_the_all_reduce(tp_results, tiny_checkpoint):
    """Issue #4 at TP=2 (two gloo processes): the boundary pass fires exactly twice a layer
    on every rank, each fused boundary takes its all-reduce (none is left in the graph),
    and the logits stay within 0.1 of the eager TP=2 model's, the whole-model bound of
    the TP=1 test (tests/passes/test_boundary.py: Inductor's lowered attention rounds
    differently from eager's; a boundary without its all-reduce is off by whole units)."""
    from beamfx.config import load_config

    layers = load_config(tiny_checkpoint).num_hidden_layers
    for res in tp_results:
        assert res["boundary_matches"] == [2 * layers]
        (ops,) = res["fused_ops_after"]
        assert "beamfx.all_reduce" not in ops, ops
        fused = ops.get("beamfx.fused_boundary", 0) + ops.get("beamfx.fused_boundary_residual", 0)
        assert fused == 2 * layers, ops
        assert (res["fused"] - res["eager"]).abs().max().item() <= 0.1
