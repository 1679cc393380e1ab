"""The CuTeDSL NVFP4 MoE kernels (`kernels/moe/cutedsl.py`) and their weight layout.

CPU (CI): the fragment layout (`kernels/moe/fragments.py`) decoded with the kernel's own
integer and bf16 operations equals `e2m1 * scale * 2^(SCALE_EXP - 126)` exactly, for any
shape, any E4M3 scale (negative, zero and subnormal ones included) and both row orders;
the provider's refusals. GPU (`-m gpu`, an H200 with nvidia-cutlass-dsl): the kernels
against the reference at the tolerances of `test_moe_kernels.py`, every output element
written, both outputs (combined, rows).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# pytest puts tests/kernels on the path; imported here, not inside a @given test (Hypothesis
# refuses the nested @given of that module's tests)
from test_moe_kernels import make_moe, poison, rel_err

from beamfx.kernels.moe import cutedsl as cd
from beamfx.kernels.moe import fragments as frag
from beamfx.kernels.moe import nvfp4
from beamfx.kernels.moe import reference as ref
from beamfx.testing import examples

E4M3_BYTES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
FINITE_E4M3 = E4M3_BYTES[E4M3_BYTES.float().isfinite()]


@st.composite
def nvfp4_stacks(draw):
    e = draw(st.integers(1, 3))
    n = 16 * draw(st.integers(1, 3))
    k = 64 * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    pick = torch.randint(0, len(FINITE_E4M3), (e, n, k // 16), generator=g)
    return packed, FINITE_E4M3[pick]


@given(nvfp4_stacks(), st.booleans())
@settings(deadline=None)
def test_fragment_layout_decodes_exactly(stack, swiglu):
    packed, scale = stack
    order = frag.swiglu_row_order(packed.shape[1] // 2) if swiglu else None
    p = frag.repack(packed, scale, order)
    assert p.codes.dtype == torch.int32 and p.codes.shape[-2:] == (32, 4)
    assert torch.equal(frag.decode(p), frag.expected(packed, scale, order))


def test_fragment_layout_is_sensitive_to_every_bit():
    """One changed code or scale changes exactly one decoded value or one block."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (1, 16, 32), generator=g, dtype=torch.uint8)
    scale = torch.full((1, 16, 4), 1.0).to(torch.float8_e4m3fn)
    base = frag.decode(frag.repack(packed, scale))
    flipped = packed.clone()
    flipped[0, 5, 7] ^= 0x10  # the high nibble: element (row 5, k 15)
    diff = (frag.decode(frag.repack(flipped, scale)) != base).nonzero().tolist()
    assert diff == [[0, 5, 15]]


def test_swiglu_row_order_interleaves_gate_and_up():
    order = frag.swiglu_row_order(16).tolist()
    assert order[:16] == [*range(8), *range(16, 24)]
    assert order[16:] == [*range(8, 16), *range(24, 32)]
    assert sorted(order) == list(range(32))


def test_repack_refuses_shapes_off_the_tile():
    with pytest.raises(ValueError, match="rows % 16 == 0 and K % 64 == 0"):
        frag.repack(torch.zeros(1, 24, 32, dtype=torch.uint8), torch.ones(1, 24, 4))


def test_repacked_weights_end_in_zero_padding():
    """A warp may load up to `depth` - 1 chunks past its range (`load_step`): PAD_CHUNKS
    chunks of zeros follow the codes and the scales in memory, and the decoded values
    ignore them."""
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 32, 64), generator=g, dtype=torch.uint8)
    scale = torch.full((2, 32, 8), 0.5).to(torch.float8_e4m3fn)
    p = frag.repack(packed, scale)
    for t, chunk_bytes in ((p.codes, 32 * 16), (p.scales, 8 * 4 * 2)):
        storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        assert t.storage_offset() == 0 and t.is_contiguous()
        assert storage.numel() == t.numel() * t.element_size() + frag.PAD_CHUNKS * chunk_bytes
        assert not storage[t.numel() * t.element_size() :].any()
    assert torch.equal(frag.decode(p), frag.expected(packed, scale))


