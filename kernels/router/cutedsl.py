"""CuTeDSL router GEMM (bf16 x fp32 -> fp32 logits) for decode sizes, with the routing
fused into the same launch.

One launch, a cluster of CTAs a 16-expert tile: each CTA takes 1/`cluster` of K, each of
its warps a slice of that, 32 of K a step (Beam-1.0, 5120 x 256: 16 clusters of 8 CTAs,
4 warps each, five steps a warp; 128 CTAs).
- Every weight load of a warp is issued before it waits for the previous launch
  (programmatic dependent launch), so the 5.2 MB weight streams while that launch ends;
  once it has waited it releases the next launch in turn (`launch_dependents`).
- The fp32 weight splits in registers into three bf16 pieces (w = hi + mid + lo exactly;
  4 integer and 2 float ops a weight), each an `mma.sync.m16n8k16` against the bf16
  activations (exact products, fp32 sums): the weight as the MMA's A (16 experts), up to
  8 tokens an MMA column tile. K is permuted alike in both operands so that each lane reads
  32 contiguous bytes of a weight row and 16 of an activation row a step.
- The warps' fp32 partials meet in the cluster's distributed shared memory: each CTA sums
  its share of the tile's outputs over the cluster's CTAs and warps in a fixed order (one
  launch, no second pass, bitwise repeatable).
- With routing, the CTAs that sum the logits also score them (sigmoid, biased key); each
  counts its arrival on a device counter once its outputs are out (acquire/release); the
  last one sees every score and routes (up to a token a warp) or flags its cluster, whose
  32 warps route a token each (`route_token`: sorted per-lane keys, butterfly group
  top-2, `redux.sync` rounds for the top-k). The scores go through L2 only.

The Triton kernels (`triton.py`) serve what this does not: more than MAX_TOKENS tokens,
shapes off the tiles, routing shapes the warp layout cannot hold, GPUs other than 9.x.
Needs `nvidia-cutlass-dsl`; `BEAMFX_CUTEDSL=0` turns it off. Kernels compile once per
static configuration (shape, token tiles of 8, routing settings).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from beamfx.kernels.moe import cutedsl as moe_cutedsl
from beamfx.ops import Provider

MAX_TOKENS = 64  # 8 MMA column tiles of 8 tokens
# Where the Triton kernels are faster: logits below 4 tokens (the whole-row kernel). On an
# H100, both forced and taking turns (router run 21's `--crossover`,
# `router_logits_crossover_h100.json`): Triton 2.52 / 2.62 us at 1 / 2 tokens against
# 3.12 / 3.15 here; this kernel ahead from 4 (3.23 against 3.52; 3.26 against 4.37 at 6).
# (8 until then: an H200 choice from router runs 11-14, before the pushed exchange took
# 0.4-0.7 us off this kernel's logits; 3 tokens not timed.) Logits + routing: this kernel
# at every count it serves since the summing CTAs score the logits (router run 17: 5.59 us
# at 1 token and 10.70 at 64 on an H200; Triton's two kernels 6.82 and 12.11 in run 14's
# table, not the same run).
LOGITS_MIN_TOKENS = 4
ROUTED_MIN_TOKENS = 1
ROUTED_MAX_TOKENS = MAX_TOKENS
MAX_STEPS = 8  # 32-wide K steps a warp holds in flight (registers)
PDL = moe_cutedsl.PDL


def _cute():
    return moe_cutedsl.import_kernels("router.cutedsl_kernels")


@dataclass(frozen=True)
class Config:
    """CTAs a cluster (K split across them), warps a CTA (K split again), accumulator
    chains for the fp32 weight's pieces (2: hi apart from mid + lo; 4: and the two halves
    of each 32-wide step apart), and the form of the cluster's exchange of partials: 0 each
    CTA pulls the partials it sums from its peers' shared memory after a cluster barrier
    (release, acquire); 1 each warp pushes them into the shared memory of the CTA that sums
    them (`st.async`, counted on that CTA's mbarrier); 2 pushed, and no cluster barrier at
    exit where no CTA reads a peer's shared memory; 3 as 2, a thread's four values of a
    token tile sent in one 16-byte store (an even number of 8-token tiles; else as 2). All
    sum in the same order: the same bits."""

    cluster: int = 8
    warps: int = 4
    chains: int = 2
    pdl: bool = True
    probe: int = 0  # benchmarks: a stage left out to time it (`router_kernel`)
    exchange: int = 2


# Accumulator chains a launch takes: (most tokens, chains), the first entry that holds the
# call's count, for the logits alone and for the routed launch; and the exchange's form
# (`Config.exchange`), for both. Router run 20 (two H100 sweeps,
# `router_exchange_sweep_h100*.json`): pushed without the exit barrier (form 2), the logits
# take 0.38-0.70 us less at 1-16 tokens and routed calls 0.25-0.70 less; at 64 it lost 0.9
# us to the pulled form (32 sends a thread, each behind a branch). Router run 21 (two H100
# sweeps, `router_vector_push_sweep_h100*.json`, us, first / second): form 3 sends a
# thread's four values of a tile in one store where a CTA sums an even number of tiles
# (9-16, 25-32, 41-48, 57-64 tokens; elsewhere it is form 2). At 64 tokens, two chains,
# logits 6.38 / 6.44 against 7.07 / 7.11 pulled and routed 10.12 / 10.19 against 10.74 /
# 10.83; at 32 4.54 / 4.51 against 5.05 / 5.01 (form 2), routed 7.08 / 7.02 against 7.43 /
# 7.38; at 16 the logits 3.37 / 3.39 with two chains against 3.43 / 3.44 (form 2, four:
# form 3 with four chains takes 3.98), routed equal within 0.02. 33-56 tokens stay pulled
# (5-7 tiles: not timed with form 3). Chains as in router run 17's H200 sweep otherwise
# (routed 2 everywhere; logits 4 for one tile).
CHAINS_LOGITS = ((8, 4), (MAX_TOKENS, 2))
CHAINS_ROUTED = ((MAX_TOKENS, 2),)
EXCHANGE_FORMS = ((32, 3), (56, 0), (MAX_TOKENS, 3))


def _by_tokens(table, tokens: int) -> int:
    return next((v for most, v in table if tokens <= most), table[-1][1])


def pick_config(hidden: int, tokens: int = 1, routed: bool = False) -> Config | None:
    """The widest cluster (8, the portable limit) and fewest warps whose K slices are
    whole 32-wide steps, at most MAX_STEPS a warp; None if no split fits. The accumulator
    chains by token count, from `CHAINS_LOGITS` or `CHAINS_ROUTED`, and the exchange's form
    from `EXCHANGE_FORMS`."""
    chains = _by_tokens(CHAINS_ROUTED if routed else CHAINS_LOGITS, tokens)
    exchange = _by_tokens(EXCHANGE_FORMS, tokens)
    for cluster in (8, 4, 2, 1):
        for warps in (4, 8, 2, 1, 6, 5, 3, 7):
            share = hidden // (cluster * warps) if hidden % (cluster * warps) == 0 else 0
            if share and share % 32 == 0 and share // 32 <= MAX_STEPS:
                return Config(cluster, warps, chains, PDL, exchange=exchange)
    return None


def sort_network(n: int) -> list[tuple[int, int]]:
    """Batcher's odd-even merge sort for n (a power of two) values, as compare-exchange
    pairs (i, j), i < j: after them, position i holds the larger."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return pairs


def why_not_device(device: torch.device) -> str | None:
    """The MoE kernels' conditions (BEAMFX_CUTEDSL, compute capability 9.x, CuTeDSL; these
    kernels share their PTX helpers), then this module's import."""
    return moe_cutedsl.why_not_device(device) or _cute()[1]


def why_not_tokens(tokens, low: int, high: int) -> str | None:
    """Outside [low, high] the Triton kernels are faster (or this kernel does not run). A
    symbolic count (the passes ask while compiling for any batch size) is not compared:
    that would guard the graph on it; the run-time call decides."""
    if isinstance(tokens, int) and not low <= tokens <= high:
        return f"serves {low} to {high} tokens (Triton is faster outside), got {tokens}"
    return None


def why_not(x, weight) -> str | None:
    reason = why_not_device(x.device)
    if reason:
        return reason
    if x.dtype != torch.bfloat16 or weight.dtype not in (torch.float32, torch.bfloat16):
        return f"needs bf16 activations and an fp32 or bf16 weight, got {x.dtype}, {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.device != x.device:
        return f"weight {tuple(weight.shape)} is not [experts, {x.shape[-1]}] on {x.device}"
    experts, hidden = weight.shape
    if experts % 16:
        return f"needs experts in tiles of 16, got {experts}"
    if pick_config(hidden) is None:
        return f"hidden {hidden} does not split into 32-wide K steps over a cluster"
    return None


def why_not_routing(experts: int, top_k: int, n_group: int, topk_group: int) -> str | None:
    """The warp layout of `route_token`: 32 lanes of experts / 32 (1-8) each, a group
    whole lanes."""
    per = experts // 32
    if experts % 32 or per not in (1, 2, 4, 8):
        return f"routing in a warp needs 32, 64, 128 or 256 experts, got {experts}"
    if n_group not in (1, 2, 4, 8, 16, 32):
        return f"routing in a warp needs n_group a power of two up to 32, got {n_group}"
    if not 0 < topk_group <= n_group or not 0 < top_k <= min(32, experts // n_group * topk_group):
        return f"top_k {top_k} / topk_group {topk_group} out of range for {experts} experts"
    return None


@functools.cache
def compiled(hidden, experts, n_tiles, cfg: Config, fp32_weight, route, n_group, topk_group,
             top_k, renorm, few=False):  # fmt: skip
    k = _cute()[0]
    z64 = k.Int64(0)
    stream = moe_cutedsl._stream_type()(0)
    return k.cute.compile(
        k.router_host, *[z64] * 8, k.Int32(1), stream, hidden, experts, n_tiles,
        cfg.warps, cfg.cluster, fp32_weight, cfg.chains, cfg.pdl, route, n_group, topk_group,
        top_k, renorm, few, cfg.probe, cfg.exchange,
    )  # fmt: skip


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The routing launch's arrival counter, zero between launches (the last CTA
    resets it). One a device: launches on one stream (as vLLM's) never overlap on it."""
    if device not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "routed_topk (cutedsl): its arrival counter is allocated on the first call, "
                "which is inside CUDA graph capture here; run one call eagerly first"
            )
        _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def _launch(x2d, weight, logits, route=None, config: Config | None = None):
    tokens, hidden = x2d.shape
    experts = weight.shape[0]
    cfg = config or pick_config(hidden, tokens, route is not None)
    share, rest = divmod(hidden, cfg.cluster * cfg.warps)
    if rest or share % 32 or cfg.cluster not in (1, 2, 4, 8):
        raise ValueError(
            f"router (cutedsl): {cfg} does not split hidden {hidden} into 32-wide K steps "
            "over a cluster of 1, 2, 4 or 8; use pick_config(hidden)"
        )
    if cfg.exchange not in (0, 1, 2, 3):
        raise ValueError(
            f"router (cutedsl): Config.exchange is {cfg.exchange!r}; it must be 0 (pulled), "
            "1 (pushed), 2 (pushed, no exit barrier) or 3 (2 in 16-byte stores)"
        )
    x2d = x2d.contiguous()
    if x2d.data_ptr() % 16:  # activations are read 16 bytes at a time
        x2d = x2d.clone()
    if not weight.is_contiguous() or weight.data_ptr() % 16:
        # A copy made just now: the kernel must not read it before the wait (no PDL).
        weight = weight.clone(memory_format=torch.contiguous_format)
        cfg = dataclasses.replace(cfg, pdl=False)
    n_tiles = (tokens + 7) // 8
    fp32 = weight.dtype == torch.float32
    if route is None:
        ptrs = [0, 0, 0, 0, 0]
        static = (False, 1, 1, 1, False)
    else:
        bias, weights, ids, top_k, n_group, topk_group, renorm = route
        # Each expert's biased key and sigmoid, [token][expert][2]: the routing's inputs,
        # written by the CTAs that sum the logits.
        scored = torch.empty((tokens, experts, 2), dtype=torch.int32, device=x2d.device)
        ptrs = [scored.data_ptr(), bias.data_ptr(), weights.data_ptr(), ids.data_ptr(),
                _counter(x2d.device).data_ptr()]  # fmt: skip
        static = (True, n_group, topk_group, top_k, bool(renorm))
    # At most one token a warp: the last CTA routes them alone (see router_kernel).
    few = route is not None and tokens <= cfg.warps
    run = compiled(hidden, experts, n_tiles, cfg, fp32, *static, few)
    run(x2d.data_ptr(), weight.data_ptr(), logits.data_ptr(), *ptrs, tokens, moe_cutedsl._stream())


def router_gemm(x: torch.Tensor, weight: torch.Tensor, *, config: Config | None = None):
    """`reference.router_logits` for up to MAX_TOKENS tokens (any leading shape)."""
    hidden = x.shape[-1]
    tokens = x.numel() // hidden
    logits = torch.empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32, device=x.device)
    if tokens:
        _launch(x.reshape(tokens, hidden), weight, logits.view(tokens, -1), config=config)
    return logits


