"""Whole decoder layer, Beam-1.0-shaped: eager vs torch.compile vs beamfx, side by side.

Layers: sliding-attention + MoE and full-attention + MoE; experts bf16 or NVFP4; TP=1 and
per-rank TP=8 shapes (one GPU: the per-rank compute of TP=8, without its all-reduce).
Token counts: decode 1, 8, 32, 128 (that many sequences of one new token; the standalone
model has no KV cache, so decode attention sees only the token itself) and prefill 2048
and 8192 (one sequence). Attention is `F.scaled_dot_product_attention` with a boolean mask.

Rows, each timed as a CUDA-graph replay median (wall-clock median on CPU):
- eager: the plain model as written; Beam IR ops run their references, experts on
  `torch._grouped_mm` (bf16) or beamfx's NVFP4 kernels (NVFP4 has no library path);
- torch.compile: the plain model under Inductor's defaults, no beamfx fusion (Beam IR is
  lowered back to torch code; experts as in eager);
- beamfx: `beamfx.compile(passes="all")`, every fused op on its fast provider.
Each with kernel launches per layer (torch.profiler) and the weight-read floor.

    python tools/bench_layer.py [--config beam-1.0-shaped] [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import time

import torch

import beamfx
from beamfx import ops
from beamfx.config import BeamConfig, load_config
from beamfx.kernels.measure import package_version
from beamfx.models.beam import BeamDecoderLayer, Parallel

DECODE = (1, 8, 32, 128)
PREFILL = (2048, 8192)
NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}


class LayerStep(torch.nn.Module):
    """One decoder layer as the model runs it: (residual, normalized input) -> the same."""

    def __init__(self, layer: BeamDecoderLayer, hidden: int):
        super().__init__()
        self.layer = layer
        self.next_norm = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, h, x, positions):
        return self.layer(h, x, positions, self.next_norm)


def build(cfg: BeamConfig, kind: str, world: int, device: str) -> LayerStep:
    index = next(
        i for i, (a, m) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types))
        if a == kind and m == "sparse"
    )  # fmt: skip
    with torch.device(device):
        layer = BeamDecoderLayer(cfg, index, Parallel(0, world), torch.bfloat16)
        layer.par = Parallel()  # per-rank shapes, no collective on one GPU
        step = LayerStep(layer, cfg.hidden_size).to(torch.bfloat16)
    g = torch.Generator(device).manual_seed(0)
    for name, p in step.named_parameters():
        if p.dtype == torch.uint8:
            continue
        scale = 0.1 if "norm" in name else p.shape[-1] ** -0.5
        base = 1.0 if "norm" in name else 0.0
        p.data.copy_(base + scale * torch.randn(p.shape, generator=g, device=device))
    # As the checkpoint loader keeps them (BEAM.md): the router weight and its correction
    # bias stay fp32.
    gate = step.layer.mlp.gate
    gate.weight.data = gate.weight.data.float()
    gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
    experts = step.layer.mlp.experts
    if hasattr(experts, "w13_scale"):  # NVFP4: quantize random dense weights
        q = random_nvfp4_experts(cfg.num_experts, cfg.hidden_size, experts.w2.shape[2] * 2, g)
        for f in dataclasses.fields(q):
            getattr(experts, f.name).data = getattr(q, f.name)
    return step.eval()


def random_nvfp4_experts(e: int, h: int, inter: int, g: torch.Generator, chunk: int = 16):
    """NVFP4 of random dense experts, quantized `chunk` experts at a time (each matrix has
    its own global scale, so the result is the one-shot quantization of the same weights):
    at once, one TP1 layer's dense stack in fp32 (32 GB), its bf16 copy and quantize's
    temporaries ran an 80 GB card out of memory."""
    from beamfx.kernels.moe.nvfp4 import NVFP4Experts, quantize_experts

    parts = []
    for first in range(0, e, chunk):
        n = min(chunk, e - first)
        w13 = torch.randn(n, 2 * inter, h, generator=g, device=g.device) * h**-0.5
        w2 = torch.randn(n, h, inter, generator=g, device=g.device) * inter**-0.5
        parts.append(quantize_experts(w13.to(torch.bfloat16), w2.to(torch.bfloat16)))
    fields = dataclasses.fields(NVFP4Experts)
    return NVFP4Experts(*(torch.cat([getattr(q, f.name) for q in parts]) for f in fields))


def inputs(cfg: BeamConfig, tokens: int, prefill: bool, device: str):
    g = torch.Generator(device).manual_seed(tokens)
    batch, seq = (1, tokens) if prefill else (tokens, 1)
    h = torch.randn(batch * seq, cfg.hidden_size, generator=g, device=device) * 4
    x = torch.randn(batch * seq, cfg.hidden_size, generator=g, device=device)
    positions = torch.arange(seq, device=device).expand(batch, seq) + (0 if prefill else 4096)
    return h.to(torch.bfloat16), x.to(torch.bfloat16), positions.contiguous()


def time_us(fn, args, device: str) -> tuple[float, str]:
    if device == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        with torch.no_grad():
            fn(*args)
            torch.cuda.synchronize()
            try:
                return do_bench_cudagraph(
                    lambda: fn(*args), rep=50, return_mode="median"
                ) * 1e3, "cuda graph"
            except Exception as e:  # a variant that cannot be captured: say so
                return do_bench(lambda: fn(*args), rep=50) * 1e3, f"no graph ({type(e).__name__})"
    with torch.no_grad():
        fn(*args)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn(*args)
            times.append(time.perf_counter() - start)
    return sorted(times)[2] * 1e6, "wall clock"


def launches(fn, args, device: str) -> int | None:
    if device != "cuda":
        return None
    from beamfx.kernels.measure import count_launches

    with torch.no_grad():
        return count_launches(fn, args)


def breakdown(fn, args, top: int = 10) -> list[list]:
    """The kernels that take the most device time in one call: [name, us, count]."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append([e.key[:90], round(us, 1), e.count])
    return sorted(rows, key=lambda r: -r[1])[:top]


