"""Benchmark the sublayer boundary (BEAM.md "Decoder layer") at hidden 5120, bf16.

Side by side in one run, per token count (1, 4, 16, 64, 256, 1024, 4096, 16384): the Triton
fused op (launched with programmatic dependent launch where the GPU and Triton have it, and
without), the unfused eager reference ops, and `torch.compile` (Inductor defaults, static
shapes) of the same unfused math; the same for the MoE boundary (finalize of k=8 expert
rows folded in) at 1, 64, 1024, 4096 tokens. Each row: CUDA-graph replay median per
boundary; the copy-bandwidth floor (bytes read once + written once over the copy bandwidth
measured in this run); kernel launches per boundary (torch.profiler: device kernels and
memsets of one eager call); the drift from the contract (h, y: % bitwise equal, max diff).
A last row per plain token count times `torch.cat` of x and r: the same bytes moved by a
copy kernel at this size, what the fused op's "% of floor" can be held against.
Inputs rotate over several sets (up to 16, 256 MiB in all) so that large calls are not served
from L2; below 256 tokens the 16 sets fit in the 50 MB L2 (42 MB at 64 tokens), so those
rows' % of floor may read L2 (their target is a time, not a bandwidth).

    python tools/bench_boundary.py [--out DIR] [--sweep] [--quick] [--ab-row2d]

`--ab-row2d` times only the kernel with its tiles as rows of 2-D tiles (`ROW2D`, one block
reduction a norm) against the 1-D tiles (one a tile), and the copy of the same bytes, at
1-16384 tokens (both split into exact tiles; and the launch heuristic's choice),
interleaved over rounds, into `boundary_row2d_ab.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics

import torch
import triton

from beamfx.kernels.boundary import reference
from beamfx.kernels.boundary import triton as tk
from beamfx.kernels.measure import copy_bandwidth, count_launches, time_per_call

HIDDEN, TOP_K = 5120, 8
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
MOE_TOKENS = (1, 64, 1024, 4096)
SWEEP_TOKENS = (1, 64, 1024, 16384)
ROTATION_BYTES = 256 << 20


def boundary_bytes(tokens: int, topk: int) -> int:
    row = HIDDEN * 2
    x = tokens * max(topk, 1) * row + tokens * topk * 4
    return x + 3 * tokens * row + 2 * row  # x, r in; h, y out; two norm weights


def make_set(tokens: int, topk: int, gen: torch.Generator):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    x = randn(tokens, topk, HIDDEN) if topk else randn(tokens, HIDDEN)
    tw = torch.rand(tokens, topk, generator=gen, device="cuda") if topk else None
    r = randn(tokens, HIDDEN, scale=4.0)
    w_post, w_next = randn(HIDDEN, scale=0.3) + 1, randn(HIDDEN, scale=0.3) + 1
    # Layer 10's MLP add: n = 2L + 1 = 21.
    xs, rs = 1 / math.sqrt(21), math.sqrt(20) / math.sqrt(21)
    return (x, r, w_post, w_next, 1e-6, 1e-6, xs, rs, None, tw, 2.5)


def drift(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(% of elements bitwise equal, largest absolute difference) against the contract."""
    equal = 100 * (got == want).float().mean().item()
    return round(equal, 3), float(f"{(got.float() - want.float()).abs().max().item():.3g}")


def fused_no_pdl(x, r, wp, wn, ep, en, xs, rs, g, tw, scale):
    h, y = torch.empty_like(r), torch.empty_like(r)
    tk.boundary_into(h, y, x, r, wp, wn, ep, en, xs, rs, tw, scale, pdl=False)
    return h, y


COPY_ROW = "copy of the same bytes (torch.cat of x, r)"


def copy_same_bytes(x, r, *rest):
    """x and r read once, as many bytes written: the boundary's traffic without its math."""
    return torch.cat([x, r])


def variants(compiled) -> dict:
    return {
        "triton fused": tk.fused_boundary,
        "triton fused, no PDL": fused_no_pdl,
        "eager unfused": reference.fused_boundary,
        "torch.compile unfused": compiled,
    }


