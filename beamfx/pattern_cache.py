"""Traced pattern graphs kept on disk, so a process registers the passes without tracing.

Tracing every variant of every pattern with make_fx is most of a pass's one-time cost. A
traced graph depends only on the code that ran (beamfx's sources, torch, Python, the
decomposition table), so the file is keyed by a hash of all of it: any change is a new
key, never a stale hit. Patterns whose code lies elsewhere (a user's pass, a closure) are
always traced. An unreadable or foreign file is ignored and the patterns are traced
again; a file is written only after it was read back to the same graphs.
`BEAMFX_PATTERN_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import operator
import os
import pathlib
import pickle
import sys
import tempfile
import types
from typing import Any

import torch

_FORMAT = 1  # bump when the file layout changes


def enabled() -> bool:
    return os.environ.get("BEAMFX_PATTERN_CACHE", "1") != "0"


class GraphCache:
    """The traced graphs of one pass: `entry_key(...) -> (parameter names, graph)`."""

    def __init__(self, pass_name: str, path: pathlib.Path | None):
        self.pass_name = pass_name
        self.path = path
        self._stored: dict[Any, tuple[list[str], list]] = {}
        self._new: dict[Any, tuple[list[str], torch.fx.Graph]] = {}
        if path is not None:
            try:
                with open(path, "rb") as f:
                    key, stored = pickle.load(f)
                if key == path.stem:  # a file moved under another name is not trusted
                    self._stored = stored
            except Exception:  # missing, truncated, written by other code: trace again
                self._stored = {}

    def get(self, key: Any) -> tuple[list[str], torch.fx.Graph] | None:
        entry = self._stored.get(key)
        if entry is None:
            return None
        try:
            return list(entry[0]), _decode(entry[1])
        except Exception:
            self._stored.pop(key)
            return None

    def put(self, key: Any, names: list[str], graph: torch.fx.Graph) -> None:
        self._new[key] = (list(names), graph)

    def save(self) -> None:
        """Write the stored and newly traced graphs, if every new one reads back the same."""
        if self.path is None or not self._new:
            return
        try:
            stored = dict(self._stored)
            for key, (names, graph) in self._new.items():
                data = _encode(graph)
                if str(_decode(data)) != str(graph):
                    return  # a graph this format cannot carry: keep tracing it
                stored[key] = (names, data)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((self.path.stem, stored), f)
            os.replace(tmp, self.path)  # atomic: a reader sees the old file or the new one
        except Exception:  # read-only or full disk, an unpicklable constant: no cache
            return


def entry_key(search: Any, specs: dict[str, Any], present: tuple, act: torch.dtype) -> Any:
    """The key of one traced variant, or None when the pattern function's code is not all
    in the hashed sources (a test's pattern, a closure over values): those are traced."""
    if not isinstance(search, types.FunctionType) or search.__closure__ is not None:
        return None
    file = inspect.getsourcefile(search)
    if file is None or not any(pathlib.Path(file).is_relative_to(d) for d in _source_dirs()):
        return None
    spec_text = repr(sorted((n, repr(s)) for n, s in specs.items()))
    return (search.__module__, search.__qualname__, spec_text, present, str(act))


def open_cache(pass_name: str) -> GraphCache:
    """The cache file of `pass_name` in Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR)."""
    if not enabled():
        return GraphCache(pass_name, None)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        path = pathlib.Path(cache_dir(), "beamfx_patterns", f"{pass_name}-{_code_key()}.pkl")
    except OSError:  # no cache directory to be had: trace
        path = None
    return GraphCache(pass_name, path)


@functools.cache
def _code_key() -> str:
    """A hash of everything a traced pattern graph depends on."""
    from torch._inductor import config
    from torch._inductor.decomposition import select_decomp_table

    h = hashlib.sha256()
    for part in (_FORMAT, torch.__version__, torch.version.git_version, sys.version,
                 config.fallback_random):  # fmt: skip
        h.update(f"{part}\0".encode())
    for op, fn in sorted((str(k), _name(v)) for k, v in select_decomp_table().items()):
        h.update(f"{op}={fn}\0".encode())
    for file in sorted(f for d in _source_dirs() for f in d.rglob("*.py")):
        h.update(str(file.relative_to(file.parents[1])).encode() + b"\0" + file.read_bytes())
    return h.hexdigest()[:32]


@functools.cache
def _source_dirs() -> tuple[pathlib.Path, ...]:
    import beamfx.kernels
    import beamfx.passes

    dirs = [pathlib.Path(__file__).parent, *beamfx.passes.__path__, *beamfx.kernels.__path__]
    return tuple(pathlib.Path(d).resolve() for d in dirs)


def _name(fn: Any) -> str:
    fn = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


# --- graphs as plain data: nodes in order, targets by name, node arguments by index -------


class _Ref(int):
    """An argument that is the node at this index."""


def _encode(graph: torch.fx.Graph) -> list:
    index = {n: i for i, n in enumerate(graph.nodes)}
    ref = lambda a: _Ref(index[a])
    out = []
    for n in graph.nodes:
        args, kwargs = torch.fx.node.map_arg(n.args, ref), torch.fx.node.map_arg(n.kwargs, ref)
        out.append((n.op, n.name, _target(n.target), args, kwargs))
    return out


def _decode(data: list) -> torch.fx.Graph:
    graph = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []

    def arg(a):
        if isinstance(a, _Ref):
            return nodes[a]
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        if isinstance(a, dict):
            return {k: arg(v) for k, v in a.items()}
        return a

    for op, name, target, args, kwargs in data:
        node = graph.create_node(op, _resolve(target), arg(args), arg(kwargs), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} read back as {node.name!r}")
        nodes.append(node)
    graph.lint()
    return graph


def _target(target: Any) -> tuple:
    if isinstance(target, str):  # placeholder and output names
        return ("str", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    if target is operator.getitem:
        return ("getitem",)
    raise TypeError(f"pattern cache: no encoding for target {target!r}")


def _resolve(target: tuple) -> Any:
    if target[0] == "str":
        return target[1]
    if target[0] == "getitem":
        return operator.getitem
    _, namespace, name, overload = target
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)
