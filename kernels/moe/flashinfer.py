"""SM100 (Blackwell) NVFP4 MoE: FlashInfer's CuTeDSL fused MoE, W4A16 mode (bf16 activations).

Chosen only where `torch.cuda.get_device_capability() >= (10, 0)` and FlashInfer imports;
elsewhere (the project's H200 included) `supports` says why and the Triton provider
serves. Untested on hardware here: no Blackwell GPU is lent to this project.

FlashInfer 0.7.2 `cute_dsl_fused_moe(..., quant_mode="w4a16")` wants its own weight
layout: FC1 rows interleaved in 64-row granules, up before gate
(`[up 0:64, gate 0:64, up 64:128, ...]`), and block scales swizzled to the tensor-core
128x4 layout. `to_flashinfer_layout` converts ModelOpt's layout once per weight (cached on
the tensors' storage). Its FC1 takes one global scale per expert, so `supports` declines
experts whose gate and up global scales differ (the next provider serves them).
"""

from __future__ import annotations

import functools

import torch
from torch._subclasses.fake_tensor import is_fake

from beamfx.kernels.moe.reference import why_not_layout
from beamfx.kernels.moe.weight_cache import WeightCache
from beamfx.ops import Provider

MIN_CAPABILITY = (10, 0)
_GRANULE = 64  # FC1 up/gate interleave granularity of FlashInfer's gated epilogue


@functools.cache
def _flashinfer_moe():
    """FlashInfer's fused-MoE entry point, or None with the import error's text."""
    try:
        from flashinfer.fused_moe import cute_dsl_fused_moe
    except Exception as err:  # ImportError, or a CUDA/CuTeDSL setup error on import
        return None, f"FlashInfer's CuTeDSL MoE does not import: {err}"
    return cute_dsl_fused_moe, None


def why_not_device(device: torch.device) -> str | None:
    """None if FlashInfer's NVFP4 MoE can run on `device`, else the reason."""
    if device.type != "cuda":
        return f"needs a CUDA device (SM100+), got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"needs compute capability >= {MIN_CAPABILITY} (Blackwell), this GPU is {cap}"
    return _flashinfer_moe()[1]


def interleave_up_gate(w13: torch.Tensor) -> torch.Tensor:
    """`[E, 2I, X]` gate-then-up rows -> FlashInfer's 64-row granules, up first."""
    e, two_i, rest = w13.shape[0], w13.shape[1], w13.shape[2:]
    inter = two_i // 2
    if inter % _GRANULE:
        raise ValueError(f"FlashInfer's FC1 needs moe_intermediate % 64 == 0, got {inter}")
    gate, up = w13[:, :inter], w13[:, inter:]
    granules = (e, inter // _GRANULE, _GRANULE, *rest)
    return torch.stack((up.reshape(granules), gate.reshape(granules)), 2).reshape(w13.shape)


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales `[E, M, K/16]` -> the 128x4 tensor-core layout, flat per expert.

    Row m and scale column c land at `(m // 128, c // 4, m % 32, (m % 128) // 32, c % 4)`
    (M padded to 128, K/16 to 4 with zeros).
    """
    e, m, c = scale.shape
    mp, cp = -(-m // 128) * 128, -(-c // 4) * 4
    raw = scale.view(torch.uint8)
    padded = raw.new_zeros(e, mp, cp)
    padded[:, :m, :c] = raw
    tiles = padded.view(e, mp // 128, 4, 32, cp // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.contiguous().view(torch.float8_e4m3fn).reshape(e, -1)


def unswizzle_block_scales(swizzled: torch.Tensor, m: int, c: int) -> torch.Tensor:
    """Inverse of `swizzle_block_scales` (tests and debugging)."""
    e = swizzled.shape[0]
    mp, cp = -(-m // 128) * 128, -(-c // 4) * 4
    tiles = swizzled.view(torch.uint8).view(e, mp // 128, cp // 4, 32, 4, 4)
    rows = tiles.permute(0, 1, 4, 3, 2, 5).reshape(e, mp, cp)
    return rows[:, :m, :c].contiguous().view(torch.float8_e4m3fn)


def to_flashinfer_layout(w13, w13_scale, w13_global, w2, w2_scale, w2_global):
    """FlashInfer W4A16 weights from ModelOpt-layout NVFP4 experts (see the module docs)."""
    if not torch.equal(w13_global[:, 0], w13_global[:, 1]):
        raise ValueError(
            "FlashInfer's FC1 takes one global scale per expert, but gate and up scales "
            "differ: requantize them with a shared weight_scale_2, or use the Triton provider"
        )
    return (
        interleave_up_gate(w13).contiguous(),
        swizzle_block_scales(interleave_up_gate(w13_scale)),
        w13_global[:, 0].float().contiguous(),
        w2.contiguous(),
        swizzle_block_scales(w2_scale),
        w2_global.float().contiguous(),
    )


PREPARED = WeightCache()  # one entry per layer: a copy of its experts in FlashInfer's layout


def _prepare(*weights):
    return PREPARED.get(weights, lambda: to_flashinfer_layout(*weights))


def mega_moe_nvfp4(
    x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, routed_scale
):
    fused_moe = _flashinfer_moe()[0]
    w1, w1_sf, w1_alpha, w2f, w2_sf, w2_alpha = _prepare(
        w13, w13_scale, w13_global, w2, w2_scale, w2_global
    )
    # FlashInfer's combine is sum_j scale[t, j] * row; the routed scale folds into the weights.
    scales = (topk_weights.float() * routed_scale).contiguous()
    return fused_moe(
        x.contiguous(),
        None,
        topk_ids.to(torch.int32).contiguous(),
        scales,
        w1,
        w1_sf,
        w1_alpha,
        None,
        w2f,
        w2_sf,
        w2_alpha,
        num_experts=w13.shape[0],
        top_k=topk_ids.shape[1],
        quant_mode="w4a16",
    )


SHARED_GLOBALS = WeightCache()  # per w13_global: None, or why gate and up differ


def why_not_globals(w13_global: torch.Tensor) -> str | None:
    """FlashInfer's FC1 takes one global scale an expert: gate and up must share theirs.
    A value check (a host sync), made once per tensor; while compiling (fake tensors) it
    is left to the run-time call, where the dispatcher asks again."""
    if is_fake(w13_global):
        return None

    def check():
        if torch.equal(w13_global[:, 0], w13_global[:, 1]):
            return None
        return (
            "FlashInfer's FC1 takes one global scale per expert, but gate and up scales "
            "differ (requantize them with a shared weight_scale_2)"
        )

    return SHARED_GLOBALS.get((w13_global,), check)


def supports_mega_moe_nvfp4(x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, *rest):
    reason = why_not_device(x.device)
    if reason:
        return reason
    if x.dtype != torch.bfloat16:
        return f"FlashInfer's W4A16 MoE needs bf16 activations, got {x.dtype}"
    if (w13.shape[1] // 2) % _GRANULE or x.shape[-1] % 64:
        return "FlashInfer's W4A16 MoE needs hidden and moe_intermediate multiples of 64"
    scales = (w13_scale, w13_global, *rest[:2])
    return why_not_layout(x, topk_ids, w13, w2, scales) or why_not_globals(w13_global)


MEGA_MOE_NVFP4 = Provider("flashinfer_cutedsl", mega_moe_nvfp4, supports_mega_moe_nvfp4)