def weight_bytes(step: LayerStep, experts_touched: int) -> int:
    """Bytes a layer must read: every weight, except the experts nobody routed to."""
    total, experts = 0, step.layer.mlp.experts
    per_expert = 0
    for name, t in [*step.named_parameters(), *step.named_buffers()]:
        if t.ndim == 3 and name.startswith("layer.mlp.experts"):
            per_expert += t[0].numel() * t.element_size()
        else:
            total += t.numel() * t.element_size()
    del experts
    return total + experts_touched * per_expert


def experts_touched(step: LayerStep, x: torch.Tensor) -> int:
    moe = step.layer.mlp
    with torch.no_grad():
        logits = ops.router_logits(x, moe.gate.weight)
        _, ids = ops.grouped_topk(logits, moe.gate.e_score_correction_bias, moe.top_k,
                                  moe.n_group, moe.topk_group, moe.renormalize)  # fmt: skip
    return int(ids.unique().numel())


BASE_VARIANTS = ("eager", "torch.compile", "beamfx")
# Passes in this order let the boundary take the MoE finalize (the experts then write their
# k rows each); the default order folds it into the MegaMoE kernel instead.
FINALIZE_IN_BOUNDARY = ["attn_gate", "router_gemm", "boundary", "mega_moe"]


def variants(step: LayerStep, nvfp4: bool, finalize_in_boundary: bool = False):
    # The baselines run the MoE experts on the library's grouped GEMM (bf16); NVFP4 has no
    # library path, so its experts run beamfx's W4A16 kernel in every row.
    pin = {} if nvfp4 else {"moe_experts": "grouped_mm"}

    def compiled(passes, pins, **options):
        # The FX graph cache stays off: a hit would skip the passes and their reports. The
        # pass manager is taken at once: `.beamfx` lands on the module all rows share.
        fn = beamfx.compile(step, passes, options={"fx_graph_cache": False, **options})
        return fn, pins, fn.beamfx

    runs = {
        "eager": (step, pin, None),
        "torch.compile": compiled((), pin, emulate_precision_casts=False),
        "beamfx": compiled("all", {}),
    }
    if finalize_in_boundary:
        runs["beamfx, finalize in boundary"] = compiled(FINALIZE_IN_BOUNDARY, {})
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="beam-1.0-shaped")
    ap.add_argument("--quick", action="store_true", help="decode 1, 32 and prefill 2048 only")
    ap.add_argument("--tokens", type=int, nargs="*", help="decode token counts")
    ap.add_argument("--prefill", type=int, nargs="*", help="prefill lengths")
    ap.add_argument("--experts", nargs="*", default=["bf16", "nvfp4"])
    ap.add_argument("--tp", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--breakdown", action="store_true",
                    help="also record the top kernels of each row (torch.profiler)")  # fmt: skip
    ap.add_argument("--finalize-in-boundary", action="store_true",
                    help="also time beamfx with the boundary taking the MoE finalize")  # fmt: skip
    ap.add_argument("--replot", metavar="JSON",
                    help="only rewrite the summary and plot of a results JSON")  # fmt: skip
    args = ap.parse_args()
    # Every compiled row recompiles the same forward (new backend, new shapes): past
    # Dynamo's default limit of 8 it would run that row eagerly without a word.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    if args.replot:
        with open(args.replot) as f:
            data = json.load(f)
        stem = args.replot.removesuffix(".json")
        with open(stem + ".md", "w") as f:
            f.write(markdown(data["meta"], data["rows"]))
        plot(data["rows"], stem)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decode = args.tokens if args.tokens is not None else ((1, 32) if args.quick else DECODE)
    prefill = args.prefill if args.prefill is not None else ((2048,) if args.quick else PREFILL)
    bw = None
    if device == "cuda":
        from beamfx.kernels.measure import copy_bandwidth

        bw = copy_bandwidth()

    rows = []
    for experts in args.experts:
        extra = {"quantization_config": NVFP4_CONFIG} if experts == "nvfp4" else {}
        cfg = load_config(args.config, 4)
        cfg = BeamConfig(**{**cfg.to_dict(), **extra})
        for world in args.tp:
            for kind in ("sliding_attention", "full_attention"):
                step = build(cfg, kind, world, device)
                runs = variants(step, experts == "nvfp4", args.finalize_in_boundary)
                for tokens, is_prefill in [(t, False) for t in decode] + [
                    (t, True) for t in prefill
                ]:
                    args_ = inputs(cfg, tokens, is_prefill, device)
                    touched = experts_touched(step, args_[1])
                    floor = weight_bytes(step, touched) / bw * 1e6 if bw else None
                    row = {"experts": experts, "tp": world, "layer": kind, "tokens": tokens,
                           "phase": "prefill" if is_prefill else "decode",
                           "experts_touched": touched,
                           "floor_us": round(floor, 2) if floor else None}  # fmt: skip
                    for name, (fn, pin, manager) in runs.items():
                        with ops.pinned_providers(**pin) if pin else contextlib.nullcontext():
                            us, how = time_us(fn, args_, device)
                            row[name] = {"us": round(us, 2), "timing": how,
                                         "launches": launches(fn, args_, device)}  # fmt: skip
                            if manager is not None and manager.reports:
                                # The beamfx ops in the graph this call ran (the latest).
                                after = manager.reports[-1].ops_after
                                row[name]["ops"] = {k: v for k, v in after.items()
                                                    if k.startswith("beamfx.")}  # fmt: skip
                            if args.breakdown and device == "cuda":
                                row[name]["top_kernels"] = breakdown(fn, args_)
                    row["beamfx_vs_compile"] = round(
                        row["torch.compile"]["us"] / row["beamfx"]["us"], 3
                    )
                    print(json.dumps(row))
                    rows.append(row)
                del step, runs
                torch.compiler.reset()

    meta = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": args.config,
        "copy_GBps": round(bw / 1e9, 1) if bw else None,
        "attention": "F.scaled_dot_product_attention, boolean mask; decode without a KV cache",
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"layer_{device}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    text = markdown(meta, rows)
    with open(stem + ".md", "w") as f:
        f.write(text)
    plot(rows, stem)
    print(text)


