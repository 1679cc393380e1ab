"""`beamfx vllm-demo`: a tiny Beam checkpoint served by vLLM, beamfx's passes on and off.

Generates greedily with `vllm.LLM` twice in one process (every beamfx pass, then none: the
same compile pipeline, canonicalize and lower only) and checks that the tokens are
identical, that each pass matched what it should per layer, and that every token is the
plain eager model's choice (`beamfx.models.beam`, fed vLLM's tokens) up to a bf16 near-tie.
Runs on vLLM's CPU build in a minute or two per engine; vLLM is imported only by `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

# A token vLLM chose may trail the plain model's choice by this many logits: activations
# are bf16, and vLLM's attention kernel and Inductor's fused code round differently from
# the eager SDPA path. Such a difference can also flip a routing near-tie (a prompt token
# of the tiny checkpoint has its 8th and 9th experts 7e-3 apart), and a token routed to
# another expert moves the logits after it by up to ~0.3. Measured on the tiny checkpoint
# (seed 0, fp32 router in both): gaps of 0.124 and 0.016, every other token the same.
NEAR_TIE_LOGITS = 0.25
INDUCTOR = {
    # Keep the contract's bf16 roundings in Inductor's own fused code too, so the graphs
    # with and without the fusions compute the same bits: without it, Inductor drops
    # intermediate roundings that the fused ops keep, and near-tie tokens can flip.
    "emulate_precision_casts": True,
    # A fresh compile, so the report shows the passes at work rather than a cache hit.
    "fx_graph_cache": False,
}
# Small enough for a laptop or a 2-core CI machine; the tiny preset allows 1024 positions.
ENGINE = dict(
    dtype="bfloat16",
    max_model_len=128,
    max_num_batched_tokens=128,
    kv_cache_memory_bytes=64 << 20,
    seed=0,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint", help="a Beam checkpoint folder (default: write the tiny one first)"
    )
    parser.add_argument("--out", help="where to write the tiny checkpoint (default: temporary)")
    parser.add_argument("--passes", default="all", help="beamfx passes for the 'on' run")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt")
    parser.add_argument("--seed", type=int, default=0, help="weights and prompts seed")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (CPU: gloo)")
    parser.add_argument("--json", help="write the results here as JSON")


def expected_matches(cfg) -> dict[str, int]:
    """Matches per compiled whole-model graph: two boundaries and one gate per layer, one
    router and one MegaMoE per sparse layer. (vLLM's CPU build compiles Beam as one graph.)"""
    layers = cfg.num_hidden_layers
    sparse = cfg.mlp_layer_types.count("sparse")
    return {"boundary": 2 * layers, "attn_gate": layers, "router_gemm": sparse, "mega_moe": sparse}


def prompts_for(cfg, seed: int) -> list[list[int]]:
    """One prompt longer than the sliding window, one that crosses it while decoding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = (cfg.sliding_window + 4, max(2, cfg.sliding_window - 3))
    return [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def generate(
    checkpoint: str, passes, prompts: list[list[int]], tokens: int, tp: int = 1
) -> dict[str, Any]:
    """Greedy tokens from a `vllm.LLM` running beamfx `passes`, and rank 0's report."""
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from beamfx.integrations.vllm import REPORT_ENV, compilation_config, engine_pass

    config = compilation_config(passes, inductor_compile_config=INDUCTOR)
    with tempfile.TemporaryDirectory(prefix="beamfx-report-") as scratch:
        # The report as every engine writes it, in this process or in TP workers.
        os.environ[REPORT_ENV] = report_path = os.path.join(scratch, "report.json")
        start = time.perf_counter()
        llm = LLM(
            model=checkpoint,
            compilation_config=config,
            max_num_seqs=len(prompts),
            tensor_parallel_size=tp,
            **ENGINE,
        )
        started = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0),
            use_tqdm=False,
        )
        done = time.perf_counter()
        with open(report_path) as f:
            report = json.load(f)
        if tp == 1:  # the engine runs in this process: its pass object holds the same report
            held = engine_pass(llm).summary()["matches"]
            if held != report["matches"]:
                raise RuntimeError(f"{REPORT_ENV} holds {report['matches']}, the pass {held}")
        del llm
        cleanup_dist_env_and_memory()
    return {
        "compilation_config": config,
        "tensor_parallel_size": tp,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # The chosen tokens' log-probabilities: equal bits with and without the fusions.
        "logprobs": [
            [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
            for o in outputs
        ],
        "report": report,
        "start_seconds": round(started - start, 1),
        "generate_seconds": round(done - started, 1),
    }


def plain_agreement(checkpoint: str, prompts: list[list[int]], outputs: list[list[int]]):
    """How vLLM's tokens compare with the plain eager model on the same checkpoint.

    `gaps[i][j]`: the plain model's best logit minus its logit for vLLM's token j of prompt
    i, fed vLLM's tokens before it (0 where vLLM took the plain model's argmax).
    `greedy`: the plain model's own greedy tokens; `greedy_unwindowed`: the same with the
    sliding window taken away (they differ when the prompts exercise the window).
    """
    import torch

    from beamfx.checkpoint import load_checkpoint

    model = load_checkpoint(checkpoint).eval()

    def greedy(prompt: list[int], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        return ids[len(prompt) :]

    gaps = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            logits = model(torch.tensor([prompt + out]))[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
            gaps.append([round(g, 4) for g in (logits.max(-1).values - chosen).tolist()])
        windowed = [greedy(p, len(o)) for p, o in zip(prompts, outputs)]
        for layer in model.model.layers:
            layer.self_attn.window = None
        unwindowed = [greedy(p, len(o)) for p, o in zip(prompts, outputs)]
    return {"gaps": gaps, "greedy": windowed, "greedy_unwindowed": unwindowed}


def compare(cfg, on: dict[str, Any], off: dict[str, Any], plain: dict[str, Any]) -> list[str]:
    """What went wrong (empty when the demo holds)."""
    problems = []
    if on["tokens"] != off["tokens"]:
        problems.append(f"tokens differ: passes on {on['tokens']}, off {off['tokens']}")
    elif on["logprobs"] != off["logprobs"]:
        problems.append(f"logprobs differ: passes on {on['logprobs']}, off {off['logprobs']}")
    report = on["report"]
    graphs = report["graphs"]
    if graphs == 0:
        problems.append("no graph was compiled with the passes on")
    for name, per_graph in expected_matches(cfg).items():
        got = report["matches"].get(name)
        if got is not None and got != per_graph * graphs:
            problems.append(
                f"pass {name} matched {got} times over {graphs} graph(s), expected "
                f"{per_graph} per graph"
            )
    for g in off["report"]["per_graph"]:
        # Lowering may bring in torch ops (the all-reduce collective); a fusion brings beamfx's.
        fused = {op for op in g["ops_after"] if op.startswith("beamfx.")} - set(g["ops_before"])
        if fused:
            problems.append(f"the passes-off pipeline created fused ops: {sorted(fused)}")
    if plain["greedy_unwindowed"] == plain["greedy"]:
        problems.append("the prompts do not exercise the sliding window: choose another seed")
    worst = max(g for row in plain["gaps"] for g in row)
    if worst > NEAR_TIE_LOGITS:
        problems.append(
            f"a vLLM token trails the plain model's choice by {worst:.3g} logits "
            f"(> {NEAR_TIE_LOGITS}): gaps {plain['gaps']}"
        )
    return problems


def format_table(cfg, on, off, plain, passes) -> str:
    names = on["report"]["passes"]
    lines = [f"{'passes':<10} {'graphs':>6} " + " ".join(f"{n:>12}" for n in [*names, "lower"])]
    for label, run in (("on", on), ("off", off)):
        m = run["report"]["matches"]
        cells = " ".join(f"{m.get(n, '-'):>12}" for n in [*names, "lower"])
        lines.append(f"{label:<10} {run['report']['graphs']:>6} {cells}")
    expected = expected_matches(cfg)
    lines.append(
        "expected per graph: "
        + ", ".join(f"{n} {expected[n]}" for n in names if n in expected)
        + f" ({cfg.num_hidden_layers} layers)"
    )
    for label, run in (("on", on), ("off", off)):
        lines.append(
            f"{label:<4} uuid {run['report']['uuid'][:12]}  start {run['start_seconds']:>5} s  "
            f"generate {run['generate_seconds']:>4} s  tokens {run['tokens']}"
        )
    exact = sum(g == 0 for row in plain["gaps"] for g in row)
    total = sum(len(row) for row in plain["gaps"])
    worst = max(g for row in plain["gaps"] for g in row)
    same = "the same" if on["logprobs"] == off["logprobs"] else "DIFFERENT"
    lines.append(f"logprobs of the chosen tokens, passes on vs off: {same} bits")
    lines.append(
        f"plain eager model (fed vLLM's tokens): {exact}/{total} are its own argmax"
        + (f", the rest within {worst:.3g} logits of it" if exact < total else "")
        + f"; its own greedy tokens {plain['greedy']}"
    )
    lines.append(f"  (without the sliding window they would be {plain['greedy_unwindowed']})")
    return "\n".join(lines)


def _split_cores(parts: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `parts` workers: this process's cores, split evenly."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < parts:
        raise ValueError(f"--tp {parts} needs {parts} CPU cores; this process may use {cores}")
    share = len(cores) // parts
    groups = [cores[i * share : (i + 1) * share] for i in range(parts)]
    return "|".join(",".join(map(str, g)) for g in groups)


def run(args: argparse.Namespace) -> int:
    # One process (the engine in this one): faster to start, and the report is an object here.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    if args.tp > 1:
        # vLLM's CPU workers bind their OpenMP threads per NUMA node, and one node cannot
        # host two workers: give each worker its own share of this process's cores.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _split_cores(args.tp))
    from beamfx.checkpoint import write_tiny_checkpoint
    from beamfx.config import load_config

    with tempfile.TemporaryDirectory(prefix="beamfx-tiny-") as scratch:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = write_tiny_checkpoint(args.out or scratch, "tiny", seed=args.seed)
            print(f"wrote the tiny Beam checkpoint to {checkpoint}")
        cfg = load_config(checkpoint)
        prompts = prompts_for(cfg, args.seed)
        on = generate(checkpoint, args.passes, prompts, args.tokens, args.tp)
        off = generate(checkpoint, (), prompts, args.tokens, args.tp)
        plain = plain_agreement(checkpoint, prompts, on["tokens"])
    problems = compare(cfg, on, off, plain)
    print(format_table(cfg, on, off, plain, args.passes))
    if args.json:
        with open(args.json, "w") as f:
            results = {"prompts": prompts, "on": on, "off": off, "plain": plain}
            json.dump({**results, "problems": problems}, f, indent=1, default=str)
    for p in problems:
        print(f"PROBLEM: {p}")
    print("vLLM with beamfx: " + ("OK" if not problems else "FAILED"))
    return 0 if not problems else 1
