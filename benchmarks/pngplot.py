"""A tiny line-plot rasteriser that writes PNG with numpy and zlib (no matplotlib).

    line_plot("out.png", [("ours", xs, ys), ...], title="...", xlabel="...",
              ylabel="...", log_x=True)

Enough for benchmark figures: axes with ticks, one coloured polyline with
markers per series, a legend, a title, and a 3x5 pixel font (upper case) drawn
at 2x. Not a test subject of its own beyond "the file is a valid PNG of the
expected size"; keep it small.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Series = tuple[str, Sequence[float], Sequence[float]]

COLOURS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14),
           (23, 190, 207)]
_BLACK = (0, 0, 0)
_GREY = (200, 200, 200)

# 3x5 glyphs, rows top to bottom, "1" = ink. Lower case is drawn as upper case.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001010010010", "8": "111101111101111",
    "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111",
    "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011",
    "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", ",": "000000000010100", "%": "101001010100101",
    "-": "000000111000000", "+": "000010111010000", "/": "001001010100100",
    "(": "010100100100010", ")": "010001001001010", "=": "000111000111000",
    ":": "000010000010000", "<": "001010100010001", ">": "100010001010100",
    "_": "000000000000111", " ": "000000000000000", "*": "000101010101000",
    "^": "010101000000000", "'": "010010000000000", "~": "000011110000000",
}


def write_png(path: str | Path, rgb: np.ndarray) -> None:
    """Write an 8-bit RGB image (H x W x 3, uint8) as a PNG file."""
    height, width, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[row].tobytes() for row in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack("!I", len(body)) + kind + body
                + struct.pack("!I", zlib.crc32(kind + body) & 0xFFFFFFFF))

    header = struct.pack("!IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
                           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.pixels = np.full((height, width, 3), 255, np.uint8)

    def dot(self, x: float, y: float, colour: tuple[int, int, int], radius: int = 1) -> None:
        h, w, _ = self.pixels.shape
        cx, cy = round(x), round(y)
        self.pixels[max(cy - radius, 0):min(cy + radius + 1, h),
                    max(cx - radius, 0):min(cx + radius + 1, w)] = colour

    def line(self, x0: float, y0: float, x1: float, y1: float,
             colour: tuple[int, int, int], width: int = 1) -> None:
        steps = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0.0, 1.0, steps + 1):
            self.dot(x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, colour, width // 2)

    def text(self, x: int, y: int, text: str, colour: tuple[int, int, int] = _BLACK,
             scale: int = 2) -> int:
        """Draw ``text`` with its top-left at (x, y); returns the x after it."""
        for char in text.upper():
            glyph = _FONT.get(char, _FONT["*"])
            for i, bit in enumerate(glyph):
                if bit == "1":
                    row, col = divmod(i, 3)
                    self._block(x + col * scale, y + row * scale, scale, colour)
            x += 4 * scale
        return x

    def _block(self, x: int, y: int, size: int, colour: tuple[int, int, int]) -> None:
        h, w, _ = self.pixels.shape
        if 0 <= x < w and 0 <= y < h:
            self.pixels[y:min(y + size, h), x:min(x + size, w)] = colour


def text_width(text: str, scale: int = 2) -> int:
    return 4 * scale * len(text)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers spanning [low, high]."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * step:
            step *= factor
            break
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float) -> str:
    if abs(value) >= 1000 and value % 1000 == 0:
        return f"{value / 1000:g}K"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-2):
        return f"{value:.0e}".replace("e+0", "e").replace("e-0", "e-")
    return f"{value:g}"


def line_plot(path: str | Path, series: Sequence[Series], *, title: str, xlabel: str,
              ylabel: str, log_x: bool = False, log_y: bool = False,
              y_range: tuple[float, float] | None = None, legend_at: str = "lower left",
              width: int = 900, height: int = 560) -> None:
    """Plot each series as a polyline with markers and write a PNG; ``legend_at``
    is "lower left", "upper left", "lower right", "upper right" or "below"
    (under the axes, on a taller image)."""
    extra = 18 * len(series) + 10 if legend_at == "below" else 0
    canvas = Canvas(width, height + extra)
    left, right, top, bottom = 90, width - 30, 50, height - 70
    xs_all = [x for _, xs, _ in series for x in xs]
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    ys_all = [fy(y) for _, _, ys in series for y in ys if math.isfinite(y) and (y > 0 or not log_y)]
    x_low, x_high = fx(min(xs_all)), fx(max(xs_all))
    if x_high <= x_low:
        x_high = x_low + 1.0
    y_low, y_high = (fy(y_range[0]), fy(y_range[1])) if y_range else (min(ys_all), max(ys_all))
    if y_high <= y_low:
        y_high = y_low + 1.0
    pad = 0.0 if y_range else 0.05 * (y_high - y_low)
    y_low, y_high = y_low - pad, y_high + pad

    def px(x: float) -> float:
        return left + (fx(x) - x_low) / (x_high - x_low) * (right - left)

    def py(y: float) -> float:
        return bottom - (fy(y) - y_low) / (y_high - y_low) * (bottom - top)

    x_ticks = ([10.0 ** e for e in range(math.floor(x_low), math.ceil(x_high) + 1)]
               if log_x else nice_ticks(x_low, x_high))
    for x in x_ticks:
        if x_low - 1e-9 <= fx(x) <= x_high + 1e-9:
            canvas.line(px(x), top, px(x), bottom, _GREY)
            label = f"1e{round(math.log10(x))}" if log_x else _label(x)
            canvas.text(int(px(x)) - text_width(label) // 2, bottom + 8, label)
    y_ticks = ([10.0 ** e for e in range(math.ceil(y_low), math.floor(y_high) + 1)]
               if log_y else nice_ticks(y_low, y_high))
    for y in y_ticks:
        canvas.line(left, py(y), right, py(y), _GREY)
        label = _label(y)
        canvas.text(left - 8 - text_width(label), int(py(y)) - 5, label)
    canvas.line(left, bottom, right, bottom, _BLACK, 2)
    canvas.line(left, top, left, bottom, _BLACK, 2)
    for i, (_, xs, ys) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        points = [(px(x), py(y)) for x, y in zip(xs, ys, strict=True)
                  if math.isfinite(y) and (y > 0 or not log_y)]
        for (a, b), (c, d) in itertools.pairwise(points):
            canvas.line(a, b, c, d, colour, 3)
        for a, b in points:
            canvas.dot(a, b, colour, 3)
    canvas.text((left + right - text_width(title, 3)) // 2, 12, title, scale=3)
    canvas.text((left + right - text_width(xlabel)) // 2, height - 30, xlabel)
    canvas.text(8, top - 30, ylabel)
    _legend(canvas, series, legend_at, (left, right, top, bottom))
    write_png(path, canvas.pixels)


def _legend(canvas: Canvas, series: Sequence[Series], where: str,
            box: tuple[int, int, int, int]) -> None:
    left, right, top, bottom = box
    wide = 50 + max(text_width(label) for label, _, _ in series)
    tall = 18 * len(series) + 8
    x = left + 12 if "left" in where or where == "below" else right - wide - 12
    y = top + 8 if "upper" in where else bottom - tall - 8
    if where == "below":
        y = bottom + 70
    canvas.pixels[y - 4:y + tall - 4, x - 6:x + wide] = 255
    for i, (label, _, _) in enumerate(series):
        colour = COLOURS[i % len(COLOURS)]
        canvas.line(x, y + 5, x + 30, y + 5, colour, 3)
        canvas.text(x + 40, y, label)
        y += 18
