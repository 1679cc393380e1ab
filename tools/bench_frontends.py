"""Does Beam IR cost anything? The plain model compiled three ways, timed side by side.

Rows: eager; `torch.compile` of the model written in plain torch (the `torch` front end,
Inductor defaults); `beamfx.compile(passes=())` of the Beam IR model (its ops lowered back
to their reference code); `beamfx.compile(passes="all")`. Runs on CPU or CUDA.

    python tools/bench_frontends.py [--layers 4] [--hidden 512] [--out bench/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch

import beamfx
from beamfx.checkpoint import init_random
from beamfx.config import preset
from beamfx.models.beam import BeamForCausalLM


def median_ms(fn, ids, reps: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn(ids)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(ids)
            if ids.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--shapes", default="1x16,4x64", help="batch x tokens, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = preset("tiny", args.layers, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                 moe_intermediate_size=args.hidden // 2)  # fmt: skip
    semantic = init_random(BeamForCausalLM(cfg)).to(device).eval()
    plain = init_random(BeamForCausalLM(cfg, frontend="torch")).to(device).eval()
    rows = []
    for shape in args.shapes.split(","):
        b, s = map(int, shape.split("x"))
        ids = torch.randint(3, cfg.vocab_size, (b, s), device=device)
        variants = {
            "eager (Beam IR ops run their references)": semantic,
            "torch.compile, plain-torch model": torch.compile(plain),
            "beamfx.compile, no fusion passes": beamfx.compile(semantic, ()),
            "beamfx.compile, all passes": beamfx.compile(semantic, "all"),
        }
        for name, fn in variants.items():
            torch.compiler.reset()
            rows.append(
                {"shape": shape, "variant": name, "ms": round(median_ms(fn, ids, args.reps), 3)}
            )
    gpu = torch.cuda.get_device_name() if device == "cuda" else None
    meta = {
        "device": gpu or platform.processor() or "cpu",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "model": f"tiny preset widened: {args.layers} layers, hidden {args.hidden}",
    }
    os.makedirs(args.out, exist_ok=True)
    name = f"frontends_{device}"
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [
        f"# Beam IR's cost: compiled plain model, {device}",
        "",
        f"{meta['date']}, {meta['device']} ({meta['cpus']} cores), torch {meta['torch']}; "
        f"{meta['model']}. Median wall time per forward (ms), {args.reps} runs.",
        "",
        "| batch x tokens | variant | ms |",
        "| --- | --- | ---: |",
    ]
    lines += [f"| {r['shape']} | {r['variant']} | {r['ms']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, f"{name}.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
