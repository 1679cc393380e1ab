"""Beam config: one bad-input case per validation rule, pre-release keys, presets."""

import json
import warnings

import pytest
import torch

from beamfx.checkpoint import init_random
from beamfx.config import PRESETS, BeamConfig, BeamConfigError, load_config, preset
from beamfx.models.beam import BeamForCausalLM

TINY = PRESETS["tiny"]
SLIDING_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# (overrides of the tiny preset, key the error must name, value the error must show)
BAD = {
    "hidden_size not positive": ({"hidden_size": 0}, "hidden_size", 0),
    "vocab_size not an int": ({"vocab_size": "512"}, "vocab_size", "512"),
    "num_hidden_layers a bool": ({"num_hidden_layers": True}, "num_hidden_layers", True),
    "head_dim negative": ({"head_dim": -64}, "head_dim", -64),
    "num_experts zero": ({"num_experts": 0}, "num_experts", 0),
    "sliding_window zero": ({"sliding_window": 0}, "sliding_window", 0),
    "rms_norm_eps zero": ({"rms_norm_eps": 0.0}, "rms_norm_eps", 0.0),
    "rms_norm_eps too big": ({"rms_norm_eps": 1.5}, "rms_norm_eps", 1.5),
    "activation not silu": ({"hidden_act": "gelu"}, "hidden_act", "gelu"),
    "tied embeddings": ({"tie_word_embeddings": True}, "tie_word_embeddings", True),
    "kv heads do not divide heads": ({"num_key_value_heads": 3}, "num_key_value_heads", 3),
    "heads do not divide hidden (no head_dim)": (
        {"head_dim": None, "num_attention_heads": 3, "num_key_value_heads": 1},
        "num_attention_heads",
        3,
    ),
    "layer_types too short": (
        {"layer_types": ["sliding_attention"] * 3},
        "layer_types",
        ["sliding_attention"] * 3,
    ),
    "layer_types not a list": (
        {"layer_types": "sliding_attention"},
        "layer_types",
        "sliding_attention",
    ),
    "unknown layer type": (
        {"layer_types": ["sliding_attention", "global", "sliding_attention", "full_attention"]},
        "layer_types[1]",
        "global",
    ),
    "mlp_layer_types too long": (
        {"mlp_layer_types": ["dense"] * 5},
        "mlp_layer_types",
        ["dense"] * 5,
    ),
    "unknown mlp type": (
        {"mlp_layer_types": ["dense", "moe", "sparse", "dense"]},
        "mlp_layer_types[1]",
        "moe",
    ),
    "rope for both layer types": (
        {"rope_parameters": {"sliding_attention": SLIDING_ROPE, "full_attention": SLIDING_ROPE}},
        "rope_parameters",
        {"sliding_attention": SLIDING_ROPE, "full_attention": SLIDING_ROPE},
    ),
    "rope for neither layer type": (
        {"rope_parameters": {"sliding_attention": None, "full_attention": None}},
        "rope_parameters",
        {"sliding_attention": None, "full_attention": None},
    ),
    "rope on full attention only": (
        {"rope_parameters": {"sliding_attention": None, "full_attention": SLIDING_ROPE}},
        "rope_parameters",
        {"sliding_attention": None, "full_attention": SLIDING_ROPE},
    ),
    "rope per-type dict with a stray key": (
        {"rope_parameters": {"sliding_attention": SLIDING_ROPE, "rope_theta": 1.0}},
        "rope_parameters",
        {"sliding_attention": SLIDING_ROPE, "rope_theta": 1.0},
    ),
    "rope not a dict": ({"rope_parameters": [SLIDING_ROPE]}, "rope_parameters", [SLIDING_ROPE]),
    "rope type not default": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
        "rope_parameters.rope_type",
        "yarn",
    ),
    "rope theta missing": (
        {"rope_parameters": {"rope_type": "default"}},
        "rope_parameters.rope_theta",
        None,
    ),
    "rope theta negative": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}},
        "rope_parameters.rope_theta",
        -1.0,
    ),
    "n_group does not divide experts": ({"n_group": 3}, "n_group", 3),
    "topk_group above n_group": ({"topk_group": 3}, "topk_group", 3),
    "top-k above the reachable experts": ({"num_experts_per_tok": 5}, "num_experts_per_tok", 5),
    "softcap not positive": ({"final_logit_softcapping": 0.0}, "final_logit_softcapping", 0.0),
    "softcap not a number": ({"final_logit_softcapping": "30"}, "final_logit_softcapping", "30"),
    "routed scale not a number": ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor", "2.5"),
    "routed scale a bool": ({"routed_scaling_factor": True}, "routed_scaling_factor", True),
    "routed scale negative": ({"routed_scaling_factor": -2.5}, "routed_scaling_factor", -2.5),
    "softcap a bool": ({"final_logit_softcapping": True}, "final_logit_softcapping", True),
    # A string: the semantic front end failed late on the op's bool, the torch one took
    # "false" as true; the tied check reported the string as True.
    "norm_topk_prob a string": ({"norm_topk_prob": "false"}, "norm_topk_prob", "false"),
    "tied embeddings a string": ({"tie_word_embeddings": "false"}, "tie_word_embeddings", "false"),
}


