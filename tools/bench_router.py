"""Benchmark the MoE router at Beam-1.0's shape: hidden 5120, 256 experts, fp32 weight.

Side by side in one run, per token count (1, 2, 4, 8, 16, 32, 64, 128, and 256-8192 to
place the crossovers): the provider's choice (`beamfx.ops` dispatch: logits, and logits +
routing); the CuTeDSL kernel (up to 64 tokens: logits, and logits + routing in one launch;
`--cutedsl-sweep` times its cluster and warp splits); the Triton
router GEMM kernel forced (up to 1024 tokens); the Triton router + grouped top-k (fused
into the GEMM's last programs, and as a second kernel); cuBLAS on the weight's three exact
bf16 pieces (one bf16 GEMM, fp32 output), with and without routing; cuBLAS fp32
(`F.linear(x.float(), w)`), cuBLAS with a bf16 weight and fp32 output,
`torch.compile` of the reference logits, and `torch.compile` of the reference router +
routing (top-8 of 8 groups, best 4). Each row: CUDA-graph replay median per call over 16
rotating weight copies (84 MB, more than the 50 MB L2 of an H100 or H200, as in a model
whose layers each read their own router; 32 copies for the bf16-weight baseline, whose
copies are half the size); the weight-read floor (5.2 MB of fp32 weight once over the copy
bandwidth measured in this run; the bf16-weight baseline reads half of it, and its % is
still against this floor); kernel launches per call (torch.profiler: device kernels and
memsets of one eager call); the logits' error against fp64 and the tokens whose experts
differ from the reference.

    python tools/bench_router.py [--out DIR] [--sweep] [--cutedsl-sweep] [--broadcast-sweep]
        [--broadcast-confirm] [--crossover]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from beamfx import ops
from beamfx.kernels.measure import copy_bandwidth, count_launches, package_version, time_per_call
from beamfx.kernels.router import cutedsl as rc
from beamfx.kernels.router import reference
from beamfx.kernels.router import triton as rt

HIDDEN, EXPERTS = 5120, 256
TOP_K, N_GROUP, TOPK_GROUP = 8, 8, 4
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 8192)
N_WEIGHTS = 16
SWEEP_TOKENS = (1, 16, 64, 256)
SWEEP_CONFIGS = [  # block_e, k_chunk, block_k
    rt.GemmConfig(16, 256, 64, num_warps=4, num_stages=5, max_block_t=16),
    rt.GemmConfig(16, 512, 64, num_warps=4, num_stages=9, max_block_t=16),
    rt.GemmConfig(16, 128, 64, num_warps=4, num_stages=3, max_block_t=16),
    rt.GemmConfig(32, 256, 64, num_warps=4, num_stages=5, max_block_t=64),
    rt.GemmConfig(16, 256, 64, num_warps=4, num_stages=5, max_block_t=64),
    rt.GemmConfig(64, 256, 64, num_warps=4, num_stages=5, max_block_t=64),
    rt.GemmConfig(64, 512, 64, num_warps=4, num_stages=9, max_block_t=64),
]


def bf16_weight_fp32_out(x, w_bf16):
    try:
        return torch.mm(x, w_bf16.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype: cuBLAS bf16 output, widened
        return F.linear(x, w_bf16).float()


def logits_error(out: torch.Tensor, x, w) -> float:
    return logits_errors(out, x, w)[0]


def logits_errors(out: torch.Tensor, x, w, tol=1e-5) -> tuple[float, int]:
    """(relative error in norm, logits farther than tol + tol x |exact|), against fp64."""
    ref = x.double() @ w.double().T
    err = (out.double() - ref).abs()
    return (err.norm() / ref.norm()).item(), int((err > tol + tol * ref.abs()).sum())


def routing(x, w, bias, fused, config=None):
    return rt.routed_topk(x, w, bias, TOP_K, N_GROUP, TOPK_GROUP, True, fused=fused, config=config)


def cute_routing(x, w, bias, config=None):
    return rc.routed_topk(x, w, bias, TOP_K, N_GROUP, TOPK_GROUP, True, config=config)


CUTEDSL_SWEEP_TOKENS = (1, 4, 8, 16, 32, 64)
CUTEDSL_SWEEP = [  # cluster, warps, chains, PDL; probe: a stage left out, to time it
    # (router runs 11-12 also swept Config(4, 8, 4, True) and probes 1 and 3, run 14 probe 4,
    # run 15 probe 5, run 17 probes 6 and 7, run 20 exchange 1 (pushed, with the
    # exit barrier); run 18's tie in bench/experiments)
    rc.Config(8, 4, 4, True),
    rc.Config(8, 4, 2, True),
    rc.Config(8, 4, 4, True, exchange=0),
    rc.Config(8, 4, 2, True, exchange=0),
    rc.Config(8, 4, 4, True, exchange=3),
    rc.Config(8, 4, 2, True, exchange=3),
    rc.Config(8, 4, 4, True, probe=9),
    rc.Config(8, 4, 2, True, probe=9),
]


def cutedsl_sweep(weights, bias, gen, rounds: int = 1) -> list[dict]:
    """Each config's logits and routed call; with `rounds` > 1 the configs take turns (the
    order rotated each round) and the row gives the median and every round's time. Each
    config's routing is compared bitwise with the first config's (the probes that time a
    step keep the bits; other chains sum in another order)."""
    rows = []
    for tokens in CUTEDSL_SWEEP_TOKENS:
        xs = [torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
              for _ in range(N_WEIGHTS)]  # fmt: skip
        sets = list(zip(xs, weights))
        calls, found = [], []
        for cfg in CUTEDSL_SWEEP:
            gemm = lambda x, w, c=cfg: rc.router_gemm(x, w, config=c)
            routed = lambda x, w, c=cfg: cute_routing(x, w, bias, c)
            rel, off = logits_errors(gemm(*sets[0]), *sets[0])  # a probe's: meaningless
            calls.append((gemm, routed))
            found.append(dict(rel=rel, off=off, routing=[t.clone() for t in routed(*sets[0])]))
        times = [dict(logits=[], routed=[]) for _ in CUTEDSL_SWEEP]
        for r in range(rounds):
            for i in [(r + j) % len(CUTEDSL_SWEEP) for j in range(len(CUTEDSL_SWEEP))]:
                times[i]["logits"].append(time_per_call(calls[i][0], sets))
                times[i]["routed"].append(time_per_call(calls[i][1], sets))
        for cfg, f, t in zip(CUTEDSL_SWEEP, found, times):
            same = all(torch.equal(a, b) for a, b in zip(f["routing"], found[0]["routing"]))
            row = dict(tokens=tokens, config=repr(cfg), logits_rel_err=float(f"{f['rel']:.2e}"),
                       elements_off_1e_5=f["off"], routing_bits_as_first_config=same,
                       logits_us=round(statistics.median(t["logits"]), 2),
                       routed_us=round(statistics.median(t["routed"]), 2))  # fmt: skip
            if rounds > 1:
                row.update(logits_rounds=[round(v, 2) for v in t["logits"]],
                           routed_rounds=[round(v, 2) for v in t["routed"]])  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    return rows


@triton.jit
def _empty_kernel(ptr):
    pass


@triton.jit
def _load_only_kernel(w_ptr, out_ptr, hidden, BLOCK_E: tl.constexpr, K_CHUNK: tl.constexpr):
    """Read one [BLOCK_E, K_CHUNK] fp32 weight tile in one go and write its sum: the
    DRAM-read-plus-launch floor of a grid shaped like the GEMM's."""
    pid_e, pid_s = tl.program_id(0), tl.program_id(1)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_k = pid_s * K_CHUNK + tl.arange(0, K_CHUNK)
    w = tl.load(w_ptr + offs_e[:, None] * hidden + offs_k[None, :])
    tl.store(out_ptr + pid_e * tl.num_programs(1) + pid_s, tl.sum(tl.sum(w, 1), 0))