def test_depth_past_the_padding_is_refused():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    w = (torch.zeros(4, 32, 32, dtype=torch.uint8), torch.ones(4, 32, 4), torch.ones(4, 2))
    w2 = (torch.zeros(4, 64, 8, dtype=torch.uint8), torch.ones(4, 64, 1), torch.ones(4))
    deep = cd.Config(depth1=frag.PAD_CHUNKS + 1)
    with pytest.raises(ValueError, match="depth 9 > fragments.PAD_CHUNKS = 8"):
        cd.experts(x, ids, *w, *w2, config=deep)


def test_provider_refuses_cpu_tensors():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    w13 = torch.zeros(4, 64, 32, dtype=torch.uint8)
    w2 = torch.zeros(4, 64, 16, dtype=torch.uint8)
    s13, s2 = torch.zeros(4, 64, 4), torch.zeros(4, 64, 2)  # the device is checked first
    reason = cd.why_not(x, ids, w13, s13, torch.ones(4, 2), w2, s2, torch.ones(4))
    assert "needs a CUDA device" in reason


# --- GPU ---------------------------------------------------------------------------------

gpu = pytest.mark.gpu
TOL_NVFP4 = 1.2e-2  # as test_moe_kernels.py: the reference rounds each weight to bf16


def _check(tokens, hidden, inter, experts, top_k, combine, seed, config=None):
    reason = cd.why_not_device(torch.device("cuda"))
    if reason:
        pytest.skip(reason)
    x, ids, wt, q, w13b, w2b = make_moe(tokens, hidden, inter, experts, top_k, "cuda", seed)
    wgmma = config is not None and config.wgmma is not None
    assert cd.why_not(x, ids, *q.tensors()) is None or wgmma
    poison("cuda")
    if combine:
        out = cd.experts(x, ids, *q.tensors(), wt, 1.5, config=config)
        want = ref.mega_moe(x, wt, ids, w13b, w2b, 1.5)
    else:
        out = cd.experts(x, ids, *q.tensors(), config=config)
        want = ref.moe_experts(x, w13b, w2b, ids)
    err = rel_err(out, want)
    assert err <= TOL_NVFP4, f"relative error {err:.2e}"
    if combine:  # no less accurate than the reference against fp64 weights
        w13d, w2d = q.dequantize(torch.float64)
        exact = ref.mega_moe(x.double(), wt.double(), ids, w13d, w2d, 1.5)
        assert rel_err(out, exact) <= 1.1 * rel_err(want, exact) + 1e-4
    return err


@gpu
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [
        (1, 5120, 1536, 32, 8),  # Beam-1.0 TP1 rows, fewer experts
        (8, 5120, 192, 64, 8),  # one rank of TP8
        (32, 5120, 192, 256, 8),  # 256 pairs, every expert
        (3, 256, 128, 8, 3),  # odd top-k: warps own unequal expert counts
        (5, 192, 64, 8, 6),  # K of FC1 not a multiple of 4 chunks a warp
    ],
)
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_cutedsl_matches_reference_gpu(tokens, hidden, inter, experts, top_k, combine, grouped):
    """Per pair, or pairs sorted into blocks of one expert (forced here at any size)."""
    cfg = cd.Config(grouped=grouped, warps2=4 if grouped else min(8, top_k), pdl=True)
    _check(tokens, hidden, inter, experts, top_k, combine, tokens, cfg)


@gpu
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [
        (1, 5120, 1536, 32, 8),  # Beam-1.0 TP1 rows
        (8, 5120, 192, 64, 8),  # one rank of TP8
        (3, 256, 128, 8, 3),  # odd top-k
        (5, 192, 64, 8, 6),  # K of FC1 not a multiple of 4 chunks a warp
        (2, 640, 64, 16, 12),  # more experts than FC2's warps: a warp restages its buffer
    ],
)
@pytest.mark.parametrize("pdl", [False, True])
def test_cutedsl_staged_activations_change_no_bit_gpu(tokens, hidden, inter, experts, top_k,
                                                      pdl):  # fmt: skip
    """Activations staged in shared memory by each warp: within tolerance, and the same
    bits as read from global memory (the same products in the same order)."""
    cfg = cd.Config(warps2=min(8, top_k), pdl=pdl, stage=True)
    _check(tokens, hidden, inter, experts, top_k, True, tokens, cfg)
    x, ids, wt, q, _, _ = make_moe(tokens, hidden, inter, experts, top_k, "cuda", tokens)
    for combine in (True, False):
        args = (wt, 1.5) if combine else ()
        staged = cd.experts(x, ids, *q.tensors(), *args, config=cfg)
        direct = cd.experts(x, ids, *q.tensors(), *args, config=replace(cfg, stage=False))
        assert torch.equal(staged, direct)


