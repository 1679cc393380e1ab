"""beamfx: compile-time graph-rewriting fusion passes for vLLM, built first for Beam-1.0."""

from beamfx import ops  # noqa: F401  (registers the beamfx:: custom ops)

__version__ = "0.1.0"
