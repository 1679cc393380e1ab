"""The Triton router GEMM and routing against the references (kernels/router/reference.py).

Logits: within 1e-5 of an fp64 reference, in norm (relative) and per element (relative to
the dot's own scale sum |x||w|, the fp32 GEMM error bound's yardstick). Routing: the same
experts as the reference for every token whose decision has a margin above float tolerance;
at near-ties either choice passes if it is a valid top-k within that tolerance.

CPU (CI): supports(), dispatch fallback, and the kernels under Triton's interpreter in a
subprocess. GPU (`-m gpu`, an H200): Beam's 5120 x 256 and other shapes, NaN-filled outputs,
repeatability (the split-K fixup must not race), the cuBLAS side of the crossover.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from beamfx import ops
from beamfx.kernels.router import reference
from beamfx.testing import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
rt = pytest.importorskip("beamfx.kernels.router.triton")
no_triton = pytest.mark.skipif(rt.triton is None, reason="triton not installed")
# Beam-1.0-shaped routing: 256 experts in 8 groups, best 4 groups, top-8.
BEAM_ROUTING = dict(top_k=8, n_group=8, topk_group=4)


def make_router(tokens, hidden, experts, weight_dtype, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    w = (torch.randn(experts, hidden, generator=g) / hidden**0.5).to(weight_dtype).to(device)
    bias = (torch.randn(experts, generator=g) * 0.05).to(device)
    return x, w, bias


def check_logits(logits: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rtol=1e-5) -> float:
    assert logits.dtype == torch.float32 and not logits.isnan().any(), "unwritten logits"
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = (logits.double() - ref).abs()
    rel = (err.norm() / ref.norm()).item()
    assert rel <= rtol, f"norm-wise relative error {rel:.2e} > {rtol}"
    worst = (err / scale).max().item()
    assert worst <= rtol, f"element error {worst:.2e} of sum|x||w| > {rtol}"
    return rel


def check_routing(weights, ids, logits, bias, top_k, n_group, topk_group, renormalize, ref_ids,
                  tol=1e-5) -> int:  # fmt: skip
    """Tie-aware comparison; returns the number of near-tie tokens."""
    assert not weights.isnan().any(), "unwritten routing weights"
    ids = ids.long().cpu()
    t, e = logits.shape
    assert ((ids >= 0) & (ids < e)).all() and (ids.sort(1).values.diff(dim=1) > 0).all()
    scores = torch.sigmoid(logits.double().cpu())
    biased = scores + bias.double().cpu()
    per_group = e // n_group
    group_score = biased.view(t, n_group, per_group).topk(min(2, per_group), -1).values.sum(-1)
    gs = group_score.sort(-1, descending=True).values
    inf = torch.full((t,), float("inf"), dtype=torch.float64)
    g_margin = gs[:, topk_group - 1] - gs[:, topk_group] if topk_group < n_group else inf
    kept = torch.zeros_like(group_score, dtype=torch.bool)
    kept.scatter_(1, group_score.topk(topk_group, -1).indices, True)
    cand = biased.masked_fill(~kept.repeat_interleave(per_group, 1), float("-inf"))
    cs = cand.sort(-1, descending=True).values
    e_margin = cs[:, top_k - 1] - cs[:, top_k] if top_k < topk_group * per_group else inf
    clear = (g_margin > tol) & (e_margin > tol)
    same = (ids.sort(1).values == ref_ids.long().cpu().sort(1).values).all(1)
    assert same[clear].all(), f"tokens {torch.nonzero(clear & ~same).flatten().tolist()} differ"
    # Any token: a valid choice within tolerance. Its groups lie at or near the group cut,
    # and its experts are the top-k of (clearly kept groups + its own groups) within tol.
    cut = gs[:, topk_group - 1 : topk_group]
    chosen = torch.zeros_like(kept).scatter_(1, ids // per_group, True)
    assert (chosen.sum(1) <= topk_group).all(), "experts from too many groups"
    # Every valid order keeps the groups clearly above the cut.
    kept_any_order = chosen | (group_score > cut + tol)
    assert (kept_any_order.sum(1) <= topk_group).all(), "a group clearly above the cut dropped"
    assert (group_score[chosen] >= cut.expand_as(group_score)[chosen] - tol).all(), "bad group"
    allowed = (chosen | (group_score > cut + tol)).repeat_interleave(per_group, 1)
    allowed.scatter_(1, ids, False)
    best_left = biased.masked_fill(~allowed, float("-inf")).max(1).values
    assert (biased.gather(1, ids).min(1).values >= best_left - tol).all(), "not a top-k"
    expected = scores.gather(1, ids)
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double().cpu(), expected, rtol=1e-5, atol=1e-6)
    return int((~clear).sum())


def test_check_routing_refuses_a_routing_that_drops_a_clearly_kept_group():
    """Three groups of two, two kept, top-2: group 0 (top-2 sum 1.2) is kept in every
    valid order while groups 1 and 2 tie at the cut (0.901). Ids from groups 1 and 2 alone
    (what scoring groups by their max gives) passed the tie-aware check."""
    s = torch.tensor([[0.6, 0.6, 0.9, 0.001, 0.9, 0.001]], dtype=torch.float64)
    logits, bias = torch.log(s / (1 - s)), torch.zeros(6)
    ref_w, ref_ids = reference.grouped_topk(logits.float(), bias, 2, 3, 2, True)
    check_routing(ref_w, ref_ids, logits, bias, 2, 3, 2, True, ref_ids)
    bad = torch.tensor([[2, 4]], dtype=torch.int32)
    bad_w = torch.sigmoid(logits).gather(1, bad.long())
    with pytest.raises(AssertionError, match="clearly above the cut"):
        check_routing(bad_w / bad_w.sum(), bad, logits, bias, 2, 3, 2, True, ref_ids)


@pytest.mark.parametrize(
    "top_k, n_group, topk_group, error",
    [(3, 4, 1, "top_k 3 must lie in 1..2"), (2, 3, 1, "n_group 3 must divide the 8"),
     (2, 4, 5, "n_group 4 must divide the 8 experts and topk_group 5"),
     (0, 4, 1, "top_k 0 must lie"), (2, 0, 1, "n_group 0 must divide")],
)  # fmt: skip
def test_routing_arguments_the_math_is_not_defined_for_are_named(top_k, n_group, topk_group, error):
    """top_k above what the kept groups hold returned an expert of a dropped group; the
    others failed in a view or a division, or were taken."""
    logits, bias = torch.randn(2, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="routing: " + error):
        ops.grouped_topk(logits, bias, top_k, n_group, topk_group, True)
    x, w = torch.randn(2, 16, dtype=torch.bfloat16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="routing: " + error):
        ops.routed_topk(x, w, bias, top_k, n_group, topk_group, True)


# --- CPU: supports() and dispatch -------------------------------------------------------


def fake_router(tokens=4, hidden=5120, experts=256, x_dtype=torch.bfloat16,
                w_dtype=torch.float32, device="cuda"):  # fmt: skip
    with FakeTensorMode():
        x = torch.empty(tokens, hidden, dtype=x_dtype, device=device)
        w = torch.empty(experts, hidden, dtype=w_dtype, device=device)
        bias = torch.empty(experts, device=device)
    return x, w, bias


@no_triton
@pytest.mark.parametrize(
    "case, expected",
    [
        (dict(), None),
        (dict(w_dtype=torch.bfloat16), None),
        (dict(experts=384, tokens=100000), None),
        (dict(device="cpu"), "device cpu is not cuda"),
        (dict(x_dtype=torch.float16), "x dtype torch.float16 is not bf16"),
        (dict(w_dtype=torch.float16), "weight dtype torch.float16"),
        # The split-K kernel (9-64 tokens) adds at most MAX_SPLITS chunks of 256: it raised
        # for hidden above 16384 rather than declining; the whole-row kernel (4) takes it.
        (dict(tokens=16, hidden=16640), "hidden 16640 makes 65 K chunks of 256 at 16 tokens"),
        (dict(tokens=4, hidden=16640), None),
        # A plain fp32 head on upcast states is lifted to router_gemm too: at 65-255 tokens
        # it raised "output tiles > 2048" at launch rather than being declined.
        (dict(tokens=200, experts=32000), "32000 experts > 1024"),
    ],
)
def test_supports_names_the_limit(case, expected):
    x, w, bias = fake_router(**case)
    for reason in (
        rt.supports_router_gemm(x, w),
        rt.supports_routed_topk(x, w, bias, 8, 8, 4, True),
    ):
        assert reason == expected if expected is None else expected in reason


@no_triton
def test_supports_rejects_bad_routing_shapes():
    x, w, bias = fake_router()
    with FakeTensorMode():
        w_short = torch.empty(256, 4096, device="cuda")
        bias_short = torch.empty(255, device="cuda")
    assert "is not [experts, 5120]" in rt.supports_router_gemm(x, w_short)
    assert "do not split 256 experts" in rt.supports_routed_topk(x, w, bias, 8, 6, 4, True)
    assert "top_k 40 > experts in 1 groups" in rt.supports_routed_topk(x, w, bias, 40, 8, 1, True)
    assert "correction_bias (255,)" in rt.supports_routed_topk(x, w, bias_short, 8, 8, 4, True)
    # The kernel reads the bias by address: one on the host raised at launch, not declined.
    bias_cpu = torch.zeros(256)
    assert "correction_bias on cpu" in rt.supports_routed_topk(x, w, bias_cpu, 8, 8, 4, True)


@no_triton
def test_routable_needs_power_of_two_tiles():
    assert rt._routable(256, 8, 4, 8)
    assert rt._routable(64, 1, 1, 6)
    assert not rt._routable(384, 8, 4, 8)  # 48 experts a group: the reference routes
    assert not rt._routable(256, 64, 4, 8)  # kept groups are a 32-bit mask


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cpu_dispatch_falls_back_to_reference():
    assert rt.ROUTER_GEMM is None and rt.ROUTED_TOPK is None
    x, w, bias = make_router(3, 64, 16, torch.float32, "cpu", seed=0)
    assert torch.equal(ops.router_gemm(x, w), reference.router_logits(x, w))
    assert ops.ROUTER_GEMM.last_provider == "reference"
    got = ops.routed_topk(x, w, bias, 4, 4, 2, True)
    want = reference.routed_topk(x, w, bias, 4, 4, 2, True)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


# --- CPU: the kernels under Triton's interpreter -----------------------------------------


@pytest.mark.skipif(INTERPRETED or rt.triton is None, reason="runs the interpreted tests below")
def test_kernels_under_triton_interpreter():
    run_interpreted(__file__)


needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")


def test_gemv_broadcast_needs_the_whole_row():
    with pytest.raises(ValueError, match="broadcast=True needs one_shot=True"):
        rt.GemvConfig(2, 8, 512, 8, broadcast=True)


SMALL_CONFIGS = [
    rt.GemmConfig(block_e=16, k_chunk=64, block_k=32, num_warps=4),
    rt.GemmConfig(block_e=32, k_chunk=128, block_k=64, num_warps=4),
    rt.GemmConfig(block_e=16, k_chunk=4096, block_k=64, num_warps=4),  # no split
    # Whole weight rows per program (few tokens): K tiles that do and do not divide hidden.
    rt.GemvConfig(block_e=1, block_t=1, block_k=64, num_warps=4),
    rt.GemvConfig(block_e=2, block_t=4, block_k=128, num_warps=4),
    rt.GemvConfig(block_e=4, block_t=2, block_k=256, num_warps=2),
    # The whole row at once: two tiles (hidden 200: 128 + 128 padded), or one padded tile.
    rt.GemvConfig(block_e=2, block_t=2, block_k=128, num_warps=4, one_shot=True, pdl=True),
    # ... each row loaded once, the product broadcast: a tile past the experts and tokens.
    rt.GemvConfig(2, 4, 128, 4, one_shot=True, pdl=True, broadcast=True),
    rt.GemvConfig(4, 1, 256, 2, one_shot=True, broadcast=True),
    # Split-K without a fixup: the sum kernel, or the routing kernel, adds the splits; K
    # chunks that do and do not divide hidden, one token tile or several.
    rt.SplitConfig(block_e=16, k_chunk=64, num_warps=4),
    rt.SplitConfig(block_e=32, k_chunk=128, num_warps=4, max_block_t=16),
    # Many tokens: one GEMM on the weight's three bf16 pieces, their thirds added by the
    # reader (the pieces kernel's blocks do not divide the weight).
    rt.PiecesConfig(block=512),
    rt.PiecesConfig(block=512, k_chunks=4),  # K in 4 chunks where hidden allows
]


@needs_interpreter
@pytest.mark.parametrize(
    "tokens, hidden, experts, config",
    [
        (3, 200, 48, rt.GemvConfig(2, 4, 128, 4, one_shot=True, pdl=True, broadcast=True)),
        (9, 512, 32, rt.GemvConfig(4, 8, 256, 2, one_shot=True, broadcast=True)),
        (1, 64, 16, rt.GemvConfig(1, 1, 64, 1, one_shot=True, broadcast=True)),
    ],
)
def test_interpreted_gemv_broadcast(tokens, hidden, experts, config):
    """Each weight row read once and broadcast over the token tile: every logit written
    (NaN-filled output), partial token and expert tiles, a second K tile or none."""
    x, w, bias = make_router(tokens, hidden, experts, torch.float32, "cpu", seed=tokens)
    logits = torch.full((tokens, experts), float("nan"))
    rt._launch_gemm(x, w, logits, None, config)
    check_logits(logits, x, w)
    # Routing in the last program to finish a token tile (the arrival counter), and behind
    # (48 experts are not routable in Triton: the reference routes them).
    top_k, n_group, topk_group = 4, 4, 2
    _, ref_ids = reference.routed_topk(x, w, bias, top_k, n_group, topk_group, True)
    for fused in (True, False):
        weights, ids = rt.routed_topk(
            x, w, bias, top_k, n_group, topk_group, True, fused=fused, config=config
        )
        exact = x.double() @ w.double().T
        check_routing(weights, ids, exact, bias, top_k, n_group, topk_group, True, ref_ids)


@needs_interpreter
@settings(deadline=None)
@given(
    tokens=st.integers(1, 80),
    hidden=st.sampled_from([64, 200, 512]),
    experts=st.sampled_from([16, 32, 64, 48]),
    weight_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    config=st.sampled_from(SMALL_CONFIGS),
    seed=st.integers(0, 2**16),
)
def test_interpreted_gemm_matches_fp64(tokens, hidden, experts, weight_dtype, config, seed):
    x, w, _ = make_router(tokens, hidden, experts, weight_dtype, "cpu", seed)
    check_logits(rt.router_gemm(x, w, config=config), x, w)


@needs_interpreter
@settings(deadline=None)
@given(
    tokens=st.integers(1, 70),
    experts_routing=st.sampled_from(
        [(64, 8, 4, 8), (64, 1, 1, 6), (32, 4, 2, 3), (16, 16, 4, 4), (32, 2, 2, 1)]
    ),
    renormalize=st.booleans(),
    fused=st.booleans(),
    config=st.sampled_from(SMALL_CONFIGS),
    sorted_keys=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_interpreted_routing_matches_reference(
    tokens, experts_routing, renormalize, fused, config, sorted_keys, seed
):
    experts, n_group, topk_group, top_k = experts_routing
    x, w, bias = make_router(tokens, 128, experts, torch.float32, "cpu", seed)
    with routing_by(sorted_keys):
        weights, ids = rt.routed_topk(
            x, w, bias, top_k, n_group, topk_group, renormalize, fused=fused, config=config
        )
    _, ref_ids = reference.routed_topk(x, w, bias, top_k, n_group, topk_group, renormalize)
    logits = x.double() @ w.double().T
    check_routing(weights, ids, logits, bias, top_k, n_group, topk_group, renormalize, ref_ids)


@needs_interpreter
@pytest.mark.parametrize("config", [c for c in SMALL_CONFIGS if isinstance(c, rt.SplitConfig)])
def test_interpreted_split_k_adds_every_split(config):
    # hidden 448: 7 K splits of 64 (the last ragged at 128-wide chunks): the sum kernel and
    # the routing kernel must each add all of them.
    x, w, bias = make_router(19, 448, 64, torch.float32, "cpu", seed=5)
    check_logits(rt.router_gemm(x, w, config=config), x, w)
    weights, ids = rt.routed_topk(x, w, bias, 8, 8, 4, True, config=config)
    _, ref_ids = reference.routed_topk(x, w, bias, 8, 8, 4, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, 8, 8, 4, True, ref_ids)


@needs_interpreter
@settings(deadline=None)
@given(
    shape=st.sampled_from([(16, 64), (48, 200), (64, 448)]),
    scale=st.sampled_from([1.0, 2.0**-60, 2.0**60]),
    seed=st.integers(0, 2**16),
)
def test_interpreted_pieces_sum_to_the_weight_exactly(shape, scale, seed):
    # Every product with a piece is exact only if the pieces add up to w bit for bit (as
    # long as the third piece is a normal number: |w| above about 2^-110).
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * scale
    pieces = torch.empty((3 * shape[0], shape[1]), dtype=torch.bfloat16)
    rt._pieces_kernel[(rt.triton.cdiv(w.numel(), 512),)](w, pieces, w.numel(), BLOCK=512)
    p1, p2, p3 = pieces.float().view(3, *shape)
    assert torch.equal((p1 + p2) + p3, w)
    # Each piece below the last one's unit in the last place (truncating or rounding).
    assert (p2.abs() <= p1.abs() * 2**-7).all() and (p3.abs() <= p2.abs() * 2**-7).all()


@needs_interpreter
def test_interpreted_pieces_from_their_token_count(monkeypatch):
    # From PIECES_MIN_TOKENS the provider takes the pieces GEMM: the same bits as forcing it.
    x, w, bias = make_router(12, 256, 64, torch.float32, "cpu", seed=3)
    forced_config = rt.PIECES_CONFIG
    forced = rt.router_gemm(x, w, config=forced_config)
    forced_route = rt.routed_topk(x, w, bias, 8, 8, 4, True, config=forced_config)
    monkeypatch.setattr(rt, "PIECES_MIN_TOKENS", 12)
    assert torch.equal(rt.router_gemm(x, w), forced)
    got = rt.routed_topk(x, w, bias, 8, 8, 4, True)
    assert torch.equal(got[0], forced_route[0]) and torch.equal(got[1], forced_route[1])
    monkeypatch.setattr(rt, "PIECES_MIN_TOKENS", 13)
    assert not torch.equal(rt.router_gemm(x, w), forced)  # the split kernel: other sums
    check_logits(forced, x, w)
    # The readers add every K chunk's three pieces' products, in order: the same bits as
    # doing so here.
    for chunks in (1, 4):
        config = rt.PiecesConfig(k_chunks=chunks)
        part, splits = rt._launch_pieces(x, w, config)
        assert part.shape == (chunks, 12, 3 * 64) and splits == 3 * chunks
        logits = part[0, :, :64]
        for i in range(1, splits):
            logits = logits + part[i // 3, :, i % 3 * 64 : (i % 3 + 1) * 64]
        assert torch.equal(rt.router_gemm(x, w, config=config), logits)
        weights, ids = torch.empty(12, 8), torch.empty(12, 8, dtype=torch.int32)
        rt._launch_route(logits, bias, weights, ids, 8, 8, 4, True)
        routed = rt.routed_topk(x, w, bias, 8, 8, 4, True, config=config)
        assert torch.equal(routed[0], weights) and torch.equal(routed[1], ids)


@contextlib.contextmanager
def routing_by(sorted_keys: bool):
    """Route by sorted (score, index) keys, or by argmax rounds, inside the block."""
    before = rt.ROUTE_SORTED
    rt.ROUTE_SORTED = sorted_keys
    try:
        yield
    finally:
        rt.ROUTE_SORTED = before


@needs_interpreter
@pytest.mark.parametrize("sorted_keys", [True, False])
@pytest.mark.parametrize("experts", [64, 256])
def test_interpreted_routing_with_exact_ties(sorted_keys, experts):
    # Logits on a coarse grid: many exact ties in scores and group scores. Both methods
    # break them by the higher score, then the lower index. The reference's torch.topk
    # keeps no such order at exact ties (on CPU, all-equal scores give experts 172, 169,
    # ... of 256), so the comparison with it is tie-aware; the order is asserted below.
    g = torch.Generator().manual_seed(3)
    logits = (torch.randint(-4, 5, (40, experts), generator=g) * 0.5).float()
    logits[0] = 0.0  # every score equal, every group tied
    bias = torch.zeros(experts)
    weights = torch.full((40, 8), float("nan"))
    ids = torch.full((40, 8), -1, dtype=torch.int32)
    with routing_by(sorted_keys):
        rt._launch_route(logits, bias, weights, ids, 8, 8, 4, True)
    _, ref_ids = reference.grouped_topk(logits, bias, 8, 8, 4, True)
    ties = check_routing(weights, ids, logits, bias, 8, 8, 4, True, ref_ids)
    assert ties > 0
    assert ids[0].tolist() == list(range(8))  # groups 0-3 kept, their first experts, in order
    # Lower index first among equal scores: the ids of each token's equal weights ascend.
    for row_w, row_i in zip(weights.tolist(), ids.tolist()):
        for j in range(7):
            if row_w[j] == row_w[j + 1]:
                assert row_i[j] < row_i[j + 1]


@needs_interpreter
def test_interpreted_sorted_keys_order_like_floats():
    # The packed keys order as their fp32 values: signs, zeros of both signs, infinities,
    # subnormals; the ids come out by descending biased score.
    vals = [float("-inf"), -3.0, -1e-40, -0.0, 0.0, 1e-40, 2.5, float("inf")]
    logits = torch.full((1, 16), -200.0)  # sigmoid: exactly 0.0, so the bias decides
    bias = torch.zeros(16)
    bias[: len(vals)] = torch.tensor(vals)
    bias[8:] = -torch.arange(1, 9).float()
    weights = torch.empty(1, 8)
    ids = torch.empty(1, 8, dtype=torch.int32)
    with routing_by(True):
        rt._launch_route(logits, bias, weights, ids, 8, 1, 1, False)
    # 0.0 + -0.0 is 0.0: experts 3 and 4 tie (lower index first).
    assert ids[0].tolist() == [7, 6, 5, 3, 4, 2, 8, 9]


@needs_interpreter
def test_interpreted_entry_points_and_crossover(monkeypatch):
    x, w, bias = make_router(6, 256, 64, torch.float32, "cpu", seed=1)
    check_logits(rt.router_gemm(x, w), x, w)
    # One token: the few-token kernel; below TRITON_MIN_TOKENS cuBLAS (the reference) unless
    # a tiling forces the kernel.
    check_logits(rt.router_gemm(x[:1], w), x[:1], w)
    monkeypatch.setattr(rt, "TRITON_MIN_TOKENS", 2)
    assert torch.equal(rt.router_gemm(x[:1], w), reference.router_logits(x[:1], w))
    check_logits(rt.router_gemm(x[:1], w, config=SMALL_CONFIGS[0]), x[:1], w)
    monkeypatch.setattr(rt, "TRITON_MIN_TOKENS", 1)
    one = rt.routed_topk(x[:1], w, bias, 8, 8, 4, True)
    _, ref_ids = reference.routed_topk(x[:1], w, bias, 8, 8, 4, True)
    check_routing(*one, x[:1].double() @ w.double().T, bias, 8, 8, 4, True, ref_ids)
    # Above the crossover: cuBLAS logits (the reference) and the routing kernel after them.
    monkeypatch.setattr(rt, "TRITON_MAX_TOKENS", 4)
    assert torch.equal(rt.router_gemm(x, w), reference.router_logits(x, w))
    weights, ids = rt.routed_topk(x, w, bias, 8, 8, 4, True)
    _, ref_ids = reference.routed_topk(x, w, bias, 8, 8, 4, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, 8, 8, 4, True, ref_ids)
    # Experts that do not tile in powers of two: Triton logits, reference routing.
    monkeypatch.setattr(rt, "TRITON_MAX_TOKENS", 1024)
    x, w, bias = make_router(6, 256, 48, torch.float32, "cpu", seed=2)
    weights, ids = rt.routed_topk(x, w, bias, 4, 4, 2, False)
    _, ref_ids = reference.routed_topk(x, w, bias, 4, 4, 2, False)
    check_routing(weights, ids, x.double() @ w.double().T, bias, 4, 4, 2, False, ref_ids)


# --- GPU: an H200 --------------------------------------------------------------------------

gpu = pytest.mark.gpu
BEAM_TOKENS = [1, 2, 3, 8, 16, 17, 33, 64, 100, 128, 256, 1000, 1500, 8192]


@gpu
@pytest.mark.parametrize("tokens", BEAM_TOKENS)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gpu_gemm_beam_shape(tokens, weight_dtype):
    x, w, _ = make_router(tokens, 5120, 256, weight_dtype, "cuda", seed=tokens)
    check_logits(rt.router_gemm(x, w), x, w)
    if tokens <= rt.TRITON_MAX_TOKENS:
        # The Triton kernel at this count, into NaNs: every logit written.
        config = rt._gemm_config(tokens)
        logits = torch.full((tokens, 256), float("nan"), device="cuda")
        if isinstance(config, rt.SplitConfig):
            part, _ = rt._launch_split(x, w, config)
            rt._sum_splits(part, logits)
        else:
            rt._launch_gemm(x, w, logits, None, config)
        check_logits(logits, x, w)


@gpu
@pytest.mark.parametrize("hidden, experts", [(2048, 64), (7168, 256), (4096, 384), (1000, 96)])
@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
def test_gpu_gemm_other_shapes(hidden, experts, tokens):
    x, w, _ = make_router(tokens, hidden, experts, torch.float32, "cuda", seed=hidden + tokens)
    check_logits(rt.router_gemm(x, w), x, w)


GEMV_CONFIGS = [
    rt.GemvConfig(block_e=1, block_t=1, block_k=1024, num_warps=8),
    rt.GemvConfig(block_e=2, block_t=4, block_k=512, num_warps=4),
    rt.GemvConfig(block_e=1, block_t=2, block_k=4096, num_warps=8, one_shot=True),
    rt.GemvConfig(block_e=2, block_t=1, block_k=4096, num_warps=16, one_shot=True, pdl=True),
    rt.GemvConfig(2, 8, 4096, 8, one_shot=True, pdl=True, broadcast=True),
    rt.GemvConfig(4, 16, 4096, 8, one_shot=True, pdl=True, broadcast=True),
]


@gpu
@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=repr)
@pytest.mark.parametrize("hidden, experts", [(5120, 256), (7168, 256), (1000, 96)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_gpu_gemv_tilings(config, hidden, experts, tokens):
    x, w, bias = make_router(tokens, hidden, experts, torch.float32, "cuda", seed=tokens + hidden)
    logits = torch.full((tokens, experts), float("nan"), device="cuda")
    rt._launch_gemm(x, w, logits, None, config)
    check_logits(logits, x, w)
    if experts == 256:
        args = (BEAM_ROUTING["top_k"], BEAM_ROUTING["n_group"], BEAM_ROUTING["topk_group"])
        for fused in (True, False):
            weights, ids = rt.routed_topk(x, w, bias, *args, True, fused=fused, config=config)
            _, ref_ids = reference.routed_topk(x, w, bias, *args, True)
            check_routing(weights, ids, x.double() @ w.double().T, bias, *args, True, ref_ids)


SPLIT_CONFIGS = [
    rt.SplitConfig(block_e=16, k_chunk=256, num_warps=4),
    rt.SplitConfig(block_e=32, k_chunk=256, num_warps=8, max_block_t=16, pdl=False),
    rt.SplitConfig(block_e=64, k_chunk=512, num_warps=4),
]


@gpu
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=repr)
@pytest.mark.parametrize("hidden, experts", [(5120, 256), (7168, 256), (1000, 96)])
@pytest.mark.parametrize("tokens", [1, 5, 16, 33, 64])
@pytest.mark.parametrize("sorted_keys", [True, False])
def test_gpu_split_tilings(config, hidden, experts, tokens, sorted_keys):
    x, w, bias = make_router(tokens, hidden, experts, torch.float32, "cuda", seed=tokens + hidden)
    first = rt.router_gemm(x, w, config=config)
    check_logits(first, x, w)
    assert torch.equal(rt.router_gemm(x, w, config=config), first)  # a fixed order of splits
    if experts == 256:
        args = (BEAM_ROUTING["top_k"], BEAM_ROUTING["n_group"], BEAM_ROUTING["topk_group"])
        with routing_by(sorted_keys):
            weights, ids = rt.routed_topk(x, w, bias, *args, True, config=config)
        _, ref_ids = reference.routed_topk(x, w, bias, *args, True)
        check_routing(weights, ids, x.double() @ w.double().T, bias, *args, True, ref_ids)


@gpu
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, experts", [(5120, 256), (7168, 256), (1000, 96)])
@pytest.mark.parametrize("tokens", [1, 33, 256, 4096, 8192])
@pytest.mark.parametrize("k_chunks", [1, 4])
def test_gpu_pieces_gemm(weight_dtype, hidden, experts, tokens, k_chunks):
    # cuBLAS on the weight's bf16 pieces (fp32 output), forced at every token count.
    assert rt._BMM_OUT_DTYPE, "torch.bmm has no out_dtype here: the pieces path is off"
    x, w, bias = make_router(tokens, hidden, experts, weight_dtype, "cuda", seed=tokens + hidden)
    config = rt.PiecesConfig(k_chunks=k_chunks)
    first = rt.router_gemm(x, w, config=config)
    check_logits(first, x, w)
    assert torch.equal(rt.router_gemm(x, w, config=config), first)
    if experts == 256:
        args = (BEAM_ROUTING["top_k"], BEAM_ROUTING["n_group"], BEAM_ROUTING["topk_group"])
        weights, ids = rt.routed_topk(x, w, bias, *args, True, config=config)
        _, ref_ids = reference.routed_topk(x, w, bias, *args, True)
        check_routing(weights, ids, x.double() @ w.double().T, bias, *args, True, ref_ids)


@gpu
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_gpu_noncontiguous_weight_and_bias(tokens):
    # A strided weight or bias is copied per call: that launch goes without PDL (the
    # kernels read them before the wait), and the results stay the contract's.
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=tokens)
    w_t = w.t().contiguous().t()  # the same values, column-major
    bias_s = torch.stack([bias, bias], 1)[:, 0]
    assert not w_t.is_contiguous() and not bias_s.is_contiguous()
    check_logits(rt.router_gemm(x, w_t), x, w)
    weights, ids = rt.routed_topk(x, w_t, bias_s, *BEAM_ROUTING.values(), True)
    _, ref_ids = reference.routed_topk(x, w, bias, *BEAM_ROUTING.values(), True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *BEAM_ROUTING.values(), True,
                  ref_ids)  # fmt: skip


@gpu
@pytest.mark.parametrize("tokens", [4, 64, 512])
def test_gpu_gemm_is_repeatable(tokens):
    # The last program of a tile sums the split partials in a fixed order: bitwise the same
    # every run, unless the arrival counters let it read a partial before it was written.
    x, w, _ = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=9)
    first = rt.router_gemm(x, w)
    for _ in range(50):
        assert torch.equal(rt.router_gemm(x, w), first)


@gpu
@pytest.mark.parametrize("tokens", [1, 7, 16, 64, 128, 1000, 2000])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gpu_routing_beam_shape(tokens, fused, renormalize):
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=tokens)
    args = (BEAM_ROUTING["top_k"], BEAM_ROUTING["n_group"], BEAM_ROUTING["topk_group"])
    weights, ids = rt.routed_topk(x, w, bias, *args, renormalize, fused=fused)
    _, ref_ids = reference.routed_topk(x, w, bias, *args, renormalize)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *args, renormalize, ref_ids)


@gpu
def test_gpu_fused_routing_writes_every_output():
    x, w, bias = make_router(37, 5120, 256, torch.float32, "cuda", seed=4)
    logits = torch.full((37, 256), float("nan"), device="cuda")
    weights = torch.full((37, 8), float("nan"), device="cuda")
    ids = torch.full((37, 8), -1, dtype=torch.int32, device="cuda")
    rt._launch_gemm(x, w, logits, (bias, weights, ids, 8, 8, 4, True))
    check_logits(logits, x, w)
    _, ref_ids = reference.routed_topk(x, w, bias, 8, 8, 4, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, 8, 8, 4, True, ref_ids)


@gpu
@pytest.mark.parametrize("experts, routing", [(64, (6, 1, 1)), (384, (8, 8, 4)), (128, (4, 4, 2))])
def test_gpu_routing_other_shapes(experts, routing):
    x, w, bias = make_router(50, 2048, experts, torch.float32, "cuda", seed=experts)
    weights, ids = rt.routed_topk(x, w, bias, *routing, True)
    _, ref_ids = reference.routed_topk(x, w, bias, *routing, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *routing, True, ref_ids)


@gpu
@pytest.mark.parametrize("sorted_keys", [True, False])
def test_gpu_routing_with_exact_ties(sorted_keys):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randint(-4, 5, (300, 256), generator=g) * 0.5).float().cuda()
    bias = torch.zeros(256, device="cuda")
    weights = torch.full((300, 8), float("nan"), device="cuda")
    ids = torch.full((300, 8), -1, dtype=torch.int32, device="cuda")
    with routing_by(sorted_keys):
        rt._launch_route(logits, bias, weights, ids, 8, 8, 4, True)
    _, ref_ids = reference.grouped_topk(logits, bias, 8, 8, 4, True)
    assert check_routing(weights, ids, logits, bias, 8, 8, 4, True, ref_ids) > 0


@gpu
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_gpu_sorted_and_argmax_routing_agree(tokens):
    # The two methods pick by one rule (score, then lower index): the same ids and weights.
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=tokens)
    logits = rt.router_gemm(x, w)
    out = {}
    for sorted_keys in (True, False):
        weights = torch.full((tokens, 8), float("nan"), device="cuda")
        ids = torch.full((tokens, 8), -1, dtype=torch.int32, device="cuda")
        with routing_by(sorted_keys):
            rt._launch_route(logits, bias, weights, ids, 8, 8, 4, True)
        out[sorted_keys] = (weights, ids)
    assert torch.equal(out[True][1], out[False][1])
    assert torch.equal(out[True][0], out[False][0])


@gpu
def test_gpu_ops_dispatch_to_triton():
    # Past the CuTeDSL kernel's token limit (tests/kernels/test_router_cutedsl.py has below).
    x, w, bias = make_router(100, 5120, 256, torch.float32, "cuda", seed=8)
    check_logits(ops.router_gemm(x, w), x, w)
    assert ops.ROUTER_GEMM.last_provider == "triton"
    weights, ids = ops.routed_topk(x, w, bias, 8, 8, 4, True)
    assert ops.ROUTED_TOPK.last_provider == "triton"
    _, ref_ids = reference.routed_topk(x, w, bias, 8, 8, 4, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, 8, 8, 4, True, ref_ids)