ROWS_RUN = """\
- **eager**: the plain model as written; Beam IR ops run their torch references; experts on
  `torch._grouped_mm` (bf16; rows sorted by expert, gathered, scattered back) or beamfx's
  NVFP4 experts op (NVFP4 has no library path: CuTeDSL on Hopper, else Triton), finalize in
  torch.
- **torch.compile**: the plain model under Inductor's defaults, no beamfx fusion pass
  (Beam IR lowered back to torch code, so Inductor fuses norms, residual adds and routing
  itself); experts as in eager (an opaque op), router GEMM on cuBLAS fp32.
- **beamfx**: `beamfx.compile(passes="all")`: attention gate (Triton), router GEMM with
  routing (one CuTeDSL launch at 4-32 tokens where installed; else Triton: whole rows per
  program at 1-7 tokens, each row loaded once and the product broadcast, split-K to 255;
  from 256 tokens one cuBLAS bf16 GEMM on the fp32 weight's three exact bf16 pieces, K in
  chunks), MegaMoE
  (NVFP4 W4A16 on Hopper: CuTeDSL tensor-core kernels on weights repacked into MMA
  fragments; up to 256 (token, expert) pairs `mma.sync`, per pair with the finalize in FC2,
  or from 64 pairs on wide experts (256 on narrow ones) in blocks of 8 pairs of one expert,
  sorted into blocks by one launch, with a finalize kernel; above, wgmma kernels in blocks
  of 16-64 pairs; else Triton,
  bf16 or NVFP4, FC2 writing k rows and a finalize kernel at sorted-block sizes, the pairs
  sorted by three launches over chunks of 1024 beyond 1024 pairs; bf16 in
  128-row blocks with wide tiles once the experts average 128 rows), two fused boundaries
  per layer (Triton), the rest as compile; the boundary, few-token router and routing
  kernels launch with programmatic dependent launch.
- **beamfx, finalize in boundary** (`--finalize-in-boundary`): the passes in the order
  attn_gate, router_gemm, boundary, mega_moe: the experts write their k rows each and the
  second boundary kernel finalizes them.
- Attention in every row: `F.scaled_dot_product_attention` with a boolean mask (cuDNN or
  memory-efficient kernels as torch picks); decode rows run without a KV cache.
- One GPU: TP8 rows are one rank's shapes (heads, experts' intermediate / 8) without the
  all-reduce."""


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Decoder layer ({meta['config']}): eager, torch.compile, beamfx",
        "",
        f"{meta['date']}, {meta['device']}, torch {meta['torch']}, Triton {meta['triton']}; "
        f"copy bandwidth {meta['copy_GBps']} GB/s. Each row a CUDA-graph replay median, its "
        "baselines measured in the same run. Cells: us per layer (kernel launches per layer, "
        "torch.profiler); floor = every weight the layer needs (the routed experts only) "
        "read once at the copy bandwidth.",
        "",
        "What each row runs:",
        "",
        ROWS_RUN,
        "",
    ]
    if meta.get("note"):
        lines += [meta["note"], ""]
    names = _variant_names(rows)
    lines += [
        "| experts | TP | layer | phase | tokens | " + " | ".join(names) + " | "
        "beamfx vs compile | floor us | beamfx % of floor |",
        "| --- | --- | --- | --- | ---: |" + " ---: |" * (len(names) + 3),
    ]
    for r in rows:
        cell = [
            f"{r[v]['us']} ({r[v]['launches']})" if r[v].get("us") is not None else "-"
            for v in names
        ]
        pct = f"{100 * r['floor_us'] / r['beamfx']['us']:.0f}%" if r["floor_us"] else ""
        lines.append(
            f"| {r['experts']} | {r['tp']} | {r['layer'].split('_')[0]} | {r['phase']} | "
            f"{r['tokens']} | {' | '.join(cell)} | {r['beamfx_vs_compile']}x | {r['floor_us']} | "
            f"{pct} |"
        )
    lines += ["", "beamfx vs torch.compile, lowest and highest ratio per group:", ""]
    groups = dict.fromkeys((r["experts"], r["tp"], r["phase"]) for r in rows)
    for experts, tp, phase in groups:
        sel = [r for r in rows if (r["experts"], r["tp"], r["phase"]) == (experts, tp, phase)]
        ratios = [r["beamfx_vs_compile"] for r in sel]
        tokens = sorted({r["tokens"] for r in sel})
        lines.append(
            f"- {experts} TP{tp} {phase} (tokens {', '.join(map(str, tokens))}): "
            f"{min(ratios)}x to {max(ratios)}x"
        )
    return "\n".join(lines) + "\n"