@gpu
@pytest.mark.parametrize("tokens, inter, experts", [(32, 192, 256), (40, 1024, 4)])
def test_cutedsl_grouped_default_gpu(tokens, inter, experts):
    """The defaults that group pairs; 40 tokens on 4 experts: blocks of 8 pairs and
    partial ones."""
    k = min(8, experts)
    assert cd.pick_config(tokens * k, 5120, inter, k).grouped
    _check(tokens, 5120, inter, experts, k, True, tokens)


@gpu
@pytest.mark.parametrize("tokens, inter, experts", [(64, 192, 256), (64, 1536, 64)])
def test_cutedsl_wgmma_default_gpu(tokens, inter, experts):
    """From 257 pairs the defaults are the wgmma kernels: at 64 tokens (512 pairs) blocks
    of 16 pairs, FC2's rows through shared memory on narrow experts (MoE run 22)."""
    wc = cd.pick_config(tokens * 8, 5120, inter, 8, experts=experts).wgmma
    assert (wc.bn, wc.stage_out) == (16, inter < cd.GROUP_MIN_INTER)
    _check(tokens, 5120, inter, experts, 8, True, tokens)


@gpu
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [
        (512, 5120, 1536, 64, 8),  # Beam-1.0 TP1 rows: 64 pairs an expert, full blocks
        (300, 5120, 192, 256, 8),  # one rank of TP8: FC1's 384 rows, 3 chunks of FC2's K
        (40, 192, 64, 4, 3),  # FC2's 192 rows: a half slice; K of 3 chunks, below the stages
        (7, 256, 128, 16, 5),  # blocks of 1-5 pairs
    ],
)
@pytest.mark.parametrize("combine", [True, False])
@pytest.mark.parametrize(
    "wc",
    [
        cd.Wgmma(),
        cd.Wgmma(bn=32, mt=1, stages=3),
        cd.Wgmma(bn=16, stages=2),
        cd.Wgmma(ctas=3),
        cd.Wgmma(bn=32, stages=3, ctas=4),
        cd.Wgmma(ctas=2, wgs=2),  # two warpgroups sharing the activations
        cd.Wgmma(bn=32, mt=1, stages=3, wgs=2),
        cd.Wgmma(ctas=2, wgs=2, walk=2),  # FC2: two slices a CTA, copies running on
        cd.Wgmma(ctas=2, wgs=2, stage_out=True),  # FC2's rows through shared memory
        cd.Wgmma(bn=16, mt=1, walk=3, stage_out=True),  # K of 1-3 chunks: copies cross slices
    ],
)
def test_cutedsl_wgmma_matches_reference_gpu(tokens, hidden, inter, experts, top_k, combine,
                                             wc):  # fmt: skip
    """The wgmma kernels (forced at any size): weights decoded as the register operand,
    activations staged in swizzled shared memory, K permuted alike in both."""
    _check(tokens, hidden, inter, experts, top_k, combine, tokens, cd.Config(wgmma=wc))


def test_wgmma_config_refuses_shapes_the_kernels_do_not_build():
    assert cd.Wgmma(bn=128, mt=1).bn == 128
    with pytest.raises(ValueError, match="bn must be 16, 32, 64 or 128, mt 1 or 2"):
        cd.Wgmma(bn=24)
    with pytest.raises(ValueError, match="bn x mt at most 128"):
        cd.Wgmma(bn=128, mt=2)
    with pytest.raises(ValueError, match="stages must be 2-6, got 1"):
        cd.Wgmma(stages=1)
    assert cd.Wgmma(bn=32, wgs=2).wgs == 2
    with pytest.raises(ValueError, match="wgs .* must be 1 or 2, and 2 needs bn >= 32"):
        cd.Wgmma(bn=16, wgs=2)
    with pytest.raises(ValueError, match="wgs .* must be 1 or 2"):
        cd.Wgmma(wgs=3)
    assert cd.Wgmma(ctas=4).ctas == 4
    with pytest.raises(ValueError, match="must be 0-4, got 5"):
        cd.Wgmma(ctas=5)
    assert cd.Wgmma(walk=8).walk == 8
    with pytest.raises(ValueError, match="walk .* must be 1-8, got 0"):
        cd.Wgmma(walk=0)


