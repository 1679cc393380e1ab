"""CuTeDSL NVFP4 (W4A16) MoE experts for Hopper: tensor-core MMAs on codes decoded in
registers, weights repacked once into the fragment layout of `kernels/moe/fragments.py`.
Per pair or in blocks of 8 at decode sizes (`mma.sync`), through wgmma above MAX_PAIRS
(`cutedsl_wgmma_kernels.py`: the same fragments are wgmma's register operand A).

Per pair (below `GROUP_MIN_PAIRS`), two launches, as the Triton FMA path they replace:
1. FC1 + SwiGLU: a CTA owns one (token, expert) pair and one 16-row tile (8 gate rows and
   their 8 up rows); its warps split K. Each lane keeps `depth` 16-byte loads of codes in
   flight (four 16 x 16 tiles each), decodes a tile's 8 codes into four bf16 pairs with 9
   integer ops, multiplies them by the block scales (one bf16x2 multiply a pair, exact),
   and issues `mma.sync.m16n8k16` against the token's activations (every one of the 8 MMA
   columns holds the same token, so any lane holds the result). The warps' fp32 sums meet
   in shared memory; gate and up get their global scales, round to bf16, and
   `silu(g) * u` rounds once.
2. FC2 + combine: a CTA owns one token and one 16-row tile of the hidden dimension; its
   warps split the token's k experts. Each expert's row rounds to bf16 (the `moe_experts`
   contract); with the combine, the rows' weighted sum is taken in fp32, in slot order,
   times the routed scale, rounded once.

In blocks (from `GROUP_MIN_PAIRS` on wide experts): one small launch sorts the pairs into
blocks of up to 8 of one expert (`triton.sort_blocks`), one MMA column a pair, so an expert's
weights are read once for all its tokens; FC2 writes the pairs' bf16 rows and the Triton
finalize kernel combines them.

About 81 instructions a lane per 32 codes in FC1's loop (SASS for sm_90a): ~2.5 per code,
against ~5.5 in the Triton FMA kernels. Each warp first copies its slice of the activations
into shared memory (`Config.stage`): read from global memory, ptxas places each 8-byte
activation load just before its MMA, one L2 round trip a tile. Programmatic dependent
launch (FC2 loads its first weights before waiting for FC1) where FC2's whole K fits those
loads.

Needs `nvidia-cutlass-dsl` (the `gpu` extra) and compute capability 9.x (sm_90a PTX:
`mul.rn.bf16x2`). Kernels are compiled once per static configuration (top-k, warps,
depth, combine, PDL) and take every size as a runtime argument: token counts never
recompile. `BEAMFX_CUTEDSL=0` turns the provider off.
"""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass

import torch

from beamfx.kernels.moe import fragments as frag
from beamfx.kernels.moe.reference import why_not_layout
from beamfx.kernels.moe.weight_cache import WeightCache
from beamfx.ops import Provider

# Above MAX_PAIRS (tokens x top-k) the wgmma kernels serve, configured by `wgmma_config`
# (bench/NOTES.md, MoE runs 19, 20 and 22: at 512 pairs, 64 tokens, 4-11% faster on an
# H200 and 14-16% on an H100; level at 256).
MAX_PAIRS = 256
MAX_GRID_Y = 65535  # the wgmma launches' blocks of pairs run along the grid's y
# From this many pairs, pairs sharing an expert share its weight reads: one launch sorts
# them into blocks of GROUP columns (`triton.sort_blocks`), FC2 writes rows, a finalize
# launch combines them (bench/NOTES.md, MoE runs 9 and 13).
GROUP_MIN_PAIRS = 64
GROUP_MIN_INTER = 1024  # narrower experts (one TP8 rank: 192) gain less from sharing,
GROUP_MIN_PAIRS_NARROW = 256  # ... up to this many pairs
PDL = os.environ.get("BEAMFX_PDL", "1") != "0"
GROUP = 8  # pairs a block: the MMA's N
STAGE_BYTES = 32 << 10  # most shared memory a CTA takes to stage activations (`Config.stage`)


@functools.cache
def import_kernels(module: str):
    """(the CuTeDSL kernels module `beamfx.kernels.<module>`, None), or (None, why CuTeDSL
    does not import)."""
    try:
        return importlib.import_module(f"beamfx.kernels.{module}"), None
    except Exception as err:  # ImportError, or a CUDA setup error on import
        return None, f"CuTeDSL (nvidia-cutlass-dsl) does not import: {err}"


def _cute():
    return import_kernels("moe.cutedsl_kernels")