@pytest.mark.parametrize("overrides, key, value", BAD.values(), ids=BAD.keys())
def test_each_rule_rejects_its_bad_input_naming_key_and_value(overrides, key, value):
    with pytest.raises(BeamConfigError) as err:
        BeamConfig(**{**TINY, **overrides})
    message = str(err.value)
    assert f"{key}=" in message
    assert repr(value) in message
    # ... and says what is allowed (more than "key=value is invalid").
    assert len(message.split("is invalid:", 1)[-1].strip()) > 5


def test_the_tiny_preset_itself_is_valid():
    cfg = BeamConfig(**TINY)
    assert cfg.num_hidden_layers == 4


def test_bad_value_in_a_config_json_is_reported_with_its_key(tmp_path):
    data = {**TINY, "hidden_act": "relu"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(BeamConfigError, match=r"hidden_act='relu'.*silu"):
        load_config(tmp_path)


def test_config_json_missing_math_keys_warns_with_the_defaults_it_takes(tmp_path):
    data = {k: v for k, v in TINY.items() if k not in ("routed_scaling_factor", "n_group")}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.warns(UserWarning, match=r"does not set n_group, routed_scaling_factor: .*"
                      r"n_group=1, routed_scaling_factor=1\.0.*tiny") as caught:  # fmt: skip
        cfg = load_config(tmp_path)
    assert (cfg.n_group, cfg.routed_scaling_factor) == (1, 1.0)
    assert len([w for w in caught if "does not set" in str(w.message)]) == 1
    # head_dim follows from the other keys: leaving it out is no cause to warn.
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in TINY.items() if k != "head_dim"})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(tmp_path).head_dim == 64


def test_world_size_that_does_not_divide_the_heads_is_rejected():
    with pytest.raises(BeamConfigError, match=r"num_attention_heads=4 .*world size 3"):
        preset("tiny").check_world_size(3)
    with pytest.raises(BeamConfigError, match="num_attention_heads=4"):
        BeamForCausalLM(preset("tiny"), parallel=_parallel(world_size=8))


def test_unknown_preset_and_missing_file_are_named():
    with pytest.raises(BeamConfigError, match=r"'huge'.*beam-1.0-shaped.*tiny"):
        preset("huge")
    with pytest.raises(BeamConfigError, match="no/such/dir"):
        load_config("no/such/dir")


# --- pre-release keys -----------------------------------------------------------------------

# Each value asks for the pre-release behaviour the released model does not have.
PRE_RELEASE = {
    "enable_sandwich_norm": False,
    "mlp_only_layers": [0, 1, 2, 3],
    "nope_layer_ids": [0, 2],
    "moe_router_dtype": "bfloat16",
}


