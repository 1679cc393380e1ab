"""Sweep the CuTeDSL wgmma NVFP4 MoE kernels (`cutedsl.Wgmma`: pairs a block, 64-row slices
a CTA, activation stages) against the NVFP4 Triton kernels and, at up to 512 pairs, the
CuTeDSL kernels per pair or in blocks; Beam-1.0-shaped, interleaved rounds, CUDA-graph
replay medians. Each variant is checked against the NVFP4 Triton output first.

    python tools/sweep_moe_wgmma.py [--shapes TP1 TP8] [--tokens 512 4096] [--rounds 3]
        [--configs '[[64, 2, 4]]' (bn, mt, stages[, ctas, wgs, walk, stage_out]:
        `cutedsl.Wgmma`)]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_moe as bm  # noqa: E402

from beamfx.kernels.moe import cutedsl as cd  # noqa: E402
from beamfx.kernels.moe import triton as tk  # noqa: E402

CONFIGS = [(64, 2, 4, 2, 2), (64, 2, 4), (32, 2, 4), (16, 2, 4)]


def wgmma_name(wc: cd.Wgmma) -> str:
    """wgmma_{bn}_{mt}_{stages}, then _c{ctas}, _w{wgs}, _s{walk} and _o (stage_out) where
    they are set."""
    name = f"wgmma_{wc.bn}_{wc.mt}_{wc.stages}"
    name += (f"_c{wc.ctas}" if wc.ctas else "") + (f"_w{wc.wgs}" if wc.wgs > 1 else "")
    return name + (f"_s{wc.walk}" if wc.walk > 1 else "") + ("_o" if wc.stage_out else "")


def variants(q, configs, pairs: int, inter: int) -> dict:
    """name -> fn(x, ids, weights) for one experts stack."""
    scales = (q.w13_scale, q.w13_global, q.w2_scale, q.w2_global)
    fns = {"triton_nvfp4": lambda x, i, w: tk.moe(x, i, q.w13, q.w2, scales, w, 2.5)}
    for fields in configs:
        cfg = cd.Config(wgmma=cd.Wgmma(*fields))
        fns[wgmma_name(cfg.wgmma)] = lambda x, i, w, c=cfg: cd.experts(
            x, i, *q.tensors(), w, 2.5, config=c
        )
    if pairs <= 4 * cd.MAX_PAIRS:  # the mma.sync kernels, the default up to MAX_PAIRS
        small = cd.mma_sync_config(pairs, inter, bm.TOP_K)
        fns["cutedsl_small"] = lambda x, i, w: cd.experts(x, i, *q.tensors(), w, 2.5, config=small)
    return fns


def sweep_shape(shape: str, tokens_list, configs, rounds: int, mm: float, gen) -> list[dict]:
    inter = bm.SHAPES[shape]
    q = bm.random_experts(inter, gen)
    rows = []
    for tokens in tokens_list:
        sets = bm.routing_sets(tokens, bm.n_input_sets(tokens), gen)
        fns = variants(q, configs, tokens * bm.TOP_K, inter)
        want = fns["triton_nvfp4"](*sets[0])
        errs, ok = {}, {}
        for name, fn in fns.items():
            try:
                errs[name] = bm.rel_err(fn(*sets[0]), want)
                ok[name] = fn
            except Exception as exc:  # a config that does not compile or launch
                print(f"{shape} T={tokens} {name}: {type(exc).__name__}: {exc}"[:500])
        flops = bm.moe_flops(tokens, inter)
        for name, t in bm.interleaved_rounds(ok, sets, rounds).items():
            med = statistics.median(t)
            tflops = flops / med / 1e6
            row = dict(shape=shape, tokens=tokens, variant=name, us=[round(v, 1) for v in t],
                       median_us=round(med, 1), tflops=round(tflops, 1),
                       pct_of_matmul=round(100 * tflops * 1e12 / mm, 1),
                       rel_err_vs_triton_nvfp4=errs[name])  # fmt: skip
            rows.append(row)
            print(f"{shape} T={tokens} {name}: {med:.1f} us, {tflops:.1f} TFLOP/s "
                  f"({row['pct_of_matmul']}%), err {errs[name]:.1e}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(bm.SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--configs",
        default=None,
        help="JSON list of Wgmma fields [bn, mt, stages, ctas, wgs, walk, stage_out]",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [tuple(c) for c in json.loads(args.configs)] if args.configs else CONFIGS
    gen = torch.Generator(device="cuda").manual_seed(0)
    mm = bm.matmul_rate()
    print(f"bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)
    rows = []
    for shape in args.shapes:
        rows += sweep_shape(shape, args.tokens, configs, args.rounds, mm, gen)
        torch.cuda.empty_cache()
    shape = "hidden 5120, 256 experts, top-8; TP1 inter 1536, TP8 192"
    meta = bm.run_meta(bf16_matmul_TFLOPs=mm / 1e12, shape=shape)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
