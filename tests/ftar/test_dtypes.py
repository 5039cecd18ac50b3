"""Element types and the host reduction kernels."""

from __future__ import annotations

import numpy as np
import pytest

from ft_launch.ftar.dtypes import (
    ElementType,
    HostKernels,
    bf16_to_f32,
    element_type_of,
    f32_to_bf16,
)
from ft_launch.ftar.errors import FtarUsageError


def _to_bf16(values: np.ndarray) -> np.ndarray:
    out = np.empty(values.size, np.uint16)
    f32_to_bf16(values.astype(np.float32), out, np.empty(values.size, np.uint32))
    return out


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.size, np.float32)
    bf16_to_f32(bits, out)
    return out


def test_bfloat16_rounds_to_nearest_even_and_keeps_specials() -> None:
    values = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, np.inf, -np.inf, 3.0e38,
                       np.nan], np.float32)
    bits = _to_bf16(values)
    assert list(bits[:6]) == [0x3F80, 0x3F80, 0x3F82, 0xC020, 0x7F80, 0xFF80]
    assert bits[6] == 0x7F80 or _from_bf16(bits[6:7])[0] > 3.0e38 * (1 - 2 ** -8)
    assert np.isnan(_from_bf16(bits[7:8])[0])


def test_bfloat16_error_is_within_half_an_ulp() -> None:
    values = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    back = _from_bf16(_to_bf16(values))
    assert np.all(np.abs(back - values) <= np.abs(values) * 2.0 ** -8)
    assert np.array_equal(_to_bf16(back), _to_bf16(values))    # representable: exact


@pytest.mark.parametrize("etype", list(ElementType))
def test_kernels_add_and_divide_like_float64(etype: ElementType) -> None:
    rng = np.random.default_rng(1)
    a64, b64 = rng.standard_normal(999), rng.standard_normal(999)
    if etype is ElementType.BFLOAT16:
        a, b = _to_bf16(a64), _to_bf16(b64)
        a64, b64 = _from_bf16(a).astype(np.float64), _from_bf16(b).astype(np.float64)
        read = lambda x: _from_bf16(x).astype(np.float64)
        eps = 2.0 ** -8
    else:
        a, b = a64.astype(etype.storage), b64.astype(etype.storage)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        read = lambda x: x.astype(np.float64)
        eps = float(np.finfo(etype.storage).eps)
    kernels = HostKernels(etype, 999)
    kernels.add(a, b)
    assert np.all(np.abs(read(a) - (a64 + b64)) <= eps * (np.abs(a64) + np.abs(b64)))
    before = read(a)
    kernels.divide(a, 3)
    assert np.all(np.abs(read(a) - before / 3) <= eps * np.abs(before))


def test_element_types_are_recognised_or_refused_as_fatal() -> None:
    assert element_type_of(np.zeros(2, np.float16)) is ElementType.FLOAT16
    assert element_type_of(np.zeros(2, np.uint16), "bfloat16") is ElementType.BFLOAT16
    with pytest.raises(FtarUsageError, match="unsupported dtype int32.*fatal"):
        element_type_of(np.zeros(2, np.int32))
    with pytest.raises(FtarUsageError, match="cannot hold bfloat16"):
        element_type_of(np.zeros(2, np.float32), "bfloat16")
