"""Where a router-shaped launch's CTAs land, and what clusters cost a weight read.

The CuTeDSL router (`kernels/router/cutedsl.py`) launches 16 x 8 CTAs of 4 warps in clusters
of 8 along K; its loads and MMAs alone took 3.7 us at a token against 2.1 us for the Triton
whole-row kernel reading the same 5.2 MB (bench/NOTES.md, router runs 11-13). This probe
launches a kernel of the same shape that only reads the weight (each CTA its 40 KB, every
load issued at once, as the router does before its wait) with clusters of 1, 2, 4 and 8 CTAs,
with and without enough dynamic shared memory to hold one CTA an SM, and reports the CUDA
graph replay time per launch (16 rotating weights, so every launch reads DRAM) and the
placement: distinct SMs used and the most CTAs on one SM (from %smid).

    python3 -P tools/probe_cluster_placement.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Int32, Int64
from cutlass.cutlass_dsl import dsl_user_op

from beamfx.kernels.moe import cutedsl as moe_cutedsl
from beamfx.kernels.moe.cutedsl_kernels import _asm, ld_v4_early
from beamfx.kernels.router.cutedsl_kernels import st_s32

TILES, SPLIT, THREADS = 16, 8, 128  # the router's grid: 16 expert tiles x 8 K slices
BYTES = 256 * 5120 * 4  # Beam-1.0's fp32 router weight
LOADS = BYTES // (TILES * SPLIT * THREADS * 16)  # 16-byte loads a thread (20)


@dsl_user_op
def smid(*, loc=None, ip=None):
    return _asm([Int32], [], "mov.u32 $0, %smid;", "=r", True, loc, ip)[0]


@cute.kernel
def read_kernel(w: Int64, out: Int64, sm: Int64):
    tidx, _, _ = cute.arch.thread_idx()
    bx, by, _ = cute.arch.block_idx()
    cta = by * TILES + bx
    base = w + (Int64(cta) * (LOADS * THREADS) + Int64(tidx)) * 16
    acc = Int32(0)
    for i in cutlass.range_constexpr(LOADS):
        v = ld_v4_early(base + i * THREADS * 16)
        acc = acc + v[0] + v[1] + v[2] + v[3]
    st_s32(out + (Int64(cta) * THREADS + Int64(tidx)) * 4, acc)
    if tidx == 0:
        st_s32(sm + Int64(cta) * 4, smid())


@cute.jit
def read_host(w: Int64, out: Int64, sm: Int64, stream, cluster: cutlass.Constexpr,
              smem: cutlass.Constexpr):  # fmt: skip
    if cutlass.const_expr(smem > 0):
        read_kernel(w, out, sm).launch(
            grid=[TILES, SPLIT, 1], block=[THREADS, 1, 1], cluster=[1, cluster, 1], smem=smem,
            stream=stream,
        )  # fmt: skip
    else:
        read_kernel(w, out, sm).launch(
            grid=[TILES, SPLIT, 1], block=[THREADS, 1, 1], cluster=[1, cluster, 1], stream=stream
        )


def time_graph(run, weights, out, sm, reps: int = 50) -> list[float]:
    """us per launch: one graph of a launch per weight, replayed `reps` times, 5 rounds."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for w in weights:
            run(w.data_ptr(), out.data_ptr(), sm.data_ptr(), moe_cutedsl._stream())
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for w in weights:
                run(w.data_ptr(), out.data_ptr(), sm.data_ptr(), moe_cutedsl._stream())
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps / len(weights))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [torch.randint(0, 2**30, (BYTES // 4,), dtype=torch.int32, device=dev)
               for _ in range(16)]  # fmt: skip
    out = torch.empty(TILES * SPLIT * THREADS, dtype=torch.int32, device=dev)
    sm = torch.empty(TILES * SPLIT, dtype=torch.int32, device=dev)
    stream0 = moe_cutedsl._stream_type()(0)
    rows = []
    for smem in (0, 120 * 1024):
        for cluster in (1, 2, 4, 8):
            name = f"cluster {cluster}, {'one CTA an SM' if smem else 'no shared memory'}"
            try:
                run = cute.compile(read_host, Int64(0), Int64(0), Int64(0), stream0, cluster, smem)
                sm.fill_(-1)
                run(weights[0].data_ptr(), out.data_ptr(), sm.data_ptr(), moe_cutedsl._stream())
                torch.cuda.synchronize()
                ids = sm.tolist()
                times = time_graph(run, weights, out, sm)
            except Exception as exc:  # a launch shape the device refuses
                print(f"{name}: {type(exc).__name__}: {exc}"[:400], flush=True)
                continue
            per_sm = Counter(ids)
            row = dict(cluster=cluster, smem=smem, us=[round(t, 3) for t in times],
                       median_us=round(statistics.median(times), 3), sms=len(per_sm),
                       most_ctas_an_sm=max(per_sm.values()), unset=ids.count(-1))  # fmt: skip
            rows.append(row)
            print(f"{name}: {row['median_us']:.2f} us, {row['sms']} SMs, at most "
                  f"{row['most_ctas_an_sm']} CTAs an SM", flush=True)  # fmt: skip
    props = torch.cuda.get_device_properties(0)
    meta = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
                cutlass_dsl=getattr(cutlass, "__version__", "?"), bytes=BYTES)  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
