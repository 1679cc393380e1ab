"""Router fusion: the router GEMM (activations x fp32 or bf16 weight -> fp32 logits) becomes
the low-latency `router_gemm`; with the grouped top-k routing that follows, `routed_topk`.

The fused op picks its kernel by token count at run time (no recompiles): small batches
take the Triton router kernels, large ones one cuBLAS bf16 GEMM on the fp32 weight's exact
bf16 pieces (kernels/router/triton.py).
"""

import torch

from beamfx import ops as ir
from beamfx.pattern import F32, Act, AnyFloat, E, FusionPass, H, T, dtype_in, shapes_as_annotated

PASS = FusionPass(
    "router_gemm",
    "router GEMM (bf16 x fp32 -> fp32 logits) -> router_gemm; with the sigmoid grouped "
    "top-k routing after it -> routed_topk",
)
X_DTYPE = dtype_in("x", torch.bfloat16, torch.float16, torch.float32)


@PASS.rule(replace=lambda x, weight: ir.router_gemm(x, weight),
           constraints=[X_DTYPE, shapes_as_annotated("x", "weight")])  # fmt: skip
def logits(x: Act[T, H], weight: AnyFloat[E, H]):
    return ir.router_logits(x, weight)


@PASS.rule(replace=ir.routed_topk, constraints=[X_DTYPE, shapes_as_annotated("x", "weight",
           "correction_bias")])  # fmt: skip
def routed(x: Act[T, H], weight: AnyFloat[E, H], correction_bias: F32[E], top_k: int,
           n_group: int, topk_group: int, renormalize: bool):  # fmt: skip
    logits = ir.router_logits(x, weight)
    return ir.grouped_topk(logits, correction_bias, top_k, n_group, topk_group, renormalize)
