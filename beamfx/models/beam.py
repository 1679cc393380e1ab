"""Beam-1.0 (`BeamForCausalLM`) in plain PyTorch, following the numerics contract.

Reads like the math: sandwich norms at two boundaries per layer, depth-scaled residuals,
q/k RMSNorm, RoPE + window on sliding layers, NoPE + SSMax on full layers, a gated
attention output, SwiGLU or grouped-sigmoid MoE. It knows no fusion and picks no kernel.
Tensor parallelism shards heads and MLP/expert intermediates; row-parallel outputs end
in an explicit all-reduce (absent at world size 1).

Two front ends share this code: "semantic" calls Beam IR ops (one graph node each, what
the passes match); "torch" calls their reference functions directly (what a model written
in plain torch looks like; `canonicalize` raises it back to Beam IR).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from beamfx import ops as ir
from beamfx.config import BeamConfig
from beamfx.kernels.boundary import reference as boundary_ref
from beamfx.kernels.moe import reference as moe_ref
from beamfx.kernels.moe.nvfp4 import modelopt_nvfp4
from beamfx.kernels.norm import reference as norm_ref
from beamfx.kernels.precision import widen

FRONTENDS = {
    "semantic": SimpleNamespace(
        rms_norm=ir.rms_norm,
        silu_mul=ir.silu_mul,
        scaled_residual_add=ir.scaled_residual_add,
        all_reduce=ir.all_reduce,
        router_logits=ir.router_logits,
        grouped_topk=ir.grouped_topk,
        moe_experts=ir.moe_experts,
        moe_experts_nvfp4=ir.moe_experts_nvfp4,
        moe_finalize=ir.moe_finalize,
    ),
    "torch": SimpleNamespace(
        rms_norm=norm_ref.rms_norm,
        silu_mul=norm_ref.silu_mul,
        scaled_residual_add=boundary_ref.scaled_residual_add,
        all_reduce=boundary_ref.all_reduce,
        router_logits=moe_ref.router_logits,
        grouped_topk=moe_ref.grouped_topk,
        moe_experts=moe_ref.moe_experts,
        moe_experts_nvfp4=moe_ref.moe_experts_nvfp4,
        moe_finalize=moe_ref.moe_finalize,
    ),
}


@dataclass(frozen=True)
class Parallel:
    """This rank's place in tensor parallelism; `group_name` names the torch.distributed group."""

    rank: int = 0
    world_size: int = 1
    group_name: str | None = None

    @classmethod
    def from_default_group(cls) -> Parallel:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = dist.group.WORLD
        return cls(dist.get_rank(), dist.get_world_size(), group.group_name)

    def shard(self, n: int) -> slice:
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))


def _linear(n_in: int, n_out: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False, dtype=dtype)


