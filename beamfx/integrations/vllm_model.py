"""Beam in vLLM: the plain `beamfx.models.beam` model with vLLM's paged attention core.

The same modules and math as the plain model; only `BeamAttention.attend` changes, to
vLLM's `Attention` (paged KV cache, the layer's sliding window, scale head_dim ** -0.5).
RoPE, SSMax, the q/k norms and the output gate stay the plain model's, so the compiled
graph holds the same Beam IR ops that beamfx's passes match under `beamfx.compile`.

Linear layers stay the plain model's `nn.Linear`, sharded by its own loader: vLLM's
RowParallelLinear would fold the TP all-reduce into the projection, where the boundary
pass must see it as its own op.
"""

from __future__ import annotations

import torch
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import maybe_prefix

from beamfx.config import BeamConfig, warn_missing_keys
from beamfx.integrations import vllm as integration
from beamfx.models import beam


class PagedBeamAttention(beam.BeamAttention):
    """Beam attention whose softmax core is vLLM's `Attention` (as `self.attn`)."""

    attn: Attention

    def attend(self, q, k, v, positions):
        # vLLM writes k/v into this layer's KV cache and attends over the whole context.
        return self.attn(q, k, v).view_as(q)


def use_paged_attention(model: beam.BeamModel, cache_config, prefix: str) -> None:
    """Give every layer of `model` vLLM's paged attention core, keeping its weights."""
    for i, layer in enumerate(model.layers):
        plain = layer.self_attn
        # The plain layer built its attention itself; re-classing it keeps its projections
        # and math instead of building a second copy, and changes only `attend`.
        plain.__class__ = PagedBeamAttention
        plain.attn = Attention(
            plain.num_heads,
            plain.head_dim,
            plain.head_dim**-0.5,
            num_kv_heads=plain.num_kv_heads,
            cache_config=cache_config,
            per_layer_sliding_window=plain.window,
            prefix=f"{prefix}.layers.{i}.self_attn.attn",
        )


def beam_config(hf_config, model: str | None = None) -> BeamConfig:
    """beamfx's BeamConfig from vLLM's HF config (a vLLM build may bring its own class).
    With `model` (the checkpoint folder), warns of keys its config.json leaves out, as
    `load_config` does: transformers fills them with BeamConfig's tiny defaults silently."""
    if model is not None:
        warn_missing_keys(model)
    if isinstance(hf_config, BeamConfig):
        return hf_config
    data = hf_config.to_dict()
    data.pop("model_type", None)
    return BeamConfig(**data)


def tensor_parallel() -> beam.Parallel:
    """This rank's place in vLLM's tensor-parallel group, as the plain model takes it."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return beam.Parallel()
    group_name = get_tp_group().device_group.group_name
    return beam.Parallel(get_tensor_model_parallel_rank(), world_size, group_name)


def check_parallel(parallel) -> None:
    """The parallelism the model implements: tensor (and data) parallel engines only."""
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            f"beamfx's Beam runs without pipeline parallelism (got pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): use tensor parallelism (-tp) instead"
        )
    if getattr(parallel, "enable_expert_parallel", False):
        raise ValueError(
            "beamfx's Beam shards every expert over the tensor-parallel ranks; it has no "
            "expert parallelism (got enable_expert_parallel=True): serve it without "
            "--enable-expert-parallel"
        )


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class BeamForCausalLM(beam.BeamForCausalLM):
    """vLLM's interface over the plain model: `forward` returns the final hidden states."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        check_parallel(vllm_config.parallel_config)
        # Before the compile wrapper (set up after this __init__) reads Inductor's options.
        integration.bind(vllm_config)
        model_config = vllm_config.model_config
        config = beam_config(model_config.hf_config, model_config.model)
        super().__init__(config, tensor_parallel(), vllm_config.model_config.dtype)
        use_paged_attention(self.model, vllm_config.cache_config, maybe_prefix(prefix, "model"))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise ValueError(
                "beamfx's Beam takes token ids, not prompt embeddings: serve it without "
                "--enable-prompt-embeds"
            )
        return self.model(input_ids, positions)
