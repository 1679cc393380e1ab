"""Launch chosen kernels a few times each, for Nsight Compute to profile, and print each
Triton kernel's registers, spills and shared memory.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        -k regex:'fc1|fc2|router' python tools/ncu_targets.py [CASE ...]

Cases: moe-nvfp4 (TP1 shape, 1 token, both Triton NVFP4 decoders), moe-bf16, router (Triton,
1 and 16 tokens), boundary (the fused boundary at 4096 rows and `torch.cat` of the same
bytes; filter "boundary|Cat"), moe-cutedsl (the CuTeDSL NVFP4 experts at a token, TP1;
"fc"), moe-wgmma (the CuTeDSL wgmma experts at 4096 tokens, TP1; "gemm_kernel"),
router-cutedsl (the CuTeDSL router GEMM at 1 and 16 tokens and the Triton whole-row kernel
at 1; "router|gemv"). Beam-1.0 shapes, random weights; eager calls, so each kernel
is profiled alone. `bench/results/ncu.md` has a profile of the last three.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_boundary  # noqa: E402
import bench_moe  # noqa: E402

from beamfx.kernels.boundary import triton as boundary_triton  # noqa: E402
from beamfx.kernels.moe import cutedsl as moe_cutedsl  # noqa: E402
from beamfx.kernels.moe import triton as tk  # noqa: E402
from beamfx.kernels.router import cutedsl as router_cutedsl  # noqa: E402
from beamfx.kernels.router import triton as rt  # noqa: E402


def describe(jit_fn) -> None:
    """Registers, spills and shared memory of each compiled variant (Triton internals)."""
    try:
        for caches in jit_fn.device_caches.values():
            for kernel in caches[0].values():
                md, name = kernel.metadata, jit_fn.fn.__name__
                print(
                    f"{name}: {kernel.n_regs} registers, {kernel.n_spills} spills, "
                    f"{md.shared} B shared, {md.num_warps} warps",
                    flush=True,
                )
    except (AttributeError, IndexError, TypeError) as exc:
        print(f"{jit_fn.fn.__name__}: no compile metadata ({exc})")


def moe_cases(fp4: bool, runs: int = 2) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = bench_moe.random_experts(1536, gen)
    x, ids, w = bench_moe.routing_sets(1, 1, gen)[0]
    if fp4:
        scales = (q.w13_scale, q.w13_global, q.w2_scale, q.w2_global)
        for decode in (0, 1):
            cfg = replace(tk.mma_config(8, bench_moe.HIDDEN, 1536, True), decode=decode)
            print(f"moe nvfp4 1 token, decode {decode}: {cfg}", flush=True)
            for _ in range(runs):
                tk.moe(x, ids, q.w13, q.w2, scales, w, 2.5, config=cfg)
    else:
        w13b, w2b = bench_moe.dense_bf16(q)
        print("moe bf16 1 token", flush=True)
        for _ in range(runs):
            tk.moe(x, ids, w13b, w2b, None, w, 2.5)
    torch.cuda.synchronize()
    describe(tk._fc1_kernel)
    describe(tk._fc2_kernel)


def router_cases(runs: int = 2) -> None:
    w = torch.randn(256, 5120, device="cuda") / 5120**0.5
    for tokens in (1, 16):
        x = torch.randn(tokens, 5120, device="cuda").to(torch.bfloat16)
        print(f"router {tokens} tokens: {rt._gemm_config(tokens)}", flush=True)
        for _ in range(runs):
            rt.router_gemm(x, w, config=rt._gemm_config(tokens))
    torch.cuda.synchronize()
    describe(rt._router_gemm_kernel)


def boundary_case(runs: int = 3) -> None:
    s = bench_boundary.make_set(4096, 0, torch.Generator(device="cuda").manual_seed(0))
    for _ in range(runs):
        boundary_triton.fused_boundary(*s)
        torch.cat([s[0], s[1]])
    torch.cuda.synchronize()
    describe(boundary_triton._boundary_kernel)


def moe_cutedsl_case(tokens: int = 1, runs: int = 4) -> None:
    """The CuTeDSL NVFP4 experts, TP1: at a token per pair, at 4096 tokens through wgmma."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = bench_moe.random_experts(1536, gen)
    for x, ids, w in bench_moe.routing_sets(tokens, runs, gen):
        moe_cutedsl.experts(x, ids, *q.tensors(), w, 2.5)
    torch.cuda.synchronize()


def router_cutedsl_case(runs: int = 3) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 5120, generator=gen, device="cuda") / 5120**0.5
    for tokens in (1, 16):
        x = torch.randn(tokens, 5120, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(runs):
            router_cutedsl.router_gemm(x, w)
            if tokens == 1:
                rt.router_gemm(x, w)
    torch.cuda.synchronize()


CASES = {
    "moe-nvfp4": lambda: moe_cases(True),
    "moe-bf16": lambda: moe_cases(False),
    "router": router_cases,
    "boundary": boundary_case,
    "moe-cutedsl": moe_cutedsl_case,
    "moe-wgmma": lambda: moe_cutedsl_case(4096, runs=2),
    "router-cutedsl": router_cutedsl_case,
}

if __name__ == "__main__":
    cases = sys.argv[1:] or ["moe-nvfp4", "moe-bf16", "router"]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"ncu_targets: unknown case(s) {unknown}; choose from {list(CASES)}")
    for case in cases:
        CASES[case]()
