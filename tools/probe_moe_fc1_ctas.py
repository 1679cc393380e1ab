"""FC1 of the per-pair CuTeDSL NVFP4 MoE alone, on one TP8 rank's experts, at pair counts
that put 1, 2 or 3 of its CTAs on an SM: does its time follow the most CTAs an SM holds?

Each pair is a CTA per 16-row tile (`inter // 8` tiles: 24 at TP8), so P pairs launch
24 x P CTAs. CUDA-graph replay medians per call, back to back as `breakdown_moe.py` times
one launch alone, over 32 input sets of disjoint experts (cold: DRAM) and over one set
repeated (hot: L2), interleaved rounds.

    python tools/probe_moe_fc1_ctas.py [--pairs 4 5 6 8 11 12 16] [--out FILE]
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
from breakdown_moe import launches  # noqa: E402

from beamfx.kernels.moe import cutedsl as cd  # noqa: E402

CONFIGS = [dict(warps1=8, depth1=2), dict(warps1=4, depth1=2), dict(warps1=4, depth1=4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[4, 5, 6, 8, 11, 12, 16])
    ap.add_argument("--configs", default=None, help="JSON list of FC1 Config fields")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = json.loads(args.configs) if args.configs else CONFIGS
    gen = torch.Generator(device="cuda").manual_seed(0)
    inter, hidden, k = bm.SHAPES["TP8"], bm.HIDDEN, bm.TOP_K
    tensors = bm.random_experts(inter, gen).tensors()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for fields in configs:
        cfg = cd.Config(pdl=cd.PDL, stage=True, **fields)
        for pairs in args.pairs:
            tokens = -(-pairs // k)
            fc1, _ = launches(tensors, cfg, tokens, pairs)
            weights = torch.ones(tokens, k, device="cuda")  # FC1 does not read them
            sets = []
            for _ in range(32):
                x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
                ids = torch.randperm(bm.EXPERTS, generator=gen, device="cuda")[:pairs]
                sets.append((x, ids.to(torch.int32), weights))
            cold = bm.interleaved_rounds({"cold": fc1}, sets, args.rounds)["cold"]
            hot = bm.interleaved_rounds({"hot": fc1}, [sets[0]] * len(sets), args.rounds)["hot"]
            ctas = pairs * (inter // 8)
            row = dict(config=fields, pairs=pairs, ctas=ctas, most_ctas_an_sm=-(-ctas // sms),
                       cold_us=round(statistics.median(cold), 2),
                       hot_us=round(statistics.median(hot), 2))  # fmt: skip
            rows.append(row)
            print(row, flush=True)
    meta = bm.run_meta(sms=sms, method=__doc__.split("\n\n")[1].replace("\n", " "))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
