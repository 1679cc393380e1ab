"""Mixture of experts: routing, experts, finalize; bf16 and NVFP4 weights."""