def routed_topk(x, weight, correction_bias, top_k, n_group, topk_group, renormalize, *,
                config: Config | None = None):  # fmt: skip
    """`reference.routed_topk` in one launch (the routing in the last CTA's cluster)."""
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    tokens, experts = x2d.shape[0], weight.shape[0]
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int32, device=x.device)
    if tokens:
        logits = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
        bias = correction_bias.float().contiguous()
        route = (bias, weights, ids, top_k, n_group, topk_group, renormalize)
        _launch(x2d, weight, logits, route, config)
    return weights, ids


def _tokens(x):
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def supports_router_gemm(x, weight) -> str | None:
    return why_not(x, weight) or why_not_tokens(_tokens(x), LOGITS_MIN_TOKENS, MAX_TOKENS)


def supports_routed_topk(x, weight, correction_bias, top_k, n_group, topk_group,
                         renormalize) -> str | None:  # fmt: skip
    reason = why_not(x, weight) or why_not_tokens(_tokens(x), ROUTED_MIN_TOKENS, ROUTED_MAX_TOKENS)
    if reason:
        return reason
    experts = weight.shape[0]
    if tuple(correction_bias.shape) != (experts,):
        return f"correction_bias {tuple(correction_bias.shape)} is not ({experts},)"
    if correction_bias.device != x.device:  # the kernel reads it by address
        return f"correction_bias on {correction_bias.device}, x on {x.device}"
    return why_not_routing(experts, top_k, n_group, topk_group)


ROUTER_GEMM = Provider("cutedsl", router_gemm, supports_router_gemm)
ROUTED_TOPK = Provider("cutedsl", routed_topk, supports_routed_topk)