def test_permute_k_matches_the_fragment_k_order():
    """`permute_k` puts each K index where the fragments' MMA k order has it: lane c's
    values a0, a1 (MMA k 2c, 2c+1) and a4, a5 (MMA k 8+2c, 8+2c+1) hold k 4c + `_K[v]`;
    `fragments.permuted_k` (the kernels' integer form) agrees."""
    want = [0] * 64
    for base in range(0, 64, 16):
        for c in range(4):
            for v in (0, 1, 4, 5):
                mma_k = 2 * c + v if v < 2 else 8 + 2 * c + v - 4
                want[base + mma_k] = base + 4 * c + frag._K[v]
    k = torch.arange(192, dtype=torch.float32).view(3, 64).to(torch.bfloat16)  # exact to 256
    for row, got in enumerate(cd.permute_k(k).long().tolist()):
        assert got == [64 * row + i for i in want]
    assert [frag.permuted_k(i) for i in range(64)] == [want.index(i) for i in range(64)]


@gpu
@given(  # hidden >= 256 as in test_moe_kernels.py: at 64 the outputs are so few that the
    # reference's own bf16 weight rounding comes near the tolerance (9.6e-3 in a CPU model of
    # the kernels' arithmetic, 60 cases)
    tokens=st.integers(1, 24),
    hidden=st.sampled_from([256, 640, 2048]),
    inter=st.sampled_from([64, 192, 512]),
    experts=st.integers(2, 16),
    top_k=st.integers(1, 8),
    seed=st.integers(0, 1000),
)
@settings(deadline=None, max_examples=examples(20))
def test_cutedsl_random_shapes_gpu(tokens, hidden, inter, experts, top_k, seed):
    k = min(top_k, experts)
    cfg = cd.Config(grouped=seed % 2 == 1, warps2=min(8, k), pdl=seed % 4 < 2,
                    stage=seed % 3 == 0)  # fmt: skip
    _check(tokens, hidden, inter, experts, k, True, seed, cfg)


def test_nvfp4_zero_scales_zero_their_block():
    """A zero block scale contributes nothing whatever its codes (ModelOpt can emit them)."""
    packed = torch.full((1, 16, 32), 0x77, dtype=torch.uint8)  # every code 6.0
    scale = torch.ones(1, 16, 4)
    scale[0, 3, 1] = 0
    dense = frag.decode(frag.repack(packed, scale.to(torch.float8_e4m3fn)))
    assert (dense[0, 3, 16:32] == 0).all() and (dense[0, 3, :16] != 0).all()
    assert torch.equal(dense, frag.expected(packed, scale.to(torch.float8_e4m3fn)))
    assert nvfp4.E2M1_VALUES[7] == 6.0


def test_pick_config_follows_the_measured_rules():
    """The defaults bench/NOTES.md (MoE runs 9, 12, 13, 17 and 19) chose: per pair below 64
    pairs (256 on narrow experts), blocks above; FC1 on 8 warps with two chunks in flight
    below 512 CTAs; activations staged in shared memory; PDL where FC2's K fits the chunks
    it loads before waiting; a step's loads from one base address only per pair with
    neither (faster at TP1 1-4 tokens, slower at TP8 and in blocks)."""
    tp1, tp8 = 1536, 192
    one = cd.pick_config(8, 5120, tp1, 8)
    assert (one.grouped, one.warps1, one.depth1, one.warps2, one.pdl) == (False, 4, 4, 8, False)
    assert one.stage  # activations staged in shared memory (MoE run 12)
    assert one.step_loads  # MoE run 17
    narrow = cd.pick_config(8, 5120, tp8, 8)  # 8 pairs x 24 tiles = 192 CTAs
    assert (narrow.grouped, narrow.warps1, narrow.depth1, narrow.stage) == (False, 8, 2, True)
    assert narrow.pdl == cd.PDL and not narrow.step_loads
    assert not cd.pick_config(32, 5120, tp8, 8).step_loads  # narrow experts
    assert not cd.pick_config(32, 5120, 512, 8).step_loads  # narrow, even without PDL
    assert not cd.pick_config(64, 5120, tp1, 8).step_loads  # in blocks
    assert not cd.pick_config(56, 5120, tp1, 8).grouped
    assert cd.pick_config(64, 5120, tp1, 8).grouped
    assert not cd.pick_config(248, 5120, tp8, 8).grouped
    assert cd.pick_config(256, 5120, tp8, 8).grouped
    assert not cd.pick_config(512, 5120, tp8, 8, grouped=False).grouped  # forced
    assert cd.pick_config(4, 5120, tp1, 2).warps2 == 2  # a warp an expert
    # above 256 pairs the wgmma kernels (MoE runs 19, 20, 22), configured by pairs an expert
    assert cd.pick_config(256, 5120, tp1, 8).wgmma is None
    assert cd.pick_config(256, 5120, tp8, 8).wgmma is None
    wide = [cd.pick_config(p, 5120, tp1, 8, experts=256).wgmma
            for p in (257, 512, 2048, 2049, 4096, 4097, 32768)]  # fmt: skip
    assert [(w.bn, w.wgs, w.ctas, w.stage_out) for w in wide] == [
        (16, 1, 0, False), (16, 1, 0, False), (16, 1, 0, False), (32, 1, 0, False),
        (32, 1, 0, False), (64, 2, 2, True), (64, 2, 2, True),
    ]  # fmt: skip
    assert wide[-1].walk == 1  # run 21: walking lost on wide
    narrow = [cd.pick_config(p, 5120, tp8, 8, experts=256).wgmma for p in (512, 8192, 8193)]
    assert [(w.bn, w.wgs, w.stage_out) for w in narrow] == [(16, 1, True), (32, 1, False),
                                                            (64, 1, True)]  # fmt: skip
    assert narrow[-1].walk == 2


