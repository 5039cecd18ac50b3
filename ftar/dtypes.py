"""Element types FTAR reduces and the host-side kernels that reduce them.

Frames carry the caller's element type unchanged (half types stay 2 bytes on the
wire); each reduction step widens both operands to float32, adds, and rounds once.
numpy has no bfloat16, so bfloat16 arrays arrive as ``uint16`` bit patterns
(declared with ``dtype="bfloat16"``, or an ``ml_dtypes`` bfloat16 array) and are
widened by a shift.
"""

from __future__ import annotations

import enum

import numpy as np

from .errors import FtarUsageError

_BF16_QUIET_NAN = 0x7FC0


class ElementType(enum.Enum):
    """Wire codes are part of the frame header: do not renumber."""

    FLOAT32 = 1
    FLOAT64 = 2
    FLOAT16 = 3
    BFLOAT16 = 4

    @property
    def storage(self) -> np.dtype:
        """The numpy dtype whose bytes hold one element."""
        return np.dtype(_STORAGE[self])

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize


_STORAGE = {ElementType.FLOAT32: np.float32, ElementType.FLOAT64: np.float64,
            ElementType.FLOAT16: np.float16, ElementType.BFLOAT16: np.uint16}
_BY_NAME = {"float32": ElementType.FLOAT32, "float64": ElementType.FLOAT64,
            "float16": ElementType.FLOAT16, "bfloat16": ElementType.BFLOAT16}


def element_type_of(array: np.ndarray, declared: str | None = None) -> ElementType:
    """The element type of ``array``; ``declared="bfloat16"`` reads uint16 as bfloat16."""
    name = array.dtype.name
    if declared is not None:
        wanted = _BY_NAME.get(declared)
        if wanted is None:
            raise FtarUsageError(f"unsupported dtype {declared!r}; FTAR reduces "
                                 f"{', '.join(_BY_NAME)}")
        if array.dtype.itemsize != wanted.itemsize or array.dtype.kind not in "fuV":
            raise FtarUsageError(f"array of {name} cannot hold {declared} elements")
        return wanted
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise FtarUsageError(f"unsupported dtype {name}; FTAR reduces {', '.join(_BY_NAME)} "
                         "(pass dtype='bfloat16' for bfloat16 bits held as uint16)")


class HostKernels:
    """In-place add and divide on host arrays of one element type.

    Scratch buffers for the half types are allocated once, for the largest piece
    the ring hands over (``max_elems``).
    """

    def __init__(self, etype: ElementType, max_elems: int) -> None:
        self.etype = etype
        widen = etype in (ElementType.FLOAT16, ElementType.BFLOAT16)
        size = max_elems if widen else 0
        self._a = np.empty(size, np.float32)
        self._b = np.empty(size, np.float32)
        self._bits = np.empty(size if etype is ElementType.BFLOAT16 else 0, np.uint32)

    def add(self, dst: np.ndarray, src: np.ndarray) -> None:
        """``dst += src`` in place, accumulating half types in float32."""
        if self.etype is ElementType.BFLOAT16:
            n = dst.size
            a, b = self._a[:n], self._b[:n]
            bf16_to_f32(dst, a)
            bf16_to_f32(src, b)
            np.add(a, b, out=a)
            f32_to_bf16(a, dst, self._bits[:n])
        elif self.etype is ElementType.FLOAT16:
            n = dst.size
            a, b = self._a[:n], self._b[:n]
            np.copyto(a, dst)
            np.copyto(b, src)
            np.add(a, b, out=a)
            np.copyto(dst, a, casting="same_kind")
        else:
            np.add(dst, src, out=dst)

    def divide(self, dst: np.ndarray, divisor: int) -> None:
        """``dst /= divisor`` in place (in float32 for the half types)."""
        if self.etype is ElementType.BFLOAT16:
            a = self._a[:dst.size]
            bf16_to_f32(dst, a)
            np.divide(a, divisor, out=a)
            f32_to_bf16(a, dst, self._bits[:dst.size])
        elif self.etype is ElementType.FLOAT16:
            a = self._a[:dst.size]
            np.copyto(a, dst)
            np.divide(a, divisor, out=a)
            np.copyto(dst, a, casting="same_kind")
        else:
            np.divide(dst, divisor, out=dst)


def bf16_to_f32(bits: np.ndarray, out: np.ndarray) -> None:
    """Widen bfloat16 bit patterns (uint16) into float32 ``out`` (exact)."""
    wide = out.view(np.uint32)
    np.copyto(wide, bits, casting="unsafe")
    np.left_shift(wide, 16, out=wide)


def f32_to_bf16(values: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """Round float32 to bfloat16 bits, nearest-even; NaN stays NaN."""
    bits = values.view(np.uint32)
    np.right_shift(bits, 16, out=scratch)
    np.bitwise_and(scratch, 1, out=scratch)
    np.add(scratch, bits, out=scratch)
    np.add(scratch, 0x7FFF, out=scratch)
    np.right_shift(scratch, 16, out=scratch)
    np.copyto(out, scratch, casting="unsafe")
    nans = np.isnan(values)
    if nans.any():  # rounding could carry a NaN's mantissa into an infinity
        out[nans] = _BF16_QUIET_NAN
