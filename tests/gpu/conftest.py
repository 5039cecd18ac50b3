"""The GPU tier: tests here are marked ``gpu`` and skip where torch or a CUDA
device is missing, so the CPU tiers collect them at no cost."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def cuda_torch() -> Any:
    """torch, on a machine with a CUDA device (else the test is skipped)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch
