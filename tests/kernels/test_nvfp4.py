"""NVFP4 (ModelOpt layout): encodings, rounding, round trips, errors; the MoE references;
NVFP4 checkpoints and the plain model's NVFP4 experts.

Round-trip bound checked here (stated in `kernels/moe/nvfp4.py`): with S the block's
effective scale, `|x - x'| <= S * half_step(min(|x|/S, 6)) + max(0, |x| - 6 S)`; for blocks
whose E4M3 scale is a normal number, `|x - x'| <= (1 + 2^-4) / 6 * amax(block)`.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from beamfx.kernels.moe import nvfp4
from beamfx.kernels.moe import reference as ref
from beamfx.kernels.moe.nvfp4 import NVFP4Error
from beamfx.testing import examples

# Hand table: code -> value (bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa).
E2M1_TABLE = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5,
    0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0,
    0b1101: -3.0, 0b1110: -4.0, 0b1111: -6.0,
}  # fmt: skip


def test_e2m1_decoding_matches_hand_table():
    values = nvfp4.decode_e2m1(torch.arange(16))
    for code, v in E2M1_TABLE.items():
        assert values[code].item() == v
    assert values[8].item() == 0.0 and math.copysign(1, values[8].item()) == -1  # -0


@pytest.mark.parametrize(
    "x, code",
    [
        (0.24, 0), (0.25, 0), (0.26, 1), (0.75, 2), (0.74, 1), (1.25, 2), (1.26, 3),
        (1.75, 4), (2.5, 4), (2.51, 5), (3.5, 6), (4.9, 6), (5.0, 6), (5.01, 7), (6.0, 7),
        (7.0, 7), (1e6, 7), (-0.25, 8), (-0.0, 8), (0.0, 0), (-1.75, 12), (-3.5, 14),
        (-100.0, 15),
    ],
)  # fmt: skip
def test_e2m1_rounds_to_nearest_even_and_saturates(x, code):
    assert nvfp4.encode_e2m1(torch.tensor([x])).item() == code


def test_e4m3_encoding_hand_table():
    # byte -> value: sign, 4-bit exponent (bias 7), 3-bit mantissa; e=0 is subnormal.
    table = {0x01: 2.0**-9, 0x07: 7 * 2.0**-9, 0x08: 2.0**-6, 0x38: 1.0, 0x3C: 1.5, 0x7E: 448.0,
             0xB8: -1.0}  # fmt: skip
    raw = torch.tensor(list(table), dtype=torch.uint8)
    assert raw.view(torch.float8_e4m3fn).float().tolist() == list(table.values())


def test_packing_order_is_modelopt():
    # element 2j in the low nibble, 2j+1 in the high nibble
    assert nvfp4.pack_e2m1(torch.tensor([1, 2, 15, 0])).tolist() == [0x21, 0x0F]
    assert nvfp4.unpack_e2m1(torch.tensor([0x21, 0x0F], dtype=torch.uint8)).tolist() == [
        1,
        2,
        15,
        0,
    ]


def modelopt_codes(x: torch.Tensor, block_scale: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `_cast_fp4` recipe, written out independently: searchsorted over the decision
    bounds, then bump the ties whose upper neighbour is even."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    scaled = x.float().unflatten(-1, (-1, 16)) / (block_scale.float() * g).unsqueeze(-1)
    scaled = scaled.flatten(-2)
    mag = scaled.abs()
    code = torch.searchsorted(bounds, mag.contiguous())
    code += (mag.unsqueeze(-1) == torch.tensor([0.75, 1.75, 3.5])).any(-1).long()
    return code + 8 * (scaled < 0).long()


@given(rows=st.integers(1, 6), blocks=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_quantize_agrees_with_modelopt_recipe(rows, blocks, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 16 * blocks, generator=g) * torch.rand(rows, 1, generator=g) * 4
    q = nvfp4.quantize(x)
    assert torch.allclose(q.global_scale, x.abs().amax() / (6 * 448))
    block_amax = x.abs().unflatten(-1, (-1, 16)).amax(-1)
    want_scale = (block_amax / (6 * q.global_scale)).to(torch.float8_e4m3fn)
    assert torch.equal(q.scale.view(torch.uint8), want_scale.view(torch.uint8))
    codes = nvfp4.unpack_e2m1(q.packed).long()
    want = modelopt_codes(x, q.scale, q.global_scale)
    nonzero = (x != 0) & (codes != 8)  # ModelOpt writes +0 where we keep the sign of -0
    assert torch.equal(codes[nonzero], want[nonzero])


@given(
    matrices=st.integers(1, 3),
    rows=st.integers(1, 5),
    blocks=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_exact_for_representable_values(matrices, rows, blocks, seed):
    """Codes whose every block holds a +-6: dequantize then quantize gives them back bitwise."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (matrices, rows, 16 * blocks), generator=g, dtype=torch.uint8)
    codes.view(matrices, rows, blocks, 16)[..., 0] = 7 + 8 * torch.randint(
        0, 2, (matrices, rows, blocks), generator=g, dtype=torch.uint8
    )
    scale_bytes = torch.randint(0x08, 0x7F, (matrices, rows, blocks), generator=g)  # normals
    scale = scale_bytes.to(torch.uint8).view(torch.float8_e4m3fn)
    glob = torch.rand(matrices, generator=g) * 1e-2 + 1e-4
    packed = nvfp4.pack_e2m1(codes)
    x = nvfp4.dequantize(packed, scale, glob)
    again = nvfp4.quantize(x, glob)
    assert torch.equal(again.packed, packed)
    assert torch.equal(again.scale.view(torch.uint8), scale.view(torch.uint8))


def half_step(m: torch.Tensor) -> torch.Tensor:
    return torch.where(m <= 2, 0.25, torch.where(m <= 4, 0.5, 1.0))


@given(
    rows=st.integers(1, 6),
    blocks=st.integers(1, 4),
    spread=st.floats(0, 12),
    seed=st.integers(0, 2**16),
)
def test_round_trip_error_is_bounded(rows, blocks, spread, seed):
    g = torch.Generator().manual_seed(seed)
    # block magnitudes over 2^spread: tiny blocks get subnormal or zero E4M3 scales
    mags = 2.0 ** (-spread * torch.rand(rows, blocks, 1, generator=g))
    x = (torch.randn(rows, blocks, 16, generator=g) * mags).flatten(-2)
    q = nvfp4.quantize(x)
    err = (q.dequantize() - x).abs().unflatten(-1, (-1, 16))
    xb = x.abs().unflatten(-1, (-1, 16))
    s = (q.scale.float() * q.global_scale).unsqueeze(-1)
    bound = s * half_step(torch.clamp(xb / s, max=6)) + torch.clamp(xb - 6 * s, min=0)
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()
    normal = (q.scale.float() >= 2.0**-6).unsqueeze(-1)
    amax = xb.amax(-1, keepdim=True)
    assert ((err <= (1 + 2**-4) / 6 * amax * (1 + 1e-6)) | ~normal).all()


def test_errors_name_the_problem():
    with pytest.raises(NVFP4Error, match="multiple of 16"):
        nvfp4.quantize(torch.randn(4, 24))
    with pytest.raises(NVFP4Error, match="NaN"):
        nvfp4.quantize(torch.tensor([[float("nan")] * 16]))
    with pytest.raises(NVFP4Error, match="too small"):
        nvfp4.quantize(torch.full((1, 16), 100.0), global_scale=1e-3)
    q = nvfp4.quantize(torch.randn(4, 32))
    with pytest.raises(NVFP4Error, match="block scale has shape"):
        nvfp4.dequantize(q.packed, q.scale[:, :1], q.global_scale)
    with pytest.raises(NVFP4Error, match="uint8"):
        nvfp4.dequantize(q.packed.int(), q.scale, q.global_scale)
    with pytest.raises(NVFP4Error, match="finite and > 0"):
        nvfp4.check_scale_values(q.scale, torch.tensor(0.0))
    e = nvfp4.quantize_experts(torch.randn(2, 64, 32), torch.randn(2, 32, 32))
    with pytest.raises(NVFP4Error, match="w2 has shape"):
        nvfp4.check_experts(e.w13, e.w13_scale, e.w13_global, e.w2[:, :16], e.w2_scale, e.w2_global)
    with pytest.raises(NVFP4Error, match="w13_global"):
        nvfp4.check_experts(e.w13, e.w13_scale, e.w2_global, e.w2, e.w2_scale, e.w2_global)
    with pytest.raises(NVFP4Error, match="only ModelOpt NVFP4"):
        nvfp4.modelopt_nvfp4({"quant_method": "modelopt", "quant_algo": "FP8"})
    with pytest.raises(NVFP4Error, match="group_size"):
        nvfp4.modelopt_nvfp4({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32})
    assert nvfp4.modelopt_nvfp4(None) is False