# One-shot tilings (the whole K chunk loaded at once, no K loop) beside the default.
PROBE_CONFIGS = [
    rt.GemmConfig(16, 256, 64, num_warps=4, num_stages=5, max_block_t=16),
    rt.GemmConfig(16, 256, 256, num_warps=4, num_stages=1, max_block_t=16),
    rt.GemmConfig(32, 256, 256, num_warps=8, num_stages=1, max_block_t=16),
    rt.GemmConfig(16, 512, 512, num_warps=8, num_stages=1, max_block_t=16),
    rt.GemmConfig(32, 512, 256, num_warps=8, num_stages=2, max_block_t=16),
    rt.GemmConfig(64, 1024, 128, num_warps=4, num_stages=8, max_block_t=16),
]


def probe(weights) -> list[dict]:
    """Place the time of a one-launch router call: an empty kernel (the launch floor of
    this timing), a copy of one 5.2 MB weight (one DRAM-bound launch of the same bytes),
    a Triton kernel that only reads the weight (grids of 320, 160 and 80 programs), and
    the split-K kernel with rotating weights (DRAM) and with one weight (L2 hot), under
    its default tiling and one-shot tilings (1, 16 and 64 tokens)."""
    x = torch.randn(1, HIDDEN, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(weights[0])
    sums = torch.empty(4096, device="cuda")
    rot = [(x, w) for w in weights]
    hot = [(x, weights[0])] * len(weights)
    k = rt._gemm_config(1)

    def load_only(block_e, k_chunk, warps):
        grid = (EXPERTS // block_e, HIDDEN // k_chunk)
        return lambda x, w: _load_only_kernel[grid](
            w, sums, HIDDEN, block_e, k_chunk, num_warps=warps
        )

    cases = {
        "empty triton kernel": (lambda x, w: _empty_kernel[(1,)](w), rot),
        "copy_ of one weight (5.2 MB read + write)": (lambda x, w: dst.copy_(w), rot),
        "load-only, 320 programs x 16 KB": (load_only(16, 256, 4), rot),
        "load-only, 160 programs x 32 KB": (load_only(32, 256, 8), rot),
        "load-only, 80 programs x 64 KB": (load_only(32, 512, 8), rot),
        "router gemm 1 token, rotating weights": (lambda x, w: rt.router_gemm(x, w, config=k), rot),
        "router gemm 1 token, one weight (L2)": (lambda x, w: rt.router_gemm(x, w, config=k), hot),
        "cuBLAS fp32 1 token, one weight (L2)": (lambda x, w: F.linear(x.float(), w), hot),
    }
    out = []
    for name, (fn, sets) in cases.items():
        us = time_per_call(fn, sets)
        out.append(dict(probe=name, us=round(us, 2)))
        print(out[-1], flush=True)
    for tokens in (1, 16, 64):
        xt = torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16)
        for config in PROBE_CONFIGS:
            cfg = (
                config if tokens <= 16 else rt.GemmConfig(**{**config.__dict__, "max_block_t": 64})
            )
            fn = lambda x, w, c=cfg: rt.router_gemm(x, w, config=c)
            try:
                err = logits_error(fn(xt, weights[0]), xt, weights[0])
                us = time_per_call(fn, [(xt, w) for w in weights])
            except Exception as exc:  # a tiling over the chip's limits: record, go on
                print(f"  {cfg}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            out.append(dict(probe="router gemm", tokens=tokens, config=repr(cfg), us=round(us, 2),
                            rel_err=float(f"{err:.2e}")))  # fmt: skip
            print(out[-1], flush=True)
    return out


