"""The example's ``--param-dtype auto``: bf16 where the device computes it
natively, fp32 on a CPU that would emulate it (several times slower)."""

from __future__ import annotations

import pytest

from tests.scale.helpers import load_script

from .harness import TRAIN

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def train():
    return load_script(TRAIN)


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_is_bf16_only_where_the_device_computes_it_natively(train, monkeypatch,
                                                                 native, expected):
    monkeypatch.setattr(train, "native_bf16", lambda device: native)
    assert train.param_dtype_for("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize("requested", ["bf16", "fp16", "fp32"])
def test_an_explicit_dtype_is_kept_on_any_device(train, monkeypatch, requested):
    monkeypatch.setattr(train, "native_bf16", lambda device: False)
    assert train.param_dtype_for(requested, torch.device("cpu")) == requested


def test_a_gpu_counts_as_native_bf16_without_asking_the_cpu(train):
    assert train.native_bf16(torch.device("cuda")) is True
