"""Where a decode-sized NVFP4 MoE call's time goes: its two CuTeDSL launches (per pair),
each alone and together, with the weights cold (DRAM) and hot (L2), with and without
programmatic dependent launch.

The call is FC1 + SwiGLU, then FC2 + combine (`kernels/moe/cutedsl.py`, per pair, the
default config). Each variant is a CUDA-graph replay median per call over a rotation of
input sets, variants interleaved over rounds (`bench_moe.interleaved_rounds`):

- `call`: both launches, as the provider runs them;
- `fc1` / `fc2`: one launch alone, back to back (with PDL each waits on the one before);
- `... hot`: the same input set every call, so the weights are read from L2, not DRAM:
  what is left is launch, latency and the kernel's own work;
- `..., no PDL`: the same launches without programmatic dependent launch.

    python tools/breakdown_moe.py [--tokens 1 2 4 8] [--shapes TP8 TP1] [--out FILE]
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


def launches(tensors, cfg: cd.Config, tokens: int, pairs: int | None = None):
    """(fc1(x, ids, w), fc2(x, ids, w)): the call's two launches as `cd.experts` makes them,
    on buffers made once (FC2 reads the h FC1 left there). `pairs`: FC1's pairs, if not
    all of the tokens' (tokens x top-k)."""
    w13, w13_scale, w13_global, w2, w2_scale, w2_global = tensors
    fc1w, fc2w, g13, g2 = cd.prepare(w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    hidden, inter, k = bm.HIDDEN, w13.shape[1] // 2, bm.TOP_K
    pairs = tokens * k if pairs is None else pairs
    stage1, stage2 = cd.stage_chunks(cfg, hidden, inter)
    run1 = cd.compiled_fc1(k, cfg.warps1, cfg.depth1, cfg.pdl, stage1, cfg.step_loads)
    run2 = cd.compiled_fc2(k, cfg.warps2, True, cfg.depth2, cfg.pdl, stage2, cfg.step_loads)
    h = torch.zeros(tokens * k, inter, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)

    def fc1(x, ids, w):
        run1(x.data_ptr(), ids.data_ptr(), fc1w.codes.data_ptr(), fc1w.scales.data_ptr(),
             g13.data_ptr(), h.data_ptr(), pairs, hidden, inter, cd._stream())  # fmt: skip

    def fc2(x, ids, w):
        run2(h.data_ptr(), ids.data_ptr(), fc2w.codes.data_ptr(), fc2w.scales.data_ptr(),
             g2.data_ptr(), w.data_ptr(), out.data_ptr(), 2.5, tokens, hidden, inter,
             cd._stream())  # fmt: skip

    return fc1, fc2


def both(first, second):
    """The two launches of one call, in order."""

    def call(*args):
        first(*args)
        second(*args)

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--shapes", nargs="+", default=["TP8", "TP1"], choices=list(bm.SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = bm.copy_bandwidth()
    rows = []
    for shape in args.shapes:
        inter = bm.SHAPES[shape]
        q = bm.random_experts(inter, gen)
        tensors = q.tensors()
        for tokens in args.tokens:
            pairs = tokens * bm.TOP_K
            cfg = cd.pick_config(pairs, bm.HIDDEN, inter, bm.TOP_K, experts=bm.EXPERTS)
            if cfg.grouped or cfg.wgmma is not None:
                print(f"{shape} {tokens} tokens: not per pair ({cfg}), skipped", flush=True)
                continue
            sets = bm.routing_sets(tokens, bm.n_input_sets(tokens), gen)
            # the ids and combine weights flat, as `cd.experts` hands them to the kernels
            sets = [(x, i.reshape(-1).contiguous(), w.reshape(-1).float().contiguous())
                    for x, i, w in sets]  # fmt: skip
            experts = sum(len(torch.unique(s[1])) for s in sets) / len(sets)
            floor = bm.nvfp4_floor_us(experts, inter, copy_bw)
            fc1, fc2 = launches(tensors, cfg, tokens)
            fc1_n, fc2_n = launches(tensors, replace(cfg, pdl=False), tokens)
            fns = {"call": both(fc1, fc2), "fc1": fc1, "fc2": fc2,
                   "call, no PDL": both(fc1_n, fc2_n), "fc1, no PDL": fc1_n,
                   "fc2, no PDL": fc2_n}  # fmt: skip
            times = bm.interleaved_rounds(fns, sets, args.rounds)
            hot = bm.interleaved_rounds(
                {f"{n} hot": fns[n] for n in ("call", "fc1", "fc2")}, [sets[0]] * len(sets),
                args.rounds,
            )  # fmt: skip
            times.update(hot)
            med = {n: round(statistics.median(v), 2) for n, v in times.items()}
            row = dict(shape=shape, tokens=tokens, config=repr(cfg), experts=experts,
                       floor_us=round(floor, 2), median_us=med,
                       rounds={n: [round(t, 2) for t in v] for n, v in times.items()})  # fmt: skip
            rows.append(row)
            print(f"{shape} {tokens} tokens (floor {floor:.2f} us): "
                  + ", ".join(f"{n} {t}" for n, t in med.items()), flush=True)  # fmt: skip
    meta = bm.run_meta(
        copy_bandwidth_gbs=round(copy_bw / 1e9, 1),
        method="CUDA-graph replay medians per call over a rotation of input sets "
        f"(bench_moe.n_input_sets; 'hot': one set repeated), {args.rounds} interleaved rounds",
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