GEMV_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def gemv_sweep_configs() -> list:
    """Few-token kernel tilings: a K loop (block_k per step) or the whole row at once
    (one_shot, optionally read before the programmatic-dependent-launch wait)."""
    configs = []
    for block_e in (1, 2):
        for block_t in (1, 2, 4, 8):
            for block_k in (512, 1024):
                for warps in (4, 8):
                    for pdl in (False, True):
                        configs.append(rt.GemvConfig(block_e, block_t, block_k, warps, False, pdl))
            for warps in (8, 16):
                for pdl in (False, True):
                    if block_t <= 4 or warps == 16:
                        configs.append(rt.GemvConfig(block_e, block_t, 4096, warps, True, pdl))
    return configs


def routing_alone(sets, bias, knob: str, field: str, settings: list) -> list[dict]:
    """The routing kernel alone, on logits already computed, once per (label, value) of
    the module flag `rt.<knob>`, each row labelled under `field`; the flag is restored."""
    logits = [rt.router_gemm(x, w) for x, w in sets]
    tokens = logits[0].shape[0]
    wts = torch.empty(tokens, TOP_K, device="cuda")
    ids = torch.empty(tokens, TOP_K, dtype=torch.int32, device="cuda")
    fn = lambda lg: rt._launch_route(lg, bias, wts, ids, TOP_K, N_GROUP, TOPK_GROUP, True)
    before, rows = getattr(rt, knob), []
    try:
        for label, value in settings:
            setattr(rt, knob, value)
            us = time_per_call(fn, [(lg,) for lg in logits])
            rows.append({"tokens": tokens, "kernel": "routing kernel alone", field: label,
                         "us": round(us, 2)})  # fmt: skip
            print(rows[-1], flush=True)
    finally:
        setattr(rt, knob, before)
    return rows


