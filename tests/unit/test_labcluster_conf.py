"""The lab cluster's slurm.conf: the timeouts chosen per Slurm release."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import labcluster

#: how long one ping or registration round lasted past MessageTimeout with a
#: crashed node in it (24.11's slurmctld log: "agent maximum delay 7 seconds")
ROUND_BEYOND_MESSAGE_TIMEOUT = 2


def conf_value(conf: str, key: str) -> str:
    (line,) = [line for line in conf.splitlines() if line.startswith(f"{key}=")]
    return line.split("=", 1)[1]


@pytest.mark.parametrize("release", ["24.11", "26.05"])
def test_from_24_11_no_live_node_looks_silent_while_a_crashed_one_holds_up_a_round(
        release, monkeypatch):
    """One round to every node lasts as long as the crashed node's MessageTimeout; a
    live node can go three such rounds without a counted reply (README, 24.11)."""
    monkeypatch.setenv("LAB_SLURM_RELEASE", release)
    conf = labcluster.slurm_conf(Path("/lab"), ["n1", "n2"], labcluster.Hooks())
    message_timeout = int(conf_value(conf, "MessageTimeout"))
    assert int(conf_value(conf, "SlurmdTimeout")) > 3 * (
        message_timeout + ROUND_BEYOND_MESSAGE_TIMEOUT)


def test_up_to_22_05_a_dead_node_is_down_soon():
    """22.05 pings each node on its own: the short timeout stays (the host's suite)."""
    assert labcluster.slurmd_timeout("22.05") == 5
    assert labcluster.slurmd_timeout("24.11") > labcluster.slurmd_timeout("22.05")
