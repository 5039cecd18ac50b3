"""The pure parts of benchmarks/hsdp_bench.py: arguments, size plans, the
interleaved schedule, step times, the summary, wire bytes, the ft-launch command.
Nothing here starts a process or imports torch."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scale.helpers import load_benchmark

bench = load_benchmark("hsdp_bench")
core = load_benchmark("hsdp.core")
Arm = core.Arm

TRAIN_SIZES = {"default": {"d_model": 192, "n_layers": 6, "n_heads": 6, "context": 64},
               "100m": {"d_model": 768, "n_layers": 14, "n_heads": 12, "context": 64}}


def run(arm, pair, median=None, durations=None, error="", wire=None, order=0):
    durations = durations if durations is not None else ((median,) * 3 if median else ())
    return core.RunResult(arm, "default", pair, order, durations=tuple(durations),
                          error=error, wire_bytes_per_step=wire)


# ---------------------------------------------------------------- arguments and plans


def test_defaults_run_both_sizes_every_arm_two_pairs():
    args = bench.parse_args([])
    assert args.sizes == ["default", "100m"]
    assert args.pairs == 2
    assert args.arms == list(Arm)
    assert (args.replicas, args.ranks, args.param_dtype, args.reduce_dtype) == (3, 2, "bf16", "fp32")
    assert args.json is None


def test_quick_is_one_pair_of_the_default_size():
    args = bench.parse_args(["--quick", "--json", "out.json"])
    assert (args.sizes, args.pairs, args.json) == (["default"], 1, Path("out.json"))


def test_explicit_flags_win_over_quick():
    args = bench.parse_args(["--quick", "--sizes", "100m", "--pairs", "3", "--arms", "torchft"])
    assert (args.sizes, args.pairs, args.arms) == (["100m"], 3, [Arm.TORCHFT])


@pytest.mark.parametrize("argv", [["--pairs", "0"], ["--steps", "2"], ["--warmup", "0"],
                                  ["--arms", "ddp"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_plans_take_train_py_sizes_and_per_size_steps():
    plans = bench.plan_sizes(bench.parse_args([]), TRAIN_SIZES)
    assert [(p.name, p.warmup, p.steps) for p in plans] == [("default", *bench.STEPS["default"]),
                                                             ("100m", *bench.STEPS["100m"])]
    assert plans[1].config == TRAIN_SIZES["100m"]


def test_steps_and_warmup_override_every_size():
    plans = bench.plan_sizes(bench.parse_args(["--steps", "10", "--warmup", "4"]), TRAIN_SIZES)
    assert {(p.warmup, p.steps) for p in plans} == {(4, 10)}


def test_a_plan_with_fewer_than_two_timed_steps_is_refused():
    with pytest.raises(ValueError, match="fewer than 2 timed"):
        bench.plan_sizes(bench.parse_args(["--steps", "5", "--warmup", "4"]), TRAIN_SIZES)


def test_an_unknown_size_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown size 'huge'.*\['100m', 'default'\]"):
        bench.plan_sizes(bench.parse_args(["--sizes", "huge"]), TRAIN_SIZES)


@pytest.mark.parametrize("cores, expected", [(16, 2), (2, 1), (None, 1), (64, 10)])
def test_threads_share_the_cores_among_the_six_processes(cores, expected):
    assert bench.default_threads(3, 2, cores) == expected


def test_sizes_are_read_from_a_literal_in_the_source():
    source = 'X = 1\nSIZES = {"tiny": {"d_model": 32, "n_layers": 1}}\n'
    assert core.sizes_in_source(source) == {"tiny": {"d_model": 32, "n_layers": 1}}
    assert core.sizes_in_source("SIZES = make_sizes()\n") == {}
    assert core.sizes_in_source("pass\n") == {}


def test_the_example_train_py_has_both_sizes_of_the_default_run():
    assert set(bench.DEFAULT_SIZES) <= set(core.sizes_in_source(bench.TRAIN.read_text()))


def test_missing_train_support_lists_the_absent_flags_and_size():
    old = "usage: train.py [--size {default,small,tiny}] [--optimizer {adamw}]"
    assert core.missing_train_support(old, "100m") == [
        "--parallel", "--param-dtype", "--reduce-dtype",
        "--size 100m (choices: default,small,tiny)"]
    new = ("usage: train.py [--size {100m,default}] [--optimizer X] [--parallel {fsdp}] "
           "[--param-dtype X] [--reduce-dtype X]")
    assert core.missing_train_support(new, "100m") == []


# ---------------------------------------------------------------- schedule


def test_each_pair_runs_every_arm_once_in_a_rotated_order():
    schedule = core.interleave(list(Arm), 4)
    assert all(sorted(p, key=list(Arm).index) == list(Arm) for p in schedule)
    assert [p[0] for p in schedule] == list(Arm)               # every arm goes first once
    for before, after in itertools.pairwise(schedule):
        assert after == before[1:] + before[:1]


def test_interleave_refuses_no_pairs_and_allows_no_arms():
    with pytest.raises(ValueError):
        core.interleave(list(Arm), 0)
    assert core.interleave([], 2) == [[], []]


def test_step_times_skip_warmup_and_step_zero():
    ended = [10.0, 11.0, 11.5, 12.5, 13.0]
    assert core.step_durations(ended, 2) == [0.5, 1.0, 0.5]
    assert core.step_durations(ended, 1) == core.step_durations(ended, 0) == [1.0, 0.5, 1.0, 0.5]
    assert core.step_durations(ended, 9) == []


def test_commit_times_are_ordered_by_step():
    assert core.commit_times([(1, 5.0), (0, 4.0), (2, 7.0)]) == [4.0, 5.0, 7.0]


@pytest.mark.parametrize("commits", [[(0, 1.0), (0, 2.0)], [(0, 1.0), (2, 2.0)]])
def test_commit_times_refuse_a_run_that_was_not_fault_free(commits):
    with pytest.raises(ValueError):
        core.commit_times(commits)


# ---------------------------------------------------------------- summary


def test_ratios_are_medians_of_per_pair_ratios():
    runs = [run(Arm.NATIVE_HSDP, 0, 1.0), run(Arm.FTL_OVERLAP, 0, 1.1),
            run(Arm.NATIVE_HSDP, 1, 2.0), run(Arm.FTL_OVERLAP, 1, 2.0),
            run(Arm.NATIVE_HSDP, 2, 1.0), run(Arm.FTL_OVERLAP, 2, 1.05)]
    assert core.paired_ratio(runs, Arm.FTL_OVERLAP, Arm.NATIVE_HSDP) == pytest.approx(1.05)


def test_a_pair_with_a_failed_run_is_left_out():
    runs = [run(Arm.NATIVE_HSDP, 0, 1.0), run(Arm.FTL_OVERLAP, 0, error="boom"),
            run(Arm.NATIVE_HSDP, 1, 1.0), run(Arm.FTL_OVERLAP, 1, 1.2)]
    assert core.paired_ratio(runs, Arm.FTL_OVERLAP, Arm.NATIVE_HSDP) == pytest.approx(1.2)
    assert core.paired_ratio(runs, Arm.FTL_OVERLAP, Arm.TORCHFT) is None


def test_a_run_median_is_of_its_timed_steps():
    result = run(Arm.TORCHFT, 0, durations=[0.3, 0.1, 0.2, 9.0])
    assert result.ok and result.median_s == pytest.approx(0.25)
    assert not run(Arm.TORCHFT, 0, durations=[]).ok
    assert run(Arm.TORCHFT, 0, durations=[0.1], error="x").median_s is None


def full_size(scale: float = 1.0):
    runs = [run(Arm.NATIVE_HSDP, 0, 1.0), run(Arm.FTL_OVERLAP, 0, 1.02 * scale, wire=400.0),
            run(Arm.FTL_NO_OVERLAP, 0, 1.3), run(Arm.TORCHFT, 0, 1.2)]
    return core.size_summary(runs, run(Arm.FTL_OVERLAP, -1, 1.0, wire=200.0), 100, 3)


def test_size_summary_names_the_four_ratios_and_defines_no_overlap_as_c_over_b():
    s = full_size()
    assert s["ratios"]["step_time_ratio_vs_native_hsdp"] == pytest.approx(1.02)
    assert s["ratios"]["step_time_ratio_no_overlap"] == pytest.approx(1.3 / 1.02)
    assert s["ratios"]["step_time_ratio_no_overlap_vs_native_hsdp"] == pytest.approx(1.3)
    assert s["ratios"]["step_time_ratio_vs_torchft"] == pytest.approx(1.02 / 1.2)
    assert s["ratios"]["wire_bytes_ratio_bf16_vs_fp32"] == pytest.approx(0.5)
    assert s["wire"]["source"] == core.MEASURED
    assert s["arms"]["torchft"]["median_step_s"] == pytest.approx(1.2)
    assert "c / b" in core.NOTES["step_time_ratio_no_overlap"]


def test_summary_is_the_geomean_over_sizes_with_the_worst_beside_it():
    summary = core.summarise({"default": full_size(), "100m": full_size(scale=1.1)})
    for key in ("step_time_ratio_vs_native_hsdp", "step_time_ratio_no_overlap",
                "wire_bytes_ratio_bf16_vs_fp32", "step_time_ratio_vs_torchft"):
        assert key in summary
    assert summary["step_time_ratio_vs_native_hsdp"] == pytest.approx(
        math.sqrt(1.02 * 1.02 * 1.1))
    assert summary["step_time_ratio_vs_native_hsdp_worst"] == pytest.approx(1.02 * 1.1)


def test_verdicts_compare_with_the_targets_and_leave_unmeasured_ones_open():
    verdicts = core.verdicts({"step_time_ratio_vs_native_hsdp": 1.04,
                              "step_time_ratio_vs_torchft": 0.9,
                              "wire_bytes_ratio_bf16_vs_fp32": None})
    assert verdicts == {"step_time_ratio_vs_native_hsdp": False,
                        "step_time_ratio_vs_torchft": True, "wire_bytes_ratio_bf16_vs_fp32": None}


def test_an_unavailable_arm_leaves_its_ratios_none():
    runs = [run(Arm.NATIVE_HSDP, 0, 1.0), run(Arm.FTL_OVERLAP, 0, 1.0)]
    s = core.size_summary(runs, None, 100, 3)
    assert s["ratios"]["step_time_ratio_vs_torchft"] is None
    assert s["ratios"]["wire_bytes_ratio_bf16_vs_fp32"] is None
    summary = core.summarise({"default": s})
    assert summary["step_time_ratio_vs_torchft"] is None
    assert "MISSED" not in core.table({"default": s}, summary)


def test_the_table_prints_each_target_beside_its_figure():
    per_size = {"default": full_size()}
    text = core.table(per_size, core.summarise(per_size))
    assert "target <= 1.03  met" in text
    assert "target <= 1.0  met" in text
    assert "target <= 0.51  met" in text


# ---------------------------------------------------------------- wire bytes


def test_wire_bytes_per_step_sum_the_replicas_ranks():
    counters = [{"bytes_sent": 600}, {"bytes_sent": 400}]
    assert core.bytes_per_step(counters, 10) == 100.0
    with pytest.raises(ValueError):
        core.bytes_per_step(counters, 0)


def test_a_ring_member_sends_two_n_minus_one_over_n_of_the_payload():
    assert core.ring_wire_bytes(300, 3) == pytest.approx(400)
    assert core.ring_wire_bytes(300, 1) == 0


def test_wire_ratio_is_computed_only_when_the_bf16_run_worked_without_counters():
    runs = [run(Arm.FTL_OVERLAP, 0, 1.0)]
    computed = core.wire_summary(runs, run(Arm.FTL_OVERLAP, -1, 1.0), 1000, 3)
    assert computed["ratio"] == pytest.approx(0.5)
    assert computed["source"] == core.COMPUTED
    assert computed["computed_fp32_bytes_per_step"] == pytest.approx(4000 * 4 / 3)
    failed = core.wire_summary(runs, run(Arm.FTL_OVERLAP, -1, error="no bf16"), 1000, 3)
    assert failed["ratio"] is None and failed["bf16_run_error"] == "no bf16"


# ---------------------------------------------------------------- ft-launch command


def test_the_ft_launch_arms_run_train_py_with_the_contract_flags():
    s = core.RunSettings("100m", TRAIN_SIZES["100m"], 2, 8, threads=2, timeout=60)
    argv = core.ftl_command(s, "py", Path("train.py"), "bf16")
    assert argv[0] == "py"
    train = argv[1:]
    assert train[0] == "train.py"
    flags = dict(zip(train[1::2], train[2::2]))
    assert flags == {"--size": "100m", "--steps": "8", "--parallel": "fsdp",
                     "--param-dtype": "bf16", "--reduce-dtype": "bf16", "--optimizer": "resident-adamw",
                     "--batch-size": "16", "--lr": "0.003", "--seed": "0", "--threads": "2"}


def test_no_overlap_is_the_one_config_difference():
    overlap, no_overlap = core.ftl_config_env(True, 2, 3), core.ftl_config_env(False, 2, 3)
    assert {k: v for k, v in no_overlap.items() if k not in overlap} == {
        "FTL_RUNTIME_OVERLAP_BACKWARD": "false"}
    assert overlap["OMP_NUM_THREADS"] == "2"
    # every quorum waits for all replicas, as the torchft arm's lighthouse does
    assert overlap["FTL_QUORUM_MIN_REPLICAS"] == "3"


def test_the_driver_imports_no_torch():
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import hsdp_bench; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=bench.REPO, timeout=60, check=False)
    assert result.stdout.strip() == "False", result.stderr