def gemv_sweep(weights, bias, tokens_list=GEMV_TOKENS) -> list[dict]:
    """Every few-token tiling at 1-64 tokens beside the split-K default and cuBLAS fp32, then
    routing (fused, and as a second kernel with and without programmatic dependent launch)
    behind the two best tilings."""
    out = []
    for tokens in tokens_list:
        xs = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16) for _ in weights]
        sets = [(x, w) for x, w in zip(xs, weights)]
        x0, w0 = sets[0]
        split_k = next(c for bound, c in rt.GEMM_CONFIGS if tokens <= bound)
        cases = [("split-K default", split_k), ("cuBLAS fp32", None)]
        pow2 = triton.next_power_of_2(tokens)
        cases += [(repr(c), c) for c in gemv_sweep_configs()
                  if c.block_t <= pow2 and tokens <= 16 * c.block_t]  # fmt: skip
        timed = []
        for name, cfg in cases:
            if cfg is None:
                fn = lambda x, w: F.linear(x.float(), w)
            else:
                fn = lambda x, w, c=cfg: rt.router_gemm(x, w, config=c)
            try:
                err = logits_error(fn(x0, w0), x0, w0)
                us = time_per_call(fn, sets)
            except Exception as exc:  # a tiling over the chip's limits: record, go on
                print(f"  {tokens} {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            row = dict(tokens=tokens, kernel=name, us=round(us, 2), rel_err=float(f"{err:.2e}"))
            out.append(row)
            if isinstance(cfg, rt.GemvConfig):
                timed.append((us, cfg))
            print(row, flush=True)
        for _, cfg in sorted(timed, key=lambda t: t[0])[:2]:
            for fused, route_pdl in ((True, False), (False, False), (False, True)):
                rt.ROUTE_PDL = route_pdl
                fn = lambda x, w, c=cfg, f=fused: routing(x, w, bias, f, c)
                wts, ids = fn(x0, w0)
                _, ref_ids = reference.routed_topk(x0, w0, bias, TOP_K, N_GROUP, TOPK_GROUP, True)
                differ = int((ids.sort(1).values != ref_ids.sort(1).values).any(1).sum())
                us = time_per_call(fn, sets)
                how = "fused" if fused else "second kernel" + (", PDL" if route_pdl else "")
                row = dict(tokens=tokens, kernel=repr(cfg), routing=how, us=round(us, 2),
                           ids_differ=differ)  # fmt: skip
                out.append(row)
                print(row, flush=True)
            rt.ROUTE_PDL = True
        out += routing_alone(sets, bias, "ROUTE_PDL", "pdl", [(False, False), (True, True)])
    return out


BROADCAST_TOKENS = (1, 2, 4, 8, 16, 32)


def broadcast_sweep(weights, bias, tokens_list=BROADCAST_TOKENS) -> list[dict]:
    """The whole-row kernel with each row loaded once and the product broadcast
    (`GemvConfig.broadcast`) over experts a program x warps, the token tile covering every
    token (16 at most), beside the provider's logits and the pair-per-row whole-row tiling
    of the same count; then the fastest broadcast tiling with the routing kernel behind it,
    beside the provider's router + routing. The provider's logits timed first and last (drift)."""
    out = []
    for tokens in tokens_list:
        xs = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16) for _ in weights]
        sets = [(x, w) for x, w in zip(xs, weights)]
        x0, w0 = sets[0]
        block_t = min(16, triton.next_power_of_2(tokens))
        pair = next(c for bound, c in rt.GEMV_CONFIGS if min(tokens, 16) <= bound)
        cases = [
            ("provider logits", lambda x, w: ops.router_gemm(x, w)),
            (f"pair rows {pair!r}", lambda x, w, c=pair: rt.router_gemm(x, w, config=c)),
        ]
        configs = [rt.GemvConfig(block_e, block_t, 4096, warps, one_shot=True, pdl=True,
                                 broadcast=True)
                   for block_e in (1, 2, 4) for warps in (4, 8, 16)]  # fmt: skip
        cases += [(repr(c), lambda x, w, c=c: rt.router_gemm(x, w, config=c)) for c in configs]
        cases.append(("provider logits, again", cases[0][1]))
        timed = []
        for name, fn in cases:
            try:
                err, off = logits_errors(fn(x0, w0), x0, w0)
                us = time_per_call(fn, sets)
            except Exception as exc:  # over the chip's limits: record, go on
                print(f"  {tokens} {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            row = dict(tokens=tokens, kernel=name, us=round(us, 2), rel_err=float(f"{err:.2e}"),
                       off_1e_5=off)  # fmt: skip
            out.append(row)
            print(row, flush=True)
            if "broadcast=True" in name and off == 0:
                timed.append((us, name, fn))
        _, ref_ids = reference.routed_topk(x0, w0, bias, TOP_K, N_GROUP, TOPK_GROUP, True)
        routed = [
            (
                "provider router + routing",
                lambda x, w: ops.routed_topk(x, w, bias, TOP_K, N_GROUP, TOPK_GROUP, True),
            )
        ]
        if timed:
            best = min(timed, key=lambda t: t[0])[1]
            cfg = next(c for c in configs if repr(c) == best)
            routed.append((f"{best} + routing kernel",
                           lambda x, w, c=cfg: routing(x, w, bias, False, c)))  # fmt: skip
        for name, fn in routed:
            _, ids = fn(x0, w0)
            differ = int((ids.sort(1).values != ref_ids.sort(1).values).any(1).sum())
            row = dict(tokens=tokens, kernel=name, routed=True,
                       us=round(time_per_call(fn, sets), 2), ids_differ=differ)  # fmt: skip
            out.append(row)
            print(row, flush=True)
    return out


# The whole-row tilings with a (token, expert) pair a row: the defaults before router run
# 13; and the two fastest broadcast tilings of that run's sweep, per token count.
PAIR_ROWS = {
    1: rt.GemvConfig(2, 1, 4096, 8, one_shot=True, pdl=True),
    2: rt.GemvConfig(1, 2, 4096, 16, one_shot=True, pdl=True),
    4: rt.GemvConfig(1, 4, 4096, 8, one_shot=True, pdl=True),
    8: rt.GemvConfig(1, 8, 512, 8, pdl=True),
}
_B = dict(block_k=4096, one_shot=True, pdl=True, broadcast=True)
BROADCAST_FINALISTS = {
    1: [rt.GemvConfig(4, 1, num_warps=4, **_B), rt.GemvConfig(2, 1, num_warps=8, **_B)],
    2: [rt.GemvConfig(4, 2, num_warps=4, **_B), rt.GemvConfig(4, 2, num_warps=8, **_B)],
    4: [rt.GemvConfig(2, 4, num_warps=4, **_B), rt.GemvConfig(4, 4, num_warps=4, **_B)],
    8: [rt.GemvConfig(2, 8, num_warps=4, **_B), rt.GemvConfig(2, 8, num_warps=8, **_B)],
}