def why_not_device(device: torch.device) -> str | None:
    if os.environ.get("BEAMFX_CUTEDSL", "1") == "0":
        return "disabled by BEAMFX_CUTEDSL=0"
    if device.type != "cuda":
        return f"needs a CUDA device, got {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap[0] != 9:
        return f"needs compute capability 9.x (Hopper, sm_90a), this GPU is {cap}"
    return _cute()[1]


def _stream_type():
    from cuda.bindings import driver

    return driver.CUstream


@dataclass(frozen=True)
class Config:
    """Warps of a CTA (FC1: splitting K; FC2: splitting the token's experts) and chunks of
    64 codes a lane keeps in flight (`depth`)."""

    warps1: int = 4
    depth1: int = 4
    warps2: int = 8
    depth2: int = 4
    grouped: bool = False
    # programmatic dependent launch: FC2 loads its first weights while FC1 finishes
    pdl: bool = False
    # each warp stages its activations in shared memory first (per pair only)
    stage: bool = False
    # per pair: the next step's chunks load from one base address (no clamp a chunk)
    step_loads: bool = False
    # many pairs: blocks of one expert through wgmma (`Wgmma`); overrides the fields above
    wgmma: Wgmma | None = None


@dataclass(frozen=True)
class Wgmma:
    """The wgmma kernels (`cutedsl_wgmma_kernels.py`): `bn` pairs a block (wgmma's N),
    `mt` 64-row slices of the weights a warpgroup, `stages` chunks of activations and weights
    in shared memory, `wgs` warpgroups a CTA (sharing the activations), `ctas` CTAs an SM
    the registers are capped for (0: no cap), `walk` slices of FC2's rows a CTA takes in turn
    (its copies run on into the next slice's K, so a CTA's pipeline fills once for them all),
    `stage_out`: FC2's rows written through shared memory, 16 bytes a store."""

    bn: int = 64
    mt: int = 2
    stages: int = 4
    ctas: int = 0
    wgs: int = 1
    walk: int = 1
    stage_out: bool = False

    def __post_init__(self):
        if self.bn not in (16, 32, 64, 128) or self.mt not in (1, 2) or self.bn * self.mt > 128:
            raise ValueError(
                f"CuTeDSL wgmma MoE {self}: bn must be 16, 32, 64 or 128, mt 1 or 2 and bn x "
                f"mt at most 128 (the accumulators are mt x bn / 2 registers a thread)"
            )
        if not 2 <= self.stages <= 6:
            raise ValueError(f"CuTeDSL wgmma MoE {self}: stages must be 2-6, got {self.stages}")
        if self.wgs not in (1, 2) or self.bn * 8 < 128 * self.wgs:
            raise ValueError(
                f"CuTeDSL wgmma MoE {self}: wgs (warpgroups a CTA) must be 1 or 2, and 2 needs "
                f"bn >= 32 (each thread copies whole 16-byte units of the block's rows)"
            )
        if not 0 <= self.ctas <= 4:
            raise ValueError(
                f"CuTeDSL wgmma MoE {self}: ctas (CTAs an SM the registers are capped for; 0: "
                f"no cap) must be 0-4, got {self.ctas}"
            )
        if not 1 <= self.walk <= 8:
            raise ValueError(
                f"CuTeDSL wgmma MoE {self}: walk (slices of FC2's rows a CTA takes in turn) "
                f"must be 1-8, got {self.walk}"
            )


FEW_CTAS = 512  # FC1 below this many CTAs (one TP8 rank at a token: 192) splits K 8 ways


# blocks of 64 pairs: wide experts two warpgroups a CTA (128 registers, two CTAs an SM);
# FC2's rows through shared memory on both, and on narrow experts (FC2's K of 3 chunks)
# two slices a CTA (MoE run 21: 1-4% faster at 1024-4096 tokens on wide, 12% on narrow)
MANY_WIDE = Wgmma(ctas=2, wgs=2, stage_out=True)
MANY_NARROW = Wgmma(walk=2, stage_out=True)


def wgmma_config(pairs: int, experts: int, inter: int) -> Wgmma:
    """By pairs an expert (MoE runs 20-22): blocks of 16 to 8 pairs (FC2's rows through
    shared memory on narrow experts), of 32 to 16 on wide experts (`inter` from
    GROUP_MIN_INTER) and to 32 on narrow ones; beyond, blocks of 64 (`MANY_WIDE`,
    `MANY_NARROW`)."""
    per_expert = pairs / max(experts, 1)
    wide = inter >= GROUP_MIN_INTER
    if per_expert <= 8:
        return Wgmma(bn=16, stage_out=not wide)
    if per_expert <= (16 if wide else 32):
        return Wgmma(bn=32)
    return MANY_WIDE if wide else MANY_NARROW


