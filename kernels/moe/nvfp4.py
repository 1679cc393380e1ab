"""NVFP4 weights in NVIDIA ModelOpt's layout: E2M1 values, an E4M3 scale per 16, an fp32 global.

A weight `W [..., N, K]` is stored as
- `packed` uint8 `[..., N, K/2]`: two E2M1 codes per byte, element `2j` in the low nibble and
  `2j+1` in the high nibble (ModelOpt's `weight`);
- `scale` float8_e4m3fn `[..., N, K/16]`: one scale per 16 consecutive values along K
  (ModelOpt's `weight_scale`, linear layout, not the swizzled layout of tensor-core kernels);
- `global_scale` fp32, one per matrix (ModelOpt's `weight_scale_2` = amax / (6 * 448)).
`W[n, k] = e2m1(code[n, k]) * float(scale[n, k // 16]) * global_scale`.

Quantization follows ModelOpt: the block scale is `amax(block) / (6 * global)` rounded to
E4M3 (an all-zero block gets 1.0; a nonzero block whose scale underflows E4M3 keeps its
smallest, 2^-9, where ModelOpt's would be 0), values are divided by `scale * global` in fp32
and rounded to the nearest E2M1 value, ties to even, saturating at +-6.

Error bound of a round trip (`dequantize(quantize(x))`), with `S = scale * global` the
block's effective scale: every element satisfies
`|x - x'| <= S * half_step(min(|x| / S, 6)) + max(0, |x| - 6 S)`, where `half_step` is half
the E2M1 spacing at that magnitude (0.25 below 2, 0.5 below 4, 1 up to 6). For a block
whose scale is an E4M3 normal number (block amax >= 2^-6 * 6 * global), this gives
`|x - x'| <= (1 + 2^-4) / 6 * amax(block)` (about 0.177 amax). Values that are already
E2M1 multiples of an exact block scale (every block holding a +-6 code) round-trip exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16  # values per E4M3 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN = 2.0**-9  # E4M3's smallest subnormal
# Code -> value. Codes 0-7 are +0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
# Decision points between consecutive magnitudes; a tie goes to the even code (0, 1, 2, 4, 6).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_ROUND_UP = (0.75, 1.75, 3.5)  # ties whose upper neighbour has the even code


class NVFP4Error(ValueError):
    """An NVFP4 tensor or scale that the format does not allow."""


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0-15) of `x`: round to nearest, ties to even, saturate at +-6."""
    if x.is_floating_point() and torch.isnan(x).any():
        raise NVFP4Error("encode_e2m1 got NaN values: NVFP4 has no NaN; clean the input first")
    xf = x.float()
    mag = xf.abs()
    bounds = torch.tensor(_E2M1_BOUNDS, device=x.device)
    code = torch.searchsorted(bounds, mag.contiguous(), right=False).to(torch.uint8)
    ties = torch.tensor(_TIES_ROUND_UP, device=x.device)
    code += (mag.unsqueeze(-1) == ties).any(-1).to(torch.uint8)
    sign = torch.signbit(xf).to(torch.uint8) << 3
    return code | sign


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of E2M1 codes (any integer dtype, 0-15)."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: element 2j low nibble, 2j+1 high nibble."""
    if codes.shape[-1] % 2:
        raise NVFP4Error(
            f"pack_e2m1 needs an even last dimension, got shape {tuple(codes.shape)}: pad K to "
            "a multiple of 16"
        )
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2K] of packed bytes [..., K] (inverse of `pack_e2m1`)."""
    if packed.dtype != torch.uint8:
        raise NVFP4Error(f"packed NVFP4 data must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def global_scale_of(x: torch.Tensor) -> torch.Tensor:
    """ModelOpt's per-matrix global scale of `x [..., N, K]`: amax / (6 * 448), fp32 [...]."""
    return x.float().abs().amax(dim=(-2, -1)) / (E2M1_MAX * E4M3_MAX)


