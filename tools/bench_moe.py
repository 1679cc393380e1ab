"""Benchmark the MoE experts + combine, Beam-1.0-shaped, side by side in one run.

Shapes: hidden 5120, 256 experts, top-8; moe_intermediate 1536 (TP=1) and 192 (one rank
of TP=8); tokens 1, 8, 64, 512, 4096. Variants: the NVFP4 CuTeDSL kernels (Hopper; per pair
or in blocks up to 512 (token, expert) pairs, through wgmma above; `--cutedsl-sweep` times
their configs), the NVFP4 Triton kernel (W4A16), the bf16
Triton kernel, torch._grouped_mm bf16, the reference (small token counts only: it loops
over experts on the host), beside the floors: NVFP4 weight bytes (distinct experts touched
x 3 x hidden x moe_intermediate x 0.5625 B) over the measured copy bandwidth, and at
large token counts FLOPs over the measured bf16 matmul rate. Times are CUDA-graph replay
medians over a rotation of inputs (different experts each call, so small calls are not
served from L2). Checks every variant against the reference first.

    python tools/bench_moe.py [--out DIR] [--quick] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
from dataclasses import replace

import torch
import triton
from triton.testing import do_bench_cudagraph

from beamfx.kernels.measure import package_version
from beamfx.kernels.moe import cutedsl as cd
from beamfx.kernels.moe import grouped, nvfp4
from beamfx.kernels.moe import reference as ref
from beamfx.kernels.moe import triton as tk

HIDDEN, EXPERTS, TOP_K = 5120, 256, 8
SHAPES = {"TP1": 1536, "TP8": 192}
TOKENS = (1, 8, 64, 512, 4096)


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s, read + write counted: the better of two methods."""
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    b = torch.empty_like(a)
    graph_ms = do_bench_cudagraph(lambda: b.copy_(a), rep=100, return_mode="median")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    event_ms = start.elapsed_time(end) / 10
    return 2 * a.numel() * 4 / (min(graph_ms, event_ms) * 1e-3)