@pytest.mark.parametrize("key, value", PRE_RELEASE.items())
def test_pre_release_key_warns_and_is_dropped(key, value):
    with pytest.warns(UserWarning, match=rf"{key}.*pre-release.*ignored"):
        cfg = BeamConfig(**TINY, **{key: value})
    assert not hasattr(cfg, key)
    assert key not in cfg.to_dict()


def test_pre_release_keys_are_not_obeyed(tmp_path):
    """A config.json carrying every pre-release key builds the released model: same logits."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY, **PRE_RELEASE}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(tmp_path)
    assert {k for k in PRE_RELEASE if any(k in str(w.message) for w in caught)} == set(PRE_RELEASE)
    released = init_random(BeamForCausalLM(BeamConfig(**TINY)), seed=3)
    with_keys = init_random(BeamForCausalLM(cfg), seed=3)
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        assert torch.equal(released(ids), with_keys(ids))
    # The router stays fp32 whatever moe_router_dtype said.
    assert with_keys.model.layers[1].mlp.gate.weight.dtype == torch.float32


# --- presets ------------------------------------------------------------------------------


def test_tiny_preset_has_every_kind_of_layer():
    cfg = preset("tiny")
    assert cfg.num_hidden_layers == 4
    assert (cfg.hidden_size, cfg.head_dim) == (256, 64)
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    assert set(cfg.mlp_layer_types) == {"dense", "sparse"}
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group) == (8, 2, 2)
    assert cfg.topk_group < cfg.n_group  # grouping decides something
    assert cfg.rope_parameters["full_attention"] is None


def test_beam_shaped_preset_and_layer_override():
    cfg = preset("beam-1.0-shaped", num_hidden_layers=6)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (5120, 48, 8)
    assert cfg.head_dim == 128
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (
        256,
        8,
        8,
        4,
    )
    assert cfg.moe_intermediate_size == 1536
    assert cfg.num_hidden_layers == len(cfg.layer_types) == len(cfg.mlp_layer_types) == 6
    assert preset("beam-1.0-shaped").num_hidden_layers == 80
    cfg.check_world_size(8)  # shards at TP8 (48 / 8 heads, 8 / 8 KV heads)


def test_config_round_trips_through_config_json(tmp_path):
    cfg = preset("tiny", num_hidden_layers=3)
    cfg.save_pretrained(tmp_path)
    again = load_config(tmp_path)
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "n_group", "head_dim"):
        assert getattr(again, key) == getattr(cfg, key)
    assert again.residual_scales(2, "mlp") == cfg.residual_scales(2, "mlp")


def test_residual_scales_follow_the_add_number():
    cfg = preset("tiny")
    # Layer index 0: attention add n = 2, MLP add n = 3; xs = 1/sqrt(n), rs = sqrt(n-1)/sqrt(n).
    assert cfg.residual_scales(0, "attn") == pytest.approx((2**-0.5, 0.5**0.5))
    assert cfg.residual_scales(0, "mlp") == pytest.approx((3**-0.5, (2 / 3) ** 0.5))
    assert cfg.residual_scales(3, "mlp") == pytest.approx((9**-0.5, (8 / 9) ** 0.5))
    # Layer i: attention add n = 2i + 2 (at layer 0 its two scales are equal: no swap shows).
    assert cfg.residual_scales(2, "attn") == pytest.approx((6**-0.5, (5 / 6) ** 0.5))
    assert cfg.residual_scales(3, "attn") == pytest.approx((8**-0.5, (7 / 8) ** 0.5))


def _parallel(world_size):
    from beamfx.models.beam import Parallel

    return Parallel(rank=0, world_size=world_size, group_name=None)


def test_a_misspelled_key_is_named_with_the_key_it_resembles():
    near = r"'num_expert_per_tok'.*did you mean 'num_experts_per_tok'"
    with pytest.warns(UserWarning, match=near):
        cfg = BeamConfig(**{**TINY, "num_expert_per_tok": 4})
    assert cfg.num_experts_per_tok == TINY.get("num_experts_per_tok", 2)
