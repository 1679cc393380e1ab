"""Beam-1.0 configuration in the released `config.json` schema, validated, with presets."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from transformers import PretrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")
MLP_TYPES = ("dense", "sparse")
# Keys that only pre-release checkpoints had. They are dropped, never obeyed: sandwich
# norm is always on, NoPE means the full-attention layers, the router is always fp32.
PRE_RELEASE_KEYS = {
    "enable_sandwich_norm": "sandwich norm is always on",
    "mlp_only_layers": "use mlp_layer_types",
    "nope_layer_ids": "NoPE layers are the full_attention layers of layer_types",
    "moe_router_dtype": "the router is always fp32",
}


# Keys a config.json may leave out without changing the model's math: head_dim follows from
# hidden_size / num_attention_heads, and the others are only checked. Any other key left out
# takes BeamConfig's default, which is the tiny preset's, not Beam-1.0's: `load_config` warns.
OPTIONAL_KEYS = ("head_dim", "hidden_act", "tie_word_embeddings", "max_position_embeddings")


class BeamConfigError(ValueError):
    """A Beam config value that the released schema does not allow."""


def _fail(key: str, value: Any, allowed: str) -> None:
    raise BeamConfigError(f"Beam config {key}={value!r} is invalid: {allowed}")


def _is_number(value: Any) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _own_keys() -> dict[str, Any]:
    """Beam's own config keys, each with BeamConfig's default."""
    import inspect

    params = inspect.signature(BeamConfig.__init__).parameters.items()
    return {k: p.default for k, p in params if k not in ("self", "kwargs")}


def _warn_near_misses(extra: dict[str, Any]) -> None:
    """A key transformers would keep as a plain attribute, spelled like one of Beam's own
    (`num_expert_per_tok`), leaves that key at its default: say so."""
    import difflib

    ours = list(_own_keys())
    for key in extra:
        close = difflib.get_close_matches(key, ours, n=1, cutoff=0.85)
        if close and key not in ours:
            warnings.warn(
                f"Beam config key {key!r} is not one of Beam's; did you mean {close[0]!r}? "
                f"({close[0]} keeps its default)",
                stacklevel=3,
            )


class BeamConfig(PretrainedConfig):
    """Config of `BeamForCausalLM` (released schema; see the project's BEAM.md notes)."""

    model_type = "beam"

    def __init__(
        self,
        vocab_size: int = 512,
        hidden_size: int = 256,
        intermediate_size: int = 512,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        sliding_window: int = 128,
        layer_types: list[str] | None = None,
        mlp_layer_types: list[str] | None = None,
        rope_parameters: dict | None = None,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        moe_intermediate_size: int = 128,
        norm_topk_prob: bool = True,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        final_logit_softcapping: float | None = None,
        tie_word_embeddings: bool = False,
        **kwargs: Any,
    ) -> None:
        for key, why in PRE_RELEASE_KEYS.items():
            if key in kwargs:
                value = kwargs.pop(key)
                warnings.warn(
                    f"Beam config key {key!r}={value!r} is from a pre-release schema and is "
                    f"ignored ({why}).",
                    stacklevel=2,
                )
        _warn_near_misses(kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = (
            head_dim
            if head_dim is not None
            else _default_head_dim(hidden_size, num_attention_heads)
        )
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.sliding_window = sliding_window
        # Only a list or tuple is copied: list("sliding_attention") would hide the bad value.
        self.layer_types = (
            _as_list(layer_types)
            if layer_types is not None
            else ["sliding_attention"] * num_hidden_layers
        )
        self.mlp_layer_types = (
            _as_list(mlp_layer_types)
            if mlp_layer_types is not None
            else ["sparse"] * num_hidden_layers
        )
        self.rope_parameters = (
            rope_parameters
            if rope_parameters is not None
            else {"rope_type": "default", "rope_theta": 10000.0}
        )
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.final_logit_softcapping = final_logit_softcapping
        self.tie_word_embeddings = tie_word_embeddings
        # Ours first: transformers' generic validators give less specific messages.
        self.validate_beam()
        # transformers (5.17) standardizes any `rope_parameters` it finds during __init__ by
        # adding a top-level rope_theta, which corrupts a per-layer-type dict; so the dict is
        # set only once the base class is done (vLLM standardizes it correctly later).
        rope = self.__dict__.pop("rope_parameters")
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.rope_parameters = rope

    # --- validation -----------------------------------------------------------------------

    def validate_beam(self) -> None:
        """Raise `BeamConfigError` naming the key, the value and what is allowed."""
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
            "sliding_window",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_group",
            "topk_group",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(key, value, "a positive integer")
        if not (isinstance(self.rms_norm_eps, float | int) and 0 < self.rms_norm_eps < 1):
            _fail("rms_norm_eps", self.rms_norm_eps, "a float in (0, 1)")
        if self.hidden_act != "silu":
            _fail("hidden_act", self.hidden_act, "Beam's MLPs are SwiGLU; only 'silu' is allowed")
        for key in ("norm_topk_prob", "tie_word_embeddings"):
            if not isinstance(getattr(self, key), bool):
                _fail(key, getattr(self, key), "true or false (a JSON boolean)")
        if self.tie_word_embeddings:
            _fail("tie_word_embeddings", True, "Beam's lm_head is untied; set it to false")
        if self.num_attention_heads % self.num_key_value_heads:
            _fail(
                "num_key_value_heads",
                self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
        self._validate_types("layer_types", self.layer_types, LAYER_TYPES)
        self._validate_types("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)
        self._validate_rope()
        if self.num_experts % self.n_group:
            _fail("n_group", self.n_group, f"must divide num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            _fail("topk_group", self.topk_group, f"at most n_group={self.n_group}")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            _fail(
                "num_experts_per_tok",
                self.num_experts_per_tok,
                f"at most topk_group * num_experts / n_group = {reachable}",
            )
        cap = self.final_logit_softcapping
        if cap is not None and not (_is_number(cap) and cap > 0):
            _fail("final_logit_softcapping", cap, "null or a positive number")
        if not (_is_number(self.routed_scaling_factor) and self.routed_scaling_factor > 0):
            _fail("routed_scaling_factor", self.routed_scaling_factor, "a positive number")

    def _validate_types(self, key: str, value: Any, allowed: tuple[str, ...]) -> None:
        if not isinstance(value, list) or len(value) != self.num_hidden_layers:
            n = len(value) if isinstance(value, list) else type(value).__name__
            _fail(
                key,
                value,
                f"a list of num_hidden_layers={self.num_hidden_layers} entries (got {n})",
            )
        for i, t in enumerate(value):
            if t not in allowed:
                _fail(f"{key}[{i}]", t, f"one of {list(allowed)}")

    def _validate_rope(self) -> None:
        rope = self.rope_parameters
        if not isinstance(rope, dict):
            _fail("rope_parameters", rope, "a RoPE dict or a dict per layer type")
        per_type = set(rope) & set(LAYER_TYPES)
        if per_type:
            if set(rope) - set(LAYER_TYPES):
                _fail("rope_parameters", rope, f"a per-type dict has only keys {list(LAYER_TYPES)}")
            with_rope = [t for t in LAYER_TYPES if rope.get(t) is not None]
            if len(with_rope) != 1:
                _fail(
                    "rope_parameters",
                    rope,
                    "exactly one layer type has RoPE (sliding_attention; full_attention "
                    "layers are NoPE, so give it null)",
                )
            if with_rope != ["sliding_attention"]:
                _fail(
                    "rope_parameters",
                    rope,
                    "RoPE belongs to sliding_attention; full_attention layers are NoPE",
                )
            rope = rope["sliding_attention"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            _fail("rope_parameters.rope_type", rope_type, "only 'default' RoPE is supported")
        theta = rope.get("rope_theta")
        if not isinstance(theta, float | int) or theta <= 0:
            _fail("rope_parameters.rope_theta", theta, "a positive number")

    # --- derived facts --------------------------------------------------------------------

    @property
    def sliding_rope_theta(self) -> float:
        """RoPE base of the sliding-attention layers (the only layers with RoPE).

        Deliberately not called `rope_theta`: transformers and vLLM read an attribute of
        that name as a legacy top-level RoPE setting and move it into `rope_parameters`,
        which breaks the per-layer-type dict.
        """
        rope = self.rope_parameters
        return float(rope.get("sliding_attention", rope)["rope_theta"])

    def residual_scales(self, layer_index: int, sublayer: str) -> tuple[float, float]:
        """(x_scale, residual_scale) of a boundary: add number n = 2L (+1 for the MLP)."""
        n = 2 * (layer_index + 1) + (1 if sublayer == "mlp" else 0)
        return 1.0 / n**0.5, (n - 1) ** 0.5 / n**0.5

    def check_world_size(self, world_size: int) -> None:
        """Raise if tensor parallelism over `world_size` ranks cannot shard this model."""
        for key in (
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "moe_intermediate_size",
        ):
            if getattr(self, key) % world_size:
                raise BeamConfigError(
                    f"Beam config {key}={getattr(self, key)} does not divide by tensor "
                    f"parallel world size {world_size}: choose a world size that divides it"
                )


def _warn_missing(path: str, data: dict[str, Any]) -> None:
    defaults = {k: v for k, v in _own_keys().items() if k not in OPTIONAL_KEYS}
    missing = [k for k in defaults if k not in data]
    if missing:
        given = ", ".join(f"{k}={defaults[k]!r}" for k in missing)
        warnings.warn(
            f"Beam config {path!r} does not set {', '.join(missing)}: they take BeamConfig's "
            f"defaults ({given}), which are a tiny test model's, not Beam-1.0's; write them "
            "into config.json",
            stacklevel=3,
        )


def _as_list(value: Any) -> Any:
    return list(value) if isinstance(value, list | tuple) else value


def _default_head_dim(hidden: Any, heads: Any) -> int:
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        if hidden % heads:
            _fail(
                "num_attention_heads",
                heads,
                f"must divide hidden_size={hidden} when head_dim is not given",
            )
        return hidden // heads
    return 0


PRESETS: dict[str, dict[str, Any]] = {
    # Small enough for CPU CI, yet it has every kind of layer: both attention types, both
    # MLP types, grouped routing that matters (2 groups, only 1 survives).
    "tiny": dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": None,
        },
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        final_logit_softcapping=30.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # Beam-1.0-shaped: hidden 5120 and 256 experts are public; the head layout
    # (48 q / 8 kv x 128) is inferred from upstream kernel shape tables and the rest is a
    # plausible full shape. Not an official config.
    "beam-1.0-shaped": dict(
        vocab_size=131072,
        hidden_size=5120,
        intermediate_size=12288,
        num_hidden_layers=80,
        num_attention_heads=48,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        sliding_window=4096,
        layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 20,
        mlp_layer_types=["dense"] + ["sparse"] * 79,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
            "full_attention": None,
        },
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=1536,
        norm_topk_prob=True,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        final_logit_softcapping=None,
    ),
}


def preset(name: str, num_hidden_layers: int | None = None, **overrides: Any) -> BeamConfig:
    """A preset config; `num_hidden_layers` trims or extends the per-layer type lists."""
    if name not in PRESETS:
        raise BeamConfigError(f"unknown Beam preset {name!r}: choose one of {sorted(PRESETS)}")
    kw = dict(PRESETS[name])
    if num_hidden_layers is not None:
        n = num_hidden_layers
        kw["num_hidden_layers"] = n
        for key in ("layer_types", "mlp_layer_types"):
            base = kw[key]
            kw[key] = [base[i % len(base)] for i in range(n)]
    kw.update(overrides)
    return BeamConfig(**kw)


def warn_missing_keys(folder: str | os.PathLike) -> None:
    """`load_config`'s warning for a checkpoint folder's config.json that leaves out keys
    (they take the tiny preset's defaults), for loaders that read config.json themselves
    (vLLM, through transformers). Nothing for a folder without one (a hub id, say)."""
    path = os.path.join(str(folder), "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError:
            return  # the loader that parses it says so
    _warn_missing(path, data)


def load_config(source: str | os.PathLike, num_hidden_layers: int | None = None) -> BeamConfig:
    """A preset name, a checkpoint folder, or a path to a `config.json`."""
    source = str(source)
    if source in PRESETS:
        return preset(source, num_hidden_layers)
    path = os.path.join(source, "config.json") if os.path.isdir(source) else source
    if not os.path.exists(path):
        raise BeamConfigError(
            f"Beam config {source!r} is neither a preset ({sorted(PRESETS)}) nor a file"
        )
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise BeamConfigError(f"Beam config {path!r} is not valid JSON: {e}") from None
    data.pop("model_type", None)
    _warn_missing(path, data)
    if num_hidden_layers is not None:
        data["num_hidden_layers"] = num_hidden_layers
        for key in ("layer_types", "mlp_layer_types"):
            if key in data:
                data[key] = [data[key][i % len(data[key])] for i in range(num_hidden_layers)]
    return BeamConfig(**data)
