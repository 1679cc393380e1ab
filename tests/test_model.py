"""The plain Beam model: eager vs torch.compile, its post-grad graph, random configs vs fp64.

Tolerances (logits are fp32; "scale" is the largest |logit|):
- semantic front end compiled with Inductor's `emulate_precision_casts` (every bf16
  rounding of the contract kept): final hidden states bitwise equal at the test prompt;
  logits within 1e-5, from the fp32 softcap alone (measured 2.4e-7). Not at every prompt:
  Inductor's norms sum a row in another order than eager, and at 64 tokens a few
  elements move by one bf16 ulp where the fp32 sum's last bit crosses a rounding.
- Inductor defaults, either front end: within 3% of scale (measured 1.2-1.4% on the
  tiny model): fused elementwise code skips the contract's intermediate bf16 roundings.
- bf16 model vs the fp64 reference on random small configs: within 5% of scale
  (measured at most 2.4% over 150 configs), on prompts whose routing has no near-tie.
"""

import re
from collections import Counter

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from beamfx.checkpoint import init_random, load_checkpoint
from beamfx.cli import (
    BF16_LOGITS_RTOL,
    EXACT_LOGITS_TOL,
    build_parser,
    main,
    post_grad_graphs,
    routing_margin,
)
from beamfx.config import BeamConfig, preset
from beamfx.models.beam import BeamForCausalLM, reference_model
from beamfx.testing import strategies as bst

REFERENCE_RTOL = 0.05
# Routing is a discrete choice: where two experts (or groups) score within this of each
# other, bf16 and fp64 may legitimately choose differently. Such prompts are skipped.
MIN_ROUTING_MARGIN = 0.02


def expected_ir_counts(cfg: BeamConfig, layer: int, world_size: int) -> Counter:
    """Beam IR ops one decoder layer of the plain model puts in the graph."""
    counts = Counter(
        rms_norm=2 + 2 * 2,  # q_norm, k_norm; each of 2 boundaries: post-norm and next norm
        scaled_residual_add=2,  # one per boundary
    )
    if world_size > 1:
        counts["all_reduce"] = 2  # o_proj and down_proj / expert combine are row-parallel
    if cfg.mlp_layer_types[layer] == "sparse":
        counts.update(router_logits=1, grouped_topk=1, moe_experts=1, moe_finalize=1)
    else:
        counts["silu_mul"] = 1
    return counts


def assert_per_layer_sequence(graphs, cfg: BeamConfig, world_size: int) -> None:
    """The graph shows, per layer, the unfused sequences the passes will target."""
    assert len(graphs) == 1, f"the model broke into {len(graphs)} graphs; passes need one"
    (graph,) = graphs
    outside = [n.op for n in graph.ir_nodes if n.layer is None]
    assert outside == ["beamfx.rms_norm"]  # layer 0's input norm; later ones sit in boundaries
    boundary = ["rms_norm", "scaled_residual_add", "rms_norm"]
    if world_size > 1:
        boundary = ["all_reduce", *boundary]
    for layer in range(cfg.num_hidden_layers):
        assert graph.counts(layer) == expected_ir_counts(cfg, layer, world_size), layer
        nodes = [n for n in graph.ir_nodes if n.layer == layer]
        ops = {
            scope: [n.op.split(".")[1] for n in nodes if n.scope == scope]
            for scope in {"self_attn", "mlp", "boundary"}
        }
        assert ops["self_attn"] == ["rms_norm", "rms_norm"]
        assert ops["boundary"] == boundary * 2
        sparse = cfg.mlp_layer_types[layer] == "sparse"
        moe = ["router_logits", "grouped_topk", "moe_experts", "moe_finalize"]
        assert ops["mlp"] == (moe if sparse else ["silu_mul"])
        # Dataflow: each residual add takes its boundary's post-norm, not something else.
        by_name = {n.name: n for n in nodes}
        for add in (n for n in nodes if n.op == "beamfx.scaled_residual_add"):
            first_arg = add.args.split(",")[0]
            assert by_name[first_arg].op == "beamfx.rms_norm"


class HiddenAndLogits(torch.nn.Module):
    """The model returning its final hidden states too, to compare them bit for bit."""

    def __init__(self, model: BeamForCausalLM):
        super().__init__()
        self.inner = model

    def forward(self, input_ids):
        b, s = input_ids.shape
        positions = torch.arange(s).expand(b, s)
        x = self.inner.model(input_ids, positions)
        return x, self.inner.compute_logits(x).view(b, s, -1)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint).eval()


@pytest.fixture(scope="module")
def compiled_keeping_roundings(tiny, tiny_prompt):
    """One Inductor compile keeping every bf16 rounding, with its post-grad graph."""
    graphs, out = post_grad_graphs(
        HiddenAndLogits(tiny), tiny_prompt, stop=False, options={"emulate_precision_casts": True}
    )
    return graphs, out


@pytest.mark.slow
def test_compiled_semantic_model_matches_eager_bitwise(
    tiny, tiny_prompt, compiled_keeping_roundings
):
    _, (hidden, logits) = compiled_keeping_roundings
    with torch.no_grad():
        eager_hidden, eager_logits = HiddenAndLogits(tiny)(tiny_prompt)
    assert torch.equal(hidden, eager_hidden)
    assert (logits - eager_logits).abs().max().item() <= EXACT_LOGITS_TOL


