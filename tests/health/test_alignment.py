"""The bit-wise alignment test: deterministic on the CPU, a simulated silent data
corruption changes the digest, and the check judges against pinned references."""

import json

import pytest

from ft_launch.health.alignment import AlignmentRun, digest_outliers, judge_run, run_in_subprocess
from ft_launch.health.catalog import AlignmentParams, bind
from ft_launch.health.result import CheckStatus
from ft_launch.health.settings import parse_settings

pytest.importorskip("torch")


def test_judging_is_pure():
    good = AlignmentRun("cuda:0", "cuda-H200", ("aa", "aa"), 1.0)
    assert judge_run(good, {}) is None and judge_run(good, {"cuda-H200": "aa"}) is None
    assert judge_run(good, {"cuda-H200": "bb"}) == "alignment mismatch on cuda:0"
    flaky = AlignmentRun("cuda:1", "cuda-H200", ("aa", "ab"), 1.0)
    assert judge_run(flaky, {}) == "alignment nondeterministic on cuda:1"
    assert digest_outliers({"n1": "aa", "n2": "aa", "n3": "bb"}) == ["n3"]
    assert digest_outliers({}) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cpu_digest_is_repeatable_and_sdc_changes_it(tmp_path):
    (run,) = run_in_subprocess(("cpu",), repeats=2)
    assert run.deterministic and len(run.digests[0]) == 64
    references = {run.platform: run.digests[0]}
    (tmp_path / "n1.json").write_text(json.dumps([{"gpu": 0, "sdc": True}]))
    settings = parse_settings({"health": {"backend": "simulated", "gpus_per_node": 1,
                                        "sim_fault_dir": str(tmp_path)}}, "t")
    check = bind("alignment", AlignmentParams(devices=("cpu",), repeats=1, timeout=100,
                                              references=references))
    result = check(settings.context("n1"))
    assert (result.status, result.reason) == (CheckStatus.FAIL, "alignment mismatch on cpu")
    assert result.evidence["cpu"]["digest"] != run.digests[0]
