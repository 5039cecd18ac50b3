"""Small states and fault-injecting state sources shared by the checkpoint tests."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ft_launch.ckpt.manifest import Bytes, TensorDesc
from ft_launch.ckpt.snapshot import ArrayState, DualBufferSnapshotter


def make_arrays(step: int, size: int = 1000) -> dict[str, np.ndarray]:
    """A state whose every value depends on ``step`` (so steps are told apart)."""
    rng = np.random.default_rng(step)
    return {
        "model/w": rng.standard_normal((size // 10, 10)).astype(np.float32),
        "model/b": np.full(7, step, dtype=np.float64),
        "optim/state/0/exp_avg": rng.standard_normal(size).astype(np.float32),
        "optim/state/0/step": np.array(step, dtype=np.int64),
        "rng/torch": rng.integers(0, 255, 33, dtype=np.uint8),
        "flags": np.array([True, False, True]),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


def snapshot_of(step: int, snapshotter: DualBufferSnapshotter | None = None,
                size: int = 1000) -> DualBufferSnapshotter:
    snapshotter = snapshotter or DualBufferSnapshotter()
    snapshotter.start(step, ArrayState(make_arrays(step, size), meta={"step": step}))
    snapshotter.wait_complete(timeout=30)
    return snapshotter


def assert_state_equal(manifest_buffer: tuple[Any, Bytes], step: int, size: int = 1000) -> None:
    manifest, buffer = manifest_buffer
    expected = make_arrays(step, size)
    assert manifest.step == step
    assert list(manifest.names) == list(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(manifest.spec(name).view(buffer), array)


class GatedSource:
    """Copies like ``ArrayState`` but stops before tensor ``gate_at`` until released.

    With ``fail`` it raises there instead: a writer that dies mid-copy.
    """

    def __init__(self, arrays: Mapping[str, np.ndarray], gate_at: int, fail: bool = False,
                 meta: Mapping[str, Any] | None = None) -> None:
        self._inner = ArrayState(arrays, meta)
        self.gate_at = gate_at
        self.fail = fail
        self.reached = threading.Event()
        self.release = threading.Event()

    def describe(self) -> Sequence[TensorDesc]:
        return self._inner.describe()

    def meta(self) -> Mapping[str, Any]:
        return self._inner.meta()

    def copy_into(self, index: int, dest: Bytes) -> None:
        if index == self.gate_at:
            self.reached.set()
            if self.fail:
                raise RuntimeError("writer killed mid-copy (injected)")
            if not self.release.wait(timeout=30):
                raise RuntimeError("test never released the gated copy")
        self._inner.copy_into(index, dest)
