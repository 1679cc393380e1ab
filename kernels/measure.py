"""Measuring kernels on a CUDA GPU, shared by the benchmarks in tools/: copy bandwidth,
CUDA-graph replay timing, kernel launches per call, package versions for the record."""

from __future__ import annotations

import importlib.metadata

import torch


def package_version(dist: str) -> str | None:
    """An installed distribution's version (for a benchmark's record), or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write counted): the best of three timings of
    ten 1 GiB copies, after a warm-up (a single graph-timed copy read low here once)."""
    a = torch.ones(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(5):
        b.copy_(a)
    best = 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            b.copy_(a)
        end.record()
        end.synchronize()
        best = max(best, 10 * 2 * a.numel() * 4 / (start.elapsed_time(end) * 1e-3))
    return best


def time_per_call(fn, sets) -> float:
    """Microseconds per call: CUDA-graph replay median of one pass over all input sets."""

    def run_all():
        for s in sets:
            fn(*s)

    from triton.testing import do_bench_cudagraph

    run_all()
    torch.cuda.synchronize()
    return do_bench_cudagraph(run_all, rep=20, return_mode="median") * 1e3 / len(sets)


def count_launches(fn, args) -> int:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