def broadcast_confirm(weights, gen, rounds: int = 5) -> list[dict]:
    """The sweep's finalists against the pair-row tilings and the provider, interleaved over
    `rounds` rounds (each row: the median round and all of them)."""
    out = []
    for tokens, finalists in BROADCAST_FINALISTS.items():
        xs = [torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16() for _ in weights]
        sets = list(zip(xs, weights))
        fns = {"provider": lambda x, w: ops.router_gemm(x, w)}
        for name, c in [("pair rows", PAIR_ROWS[tokens])] + [(repr(c), c) for c in finalists]:
            fns[name] = lambda x, w, c=c: rt.router_gemm(x, w, config=c)
        times = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():
                times[k].append(round(time_per_call(fn, sets), 3))
        for k, v in times.items():
            out.append(dict(tokens=tokens, kernel=k, us=sorted(v)[len(v) // 2], rounds=v))
            print(out[-1], flush=True)
    return out


CROSSOVER_TOKENS = (1, 2, 4, 6, 8, 12, 16)


def logits_crossover(weights, gen, rounds: int = 5) -> list[dict]:
    """Where the provider should hand the logits from Triton's few-token kernel to CuTeDSL's:
    both forced, and the provider, interleaved over `rounds` rounds (the order rotated each
    round; each row: the median round and all of them)."""
    out = []
    for tokens in CROSSOVER_TOKENS:
        xs = [torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16() for _ in weights]
        sets = list(zip(xs, weights))
        kernel = rt._gemm_config(tokens)
        fns = {
            "provider": lambda x, w: ops.router_gemm(x, w),
            "triton": lambda x, w, k=kernel: rt.router_gemm(x, w, config=k),
            "cutedsl": lambda x, w: rc.router_gemm(x, w),
        }
        times = {k: [] for k in fns}
        names = list(fns)
        for r in range(rounds):
            for k in names[r % len(names) :] + names[: r % len(names)]:
                times[k].append(round(time_per_call(fns[k], sets), 3))
        for k, v in times.items():
            out.append(dict(tokens=tokens, kernel=k, us=statistics.median(v), rounds=v))
            print(out[-1], flush=True)
    return out


SPLIT_TOKENS = (1, 2, 4, 8, 16, 32, 64)


def split_sweep_configs() -> list:
    """Split-K without a fixup: expert tile x K chunk x warps, the weight tile read before
    the programmatic-dependent-launch wait (and once without it)."""
    configs = [
        rt.SplitConfig(16, 256, 4),
        rt.SplitConfig(16, 256, 4, pdl=False),
        rt.SplitConfig(32, 256, 4),
        rt.SplitConfig(32, 256, 8),
        rt.SplitConfig(64, 256, 4),
        rt.SplitConfig(16, 128, 4),
    ]
    return configs + [rt.SplitConfig(16, 256, 4, max_block_t=16)]


def split_sweep(weights, bias, tokens_list=SPLIT_TOKENS) -> list[dict]:
    """Per token count: the default kernel and every split tiling, for the logits alone
    (split + sum kernel) and for routing (the routing kernel adds the splits), each routing
    by argmax rounds and by sorted keys; then the routing kernel alone both ways."""
    out = []
    for tokens in tokens_list:
        xs = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16) for _ in weights]
        sets = [(x, w) for x, w in zip(xs, weights)]
        x0, w0 = sets[0]
        _, ref_ids = reference.routed_topk(x0, w0, bias, TOP_K, N_GROUP, TOPK_GROUP, True)
        default = rt._gemm_config(tokens)
        cases = [("default " + repr(default), default)]
        cases += [(repr(c), c) for c in split_sweep_configs()
                  if tokens > 16 or c.max_block_t == 64]  # fmt: skip
        for name, cfg in cases:
            fn = lambda x, w, c=cfg: rt.router_gemm(x, w, config=c)
            try:
                err = logits_error(fn(x0, w0), x0, w0)
                us = time_per_call(fn, sets)
            except Exception as exc:  # a tiling over the chip's limits: record, go on
                print(f"  {tokens} {name}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            row = dict(tokens=tokens, kernel=name, what="logits", us=round(us, 2),
                       rel_err=float(f"{err:.2e}"))  # fmt: skip
            out.append(row)
            print(row, flush=True)
            for sorted_ in (False, True):
                rt.ROUTE_SORTED = sorted_
                fn = lambda x, w, c=cfg: routing(x, w, bias, False, c)
                _, ids = fn(x0, w0)
                differ = int((ids.sort(1).values != ref_ids.sort(1).values).any(1).sum())
                us = time_per_call(fn, sets)
                row = dict(tokens=tokens, kernel=name, what="routed",
                           routing="sorted keys" if sorted_ else "argmax rounds",
                           us=round(us, 2), ids_differ=differ)  # fmt: skip
                out.append(row)
                print(row, flush=True)
        methods = [("argmax rounds", False), ("sorted keys", True)]
        out += routing_alone(sets, bias, "ROUTE_SORTED", "routing", methods)
    return out


def adopt_sweep(rows: list[dict]) -> dict:
    """Take a split sweep's winners as the defaults of this process: the routing method
    faster alone at most token counts, and per token count the fastest kernel for routing
    (a split tiling, or the default kernel). Returns what it set."""
    alone = {}
    for r in rows:
        if r["kernel"] == "routing kernel alone":
            alone.setdefault(r["tokens"], {})[r["routing"]] = r["us"]
    wins = sum(v["sorted keys"] < v["argmax rounds"] for v in alone.values())
    rt.ROUTE_SORTED = wins * 2 > len(alone)
    method = "sorted keys" if rt.ROUTE_SORTED else "argmax rounds"
    configs = {repr(c): c for c in split_sweep_configs()}
    best = {}
    for r in rows:
        if r.get("what") != "routed" or r["routing"] != method or r["ids_differ"]:
            continue
        if r["tokens"] not in best or r["us"] < best[r["tokens"]][0]:
            best[r["tokens"]] = (r["us"], configs.get(r["kernel"]))
    split_at = sorted(t for t, (_, c) in best.items() if c is not None)
    rt.SPLIT_CONFIGS = [(t, best[t][1]) for t in split_at]
    rt.SPLIT_MIN_TOKENS = split_at[0] if split_at else 1
    chosen = dict(route_sorted=rt.ROUTE_SORTED, split_min_tokens=rt.SPLIT_MIN_TOKENS,
                  split_configs=[(t, repr(c)) for t, c in rt.SPLIT_CONFIGS])  # fmt: skip
    print("adopted from the sweep:", chosen, flush=True)
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--sweep", action="store_true", help="also sweep the GEMM tiling")
    ap.add_argument("--probe", action="store_true", help="only place a 1-token call's time")
    ap.add_argument("--gemv-sweep", action="store_true", help="only sweep the few-token kernel")
    ap.add_argument("--split-sweep", action="store_true", help="only sweep split-K and routing")
    ap.add_argument("--then-table", action="store_true",
                    help="after --split-sweep, run the table with the sweep's winners")  # fmt: skip
    ap.add_argument("--cutedsl-sweep", action="store_true",
                    help="only time the CuTeDSL kernel's configs")  # fmt: skip
    ap.add_argument("--crossover", action="store_true",
                    help="only time the few-token logits of Triton and CuTeDSL")  # fmt: skip
    ap.add_argument("--broadcast-sweep", action="store_true",
                    help="only time the whole-row kernel's broadcast tilings")  # fmt: skip
    ap.add_argument("--broadcast-confirm", action="store_true",
                    help="only time the broadcast sweep's finalists, interleaved")  # fmt: skip
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--rounds", type=int, default=1,
                    help="--cutedsl-sweep: rounds in which the configs take turns")  # fmt: skip
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    floor_us = EXPERTS * HIDDEN * 4 / bw * 1e6
    weights = [
        torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5
        for _ in range(N_WEIGHTS)
    ]

    def stamp(**more) -> dict:
        return dict(
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            triton=triton.__version__,
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            **more,
        )

    def sweep_stamp(**more) -> dict:
        return stamp(
            timing=f"CUDA-graph replay median per call over {N_WEIGHTS} rotating weights",
            copy_bandwidth_GBps=round(bw / 1e9, 1),
            floor_us=round(floor_us, 3),
            **more,
        )

    # The routing bias, drawn right after the weights (the sweeps and the table use it).
    bias = torch.randn(EXPERTS, generator=gen, device="cuda") * 0.05
    if args.gemv_sweep:
        meta = sweep_stamp()
        with open(os.path.join(args.out, "router_gemv_sweep.json"), "w") as f:
            tokens = [t for t in args.tokens if t in GEMV_TOKENS]
            json.dump(dict(meta=meta, rows=gemv_sweep(weights, bias, tokens)), f, indent=1)
        return
    if args.broadcast_confirm:
        meta = stamp(timing=f"CUDA-graph replay median per call over {N_WEIGHTS} rotating "
                     "weights; five rounds, interleaved")  # fmt: skip
        with open(os.path.join(args.out, "router_broadcast_confirm.json"), "w") as f:
            json.dump(dict(meta=meta, rows=broadcast_confirm(weights, gen)), f, indent=1)
        return
    if args.crossover:
        span = f"{rc.LOGITS_MIN_TOKENS}-{rc.MAX_TOKENS}"
        meta = sweep_stamp(cutlass_dsl=package_version("nvidia-cutlass-dsl"), cutedsl_logits=span)
        with open(os.path.join(args.out, "router_logits_crossover.json"), "w") as f:
            json.dump(dict(meta=meta, rows=logits_crossover(weights, gen)), f, indent=1)
        return
    if args.broadcast_sweep:
        meta = sweep_stamp(cutlass_dsl=package_version("nvidia-cutlass-dsl"))
        tokens = [t for t in args.tokens if t in BROADCAST_TOKENS]
        with open(os.path.join(args.out, "router_broadcast_sweep.json"), "w") as f:
            json.dump(dict(meta=meta, rows=broadcast_sweep(weights, bias, tokens)), f, indent=1)
        return
    if args.split_sweep:
        meta = sweep_stamp(topk=hasattr(tl, "topk"))
        with open(os.path.join(args.out, "router_split_sweep.json"), "w") as f:
            tokens = [t for t in args.tokens if t in SPLIT_TOKENS]
            swept = split_sweep(weights, bias, tokens)
            json.dump(dict(meta=meta, rows=swept), f, indent=1)
        if not args.then_table:
            return
        adopt_sweep(swept)
    if args.cutedsl_sweep:
        meta = sweep_stamp(cutlass_dsl=package_version("nvidia-cutlass-dsl"), rounds=args.rounds)
        rows = cutedsl_sweep(weights, bias, gen, args.rounds)
        with open(os.path.join(args.out, "router_cutedsl_sweep.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        return
    if args.probe:
        meta = stamp(
            timing=f"CUDA-graph replay median per call over {N_WEIGHTS} calls",
            kernel="split-K router kernel, its 1-token tiling forced",
        )
        with open(os.path.join(args.out, "router_probe.json"), "w") as f:
            json.dump(dict(meta=meta, rows=probe(weights)), f, indent=1)
        return
    # Twice as many bf16 copies as fp32 ones, so that they too exceed the L2.
    weights_bf16 = [w.to(torch.bfloat16) for w in weights + weights]
    # Dynamic token count, as vLLM compiles: one graph for all token counts.
    compiled_logits = torch.compile(reference.router_logits, dynamic=True)
    compiled_routed = torch.compile(reference.routed_topk, dynamic=True)
    rows, sweeps = [], []
    for tokens in args.tokens:
        xs = [
            torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
            for _ in range(N_WEIGHTS)
        ]
        sets = [(x, w) for x, w in zip(xs, weights)]
        sets_bf16 = [(xs[i % len(xs)], w) for i, w in enumerate(weights_bf16)]
        x0, w0 = sets[0]
        _, ref_ids = reference.routed_topk(x0, w0, bias, TOP_K, N_GROUP, TOPK_GROUP, True)
        # The Triton kernels forced, up to TRITON_MAX_TOKENS; the cuBLAS pieces GEMM forced;
        # and what the provider chooses at this count.
        kernel = rt._gemm_config(tokens)
        pieces = rt.PIECES_CONFIG
        variants = {
            "provider logits": (lambda x, w: ops.router_gemm(x, w), sets),
            "provider router + routing": (
                lambda x, w: ops.routed_topk(x, w, bias, TOP_K, N_GROUP, TOPK_GROUP, True),
                sets,
            ),
        }
        if tokens <= rc.MAX_TOKENS and rc.why_not(x0, w0) is None:
            variants |= {
                "cutedsl router gemm": (lambda x, w: rc.router_gemm(x, w), sets),
                "cutedsl router + routing (1 kernel)": (
                    lambda x, w: cute_routing(x, w, bias),
                    sets,
                ),
            }
        if tokens <= rt.TRITON_MAX_TOKENS:
            variants |= {
                "triton router gemm": (lambda x, w, k=kernel: rt.router_gemm(x, w, config=k), sets),
                "triton router + routing (fused)": (
                    lambda x, w, k=kernel: routing(x, w, bias, True, k),
                    sets,
                ),
                "triton router + routing (2 kernels)": (
                    lambda x, w, k=kernel: routing(x, w, bias, False, k),
                    sets,
                ),
            }
        if rt._BMM_OUT_DTYPE:
            variants |= {
                "cuBLAS on bf16 pieces": (
                    lambda x, w, p=pieces: rt.router_gemm(x, w, config=p),
                    sets,
                ),
                "cuBLAS on bf16 pieces + routing": (
                    lambda x, w, p=pieces: routing(x, w, bias, False, p),
                    sets,
                ),
            }
            for chunks in (1, 2, 4):  # shorter tensor-core sums: accuracy against time
                if chunks != pieces.k_chunks:
                    cfg = rt.PiecesConfig(k_chunks=chunks)
                    variants[f"cuBLAS on bf16 pieces, K in {chunks}"] = (
                        lambda x, w, c=cfg: rt.router_gemm(x, w, config=c),
                        sets,
                    )
        variants |= {
            "cuBLAS fp32": (lambda x, w: F.linear(x.float(), w), sets),
            "cuBLAS bf16 weight, fp32 out": (bf16_weight_fp32_out, sets_bf16),
            "torch.compile logits": (compiled_logits, sets),
            "torch.compile router + routing": (
                lambda x, w: compiled_routed(x, w, bias, TOP_K, N_GROUP, TOPK_GROUP, True),
                sets,
            ),
        }
        for name, (fn, fn_sets) in variants.items():
            out = fn(*fn_sets[0])
            row = dict(tokens=tokens, variant=name)
            if isinstance(out, tuple):
                row["ids_differ"] = int(
                    (out[1].sort(1).values != ref_ids.sort(1).values).any(1).sum()
                )
            else:
                rel, off = logits_errors(out, *fn_sets[0])
                row["logits_rel_err"] = float(f"{rel:.2e}")
                row["elements_off_1e-5"] = off
            us = time_per_call(fn, fn_sets)
            row.update(us=round(us, 2), pct_floor=round(100 * floor_us / us, 1))
            row["launches"] = count_launches(fn, fn_sets[0])
            rows.append(row)
            print(row, flush=True)
        if args.sweep and tokens in SWEEP_TOKENS:
            for config in SWEEP_CONFIGS:
                fn = lambda x, w, config=config: rt.router_gemm(x, w, config=config)
                err = logits_error(fn(x0, w0), x0, w0)
                us = time_per_call(fn, sets)
                sweeps.append(dict(tokens=tokens, config=repr(config), us=round(us, 2),
                                   rel_err=float(f"{err:.2e}")))  # fmt: skip
            for rows_, warps in ((1, 1), (2, 1), (1, 2)):
                rt.ROUTE_ROWS, rt.ROUTE_WARPS = rows_, warps
                for fused in (True, False) if tokens <= 64 else ():
                    fn = lambda x, w, fused=fused: routing(x, w, bias, fused)
                    us = time_per_call(fn, sets)
                    sweeps.append(dict(tokens=tokens, route_rows=rows_, route_warps=warps,
                                       fused=fused, us=round(us, 2)))  # fmt: skip
            rt.ROUTE_ROWS, rt.ROUTE_WARPS = 1, 1
    bw_end = copy_bandwidth()
    meta = dict(
        bench="router",
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        cutlass_dsl=package_version("nvidia-cutlass-dsl"),
        cutedsl_logits=f"{rc.LOGITS_MIN_TOKENS}-{rc.MAX_TOKENS}",
        cutedsl_routed=f"{rc.ROUTED_MIN_TOKENS}-{rc.ROUTED_MAX_TOKENS}",
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        shape=f"hidden {HIDDEN} x {EXPERTS} experts, fp32 weight, bf16 activations",
        routing=f"top-{TOP_K} of {N_GROUP} groups (best {TOPK_GROUP}), renormalized",
        copy_bandwidth_GBps=round(bw / 1e9, 1),
        copy_bandwidth_end_GBps=round(bw_end / 1e9, 1),
        floor_us=round(floor_us, 3),
        triton_max_tokens=rt.TRITON_MAX_TOKENS,
        pieces_min_tokens=rt.PIECES_MIN_TOKENS if rt._BMM_OUT_DTYPE else None,
        pieces_config=repr(rt.PIECES_CONFIG),
        bmm_out_dtype=rt._BMM_OUT_DTYPE,
        route_sorted=rt.ROUTE_SORTED,
        split_configs=[(t, repr(c)) for t, c in rt.SPLIT_CONFIGS],
        split_min_tokens=rt.SPLIT_MIN_TOKENS,
        gemv_max_tokens=rt.GEMV_MAX_TOKENS,
        timing=f"CUDA-graph replay median over {N_WEIGHTS} rotating weights, per call",
        launches="device kernels + memsets in one eager call (torch.profiler)",
    )
    with open(os.path.join(args.out, "router.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, sweep=sweeps), f, indent=1)
    md = markdown(meta, rows)
    with open(os.path.join(args.out, "router.md"), "w") as f:
        f.write(md)
    if sweeps:
        print("\nsweep (best per token count):")
        for tokens in SWEEP_TOKENS:
            gemm = sorted((s for s in sweeps if s["tokens"] == tokens and "config" in s),
                          key=lambda s: s["us"])  # fmt: skip
            route = sorted((s for s in sweeps if s["tokens"] == tokens and "fused" in s),
                           key=lambda s: s["us"])  # fmt: skip
            print(tokens, gemm[:2], route[:3])
    print()
    print(md)


def provider_bound(meta: dict) -> str:
    if meta.get("pieces_min_tokens"):
        return (f"{meta['pieces_min_tokens'] - 1} tokens, cuBLAS on the weight's three bf16 "
                f"pieces (fp32 output) from there ({meta['pieces_config']})")  # fmt: skip
    return f"{meta['triton_max_tokens']} tokens, cuBLAS fp32 above"


def markdown(meta: dict, rows: list[dict]) -> str:
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["tokens"], r["variant"]): r for r in rows}
    lines = [
        f"# Router: {meta['shape']}",
        "",
        f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date']}. "
        f"Copy bandwidth measured: {meta['copy_bandwidth_GBps']} GB/s; weight-read floor "
        f"{meta['floor_us']} us. {meta['timing']}. Routing: {meta['routing']}. The provider "
        f"(`beamfx.ops` dispatch): the CuTeDSL kernel (nvidia-cutlass-dsl "
        f"{meta.get('cutlass_dsl')}) for logits at {meta.get('cutedsl_logits', '-')} tokens and "
        f"logits + routing at {meta.get('cutedsl_routed', '-')}, else "
        f"Triton kernels up to {provider_bound(meta)}. Cells: us (% of "
        "floor) [launches]; "
        f"empty where a path does not run at that count.",
        "",
        "| tokens | " + " | ".join(variants) + " |",
        "| ---: |" + " ---: |" * len(variants),
    ]
    for tokens in dict.fromkeys(r["tokens"] for r in rows):
        cells = []
        for v in variants:
            r = by.get((tokens, v))
            cells.append(f"{r['us']} ({r['pct_floor']}%) [{r['launches']}]" if r else "")
        lines.append(f"| {tokens} | " + " | ".join(cells) + " |")
    lines += ["", "Accuracy: logits relative error vs fp64 (norm); tokens whose experts differ "
              "from the reference.", ""]  # fmt: skip
    for r in rows:
        if "logits_rel_err" in r and not r["variant"].startswith(("torch", "cuBLAS fp32")):
            lines.append(f"- {r['tokens']} tokens, {r['variant']}: {r['logits_rel_err']} "
                         f"({r['elements_off_1e-5']} logits off by more than 1e-5 + 1e-5 "
                         "relative)")  # fmt: skip
        if "ids_differ" in r:
            lines.append(f"- {r['tokens']} tokens, {r['variant']}: {r['ids_differ']} differ")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
