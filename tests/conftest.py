"""Shared test set-up: hypothesis profiles and the tiny checkpoint.

HYPOTHESIS_PROFILE=ci (default: few examples, quick) or thorough (many examples).
"""

import pytest

from beamfx.testing import load_profile

load_profile()


@pytest.fixture(autouse=True)
def _release_prepared_experts():
    """Each test's expert weights are new tensors, so the MoE providers' caches of
    converted weights (one entry a layer in a model) would grow by one a test and keep
    every test's weights alive on the GPU; a test leaves them empty."""
    yield
    import sys

    for name in ("beamfx.kernels.moe.cutedsl", "beamfx.kernels.moe.flashinfer"):
        module = sys.modules.get(name)
        if module is not None:
            module.PREPARED.clear()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    """The `tiny` preset's random-weight checkpoint, written once per session."""
    from beamfx.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny")), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_prompt(tiny_checkpoint):
    """Token ids [2, 16] on which the tiny model's routing has no near-tie (margin >= 0.02).

    Near-ties let last-bit differences pick other experts (see `beamfx.cli.routing_margin`).
    """
    from beamfx.checkpoint import load_checkpoint
    from beamfx.cli import stable_prompt

    ids, margin = stable_prompt(load_checkpoint(tiny_checkpoint), 2, 16, seed=0)
    assert margin >= 0.02, f"no prompt with a clear routing margin (best {margin})"
    return ids


@pytest.fixture(scope="session")
def gloo_world() -> str:
    """A one-rank gloo process group: the all-reduce variants trace as at any world size."""
    import torch.distributed as dist

    if not dist.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)  # fmt: skip
    return dist.group.WORLD.group_name
