"""The CuTeDSL router kernel (`kernels/router/cutedsl.py`): logits and fused routing.

CPU (CI): the routing's sort network sorts (0-1 principle), the config choice, and the
provider's refusals (device, shapes, token count, routing layouts) with their reasons.
GPU (`-m gpu`, an H200 with nvidia-cutlass-dsl): logits within 1e-5 of fp64 and routing
equal to the reference but for near-ties (the checks of `test_router_kernels.py`), every
output written, bitwise repeatable, exact ties, CUDA graph replay, the counter left at
zero, dispatch through `beamfx.ops`, and the same routing bits whichever CTA scores the
logits.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_router_kernels import check_logits, check_routing, fake_router, make_router
from torch._subclasses.fake_tensor import FakeTensorMode

from beamfx import ops
from beamfx.kernels.router import cutedsl as rc
from beamfx.kernels.router import reference

BEAM = (8, 8, 4)  # top-k, groups, kept groups


# --- CPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_sort_network_sorts_every_input(n):
    net = rc.sort_network(n)
    for bits in itertools.product([0, 1], repeat=n):  # 0-1 principle: then any input
        v = list(bits)
        for a, b in net:
            if v[b] > v[a]:
                v[a], v[b] = v[b], v[a]
        assert v == sorted(bits, reverse=True), (n, bits)


@pytest.mark.parametrize(
    "hidden, expected",
    [(5120, (8, 4)), (7168, (8, 4)), (2048, (8, 4)), (256, (8, 1)), (96, (1, 1)), (1000, None)],
)
def test_pick_config_splits_k_into_whole_steps(hidden, expected):
    cfg = rc.pick_config(hidden)
    assert (cfg and (cfg.cluster, cfg.warps)) == expected or cfg is expected
    if cfg:
        share = hidden // (cfg.cluster * cfg.warps)
        assert share % 32 == 0 and share // 32 <= rc.MAX_STEPS


@pytest.mark.parametrize(
    "table, field, allowed",
    [("CHAINS_LOGITS", "chains", (2, 4)), ("CHAINS_ROUTED", "chains", (2, 4)),
     ("EXCHANGE_FORMS", "exchange", (0, 1, 2, 3))],
)  # fmt: skip
def test_token_tables_cover_every_count(table, field, allowed):
    # (most tokens, value) entries in rising order, the last at MAX_TOKENS: every count the
    # kernel serves takes an entry, and pick_config returns that entry's value.
    entries = getattr(rc, table)
    bounds = [most for most, _ in entries]
    assert bounds == sorted(set(bounds)) and bounds[-1] == rc.MAX_TOKENS
    assert all(value in allowed for _, value in entries)
    for routed in [table == "CHAINS_ROUTED"] if field == "chains" else [False, True]:
        for tokens in range(1, rc.MAX_TOKENS + 1):
            want = next(value for most, value in entries if tokens <= most)
            assert getattr(rc.pick_config(5120, tokens, routed), field) == want, tokens


def test_launch_refuses_an_unknown_exchange_form():
    x, w, _ = make_router(2, 5120, 256, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"Config.exchange is 4; it must be 0"):
        rc._launch(x, w, torch.empty(2, 256), config=rc.Config(exchange=4))


def test_launch_refuses_a_config_off_the_steps():
    x, w, _ = make_router(2, 5120, 256, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match=r"Config\(cluster=8, warps=8.*hidden 5120"):
        rc._launch(x, w, torch.empty(2, 256), config=rc.Config(8, 8))


def test_refuses_a_cpu_device():
    x, w, bias = fake_router(device="cpu")
    assert rc.supports_router_gemm(x, w) == "needs a CUDA device, got cpu"
    assert rc.supports_routed_topk(x, w, bias, *BEAM, True) == "needs a CUDA device, got cpu"


@pytest.mark.parametrize(
    "args, expected",
    [
        ((256, 8, 8, 4), None),
        ((64, 6, 1, 1), None),
        ((32, 4, 4, 2), None),
        ((384, 8, 8, 4), "routing in a warp needs 32, 64, 128 or 256 experts, got 384"),
        ((256, 8, 64, 4), "routing in a warp needs n_group a power of two up to 32, got 64"),
        ((256, 40, 8, 4), "top_k 40 / topk_group 4 out of range for 256 experts"),
        ((256, 8, 8, 9), "top_k 8 / topk_group 9 out of range for 256 experts"),
    ],
)
def test_routing_layouts(args, expected):
    assert rc.why_not_routing(*args) == expected


@pytest.mark.parametrize(
    "tokens, gemm, routed",
    [(1, False, True), (3, False, True), (4, True, True), (7, True, True), (8, True, True),
     (32, True, True), (33, True, True), (64, True, True), (65, False, False)],
)  # fmt: skip
def test_token_ranges_where_the_kernel_serves(tokens, gemm, routed, monkeypatch):
    monkeypatch.setattr(rc, "why_not_device", lambda device: None)  # as on a Hopper GPU
    x, w, bias = fake_router(tokens)
    assert (rc.supports_router_gemm(x, w) is None) == gemm
    assert (rc.supports_routed_topk(x, w, bias, *BEAM, True) is None) == routed


def test_routing_declines_a_bias_on_another_device(monkeypatch):
    # The kernel reads the correction bias by its address: a host tensor would be read as
    # device memory.
    monkeypatch.setattr(rc, "why_not_device", lambda device: None)  # as on a Hopper GPU
    x, w, _ = fake_router(4)
    with FakeTensorMode():
        bias = torch.empty(256, device="cpu")
    assert rc.supports_routed_topk(x, w, bias, *BEAM, True) == "correction_bias on cpu, x on cuda:0"


def test_cpu_dispatch_reports_why_cutedsl_declined():
    x, w, bias = make_router(3, 256, 64, torch.float32, "cpu", seed=0)
    ops.provider_report(reset=True)
    out = ops.router_gemm(x, w)
    torch.testing.assert_close(out, reference.router_logits(x, w))
    report = ops.provider_report(reset=True)["router_gemm"]
    assert report["provider"] == "reference"
    assert report["declined"].get("cutedsl") == "needs a CUDA device, got cpu"


# --- GPU: an H200 ---------------------------------------------------------------------------

gpu = pytest.mark.gpu


def _nan_launch(x, w, route=None, config=None):
    """The kernel into NaN-filled outputs: every element must be written."""
    logits = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")
    rc._launch(x, w, logits, route, config)
    return logits


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 9, 16, 33, 64])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_gpu_logits_beam_shape(tokens, weight_dtype):
    x, w, _ = make_router(tokens, 5120, 256, weight_dtype, "cuda", seed=tokens)
    assert rc.why_not(x, w) is None
    check_logits(_nan_launch(x, w), x, w)
    check_logits(rc.router_gemm(x, w), x, w)


@gpu
@pytest.mark.parametrize("hidden, experts", [(2048, 64), (7168, 256), (4096, 384), (256, 32)])
@pytest.mark.parametrize("tokens", [1, 17, 64])
def test_gpu_logits_other_shapes(hidden, experts, tokens):
    x, w, _ = make_router(tokens, hidden, experts, torch.float32, "cuda", seed=hidden + tokens)
    check_logits(_nan_launch(x, w), x, w)


CONFIGS = [
    rc.Config(8, 4, 2, True),
    rc.Config(8, 4, 1, True),
    rc.Config(4, 8, 2, False),
    rc.Config(8, 5, 2, True),
    rc.Config(4, 5, 1, True),
]


@gpu
@pytest.mark.parametrize("config", CONFIGS, ids=repr)
@pytest.mark.parametrize("tokens", [1, 24, 64])
def test_gpu_configs(config, tokens):
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=tokens + 1)
    first = _nan_launch(x, w, config=config)
    check_logits(first, x, w)
    assert torch.equal(_nan_launch(x, w, config=config), first)
    weights, ids = rc.routed_topk(x, w, bias, *BEAM, True, config=config)
    _, ref_ids = reference.routed_topk(x, w, bias, *BEAM, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *BEAM, True, ref_ids)


@gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_gpu_repeatable(tokens):
    # The partials meet in a fixed order: bitwise the same every call.
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=9)
    first = rc.router_gemm(x, w)
    routed = rc.routed_topk(x, w, bias, *BEAM, True)
    for _ in range(50):
        assert torch.equal(rc.router_gemm(x, w), first)
        again = rc.routed_topk(x, w, bias, *BEAM, True)
        assert torch.equal(again[0], routed[0]) and torch.equal(again[1], routed[1])


@gpu
@pytest.mark.parametrize("tokens", [1, 4, 7, 8, 16, 33, 64])
@pytest.mark.parametrize("renormalize", [True, False])
def test_gpu_routing_beam_shape(tokens, renormalize):
    x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=tokens)
    assert rc.why_not(x, w) is None
    weights = torch.full((tokens, 8), float("nan"), device="cuda")
    ids = torch.full((tokens, 8), -1, dtype=torch.int32, device="cuda")
    route = (bias, weights, ids, *BEAM, renormalize)
    logits = _nan_launch(x, w, route)
    check_logits(logits, x, w)
    _, ref_ids = reference.routed_topk(x, w, bias, *BEAM, renormalize)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *BEAM, renormalize, ref_ids)
    assert rc._counter(x.device).item() == 0, "the last cluster resets the arrival counter"


def same_bits_over_alternating_inputs(tokens, seed, call, want_cfg, got_cfg):
    # `call(x, w, bias, config)` (a tuple of outputs) with `got_cfg` gives `want_cfg`'s bits
    # over launches alternating between two inputs: a read ordered before another CTA's
    # store would find the other input's values (the allocator hands the same buffers
    # back) and give other bits.
    cases = []
    for s in (seed, seed + 100):
        x, w, bias = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=s)
        cases.append(((x, w, bias), call(x, w, bias, want_cfg)))
    assert not torch.equal(cases[0][1][0], cases[1][1][0])
    for _ in range(10):
        for args, want in cases:
            got = call(*args, got_cfg)
            assert all(torch.equal(g, e) for g, e in zip(got, want, strict=True))


def routed_call(x, w, bias, config):
    return rc.routed_topk(x, w, bias, *BEAM, True, config=config)


def logits_call(x, w, bias, config):
    return (rc.router_gemm(x, w, config=config),)


@gpu
@pytest.mark.parametrize("probe", [7, 9])
@pytest.mark.parametrize("tokens", [1, 4, 5, 16, 33, 64])
def test_gpu_same_bits_as_the_former_forms(tokens, probe):
    # The routing warp starts from the keys and sigmoids that the CTAs summing the logits
    # wrote (the default), or scores the logits itself (`probe` 7); the arrival is ordered
    # by thread 0's release and acquire and the CTA barriers (the default), or by a fence in
    # every thread as well (`probe` 9). The same operations on the same values, so the
    # same bits, on the few-token path and the cluster's.
    cfg = rc.pick_config(5120, tokens, routed=True)
    former = dataclasses.replace(cfg, probe=probe)
    same_bits_over_alternating_inputs(tokens, 40 + tokens, routed_call, former, cfg)


@gpu
@pytest.mark.parametrize("form", [1, 2, 3])
@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 4, 8, 9, 16, 24, 32, 33, 48, 63, 64])
def test_gpu_exchange_forms_same_bits(tokens, routed, form):
    # The cluster's exchange pulled (`Config.exchange` 0: a cluster barrier, then reads of
    # the peers' shared memory) or pushed (1, and 2 without the exit barrier: each warp's
    # partials sent to the CTA that sums them, async stores counted on that CTA's mbarrier;
    # 3 as 2 in 16-byte stores, a token pair a store, the odd count's padding sent too):
    # the same sums in the same order, so the same bits.
    cfg = dataclasses.replace(rc.pick_config(5120, tokens, routed=routed), exchange=0)
    pushed = dataclasses.replace(cfg, exchange=form)
    call = routed_call if routed else logits_call
    same_bits_over_alternating_inputs(tokens, 60 + tokens, call, cfg, pushed)


@gpu
@pytest.mark.parametrize(
    "hidden, experts, routing",
    [(2048, 64, (6, 1, 1)), (2048, 128, (4, 4, 2)), (256, 32, (4, 4, 2)), (7168, 256, (8, 8, 4)),
     (2048, 256, (6, 32, 8)), (1024, 128, (8, 2, 1))],
)  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 50])
def test_gpu_routing_other_shapes(hidden, experts, routing, tokens):
    x, w, bias = make_router(tokens, hidden, experts, torch.float32, "cuda", seed=experts)
    assert rc.why_not(x, w) is None and rc.why_not_routing(experts, *routing) is None
    weights, ids = rc.routed_topk(x, w, bias, *routing, True)
    _, ref_ids = reference.routed_topk(x, w, bias, *routing, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *routing, True, ref_ids)


@gpu
def test_gpu_routing_with_exact_ties():
    # Duplicated weight rows: equal logits, so exact ties inside and across groups.
    x, w, _ = make_router(40, 5120, 256, torch.float32, "cuda", seed=3)
    w = w[torch.arange(256, device="cuda") % 24].contiguous()
    bias = torch.zeros(256, device="cuda")
    weights, ids = rc.routed_topk(x, w, bias, *BEAM, True)
    logits = x.double() @ w.double().T
    _, ref_ids = reference.grouped_topk(logits.float(), bias, *BEAM, True)
    assert check_routing(weights, ids, logits, bias, *BEAM, True, ref_ids) > 0


@gpu
@pytest.mark.parametrize("tokens", [8, 24])
def test_gpu_cuda_graph_replay(tokens):
    # 24 tokens: a token tile count first compiled while capturing (as vLLM's capture of
    # batch sizes its warm-up did not run).
    x, w, bias = make_router(8, 5120, 256, torch.float32, "cuda", seed=5)
    rc.routed_topk(x, w, bias, *BEAM, True)  # allocates the counter
    static, _, _ = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rc.routed_topk(static, w, bias, *BEAM, True)
        logits = rc.router_gemm(static, w)
    for seed in range(3):
        fresh, _, _ = make_router(tokens, 5120, 256, torch.float32, "cuda", seed=100 + seed)
        static.copy_(fresh)
        graph.replay()
        eager = rc.routed_topk(fresh, w, bias, *BEAM, True)
        assert torch.equal(out[1], eager[1]) and torch.equal(out[0], eager[0])
        assert torch.equal(logits, rc.router_gemm(fresh, w))
    assert rc._counter(x.device).item() == 0


@gpu
def test_gpu_ops_dispatch_to_cutedsl():
    x, w, bias = make_router(16, 5120, 256, torch.float32, "cuda", seed=8)
    check_logits(ops.router_gemm(x, w), x, w)
    assert ops.ROUTER_GEMM.last_provider == "cutedsl"
    weights, ids = ops.routed_topk(x, w, bias, *BEAM, True)
    assert ops.ROUTED_TOPK.last_provider == "cutedsl"
    _, ref_ids = reference.routed_topk(x, w, bias, *BEAM, True)
    check_routing(weights, ids, x.double() @ w.double().T, bias, *BEAM, True, ref_ids)
    # Where Triton is faster, Triton serves, and the report says why.
    x, w, bias = make_router(65, 5120, 256, torch.float32, "cuda", seed=8)
    ops.routed_topk(x, w, bias, *BEAM, True)
    assert ops.ROUTED_TOPK.last_provider == "triton"
    reason = "serves 1 to 64 tokens (Triton is faster outside), got 65"
    assert ops.ROUTED_TOPK.last_declined["cutedsl"] == reason
