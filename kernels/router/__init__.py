"""The MoE router GEMM (bf16 x fp32 -> fp32 logits) and the routing that follows it."""