def matmul_rate() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench_cudagraph(lambda: a @ b, rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def random_experts(inter: int, gen: torch.Generator) -> nvfp4.NVFP4Experts:
    """Random NVFP4 experts straight in the packed layout (codes, scales, globals)."""
    dev = "cuda"
    e, h = EXPERTS, HIDDEN

    def packed(n, k):
        return torch.randint(0, 256, (e, n, k // 2), generator=gen, device=dev, dtype=torch.uint8)

    def scales(n, k):
        s = torch.rand(e, n, k // 16, generator=gen, device=dev) * 1.5 + 0.5
        return s.to(torch.float8_e4m3fn)

    # Random codes have RMS ~2.9 and scales mean ~1.25: globals give weights ~1/sqrt(K).
    g13 = torch.full((e, 2), 1.0 / (3.6 * h**0.5), device=dev)
    g2 = torch.full((e,), 1.0 / (3.6 * inter**0.5), device=dev)
    return nvfp4.NVFP4Experts(
        packed(2 * inter, h), scales(2 * inter, h), g13, packed(h, inter), scales(h, inter), g2
    )


def dense_bf16(q: nvfp4.NVFP4Experts):
    """The bf16 weights = the reference's dequantization, a few experts at a time."""
    w13, w2 = [], []
    for s in range(0, EXPERTS, 16):
        part = [t[s : s + 16] for t in q.tensors()]
        a, b = nvfp4.dequantize_experts(*part, dtype=torch.bfloat16)
        w13.append(a)
        w2.append(b)
    return torch.cat(w13), torch.cat(w2)


def routing_sets(tokens: int, n_sets: int, gen: torch.Generator):
    """Inputs (x, ids, weights), each set touching other experts where it can."""
    sets = []
    # One permutation, cut into disjoint groups: consecutive 1-token calls share no weights
    # (a permutation drawn per set let 32 sets touch only ~164 of the 256 experts).
    perm = torch.randperm(EXPERTS, generator=gen, device="cuda")
    for i in range(n_sets):
        x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        if tokens == 1:
            ids = perm[(i % (EXPERTS // TOP_K)) * TOP_K :][:TOP_K].view(1, TOP_K)
        else:
            scores = torch.rand(tokens, EXPERTS, generator=gen, device="cuda")
            ids = scores.topk(TOP_K, dim=-1).indices
        w = torch.rand(tokens, TOP_K, generator=gen, device="cuda")
        sets.append((x, ids.to(torch.int32), w / w.sum(-1, keepdim=True)))
    return sets


def moe_flops(tokens: int, inter: int) -> float:
    """FLOPs of the experts: tokens x top-k pairs, 3 matrices of hidden x inter each."""
    return 2 * tokens * TOP_K * 3 * HIDDEN * inter


def nvfp4_floor_us(experts: float, inter: int, bw: float) -> float:
    """The NVFP4 weight-bytes floor: `experts` x 3 matrices x hidden x inter x 0.5625 bytes
    at copy bandwidth `bw` (bytes/s)."""
    return experts * 3 * HIDDEN * inter * 0.5625 / bw * 1e6


def n_input_sets(tokens: int) -> int:
    """Input sets a timing rotates over: enough that small calls read their weights from
    DRAM, not L2 (at a token, disjoint expert groups)."""
    return 32 if tokens == 1 else 8 if tokens <= 64 else 2


def interleaved_rounds(fns: dict, sets, rounds: int) -> dict[str, list[float]]:
    """`time_over` of each of `fns` (name -> fn) per round, the order reversed every other
    round, so slow drift of the machine falls on every variant alike."""
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in list(fns)[:: 1 if r % 2 else -1]:
            times[name].append(time_over(fns[name], sets))
    return times


def time_over(fn, sets, graph=True) -> float:
    """Median microseconds per call, over a rotation of input sets."""

    def run_all():
        for s in sets:
            fn(*s)

    if graph:
        ms = do_bench_cudagraph(run_all, rep=40, return_mode="median")
    else:
        ms = triton.testing.do_bench(run_all, rep=40, return_mode="median")
    return ms * 1e3 / len(sets)


def rel_err(out, want) -> float:
    if out.isnan().any():
        return float("nan")
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def sweep_configs(pairs: int, inter: int, fp4: bool) -> list[tk.Config]:
    base = tk.mma_config(pairs, HIDDEN, inter, fp4)
    if base.scan:
        cands = [base, replace(base, bn1=16), replace(base, bn1=64), replace(base, bn2=128)]
        cands += [replace(base, warps1=8, warps2=8), replace(base, stages1=4, stages2=4)]
        cands += [replace(base, bk1=128, bk2=min(128, base.bk2))]
        if fp4:  # the two NVFP4 decodes (kernels/moe/triton.py, Config.decode)
            cands += [replace(base, decode=d) for d in (0, 1)]
    else:
        # Sorted blocks: taller row blocks share each weight tile (and, NVFP4, its decode)
        # among more rows; shorter ones pad less when experts get few rows each.
        bn1_wide = 128 if inter % 128 == 0 else base.bn1
        cands = [
            base,
            replace(base, bm=128, warps1=8, warps2=8),
            replace(base, bm=128, bn1=bn1_wide, warps1=8, warps2=8),
            replace(base, bm=128, bn1=bn1_wide, bn2=256, warps1=8, warps2=8),
            replace(base, bm=128, warps1=8, warps2=8, stages1=4, stages2=4),
            replace(base, bn1=bn1_wide, warps1=8),
            replace(base, stages1=4, stages2=4),
            replace(base, bm=32, warps2=4),
            replace(base, bm=16, bn2=64, warps2=4),
        ]
    out = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def atomics_config(x: torch.Tensor, w2b: torch.Tensor, fp4: bool) -> tk.Config:
    cfg = tk.mma_config(x.shape[0] * TOP_K, HIDDEN, w2b.shape[2], fp4)
    return replace(cfg, combine_rows=False)


# CuTeDSL configs timed by --cutedsl-sweep: (FC1 warps, depth, FC2 warps, depth, grouped, PDL)
CUTEDSL_SWEEP = [
    cd.Config(*c)
    for c in ((4, 4, 8, 4, False, False), (4, 8, 8, 4, False, True), (8, 4, 8, 4, False, True),
              (4, 4, 8, 2, False, True), (4, 2, 4, 2, True, False), (4, 2, 4, 2, True, True),
              (4, 4, 4, 2, True, True), (4, 2, 2, 2, True, True))
]  # fmt: skip


# Activations staged in shared memory (`stage`), with the chunks in flight, on the default
# config (the default stages; unstaged second and again last, for run-to-run drift)
STAGE_SWEEP = [{}, dict(stage=False), dict(stage=True), dict(stage=True, depth1=2),
               dict(stage=True, depth2=2), dict(stage=True, warps1=8),
               dict(stage=False)]  # fmt: skip


def variants(q: nvfp4.NVFP4Experts, w13b: torch.Tensor, w2b: torch.Tensor) -> dict:
    """The implementations compared, each `fn(x, ids, weights)` -> [T, H] bf16."""
    scales = (q.w13_scale, q.w13_global, q.w2_scale, q.w2_global)
    return {
        "nvfp4_triton": lambda x, i, w: tk.moe(x, i, q.w13, q.w2, scales, w, 2.5),
        "bf16_triton": lambda x, i, w: tk.moe(x, i, w13b, w2b, None, w, 2.5),
        "grouped_mm_bf16": lambda x, i, w: grouped.mega_moe(x, w, i, w13b, w2b, 2.5),
        "reference": lambda x, i, w: ref.mega_moe_nvfp4(x, w, i, *q.tensors(), 2.5),
        # the two NVFP4 kernels at decode sizes, forced: tensor-core MMA or fp32 FMAs
        "nvfp4_mma": lambda x, i, w: tk.moe(
            x,
            i,
            q.w13,
            q.w2,
            scales,
            w,
            2.5,
            config=tk.mma_config(x.shape[0] * TOP_K, HIDDEN, w2b.shape[2], True),
        ),  # fmt: skip
        # the CuTeDSL tensor-core kernels (fragment-layout weights), where they serve
        "nvfp4_cutedsl": lambda x, i, w: cd.experts(x, i, *q.tensors(), w, 2.5),
        "cutedsl_config": lambda x, i, w, c: cd.experts(x, i, *q.tensors(), w, 2.5, config=c),
        "nvfp4_fma": lambda x, i, w: tk.moe(
            x, i, q.w13, q.w2, scales, w, 2.5, config=tk.fma_config(w2b.shape[2])
        ),
        # its two launches alone (FC2 on FC1's output, made once per input set)
        "nvfp4_fma_fc1": lambda x, i, w: tk.fma_fc1(
            x, i.reshape(-1), TOP_K, q.w13, q.w13_scale, q.w13_global, tk.fma_config(w2b.shape[2])
        ),
        # sorted blocks, the combine by fp32 atomics in FC2 (the default: k bf16 rows, then
        # a finalize launch)
        "nvfp4_atomics": lambda x, i, w: tk.moe(
            x, i, q.w13, q.w2, scales, w, 2.5, config=atomics_config(x, w2b, True)
        ),
        "bf16_atomics": lambda x, i, w: tk.moe(
            x, i, w13b, w2b, None, w, 2.5, config=atomics_config(x, w2b, False)
        ),
        # tile sweeps
        "nvfp4_config": lambda x, i, w, c: tk.moe(x, i, q.w13, q.w2, scales, w, 2.5, config=c),
        "bf16_config": lambda x, i, w, c: tk.moe(x, i, w13b, w2b, None, w, 2.5, config=c),
    }


def bench_shape(
    shape, inter, token_counts, gen, bw, mm, sweep, sweeps, fma_sweep=False, cutedsl_sweep=False
):
    q = random_experts(inter, gen)
    w13b, w2b = dense_bf16(q)
    fns = variants(q, w13b, w2b)
    rows = []
    for tokens in token_counts:
        sets = routing_sets(tokens, n_input_sets(tokens), gen)
        distinct = sum(len(torch.unique(s[1])) for s in sets) / len(sets)
        row = dict(
            shape=shape, inter=inter, tokens=tokens, experts_touched=distinct,
            floor_nvfp4_us=nvfp4_floor_us(distinct, inter, bw),
            floor_bf16_us=distinct * 3 * HIDDEN * inter * 2 / bw * 1e6,
            floor_flops_us=moe_flops(tokens, inter) / mm * 1e6,
        )  # fmt: skip
        row["nvfp4_path"] = (
            "FMA" if tk.pick_config(tokens * TOP_K, HIDDEN, inter, True).fma else "MMA"
        )
        x0, i0, w0 = sets[0]
        want = ref.mega_moe(x0, w0, i0, w13b, w2b, 2.5)  # = the NVFP4 reference's math
        names = ["nvfp4_triton", "bf16_triton", "grouped_mm_bf16"]
        if tokens * TOP_K <= tk.SCAN_MAX_PAIRS:
            names += ["nvfp4_mma", "nvfp4_fma"]
        else:
            names += ["nvfp4_atomics", "bf16_atomics"]
        if cd.why_not(x0, i0, *q.tensors()) is None:  # per pair, in blocks, or through wgmma
            names.append("nvfp4_cutedsl")
        for name in names:
            err, us = measure(fns[name], sets, want)
            row[f"{name}_us"], row[f"{name}_err"] = us, err
            print(f"{shape} T={tokens:5d} {name:16s} {us:9.1f} us  err {err:.1e}", flush=True)
        if tokens * TOP_K <= tk.SCAN_MAX_PAIRS:  # the FMA path's launches, one at a time
            cfg = tk.fma_config(inter)
            fc2_sets = [(fns["nvfp4_fma_fc1"](*st), st[1], st[2]) for st in sets]

            def fc2(h, i, w, cfg=cfg):
                return tk.fma_fc2(
                    h, i.reshape(-1), i.shape[0], TOP_K, q.w2, q.w2_scale, q.w2_global, w, 2.5,
                    HIDDEN, cfg,
                )  # fmt: skip

            row["nvfp4_fma_fc1_us"] = time_over(fns["nvfp4_fma_fc1"], sets)
            row["nvfp4_fma_fc2_us"] = time_over(fc2, fc2_sets)
            # each launch's share of the NVFP4 floor: FC1 reads 2/3 of the weights
            print(f"{shape} T={tokens:5d} FMA FC1 {row['nvfp4_fma_fc1_us']:.1f} us (floor "
                  f"{2 * row['floor_nvfp4_us'] / 3:.1f}), FC2 {row['nvfp4_fma_fc2_us']:.1f} us "
                  f"(floor {row['floor_nvfp4_us'] / 3:.1f})", flush=True)  # fmt: skip
        if cutedsl_sweep and "nvfp4_cutedsl" in names:
            cfgs = CUTEDSL_SWEEP
            if cutedsl_sweep == "stage":  # per pair only: grouped configs do not stage
                base = cd.pick_config(tokens * TOP_K, HIDDEN, inter, TOP_K)
                cfgs = [] if base.grouped else [replace(base, **c) for c in STAGE_SWEEP]
            elif cutedsl_sweep == "group":  # per pair, in blocks, per pair again (drift)
                cfgs = [cd.pick_config(tokens * TOP_K, HIDDEN, inter, TOP_K, g)
                        for g in (False, True, False)]  # fmt: skip
            for cfg in cfgs:
                fn = functools.partial(fns["cutedsl_config"], c=cfg)
                err, us = measure(fn, sets, want)
                sweeps.append(dict(shape=shape, tokens=tokens, cutedsl=cfg.__dict__, us=us,
                                   err=err))  # fmt: skip
                print(f"  cutedsl sweep {cfg}: {us:.1f} us err {err:.1e}", flush=True)
        if tokens <= 8:  # host loop over experts: not graph-capturable, slow
            row["reference_us"] = time_over(fns["reference"], sets[:2], graph=False)
        if fma_sweep and tokens * TOP_K <= tk.SCAN_MAX_PAIRS:
            base = tk.fma_config(inter)
            cands = [replace(base, bn1=2, warps1=2), replace(base, bn1=8, warps1=8),
                     replace(base, bk1=512), replace(base, bn2=16, bk2=128, warps2=4),
                     replace(base, bn2=4, warps2=1), replace(base, bk2=128)]  # fmt: skip
            for cfg in cands:
                fn = functools.partial(fns["nvfp4_config"], c=cfg)
                err, us = measure(fn, sets, want)
                sweeps.append(dict(shape=shape, tokens=tokens, fp4=True, config=cfg.__dict__,
                                   us=us, err=err))  # fmt: skip
                print(f"  fma sweep {cfg}: {us:.1f} us err {err:.1e}", flush=True)
        if sweep and tokens in (1, 64, 512, 4096):
            for fp4, name in ((True, "nvfp4"), (False, "bf16"))[: 1 if sweep == "nvfp4" else 2]:
                best = float("inf")
                for cfg in sweep_configs(tokens * TOP_K, inter, fp4):
                    fn = functools.partial(fns[f"{name}_config"], c=cfg)
                    err, us = measure(fn, sets, want)
                    if err < 2e-2:
                        best = min(best, us)
                    sweeps.append(
                        dict(shape=shape, tokens=tokens, fp4=fp4, config=cfg.__dict__, us=us,
                             err=err)
                    )  # fmt: skip
                    print(f"  sweep {name} {cfg}: {us:.1f} us err {err:.1e}", flush=True)
                row[f"{name}_best_us"] = best
        rows.append(row)
    return rows


def measure(fn, sets, want) -> tuple[float, float]:
    """(relative error against `want`, us per call); NaNs if it fails (the run goes on)."""
    try:
        return rel_err(fn(*sets[0]), want), time_over(fn, sets)
    except Exception as exc:
        print(f"  failed: {type(exc).__name__}: {exc}"[:1000], flush=True)
        return float("nan"), float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--quick", action="store_true", help="TP8 only, fewer token counts")
    ap.add_argument("--sweep", action="store_true", help="also time tile variants")
    ap.add_argument("--sweep-nvfp4-only", action="store_true", help="sweep the NVFP4 kernel only")
    ap.add_argument("--tokens", type=int, nargs="*", help="token counts (default: all)")
    ap.add_argument("--fma-sweep", action="store_true", help="sweep the NVFP4 FMA kernel tiles")
    ap.add_argument("--cutedsl-sweep", action="store_true", help="sweep the CuTeDSL configs")
    ap.add_argument(
        "--stage-sweep",
        action="store_true",
        help="sweep staging activations in shared memory (CuTeDSL, per pair)",
    )
    ap.add_argument(
        "--group-sweep",
        action="store_true",
        help="CuTeDSL per pair against blocks of pairs, and the sort alone (one launch or torch)",
    )
    ap.add_argument("--sort", action="store_true", help="only time the sort into blocks")
    ap.add_argument("--sort-pairs", nargs="*", type=int, default=SORT_PAIRS,
                    help="pair counts for --sort")  # fmt: skip
    ap.add_argument("--shapes", nargs="*", choices=list(SHAPES), help="shapes (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.sort:
        meta = run_meta(timing="CUDA-graph replay median per call over 8 id sets",
                        experts=EXPERTS)  # fmt: skip
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_sort.json"), "w") as f:
            json.dump(dict(meta=meta, rows=sort_timings(gen, args.sort_pairs)), f, indent=1)
        return
    bw, mm = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows, sweeps = [], []
    for shape, inter in SHAPES.items():
        if args.shapes and shape not in args.shapes:
            continue
        if not (args.quick and shape == "TP1"):
            tokens = args.tokens or (TOKENS if not args.quick else (1, 64, 4096))
            sweep = "nvfp4" if args.sweep_nvfp4_only else args.sweep
            rows += bench_shape(
                shape, inter, tokens, gen, bw, mm, sweep, sweeps, args.fma_sweep,
                "configs" if args.cutedsl_sweep else "stage" if args.stage_sweep
                else "group" if args.group_sweep else None,
            )  # fmt: skip
            torch.cuda.empty_cache()
    meta = run_meta(
        copy_bandwidth_GBps=bw / 1e9,
        bf16_matmul_TFLOPs=mm / 1e12,
        launches_per_call=f"{tk.LAUNCHES} (NVFP4/bf16 Triton, <= {tk.SCAN_MAX_PAIRS} pairs); "
        f"CuTeDSL {cd.LAUNCHES} per pair, 4 in blocks (from {cd.GROUP_MIN_PAIRS} pairs on "
        f"experts >= {cd.GROUP_MIN_INTER} wide, {cd.GROUP_MIN_PAIRS_NARROW} on narrower); "
        f"through wgmma above {cd.MAX_PAIRS} pairs: 5-7 (the sort's 1-3, x's K permuted, "
        f"FC1, FC2, the finalize)",
        shape=dict(hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K, moe_intermediate=SHAPES),
    )
    os.makedirs(args.out, exist_ok=True)
    if args.stage_sweep or args.group_sweep:
        name = "moe_stage_sweep.json" if args.stage_sweep else "moe_group_sweep.json"
        extra = dict(sort=sort_timings(gen)) if args.group_sweep else {}
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(dict(meta=meta, rows=rows, sweep=sweeps, **extra), f, indent=1)
        return
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweeps), f, indent=1)
    table = markdown(meta, rows)
    with open(os.path.join(args.out, "moe.md"), "w") as f:
        f.write(table)
    print(table)


def run_meta(**more) -> dict:
    """The device, the versions and the date of a run, and `more`."""
    return dict(
        device=torch.cuda.get_device_name(),
        capability=list(torch.cuda.get_device_capability()),
        torch=torch.__version__,
        triton=triton.__version__,
        nvidia_cutlass_dsl=package_version("nvidia-cutlass-dsl") or "absent",
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **more,
    )


SORT_PAIRS = (64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 131072)


def sort_timings(gen: torch.Generator, counts=SORT_PAIRS) -> list[dict]:
    """`sort_blocks` alone, per call (graph replay): the default path (`tk.sort_path`), the
    three chunked launches forced on, the chunked launches off (one program, or the torch
    ops past SORT_ONE_PROGRAM_PAIRS), and the torch ops."""

    def chunked_set(on: bool):
        def sort(ids, experts, bm):
            old, tk.SORT_CHUNKED_ON_GPU = tk.SORT_CHUNKED_ON_GPU, on
            try:
                return tk.sort_blocks(ids, experts, bm)
            finally:
                tk.SORT_CHUNKED_ON_GPU = old

        return sort

    out = []
    for pairs in counts:
        for bm in (cd.GROUP, 64):
            sets = [(torch.randint(0, EXPERTS, (pairs,), generator=gen, device="cuda",
                                   dtype=torch.int32),) for _ in range(8)]  # fmt: skip
            want = tk.sort_blocks_torch(sets[0][0], EXPERTS, bm)
            row = dict(pairs=pairs, bm=bm, default_path=tk.sort_path(sets[0][0], EXPERTS))
            fns = (("default", tk.sort_blocks), ("chunked", chunked_set(True)),
                   ("chunked_off", chunked_set(False)),
                   ("torch_ops", tk.sort_blocks_torch))  # fmt: skip
            for name, fn in fns:
                got = fn(sets[0][0], EXPERTS, bm)
                row[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
                row[f"{name}_us"] = time_over(lambda i, fn=fn, bm=bm: fn(i, EXPERTS, bm), sets)
            print(
                f"sort {pairs:5d} pairs, {bm:3d} rows a block: default ({row['default_path']}) "
                f"{row['default_us']:.2f} us, chunked {row['chunked_us']:.2f}, chunked off "
                f"{row['chunked_off_us']:.2f}, torch ops {row['torch_ops_us']:.2f}",
                flush=True,
            )
            out.append(row)
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# MoE experts + combine, Beam-1.0-shaped "
        f"(hidden {HIDDEN}, {EXPERTS} experts, top-{TOP_K})",
        "",
        f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, "
        f"nvidia-cutlass-dsl {meta.get('nvidia_cutlass_dsl', '4.8.1')}, {meta['date']}. "
        f"Measured: copy {meta['copy_bandwidth_GBps']:.0f} GB/s, bf16 matmul "
        f"{meta['bf16_matmul_TFLOPs']:.0f} TFLOP/s. CUDA-graph replay medians (us per call).",
        "",
        "| shape | tokens | experts | NVFP4 CuTeDSL (% of floor, vs bf16) | NVFP4 Triton | "
        "% of NVFP4 floor | bf16 Triton | "
        "grouped_mm bf16 | reference | NVFP4 floor | bf16 floor | FLOP floor | "
        "NVFP4 vs bf16 | TFLOP/s NVFP4 | best swept NVFP4 / bf16 | "
        "NVFP4 MMA / FMA (forced; FMA launches alone, % of their floor), or the combine as "
        "the combine by fp32 atomics (NVFP4 / bf16) |",
        "|" + " --- |" * 16,
    ]
    for r in rows:
        fp4 = r["nvfp4_triton_us"]
        tflops = moe_flops(r["tokens"], r["inter"]) / fp4 / 1e6
        refus = f"{r['reference_us']:.0f}" if "reference_us" in r else "-"
        best = "-"
        if "nvfp4_best_us" in r:
            best = f"{r['nvfp4_best_us']:.1f} / " + (
                f"{r['bf16_best_us']:.1f}" if "bf16_best_us" in r else "-"
            )
        path = f" ({r['nvfp4_path']})" if "nvfp4_path" in r else ""  # which kernels ran
        cute = "-"
        if r.get("nvfp4_cutedsl_us", float("nan")) == r.get("nvfp4_cutedsl_us"):  # not NaN
            c = r["nvfp4_cutedsl_us"]
            cute = f"{c:.1f} ({100 * r['floor_nvfp4_us'] / c:.0f}%, {r['bf16_triton_us'] / c:.2f}x"
            if r["tokens"] * TOP_K > cd.MAX_PAIRS:  # the wgmma kernels: their FLOP rate
                tf = moe_flops(r["tokens"], r["inter"]) / c / 1e6
                share = 100 * tf / meta["bf16_matmul_TFLOPs"]
                cute += f"; {tf:.0f} TFLOP/s, {share:.0f}% of matmul"
            cute += ")"
        forced = "-"
        if "nvfp4_fma_us" in r:
            forced = f"{r['nvfp4_mma_us']:.1f} / {r['nvfp4_fma_us']:.1f}"
        if "nvfp4_atomics_us" in r:
            forced = f"atomics: {r['nvfp4_atomics_us']:.1f} / bf16 {r['bf16_atomics_us']:.1f}"
        if "nvfp4_fma_fc1_us" in r:  # FC1 + FC2 alone, each against its third of the floor
            f1, f2 = r["nvfp4_fma_fc1_us"], r["nvfp4_fma_fc2_us"]
            floor = r["floor_nvfp4_us"]
            forced += f" (FC1 {f1:.1f}, {200 * floor / 3 / f1:.0f}%; FC2 {f2:.1f}, "
            forced += f"{100 * floor / 3 / f2:.0f}%)"
        lines.append(
            f"| {r['shape']} (I={r['inter']}) | {r['tokens']} | {r['experts_touched']:.0f} | "
            f"{cute} | {fp4:.1f}{path} | {100 * r['floor_nvfp4_us'] / fp4:.0f}% | "
            f"{r['bf16_triton_us']:.1f} | "
            f"{r['grouped_mm_bf16_us']:.1f} | {refus} | {r['floor_nvfp4_us']:.1f} | "
            f"{r['floor_bf16_us']:.1f} | {r['floor_flops_us']:.1f} | "
            f"{r['bf16_triton_us'] / fp4:.2f}x | {tflops:.0f} | {best} | {forced} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
