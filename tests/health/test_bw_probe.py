"""The optional bandwidth probe: its judgement, and a real 2-rank run when mpi4py
and an MPI launcher are present."""

import json
import shutil
import subprocess
import sys

import pytest

from ft_launch.health.bw_probe import LinkBandwidth, judge_bandwidth, links_from_json
from ft_launch.health.result import CheckStatus


def test_slowest_link_below_threshold_fails():
    links = [LinkBandwidth("n1", "n2", 20.0), LinkBandwidth("n2", "n1", 3.5)]
    result = judge_bandwidth("bandwidth", links, min_gbytes_per_s=10)
    assert (result.status, result.reason) == (CheckStatus.FAIL, "link n2->n1 3.50GB/s<10GB/s")
    assert judge_bandwidth("bandwidth", links, 1).status is CheckStatus.PASS
    assert judge_bandwidth("bandwidth", [], 1).status is CheckStatus.FAIL


@pytest.mark.timeout(60)
def test_two_ranks_on_loopback():
    pytest.importorskip("mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    done = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "ft_launch.health.bw_probe",
                           "--bytes", str(4 << 20), "--iterations", "3"],
                          check=False, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    links = links_from_json(json.loads(done.stdout))
    assert len(links) == 2 and all(link.gbytes_per_s > 0 for link in links)
