"""MegaMoE: the routed experts and their finalize -> one fused MoE op (bf16 or NVFP4 weights).

Runs before `boundary` in "all", so the boundary then fuses after a finished MoE output.
Run alone, `boundary` folds the finalize into the boundary instead; either way the math
is the same references, so the two orders give the same numbers.
"""

from beamfx import ops as ir
from beamfx import pattern
from beamfx.pattern import F32, FP8, I32, U8, Act, E, FusionPass, H, I, K, T

# The fused op's output has x's shape: the experts must map hidden back to hidden.
HIDDEN_TO_HIDDEN = pattern.same_size(("x", -1), ("w2", 1))
# Tokens and slots agree (the weights' dims are packed or stacked: not annotated alike).
TOKENS = pattern.shapes_as_annotated("x", "topk_weights", "topk_ids")

BF16 = [HIDDEN_TO_HIDDEN, TOKENS, pattern.kernel_for(
    "mega_moe", "x", "topk_weights", "topk_ids", "w13", "w2", "routed_scale")]  # fmt: skip
NVFP4 = [HIDDEN_TO_HIDDEN, TOKENS, pattern.kernel_for(
    "mega_moe_nvfp4", "x", "topk_weights", "topk_ids", "w13", "w13_scale", "w13_global", "w2",
    "w2_scale", "w2_global", "routed_scale")]  # fmt: skip

PASS = FusionPass(
    "mega_moe",
    "routed experts (bf16 or NVFP4) + weighted finalize -> one mega_moe op",
)


@PASS.rule(replace=ir.mega_moe, constraints=BF16)
def bf16(x: Act[T, H], topk_weights: F32[T, K], topk_ids: I32[T, K], w13: Act[E, I, H],
         w2: Act[E, H, I], routed_scale: float):  # fmt: skip
    return ir.moe_finalize(ir.moe_experts(x, w13, w2, topk_ids), topk_weights, routed_scale)


@PASS.rule(replace=ir.mega_moe_nvfp4, constraints=NVFP4)
def nvfp4(x: Act[T, H], topk_weights: F32[T, K], topk_ids: I32[T, K], w13: U8[E, I, H],
          w13_scale: FP8[E, I, H], w13_global: F32[E, K], w2: U8[E, H, I], w2_scale: FP8[E, H, I],
          w2_global: F32[E], routed_scale: float):  # fmt: skip
    rows = ir.moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids)
    return ir.moe_finalize(rows, topk_weights, routed_scale)