@pytest.mark.slow
def test_compiled_graph_shows_the_unfused_sequence_per_layer(tiny, compiled_keeping_roundings):
    graphs, _ = compiled_keeping_roundings
    assert_per_layer_sequence(graphs, tiny.config, world_size=1)


@pytest.mark.slow
def test_compiled_torch_front_end_within_bf16_tolerance(tiny_checkpoint, tiny_prompt):
    model = load_checkpoint(tiny_checkpoint, frontend="torch").eval()
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(tiny_prompt)
        compiled = torch.compile(model)(tiny_prompt)
    torch._dynamo.reset()
    diff = (compiled - eager).abs().max().item()
    assert diff <= BF16_LOGITS_RTOL * eager.abs().max().item()
    assert diff > 0  # if this ever becomes bitwise, tighten the stated tolerance


# --- the CLI views of the same model -----------------------------------------------------


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "write-tiny", "graph"):
        assert name in out


def test_console_script_is_declared():
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="beamfx")
    assert script.value == "beamfx.cli:main"


def test_graph_command_prints_each_layer(capsys):
    assert main(["graph", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer 0: sliding_attention, dense MLP" in out
    assert "layer 1: full_attention, MoE" in out
    assert "= beamfx.moe_finalize(moe_experts" in out
    assert "layer 1: rms_norm x6, scaled_residual_add x2, router_logits x1" in out


def test_write_tiny_command(tmp_path, capsys):
    assert main(["write-tiny", str(tmp_path), "--layers", "1"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in tmp_path.iterdir()
    }
    assert load_checkpoint(str(tmp_path)).config.num_hidden_layers == 1


def test_commands_refuse_a_model_too_large_to_hold(capsys):
    assert main(["write-tiny", "unused", "--config", "beam-1.0-shaped"]) == 2
    assert "GiB" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_command_reports_agreement(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count(": agree") == 3  # two compile modes, then the fused-vs-unfused check
    assert "eager and torch.compile agree" in out
    # Then what fused on the 2-layer model: two boundaries per layer.
    assert re.search(r"^  boundary +4 +2\.00", out, re.M), out
    assert out.rstrip().endswith(": agree")


# --- random small configs vs the fp64 reference -------------------------------------------


small_configs = bst.beam_configs  # shared with everyone's fusion tests


@given(
    cfg=small_configs(), batch=st.integers(1, 2), seq=st.integers(1, 12), seed=st.integers(0, 2**16)
)
def test_random_configs_match_the_fp64_reference(cfg, batch, seq, seed):
    model = init_random(BeamForCausalLM(cfg), seed=seed).eval()
    ids = torch.randint(
        3, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )
    ref = reference_model(model)
    assume(routing_margin(ref, ids) >= MIN_ROUTING_MARGIN)
    with torch.no_grad():
        logits = model(ids)
        expected = ref(ids)
        # The plain-torch front end is the same math through the same references.
        assert torch.equal(model.set_frontend("torch")(ids), logits)
    assert logits.shape == (batch, seq, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    scale = expected.abs().max().item()
    err = (logits.double() - expected).abs().max().item()
    assert err <= REFERENCE_RTOL * scale, f"max |diff| {err:.3g} vs scale {scale:.3g}"
    if cfg.final_logit_softcapping is not None:
        assert scale <= cfg.final_logit_softcapping


@given(
    cfg=small_configs(), batch=st.integers(1, 2), seq=st.integers(1, 12), seed=st.integers(0, 2**16)
)
def test_the_model_computes_beams_math(cfg, batch, seq, seed):
    """The model in fp64 against Beam's math written apart from it, from the description
    alone (`tests/independent_beam.py`): `reference_model` runs the model's own code, so
    the check above measures rounding, and only this one catches a wrong formula."""
    from independent_beam import beam_logits

    from beamfx.checkpoint import hf_state_dict

    model = init_random(BeamForCausalLM(cfg), seed=seed).eval()
    ids = torch.randint(
        3, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )
    ref = reference_model(model)
    assume(routing_margin(ref, ids) >= 1e-9)  # fp64 both: only an exact tie could split them
    with torch.no_grad():
        got = ref(ids)
        want = beam_logits(cfg, hf_state_dict(model), ids)
    err = (got - want).abs().max().item()
    assert err <= 1e-9 * want.abs().max().item(), f"max |diff| {err:.3g}"


def test_reference_model_is_fp64_and_leaves_the_model_alone(tiny):
    ref = reference_model(tiny)
    assert {p.dtype for p in ref.parameters()} == {torch.float64}
    assert ref.frontend == "torch" and tiny.frontend == "semantic"
    assert tiny.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_routing_margin_measures_the_deciding_gaps():
    """The margin that guards the comparisons above must see group and expert ties."""
    cfg = preset("tiny", num_hidden_layers=1, mlp_layer_types=["sparse"])
    model = init_random(BeamForCausalLM(cfg), seed=0).eval()
    gate = model.model.layers[0].mlp.gate
    ids = torch.arange(3, 11).view(1, 8)
    with torch.no_grad():
        gate.weight.zero_()  # every score is sigmoid(0) = 0.5; the bias decides
        gate.e_score_correction_bias.copy_(torch.arange(8.0))
    # Groups {0..3}, {4..7} score 6 and 14 (gap 8); top-2 of the kept group: 7.5, 6.5, next 5.5.
    assert routing_margin(model, ids) == 1.0
    with torch.no_grad():
        gate.e_score_correction_bias[5] = 6.0  # experts 5 and 6 tie for the second place
    assert routing_margin(model, ids) == 0.0