def rope_neox(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding, fp32 cos/sin, rounded once. x: [T, heads, D]."""
    d, xf = x.shape[-1], widen(x)
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=xf.dtype) / d)
    angles = positions.reshape(-1, 1).to(xf.dtype) * inv_freq
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def ssmax(q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Scalable softmax on NoPE layers: q * (1 + (position + 1) / 2048) ** 0.1."""
    qf = widen(q)
    scale = (1.0 + (positions.reshape(-1).to(qf.dtype) + 1.0) / 2048.0) ** 0.1
    return (qf * scale.view(-1, 1, 1)).to(q.dtype)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Full-sequence causal attention (optionally windowed) for [B, S] positions.

    q: [B*S, Hq, D], k/v: [B*S, Hkv, D]. A query sees keys with 0 <= q - k <= window - 1.
    """
    b, s = positions.shape
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    q, k, v = (t.view(b, s, t.shape[1], d).transpose(1, 2) for t in (q, k, v))
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    dist = positions.unsqueeze(2) - positions.unsqueeze(1)  # [B, S_q, S_k]
    allowed = dist >= 0
    if window is not None:
        allowed = allowed & (dist <= window - 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), scale=d**-0.5)
    return out.transpose(1, 2).reshape(b * s, hq, d)


class BeamAttention(nn.Module):
    def __init__(self, cfg: BeamConfig, layer_index: int, par: Parallel, dtype: torch.dtype):
        super().__init__()
        self.sliding = cfg.layer_types[layer_index] == "sliding_attention"
        self.window = cfg.sliding_window if self.sliding else None
        self.theta = cfg.sliding_rope_theta
        self.eps = cfg.rms_norm_eps
        self.head_dim = d = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // par.world_size
        self.num_kv_heads = cfg.num_key_value_heads // par.world_size
        h = cfg.hidden_size
        self.q_proj = _linear(h, self.num_heads * d, dtype)
        self.k_proj = _linear(h, self.num_kv_heads * d, dtype)
        self.v_proj = _linear(h, self.num_kv_heads * d, dtype)
        self.gate_proj = _linear(h, self.num_heads * d, dtype)
        self.o_proj = _linear(self.num_heads * d, h, dtype)
        self.q_norm = RMSNorm(d, dtype)
        self.k_norm = RMSNorm(d, dtype)
        self.gate_bias = nn.Parameter(torch.zeros(self.num_heads, dtype=dtype))
        self.ops = FRONTENDS["semantic"]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).view(t, self.num_heads, d)
        k = self.k_proj(x).view(t, self.num_kv_heads, d)
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        gate = self.gate_proj(x).view(t, self.num_heads, d)
        q = self.ops.rms_norm(q, self.q_norm.weight, self.eps)
        k = self.ops.rms_norm(k, self.k_norm.weight, self.eps)
        if self.sliding:
            q, k = rope_neox(q, positions, self.theta), rope_neox(k, positions, self.theta)
        else:
            q = ssmax(q, positions)
        o = self.attend(q, k, v, positions)
        o = o * torch.sigmoid(gate + self.gate_bias.view(1, -1, 1))
        return self.o_proj(o.reshape(t, self.num_heads * d))

    def attend(self, q, k, v, positions):
        """Softmax attention; vLLM's integration replaces this with its paged attention."""
        return causal_attention(q, k, v, positions, self.window)


class BeamMLP(nn.Module):
    def __init__(self, cfg: BeamConfig, par: Parallel, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size // par.world_size
        self.gate_proj = _linear(cfg.hidden_size, inter, dtype)
        self.up_proj = _linear(cfg.hidden_size, inter, dtype)
        self.down_proj = _linear(inter, cfg.hidden_size, dtype)
        self.ops = FRONTENDS["semantic"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class BeamRouter(nn.Module):
    def __init__(self, cfg: BeamConfig):
        super().__init__()
        # fp32 whatever the default dtype (vLLM builds models under the model's dtype).
        fp32 = dict(dtype=torch.float32)
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size, **fp32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, **fp32))


class BeamExperts(nn.Module):
    """All experts stacked: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I]."""

    def __init__(self, cfg: BeamConfig, par: Parallel, dtype: torch.dtype):
        super().__init__()
        inter = cfg.moe_intermediate_size // par.world_size
        e, h = cfg.num_experts, cfg.hidden_size
        self.w13 = nn.Parameter(torch.zeros(e, 2 * inter, h, dtype=dtype))
        self.w2 = nn.Parameter(torch.zeros(e, h, inter, dtype=dtype))
        self.ops = FRONTENDS["semantic"]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.moe_experts(x, self.w13, self.w2, topk_ids)


class BeamExpertsNVFP4(nn.Module):
    """Experts from a ModelOpt NVFP4 checkpoint, layout of `kernels/moe/nvfp4.py`.

    Packed E2M1 weights w13 [E, 2I, H/2], w2 [E, H, I/2] (uint8); E4M3 block scales and
    fp32 global scales (gate and up keep their own) as buffers. Input scales are kept for
    W4A4 kernels; the W4A16 math does not use them.
    """

    def __init__(self, cfg: BeamConfig, par: Parallel, dtype: torch.dtype):
        super().__init__()
        inter = cfg.moe_intermediate_size // par.world_size
        e, h = cfg.num_experts, cfg.hidden_size
        if inter % 16 or h % 16:
            raise ValueError(
                f"NVFP4 experts need hidden ({h}) and per-rank moe_intermediate ({inter}) to be "
                "multiples of 16 (one E4M3 scale per 16 values)"
            )
        packed = dict(dtype=torch.uint8)
        self.w13 = nn.Parameter(torch.zeros(e, 2 * inter, h // 2, **packed), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(e, h, inter // 2, **packed), requires_grad=False)
        e4m3, nan = dict(dtype=torch.float8_e4m3fn), float("nan")
        fp32 = dict(dtype=torch.float32)  # whatever the default dtype (vLLM sets the model's)
        # Scales are NaN until loaded, so a checkpoint without them cannot pass unnoticed.
        self.register_buffer("w13_scale", torch.full((e, 2 * inter, h // 16), nan, **e4m3))
        self.register_buffer("w2_scale", torch.full((e, h, inter // 16), nan, **e4m3))
        self.register_buffer("w13_global", torch.full((e, 2), nan, **fp32))
        self.register_buffer("w2_global", torch.full((e,), nan, **fp32))
        self.register_buffer("w13_input_scale", torch.ones(e, 2, **fp32))
        self.register_buffer("w2_input_scale", torch.ones(e, **fp32))
        self.ops = FRONTENDS["semantic"]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.ops.moe_experts_nvfp4(
            x, self.w13, self.w13_scale, self.w13_global,
            self.w2, self.w2_scale, self.w2_global, topk_ids,
        )  # fmt: skip


class BeamMoE(nn.Module):
    def __init__(self, cfg: BeamConfig, par: Parallel, dtype: torch.dtype):
        super().__init__()
        self.gate = BeamRouter(cfg)
        nvfp4 = modelopt_nvfp4(getattr(cfg, "quantization_config", None))
        self.experts = (BeamExpertsNVFP4 if nvfp4 else BeamExperts)(cfg, par, dtype)
        self.top_k, self.n_group, self.topk_group = (
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
        )
        self.renormalize = cfg.norm_topk_prob
        self.routed_scale = float(cfg.routed_scaling_factor)
        self.ops = FRONTENDS["semantic"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.ops.router_logits(x, self.gate.weight)
        weights, ids = self.ops.grouped_topk(
            logits,
            self.gate.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.renormalize,
        )
        rows = self.experts(x, ids)
        return self.ops.moe_finalize(rows, weights, self.routed_scale)


class BeamDecoderLayer(nn.Module):
    def __init__(self, cfg: BeamConfig, layer_index: int, par: Parallel, dtype: torch.dtype):
        super().__init__()
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.par = par
        self.self_attn = BeamAttention(cfg, layer_index, par, dtype)
        sparse = cfg.mlp_layer_types[layer_index] == "sparse"
        self.mlp = BeamMoE(cfg, par, dtype) if sparse else BeamMLP(cfg, par, dtype)
        self.input_layernorm = RMSNorm(h, dtype)
        self.post_attention_layernorm = RMSNorm(h, dtype)
        self.pre_feedforward_layernorm = RMSNorm(h, dtype)
        self.post_feedforward_layernorm = RMSNorm(h, dtype)
        self.attn_scales = cfg.residual_scales(layer_index, "attn")
        self.mlp_scales = cfg.residual_scales(layer_index, "mlp")
        self.ops = FRONTENDS["semantic"]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.par.world_size == 1:
            return x
        return self.ops.all_reduce(x, self.par.group_name)

    def boundary(self, out, residual, w_post, w_next, scales):
        """Post-norm, depth-scaled residual add, next sublayer's pre-norm."""
        x_scale, residual_scale = scales
        t = self.ops.rms_norm(out, w_post, self.eps)
        h = self.ops.scaled_residual_add(t, residual, x_scale, residual_scale)
        return h, self.ops.rms_norm(h, w_next, self.eps)

    def forward(self, h, x, positions, next_norm: torch.Tensor):
        a = self.all_reduce(self.self_attn(x, positions))
        h, x = self.boundary(
            a,
            h,
            self.post_attention_layernorm.weight,
            self.pre_feedforward_layernorm.weight,
            self.attn_scales,
        )
        m = self.all_reduce(self.mlp(x))
        h, x = self.boundary(
            m, h, self.post_feedforward_layernorm.weight, next_norm, self.mlp_scales
        )
        return h, x


class BeamModel(nn.Module):
    def __init__(self, cfg: BeamConfig, par: Parallel, dtype: torch.dtype):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            BeamDecoderLayer(cfg, i, par, dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, dtype)
        self.ops = FRONTENDS["semantic"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final normalized hidden states [T, H] for flattened tokens."""
        h = self.embed_tokens(input_ids.reshape(-1))
        x = self.ops.rms_norm(h, self.layers[0].input_layernorm.weight, self.eps)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            h, x = layer(h, x, positions, nxt.weight)
        return x


class BeamForCausalLM(nn.Module):
    """Beam-1.0 causal LM. `forward(input_ids [B, S])` returns fp32 logits [B, S, V]."""

    def __init__(
        self,
        config: BeamConfig,
        parallel: Parallel | None = None,
        dtype: torch.dtype = torch.bfloat16,
        frontend: str = "semantic",
    ):
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or Parallel()
        config.check_world_size(parallel.world_size)
        self.model = BeamModel(config, parallel, dtype)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, dtype)
        self.softcap = config.final_logit_softcapping
        self.requires_grad_(False)  # an inference model: Beam IR ops have no autograd
        self.set_frontend(frontend)

    def set_frontend(self, frontend: str) -> BeamForCausalLM:
        if frontend not in FRONTENDS:
            raise ValueError(f"frontend={frontend!r} is unknown: choose one of {list(FRONTENDS)}")
        self.frontend = frontend
        for m in self.modules():
            if hasattr(m, "ops"):
                m.ops = FRONTENDS[frontend]
        return self

    def compute_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = widen(self.lm_head(x))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None):
        b, s = input_ids.shape
        if positions is None:
            positions = torch.arange(s, device=input_ids.device).expand(b, s)
        x = self.model(input_ids, positions)
        return self.compute_logits(x).view(b, s, -1)

    # --- weights (HF names) ---------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full (unsharded) HF-named tensors, keeping this rank's shard (vLLM's entry
        point). NVFP4 experts are checked afterwards as `load_checkpoint` checks them: a
        scale the checkpoint lacks is NaN until loaded, and the fast kernels would read it
        as a finite number, so a missing or invalid one raises here."""
        from beamfx.checkpoint import load_into
        from beamfx.quant import check_loaded

        loaded = load_into(self, weights)
        check_loaded(self)
        return loaded


def reference_model(model: BeamForCausalLM) -> BeamForCausalLM:
    """The same model in fp64 with the plain-torch front end: the error yardstick."""
    import copy

    ref = copy.deepcopy(model).set_frontend("torch")
    return ref.to(torch.float64)
