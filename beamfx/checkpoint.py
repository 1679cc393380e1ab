"""HF-format safetensors checkpoints of Beam: save, load (sharded per TP rank), tiny writer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

import torch

from beamfx.config import BeamConfig, preset
from beamfx.quant import check_loaded as check_nvfp4_loaded
from beamfx.quant import load_expert_scale

_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# Row-parallel weights are split along their input (dim 1); column-parallel along output.
_COLUMN = re.compile(
    r"self_attn\.(q_proj|k_proj|v_proj|gate_proj)\.weight$|"
    r"mlp\.(gate_proj|up_proj)\.weight$|self_attn\.gate_bias$"
)
_ROW = re.compile(r"self_attn\.o_proj\.weight$|mlp\.down_proj\.weight$")
_NVFP4_SCALE = re.compile(r"\.(weight_scale|weight_scale_2|input_scale)$")


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's full weights under HF names (world size 1 only)."""
    if model.parallel.world_size != 1:
        raise ValueError(
            f"hf_state_dict needs the unsharded model; this one has world_size="
            f"{model.parallel.world_size}: save from a world-size-1 model"
        )
    out = {}
    for name, p in model.state_dict().items():
        m = re.match(r"(.*\.mlp)\.experts\.(w13|w2)$", name)
        if not m:
            out[name] = p
            continue
        base = m.group(1) + ".experts"
        for e in range(p.shape[0]):
            if m.group(2) == "w13":
                gate, up = p[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = gate
                out[f"{base}.{e}.up_proj.weight"] = up
            else:
                out[f"{base}.{e}.down_proj.weight"] = p[e]
    return {k: v.contiguous() for k, v in out.items()}


class CheckpointError(ValueError):
    """A checkpoint folder that does not hold this model's weights as beamfx reads them."""


@torch.no_grad()
def load_into(model, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy HF-named full tensors into `model`, keeping this rank's shard. Returns names.

    A stacked expert parameter counts as loaded only once every expert's tensors came.
    Written in place (not through `.data`), so each tensor's version moves on and the
    kernels' caches of converted weights (`kernels/moe/weight_cache.py`) rebuild after a
    later load of new weights.
    """
    par = model.parallel
    params = dict(model.named_parameters())
    loaded = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    for name, w in weights:
        m = _EXPERT.match(name)
        if m:
            base, e, kind = m.group(1), int(m.group(2)), m.group(3)
            param = f"{base}.w2" if kind == "down_proj" else f"{base}.w13"
            if param not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in BeamForCausalLM")
            stacked = params[param]
            if not 0 <= e < stacked.shape[0]:
                raise KeyError(
                    f"checkpoint tensor {name!r} names expert {e}, but the model has "
                    f"{stacked.shape[0]} experts: does config.json match the checkpoint?"
                )
            _check_dtype(name, w, stacked.dtype)
            if kind == "down_proj":
                h, inter = stacked.shape[1:]
                _check_shape(name, w, (h, inter * par.world_size))
                stacked[e].copy_(w[:, par.shard(w.shape[1])])
            else:
                half, h = stacked.shape[1] // 2, stacked.shape[2]
                _check_shape(name, w, (half * par.world_size, h))
                rows = slice(0, half) if kind == "gate_proj" else slice(half, 2 * half)
                stacked[e, rows].copy_(w[par.shard(w.shape[0])])
            parts = expert_parts.setdefault(param, set())
            parts.add((e, kind))
            if len(parts) == stacked.shape[0] * (1 if kind == "down_proj" else 2):
                loaded.add(param)
            continue
        nvfp4_scale = load_expert_scale(model, name, w)  # ModelOpt NVFP4 expert scales
        if nvfp4_scale is not None:
            loaded.add(nvfp4_scale)
            continue
        if name not in params and _NVFP4_SCALE.search(name):
            raise CheckpointError(
                f"checkpoint tensor {name!r} is an NVFP4 scale of a module that is not a "
                "routed expert: beamfx reads NVFP4 for routed experts only; export the "
                "checkpoint with the other modules left unquantized (ModelOpt's "
                "exclude_modules)"
            )
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in BeamForCausalLM")
        shape = tuple(params[name].shape)
        _check_dtype(name, w, params[name].dtype)
        if _COLUMN.search(name):
            _check_shape(name, w, (shape[0] * par.world_size, *shape[1:]))
            w = w[par.shard(w.shape[0])]
        elif _ROW.search(name):
            _check_shape(name, w, (shape[0], shape[1] * par.world_size))
            w = w[:, par.shard(w.shape[1])]
        else:
            _check_shape(name, w, shape)
        params[name].copy_(w)
        loaded.add(name)
    return loaded


def _check_dtype(name: str, w: torch.Tensor, dtype: torch.dtype) -> None:
    # A float parameter takes any float tensor (converted on copy); integer codes (int8, the
    # packed uint8 of NVFP4) would be copied as numbers, so they must be what is expected.
    if w.dtype != dtype and not (dtype.is_floating_point and w.dtype.is_floating_point):
        want = "a floating-point tensor" if dtype.is_floating_point else str(dtype)
        if dtype == torch.uint8 and w.dtype.is_floating_point:
            why = (
                "config.json's quantization_config says NVFP4 experts, but the checkpoint "
                "holds unquantized ones: remove quantization_config, or load the NVFP4 export"
            )
        else:
            why = (
                "is the checkpoint quantized in a way config.json's quantization_config does "
                "not say? beamfx reads bf16 checkpoints and ModelOpt NVFP4 routed experts "
                "(other modules unquantized)"
            )
        raise CheckpointError(
            f"checkpoint tensor {name!r} is {w.dtype}, but the model needs {want} there: {why}"
        )


def _check_shape(name: str, w: torch.Tensor, expected: tuple[int, ...]) -> None:
    # Checked on the full tensor: copy_ would broadcast a wrong one, slicing would hide it.
    if tuple(w.shape) != tuple(expected):
        raise CheckpointError(
            f"checkpoint tensor {name!r} has shape {tuple(w.shape)} but the model expects "
            f"{tuple(expected)}: does config.json match the checkpoint?"
        )


def hf_names(model) -> set[str]:
    """The HF tensor names of a full checkpoint of `model` (experts one by one)."""
    names = set()
    for name, p in model.named_parameters():
        m = re.match(r"(.*\.mlp\.experts)\.(w13|w2)$", name)
        if not m:
            names.add(name)
            continue
        kinds = ("gate_proj", "up_proj") if m.group(2) == "w13" else ("down_proj",)
        names.update(f"{m.group(1)}.{e}.{k}.weight" for e in range(p.shape[0]) for k in kinds)
    return names


INDEX = "model.safetensors.index.json"


def iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF folder: the shards its index names (every *.safetensors where
    there is no index), each tensor once."""
    import json

    from safetensors import safe_open

    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        absent = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if absent:
            raise FileNotFoundError(
                f"checkpoint folder {path!r}: {INDEX} names shards that are not there: "
                f"{absent[:3]}; copy them in, or re-save the checkpoint"
            )
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in checkpoint folder {path!r}")
    owner: dict[str, str] = {}
    for f in files:
        try:
            st = safe_open(os.path.join(path, f), framework="pt")
            keys = list(st.keys())  # noqa: SIM118 (safe_open is not a dict)
        except Exception as e:  # a truncated or corrupt file
            raise CheckpointError(
                f"checkpoint file {os.path.join(path, f)!r} cannot be read ({e}): re-download "
                "or re-save it"
            ) from e
        for k in keys:
            if k in owner:
                raise CheckpointError(
                    f"checkpoint tensor {k!r} is in both {owner[k]!r} and {f!r} in {path!r}: "
                    f"keep one (a stale shard? an {INDEX} names the shards to read)"
                )
            owner[k] = f
            yield k, st.get_tensor(k)


def load_checkpoint(
    path: str, parallel=None, dtype: torch.dtype = torch.bfloat16, frontend: str = "semantic"
):
    """A `BeamForCausalLM` from an HF-format folder, sharded for `parallel`."""
    from beamfx.config import load_config
    from beamfx.models.beam import BeamForCausalLM

    model = BeamForCausalLM(load_config(path), parallel, dtype, frontend)
    seen = set()

    def weights():
        for name, w in iter_safetensors(path):
            seen.add(name)
            yield name, w

    load_into(model, weights())
    check_nvfp4_loaded(model)
    missing = hf_names(model) - seen
    if missing:
        raise CheckpointError(
            f"checkpoint {path!r} lacks {sorted(missing)[:5]} (and {max(0, len(missing) - 5)} more)"
        )
    return model


def save_checkpoint(model, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    model.config.save_pretrained(path)
    save_file(hf_state_dict(model), os.path.join(path, "model.safetensors"))


def init_random(model, seed: int = 0):
    """Random weights with realistic scales (norm weights near 1, not all-ones)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        shape = p.shape
        if name.endswith("norm.weight") or "layernorm" in name:
            v = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("gate_bias", "e_score_correction_bias")):
            v = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=g)
        else:
            v = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        p.data.copy_(v.to(p.dtype))
    return model


def write_tiny_tokenizer(path: str, vocab_size: int) -> None:
    """A WordLevel tokenizer: words `w3` ... so any text of such words round-trips."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    vocab["<unk>"] = vocab.pop(f"w{vocab_size - 1}")
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "unk_token": "<unk>",
                "model_max_length": 4096,
            },
            f,
            indent=1,
        )


TINY_MARK = ".beamfx-tiny"  # in a folder beamfx wrote a tiny checkpoint to


def refuse_to_overwrite(path: str) -> None:
    """A tiny checkpoint is written only to a new or empty folder, or over another tiny one:
    never over a checkpoint of someone's (its weights would be replaced)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, TINY_MARK)):
        return
    held = sorted(f for f in os.listdir(path) if f == "config.json" or f.endswith(".safetensors"))
    if held:
        raise CheckpointError(
            f"{path!r} already holds a checkpoint ({', '.join(held[:3])}) that beamfx did not "
            "write; writing the tiny one there would replace it: choose another folder"
        )


def mark_tiny(path: str) -> None:
    with open(os.path.join(path, TINY_MARK), "w") as f:
        f.write("a random tiny Beam checkpoint written by beamfx\n")


def write_tiny_checkpoint(path: str, config: BeamConfig | str = "tiny", seed: int = 0) -> str:
    """config.json + model.safetensors (random bf16 weights, fp32 router) + tokenizer."""
    from beamfx.models.beam import BeamForCausalLM

    refuse_to_overwrite(path)
    cfg = preset(config) if isinstance(config, str) else config
    cfg.architectures = ["BeamForCausalLM"]
    cfg.dtype = "bfloat16"
    model = init_random(BeamForCausalLM(cfg), seed)
    save_checkpoint(model, path)
    write_tiny_tokenizer(path, cfg.vocab_size)
    mark_tiny(path)
    return path
