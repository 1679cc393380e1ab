"""Sweep FC1's warps and chunks in flight for the CuTeDSL MoE on its few-CTA shape (one
TP8 rank at 1-4 tokens: fewer than `cutedsl.FEW_CTAS` FC1 CTAs), interleaved rounds.

    python tools/sweep_moe_few.py [--tokens 1 2 4] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from dataclasses import replace

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_moe as bm  # noqa: E402

from beamfx.kernels.moe import cutedsl as cd  # noqa: E402

VARIANTS = [dict(), dict(warps1=16), dict(warps1=16, depth1=1), dict(depth1=3), dict(warps1=4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=None, help="JSON list of Config changes")
    args = ap.parse_args()
    variants = json.loads(args.variants) if args.variants else VARIANTS
    gen = torch.Generator(device="cuda").manual_seed(0)
    inter = bm.SHAPES["TP8"]
    q = bm.random_experts(inter, gen)
    rows = []
    for tokens in args.tokens:
        sets = bm.routing_sets(tokens, bm.n_input_sets(tokens), gen)
        base = cd.pick_config(tokens * bm.TOP_K, bm.HIDDEN, inter, bm.TOP_K)
        cfgs = [replace(base, **v) for v in variants]
        fns = [lambda x, i, w, c=c: cd.experts(x, i, *q.tensors(), w, 2.5, config=c) for c in cfgs]
        want = fns[0](*sets[0])
        errs = [bm.rel_err(f(*sets[0]), want) for f in fns]
        times = bm.interleaved_rounds(dict(enumerate(fns)), sets, args.rounds).values()
        for c, v, t, e in zip(cfgs, variants, times, errs):
            row = dict(tokens=tokens, change=v, config=c.__dict__, us=[round(x, 2) for x in t],
                       median_us=round(statistics.median(t), 2), rel_err_vs_default=e)  # fmt: skip
            rows.append(row)
            print(f"T={tokens} {v or 'default'}: {row['median_us']} us {row['us']} err {e:.1e}")
    meta = bm.run_meta(shape="TP8 (inter 192), hidden 5120, 256 experts, top-8")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