@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf")])
def test_a_given_global_scale_that_is_not_finite_and_positive_is_refused(bad):
    with pytest.raises(NVFP4Error, match=r"global_scale \[.*\]: it must be finite and > 0"):
        nvfp4.quantize(torch.randn(2, 32), global_scale=bad)


def test_a_given_global_scale_too_large_for_e4m3_is_refused():
    # 1e30 puts every block's scale far below E4M3's smallest: all values would be 0.
    with pytest.raises(NVFP4Error, match="too large"):
        nvfp4.quantize(torch.randn(2, 32), global_scale=1e30)


def test_a_block_whose_scale_underflows_e4m3_keeps_its_values():
    # Block 2's amax is far below block 1's: its scale underflows E4M3, and keeps 2^-9.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16:] = 2688.0, 0.004
    q = nvfp4.quantize(x)
    assert q.scale.float()[0, 1].item() == 2.0**-9
    assert q.dequantize()[0, 16:].tolist() == [0.00390625] * 16


def test_values_beyond_fp32_or_too_small_for_an_fp32_global_scale_are_named():
    big = torch.ones(1, 16, dtype=torch.float64)
    big[0, 0] = 1e300
    with pytest.raises(NVFP4Error, match="beyond fp32's range"):
        nvfp4.quantize(big)
    with pytest.raises(NVFP4Error, match="largest magnitude is 3e-39"):
        nvfp4.quantize(torch.full((1, 16), 3e-39))


def test_an_intermediate_size_off_the_block_is_named():
    # I = 17: w2 [E, H, 8] holds 16 values a row, so only the I check can catch it.
    w13 = torch.zeros(2, 34, 16, dtype=torch.uint8)
    w2 = torch.zeros(2, 32, 8, dtype=torch.uint8)
    e4m3 = torch.float8_e4m3fn
    scales = (torch.ones(2, 34, 2, dtype=e4m3), torch.ones(2, 2), torch.ones(2, 32, 1, dtype=e4m3),
              torch.ones(2))  # fmt: skip
    with pytest.raises(NVFP4Error, match="I = 17 .* multiple of 16"):
        nvfp4.check_experts(w13, scales[0], scales[1], w2, scales[2], scales[3])
    x, ids = torch.randn(3, 32, dtype=torch.bfloat16), torch.zeros(3, 1, dtype=torch.int32)
    assert "multiple of 16, got 17" in ref.why_not_layout(x, ids, w13, w2, scales)


# --- the references agree with each other --------------------------------------------------


