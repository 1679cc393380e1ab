"""The MoE expert kernels (Triton, torch._grouped_mm, FlashInfer wiring) against the references.

Tolerances (norm-wise relative error against `kernels/moe/reference.py`, outputs in bf16):
- bf16 weights: <= 4e-3. Same math; fp32 sums in another order, so a bf16 rounding can flip.
- NVFP4 weights: <= 1.2e-2. The reference rounds each dequantized weight to bf16
  (`e2m1 * scale * global`); the kernels multiply exact bf16 `e2m1 * scale` and apply the
  fp32 global scale after the dot. Against an fp64 model of the same weights the kernels
  must be no less accurate than the reference (within 10%).
Every output element must be written: outputs land in NaN-poisoned memory.

CPU (CI): the kernels under Triton's interpreter in a subprocess (both row-finding paths,
both weight formats, rows and combined outputs), grouped_mm's fallback on CPU, supports()
and FlashInfer's gating and layout. GPU (`-m gpu`, an H200): random shapes up to Beam's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from beamfx.kernels.moe import cutedsl as cd
from beamfx.kernels.moe import flashinfer as fi
from beamfx.kernels.moe import grouped, nvfp4
from beamfx.kernels.moe import reference as ref
from beamfx.testing import examples

tk = pytest.importorskip("beamfx.kernels.moe.triton")
no_triton = pytest.mark.skipif(tk.triton is None, reason="triton not installed")
TOL_BF16, TOL_NVFP4 = 4e-3, 1.2e-2


def make_moe(tokens, hidden, inter, experts, top_k, device, seed):
    """Random inputs and ModelOpt-quantized experts; the bf16 weights are their dequantization."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g, device=device) / inter**0.5
    scores = torch.rand(tokens, experts, generator=g, device=device)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=g, device=device)
    q = nvfp4.quantize_experts(w13, w2)
    del w13, w2
    w13b, w2b = q.dequantize(torch.bfloat16)
    return x, ids, weights, q, w13b, w2b


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    assert not out.isnan().any(), "output element left unwritten (NaN poison survived)"
    return ((out.double() - want.double()).norm() / want.double().norm()).item()


