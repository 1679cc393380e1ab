"""Expert weights converted once for a kernel's layout, cached per source tensors.

A key of addresses alone is unsafe: once a source tensor is freed, a new tensor of the
same shape can land at the same address and would get the old tensor's converted copy.
So an entry holds its source tensors: while it lives their memory cannot be reused, and a
tensor with the same address, shape, strides and version is a view of the same data.
In-place writes bump the version and rebuild. Entries are few (one per MoE layer); the
oldest goes once `max_entries` are held, releasing its sources. Inference tensors (made
under `torch.inference_mode()`) keep no version, so an in-place write to one could not be
seen: they are converted on every call, never cached (correct, slow; a warning says so).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable

import torch


class WeightCache:
    def __init__(self, max_entries: int = 512):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[tuple[torch.Tensor, ...], object]] = OrderedDict()
        self._warned = False

    @staticmethod
    def key(tensors: tuple[torch.Tensor, ...]) -> tuple:
        return tuple(
            (t.device, t.dtype, t.data_ptr(), tuple(t.shape), t.stride(), t._version)
            for t in tensors
        )

    def get(self, tensors: tuple[torch.Tensor, ...], build: Callable[[], object]) -> object:
        """The converted weights of `tensors`, built by `build()` on a miss."""
        if any(t.is_inference() for t in tensors):
            if _capturing(tensors):
                # A rebuild allocates and copies from the host: inside a CUDA graph capture
                # that fails with an error that names none of this.
                raise RuntimeError(
                    "beamfx: expert weights are inference tensors (made under "
                    "torch.inference_mode()), so their converted copies are rebuilt on every "
                    "call, which a CUDA graph capture cannot hold: create or load the "
                    "weights outside inference mode"
                )
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "beamfx: expert weights are inference tensors (made under "
                    "torch.inference_mode()), which keep no version counter, so their "
                    "converted copies cannot be cached safely and are rebuilt on every "
                    "call; create or load the weights outside inference mode",
                    stacklevel=3,
                )
            return build()
        key = self.key(tensors)
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[1]
        value = build()
        self._entries[key] = (tuple(tensors), value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def _capturing(tensors: tuple[torch.Tensor, ...]) -> bool:
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()
