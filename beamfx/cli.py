"""The `beamfx` command: the demo (the main job), a tiny-checkpoint writer, a graph viewer.

Each subcommand is one function registered with `@command(...)`; `beamfx --help` lists
them in registration order. To add one, write `def _name(args) -> int` (and, if it
takes options, `def _name_arguments(parser)`) and decorate it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from beamfx.kernels.moe import reference as moe_ref

if TYPE_CHECKING:
    from beamfx.config import BeamConfig

# Heavy modules (transformers through beamfx.config, torch._inductor) are imported where
# used, so that `beamfx --help` and the spawned ranks start in about the time torch takes.

# --- subcommand registry ------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    run: Callable[[argparse.Namespace], int]
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]


COMMANDS: dict[str, Command] = {}


def command(
    name: str,
    help: str,
    arguments: Callable[[argparse.ArgumentParser], None] = lambda parser: None,
) -> Callable:
    """Register `run(args) -> exit status` as `beamfx NAME`; `arguments` adds its options."""

    def register(run: Callable[[argparse.Namespace], int]) -> Callable:
        COMMANDS[name] = Command(run, help, arguments)
        return run

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="beamfx",
        description="beamfx: compile-time fusion passes for vLLM, built first for Beam-1.0.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        cmd.arguments(sub.add_parser(name, help=cmd.help, description=cmd.help))
    return parser


def main(argv: list[str] | None = None) -> int:
    from beamfx.checkpoint import CheckpointError
    from beamfx.config import BeamConfigError
    from beamfx.kernels.moe.nvfp4 import NVFP4Error
    from beamfx.passes import UnknownPassError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except (BeamConfigError, UnknownPassError, FileNotFoundError, CheckpointError,
            NVFP4Error) as e:  # fmt: skip
        print(f"beamfx {args.command}: error: {e}", file=sys.stderr)
        return 2


# --- shared helpers -----------------------------------------------------------------------

# The project's CPU machines have about 23 GiB of memory; a model whose weights alone need
# more than this is a typo in --layers, not a request (Beam-1.0-shaped is ~1 TB in bf16).
_MAX_WEIGHT_GIB = 16.0


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default="tiny",
        help="preset name (tiny, beam-1.0-shaped), checkpoint folder or config.json (default tiny)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="override num_hidden_layers (types repeat)"
    )


def _check_weight_size(cfg: BeamConfig, world_size: int = 1) -> None:
    from beamfx.config import BeamConfigError
    from beamfx.models.beam import BeamForCausalLM, Parallel

    with torch.device("meta"):
        model = BeamForCausalLM(cfg, Parallel(0, world_size))
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    if gib > _MAX_WEIGHT_GIB:
        raise BeamConfigError(
            f"Beam config with num_hidden_layers={cfg.num_hidden_layers} needs {gib:.0f} GiB of "
            f"weights per rank (limit {_MAX_WEIGHT_GIB:.0f} GiB): pass --layers with fewer "
            "layers or a smaller config"
        )


def _describe(cfg: BeamConfig) -> str:
    return (
        f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x {cfg.head_dim}, "
        f"{cfg.num_experts} experts top-{cfg.num_experts_per_tok} "
        f"({cfg.n_group} groups, {cfg.topk_group} kept)"
    )


def routing_margin(model: torch.nn.Module, input_ids: torch.Tensor) -> float:
    """The smallest score gap, over tokens and MoE layers, that decides a routing choice.

    A near-tie lets a last-bit difference (eager vs compiled, TP=1 vs TP=2, bf16 vs fp64)
    pick another expert, which changes that token by far more than rounding does; numeric
    comparisons are meaningful only on prompts whose margin is well above rounding noise.
    Two gaps decide routing: between the last kept and the first dropped group, and
    between the k-th and (k+1)-th biased expert score among the kept groups.
    """
    from beamfx.models.beam import BeamMoE

    margins: list[float] = []

    def record(moe: BeamMoE, inputs: tuple) -> None:
        logits = moe_ref.router_logits(inputs[0], moe.gate.weight)
        biased = torch.sigmoid(logits) + moe.gate.e_score_correction_bias.to(logits.dtype)
        t, e = biased.shape
        per_group = e // moe.n_group
        grouped = biased.view(t, moe.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        ranked_groups = group_scores.sort(dim=-1, descending=True)
        if moe.topk_group < moe.n_group:
            v = ranked_groups.values
            margins.append((v[:, moe.topk_group - 1] - v[:, moe.topk_group]).min().item())
        kept = ranked_groups.indices[:, : moe.topk_group]
        survivors = grouped.gather(1, kept.unsqueeze(-1).expand(t, moe.topk_group, per_group))
        ranked = survivors.reshape(t, -1).sort(dim=-1, descending=True).values
        if moe.top_k < ranked.shape[1]:
            margins.append((ranked[:, moe.top_k - 1] - ranked[:, moe.top_k]).min().item())

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, BeamMoE)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return min(margins, default=math.inf)


def stable_prompt(
    model: torch.nn.Module,
    batch: int,
    seq: int,
    seed: int = 0,
    min_margin: float = 0.02,
    tries: int = 50,
) -> tuple[torch.Tensor, float]:
    """Random token ids [batch, seq] whose routing margin is at least `min_margin`."""
    best: tuple[torch.Tensor, float] | None = None
    for i in range(tries):
        g = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(3, model.config.vocab_size, (batch, seq), generator=g)
        margin = routing_margin(model, ids)
        if margin >= min_margin:
            return ids, margin
        if best is None or margin > best[1]:
            best = (ids, margin)
    assert best is not None
    return best


# --- graph capture ------------------------------------------------------------------------


@dataclass(frozen=True)
class IRNode:
    """One Beam IR (or collective) node of a post-grad graph, placed in the model."""

    name: str
    op: str  # "beamfx.rms_norm", "_c10d_functional.all_reduce", ...
    args: str
    layer: int | None  # None: outside the decoder layers
    scope: str  # "self_attn", "mlp", "boundary" (the layer's own code), "model" or "?"


@dataclass(frozen=True)
class CapturedGraph:
    text: str  # the whole graph as FX prints it
    num_nodes: int
    ir_nodes: list[IRNode]

    def counts(self, layer: int | None = None) -> Counter:
        """Beam IR op counts ("rms_norm": 6, ...) of one layer, or of the whole graph."""
        return Counter(
            n.op.split(".", 1)[1]
            for n in self.ir_nodes
            if n.op.startswith("beamfx.") and (layer is None or n.layer == layer)
        )


_SHOWN_NAMESPACES = ("beamfx", "_c10d_functional")


class _Captured(Exception):
    """Raised by the capture pass to end compilation once the graph is recorded."""


def graph_capture(stop: bool = False):
    """An Inductor post-grad pass that records each graph it sees (and changes nothing).

    Passed as `post_grad_custom_post_pass`, so it sees the graph as the fusion passes will.
    Inductor may run more passes after it, so it snapshots at once (`.graphs`, a list of
    `CapturedGraph`). `stop=True` ends the compilation after the first graph, which
    saves Inductor's codegen when only the graph is wanted.
    """
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class GraphCapture(CustomGraphPass):
        def __init__(self) -> None:
            self.graphs: list[CapturedGraph] = []

        def __call__(self, graph: torch.fx.Graph) -> None:
            self.graphs.append(_snapshot(graph))
            if stop:
                raise _Captured

        def uuid(self) -> None:
            # None turns off Inductor's graph cache: a cache hit would skip this pass.
            return None

    return GraphCapture()


def _snapshot(graph: torch.fx.Graph) -> CapturedGraph:
    ir_nodes = []
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        namespace = node.target.namespace
        if namespace not in _SHOWN_NAMESPACES:
            continue
        layer, scope = _place(node)
        op = f"{namespace}.{node.target._opname}"
        ir_nodes.append(IRNode(node.name, op, _format_args(node.args), layer, scope))
    return CapturedGraph(str(graph), len(graph.nodes), ir_nodes)


def _place(node: torch.fx.Node) -> tuple[int | None, str]:
    """(layer index, scope) from the module stack Dynamo records on each node."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None, "?"  # the root module's own code, or code resumed after a graph break
    path = list(stack.values())[-1][0]
    # Dynamo spells module paths differently across versions: a.b.0, a.b[0], _modules['b'].
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    m = re.search(r"\.layers\.(\d+)(?:\.(\w+))?", path)
    if not m:
        return None, "model"
    return int(m.group(1)), m.group(2) or "boundary"


