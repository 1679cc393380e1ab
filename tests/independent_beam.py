"""Beam's forward pass in fp64, written from the model's description alone (the project's
BEAM.md notes: decoder layer, boundary, attention, MLP and MoE, output), over the HF-named
weights. It shares no code with `beamfx`: the check that the model's math is right, where
`reference_model` (the same model code in fp64) only measures rounding error.
"""

from __future__ import annotations

import math

import torch


def beam_logits(cfg, weights: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """fp64 logits [B, S, vocab] of token ids [B, S] (positions 0..S-1 in each row)."""
    w = {k: v.double() for k, v in weights.items()}
    eps = cfg.rms_norm_eps

    def rms(v, weight):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight

    positions = torch.arange(ids.shape[1], dtype=torch.float64)
    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        a = _attention(cfg, w, p, i, x, positions, rms)
        n = 2 * (i + 1)  # the attention add's number; the MLP's is n + 1
        h = rms(a, w[p + "post_attention_layernorm.weight"]) / math.sqrt(n) + h * math.sqrt(
            (n - 1) / n
        )
        x = rms(h, w[p + "pre_feedforward_layernorm.weight"])
        if cfg.mlp_layer_types[i] == "dense":
            m = _swiglu(x, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                        w[p + "mlp.down_proj.weight"])  # fmt: skip
        else:
            m = _moe(cfg, w, p, x)
        n += 1
        h = rms(m, w[p + "post_feedforward_layernorm.weight"]) / math.sqrt(n) + h * math.sqrt(
            (n - 1) / n
        )
    logits = rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T
    cap = cfg.final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


def _attention(cfg, w, p, layer, x, positions, rms):
    b, s, _ = x.shape
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(b, s, hq, d)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(b, s, hkv, d)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(b, s, hkv, d)
    gate = (x @ w[p + "self_attn.gate_proj.weight"].T).view(b, s, hq, d)
    q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    sliding = cfg.layer_types[layer] == "sliding_attention"
    if sliding:
        rope = cfg.rope_parameters
        theta = float(rope.get("sliding_attention", rope)["rope_theta"])
        q, k = _rope(q, positions, theta), _rope(k, positions, theta)
    else:  # NoPE with scalable softmax
        q = q * ((1 + (positions + 1) / 2048) ** 0.1).view(1, s, 1, 1)
    out = torch.empty_like(q)
    gap = positions.view(s, 1) - positions.view(1, s)  # query position - key position
    allowed = (gap >= 0) & ((gap <= cfg.sliding_window - 1) if sliding else True)
    for head in range(hq):
        kv = head // (hq // hkv)
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, head], k[:, :, kv]) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, :, head] = torch.softmax(scores, -1) @ v[:, :, kv]
    out = out * torch.sigmoid(gate + w[p + "self_attn.gate_bias"].view(1, 1, hq, 1))
    return out.reshape(b, s, hq * d) @ w[p + "self_attn.o_proj.weight"].T


def _rope(v, positions, theta):
    d = v.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.view(1, -1, 1, 1) * freq
    a, c = v[..., : d // 2], v[..., d // 2 :]
    return torch.cat((a * angle.cos() - c * angle.sin(), c * angle.cos() + a * angle.sin()), -1)


def _swiglu(x, gate, up, down):
    g, u = x @ gate.T, x @ up.T
    return (g * torch.sigmoid(g) * u) @ down.T


def _moe(cfg, w, p, x):
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    groups, keep = cfg.n_group, cfg.topk_group
    scores = torch.sigmoid(x @ w[p + "mlp.gate.weight"].T)  # [B, S, E]
    choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
    per_group = choice.view(*choice.shape[:-1], groups, e // groups)
    group_score = per_group.topk(min(2, e // groups), -1).values.sum(-1)
    kept = torch.zeros_like(group_score).scatter(-1, group_score.topk(keep, -1).indices, 1.0)
    allowed = kept.repeat_interleave(e // groups, -1).bool()
    ids = choice.masked_fill(~allowed, float("-inf")).topk(k, -1).indices
    gates = scores.gather(-1, ids)
    if cfg.norm_topk_prob:
        gates = gates / gates.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for j in range(k):
        for expert in range(e):
            rows = ids[..., j] == expert
            if rows.any():
                q = f"{p}mlp.experts.{expert}."
                y = _swiglu(x[rows], w[q + "gate_proj.weight"], w[q + "up_proj.weight"],
                            w[q + "down_proj.weight"])  # fmt: skip
                out[rows] += gates[..., j][rows].unsqueeze(-1) * y
    return out * cfg.routed_scaling_factor
