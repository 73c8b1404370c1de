"""benchmarks/gpu_soak.py: one line without a GPU; its lengths, its arithmetic, its calibrations; the loop on the CPU.

The soak itself needs a GPU (``bash benchmarks/gpu_session.sh`` on the next one lent); here its
loop runs on the cpu tracker with the tiny preset, and the summary's arithmetic is checked on
records written by hand.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from batchfit.batches.minibatch import mini_batch_boundaries
from batchfit.errors import InvalidArgument
from batchfit.memory.calibration import calibrated_limits, load_calibration
from script_helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_soak.py"
SESSION = ROOT / "benchmarks" / "gpu_session.sh"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def soak():
    return load_script(SCRIPT, "gpu_soak", register=True)


# --------------------------------------------------------------------------- without a GPU


def test_without_a_gpu_it_prints_one_line_and_exits_0():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [
        "no GPU on this machine (torch.cuda.is_available() is False): nothing to soak; exit 0"
    ]


def test_without_a_gpu_main_writes_nothing(soak, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert soak.main(["--out", str(tmp_path / "soak")]) == 0
    assert capsys.readouterr().out.count("\n") == 1 and not (tmp_path / "soak").exists()


def test_the_session_script_parses():
    assert subprocess.run(["bash", "-n", str(SESSION)], capture_output=True, timeout=30).returncode == 0


@pytest.mark.slow  # three Python starts that import torch: about 12 s on the shared 2-core machine
def test_the_session_script_runs_through_without_a_gpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(["bash", str(SESSION)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "nothing to check; exit 0" in done.stdout and "nothing to soak; exit 0" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.txt", "gpu_check.log", "gpu_soak.log"]
    assert "batchfit from " + str(ROOT / "src") in (tmp_path / "env.txt").read_text()


# --------------------------------------------------------------------------- the lengths

SMALL = {
    "prompts": 8,
    "samples": 4,
    "mini_batch": 2,
    "max_turns": 4,
    "max_prompt_len": 256,
    "max_response_len": 192,
}


def test_lengths_are_deterministic_for_a_seed_and_step(soak):
    w = soak.Workload(**SMALL)
    a, b = soak.rl_lengths(3, w, seed=7), soak.rl_lengths(3, w, seed=7)
    for field in ("uids", "prompts", "responses"):
        assert np.array_equal(getattr(a, field), getattr(b, field))
    assert (a.median, a.sigma, a.truncated) == (b.median, b.sigma, b.truncated)
    other = soak.rl_lengths(3, w, seed=8)
    assert not np.array_equal(a.lengths[: len(other.lengths)], other.lengths[: len(a.lengths)])


def test_the_distribution_changes_every_step(soak):
    w = soak.Workload(**SMALL)
    steps = [soak.rl_lengths(t, w) for t in range(10)]
    assert len({(s.median, s.sigma, s.truncated) for s in steps}) == 10  # each step draws its own
    for prev, cur in itertools.pairwise(steps):
        assert len(prev.lengths) != len(cur.lengths) or not np.array_equal(prev.lengths, cur.lengths)
    assert len({len(s.lengths) for s in steps}) > 1  # step-wise: the sequence count varies too
    medians = [float(np.median(s.responses)) for s in steps]
    assert max(medians) > 1.3 * min(medians)


def test_lengths_respect_the_maximum_lengths(soak):
    w = soak.Workload(**{**SMALL, "max_prompt_len": 64, "max_response_len": 32})
    for t in range(20):
        s = soak.rl_lengths(t, w)
        assert s.prompts.min() >= 8 and s.prompts.max() <= 64
        assert s.responses.min() >= 1 and s.responses.max() <= 32
        assert s.lengths.max() <= w.max_seq_len == 96


def test_lengths_are_long_tailed(soak):
    w = soak.Workload(**{**SMALL, "max_response_len": 4096})
    responses = np.concatenate([soak.rl_lengths(t, w).responses for t in range(20)])
    median = np.median(responses)
    assert responses.mean() > 1.3 * median  # skewed to the right
    assert np.percentile(responses, 99) > 5 * median  # a tail far beyond the median
    at_max = np.mean(responses == 4096)  # generations cut at the limit: 2–8% of each step's
    assert 0.01 <= at_max <= 0.1


def test_trajectories_are_step_wise_with_contiguous_prompts(soak):
    w = soak.Workload(**SMALL)
    s = soak.rl_lengths(0, w)
    assert np.all(np.diff(s.uids) >= 0) and set(s.uids.tolist()) == set(range(w.prompts))
    counts = np.bincount(s.uids)
    assert counts.min() >= w.samples and counts.max() > w.samples  # some trajectories run several turns
    # a later turn's prompt holds the conversation so far: longer than the question
    assert len(mini_batch_boundaries(s.uids.tolist(), w.mini_batch)) == w.prompts // w.mini_batch


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        pytest.param(
            {"prompts": 6, "mini_batch": 4}, "prompts must be a multiple of mini_batch", id="multiple"
        ),
        pytest.param({"max_turns": 6}, "max_turns must be", id="turns"),
        pytest.param({"max_prompt_len": 8}, "max_prompt_len must be", id="prompt-len"),
        pytest.param({"samples": 0}, "samples must be", id="samples"),
    ],
)
def test_a_bad_workload_names_the_field(soak, fields, match):
    with pytest.raises(InvalidArgument, match=match):
        soak.Workload(**fields)


def test_the_rollout_batch_holds_the_lengths_drawn(soak):
    w = soak.Workload(**SMALL)
    s = soak.rl_lengths(1, w)
    batch = soak.rollout_batch(s, w, vocab_size=1024, step=1)
    assert batch["attention_mask"].sum(-1).tolist() == s.lengths.tolist()
    assert (batch["loss_mask"] != 0).sum(-1).tolist() == s.responses.tolist()
    assert batch["uid"] == s.uids.tolist() and batch["input_ids"].shape == (len(s.uids), w.max_seq_len)


# --------------------------------------------------------------------------- the arithmetic

# A device of 100,000 B; the budget kept 4,000 B off it (usable 96,000) and allowed 0.85 × 96,000 = 81,600.
BUDGET = {
    "tokens": 1000, "memory_limit": 100_000, "reserve_bytes": 4_000, "usable_bytes": 96_000, "limit_bytes": 81_600,
    "safety_margin": 0.85, "base": 0.0, "linear": 78.0, "quadratic": 0.0, "source": "estimate", "seconds": 1.0,
}  # fmt: skip


def _micro(peak, peak_reserved, allocated, reserved, free, predicted, tokens=1000, step=0):
    return {
        "kind": "micro_batch", "step": step, "mini_batch": 0, "position": 0, "sequences": 4, "tokens": tokens,
        "longest": 400, "predicted": predicted, "allocated": allocated, "reserved": reserved,
        "peak_allocated": peak, "peak_reserved": peak_reserved, "free": free, "seconds": 0.5,
    }  # fmt: skip


def _run(records, ooms=(), allocator="caching", verified=True, model="m"):
    return {
        "model": model, "allocator": allocator, "backend": "cuda", "device": "GPU", "device_total_bytes": 100_000,
        "budget": BUDGET, "records": list(records), "ooms": list(ooms), "allocator_verified": verified,
        "torch_version": "2.x", "batchfit_version": "",
    }  # fmt: skip


RECORDS = [
    # untracked = total − free − reserved = 100,000 − 10,000 − 88,000 = 2,000; predicted ≥ 0.5 × 81,600 = 40,800
    _micro(80_000, 88_000, 20_000, 88_000, 10_000, predicted=78_000),
    # untracked 100,000 − 9,500 − 88,000 = 2,500; predicted 40,000 < 40,800: not in the ratio
    _micro(40_000, 88_000, 20_000, 88_000, 9_500, predicted=40_000, tokens=500, step=1),
    # the optimizer step: untracked 100,000 − 7,800 − 90,000 = 2,200; the cache holds 90,000 − 20,000 = 70,000
    {"kind": "optimizer_step", "step": 1, "mini_batch": 0, "allocated": 20_000, "reserved": 90_000,
     "peak_allocated": 30_000, "peak_reserved": 90_000, "free": 7_800},
]  # fmt: skip


def test_the_summary_of_a_run(soak):
    s = soak.summarize(_run(RECORDS))
    assert (s["micro_batches"], s["optimizer_steps"], s["training_steps"], s["ooms"]) == (2, 1, 2, 0)
    assert s["tokens_per_micro_batch"] == 750  # (1,000 + 500) / 2
    assert (s["peak_allocated_bytes"], s["peak_reserved_bytes"]) == (80_000, 90_000)
    assert (s["overhead_bytes"], s["overhead_fraction"]) == (
        10_000,
        0.125,
    )  # 90,000 − 80,000; 10,000 / 80,000
    assert (s["largest_gap_bytes"], s["untracked_bytes"]) == (70_000, 2_500)
    assert s["left_bytes"] == 7_500  # 100,000 − 2,500 − 90,000
    assert s["peak_of_usable"] == pytest.approx(0.833333, abs=1e-6)  # 80,000 / 96,000
    assert s["reserved_of_usable"] == 0.9375  # 90,000 / 96,000
    assert s["peak_of_limit"] == pytest.approx(0.980392, abs=1e-6)  # 80,000 / 81,600
    assert s["estimate_ratio"] == pytest.approx(1.025641, abs=1e-6)  # 80,000 / 78,000
    assert s["margin_held"] is True  # no out of memory, 90,000 ≤ 96,000
    # 0.98 / (1.025641 × 1.125) = 0.98 / 1.153846 = 0.84933… → 0.849
    assert s["calibrated_margin"] == 0.849


def test_an_out_of_memory_counts_in_the_peaks_and_breaks_the_margin(soak):
    oom = {"kind": "oom", "where": "micro_batch", "step": 2, "mini_batch": 0, "position": 1, "sequences": 5,
           "tokens": 1000, "message": "CUDA out of memory", "allocated": 21_000, "reserved": 95_000,
           "peak_allocated": 85_000, "peak_reserved": 95_000, "free": 3_000}  # fmt: skip
    s = soak.summarize(_run(RECORDS, [oom]))
    assert (s["ooms"], s["micro_batches"], s["margin_held"]) == (1, 2, False)
    assert (s["peak_allocated_bytes"], s["peak_reserved_bytes"]) == (85_000, 95_000)
    assert s["overhead_fraction"] == pytest.approx(0.117647, abs=1e-6)  # (95,000 − 85,000) / 85,000
    assert s["untracked_bytes"] == 2_500  # the OOM's 100,000 − 3,000 − 95,000 = 2,000 is less


def test_a_reserved_peak_beyond_the_usable_memory_breaks_the_margin_without_an_out_of_memory(soak):
    # 97,000 reserved > 96,000 usable: the run lived on the reserve the budget kept for memory outside torch
    s = soak.summarize(_run([_micro(80_000, 97_000, 20_000, 97_000, 1_000, predicted=78_000)]))
    assert (s["ooms"], s["margin_held"], s["left_bytes"]) == (0, False, 1_000)  # 100,000 − 2,000 − 97,000


def test_a_run_without_a_micro_batch_has_no_verdict(soak):
    s = soak.summarize(_run([]))
    assert (s["micro_batches"], s["margin_held"], s["calibrated_margin"], s["estimate_ratio"]) == (
        0,
        None,
        None,
        None,
    )


def test_a_calibration_takes_the_worst_run_of_one_setting_and_names_it(soak, tmp_path):
    small = _run([_micro(50_000, 60_000, 10_000, 60_000, 35_000, predicted=49_000)], model="small")
    # small: untracked 100,000 − 35,000 − 60,000 = 5,000; overhead 10,000 = 20% of 50,000; ratio 50,000 / 49,000
    cal = soak.soak_calibration([_run(RECORDS), small])
    assert (cal.untracked_bytes, cal.allocator_overhead_bytes) == (5_000, 10_000)
    assert (cal.allocator_overhead_fraction, cal.estimate_ratio) == (
        0.2,
        1.025641,
    )  # 0.2 > 0.125; 1.025641 > 1.020408
    assert (cal.allocator, cal.model, cal.backend, cal.device_total_bytes) == (
        "caching",
        "m, small",
        "cuda",
        100_000,
    )
    assert [(r.estimated_bytes, r.measured_bytes, r.reserved_bytes) for r in cal.runs] == [
        (78_000, 80_000, 88_000),
        (49_000, 50_000, 60_000),
    ]
    path = tmp_path / "calibration-caching.json"
    cal.save(path)
    again = load_calibration(path)
    assert again == cal and again.allocator == "caching"
    # 0.98 / (1.025641 × 1.2) = 0.98 / 1.230769 = 0.79625 → 0.796
    assert calibrated_limits(again).safety_margin == 0.796


def test_a_calibration_of_an_unverified_setting_names_none(soak):
    assert soak.soak_calibration([_run(RECORDS, verified=False)]).allocator == ""
    assert soak.soak_calibration([_run([])]) is None


def test_a_calibration_refuses_runs_of_two_settings(soak):
    with pytest.raises(InvalidArgument, match="the runs differ in allocator"):
        soak.soak_calibration([_run(RECORDS), _run(RECORDS, allocator="expandable_segments")])


def test_the_description_states_the_verdict_and_the_margin(soak):
    run = {**_run(RECORDS), "seconds": 42.0, "stopped_by": "micro_batches"}
    lines = soak.describe(soak.summarize(run), run)
    assert lines[0].startswith("m, caching: 2 micro-batches (2 training steps, 1 optimizer steps")
    assert "0 out of memory, 42 s, stopped by micro_batches" in lines[0]
    assert "budget 1,000 tokens (estimate;" in lines[1]
    assert (
        "(12.5% of allocated)" in lines[3] and lines[4] == "  margin 0.85 held: yes; calibrated margin 0.849"
    )


# --------------------------------------------------------------------------- the soak's processes


def test_each_setting_runs_with_its_allocator_config_alone(soak):
    base = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64",
            "PYTHONPATH": "/elsewhere"}  # fmt: skip
    caching, expandable = soak.child_env("caching", base), soak.child_env("expandable_segments", base)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in caching and "PYTORCH_ALLOC_CONF" not in caching
    assert (
        expandable["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
        and "PYTORCH_ALLOC_CONF" not in expandable
    )
    assert caching["PYTHONPATH"] == os.pathsep.join([str(ROOT / "src"), "/elsewhere"])


def _args(soak, tmp_path, *extra):
    return soak.build_parser().parse_args(
        [
            "--device",
            "cpu",
            "--models",
            "tiny,other",
            "--micro-batches",
            "3",
            "--out",
            str(tmp_path / "out"),
            *extra,
        ]
    )


def test_the_soak_runs_every_model_and_setting_and_writes_a_calibration_per_setting(
    soak, tmp_path, monkeypatch
):
    seen = []

    def fake_child(command, env, timeout):
        flags = dict(itertools.pairwise(command))  # "--flag value" pairs (and some noise)
        seen.append(
            (
                flags["--model"],
                flags["--allocator"],
                env.get("PYTORCH_CUDA_ALLOC_CONF"),
                flags.get("--budget-json"),
            )
        )
        budget = {**BUDGET, "tokens": 1000 + len(seen)}
        run = {**_run(RECORDS, model=flags["--model"], allocator=flags["--allocator"]), "backend": "cpu", "device": "cpu",
               "budget": json.loads(flags["--budget-json"]) if "--budget-json" in flags else budget,
               "seconds": 1.0, "stopped_by": "micro_batches", "allocator_verified": True}  # fmt: skip
        Path(flags["--result"]).write_text(json.dumps(run))
        assert float(flags["--deadline"]) > time.time() and timeout > float(flags["--deadline"]) - time.time()
        return 0, ""

    monkeypatch.setattr(soak, "run_child", fake_child)
    lines = []
    doc = soak.soak(_args(soak, tmp_path), echo=lines.append)
    assert [s[:3] for s in seen] == [
        ("tiny", "caching", None), ("tiny", "expandable_segments", "expandable_segments:True"),
        ("other", "caching", None), ("other", "expandable_segments", "expandable_segments:True"),
    ]  # fmt: skip
    # the second setting of a model reuses the first's budget
    assert [s[3] is None for s in seen] == [True, False, True, False]
    assert json.loads(seen[1][3])["tokens"] == 1001 and json.loads(seen[3][3])["tokens"] == 1003
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "calibration-caching.json", "calibration-expandable_segments.json", "soak.json",
    ]  # fmt: skip
    cal = load_calibration(out / "calibration-expandable_segments.json")
    assert (cal.model, cal.backend, cal.allocator) == ("tiny, other", "cpu", "")  # cpu: no allocator to name
    assert json.loads((out / "soak.json").read_text())["runs"][0]["summary"]["micro_batches"] == 2
    assert doc["calibrations"]["caching"]["safety_margin"] == 0.849
    assert lines[-1].startswith("margin 0.85 held in 4 of 4 runs (0 did not, 0 without a measurement)")
    assert any(line.startswith("calibration (caching, cpu: no allocator): ") for line in lines)


def test_a_run_killed_at_its_time_or_out_of_time_is_reported_not_fatal(soak, tmp_path, monkeypatch):
    monkeypatch.setattr(soak, "run_child", lambda command, env, timeout: (None, "stuck"))
    lines = []
    doc = soak.soak(_args(soak, tmp_path, "--models", "tiny", "--allocators", "caching"), echo=lines.append)
    assert doc["runs"][0]["error"].startswith("killed 60 s after its share of the time")
    assert doc["runs"][0]["stderr"] == "stuck" and doc["calibrations"] == {}
    assert lines[-1].startswith("margin 0.85 held in 0 of 1 runs (0 did not, 1 without a measurement)")
    monkeypatch.setattr(soak, "MIN_RUN_SECONDS", 1e9)  # no run has the time it needs
    doc = soak.soak(_args(soak, tmp_path, "--models", "tiny", "--allocators", "caching"), echo=lines.append)
    assert doc["runs"][0]["error"].startswith("skipped: ")


# --------------------------------------------------------------------------- the loop on the CPU

TINY = {
    "prompts": 2,
    "samples": 2,
    "mini_batch": 1,
    "max_turns": 2,
    "max_prompt_len": 64,
    "max_response_len": 64,
}


def _tiny_soak(soak, micro_batches=5, deadline=float("inf")):
    budget = soak.SoakBudget.given(256, 64 * 2**20)
    return soak.run_soak(
        "tiny", budget, soak.Workload(**TINY), micro_batches=micro_batches, deadline=deadline, device="cpu",
        dtype="fp32",
    )  # fmt: skip


def test_the_loop_trains_micro_batches_under_the_budget_on_the_cpu_tracker(soak):
    state = _tiny_soak(soak)
    micro = [r for r in state["records"] if r["kind"] == "micro_batch"]
    steps = [r for r in state["records"] if r["kind"] == "optimizer_step"]
    assert (state["micro_batches"], len(micro), state["stopped_by"], state["ooms"]) == (
        5,
        5,
        "micro_batches",
        [],
    )
    assert all(0 < r["tokens"] <= 256 and r["peak_allocated"] >= r["allocated"] > 0 for r in micro)
    assert all(r["reserved"] == r["allocated"] for r in state["records"])  # the cpu: no allocator
    # an optimizer step at each finished mini-batch, after its micro-batches
    assert 1 <= len(steps) == state["optimizer_steps"] <= 5 and state["records"][0]["kind"] == "micro_batch"
    assert json.loads(json.dumps(state)) == state  # JSON as it is


def test_an_out_of_memory_drops_its_mini_batch_and_the_run_goes_on(soak, monkeypatch):
    real, calls = soak.train_micro_batch, []

    def second_runs_out(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        real(*args)

    monkeypatch.setattr(soak, "train_micro_batch", second_runs_out)
    state = _tiny_soak(soak, micro_batches=4)
    (oom,) = state["ooms"]
    assert (oom["where"], oom["message"]) == ("micro_batch", "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert {"peak_allocated", "reserved_after", "allocated_after"} <= set(oom)
    assert state["micro_batches"] == 4 and len(calls) == 5  # the failed one is not counted; the run went on
    # the failed micro-batch's mini-batch took no optimizer step
    assert not any(r["kind"] == "optimizer_step" and (r["step"], r["mini_batch"]) == (oom["step"], oom["mini_batch"])
                   for r in state["records"])  # fmt: skip


def test_anything_but_an_out_of_memory_is_raised(soak, monkeypatch):
    def broken(*args):
        raise ValueError("a bug in the step")

    monkeypatch.setattr(soak, "train_micro_batch", broken)
    with pytest.raises(ValueError, match="a bug in the step"):
        _tiny_soak(soak)


def test_the_loop_stops_cleanly_at_its_deadline(soak):
    state = _tiny_soak(soak, deadline=time.time() - 1)
    assert (state["stopped_by"], state["micro_batches"], state["records"]) == ("minutes", 0, [])


def test_a_run_writes_its_result_with_the_setting_it_ran(soak, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    result = tmp_path / "run.json"
    workload = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    args = soak.build_parser().parse_args([
        "--child", "--device", "cpu", "--model", "tiny", "--allocator", "expandable_segments", "--dtype", "fp32",
        "--token-budget", "256", "--micro-batches", "2", "--result", str(result), *workload,
    ])  # fmt: skip
    assert soak.child_main(args) == 0
    run = json.loads(result.read_text())
    assert (run["allocator_setting"], run["allocator_verified"], run["error"]) == (
        "expandable_segments",
        True,
        None,
    )
    assert (run["device"], run["device_total_bytes"], run["budget"]["tokens"], run["micro_batches"]) == (
        "cpu",
        64 * 2**20,
        256,
        2,
    )
    summary = soak.summarize(run)
    assert summary["micro_batches"] == 2 and summary["margin_held"] is True


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        pytest.param(
            ["--allocators", "async"], "--allocators must name caching and/or expandable_segments", id="alloc"
        ),
        pytest.param(["--micro-batches", "0"], "--micro-batches must be >= 1", id="micro-batches"),
        pytest.param(
            ["--prompts", "6", "--mini-batch", "4"], "prompts must be a multiple of mini_batch", id="workload"
        ),
    ],
)
def test_a_bad_flag_is_one_line_exit_2(soak, capsys, argv, match):
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err.strip().splitlines()[-1]  # argparse's usage, then one line


def test_a_run_that_only_runs_out_of_memory_stops(soak, monkeypatch):
    def always(*args):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(soak, "train_micro_batch", always)
    monkeypatch.setattr(soak, "MAX_OOMS", 3)
    state = _tiny_soak(soak)
    assert (state["stopped_by"], len(state["ooms"]), state["micro_batches"], state["optimizer_steps"]) == (
        "ooms",
        3,
        0,
        0,
    )


def test_the_cuda_meter_reads_the_allocator_and_resets_its_peaks(soak, monkeypatch):
    cuda, resets = torch.cuda, []
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 1000})())
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (300, 1000))
    monkeypatch.setattr(cuda, "memory_allocated", lambda d=None: 200)
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: 650)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: 600)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: 680)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: resets.append(d))
    meter = soak.CudaMeter(torch.device("cuda", 0))
    assert meter.read() == {
        "allocated": 200,
        "reserved": 650,
        "peak_allocated": 600,
        "peak_reserved": 680,
        "free": 300,
    }
    assert len(resets) == 1 and meter.total == 1000
    segments = [{"device": 0, "is_expandable": True}, {"device": 1, "is_expandable": False}]
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: segments)
    assert meter.expandable_segments() is True
    segments[0]["is_expandable"] = False
    assert meter.expandable_segments() is False
    del segments[0]["is_expandable"]  # a torch that does not say
    assert meter.expandable_segments() is None