def fused_with(**launch):
    """The fused op with `boundary_into`'s launch overrides (`num_warps`, `split`, ...)."""

    def fn(x, r, wp, wn, ep, en, xs, rs, g, tw, scale):
        h, y = torch.empty_like(r), torch.empty_like(r)
        tk.boundary_into(h, y, x, r, wp, wn, ep, en, xs, rs, tw, scale, **launch)
        return h, y

    return fn


def sweep_boundary(tokens: int, sets, bw: float, topk: int) -> list[dict]:
    """Launch shapes of the Triton kernel: warps x programs (persistent grid above SMs) x
    row tiles (4096 + 1024, or one padded 8192 tile)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(tokens, False)]
    if tokens >= 256:
        shapes = [(p, f) for p in (sms, 2 * sms, 4 * sms, tokens) for f in (True, False)]
    out = []
    grid = [(w, s, pdl) for w in (4, 8, 16, 32) for s in (True, False) for pdl in (False, True)]
    for warps, split, pdl in grid:
        for progs, prefetch in shapes:
            fn = fused_with(num_warps=warps, programs=progs, prefetch=prefetch, split=split,
                            pdl=pdl)  # fmt: skip
            us = time_per_call(fn, sets)
            floor = boundary_bytes(tokens, topk) / bw * 1e6
            out.append(dict(tokens=tokens, topk=topk, warps=warps, programs=progs,
                            prefetch=prefetch, split=split, pdl=pdl, us=round(us, 2),
                            pct_floor=round(100 * floor / us, 1)))  # fmt: skip
    return out


def interleaved(out_dir: str, fns: dict, tokens_list, name: str, rounds: int = 5) -> None:
    """Time `fns` (and the copy of the same bytes) at each token count, the configs taking
    turns over `rounds`, into `<name>.json`: medians, % of the copy floor, every round,
    and each config's drift from the contract (% of h and y bitwise equal)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    fns = {**fns, COPY_ROW: copy_same_bytes}
    rows = []
    for tokens in tokens_list:
        n_sets = max(1, min(16, math.ceil(ROTATION_BYTES / boundary_bytes(tokens, 0))))
        sets = [make_set(tokens, 0, gen) for _ in range(n_sets)]
        want_h, want_y = reference.fused_boundary(*sets[0])
        equal = {}
        for n, fn in fns.items():
            if fn is not copy_same_bytes:
                h, y = fn(*sets[0])
                equal[n] = (drift(h, want_h)[0], drift(y, want_y)[0])
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, fn in fns.items():
                times[n].append(time_per_call(fn, sets))
        floor = boundary_bytes(tokens, 0) / bw * 1e6
        med = {n: round(statistics.median(v), 2) for n, v in times.items()}
        row = dict(tokens=tokens, floor_us=round(floor, 2), median_us=med,
                   pct_floor={n: round(100 * floor / t, 1) for n, t in med.items()},
                   rounds={n: [round(t, 2) for t in v] for n, v in times.items()},
                   h_y_equal_pct=equal)  # fmt: skip
        rows.append(row)
        best = sorted(med.items(), key=lambda kv: kv[1])[:4]
        print(tokens, best, {n: row["pct_floor"][n] for n, _ in best}, flush=True)
        del sets
        torch.cuda.empty_cache()
    meta = dict(bench=f"boundary {name}", device=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__,
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                copy_bandwidth_GBps=round(bw / 1e9, 1),
                timing=f"CUDA-graph replay medians, {rounds} interleaved rounds")  # fmt: skip
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


def ab_row2d(out_dir: str) -> None:
    """`ROW2D` on and off (exact tiles both) and the launch heuristic's choice."""
    fns = {"rows as 2-D tiles": fused_with(split=True, row2d=True),
           "1-D tiles": fused_with(split=True, row2d=False),
           "the launch heuristic": fused_with()}  # fmt: skip
    interleaved(out_dir, fns, (1, 16, 64, 256, 1024, 4096, 16384), "boundary_row2d_ab")