def test_stage_chunks_split_k_as_the_kernels_do_and_cap_shared_memory():
    """FC1's warps split hidden / 64 chunks (rounded up), an FC2 warp stages all of inter;
    past STAGE_BYTES a CTA's buffers are not staged; off, nothing is."""
    cfg = cd.Config(warps1=4, warps2=8, stage=True)
    assert cd.stage_chunks(cfg, 5120, 1536) == (20, 24)  # 10 KB and 24 KB a CTA
    assert cd.stage_chunks(replace(cfg, warps1=8), 5120, 192) == (10, 3)
    assert cd.stage_chunks(cfg, 192, 64) == (1, 1)  # 3 chunks over 4 warps: 1 each
    assert cd.stage_chunks(cfg, 5120, 4096) == (20, 0)  # 8 warps x 64 chunks: 64 KB
    assert cd.stage_chunks(cfg, 65536, 1536) == (0, 24)  # 256 chunks a warp: 128 KB
    assert cd.stage_chunks(replace(cfg, stage=False), 5120, 1536) == (0, 0)


def test_weight_cache_holds_its_sources_and_rebuilds_on_change():
    """An entry keeps its source tensors alive, so no other tensor can take their address
    and be served their converted copy; views hit, in-place writes rebuild."""
    import gc
    import weakref

    from beamfx.kernels.moe.weight_cache import WeightCache

    cache, built = WeightCache(max_entries=2), []

    def build(tag):
        return lambda: built.append(tag) or tag

    a = torch.zeros(64)
    alive = weakref.ref(a)
    assert cache.get((a,), build("a")) == "a"
    assert cache.get((a[:64],), build("view")) == "a"  # a view of the same data
    a.add_(1)  # an in-place write moves the version
    assert cache.get((a,), build("a2")) == "a2"
    del a
    gc.collect()
    assert alive() is not None  # held by its entries: the memory cannot be reused
    assert cache.get((torch.zeros(64),), build("b")) == "b"  # a new tensor, a new address
    assert built == ["a", "a2", "b"] and len(cache) == 2  # the oldest entry went
    cache.clear()
    gc.collect()
    assert alive() is None


def test_pair_limit_leaves_a_symbolic_batch_unguarded():
    """The passes ask providers while compiling, where the token count is a symbol: the
    pair limit must not guard (specialize) the graph on it; concrete counts are checked."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    tokens = env.create_unbacked_symint()  # comparing an unbacked symbol would raise
    assert cd.why_not_pairs(tokens * 8, 192, 256) is None
    assert not env.guards
    assert cd.why_not_pairs(32768, 1536, 256) is None  # wide experts: the wgmma kernels
    assert cd.why_not_pairs(16384, 192, 256) is None  # narrow experts too (MoE run 20)
    assert cd.why_not_pairs(65536, 192, 256) is None
    assert "past the grid's 65535" in cd.why_not_pairs(64 * 65536, 1536, 256)