def dense_moe(x, weights, ids, w13, w2, scale):
    """Token by token, slot by slot: the MoE written as plainly as possible."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gu = (x[t : t + 1] @ w13[e].T).to(x.dtype)
            h = (torch.nn.functional.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(
                x.dtype
            )
            row = (h @ w2[e].T).to(x.dtype)
            out[t] += row[0].double() * float(weights[t, j])
    return (out * scale).float().to(x.dtype)


@given(
    tokens=st.integers(1, 9),
    n_group=st.sampled_from([1, 2, 4]),
    group_size=st.integers(1, 4),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(10))
def test_references_agree(tokens, n_group, group_size, top_k, seed):
    experts = n_group * group_size
    topk_group = max(1, n_group // 2)
    top_k = min(top_k, topk_group * group_size)
    g = torch.Generator().manual_seed(seed)
    hidden, inter = 32, 16
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)
    bias = torch.randn(experts, generator=g) * 0.1
    weights, ids = ref.grouped_topk(logits, bias, top_k, n_group, topk_group, True)
    q = nvfp4.quantize_experts(
        torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5,
        torch.randn(experts, hidden, inter, generator=g) / inter**0.5,
    )
    w13, w2 = q.dequantize(torch.bfloat16)
    fused = ref.mega_moe_nvfp4(x, weights, ids, *q.tensors(), 2.5)
    assert torch.equal(fused, ref.mega_moe(x, weights, ids, w13, w2, 2.5))
    assert torch.equal(
        ref.moe_experts_nvfp4(x, *q.tensors(), ids), ref.moe_experts(x, w13, w2, ids)
    )
    plain = dense_moe(x, weights, ids, w13, w2, 2.5).float()
    assert ((fused.float() - plain).abs() <= 2**-7 * plain.abs() + 1e-3).all()


# --- checkpoints and the plain model ------------------------------------------------------


@pytest.fixture(scope="module")
def nvfp4_checkpoint(tmp_path_factory) -> str:
    from beamfx.quant import write_tiny_nvfp4_checkpoint

    return write_tiny_nvfp4_checkpoint(str(tmp_path_factory.mktemp("nvfp4")))


def test_nvfp4_checkpoint_loads_and_matches_the_fp64_model(nvfp4_checkpoint):
    from safetensors import safe_open

    from beamfx.checkpoint import load_checkpoint
    from beamfx.models.beam import BeamExpertsNVFP4, reference_model

    with safe_open(f"{nvfp4_checkpoint}/model.safetensors", "pt") as f:
        name = next(k for k in f.keys() if k.endswith("experts.3.up_proj.weight"))  # noqa: SIM118
        base = name[: -len(".weight")]
        packed, block = f.get_tensor(name), f.get_tensor(f"{base}.weight_scale")
        glob = f.get_tensor(f"{base}.weight_scale_2")
    assert packed.dtype == torch.uint8 and block.dtype == torch.float8_e4m3fn
    assert glob.dtype == torch.float32 and glob.dim() == 0
    model = load_checkpoint(nvfp4_checkpoint)
    experts = model.get_submodule(base.rsplit(".", 2)[0])
    assert isinstance(experts, BeamExpertsNVFP4)
    inter = experts.w13.shape[1] // 2
    assert torch.equal(experts.w13[3, inter:], packed)
    assert experts.w13_global[3, 1] == glob
    ids = torch.randint(
        0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0)
    )
    got, want = model(ids).double(), reference_model(model)(ids)
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_nvfp4_checkpoint_shards_for_tensor_parallelism(nvfp4_checkpoint):
    from beamfx.checkpoint import load_checkpoint
    from beamfx.models.beam import Parallel

    full = load_checkpoint(nvfp4_checkpoint)
    for rank in range(2):
        part = load_checkpoint(nvfp4_checkpoint, Parallel(rank, 2))
        for name, module in part.named_modules():
            if not hasattr(module, "w13_global"):
                continue
            whole = full.get_submodule(name)
            inter = module.w13.shape[1] // 2
            gate = slice(rank * inter, (rank + 1) * inter)
            assert torch.equal(module.w13[:, :inter], whole.w13[:, gate])
            assert torch.equal(module.w13_scale.view(torch.uint8)[:, :inter],
                               whole.w13_scale.view(torch.uint8)[:, gate])  # fmt: skip
            cols, scols = module.w2.shape[2], module.w2_scale.shape[2]
            assert torch.equal(module.w2, whole.w2[:, :, rank * cols : (rank + 1) * cols])
            shard = whole.w2_scale.view(torch.uint8)[:, :, rank * scols : (rank + 1) * scols]
            assert torch.equal(module.w2_scale.view(torch.uint8), shard)
            assert torch.equal(module.w13_global, whole.w13_global)


def test_nvfp4_checkpoint_errors(nvfp4_checkpoint, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from beamfx.checkpoint import load_checkpoint

    broken = tmp_path / "broken"
    shutil.copytree(nvfp4_checkpoint, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    victim = next(k for k in tensors if k.endswith("experts.0.down_proj.weight_scale_2"))
    del tensors[victim]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(NVFP4Error, match="lacks weight_scale_2"):
        load_checkpoint(str(broken))
    cfg = json.loads((broken / "config.json").read_text())
    del cfg["quantization_config"]
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((NVFP4Error, ValueError), match="quantization_config|shape"):
        load_checkpoint(str(broken))


def test_moe_layer_calls_the_nvfp4_semantic_op(nvfp4_checkpoint):
    """The graph a pass sees: moe_experts_nvfp4 then moe_finalize, one node each."""
    from beamfx.checkpoint import load_checkpoint
    from beamfx.models.beam import BeamMoE

    model = load_checkpoint(nvfp4_checkpoint)
    moe = next(m for m in model.modules() if isinstance(m, BeamMoE))
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    graph = make_fx(moe)(x).graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert torch.ops.beamfx.moe_experts_nvfp4.default in targets
    assert torch.ops.beamfx.moe_finalize.default in targets
    assert torch.ops.beamfx.moe_experts.default not in targets


def _vllm_load(path, tensors):
    """As vLLM loads: a model from config.json, then `load_weights` over (name, tensor)."""
    from beamfx.config import load_config
    from beamfx.models.beam import BeamForCausalLM

    model = BeamForCausalLM(load_config(path))
    return model, model.load_weights(iter(tensors.items()))


def test_vllm_load_path_checks_nvfp4_scales(nvfp4_checkpoint):
    """vLLM calls `load_weights`, not `load_checkpoint`: a scale the checkpoint lacks stays
    NaN, which the fast kernels would read as a finite number, so it must raise there too."""
    from safetensors.torch import load_file

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    model, loaded = _vllm_load(nvfp4_checkpoint, tensors)
    assert any(name.endswith("w13_scale") for name in loaded)
    victim = next(k for k in tensors if k.endswith("experts.1.down_proj.weight_scale_2"))
    del tensors[victim]
    with pytest.raises(NVFP4Error, match=r"lacks weight_scale_2 of some experts \(1 missing\)"):
        _vllm_load(nvfp4_checkpoint, tensors)


def test_reloaded_weights_rebuild_the_converted_copies(nvfp4_checkpoint):
    """A later `load_weights` of new expert weights (a weight sync) moves the tensors'
    versions on, so the kernels' caches of converted weights build again."""
    from safetensors.torch import load_file

    from beamfx.kernels.moe.weight_cache import WeightCache
    from beamfx.models.beam import BeamExpertsNVFP4

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    model, _ = _vllm_load(nvfp4_checkpoint, tensors)
    experts = next(m for m in model.modules() if isinstance(m, BeamExpertsNVFP4))
    cache, builds = WeightCache(), []
    sources = (experts.w13, experts.w13_scale, experts.w2, experts.w2_scale)
    convert = lambda: builds.append(experts.w13.clone()) or builds[-1]  # noqa: E731
    cache.get(sources, convert)
    cache.get(sources, convert)
    assert len(builds) == 1
    name = next(k for k in tensors if k.endswith("experts.2.gate_proj.weight"))
    model.load_weights([(name, tensors[name] ^ 0x11)])  # new codes, the same scales
    assert torch.equal(cache.get(sources, convert), experts.w13) and len(builds) == 2
    assert not torch.equal(builds[0], builds[1])