def pick_config(
    pairs: int, hidden: int, inter: int, top_k: int, grouped: bool | None = None,
    experts: int = 0,
) -> Config:  # fmt: skip
    """Above MAX_PAIRS, the wgmma kernels as `wgmma_config` sets them (`experts`: 0 is
    unknown, taken as 256). Below, measured on an H200 (bench/NOTES.md, MoE runs 9, 12, 13,
    17): four chunks in flight
    a lane, FC1 on 4 warps (8 where there are few CTAs), FC2 one warp an expert; blocks of pairs
    sharing an expert from GROUP_MIN_PAIRS on wide experts (or GROUP_MIN_PAIRS_NARROW).
    Programmatic dependent launch where FC2 loads all its weights before it waits (it
    slowed wide experts at a token: FC2's waiting CTAs hold SMs from FC1's last wave).
    Per pair on wide experts, a step's loads from one base address (`step_loads`, run 17:
    2-3% faster at TP1 a token; slower on one TP8 rank's experts and in blocks)."""
    if pairs > MAX_PAIRS:
        return Config(wgmma=wgmma_config(pairs, experts or 256, inter))
    return mma_sync_config(pairs, inter, top_k, grouped)


def mma_sync_config(pairs: int, inter: int, top_k: int, grouped: bool | None = None) -> Config:
    """The per-pair or block (`mma.sync`) kernels' config at any count of pairs
    (`pick_config` below MAX_PAIRS; the sweeps time it above)."""
    pdl = PDL and inter <= 64 * Config.depth2
    if grouped is None:  # else forced (benchmark sweeps)
        grouped = pairs >= (GROUP_MIN_PAIRS if inter >= GROUP_MIN_INTER else GROUP_MIN_PAIRS_NARROW)
    if grouped:
        return Config(warps1=4, depth1=2, warps2=2, depth2=2, grouped=True, pdl=pdl)
    few = pairs * (inter // 8) < FEW_CTAS
    return Config(warps1=8 if few else 4, depth1=2 if few else 4, warps2=min(8, top_k),
                  pdl=pdl, stage=True,
                  step_loads=inter >= GROUP_MIN_INTER and not (few or pdl))  # fmt: skip


def stage_chunks(cfg: Config, hidden: int, inter: int) -> tuple[int, int]:
    """Chunks of 64 K a warp stages in shared memory (`Config.stage`): FC1's warps split
    hidden, an FC2 warp takes all of inter. 0 where staging is off or the CTA's buffers would
    pass STAGE_BYTES (the kernels then read activations from global memory)."""
    if not cfg.stage:
        return 0, 0
    fc1, fc2 = -(-(hidden // 64) // cfg.warps1), inter // 64
    most = STAGE_BYTES // 128  # chunks a CTA may stage
    return (fc1 if cfg.warps1 * fc1 <= most else 0), (fc2 if cfg.warps2 * fc2 <= most else 0)


@functools.cache
def compiled_fc1(topk: int, warps: int, depth: int, pdl: bool, stage: int, step_loads=False):
    k = _cute()[0]
    z64, z32 = k.Int64(0), k.Int32(1)
    stream = _stream_type()(0)
    return k.cute.compile(
        k.fc1_host, *[z64] * 6, z32, z32, z32, stream, topk, warps, depth, pdl, stage,
        step_loads,
    )  # fmt: skip


@functools.cache
def compiled_fc2(topk: int, warps: int, combine: bool, depth: int, pdl: bool, stage: int,
                 step_loads=False):  # fmt: skip
    k = _cute()[0]
    z64, z32 = k.Int64(0), k.Int32(1)
    stream = _stream_type()(0)
    return k.cute.compile(
        k.fc2_host, z64, z64, z64, z64, z64, z64, z64, k.Float32(1.0), z32, z32, z32,
        stream, topk, warps, combine, depth, pdl, stage, step_loads,
    )  # fmt: skip


@functools.cache
def compiled_grouped(topk: int, w1: int, d1: int, w2: int, d2: int, pdl: bool):
    k = _cute()[0]
    z64, z32 = k.Int64(0), k.Int32(1)
    stream = _stream_type()(0)
    fc1 = k.cute.compile(k.fc1_grouped_host, *[z64] * 7, z32, z32, z32, stream, topk, w1, d1, pdl)
    fc2 = k.cute.compile(k.fc2_grouped_host, *[z64] * 7, z32, z32, z32, stream, w2, d2, pdl)
    return fc1, fc2


@functools.cache
def compiled_wgmma(topk: int, wc: Wgmma):
    k, why = import_kernels("moe.cutedsl_wgmma_kernels")
    if k is None:
        raise RuntimeError(why)
    z64, z32 = k.Int64(0), k.Int32(1)
    stream = _stream_type()(0)
    shape = (wc.bn, wc.mt, wc.stages, wc.ctas, wc.wgs)
    fc1 = k.cute.compile(k.fc1_host, *[z64] * 7, z32, z32, z32, stream, topk, *shape)
    fc2 = k.cute.compile(k.fc2_host, *[z64] * 7, z32, z32, z32, stream, *shape, wc.walk,
                         wc.stage_out)  # fmt: skip
    return fc1, fc2


def permute_k(x: torch.Tensor) -> torch.Tensor:
    """`x [T, K]` with K permuted within each 16 as the fragment layout permutes the
    weights' (`fragments._K`): 4c + q to 2c + q (q < 2) or 8 + 2c + q - 2, so that wgmma
    reads the activations from shared memory in the k order of the decoded weights."""
    t, k = x.shape
    pairs = x.view(torch.int32).view(t, k // 16, 4, 2)  # the permutation moves pairs of K
    return pairs.transpose(2, 3).reshape(t, k // 2).view(torch.bfloat16)


# --- weights, prepared once per layer --------------------------------------------------------

PREPARED = WeightCache()


def prepare(w13, w13_scale, w13_global, w2, w2_scale, w2_global):
    """The experts in fragment layout, built on a layer's first call and cached."""

    def build():
        inter = w13.shape[1] // 2
        fc1 = frag.repack(w13, w13_scale, frag.swiglu_row_order(inter).to(w13.device))
        return fc1, frag.repack(w2, w2_scale)

    fc1, fc2 = PREPARED.get((w13, w13_scale, w2, w2_scale), build)
    return fc1, fc2, w13_global.float().contiguous(), w2_global.float().contiguous()


def _stream():
    return _stream_type()(torch.cuda.current_stream().cuda_stream)


def experts(x, ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights=None,
            routed_scale=1.0, config: Config | None = None):  # fmt: skip
    """FC1 + SwiGLU, then FC2 (+ combine when `topk_weights` is given: [T, H], else the
    rows [T, k, H])."""
    t, k = ids.shape
    hidden, inter = x.shape[1], w13.shape[1] // 2
    cfg = config or pick_config(t * k, hidden, inter, k, experts=w13.shape[0])
    if max(cfg.depth1, cfg.depth2) > frag.PAD_CHUNKS:
        raise ValueError(
            f"CuTeDSL MoE config {cfg}: depth {max(cfg.depth1, cfg.depth2)} > "
            f"fragments.PAD_CHUNKS = {frag.PAD_CHUNKS} (the kernels would load past the "
            f"repacked weights); use depth1, depth2 <= {frag.PAD_CHUNKS}"
        )
    fc1, fc2, g13, g2 = prepare(w13, w13_scale, w13_global, w2, w2_scale, w2_global)
    x = x.contiguous()
    if x.data_ptr() % 16:  # activations are read 8 bytes at a time
        x = x.clone()
    flat = ids.reshape(-1).to(torch.int32).contiguous()
    h = torch.empty(t * k, inter, device=x.device, dtype=torch.bfloat16)
    combine = topk_weights is not None
    stream = _stream()
    if cfg.wgmma is not None:
        runs = compiled_wgmma(k, cfg.wgmma)
        return _in_blocks(permute_k(x), flat, t, k, h, fc1, fc2, g13, g2, topk_weights,
                          routed_scale, cfg.wgmma.bn, runs, w13.shape[0], stream)  # fmt: skip
    if cfg.grouped:
        runs = compiled_grouped(k, cfg.warps1, cfg.depth1, cfg.warps2, cfg.depth2, cfg.pdl)
        return _in_blocks(x, flat, t, k, h, fc1, fc2, g13, g2, topk_weights, routed_scale,
                          GROUP, runs, w13.shape[0], stream)  # fmt: skip
    stage1, stage2 = stage_chunks(cfg, hidden, inter)
    # Made before the first launch: FC2 (a PDL launch) reads `weights` before its wait, so
    # a conversion kernel between the two launches could still be writing it.
    if combine:
        out = torch.empty(t, hidden, device=x.device, dtype=torch.bfloat16)
        weights = topk_weights.reshape(-1).float().contiguous()
    else:
        out = torch.empty(t, k, hidden, device=x.device, dtype=torch.bfloat16)
        weights = g2
    if t:
        compiled_fc1(k, cfg.warps1, cfg.depth1, cfg.pdl, stage1, cfg.step_loads)(
            x.data_ptr(), flat.data_ptr(), fc1.codes.data_ptr(), fc1.scales.data_ptr(),
            g13.data_ptr(), h.data_ptr(), t * k, hidden, inter, stream,
        )  # fmt: skip
        compiled_fc2(k, cfg.warps2, combine, cfg.depth2, cfg.pdl, stage2, cfg.step_loads)(
            h.data_ptr(), flat.data_ptr(), fc2.codes.data_ptr(), fc2.scales.data_ptr(),
            g2.data_ptr(), weights.data_ptr(), out.data_ptr(), float(routed_scale), t,
            hidden, inter, stream,
        )  # fmt: skip
    return out


def _in_blocks(act, flat, t, k, h, fc1, fc2, g13, g2, topk_weights, routed_scale, bn, runs,
               experts, stream):  # fmt: skip
    """Pairs sorted into blocks of up to `bn` of one expert; FC1 and FC2 (rows) by `runs`
    (the grouped kernels on x, or the wgmma ones on x with K permuted), and the finalize."""
    from beamfx.kernels.moe import triton as tk

    hidden, inter = act.shape[1], h.shape[1]
    order, blocks = tk.sort_blocks(flat, experts, bn)
    rows = torch.empty(t, k, hidden, device=act.device, dtype=torch.bfloat16)
    run1, run2 = runs
    n_blocks = blocks.shape[0]
    run1(
        act.data_ptr(), order.data_ptr(), blocks.data_ptr(), fc1.codes.data_ptr(),
        fc1.scales.data_ptr(), g13.data_ptr(), h.data_ptr(), n_blocks, hidden, inter, stream,
    )  # fmt: skip
    run2(
        h.data_ptr(), order.data_ptr(), blocks.data_ptr(), fc2.codes.data_ptr(),
        fc2.scales.data_ptr(), g2.data_ptr(), rows.data_ptr(), n_blocks, hidden, inter, stream,
    )  # fmt: skip
    if topk_weights is None:
        return rows
    return tk.finalize_rows(rows, topk_weights, routed_scale)


LAUNCHES = 2  # per pair; in blocks 4 (the sort, FC1, FC2, the finalize); wgmma 5 (+ x permuted)


# --- providers -------------------------------------------------------------------------------


def why_not_pairs(pairs, inter: int, experts: int) -> str | None:
    """Too many (token, expert) pairs for the wgmma kernels: more blocks than the grid
    holds. A symbolic count
    (the passes ask while compiling for any batch size) is not compared: that would guard
    the graph on it; the run-time call decides."""
    if not isinstance(pairs, int) or pairs <= MAX_PAIRS:
        return None
    blocks = pairs // wgmma_config(pairs, experts, inter).bn + min(experts, pairs) + 1
    if blocks > MAX_GRID_Y:
        return f"{pairs} pairs make up to {blocks} blocks, past the grid's {MAX_GRID_Y}"
    return None


def why_not(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global) -> str | None:
    reason = why_not_device(x.device)
    if reason:
        return reason
    if x.dtype != torch.bfloat16 or w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        return f"needs bf16 activations and NVFP4 (uint8) weights, got {x.dtype}, {w13.dtype}"
    reason = why_not_layout(x, topk_ids, w13, w2, (w13_scale, w13_global, w2_scale, w2_global))
    if reason:
        return reason
    hidden, inter = x.shape[1], w13.shape[1] // 2
    reason = why_not_pairs(topk_ids.numel(), inter, w13.shape[0])
    if reason:
        return reason
    return frag.why_not_shape(2 * inter, hidden) or frag.why_not_shape(hidden, inter)


def moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids):
    return experts(x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global)


def supports_moe_experts_nvfp4(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, ids):
    return why_not(x, ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global)


def mega_moe_nvfp4(
    x, topk_weights, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, routed_scale
):
    return experts(
        x, topk_ids, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_weights,
        routed_scale,
    )  # fmt: skip


def supports_mega_moe_nvfp4(x, topk_weights, topk_ids, w13, *rest):
    return why_not(x, topk_ids, w13, *rest[:5])


MOE_EXPERTS_NVFP4 = Provider("cutedsl", moe_experts_nvfp4, supports_moe_experts_nvfp4)
MEGA_MOE_NVFP4 = Provider("cutedsl", mega_moe_nvfp4, supports_mega_moe_nvfp4)