def _variant_names(rows: list[dict]) -> list[str]:
    extra = [k for k in rows[0] if isinstance(rows[0][k], dict) and k not in BASE_VARIANTS]
    return [*BASE_VARIANTS, *extra]


def plot(rows: list[dict], stem: str) -> None:
    """Per (experts, TP, layer): latency vs tokens per variant with the weight-read floor,
    and below it the share of the floor each variant reaches (floor / time)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    groups = sorted({(r["experts"], r["tp"], r["layer"]) for r in rows})
    cols = min(4, len(groups))
    blocks = -(-len(groups) // cols)
    fig, axes = plt.subplots(2 * blocks, cols, figsize=(4 * cols, 6.4 * blocks), squeeze=False)
    variants = _variant_names(rows)
    for i, (experts, tp, layer) in enumerate(groups):
        top, bottom = axes[2 * (i // cols)][i % cols], axes[2 * (i // cols) + 1][i % cols]
        sel = [r for r in rows if (r["experts"], r["tp"], r["layer"]) == (experts, tp, layer)]
        tokens = [r["tokens"] for r in sel]
        for v in variants:
            us = [r[v]["us"] if r[v].get("us") is not None else float("nan") for r in sel]
            top.plot(tokens, us, marker="o", label=v)
            if sel[0]["floor_us"]:
                share = [100 * r["floor_us"] / u for r, u in zip(sel, us)]
                bottom.plot(tokens, share, marker="o", label=v)
        if sel[0]["floor_us"]:
            top.plot(tokens, [r["floor_us"] for r in sel], "k--", label="weight-read floor")
        title = f"{experts}, TP{tp}, {layer.split('_')[0]} attention"
        top.set(xscale="log", yscale="log", ylabel="us per layer", title=title)
        bottom.set(xscale="log", xlabel="tokens", ylabel="% of weight-read floor", ylim=(0, 100))
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem + ".png", dpi=100)


if __name__ == "__main__":
    main()
