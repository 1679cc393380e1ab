"""HF-format checkpoints: round trip, TP shards, the tiny writer, and clear loading errors."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from beamfx.checkpoint import (
    CheckpointError,
    hf_names,
    init_random,
    load_checkpoint,
    save_checkpoint,
    write_tiny_checkpoint,
)
from beamfx.config import BeamConfigError, preset
from beamfx.models.beam import BeamForCausalLM, Parallel

IDS = torch.tensor([[5, 17, 42, 99, 3, 7, 300, 11], [8, 9, 10, 11, 12, 13, 14, 15]])


def test_round_trip_gives_identical_weights_and_logits(tmp_path):
    model = init_random(BeamForCausalLM(preset("tiny", num_hidden_layers=2)), seed=7)
    save_checkpoint(model, str(tmp_path))
    again = load_checkpoint(str(tmp_path))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(model(IDS), again(IDS))


def test_checkpoint_uses_the_hf_names_and_dtypes(tiny_checkpoint):
    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    names = set(tensors)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.0.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.gate_proj.weight",
        "model.layers.0.self_attn.gate_bias",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.up_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in names
    assert not any(".w13" in n or ".w2" in n for n in names)  # stacking is internal
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert names == hf_names(BeamForCausalLM(preset("tiny")))


def test_tiny_checkpoint_has_config_and_a_working_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"] == ["BeamForCausalLM"]
    assert config["layer_types"] == preset("tiny").layer_types
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tok("w3 w17 w500")["input_ids"]
    assert ids == [3, 17, 500]
    assert tok.decode(ids) == "w3 w17 w500"


def test_tiny_checkpoint_is_deterministic_per_seed(tmp_path):
    a = write_tiny_checkpoint(str(tmp_path / "a"), preset("tiny", num_hidden_layers=1), seed=1)
    b = write_tiny_checkpoint(str(tmp_path / "b"), preset("tiny", num_hidden_layers=1), seed=1)
    ta, tb = (load_file(os.path.join(p, "model.safetensors")) for p in (a, b))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


# --- tensor-parallel shards ---------------------------------------------------------------


def test_shards_are_the_right_slices(tiny_checkpoint):
    world_size = 2  # tiny has 2 KV heads: the largest world size that shards it
    full = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    shards = [
        dict(load_checkpoint(tiny_checkpoint, Parallel(r, world_size, "unused")).named_parameters())
        for r in range(world_size)
    ]
    a, e = "model.layers.0.self_attn", "model.layers.1.mlp.experts"

    def cat(name, dim):
        return torch.cat([s[name].data for s in shards], dim=dim)

    # Column-parallel: output rows split by rank (whole heads); row-parallel: input columns.
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj"):
        assert torch.equal(cat(f"{a}.{proj}.weight", 0), full[f"{a}.{proj}.weight"])
    assert torch.equal(cat(f"{a}.gate_bias", 0), full[f"{a}.gate_bias"])
    assert torch.equal(cat(f"{a}.o_proj.weight", 1), full[f"{a}.o_proj.weight"])
    m = "model.layers.0.mlp"
    assert torch.equal(cat(f"{m}.gate_proj.weight", 0), full[f"{m}.gate_proj.weight"])
    assert torch.equal(cat(f"{m}.down_proj.weight", 1), full[f"{m}.down_proj.weight"])
    # Rank 1's heads are the second block of head_dim-row groups.
    d, heads = 64, 4 // world_size
    assert torch.equal(
        shards[1][f"{a}.q_proj.weight"], full[f"{a}.q_proj.weight"][heads * d : 2 * heads * d]
    )
    # Experts: each rank holds gate and up rows of its slice of the intermediate, and the
    # matching columns of down; every expert is present on every rank.
    inter = 128 // world_size
    for r, s in enumerate(shards):
        rows = slice(r * inter, (r + 1) * inter)
        for x in (0, 5):
            w13 = s[f"{e}.w13"][x]
            assert torch.equal(w13[:inter], full[f"{e}.{x}.gate_proj.weight"][rows])
            assert torch.equal(w13[inter:], full[f"{e}.{x}.up_proj.weight"][rows])
            assert torch.equal(s[f"{e}.w2"][x], full[f"{e}.{x}.down_proj.weight"][:, rows])
    # Replicated: norms, router, embeddings, head.
    for name in (
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        f"{a}.q_norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        for s in shards:
            assert torch.equal(s[name].data, full[name].to(s[name].dtype)), name


# --- loading errors -----------------------------------------------------------------------


def _broken_copy(src, dst, change):
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def _bf16(*shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


E3_UP = "model.layers.1.mlp.experts.3.up_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"

BROKEN = {
    "missing norm": (lambda t: t.pop("model.norm.weight"), ValueError, r"lacks.*model\.norm"),
    "missing one expert tensor": (lambda t: t.pop(E3_UP), ValueError, rf"lacks.*{E3_UP}"),
    "wrong norm shape": (
        lambda t: t.update({"model.norm.weight": _bf16(255)}),
        ValueError,
        r"model\.norm\.weight.*\(255,\).*expects \(256,\)",
    ),
    "wrong projection shape": (
        lambda t: t.update({Q: _bf16(200, 256)}),
        ValueError,
        r"q_proj.*\(200, 256\).*expects \(256, 256\)",
    ),
    # A [1, H] tensor would broadcast silently into every row.
    "broadcastable expert shape": (
        lambda t: t.update({E3_UP: _bf16(1, 256)}),
        ValueError,
        r"experts\.3\.up_proj.*\(1, 256\).*expects \(128, 256\)",
    ),
    "wrong expert down shape": (
        lambda t: t.update({"model.layers.1.mlp.experts.3.down_proj.weight": _bf16(256, 64)}),
        ValueError,
        r"down_proj.*\(256, 64\).*expects \(256, 128\)",
    ),
    "expert out of range": (
        lambda t: t.update({"model.layers.1.mlp.experts.9.up_proj.weight": _bf16(128, 256)}),
        KeyError,
        r"experts\.9.*8 experts",
    ),
    # int8 codes copied into a bf16 weight as numbers: logits off, no error.
    "integer codes in a float weight": (
        lambda t: t.update({Q: torch.ones(256, 256, dtype=torch.int8)}),
        CheckpointError,
        r"q_proj.weight' is torch\.int8, but the model needs a floating-point tensor",
    ),
    "unknown tensor": (
        lambda t: t.update({"model.layers.0.mlp.extra.weight": _bf16(2)}),
        KeyError,
        r"model\.layers\.0\.mlp\.extra\.weight.*no place",
    ),
}


@pytest.mark.parametrize("change, error, match", BROKEN.values(), ids=BROKEN.keys())
def test_broken_checkpoint_gives_a_clear_error(tiny_checkpoint, tmp_path, change, error, match):
    path = _broken_copy(tiny_checkpoint, tmp_path / "broken", change)
    with pytest.raises(error, match=match):
        load_checkpoint(path)


def test_wrong_shape_is_caught_on_the_full_tensor_when_sharded(tiny_checkpoint, tmp_path):
    path = _broken_copy(
        tiny_checkpoint, tmp_path / "broken", lambda t: t.update({Q: _bf16(200, 256)})
    )
    with pytest.raises(ValueError, match=r"\(200, 256\).*expects \(256, 256\)"):
        load_checkpoint(path, Parallel(1, 2, "unused"))


def test_folder_without_weights_is_named(tmp_path):
    preset("tiny").save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_checkpoint(str(tmp_path))


def test_a_tensor_in_two_files_is_named(tiny_checkpoint, tmp_path):
    """A tensor in two *.safetensors files loaded from the file that sorts last."""
    path = shutil.copytree(tiny_checkpoint, tmp_path / "two")
    save_file({Q: _bf16(256, 256)}, os.path.join(path, "model-extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight' is in both 'model-extra"):
        load_checkpoint(str(path))


def test_the_index_names_the_shards_to_read(tiny_checkpoint, tmp_path):
    """With model.safetensors.index.json, a stale shard beside the listed ones was read (and
    won where it sorted last); the index decides now, and a shard it names must be there."""
    path = shutil.copytree(tiny_checkpoint, tmp_path / "indexed")
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    save_file({Q: torch.full((256, 256), 7.0, dtype=torch.bfloat16)},
              os.path.join(path, "old-00001.safetensors"))  # fmt: skip
    model = load_checkpoint(str(path))
    assert not (model.state_dict()[Q] == 7).all()
    index["weight_map"][Q] = "model-00002.safetensors"
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(FileNotFoundError, match=r"names shards that are not there.*00002"):
        load_checkpoint(str(path))


def test_an_unreadable_file_is_named(tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint, tmp_path / "cut")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointError, match=r"model.safetensors' cannot be read .*re-download"):
        load_checkpoint(str(path))
    with open(os.path.join(path, "config.json"), "a") as f:
        f.write("}")
    with pytest.raises(BeamConfigError, match=r"config.json' is not valid JSON"):
        load_checkpoint(str(path))


def test_the_tiny_writer_never_replaces_a_checkpoint_it_did_not_write(tiny_checkpoint, tmp_path):
    """`beamfx write-tiny DIR` (and `demo --out DIR`) over a real checkpoint replaced its
    config, weights and tokenizer without a word. Over its own tiny one it may write again."""
    from beamfx.quant import write_tiny_nvfp4_checkpoint

    theirs = shutil.copytree(tiny_checkpoint, tmp_path / "theirs")
    os.remove(os.path.join(theirs, ".beamfx-tiny"))
    before = load_file(os.path.join(theirs, "model.safetensors"))[Q]
    for write in (write_tiny_checkpoint, write_tiny_nvfp4_checkpoint):
        with pytest.raises(CheckpointError, match="already holds a checkpoint .*config.json"):
            write(str(theirs), "tiny", seed=5)
    assert torch.equal(load_file(os.path.join(theirs, "model.safetensors"))[Q], before)
    ours = shutil.copytree(tiny_checkpoint, tmp_path / "ours")
    write_tiny_checkpoint(str(ours), "tiny", seed=5)
    assert not torch.equal(load_file(os.path.join(ours, "model.safetensors"))[Q], before)