def main() -> None:
    # One static compile per token count and boundary: more than Dynamo's default limit.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--sweep", action="store_true", help="also sweep the kernel's launch shape")
    ap.add_argument("--quick", action="store_true", help="token counts 1, 64, 4096 only")
    ap.add_argument("--ab-row2d", action="store_true", help="only the ROW2D A/B (see above)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.ab_row2d:
        ab_row2d(args.out)
        return
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    tokens_list = (1, 64, 4096) if args.quick else TOKENS
    rows, sweeps = [], []
    for topk in (0, TOP_K):
        for tokens in tokens_list if topk == 0 else [t for t in tokens_list if t in MOE_TOKENS]:
            n_sets = max(1, min(16, math.ceil(ROTATION_BYTES / boundary_bytes(tokens, topk))))
            sets = [make_set(tokens, topk, gen) for _ in range(n_sets)]
            want_h, want_y = reference.fused_boundary(*sets[0])
            floor = boundary_bytes(tokens, topk) / bw * 1e6
            # One static-shape compile per token count, as the baseline measured.
            compiled = torch.compile(reference.fused_boundary, dynamic=False)
            for name, fn in variants(compiled).items():
                h, y = fn(*sets[0])
                us = time_per_call(fn, sets)
                rows.append(
                    dict(
                        boundary="moe (finalize k=8)" if topk else "plain",
                        tokens=tokens,
                        variant=name,
                        us=round(us, 2),
                        floor_us=round(floor, 2),
                        pct_floor=round(100 * floor / us, 1),
                        launches=count_launches(fn, sets[0]),
                        h_equal_pct=drift(h, want_h)[0],
                        h_max_abs=drift(h, want_h)[1],
                        y_equal_pct=drift(y, want_y)[0],
                        y_max_abs=drift(y, want_y)[1],
                    )
                )
                print(rows[-1], flush=True)
            if topk == 0:  # what plain data movement of the same bytes gets at this size
                us = time_per_call(copy_same_bytes, sets)
                rows.append(dict(boundary="plain", tokens=tokens, variant=COPY_ROW,
                                 us=round(us, 2), floor_us=round(floor, 2),
                                 pct_floor=round(100 * floor / us, 1),
                                 launches=count_launches(copy_same_bytes, sets[0]),
                                 h_equal_pct="-", h_max_abs="-", y_equal_pct="-",
                                 y_max_abs="-"))  # fmt: skip
                print(rows[-1], flush=True)
            if args.sweep and topk == 0 and tokens in SWEEP_TOKENS:
                sweeps += sweep_boundary(tokens, sets, bw, topk)
            del sets
            torch.cuda.empty_cache()
    bw_end = copy_bandwidth()
    meta = dict(
        bench="boundary",
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        hidden=HIDDEN,
        dtype="bf16",
        copy_bandwidth_GBps=round(bw / 1e9, 1),
        copy_bandwidth_end_GBps=round(bw_end / 1e9, 1),
        timing="CUDA-graph replay median (triton.testing.do_bench_cudagraph), per boundary",
        launches="device kernels + memsets in one eager call (torch.profiler)",
    )
    with open(os.path.join(args.out, "boundary.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweeps), f, indent=1)
    md = markdown(meta, rows)
    with open(os.path.join(args.out, "boundary.md"), "w") as f:
        f.write(md)
    if sweeps:
        print("\nsweep (best per token count):")
        for tokens in SWEEP_TOKENS:
            best = sorted((s for s in sweeps if s["tokens"] == tokens), key=lambda s: s["us"])
            print(tokens, best[:3])
    print()
    print(md)


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Sublayer boundary, hidden {meta['hidden']}, {meta['dtype']}",
        "",
        f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date']}. "
        f"Copy bandwidth measured: {meta['copy_bandwidth_GBps']} GB/s. {meta['timing']}; "
        f"floor = bytes once / copy bandwidth; launches: {meta['launches']}; "
        "drift: % of outputs bitwise equal to the contract (the eager reference) and the "
        "largest absolute difference.",
        "",
    ]
    for boundary in dict.fromkeys(r["boundary"] for r in rows):
        lines += [f"## {boundary}", ""]
        lines += [
            "| tokens | variant | us | floor us | % of floor | launches | h equal % | h max diff "
            "| y equal % | y max diff |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in rows:
            if r["boundary"] == boundary:
                lines.append(
                    f"| {r['tokens']} | {r['variant']} | {r['us']} | {r['floor_us']} | "
                    f"{r['pct_floor']} | {r['launches']} | {r['h_equal_pct']} | {r['h_max_abs']} | "
                    f"{r['y_equal_pct']} | {r['y_max_abs']} |"
                )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
