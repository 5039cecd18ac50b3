"""The tiny PNG writer makes valid files with the series drawn in."""

from __future__ import annotations

from pathlib import Path

from launcher import pngplot as plot
from tests.pngread import read_png


def test_line_plot_draws_each_series_in_its_colour(tmp_path: Path) -> None:
    path = tmp_path / "p.png"
    plot.line_plot(path, [("a", [1, 10, 100], [1.0, 2.0, 3.0]), ("b", [1, 100], [3.0, 1.0])],
                   title="t", xlabel="x", ylabel="y", log_x=True, width=400, height=300)
    pixels = read_png(path)
    assert pixels.shape == (300, 400, 3)
    for colour in plot.COLOURS[:2]:
        assert (pixels == colour).all(axis=2).sum() > 100


def test_rect_fills_exactly_its_pixels() -> None:
    canvas = plot.Canvas(10, 8)
    canvas.rect(2, 3, 5, 4, (1, 2, 3))
    assert (canvas.pixels == (1, 2, 3)).all(axis=2).sum() == 3
    assert (canvas.pixels[3, 2:5] == (1, 2, 3)).all()
