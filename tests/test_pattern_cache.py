"""The traced-pattern cache: a hit gives the traced patterns; a damaged file is traced again."""

import dataclasses
import pickle

import pytest
import torch

import beamfx.pattern
from beamfx import pattern_cache
from beamfx.passes import get_pass
from beamfx.pattern import Act, FusionPass, H, T


def fresh(name: str) -> FusionPass:
    """A pass with the rules of the shipped pass `name`, nothing registered yet."""
    shipped = get_pass(name)
    p = FusionPass(shipped.name, shipped.description)
    p.rules = [dataclasses.replace(r, variants=[]) for r in shipped.rules]
    return p


def patterns(p: FusionPass) -> list:
    p.matcher()
    return [(v.label, v.names, sorted(map(str, v.act_dtypes)), str(v.pattern), str(ops))
            for v, ops in p._variant_ops]  # fmt: skip


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BEAMFX_PATTERN_CACHE", "1")
    return tmp_path / "beamfx_patterns"


def no_tracing(monkeypatch):
    monkeypatch.setattr(beamfx.pattern, "_trace", lambda *a: pytest.fail("traced on a hit"))


@pytest.mark.parametrize("name", ["canonicalize", "router_gemm", "mega_moe", "boundary"])
def test_patterns_from_the_cache_are_the_traced_ones(name, cache_dir, monkeypatch):
    monkeypatch.setenv("BEAMFX_PATTERN_CACHE", "0")
    traced = patterns(fresh(name))
    assert not cache_dir.exists()
    monkeypatch.setenv("BEAMFX_PATTERN_CACHE", "1")
    assert patterns(fresh(name)) == traced  # a miss: traced and written
    assert len(list(cache_dir.glob(f"{name}-*.pkl"))) == 1
    no_tracing(monkeypatch)
    assert patterns(fresh(name)) == traced


def truncate(file):
    file.write_bytes(file.read_bytes()[:100])


def garbage(file):
    file.write_bytes(b"not a pickle")


def foreign_key(file):
    key, stored = pickle.loads(file.read_bytes())
    file.write_bytes(pickle.dumps(("0" * 32, stored)))


def broken_graphs(file):
    key, stored = pickle.loads(file.read_bytes())
    stored = {k: (names, [("call_function", "x", ("op", "aten", "nope", "default"), (), {})])
              for k, (names, _) in stored.items()}  # fmt: skip
    file.write_bytes(pickle.dumps((key, stored)))


@pytest.mark.parametrize("damage", [truncate, garbage, foreign_key, broken_graphs])
def test_a_damaged_cache_file_is_traced_again(damage, cache_dir, monkeypatch):
    traced = patterns(fresh("attn_gate"))
    [file] = cache_dir.glob("attn_gate-*.pkl")
    damage(file)
    assert patterns(fresh("attn_gate")) == traced
    no_tracing(monkeypatch)  # and written again
    assert patterns(fresh("attn_gate")) == traced


def test_patterns_outside_beamfx_sources_are_not_cached(cache_dir):
    def local(x: Act[T, H]):
        return torch.relu(x)

    def closure(eps):
        def search(x: Act[T, H]):
            return x + eps

        return search

    specs = {"x": Act[T, H]}
    assert pattern_cache.entry_key(local, specs, (), torch.float32) is None
    assert pattern_cache.entry_key(closure(1.0), specs, (), torch.float32) is None
    p = FusionPass("local", "relu -> relu")
    p.rule(replace=lambda x: torch.relu(x))(local)
    p.matcher()
    assert not cache_dir.exists()


def test_the_key_covers_every_source_file(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(pattern_cache, "_source_dirs", lambda: (tmp_path,))
    key = pattern_cache._code_key.__wrapped__()
    (tmp_path / "a.py").write_text("x = 2\n")
    assert pattern_cache._code_key.__wrapped__() != key