def test_converted_weights_of_inference_tensors_are_not_cached():
    """Inference tensors keep no version, so a write to one could not be seen: they are
    converted on every call (with a warning), never served a stale copy."""
    from beamfx.kernels.moe.weight_cache import WeightCache

    with torch.inference_mode():
        w = torch.ones(4)
    cache = WeightCache()
    with pytest.warns(UserWarning, match="inference tensors"):
        assert cache.get((w,), lambda: w.sum().item()) == 4
    with torch.inference_mode():
        w.add_(1)
    assert cache.get((w,), lambda: w.sum().item()) == 8 and len(cache) == 0


def test_one_dimensional_block_scale_is_named(nvfp4_checkpoint):
    from safetensors.torch import load_file

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    name = next(k for k in tensors if k.endswith("experts.0.down_proj.weight_scale"))
    tensors[name] = tensors[name].flatten()
    with pytest.raises(NVFP4Error, match=r"weight_scale is 2-D \[N, K/16\]"):
        _vllm_load(nvfp4_checkpoint, tensors)


@pytest.mark.parametrize("stored", ["uint8 bytes", "float32"])
def test_block_scales_stored_in_another_dtype_are_named(nvfp4_checkpoint, stored):
    """E4M3 scales saved as their bytes (uint8) loaded as the numbers 0-255, and fp32 scales
    above E4M3's 448 were clamped, both silently: a weight_scale is float8_e4m3fn."""
    from safetensors.torch import load_file

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    name = next(k for k in tensors if k.endswith("experts.0.down_proj.weight_scale"))
    scale = tensors[name]
    tensors[name] = scale.view(torch.uint8) if stored == "uint8 bytes" else scale.float() * 4
    with pytest.raises(NVFP4Error, match=r"down_proj.weight_scale' is torch\.(uint8|float32)"):
        _vllm_load(nvfp4_checkpoint, tensors)


def test_a_quantization_config_that_is_not_a_mapping_is_named():
    from beamfx.kernels.moe.nvfp4 import modelopt_nvfp4

    with pytest.raises(NVFP4Error, match="quantization_config is 'NVFP4', not a mapping"):
        modelopt_nvfp4("NVFP4")


@pytest.mark.parametrize("proj", ["up_proj", "down_proj"])
def test_a_missing_block_scale_is_named(nvfp4_checkpoint, proj):
    """A weight_scale left out of the checkpoint was reported as non-finite scales and "the
    checkpoint is damaged", not as the tensor that is missing."""
    from safetensors.torch import load_file

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    name = next(k for k in tensors if k.endswith(f"experts.3.{proj}.weight_scale"))
    del tensors[name]
    with pytest.raises(NVFP4Error, match=r"lacks the weight_scale of experts \[3\]"):
        _vllm_load(nvfp4_checkpoint, tensors)


