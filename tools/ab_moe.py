"""Time this tree's CuTeDSL NVFP4 MoE kernels beside another commit's, in one process.

The other commit's `kernels/moe/` (a folder given by `--base`, e.g. from `git archive`) is
loaded as a second package, `beamfx.kernels.moe_base`, with its own weight repack, so a
kernel change that also changes the weight layout is timed against what it replaces on
the same machine, in the same minutes. Rounds alternate the two (base first in odd rounds)
and the table gives the median of the rounds. Outputs are compared bitwise: a change meant
to compute the same products in the same order must give the same bits.

    python tools/ab_moe.py --base DIR [--tokens 1 8 64] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import shutil
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench_moe as bm  # noqa: E402

from beamfx.kernels.moe import cutedsl as new  # noqa: E402


def load_base(folder: str):
    """The `cutedsl` module of the MoE kernels in `folder`, as package `beamfx.kernels.moe_base`."""
    import beamfx.kernels as kernels_pkg

    site = pathlib.Path(tempfile.mkdtemp()) / "moe_base"
    shutil.copytree(folder, site)
    for path in site.glob("*.py"):
        text = path.read_text()
        text = text.replace("beamfx.kernels.moe import", "beamfx.kernels.moe_base import")
        text = text.replace("beamfx.kernels.moe.", "beamfx.kernels.moe_base.")
        text = text.replace('"moe.cutedsl_kernels"', '"moe_base.cutedsl_kernels"')
        path.write_text(text)
    kernels_pkg.__path__.append(str(site.parent))
    return importlib.import_module("beamfx.kernels.moe_base.cutedsl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="another commit's kernels/moe folder")
    ap.add_argument("--label", default="base", help="what the base is (a commit)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = load_base(args.base)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = bm.copy_bandwidth()
    rows = []
    for shape, inter in bm.SHAPES.items():
        q = bm.random_experts(inter, gen)
        tensors = q.tensors()
        for tokens in args.tokens:
            sets = bm.routing_sets(tokens, bm.n_input_sets(tokens), gen)
            experts = sum(len(torch.unique(s[1])) for s in sets) / len(sets)
            floor = bm.nvfp4_floor_us(experts, inter, copy_bw)
            fns = {
                "new": lambda x, i, w, m=new, t=tensors: m.mega_moe_nvfp4(x, w, i, *t, 2.5),
                args.label: lambda x, i, w, m=base, t=tensors: m.mega_moe_nvfp4(x, w, i, *t, 2.5),
            }
            outs = {k: [f(*s) for s in sets] for k, f in fns.items()}
            same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
            times = bm.interleaved_rounds(fns, sets, args.rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(shape=shape, tokens=tokens, experts=experts, floor_us=round(floor, 2),
                       bitwise_equal=same, rounds={k: [round(t, 2) for t in v]
                                                   for k, v in times.items()},
                       median_us={k: round(v, 2) for k, v in med.items()})  # fmt: skip
            rows.append(row)
            print(
                f"{shape} {tokens:>4} tokens: new {med['new']:8.2f} us "
                f"({100 * floor / med['new']:.0f}% of floor)  {args.label} "
                f"{med[args.label]:8.2f} us  bitwise equal: {same}",
                flush=True,
            )
    meta = bm.run_meta(
        copy_bandwidth_gbs=round(copy_bw / 1e9, 1),
        base=args.label,
        method="CUDA-graph replay medians per call over a rotation of input sets "
        "(bench_moe.n_input_sets, time_over); "
        f"{args.rounds} rounds alternating which variant goes first",
    )
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