def _format_args(args) -> str:
    def one(a) -> str:
        if isinstance(a, torch.fx.Node):
            return a.name
        if isinstance(a, list | tuple):
            return "[" + ", ".join(one(x) for x in a) + "]"
        return repr(a)

    return ", ".join(one(a) for a in args)


def _caused_by(error: BaseException | None, kind: type) -> bool:
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return False


def post_grad_graphs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    stop: bool = True,
    options: dict | None = None,
) -> tuple[list[CapturedGraph], torch.Tensor | None]:
    """Compile `model` with Inductor and return its post-grad graphs (and, unless `stop`,
    the compiled output for `input_ids`). `stop=True` keeps only the first graph."""
    torch._dynamo.reset()
    capture = graph_capture(stop)
    compiled = torch.compile(
        model, options={**(options or {}), "post_grad_custom_post_pass": capture}
    )
    out = None
    try:
        with torch.no_grad():
            out = compiled(input_ids)
    except Exception as e:
        if not (stop and _caused_by(e, _Captured)):
            raise
    finally:
        torch._dynamo.reset()
    return capture.graphs, out


def format_graph_summary(graphs: list[CapturedGraph], cfg: BeamConfig, title: str) -> str:
    """Per layer, the Beam IR nodes in graph order, then their counts."""
    lines = [title]
    total = Counter()
    for gi, g in enumerate(graphs):
        if len(graphs) > 1:
            lines.append(f"\n== graph {gi + 1} of {len(graphs)} (Dynamo broke the graph) ==")
        lines.append(
            f"{g.num_nodes} nodes, {len(g.ir_nodes)} of them Beam IR or collective ops "
            "(Beam IR ops are the torch.ops.beamfx.* nodes)"
        )
        if not g.ir_nodes:
            lines.append("  (no Beam IR ops: this graph is plain aten)")
        current: object = object()
        for n in g.ir_nodes:
            if n.layer != current:
                current = n.layer
                if n.layer is None:
                    lines.append("outside the decoder layers")
                else:
                    mlp = cfg.mlp_layer_types[n.layer]
                    kind = "MoE" if mlp == "sparse" else "dense MLP"
                    lines.append(f"layer {n.layer}: {cfg.layer_types[n.layer]}, {kind}")
            lines.append(f"  {n.scope:<9} {n.name} = {n.op}({n.args})")
        total += g.counts()
    lines.append("\nBeam IR ops per layer, in graph order:")
    for layer in range(cfg.num_hidden_layers):
        per_layer = Counter()
        for g in graphs:
            per_layer += g.counts(layer)
        ops = ", ".join(f"{op} x{c}" for op, c in per_layer.items())
        lines.append(f"  layer {layer}: {ops or '-'}")
    lines.append("total: " + (", ".join(f"{op} x{c}" for op, c in sorted(total.items())) or "-"))
    return "\n".join(lines)