def test_inference_tensor_weights_under_a_cuda_graph_capture_are_named(monkeypatch):
    """Rebuilt on every call, their conversion would allocate and copy from the host inside
    a capture, which fails with a CUDA error naming none of this. No capture runs on a CPU
    machine: the capture state is set by hand, on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from beamfx.kernels.moe.weight_cache import WeightCache

    with FakeTensorMode(), torch.inference_mode():
        w = torch.empty(4, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inference tensors .*CUDA graph capture"):
        WeightCache().get((w,), lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.warns(UserWarning, match="inference tensors"):
        assert WeightCache().get((w,), lambda: 0) == 0


@pytest.mark.parametrize(
    "tensor, value, named",
    [("experts.6.up_proj.weight_scale_2", 0.0, r"experts\.6\.up_proj\.weight_scale_2 = 0"),
     ("experts.7.down_proj.weight_scale_2", -1.0, r"experts\.7\.down_proj\.weight_scale_2 = -1"),
     ("experts.5.up_proj.weight_scale", -1.0, r"experts\.5\.up_proj\.weight_scale = -1")],
)  # fmt: skip
def test_a_bad_scale_is_named_by_its_checkpoint_tensor(nvfp4_checkpoint, tensor, value, named):
    """The error printed the stack's first four global scales (all valid) under the buffer's
    name; it names the bad entries' checkpoint tensors and values."""
    from safetensors.torch import load_file

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    name = next(k for k in tensors if k.endswith(tensor))
    bad = tensors[name].clone()
    bad.view(-1)[-1] = value
    tensors[name] = bad
    with pytest.raises(NVFP4Error, match=named):
        _vllm_load(nvfp4_checkpoint, tensors)


def test_nvfp4_outside_the_routed_experts_and_integer_scales_are_named(nvfp4_checkpoint):
    """ModelOpt's default recipe quantizes attention too: that failed as a KeyError "has no
    place"; a weight_scale_2 stored as int32 loaded as a number."""
    from safetensors.torch import load_file

    from beamfx.checkpoint import CheckpointError

    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    q = next(k for k in tensors if k.endswith("self_attn.q_proj.weight"))
    attention = {**tensors, q.replace(".weight", ".input_scale"): torch.tensor(1.0)}
    with pytest.raises(CheckpointError, match="NVFP4 for routed experts only"):
        _vllm_load(nvfp4_checkpoint, attention)
    g = next(k for k in tensors if k.endswith("experts.0.down_proj.weight_scale_2"))
    integer = {**tensors, g: torch.tensor(1, dtype=torch.int32)}
    with pytest.raises(NVFP4Error, match="is torch.int32; an NVFP4 weight_scale_2 is an fp32"):
        _vllm_load(nvfp4_checkpoint, integer)


def test_an_unquantized_checkpoint_under_an_nvfp4_config_is_named(nvfp4_checkpoint):
    from beamfx.checkpoint import CheckpointError

    w = torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="says NVFP4 experts, but the checkpoint holds"):
        _vllm_load(nvfp4_checkpoint, {"model.layers.1.mlp.experts.0.down_proj.weight": w})


def test_fp32_parameters_stay_fp32_under_the_models_default_dtype(nvfp4_checkpoint):
    """vLLM builds the model under `set_default_torch_dtype(bf16)`: the router weight and
    correction bias and the NVFP4 global scales, made without a dtype, came out bf16, and
    loading rounded the checkpoint's fp32 values into them (routing moved, and the fused
    routing, which needs an fp32 bias, stopped matching)."""
    from safetensors.torch import load_file

    from beamfx.config import load_config
    from beamfx.models.beam import BeamForCausalLM

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = BeamForCausalLM(load_config(nvfp4_checkpoint))
    finally:
        torch.set_default_dtype(before)
    tensors = load_file(f"{nvfp4_checkpoint}/model.safetensors")
    model.load_weights(iter(tensors.items()))
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    for name in ("gate.weight", "gate.e_score_correction_bias", "experts.w13_global",
                 "experts.w2_global", "experts.w13_input_scale"):  # fmt: skip
        found = [(k, v) for k, v in state.items() if k.endswith(name)]
        assert found and all(v.dtype == torch.float32 for _, v in found), (name, found[0][1].dtype)
    router = next(k for k in tensors if k.endswith("mlp.gate.weight"))
    assert tensors[router].dtype == torch.float32
    assert torch.equal(state[router], tensors[router])
