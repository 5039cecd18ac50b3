"""The benchmarks' line plots and the smoothing of the loss, drawn with matplotlib; and
the message when matplotlib (the ``[plot]`` extra) is missing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from ft_launch.errors import UsageError
from ft_launch.launcher.reporting import plots

SERIES = [("a", [1, 10, 100], [1.0, 2.0, 3.0]), ("b", [1, 100], [3.0, 1.0])]


def pixels_of(image: np.ndarray, colour: str) -> int:
    return int(np.isclose(image[..., :3], to_rgb(colour), atol=2 / 255).all(axis=2).sum())


@pytest.mark.parametrize("legend_at", ["lower right", "below"])
def test_line_plot_draws_each_series_in_its_colour(tmp_path: Path, legend_at: str) -> None:
    path = tmp_path / "p.png"
    plots.line_plot(path, SERIES, title="t", xlabel="x", ylabel="y", log_x=True, log_y=True,
                    legend_at=legend_at, size=(4.0, 3.0))  # type: ignore[arg-type]
    image = imread(path)
    assert image.shape[:2] == (300, 400)
    for colour in plots.TAB10[:2]:
        assert pixels_of(image, colour) > 100
    assert pixels_of(image, plots.TAB10[2]) == 0          # no third series, no third colour


def test_an_unknown_legend_place_names_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'below'"):
        plots.line_plot(tmp_path / "p.png", SERIES, title="t", xlabel="x", ylabel="y",
                        legend_at="middle")  # type: ignore[arg-type]
    assert not (tmp_path / "p.png").exists()


def test_without_matplotlib_the_error_says_what_to_install(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib fails
    with pytest.raises(UsageError, match=r"pip install 'ft-launch\[plot\]'"):
        plots.line_plot(tmp_path / "p.png", SERIES, title="t", xlabel="x", ylabel="y")


def test_smoothing_is_tensorboards_debiased_running_average() -> None:
    assert plots.smoothed([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    rising = plots.smoothed([0.0, 10.0], 0.5)          # (0.5 * 0 + 0.5 * 10) / (1 - 0.25)
    assert rising == pytest.approx([0.0, 10 * 0.5 / 0.75])
    gapped = plots.smoothed([1.0, math.nan, 3.0], 0.0)  # weight 0: the raw values
    assert gapped[0] == 1.0 and math.isnan(gapped[1]) and gapped[2] == 3.0