def poison(device) -> None:
    """Fill free cached memory with NaN so that an unwritten output element shows."""
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        block = torch.empty(min(free // 4, 1 << 30) // 4, device=device).fill_(float("nan"))
        del block


def check_case(tokens, hidden, inter, experts, top_k, fp4, combine, device, seed, config=None):
    x, ids, wt, q, w13b, w2b = make_moe(tokens, hidden, inter, experts, top_k, device, seed)
    scales = (q.w13_scale, q.w13_global, q.w2_scale, q.w2_global) if fp4 else None
    w13, w2 = (q.w13, q.w2) if fp4 else (w13b, w2b)
    poison(device)
    if combine:
        out = tk.moe(x, ids, w13, w2, scales, wt, 1.5, config=config)
        want = ref.mega_moe(x, wt, ids, w13b, w2b, 1.5)  # = the NVFP4 reference's math
    else:
        out = tk.moe(x, ids, w13, w2, scales, config=config)
        want = ref.moe_experts(x, w13b, w2b, ids)
    err = rel_err(out, want)
    assert err <= (TOL_NVFP4 if fp4 else TOL_BF16), f"relative error {err:.2e}"
    if fp4 and combine:  # no less accurate than the reference against fp64 weights
        w13d, w2d = q.dequantize(torch.float64)
        exact = ref.mega_moe(x.double(), wt.double(), ids, w13d, w2d, 1.5)
        assert rel_err(out, exact) <= 1.1 * rel_err(want, exact) + 1e-4
    return err


def test_reference_gives_pairs_on_no_expert_zero_rows():
    """Ids -1 and E (no expert of this rank): zero rows, the other pairs as before. Before,
    -1 indexed the last expert and E raised an IndexError."""
    x, ids, wt, _, w13, w2 = make_moe(5, 64, 32, 4, 3, "cpu", 0)
    cut = ids.clone()
    cut[::2, 0], cut[1::2, 2] = -1, 4
    rows, want = ref.moe_experts(x, w13, w2, cut), ref.moe_experts(x, w13, w2, ids)
    off = (cut < 0) | (cut >= 4)
    assert rows[off].eq(0).all() and torch.equal(rows[~off], want[~off])
    # Through the sorted blocks (Triton's interpreter or the torch ops): the same pairs drop.
    order, blocks = tk.sort_blocks_torch(cut.reshape(-1), 4, 8)
    covered = {int(order[i]) for e, a, b in blocks.tolist() if e >= 0 for i in range(a, b)}
    assert covered == set((~off).reshape(-1).nonzero().reshape(-1).tolist())


# --- CPU: the kernels under Triton's interpreter ------------------------------------------

_INTERPRETER_CASES = [
    # tokens, hidden, inter, experts, top_k, fp4, combine, scan, NVFP4 decode
    (1, 64, 32, 4, 2, True, True, True, 0),
    (1, 64, 32, 4, 2, True, True, True, 1),
    (7, 64, 64, 8, 3, True, True, True, 1),
    (5, 128, 32, 6, 2, False, True, True, 0),
    (9, 64, 32, 8, 2, True, False, True, 0),
    (9, 128, 64, 8, 2, True, False, True, 1),
    (40, 64, 32, 4, 4, True, True, False, 0),
    (33, 128, 64, 16, 2, False, False, False, 0),
    (20, 64, 32, 8, 8, True, True, False, 1),
    # NVFP4 in fp32 FMAs (decode "fma"): K steps wider and narrower than the rows
    (1, 64, 32, 4, 2, True, True, True, "fma"),
    (3, 128, 64, 8, 4, True, False, True, "fma"),
    (9, 256, 32, 8, 2, True, True, True, "fma"),
    (2, 192, 48, 8, 3, True, True, True, "fma"),  # partial row tile and K step, odd k
    # the combine as k bf16 rows and a finalize launch, no fp32 atomics (sorted blocks)
    (40, 64, 32, 4, 4, True, True, False, "rows"),
    (33, 128, 64, 16, 3, False, True, False, "rows"),
    # bf16 sorted blocks with the wide tiles (>= 128 rows an expert, 1024 wide)
    (520, 256, 1024, 2, 2, False, True, False, "wide"),
    # the tiles `pick_config` chooses (FMA at these sizes): no config given
    (2, 128, 64, 8, 4, True, True, True, "default"),
    (1, 64, 1024, 4, 1, True, False, True, "default"),
]


def _interpreter_main() -> None:
    for i, (t, h, inter, e, k, fp4, combine, scan, decode) in enumerate(_INTERPRETER_CASES):
        base = tk.mma_config(1 if scan else 10**6, h, inter, fp4)
        if decode == "fma":
            cfg = tk.Config(scan, 16, 32, 64, 32, 64, fma=True)
        elif decode == "rows":
            cfg = tk.Config(scan, 16, base.bn1, base.bk1, base.bn2, base.bk2, combine_rows=True)
        elif decode == "wide":
            cfg = tk.mma_config(t * k, h, inter, fp4, e)
            assert (cfg.bm, cfg.bn1, cfg.bn2) == (128, 128, 256), cfg
        elif decode == "default":
            assert tk.pick_config(t * k, h, inter, fp4).fma, "meant to cover the FMA defaults"
            cfg = None
        else:
            cfg = tk.Config(scan, 16, base.bn1, base.bk1, base.bn2, base.bk2, decode=decode)
        err = check_case(t, h, inter, e, k, fp4, combine, "cpu", seed=i, config=cfg)
        print(f"case {i}: relative error {err:.2e}")


@no_triton
def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    code = "import tests.kernels.test_moe_kernels as t; t._interpreter_main()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("relative error") == len(_INTERPRETER_CASES)


def check_sort_blocks(order, blocks, ids, experts, bm):
    """Every pair with a valid id in exactly one block of its expert, in stable order; no
    block over bm rows; blocks past the last real one (-1, 0, 0)."""
    seen, real = [], True
    for e, start, end in blocks.tolist():
        if e < 0:
            assert (start, end) == (0, 0)
            real = False
            continue
        assert real, "a real block after a padding one"
        rows = order[start : min(end, start + bm)].long()
        assert (ids[rows] == e).all() and (rows.diff() > 0).all()
        seen += rows.tolist()
    assert sorted(seen) == [i for i, e in enumerate(ids.tolist()) if 0 <= e < experts]


def test_sort_blocks_covers_every_pair_once():
    g = torch.Generator().manual_seed(0)
    for experts, bm, pairs in [(4, 4, 10), (16, 8, 3), (8, 16, 100), (256, 64, 4096)]:
        ids = torch.randint(0, experts, (pairs,), generator=g, dtype=torch.int32)
        ids[::7] = torch.tensor([-1, experts], dtype=torch.int32).repeat(pairs)[: ids[::7].numel()]
        order, blocks = tk.sort_blocks_torch(ids, experts, bm)
        check_sort_blocks(order, blocks, ids, experts, bm)


@no_triton
@pytest.mark.skipif(tk._INTERPRET, reason="the GPU's dispatch, outside the interpreter")
def test_sort_path_on_the_gpu(monkeypatch):
    """Which sort a CUDA tensor gets (fake CUDA tensors: no GPU needed): one program for one
    chunk, the chunked launches while their table fits, then torch; with the chunked
    launches turned off, one program to SORT_ONE_PROGRAM_PAIRS."""
    with FakeTensorMode():
        ids = {
            n: torch.empty(n, dtype=torch.int32, device="cuda")
            for n in (64, 1024, 1025, 4096, 4097)
        }
        big = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
        bigger = torch.empty((1 << 16) + 1, dtype=torch.int32, device="cuda")
        most = torch.empty(1 << 17, dtype=torch.int32, device="cuda")
    assert tk.sort_path(ids[64], 256) == tk.sort_path(ids[1024], 256) == "one program"
    assert tk.sort_path(ids[1025], 256) == tk.sort_path(big, 256) == "chunked"
    assert tk.sort_path(bigger, 256) == "torch"  # the (chunk, bin) table would not fit
    assert tk.sort_path(most, 8) == "chunked" and tk.sort_path(bigger, 8) == "chunked"
    assert tk.sort_path(torch.empty((1 << 17) + 1, device="meta"), 8) == "torch"  # chunks
    assert tk.sort_path(ids[64], 1025) == "torch"  # too many experts
    assert tk.sort_path(torch.empty(64, dtype=torch.int32), 256) == "torch"  # CPU
    monkeypatch.setattr(tk, "SORT_CHUNKED_ON_GPU", False)
    assert tk.sort_path(ids[1025], 256) == tk.sort_path(ids[4096], 256) == "one program"
    assert tk.sort_path(ids[4097], 256) == tk.sort_path(big, 256) == "torch"


@no_triton
def test_sort_blocks_kernels_under_interpreter():
    """The Triton sorts (Triton's interpreter) give the torch ops' tensors exactly: one
    program, and the three chunked launches (chunks of 64 pairs here, so that the
    interpreter's slow `tl.sort` sees many chunks in little time)."""
    code = (
        "import tests.kernels.test_moe_kernels as t\n"
        "for e, bm, n, hi, path in t.SORT_CASES: print(t.sort_case(e, bm, n, hi, 'cpu', path))"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.split() == [c[-1].replace(" ", "-") for c in SORT_CASES], run.stdout


SORT_CASES = [  # experts, block rows, pairs, ids below this (>= experts: no expert), path
    (1, 8, 1, 1, "one program"), (4, 4, 10, 4, "one program"), (16, 8, 3, 16, "one program"),
    (8, 16, 100, 9, "one program"), (256, 8, 512, 256, "one program"),
    (256, 8, 64, 2, "one program"), (255, 64, 300, 255, "one program"),
    (1024, 8, 33, 1030, "one program"), (3, 128, 1040, 3, "chunked"),
    (256, 8, 700, 257, "chunked"), (5, 8, 65, 6, "chunked"), (300, 64, 2000, 301, "chunked"),
    (2, 8, 129, 3, "chunked"),
]  # fmt: skip


def sort_case(experts, bm, pairs, hi, device, path, seed=0):
    """Ids drawn from [0, hi), or from [-1, experts] when hi > experts (-1 and experts: in no
    block). Under the interpreter, chunks of 64 pairs from 65 pairs on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1 if hi > experts else 0, hi, (pairs,), generator=g, dtype=torch.int32)
    ids = ids.clamp(max=experts)
    ids = ids.to(device)
    if device == "cpu" and path == "chunked":
        tk.SORT_ONE_PROGRAM_PAIRS = tk.SORT_CHUNK = 64
    assert tk.sort_path(ids, experts) == path
    order, blocks = tk.sort_blocks(ids, experts, bm)
    want = tk.sort_blocks_torch(ids, experts, bm)
    assert torch.equal(order, want[0]) and torch.equal(blocks, want[1]), (experts, bm, pairs)
    check_sort_blocks(order.cpu(), blocks.cpu(), ids.cpu(), experts, bm)
    return path.replace(" ", "-")


# --- CPU: grouped_mm path, provider gating ------------------------------------------------


@given(
    tokens=st.integers(1, 12),
    experts=st.integers(1, 8),
    top_k=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(10))
def test_grouped_mm_matches_reference(tokens, experts, top_k, seed):
    top_k = min(top_k, experts)
    x, ids, wt, _, w13, w2 = make_moe(tokens, 64, 32, experts, top_k, "cpu", seed)
    got = grouped.mega_moe(x, wt, ids, w13, w2, 2.0)
    assert rel_err(got, ref.mega_moe(x, wt, ids, w13, w2, 2.0)) <= TOL_BF16


def test_grouped_mm_gives_zero_rows_where_the_reference_does():
    """No pairs, and ids outside [0, E) (vLLM's -1: an expert on another rank): the rows
    view of zero pairs raised, and an id of -1 took expert 0's rows."""
    x, ids, wt, _, w13, w2 = make_moe(6, 64, 32, 4, 2, "cpu", 5)
    assert grouped.moe_experts(x[:0], w13, w2, ids[:0]).shape == (0, 2, 64)
    ids = ids.clone()
    ids[0, 0], ids[2, 1], ids[3, 0] = -1, 4, 7
    got = grouped.moe_experts(x, w13, w2, ids)
    want = ref.moe_experts(x, w13, w2, ids)
    assert torch.equal(got[0, 0], torch.zeros(64, dtype=x.dtype)) and torch.equal(
        got[2, 1], torch.zeros(64, dtype=x.dtype))  # fmt: skip
    assert rel_err(got, want) <= TOL_BF16


def test_supports_reasons_on_fake_and_cpu_tensors():
    with FakeTensorMode():
        x = torch.empty(4, 256, dtype=torch.bfloat16)
        ids = torch.empty(4, 2, dtype=torch.int32)
        w13 = torch.empty(8, 128, 128, dtype=torch.uint8)
        w2 = torch.empty(8, 256, 32, dtype=torch.uint8)
        s = torch.empty(1)
        reason = tk.supports_mega_moe_nvfp4(x, torch.empty(4, 2), ids, w13, s, s, w2, s, s, 1.0)
        assert reason is not None and "CUDA" in reason
        assert "CUDA" in grouped.MEGA_MOE.supports(x, None, ids, w13, w2, 1.0)
        assert fi.MEGA_MOE_NVFP4.supports(x, None, ids, w13, s, s, w2, s, s, 1.0) is not None
    x = torch.zeros(2, 64, dtype=torch.float32)
    assert (
        tk.supports_moe_experts(x, torch.zeros(2, 64, 64), torch.zeros(2, 64, 32), ids) is not None
    )


def _as_if_on_a_gpu(monkeypatch):
    """Every NVFP4 provider's device gate passed (Triton as under its interpreter), so that
    what their `supports` say next, the layout checks, runs here."""
    monkeypatch.setattr(tk, "_INTERPRET", True)
    monkeypatch.setattr(cd, "why_not_device", lambda device: None)
    monkeypatch.setattr(fi, "why_not_device", lambda device: None)
    return {
        "triton": tk.supports_mega_moe_nvfp4,
        "cutedsl": cd.supports_mega_moe_nvfp4,
        "flashinfer": fi.supports_mega_moe_nvfp4,
    }


def _strided_last(s):
    wide = torch.zeros(*s.shape[:-1], 2 * s.shape[-1], dtype=s.dtype)
    wide[..., ::2] = s
    return wide[..., ::2]


LAYOUT_CASES = {  # what the reference takes or rejects and a kernel would misread
    "fp32 block scales": (lambda t: {1: t[1].float()}, "needs float8_e4m3fn w13_scale"),
    "bf16 block scales": (lambda t: {4: t[4].bfloat16()}, "needs float8_e4m3fn w2_scale"),
    "strided block scales": (lambda t: {1: _strided_last(t[1])}, "contiguous along K"),
    "w13 for another hidden": (lambda t: {0: t[0][:, :, :64]}, "needs w13 (4, 256, 128)"),
    "w2 for another inter": (lambda t: {3: t[3].repeat(1, 1, 2)}, "needs w13 (4, 256, 128)"),
    "one w13 global an expert": (lambda t: {2: t[2][:, 0]}, "needs w13_global [4, 2]"),
    "w13 scale of another shape": (lambda t: {1: t[1][:, :128]}, "needs w13_scale (4, 256, 16)"),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("provider", ["triton", "cutedsl", "flashinfer"])
def test_nvfp4_providers_decline_layouts_they_would_misread(case, provider, monkeypatch):
    """A provider whose `supports` says yes must read the tensors as the reference does;
    where the layout differs (the scales in another float dtype or stride, weights or
    globals of other shapes), it declines, and the reference serves or names the error."""
    supports = _as_if_on_a_gpu(monkeypatch)[provider]
    x, ids, wt, q, _, _ = make_moe(3, 256, 128, 4, 2, "cpu", seed=5)
    good = list(q.tensors())
    good[2] = good[2][:, :1].expand(-1, 2).contiguous()  # FlashInfer: gate and up share theirs
    assert supports(x, wt, ids, *good, 1.0) is None
    change, want = LAYOUT_CASES[case]
    bad = list(good)
    for i, t in change(good).items():
        bad[i] = t
    reason = supports(x, wt, ids, *bad, 1.0)
    assert reason is not None and want in reason, reason


def test_flashinfer_declines_differing_gate_up_globals(monkeypatch):
    """FlashInfer's FC1 takes one global scale an expert: experts whose gate and up scales
    differ are declined by `supports` (the next provider serves), not refused mid-call."""
    supports = _as_if_on_a_gpu(monkeypatch)["flashinfer"]
    x, ids, wt, q, _, _ = make_moe(3, 256, 128, 4, 2, "cpu", seed=5)
    assert not torch.equal(q.w13_global[:, 0], q.w13_global[:, 1])
    reason = supports(x, wt, ids, *q.tensors(), 1.0)
    assert reason is not None and "gate and up scales differ" in reason
    shared = q.w13_global[:, :1].expand(-1, 2).contiguous()
    assert supports(x, wt, ids, q.w13, q.w13_scale, shared, *q.tensors()[3:], 1.0) is None


def test_nvfp4_weights_must_be_word_aligned():
    """The NVFP4 kernels read codes as 32-bit words: a misaligned view is refused, not read."""
    storage = torch.zeros(4 * 64 * 33 + 1, dtype=torch.uint8)
    ok = storage[: 4 * 64 * 32].view(4, 64, 32)
    assert tk._why_not_weights(True, ok, ok) is None
    shifted = storage[1 : 1 + 4 * 64 * 32].view(4, 64, 32)
    reason = tk._why_not_weights(True, shifted, ok)
    assert "w13" in reason and "address offset 1" in reason and ".contiguous()" in reason
    odd_rows = storage[: 4 * 64 * 33].view(4, 64, 33)[:, :, :32]  # row stride 33 bytes
    assert "(2112, 33, 1)" in tk._why_not_weights(True, ok, odd_rows)


@pytest.mark.filterwarnings("error")  # a fake tensor's data_ptr(): a warning here, an error
def test_nvfp4_weight_check_runs_on_fake_tensors():  # on CUDA fake tensors (torch 2.11)
    """The passes ask providers' supports() while compiling, on fake tensors, which have no
    address: the check reads the storage offset there instead of failing the compile."""
    with FakeTensorMode():
        w = torch.empty(4 * 64 * 32 + 4, dtype=torch.uint8)
        ok = w[: 4 * 64 * 32].view(4, 64, 32)
        assert tk._why_not_weights(True, ok, ok) is None
        shifted = w[2 : 2 + 4 * 64 * 32].view(4, 64, 32)
        assert "address offset 2" in tk._why_not_weights(True, ok, shifted)


def test_flashinfer_gating_needs_sm100_and_the_library(monkeypatch):
    """It cannot run here (no Blackwell GPU is lent): test the gate, not the kernel."""
    assert "CUDA" in fi.why_not_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert "Blackwell" in fi.why_not_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0))
    monkeypatch.setattr(fi, "_flashinfer_moe", lambda: (None, "FlashInfer ... does not import"))
    assert "import" in fi.why_not_device(torch.device("cuda", 0))
    monkeypatch.setattr(fi, "_flashinfer_moe", lambda: (object(), None))
    assert fi.why_not_device(torch.device("cuda", 0)) is None


def test_flashinfer_layout_conversion():
    g = torch.Generator().manual_seed(0)
    e, inter, k16 = 2, 128, 20
    w13 = torch.arange(e * 2 * inter, dtype=torch.int32).reshape(e, 2 * inter, 1)
    mixed = fi.interleave_up_gate(w13)
    # rows 0:64 are up 0:64, rows 64:128 gate 0:64, rows 128:192 up 64:128, ...
    assert torch.equal(mixed[:, :64], w13[:, inter : inter + 64])
    assert torch.equal(mixed[:, 64:128], w13[:, :64])
    assert torch.equal(mixed[:, 128:192], w13[:, inter + 64 : inter + 128])
    scale = torch.randint(0, 120, (e, 200, k16), generator=g, dtype=torch.uint8)
    scale = scale.view(torch.float8_e4m3fn)
    sw = fi.swizzle_block_scales(scale)
    assert sw.shape == (e, 256 * 20)
    back = fi.unswizzle_block_scales(sw, 200, k16)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))
    # row m, column c at (m // 128, c // 4, m % 32, (m % 128) // 32, c % 4)
    m, c = 165, 9
    flat = (((m // 128) * 5 + c // 4) * 32 + m % 32) * 16 + ((m % 128) // 32) * 4 + c % 4
    assert sw.view(torch.uint8)[1, flat] == scale.view(torch.uint8)[1, m, c]


def test_flashinfer_refuses_differing_gate_up_globals():
    q = nvfp4.quantize_experts(torch.randn(2, 128, 64), torch.randn(2, 64, 64))
    with pytest.raises(ValueError, match="global scale"):
        fi.to_flashinfer_layout(*q.tensors())


# --- GPU: an H200 -------------------------------------------------------------------------

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def config_for(pairs, hidden, inter, fp4, decode, experts=0):
    if decode == "fma":
        return tk.fma_config(inter)
    base = tk.mma_config(pairs, hidden, inter, fp4, experts)
    if decode == "rows":
        return replace(base, combine_rows=True)
    if decode == "atomics":
        return replace(base, combine_rows=False)
    return replace(base, decode=decode)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "fp4, decode",
    [
        (True, 0),
        (True, 1),
        (True, "fma"),
        (True, "rows"),
        (True, "atomics"),
        (False, 0),
        (False, "rows"),
        (False, "atomics"),
    ],  # fmt: skip
)
@pytest.mark.parametrize(
    "tokens, hidden, inter, experts, top_k",
    [
        (1, 5120, 192, 256, 8),  # Beam-1.0-shaped, TP8 decode
        (8, 5120, 1536, 32, 8),  # Beam-1.0 dims (fewer experts), TP1
        (64, 1024, 192, 64, 8),
        (300, 512, 256, 32, 4),  # sorted blocks (> 1024 pairs)
        (1000, 256, 64, 8, 2),  # sorted blocks, hot experts
        (1100, 512, 1024, 8, 2),  # bf16: the wide tiles (>= 128 rows an expert)
    ],
)
def test_kernels_match_reference_gpu(tokens, hidden, inter, experts, top_k, fp4, decode):
    cfg = config_for(tokens * top_k, hidden, inter, fp4, decode, experts)
    for combine in (True, False):
        check_case(tokens, hidden, inter, experts, top_k, fp4, combine, "cuda", tokens, cfg)


@gpu
@needs_cuda
@given(
    tokens=st.integers(1, 600),
    hidden=st.sampled_from([256, 512, 1024]),
    inter=st.sampled_from([64, 96, 192, 256]),
    experts=st.integers(2, 64),
    top_k=st.integers(1, 8),
    fp4=st.booleans(),
    decode=st.sampled_from([0, 1, "fma", "rows"]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=examples(12))
def test_kernels_random_shapes_gpu(tokens, hidden, inter, experts, top_k, fp4, decode, seed):
    top_k = min(top_k, experts)
    fp4 = fp4 or decode == "fma"
    cfg = config_for(tokens * top_k, hidden, inter, fp4, decode)
    check_case(tokens, hidden, inter, experts, top_k, fp4, True, "cuda", seed, cfg)


@gpu
@needs_cuda
def test_combine_is_repeatable_gpu():
    """Atomic combine: results may differ in fp32 rounding only (no race, no lost rows)."""
    x, ids, wt, q, *_ = make_moe(64, 1024, 192, 32, 8, "cuda", 3)
    scales = (q.w13_scale, q.w13_global, q.w2_scale, q.w2_global)
    outs = [tk.moe(x, ids, q.w13, q.w2, scales, wt, 1.0).float() for _ in range(5)]
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() <= 2 * outs[0].abs().max() * 2**-8


@gpu
@needs_cuda
@settings(deadline=None, max_examples=examples(40))
@given(
    experts=st.sampled_from([1, 8, 256, 257, 1024]),
    bm=st.sampled_from([8, 64, 128]),
    pairs=st.one_of(st.integers(1, tk.SORT_ONE_PROGRAM_PAIRS), st.integers(1, 1 << 17)),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sort_blocks_kernels_gpu(experts, bm, pairs, chunked, seed):
    """Either Triton sort (the chunked one on or off) against the torch ops."""
    old, tk.SORT_CHUNKED_ON_GPU = tk.SORT_CHUNKED_ON_GPU, chunked
    try:
        path = tk.sort_path(torch.empty(pairs, device="cuda"), experts)
        if path != "torch":
            sort_case(experts, bm, pairs, experts + 1, "cuda", path, seed)
    finally:
        tk.SORT_CHUNKED_ON_GPU = old


def largest_chunked_sort(experts):
    """The most pairs `sort_path` gives the chunked sort at this many experts."""
    c = 1
    while 2 * c <= tk.SORT_MAX_CHUNKS and 2 * c * tk._sort_bins_pad(experts) <= tk.SORT_TABLE_CELLS:
        c *= 2
    return c * tk.SORT_CHUNK


@gpu
@needs_cuda
@pytest.mark.parametrize("experts", [1, 8, 256, 257, 512, 1024])
@pytest.mark.parametrize("bm", [8, 128])
def test_sort_chunked_at_its_limits_gpu(experts, bm):
    """The chunked sort at the most pairs it takes compiles (the table's shared memory) and
    gives the torch ops' tensors; one pair more goes to the torch ops."""
    pairs = largest_chunked_sort(experts)
    sort_case(experts, bm, pairs, experts + 1, "cuda", "chunked")
    assert tk.sort_path(torch.empty(pairs + 1, device="cuda"), experts) == "torch"


@gpu
@needs_cuda
def test_grouped_mm_gpu():
    x, ids, wt, _, w13, w2 = make_moe(64, 1024, 192, 32, 8, "cuda", 4)
    assert grouped.MEGA_MOE.supports(x, wt, ids, w13, w2, 1.0) is None
    err = rel_err(
        grouped.mega_moe(x, wt, ids, w13, w2, 1.0), ref.mega_moe(x, wt, ids, w13, w2, 1.0)
    )
    assert err <= TOL_BF16
