"""A tiny line-plot rasteriser that writes PNG with numpy and zlib (no matplotlib).

    line_plot("out.png", [("ours", xs, ys), ...], title="...", xlabel="...",
              ylabel="...", log_x=True)

Enough for benchmark figures and the post-run timeline (``launcher.timeline``):
``Axes`` (a box with ticks, shared by panels), one coloured polyline with
markers per series, filled rectangles, a legend, a title, and a 3x5 pixel font
(upper case) drawn at 2x. Not a test subject of its own beyond "the file is a
valid PNG of the expected size"; keep it small.
"""

from __future__ import annotations

import itertools
import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
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

    def rect(self, x0: float, y0: float, x1: float, y1: float,
             colour: tuple[int, int, int]) -> None:
        """Fill the pixels from (x0, y0) up to, not including, (x1, y1)."""
        h, w, _ = self.pixels.shape
        self.pixels[max(round(y0), 0):min(round(y1), h),
                    max(round(x0), 0):min(round(x1), w)] = colour

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


@dataclass(frozen=True)
class Axes:
    """A plotting box in pixels and the data range it shows; a log axis keeps its
    range in log10 units."""

    left: int
    right: int
    top: int
    bottom: int
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    log_x: bool = False
    log_y: bool = False

    def fx(self, value: float) -> float:
        return math.log10(value) if self.log_x else value

    def fy(self, value: float) -> float:
        return math.log10(value) if self.log_y else value

    def px(self, x: float) -> float:
        low, high = self.x_range
        return self.left + (self.fx(x) - low) / (high - low) * (self.right - self.left)

    def py(self, y: float) -> float:
        low, high = self.y_range
        return self.bottom - (self.fy(y) - low) / (high - low) * (self.bottom - self.top)

    def grid(self, canvas: Canvas, *, x_labels: bool = True, y_labels: bool = True) -> None:
        """Grey grid lines at round values, their labels, and the two axis lines."""
        x_low, x_high = self.x_range
        y_low, y_high = self.y_range
        x_ticks = ([10.0 ** e for e in range(math.floor(x_low), math.ceil(x_high) + 1)]
                   if self.log_x else nice_ticks(x_low, x_high))
        for x in x_ticks:
            if x_low - 1e-9 <= self.fx(x) <= x_high + 1e-9:
                canvas.line(self.px(x), self.top, self.px(x), self.bottom, _GREY)
                label = f"1e{round(math.log10(x))}" if self.log_x else _label(x)
                if x_labels:
                    canvas.text(int(self.px(x)) - text_width(label) // 2, self.bottom + 8, label)
        if y_labels:
            y_ticks = ([10.0 ** e for e in range(math.ceil(y_low), math.floor(y_high) + 1)]
                       if self.log_y else nice_ticks(y_low, y_high))
            for y in y_ticks:
                canvas.line(self.left, self.py(y), self.right, self.py(y), _GREY)
                label = _label(y)
                canvas.text(self.left - 8 - text_width(label), int(self.py(y)) - 5, label)
        canvas.line(self.left, self.bottom, self.right, self.bottom, _BLACK, 2)
        canvas.line(self.left, self.top, self.left, self.bottom, _BLACK, 2)

    def plot(self, canvas: Canvas, series: Sequence[Series]) -> None:
        """Each series as a polyline with markers, in ``COLOURS`` order; a NaN breaks
        the line (matplotlib's convention), other unplottable values are skipped."""
        for i, (_, xs, ys) in enumerate(series):
            colour = COLOURS[i % len(COLOURS)]
            runs: list[list[tuple[float, float]]] = [[]]
            for x, y in zip(xs, ys, strict=True):
                if math.isnan(y):
                    runs.append([])
                elif math.isfinite(y) and (y > 0 or not self.log_y):
                    runs[-1].append((self.px(x), self.py(y)))
            for points in runs:
                for (a, b), (c, d) in itertools.pairwise(points):
                    canvas.line(a, b, c, d, colour, 3)
                for a, b in points:
                    canvas.dot(a, b, colour, 3)


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
    fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
    fy = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs_all = [fx(x) for _, xs, _ in series for x in xs]
    ys_all = [fy(y) for _, _, ys in series for y in ys if math.isfinite(y) and (y > 0 or not log_y)]
    y_low, y_high = (fy(y_range[0]), fy(y_range[1])) if y_range else (min(ys_all), max(ys_all))
    axes = Axes(left, right, top, bottom, span(min(xs_all), max(xs_all)),
                span(y_low, y_high, 0.0 if y_range else 0.05), log_x, log_y)
    axes.grid(canvas)
    axes.plot(canvas, series)
    canvas.text((left + right - text_width(title, 3)) // 2, 12, title, scale=3)
    canvas.text((left + right - text_width(xlabel)) // 2, height - 30, xlabel)
    canvas.text(8, top - 30, ylabel)
    legend(canvas, [label for label, _, _ in series], legend_at, (left, right, top, bottom))
    write_png(path, canvas.pixels)


def span(low: float, high: float, pad: float = 0.0) -> tuple[float, float]:
    """An axis range: ``high`` > ``low`` (one unit wide when empty), widened by ``pad``
    of its width on each side."""
    if high <= low:
        high = low + 1.0
    margin = pad * (high - low)
    return low - margin, high + margin


def legend(canvas: Canvas, labels: Sequence[str], where: str,
           box: tuple[int, int, int, int]) -> None:
    """A line in ``COLOURS`` order and its label for each series, on white."""
    left, right, top, bottom = box
    wide = 50 + max(text_width(label) for label in labels)
    tall = 18 * len(labels) + 8
    x = left + 12 if "left" in where or where == "below" else right - wide - 12
    y = top + 8 if "upper" in where else bottom - tall - 8
    if where == "below":
        y = bottom + 70
    canvas.pixels[y - 4:y + tall - 4, x - 6:x + wide] = 255
    for i, label in enumerate(labels):
        colour = COLOURS[i % len(COLOURS)]
        canvas.line(x, y + 5, x + 30, y + 5, colour, 3)
        canvas.text(x + 40, y, label)
        y += 18