# --- multi-process tensor parallelism on the CPU ------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _positive_int(text: str) -> int:
    """argparse type: a whole number of at least 1 (a rank count)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _group_rank(
    rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple
) -> None:
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # The ranks share the machine's cores; oversubscribed threads slow gloo down badly.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        code = fn(rank, *args)
    finally:
        dist.destroy_process_group()
    if isinstance(code, int) and code:
        sys.exit(code)  # a rank's failing status reaches the parent's exit status


def spawn_group(world_size: int, fn: Callable, *args, backend: str = "gloo") -> int:
    """Run `fn(rank, *args)` in `world_size` processes joined by a process group: gloo on
    the CPU, or nccl with rank r on GPU r. Returns 0, or the first nonzero int a rank's
    `fn` returned (an exception in a rank is raised here).

    `fn` must be a module-level function (it is pickled into the spawned processes).
    """
    import torch.multiprocessing as mp

    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise RuntimeError(
            f"spawn_group: nccl across {world_size} ranks needs {world_size} GPUs, "
            f"this machine has {torch.cuda.device_count()}; use backend='gloo' on the CPU"
        )
    try:
        mp.spawn(_group_rank, args=(world_size, free_port(), backend, fn, args), nprocs=world_size)
    except mp.ProcessExitedException as e:
        if e.exit_code is None or e.exit_code <= 0:  # killed by a signal: not a status
            raise
        return e.exit_code
    return 0


def spawn_gloo(world_size: int, fn: Callable, *args) -> int:
    """`spawn_group` over gloo (the CPU)."""
    return spawn_group(world_size, fn, *args, backend="gloo")


# --- beamfx demo --------------------------------------------------------------------------

# Hidden states must match bit for bit when Inductor keeps every bf16 rounding of the
# contract; only the final fp32 softcap (Inductor's tanh vs ATen's) may differ, by ulps.
EXACT_LOGITS_TOL = 1e-5
# With Inductor's defaults, fused elementwise code outside the Beam IR ops (RoPE, SSMax,
# the output gate) skips the contract's intermediate bf16 roundings; the few-ulp
# differences carry through the layers. Measured about 1.2% of max |logit| on the tiny model.
BF16_LOGITS_RTOL = 0.03


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="checkpoint folder to write (default: a temporary folder)")
    _config_arguments(parser)
    parser.add_argument("--batch", type=_positive_int, default=2, help="prompts (default 2)")
    parser.add_argument(
        "--seq", type=_positive_int, default=16, help="tokens per prompt (default 16)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights and prompt seed")


@command(
    "demo",
    "the main job: write the tiny checkpoint; eager vs torch.compile; what beamfx's passes fuse",
    _demo_arguments,
)
def _demo(args: argparse.Namespace) -> int:
    if args.out is not None:
        return _run_demo(args, args.out)
    with tempfile.TemporaryDirectory(prefix="beamfx-tiny-") as out:
        return _run_demo(args, out)


def _run_demo(args: argparse.Namespace, out: str) -> int:
    from beamfx.checkpoint import load_checkpoint, write_tiny_checkpoint
    from beamfx.config import load_config
    from beamfx.models.beam import reference_model

    cfg = load_config(args.config, args.layers)
    _check_weight_size(cfg)
    write_tiny_checkpoint(out, cfg, seed=args.seed)
    print(f"wrote a random-weight Beam checkpoint ({_describe(cfg)}) to {out}")
    model = load_checkpoint(out).eval()
    ids, margin = stable_prompt(model, args.batch, args.seq, seed=args.seed)
    print(
        f"loaded BeamForCausalLM: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, bf16 (router fp32); prompt {args.batch} x {args.seq} tokens "
        f"(routing margin {margin:.3f})"
    )
    with torch.no_grad():
        eager = model(ids)
        scale = eager.abs().max().item()
        fp64 = reference_model(model)(ids)
    print(f"eager: logits {list(eager.shape)} fp32, max |logit| {scale:.3f}")
    print(f"  eager vs fp64 reference: max |diff| {(eager.double() - fp64).abs().max():.3g}")
    rows = [
        ("Inductor, emulate_precision_casts", {"emulate_precision_casts": True}, EXACT_LOGITS_TOL),
        ("Inductor defaults", {}, BF16_LOGITS_RTOL * scale),
    ]
    ok = True
    for label, options, tol in rows:
        torch._dynamo.reset()
        with torch.no_grad():
            compiled = torch.compile(model, options=options)(ids)
        diff = (compiled - eager).abs().max().item()
        agree = diff <= tol
        ok &= agree
        verdict = "agree" if agree else "DISAGREE"
        print(f"  eager vs torch.compile ({label}): max |diff| {diff:.3g}, ", end="")
        print(f"tolerance {tol:.3g}: {verdict}")
    print("eager and torch.compile agree" if ok else "eager and torch.compile DISAGREE")
    # What the passes do to the same model: every pass, matches per layer, the check.
    from beamfx.report import compile_and_report, format_report

    print()
    report = compile_and_report(model, ids, "all")
    print(format_report(report, cfg))
    ok &= report["check"]["agree"]
    return 0 if ok else 1


# --- beamfx write-tiny --------------------------------------------------------------------


def _write_tiny_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="folder to write (created if missing)")
    _config_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")


@command(
    "write-tiny",
    "write a random-weight HF checkpoint: config.json, model.safetensors, tokenizer",
    _write_tiny_arguments,
)
def _write_tiny(args: argparse.Namespace) -> int:
    from beamfx.checkpoint import write_tiny_checkpoint
    from beamfx.config import load_config

    cfg = load_config(args.config, args.layers)
    _check_weight_size(cfg)
    write_tiny_checkpoint(args.path, cfg, seed=args.seed)
    print(f"wrote a random-weight Beam checkpoint ({_describe(cfg)}) to {args.path}:")
    for name in sorted(os.listdir(args.path)):
        print(f"  {name}")
    return 0


# --- beamfx graph -------------------------------------------------------------------------


def _graph_arguments(parser: argparse.ArgumentParser) -> None:
    _config_arguments(parser)
    parser.add_argument(
        "--tp",
        type=_positive_int,
        default=1,
        help="tensor-parallel ranks (>1: gloo processes; rank 0 prints)",
    )
    parser.add_argument(
        "--frontend",
        choices=("semantic", "torch"),
        default="semantic",
        help="semantic: Beam IR ops (default); torch: their reference code, as plain torch",
    )
    parser.add_argument(
        "--seq", type=_positive_int, default=16, help="tokens per prompt (default 16)"
    )
    parser.add_argument("--full", action="store_true", help="also print the whole FX graph")


@command(
    "graph",
    "print the plain model's post-grad FX graph (as the passes see it), per layer",
    _graph_arguments,
)
def _graph(args: argparse.Namespace) -> int:
    from beamfx.config import load_config

    cfg = load_config(args.config, args.layers)
    cfg.check_world_size(args.tp)
    _check_weight_size(cfg, args.tp)
    if args.tp == 1:
        _graph_on_rank(0, args)
    else:
        spawn_gloo(args.tp, _graph_on_rank, args)
    return 0


def _graph_on_rank(rank: int, args: argparse.Namespace) -> None:
    from beamfx.checkpoint import init_random
    from beamfx.config import load_config
    from beamfx.models.beam import BeamForCausalLM, Parallel

    cfg = load_config(args.config, args.layers)
    par = Parallel.from_default_group()
    model = init_random(BeamForCausalLM(cfg, par, frontend=args.frontend)).eval()
    ids = torch.randint(
        3, cfg.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0)
    )
    # The plain-torch front end breaks the graph at each MoE layer (the experts loop is
    # data-dependent), so it needs a full compile to see every graph.
    graphs, _ = post_grad_graphs(model, ids, stop=args.frontend == "semantic")
    if rank != 0:
        return
    title = (
        f"post-grad FX graph of BeamForCausalLM ({args.config}: {_describe(cfg)}), "
        f"TP={args.tp}, {args.frontend} front end, 1 x {args.seq} tokens"
    )
    if args.full:
        for g in graphs:
            print(g.text)
    print(format_graph_summary(graphs, cfg, title))


# --- beamfx vllm-demo ---------------------------------------------------------------------


def _vllm_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from beamfx.integrations import vllm_demo

    vllm_demo.add_arguments(parser)


@command(
    "vllm-demo",
    "serve the tiny checkpoint with vLLM (CPU build): beamfx passes on and off, same tokens",
    _vllm_demo_arguments,
)
def _vllm_demo(args: argparse.Namespace) -> int:
    from beamfx.integrations import vllm_demo

    return vllm_demo.run(args)


# --- beamfx passes / beamfx compile -------------------------------------------------------


@command("passes", "list the fusion passes, each with what it rewrites")
def _passes(args: argparse.Namespace) -> int:
    from beamfx.passes import STAGES, descriptions, get_pass

    for name, text in descriptions().items():
        print(f"{name:<14} {text}")
    print("always on, around the chosen passes:")
    for name in STAGES:
        print(f"  {name:<12} {get_pass(name).description}")
    return 0


def _compile_arguments(parser: argparse.ArgumentParser) -> None:
    _config_arguments(parser)
    parser.add_argument("--passes", default="all", help="comma-separated pass names, or all")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor parallel ranks (gloo)")
    parser.add_argument("--report", choices=["text", "json"], default="text")
    parser.add_argument("--explain", action="store_true", help="say why candidates did not fuse")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--frontend", choices=["semantic", "torch"], default="semantic")
    parser.add_argument("--seq", type=_positive_int, default=16, help="prompt tokens (default 16)")


@command(
    "compile",
    "compile the plain model with beamfx passes; report what fused and check the outputs",
    _compile_arguments,
)
def _compile(args: argparse.Namespace) -> int:
    from beamfx.config import load_config
    from beamfx.passes import resolve

    resolve(args.passes)  # a misspelled pass fails here, before any work
    cfg = load_config(args.config, args.layers)
    cfg.check_world_size(args.tp)
    _check_weight_size(cfg, args.tp)
    if args.tp == 1:
        return _compile_on_rank(0, args)
    return spawn_gloo(args.tp, _compile_on_rank, args)


def _compile_on_rank(rank: int, args: argparse.Namespace) -> int:
    import json

    from beamfx.config import load_config
    from beamfx.models.beam import Parallel
    from beamfx.report import build_model, compile_and_report, format_report

    cfg = load_config(args.config, args.layers)
    dtype = getattr(torch, args.dtype)
    model = build_model(cfg, args.config, dtype, args.frontend, Parallel.from_default_group())
    ids, _ = stable_prompt(model, 1, args.seq, seed=0)
    report = compile_and_report(model.eval(), ids, args.passes, explain=args.explain)
    report["tp"] = args.tp
    if rank == 0:
        print(json.dumps(report, indent=1) if args.report == "json" else format_report(report, cfg))
    return 0 if report["check"]["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
