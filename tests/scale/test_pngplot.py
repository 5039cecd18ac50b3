"""The tiny PNG writer makes valid files with the series drawn in."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from .helpers import load_benchmark


def read_png(path: Path) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        (size,) = struct.unpack("!I", data[at:at + 4])
        kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + size]
        (crc,) = struct.unpack("!I", data[at + 8 + size:at + 12 + size])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = body
        at += 12 + size
    width, height, depth, colour = struct.unpack("!IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert (rows[:, 0] == 0).all()  # filter type None on every row
    return rows[:, 1:].reshape(height, width, 3)


def test_line_plot_draws_each_series_in_its_colour(tmp_path: Path) -> None:
    plot = load_benchmark("pngplot")
    path = tmp_path / "p.png"
    plot.line_plot(path, [("a", [1, 10, 100], [1.0, 2.0, 3.0]), ("b", [1, 100], [3.0, 1.0])],
                   title="t", xlabel="x", ylabel="y", log_x=True, width=400, height=300)
    pixels = read_png(path)
    assert pixels.shape == (300, 400, 3)
    for colour in plot.COLOURS[:2]:
        assert (pixels == colour).all(axis=2).sum() > 100
