"""FSDP2-sharded state: each rank of a replica snapshots, loads and keeps resident
only its own shards, and a state sharded otherwise is refused.

Two real ranks (gloo over a FileStore in tmp_path) per test; the scenarios are
in ``sharded_proc`` and report back as JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as torch_mp

from ft_launch.errors import ExitCode
from tests.waiting import patience

from .sharded_proc import run

pytestmark = pytest.mark.timeout(180)
RANKS = 2


def _run_ranks(tmp_path: Path, scenario: str, *args: Any) -> list[dict[str, Any]]:
    """Run ``scenario`` in RANKS processes; a rank's exception fails the test with
    its traceback; returns each rank's report."""
    out = tmp_path / "out"
    out.mkdir()
    context = torch_mp.start_processes(run, args=(RANKS, str(tmp_path / "store"), str(out),
                                                  scenario, *args),
                                       nprocs=RANKS, join=False, start_method="spawn")
    limit = patience(60)
    deadline = time.monotonic() + limit
    try:
        # join returns whenever a rank ends (True once all have), and raises a
        # failed rank's exception with its traceback.
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            assert time.monotonic() < deadline, f"{scenario}: ranks still running after " \
                                                f"{limit:.0f} s"
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sharded_state_loads_into_a_fresh_sharded_model_and_trains_on_identically(
        tmp_path, dtype):
    reports = _run_ranks(tmp_path, "resume", dtype)
    for rank, report in enumerate(reports):
        assert report["loaded_differs"] == [] and report["stepped_differs"] == [], rank
        shapes, layout = report["shapes"], report["layout"]
        # Local shapes: rows split 128/128 and the 3-row layer 2/1.
        assert shapes["model/0.weight"] == [128, 64]
        assert shapes["model/4.weight"] == ([2, 256] if rank == 0 else [1, 256])
        assert shapes["optim/state/4/exp_avg"] == shapes["model/4.weight"]
        assert layout["meshes"] == [{"shape": [2], "coordinate": [rank], "dim_names": ["dp"]}]
        weight = layout["tensors"]["model/4.weight"]
        assert weight == {"mesh": 0, "placements": ["Shard(dim=0)"], "global_shape": [3, 256],
                          "local_shape": shapes["model/4.weight"]}
        assert "optim/state/0/step" not in layout["tensors"]  # plain tensors have no entry
        expected = "bfloat16" if dtype == "bfloat16" else "float32"
        assert {report["dtypes"][n] for n in ("model/0.weight", "optim/state/0/exp_avg",
                                              "optim/state/5/exp_avg_sq")} == {expected}
        # About half the unsharded state per rank, and the ranks' shards add up exactly.
        assert 0.45 < report["total_bytes"] / report["plain_total_bytes"] < 0.55
        assert report["sharded_bytes_all_ranks"] == report["global_bytes"]


def test_a_state_sharded_otherwise_is_refused_naming_both_layouts(tmp_path):
    reports = _run_ranks(tmp_path, "mismatch")
    for rank, report in enumerate(reports):
        for case in ("into_plain", "into_sharded", "into_columns"):
            refused = report[case]
            assert refused["message"] is not None, f"rank {rank}: {case} was loaded"
            assert refused["changed"] == [], f"rank {rank}: {case} changed {refused['changed']}"
            assert refused["exit_code"] == ExitCode.FATAL_NO_REQUEUE
            assert "same mesh / ranks per replica" in refused["message"]
        local = "[2, 256]" if rank == 0 else "[1, 256]"
        assert f"'model/0.weight' was saved Shard(dim=0) on mesh [2] at [{rank}]" \
            in report["into_plain"]["message"]
        assert "live plain (unsharded)" in report["into_plain"]["message"]
        assert "live meshes: none (unsharded)" in report["into_plain"]["message"]
        assert report["into_plain"]["live"] == {"meshes": [], "tensors": {}}
        assert "saved plain (unsharded) [256, 64] but is live Shard(dim=0)" \
            in report["into_sharded"]["message"]
        columns = report["into_columns"]["message"]
        assert "'model/0.weight' was saved Shard(dim=0)" in columns
        assert f"live Shard(dim=1) on mesh [2] at [{rank}] (global [256, 64], " \
            "local [256, 32])" in columns
        assert report["into_columns"]["stored"]["tensors"]["model/4.weight"]["local_shape"] \
            == json.loads(local)


def test_resident_adamw_on_fsdp2_shards_matches_torch_adamw_bit_for_bit(tmp_path):
    reports = _run_ranks(tmp_path, "resident")
    for rank, report in enumerate(reports):
        assert report["differs"] == [[], [], []], rank
        assert report["restored_differs"] == [], rank
        # Even shards live in the newest snapshot; FSDP2 pads the uneven one
        # (1 row of 2 on rank 1) into private memory, which is then copied.
        for name, inside in report["inside"].items():
            padded = name.startswith("4.") and report["local_rows"][name] == 1
            assert inside == (not padded), (rank, name)
        assert "use a copying snapshot" in (report["refusal"] or ""), report["refusal"]
        assert report["reuse"] == {"moments_kept": True, "layout_kept": True,
                                   "layout_as_fresh": True, "descs_as_fresh": True}, rank
