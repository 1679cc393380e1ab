"""ModelOpt NVFP4 checkpoints of Beam: load expert scales by their HF names, write tiny ones.

ModelOpt names each expert projection's tensors `weight` (uint8, two E2M1 codes a byte),
`weight_scale` (float8_e4m3fn, one per 16 values), `weight_scale_2` (fp32 global) and
`input_scale` (fp32, the activation scale W4A4 kernels use). The packed `weight` loads like
a bf16 expert weight (same sharding, half the columns); this module places the others.
Format and math: `beamfx.kernels.moe.nvfp4`.
"""

from __future__ import annotations

import os
import re

import torch

from beamfx.kernels.moe.nvfp4 import NVFP4Error, check_scale_values, quantize

QUANTIZATION_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
_SCALE = re.compile(
    r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight_scale|weight_scale_2|input_scale)$"
)


def load_expert_scale(model, name: str, tensor: torch.Tensor) -> str | None:
    """Copy one NVFP4 expert scale into `model` (this rank's shard); None if `name` is not one.

    Returns the name of the buffer written.
    """
    m = _SCALE.match(name)
    if not m:
        return None
    base, e, kind, what = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    try:
        experts = model.get_submodule(base)
    except AttributeError:
        raise KeyError(f"checkpoint tensor {name!r} has no place in BeamForCausalLM") from None
    if not hasattr(experts, "w13_global"):
        raise NVFP4Error(
            f"checkpoint tensor {name!r} is NVFP4, but config.json has no ModelOpt NVFP4 "
            "quantization_config: add it (quant_method 'modelopt', quant_algo 'NVFP4')"
        )
    if not 0 <= e < experts.w13.shape[0]:
        raise KeyError(f"checkpoint tensor {name!r} names expert {e} of {experts.w13.shape[0]}")
    half = 0 if kind == "gate_proj" else 1
    par = model.parallel
    if what == "weight_scale":
        if tensor.dtype != torch.float8_e4m3fn:
            raise NVFP4Error(
                f"checkpoint tensor {name!r} is {tensor.dtype}; an NVFP4 weight_scale is "
                "torch.float8_e4m3fn (ModelOpt's E4M3 block scales): re-export the checkpoint"
            )
        if tensor.dim() != 2:
            raise NVFP4Error(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; an NVFP4 "
                "weight_scale is 2-D [N, K/16] (one scale per 16 values)"
            )
        if kind == "down_proj":
            dst, w = experts.w2_scale[e], tensor[:, par.shard(tensor.shape[1])]
        else:
            inter = experts.w13_scale.shape[1] // 2
            dst = experts.w13_scale[e, half * inter : (half + 1) * inter]
            w = tensor[par.shard(tensor.shape[0])]
        if (
            w.shape != dst.shape
            or tensor.shape[0] * tensor.shape[1] != dst.numel() * par.world_size
        ):
            raise NVFP4Error(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; this model's "
                f"shard needs {tuple(dst.shape)} (one scale per 16 values): does config.json "
                "match the checkpoint?"
            )
        dst.copy_(w.to(dst.dtype))
        return f"{base}.{'w2' if kind == 'down_proj' else 'w13'}_scale"
    if tensor.numel() != 1:
        raise NVFP4Error(f"checkpoint tensor {name!r} must be a scalar, got {tuple(tensor.shape)}")
    if not tensor.is_floating_point():
        raise NVFP4Error(
            f"checkpoint tensor {name!r} is {tensor.dtype}; an NVFP4 {what} is an fp32 scalar: "
            "re-export the checkpoint"
        )
    field = "global" if what == "weight_scale_2" else "input_scale"
    if kind == "down_proj":
        getattr(experts, f"w2_{field}")[e] = tensor.reshape(())
        return f"{base}.w2_{field}"
    getattr(experts, f"w13_{field}")[e, half] = tensor.reshape(())
    return f"{base}.w13_{field}"


def _checkpoint_names(experts: str, part: str, inter: int | None = None):
    """Labels naming an entry of `part`'s block scales ([E, rows, K/16]; w13's rows are
    gate's `inter` then up's) and global scales ([E, 2] for w13, [E] for w2) by the
    checkpoint tensor it was loaded from."""

    def proj(e: int, half: int) -> str:
        kind = "down_proj" if part == "w2" else ("gate_proj", "up_proj")[half]
        return f"{experts}.{e}.{kind}"

    def block(i: list[int]) -> str:
        e, row = i[0], i[1]
        return f"{proj(e, row // inter if inter else 0)}.weight_scale"

    def global_(i: list[int]) -> str:
        return f"{proj(i[0], i[1] if len(i) > 1 else 0)}.weight_scale_2"

    return block, global_


def check_loaded(model) -> None:
    """Raise `NVFP4Error` if an NVFP4 expert stack lacks scales or holds invalid ones."""
    for name, module in model.named_modules():
        if hasattr(module, "w13_global"):
            for part in ("w13", "w2"):
                g = getattr(module, f"{part}_global")
                if torch.isnan(g).any():
                    raise NVFP4Error(
                        f"{name}.{part}: the checkpoint lacks weight_scale_2 of some experts "
                        f"({int(torch.isnan(g).sum())} missing)"
                    )
                scale = getattr(module, f"{part}_scale")
                # An unloaded weight_scale leaves its rows at the buffer's NaN.
                unset = scale.float().isnan().all(-1).any(1).nonzero().flatten().tolist()
                if unset:
                    raise NVFP4Error(
                        f"{name}.{part}: the checkpoint lacks the weight_scale of experts "
                        f"{unset[:8]}{' ...' if len(unset) > 8 else ''}: add them"
                    )
                inter = scale.shape[1] // 2 if part == "w13" else None
                check_scale_values(
                    scale, g, f"{name}.{part}", *_checkpoint_names(name, part, inter)
                )


def nvfp4_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors with every expert projection quantized to ModelOpt NVFP4 (names included)."""
    out = {}
    expert = re.compile(r".*\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
    for name, w in state.items():
        if not expert.match(name):
            out[name] = w
            continue
        q = quantize(w)
        base = name[: -len(".weight")]
        out[name] = q.packed.contiguous()
        out[f"{base}.weight_scale"] = q.scale.contiguous()
        out[f"{base}.weight_scale_2"] = q.global_scale.reshape(())
        out[f"{base}.input_scale"] = (w.float().abs().amax() / (6.0 * 448.0)).reshape(())
    return out


def write_tiny_nvfp4_checkpoint(path: str, config="tiny", seed: int = 0) -> str:
    """A tiny Beam checkpoint whose experts are ModelOpt NVFP4 (random weights, quantized)."""
    from safetensors.torch import save_file

    from beamfx.checkpoint import (
        hf_state_dict,
        init_random,
        mark_tiny,
        refuse_to_overwrite,
        write_tiny_tokenizer,
    )
    from beamfx.config import preset
    from beamfx.models.beam import BeamForCausalLM

    refuse_to_overwrite(path)
    cfg = preset(config) if isinstance(config, str) else config
    cfg.architectures = ["BeamForCausalLM"]
    cfg.dtype = "bfloat16"
    state = hf_state_dict(init_random(BeamForCausalLM(cfg), seed))
    cfg.quantization_config = dict(QUANTIZATION_CONFIG)
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    save_file(nvfp4_state_dict(state), os.path.join(path, "model.safetensors"))
    write_tiny_tokenizer(path, cfg.vocab_size)
    mark_tiny(path)
    return path