@dataclass(frozen=True)
class NVFP4Tensor:
    """A weight in ModelOpt's NVFP4 layout (see the module docstring)."""

    packed: torch.Tensor  # uint8 [..., N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    global_scale: torch.Tensor  # fp32 [...]: one per matrix

    def __post_init__(self) -> None:
        check(self.packed, self.scale, self.global_scale)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:-1], self.packed.shape[-1] * 2))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.global_scale, dtype)


def check(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> None:
    """Raise `NVFP4Error` unless the three tensors form a valid NVFP4 weight (shapes/dtypes)."""
    if packed.dtype != torch.uint8:
        raise NVFP4Error(
            f"NVFP4 packed weight must be uint8 (two E2M1 codes a byte), got {packed.dtype}"
        )
    if packed.dim() < 2:
        raise NVFP4Error(f"NVFP4 weight must be at least 2-D [N, K/2], got {packed.dim()}-D")
    k = packed.shape[-1] * 2
    if k % BLOCK:
        raise NVFP4Error(
            f"NVFP4 weight K={k} (packed last dim {packed.shape[-1]}) is not a multiple of "
            f"{BLOCK}: pad the input dimension to a multiple of {BLOCK}"
        )
    want = (*packed.shape[:-1], k // BLOCK)
    if tuple(scale.shape) != want:
        raise NVFP4Error(
            f"NVFP4 block scale has shape {tuple(scale.shape)} but packed weight "
            f"{tuple(packed.shape)} needs {want} (one scale per {BLOCK} values along K)"
        )
    if not scale.is_floating_point():
        raise NVFP4Error(
            f"NVFP4 block scale must be float8_e4m3fn (or a float holding its values), got "
            f"{scale.dtype}"
        )
    lead = tuple(packed.shape[:-2])
    if tuple(global_scale.shape) not in (lead, ()):
        raise NVFP4Error(
            f"NVFP4 global scale has shape {tuple(global_scale.shape)}; expected {lead} (one "
            "per matrix) or a scalar"
        )


def _entries(t: torch.Tensor, bad: torch.Tensor, label) -> str:
    """The first bad entries of `t`, each as `label(index) = value`."""
    shown = [f"{label(i)} = {t[tuple(i)].item():.4g}" for i in bad.nonzero()[:4].tolist()]
    more = int(bad.sum()) - len(shown)
    return ", ".join(shown) + (f" (and {more} more)" if more > 0 else "")


def check_scale_values(
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    name: str = "",
    scale_label=None,
    global_label=None,
) -> None:
    """Raise `NVFP4Error` if block or global scales are negative, NaN or infinite (host sync),
    naming the bad entries: `scale_label(index)` / `global_label(index)` (an index list) name
    one entry, e.g. as the checkpoint tensor it came from."""
    what = f" of {name}" if name else ""
    s = scale.float()
    bad = ~torch.isfinite(s) | (s < 0)
    if bad.any():
        label = scale_label or (lambda i: f"{name or 'scale'}{i}")
        raise NVFP4Error(
            f"NVFP4 block scales{what} must be finite and >= 0; found "
            f"{_entries(s, bad, label)}: the checkpoint is damaged"
        )
    g = global_scale.float()
    bad = ~torch.isfinite(g) | (g <= 0)
    if bad.any():
        label = global_label or (lambda i: f"{name or 'global scale'}{i}")
        raise NVFP4Error(
            f"NVFP4 global scale{what} must be finite and > 0; got {_entries(g, bad, label)}: "
            "weight_scale_2 is amax / (6 * 448)"
        )


def quantize(x: torch.Tensor, global_scale: torch.Tensor | float | None = None) -> NVFP4Tensor:
    """NVFP4 of `x [..., N, K]` (K a multiple of 16), one global scale per matrix.

    `global_scale` defaults to ModelOpt's amax / (6 * 448) per matrix; a given one must be
    large enough that no block scale exceeds 448 (E4M3's largest value).
    """
    if not x.is_floating_point():
        raise NVFP4Error(f"quantize needs a floating-point tensor, got {x.dtype}")
    if x.dim() < 2 or x.shape[-1] % BLOCK:
        raise NVFP4Error(
            f"quantize needs x [..., N, K] with K a multiple of {BLOCK}, got shape "
            f"{tuple(x.shape)}: pad K"
        )
    xf = x.float()
    if not torch.isfinite(xf).all():
        raise NVFP4Error(
            "quantize got NaN or inf values (or values beyond fp32's range): NVFP4 holds "
            "finite fp32 numbers only"
        )
    lead = x.shape[:-2]
    if global_scale is None:
        g = global_scale_of(xf)
        tiny = (g > 0) & (g < torch.finfo(torch.float32).tiny)
        if tiny.any():
            amax = xf.abs().amax((-2, -1))[tiny].min().item()
            raise NVFP4Error(
                f"quantize got a matrix whose largest magnitude is {amax:.4g}: its global scale "
                "amax / (6 * 448) is below fp32's smallest normal number; scale the values up"
            )
        g = torch.where(g > 0, g, torch.ones_like(g))  # an all-zero matrix: any scale works
    else:
        g = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
        g = g.expand(lead) if g.dim() == 0 else g
        if not (torch.isfinite(g) & (g > 0)).all():
            raise NVFP4Error(
                f"quantize got global_scale {g.flatten()[:4].tolist()}: it must be finite and "
                "> 0 (ModelOpt's is amax / (6 * 448) of the matrix)"
            )
    if g.shape != lead:
        raise NVFP4Error(f"global_scale has shape {tuple(g.shape)}; expected {tuple(lead)}")
    gb = g.reshape(*lead, 1, 1, 1)
    blocks = xf.unflatten(-1, (-1, BLOCK))  # [..., N, K/16, 16]
    block_scale = blocks.abs().amax(-1, keepdim=True) / (E2M1_MAX * gb)
    # amax / (6 * amax / (6 * 448)) can land an ulp above 448: clamp that, reject real overflow.
    if (block_scale > E4M3_MAX * (1 + 1e-5)).any():
        raise NVFP4Error(
            f"global_scale is too small: a block scale reaches {block_scale.max().item():.4g} > "
            f"{E4M3_MAX} (E4M3's largest); use at least amax / (6 * 448)"
        )
    nonzero = block_scale > 0
    if global_scale is not None and (nonzero & (block_scale < E4M3_MIN / 2)).any():
        least = block_scale[nonzero].min().item()
        raise NVFP4Error(
            f"global_scale is too large: a nonzero block's scale {least:.4g} is below E4M3's "
            f"smallest ({E4M3_MIN:.4g}), so its values would all quantize to zero; use "
            "amax / (6 * 448)"
        )
    # A nonzero block whose scale underflows E4M3 keeps the smallest scale (not 0, which
    # would drop its values); an all-zero block takes 1.
    block_scale = block_scale.clamp(min=E4M3_MIN, max=E4M3_MAX)
    block_scale = torch.where(nonzero, block_scale, torch.ones_like(block_scale))
    scale = block_scale.to(torch.float8_e4m3fn)
    effective = scale.float() * gb
    scaled = torch.where(effective > 0, blocks / effective, torch.zeros_like(blocks))
    codes = encode_e2m1(scaled.flatten(-2))
    return NVFP4Tensor(pack_e2m1(codes), scale.squeeze(-1), g)


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`e2m1 * (scale * global)` in fp32 (fp64 for fp64), rounded once to `dtype`."""
    check(packed, scale, global_scale)
    acc = torch.promote_types(dtype, torch.float32)
    values = decode_e2m1(unpack_e2m1(packed), acc).unflatten(-1, (-1, BLOCK))
    g = global_scale.to(acc)
    g = g.reshape(*g.shape, 1, 1) if g.dim() else g
    block_scale = (scale.to(acc) * g).unsqueeze(-1)
    return (values * block_scale).flatten(-2).to(dtype)


@dataclass(frozen=True)
class NVFP4Experts:
    """Stacked expert weights in the op layout of `moe_experts_nvfp4`.

    `w13 [E, 2I, H/2]` holds gate rows then up rows; gate and up keep their own global
    scales (`w13_global [E, 2]`), as ModelOpt exports them; `w2 [E, H, I/2]`, `w2_global [E]`.
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_global: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_global: torch.Tensor

    def __post_init__(self) -> None:
        check_experts(*self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.w13, self.w13_scale, self.w13_global, self.w2, self.w2_scale, self.w2_global)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_experts(*self.tensors(), dtype=dtype)


def check_experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global) -> None:
    """Raise `NVFP4Error` unless the tensors are a valid NVFP4 expert stack (shapes, dtypes)."""
    if w13.dim() != 3 or w2.dim() != 3:
        raise NVFP4Error(
            f"NVFP4 experts need w13 [E, 2I, H/2] and w2 [E, H, I/2]; got {tuple(w13.shape)} "
            f"and {tuple(w2.shape)}"
        )
    e, two_i, half_h = w13.shape
    if two_i % (2 * BLOCK):
        raise NVFP4Error(
            f"NVFP4 experts: w13 {tuple(w13.shape)} gives I = {two_i / 2:g} (w13.shape[1] / 2); "
            f"I must be a multiple of {BLOCK}, the block that FC2's scales cover"
        )
    if tuple(w2.shape) != (e, half_h * 2, two_i // 4):
        raise NVFP4Error(
            f"NVFP4 experts: w2 has shape {tuple(w2.shape)} but w13 {tuple(w13.shape)} needs "
            f"({e}, {half_h * 2}, {two_i // 4}) (H = 2 * w13.shape[2], I = w13.shape[1] / 2)"
        )
    if tuple(w13_global.shape) != (e, 2):
        raise NVFP4Error(
            f"w13_global must be [E, 2] = ({e}, 2) (gate and up global scales), got "
            f"{tuple(w13_global.shape)}"
        )
    check(w13, w13_scale, w13_global[:, 0])
    check(w2, w2_scale, w2_global)


def dequantize_experts(
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w13_global: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    w2_global: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense `(w13 [E, 2I, H], w2 [E, H, I])` of an NVFP4 expert stack, in `dtype`."""
    check_experts(w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    inter = w13.shape[1] // 2
    halves = [
        dequantize(w13[:, sl], w13_scale[:, sl], w13_global[:, j], dtype)
        for j, sl in enumerate((slice(0, inter), slice(inter, 2 * inter)))
    ]
    return torch.cat(halves, dim=1), dequantize(w2, w2_scale, w2_global, dtype)


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor) -> NVFP4Experts:
    """NVFP4 of dense expert weights, each of gate, up, down its own ModelOpt tensor."""
    inter = w13.shape[1] // 2
    gate, up, down = quantize(w13[:, :inter]), quantize(w13[:, inter:]), quantize(w2)
    return NVFP4Experts(
        torch.cat((gate.packed, up.packed), 1),
        torch.cat((gate.scale, up.scale), 1),
        torch.stack((gate.global_scale, up.global_scale), 1),
        down.packed,
        down.scale,
        down.global_scale,
    )


def modelopt_nvfp4(quantization_config: dict | None) -> bool:
    """Whether an HF `quantization_config` asks for ModelOpt NVFP4 (and is one we can read)."""
    if not quantization_config:
        return False
    if hasattr(quantization_config, "to_dict"):  # transformers' config classes
        quantization_config = quantization_config.to_dict()
    if not isinstance(quantization_config, dict):
        raise NVFP4Error(
            f"quantization_config is {quantization_config!r}, not a mapping: write "
            '{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}'
        )
    method = str(quantization_config.get("quant_method", "")).lower()
    algo = str(quantization_config.get("quant_algo", "")).upper()
    if method != "modelopt" or algo != "NVFP4":
        raise NVFP4Error(
            f"quantization_config quant_method={method!r} quant_algo={algo!r} is not supported: "
            "only ModelOpt NVFP4 (quant_method 'modelopt', quant_algo 'NVFP4') is"
        )
    group = quantization_config.get("group_size", BLOCK)
    if group != BLOCK:
        raise NVFP4Error(f"NVFP4 group_size must be {BLOCK}, got {group!r}")
    return True
