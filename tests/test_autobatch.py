"""batchfit.autobatch: the pure search, find_batch_size on the cpu backend, tasks, reports, two gloo ranks."""

from __future__ import annotations

import csv
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.autobatch import (
    BatchSizeResult,
    TaskTrial,
    Trial,
    build_task,
    find_batch_size,
    load_task,
    max_trials,
    model_guess,
    report_rows,
    search_largest,
    sweep,
    write_report,
)
from batchfit.autobatch.builtin_tasks import causal_lm, vision_cnn
from batchfit.autobatch.report import REPORT_FIELDS, trial_log_text
from batchfit.errors import BatchfitError, DoesNotFitError, InvalidArgument
from batchfit.memory import get_backend
from multirank import run_ranks

pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- search_largest (model_guess on the shared search; bounds in test_search.py)


def _linear_probe(base: int, per_sample: int, target: int, quadratic: int = 0):
    def probe(b: int) -> Trial:
        peak = base + per_sample * b + quadratic * b * b
        return Trial(b, peak, peak <= target)

    return probe


def test_bool_probe_bisects_to_the_threshold():
    result = search_largest(lambda n: n <= 95, low=1, high=512)
    assert result.batch_size == 95
    assert len(result.trials) <= 12  # max_trials(1, 512)
    assert {t.batch_size for t in result.trials} >= {95, 96}  # 95 fits and 96 was seen not to


def test_exact_linear_memory_is_found_in_four_trials():
    # base 10_000 + 100/sample, target 14_000 -> largest fitting is (14_000 - 10_000) / 100 = 40.
    # min 1 (peak 10_100); base-0 guess 14_000 * 1 // 10_100 = 1 -> 2; secant through (1, 2) -> 40;
    # 40 - 1 < 512 - 40 - 1 so 41 is probed first (expected over), then 40 (expected to fit).
    result = search_largest(_linear_probe(10_000, 100, 14_000), low=1, high=512, target_bytes=14_000)
    assert result.batch_size == 40
    assert [t.batch_size for t in result.trials] == [1, 2, 41, 40]
    assert [t.chosen_by for t in result.trials] == ["min", "model", "model", "model"]
    assert result.peak_bytes == 14_000  # 10_000 + 40 * 100


def test_model_guess_uses_the_secant_or_a_zero_base():
    assert model_guess([Trial(1, 300, True), Trial(4, 600, True)], 1000) == 8  # 4 + (1000 - 600) // 100
    assert model_guess([Trial(2, 400, True)], 1000) == 5  # base 0: 1000 * 2 // 400
    assert model_guess([Trial(2, 400, True), Trial(6, 400, True)], 1000) is None  # flat peak
    assert model_guess([Trial(2, None, True)], 1000) is None  # no exact peak
    # an aborted run's lower-bound peak is a secant partner: 1 + (1000 - 300) * 8 // 600
    assert model_guess([Trial(1, 300, True), Trial(9, 900, False, exact=False)], 1000) == 10
    assert model_guess([Trial(1, 300, False)], 1000) is None  # nothing fit


@settings(max_examples=200, deadline=None)
@given(
    low=st.integers(1, 50),
    span=st.integers(0, 2000),
    threshold=st.integers(1, 2100),
)
def test_threshold_search_is_correct_and_bounded(low, span, threshold):
    high = low + span
    if threshold < low:
        with pytest.raises(DoesNotFitError, match=f"low={low} does not fit"):
            search_largest(lambda n: n <= threshold, low=low, high=high)
        return
    result = search_largest(lambda n: n <= threshold, low=low, high=high)
    assert result.batch_size == min(threshold, high)
    assert len(result.trials) <= max_trials(low, high) == math.ceil(math.log2(high - low + 1)) + 3


@settings(max_examples=200, deadline=None)
@given(
    base=st.integers(0, 10**9),
    per_sample=st.integers(1, 10**7),
    quadratic=st.integers(0, 10**4),
    headroom=st.integers(0, 10**10),
    high=st.integers(1, 4096),
)
def test_memory_model_search_is_correct_and_bounded(base, per_sample, quadratic, headroom, high):
    target = base + per_sample + quadratic + headroom  # batch 1 always fits
    result = search_largest(
        _linear_probe(base, per_sample, target, quadratic), low=1, high=high, target_bytes=target
    )
    fits = [b for b in range(1, high + 1) if base + per_sample * b + quadratic * b * b <= target]
    assert result.batch_size == max(fits)
    assert len(result.trials) <= max_trials(1, high)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), low=st.integers(1, 20), span=st.integers(0, 600))
def test_any_probe_stays_within_the_bound_and_brackets_the_answer(data, low, span):
    # verdicts and peaks are arbitrary (not monotone): the bound and the bracket still hold
    high = low + span

    def probe(b: int) -> Trial:
        fits = b == low or data.draw(st.booleans(), label=f"fits({b})")
        peak = data.draw(st.integers(0, 10**6), label=f"peak({b})")
        return Trial(b, peak, fits)

    result = search_largest(probe, low=low, high=high, target_bytes=500_000)
    assert len(result.trials) <= max_trials(low, high)
    verdict = {t.batch_size: t.fits for t in result.trials}
    assert verdict[result.batch_size]
    assert result.batch_size == high or verdict[result.batch_size + 1] is False


def test_search_reports_each_trial_as_it_is_decided():
    seen: list[Trial] = []
    result = search_largest(lambda n: n <= 10, low=1, high=64, on_trial=seen.append)
    assert tuple(seen) == result.trials


def test_smallest_candidate_over_target_says_by_how_much():
    with pytest.raises(
        DoesNotFitError,
        match=r"low=4 does not fit: its peak is 1,500 bytes against 1,000 allowed \(over by 500 bytes\)",
    ) as info:
        search_largest(lambda b: Trial(b, 1500, False), low=4, high=9, target_bytes=1000)
    assert (info.value.needed, info.value.available) == (1500, 1000)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"low": 0, "high": 4}, id="low-zero"),
        pytest.param({"low": 5, "high": 4}, id="high-below-low"),
        pytest.param({"low": True, "high": 4}, id="low-bool"),
        pytest.param({"low": 1, "high": 4.5}, id="high-float"),
        pytest.param({"low": 1, "high": 4, "target_bytes": -1}, id="target-negative"),
    ],
)
def test_search_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        search_largest(lambda n: True, **kwargs)


# --------------------------------------------------------------------------- find_batch_size, cpu backend


@pytest.fixture(scope="module")
def cpu4() -> object:
    return get_backend("cpu", memory_limit="4MiB")


def _small_vision() -> object:
    return vision_cnn(width=4, image_size=16)


@pytest.mark.parametrize(
    "factory, limit",
    [
        pytest.param(_small_vision, "1MiB", id="vision-cnn"),
        pytest.param(lambda: causal_lm(seq_len=32), "8MiB", id="causal-lm"),
    ],
)
def test_chosen_size_fits_and_one_more_does_not_for_train_and_val(factory, limit):
    backend = get_backend("cpu", memory_limit=limit)
    task = build_task(factory, backend)
    chosen = {}
    for mode in ("train", "val"):
        trial = TaskTrial(task, mode)
        result = find_batch_size(trial, mode=mode, backend=backend, progress=False, max_batch_size=200)
        b = result.batch_size
        assert 1 <= b < 200
        assert result.target_bytes == math.floor(0.8 * backend.limit_bytes)
        assert len(result.trials) <= math.ceil(math.log2(200)) + 3  # 8 + 3 = 11
        at_b = backend.measure(
            lambda b=b, trial=trial: [trial(b) for _ in range(2)], register=trial.persistent
        )
        above = backend.measure(
            lambda b=b, trial=trial: [trial(b + 1) for _ in range(2)], register=trial.persistent
        )
        assert at_b.peak_bytes <= result.target_bytes < above.peak_bytes  # measured again, not recalled
        assert result.next_peak_bytes is not None and result.next_peak_bytes > result.target_bytes
        chosen[mode] = b
    assert chosen["val"] > chosen["train"]  # no gradients, optimizer state or saved activations


def test_task_and_callable_forms_agree(cpu4):
    task = build_task(_small_vision, cpu4)
    via_task = find_batch_size(task, mode="val", backend=cpu4, progress=False)
    trial = TaskTrial(task, "val")
    via_callable = find_batch_size(
        lambda b: trial(b), mode="val", backend=cpu4, progress=False, register=(task.model,)
    )
    assert via_task.batch_size == via_callable.batch_size
    assert [t.to_dict() for t in via_task.trials] == [t.to_dict() for t in via_callable.trials]


def test_a_name_and_memory_limit_build_the_backend():
    result = find_batch_size(
        lambda b: torch.zeros(b, 256), backend="cpu", memory_limit=1 << 20, progress=False
    )
    # 1 KiB per sample, target floor(0.8 * 1 MiB) = 838_860 bytes -> 819 samples, capped at max 512
    assert (result.batch_size, result.backend, result.limit_bytes) == (512, "cpu", 1 << 20)


def test_an_answer_at_max_batch_size_says_it_is_capped():
    backend = get_backend("cpu", memory_limit="1MiB")
    # 1 KiB per sample: 819 would fit under the target 838_860, the bound 100 stops the search
    capped = find_batch_size(
        lambda b: torch.zeros(b, 256), backend=backend, max_batch_size=100, progress=False
    )
    assert (capped.batch_size, capped.max_batch_size, capped.capped_by_max_batch_size) == (100, 100, True)
    row = capped.to_row()
    assert (row["max_batch_size"], row["capped_by_max_batch_size"]) == (100, True)
    # 4 KiB per sample: 838_860 // 4096 = 204 fits, 205 does not; the bound 512 is not reached
    found = find_batch_size(lambda b: torch.zeros(b, 1024), backend=backend, progress=False)
    assert (found.batch_size, found.capped_by_max_batch_size) == (204, False)
    assert found.to_row()["capped_by_max_batch_size"] is False


def test_synthetic_step_size_is_exact():
    # 4 KiB per sample (1024 fp32), target floor(0.8 * 1 MiB) = 838_860 -> 838_860 // 4096 = 204
    backend = get_backend("cpu", memory_limit="1MiB")
    result = find_batch_size(lambda b: torch.zeros(b, 1024), backend=backend, progress=False)
    assert result.batch_size == 204
    assert result.peak_bytes == 204 * 4096
    assert len(result.trials) <= 12


def test_val_mode_runs_a_plain_callable_in_eval_and_no_grad(cpu4):
    model = torch.nn.Linear(8, 8)
    seen = []

    def trial(b: int) -> None:
        seen.append((model.training, torch.is_grad_enabled()))
        model(torch.zeros(b, 8))

    find_batch_size(trial, mode="val", backend=cpu4, register=model, progress=False, max_batch_size=4)
    assert set(seen) == {(False, False)}
    assert model.training  # restored


def test_train_mode_counts_optimizer_state(cpu4):
    task = build_task(_small_vision, cpu4)
    trial = TaskTrial(task, "train")
    find_batch_size(trial, backend=cpu4, progress=False, max_batch_size=2)
    n_params = sum(p.numel() for p in task.model.parameters())
    m = cpu4.measure(lambda: trial(1), register=trial.persistent)
    # AdamW keeps exp_avg and exp_avg_sq (2 × 4 bytes per parameter) plus a step counter per tensor
    assert m.breakdown.get("optimizer_state", 0) >= 2 * 4 * n_params


def test_progress_callback_receives_every_trial_in_order(cpu4):
    seen: list[Trial] = []
    result = find_batch_size(
        lambda b: torch.zeros(b, 64), backend=cpu4, progress=seen.append, max_batch_size=100
    )
    assert tuple(seen) == result.trials


def test_min_batch_size_over_target_says_by_how_much(cpu4):
    # 1 MiB per sample; the run is aborted at the 4 MiB limit, so the peak is a lower bound
    with pytest.raises(
        DoesNotFitError, match=r"even min_batch_size=5 does not fit in train mode: .* by at least"
    ) as info:
        find_batch_size(lambda b: torch.zeros(b, 1 << 18), backend=cpu4, min_batch_size=5, progress=False)
    # the library names its keyword arguments (NOTE [ Messages in the caller's vocabulary ])
    assert str(info.value).endswith(
        "to make it fit: lower min_batch_size; raise target_memory_fraction or memory_limit; use a smaller model"
    )
    assert info.value.breakdown and info.value.usable_bytes == 4 * 1024**2


def test_min_batch_size_of_one_that_does_not_fit_offers_no_lower_min_batch_size(cpu4):
    # 5 MiB per sample against the 4 MiB limit: even batch 1 does not fit, and nothing is lower than 1
    with pytest.raises(DoesNotFitError, match=r"even min_batch_size=1 does not fit") as info:
        find_batch_size(lambda b: torch.zeros(b, 5 << 18), backend=cpu4, progress=False)
    assert "lower min_batch_size" not in str(info.value)
    assert str(info.value).endswith(
        "to make it fit: raise target_memory_fraction or memory_limit; use a smaller model"
    )


def test_a_trial_error_is_raised_unchanged(cpu4):
    def trial(b: int) -> None:
        raise KeyError("broken batch")

    with pytest.raises(KeyError, match="broken batch"):
        find_batch_size(trial, backend=cpu4, progress=False)


def test_true_progress_logs_and_never_prints(cpu4, capsys, caplog):
    with caplog.at_level("INFO", logger="batchfit.autobatch"):
        result = find_batch_size(lambda b: torch.zeros(b, 64), backend=cpu4, max_batch_size=8)
    assert capsys.readouterr() == ("", "")
    assert len([r for r in caplog.records if r.name == "batchfit.autobatch"]) == len(result.trials)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"mode": "test"}, "mode must be one of 'train', 'val'", id="mode-unknown"),
        pytest.param(
            {"target_memory_fraction": 0}, r"target_memory_fraction must be in \(0, 1\]", id="fraction-zero"
        ),
        pytest.param(
            {"target_memory_fraction": 1.5},
            r"target_memory_fraction must be in \(0, 1\]",
            id="fraction-above-one",
        ),
        pytest.param({"min_batch_size": 0}, "min_batch_size must be an integer >= 1", id="min-zero"),
        pytest.param(
            {"min_batch_size": 8, "max_batch_size": 4},
            "max_batch_size must be >= min_batch_size=8",
            id="max-below-min",
        ),
        pytest.param({"max_batch_size": True}, "max_batch_size must be an integer", id="max-bool"),
        pytest.param({"steps_per_trial": 0}, "steps_per_trial must be an integer >= 1", id="steps-zero"),
        pytest.param({"progress": "yes"}, "progress must be a bool or a callable", id="progress-string"),
        pytest.param({"backend": "tpu"}, "backend must be one of", id="backend-unknown"),
        pytest.param({"backend": "cpu"}, "a memory limit is needed", id="no-memory-limit"),
    ],
)
def test_find_batch_size_rejects_bad_arguments(kwargs, match):
    kwargs = {"backend": get_backend("cpu", memory_limit="1MiB"), **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        find_batch_size(lambda b: None, progress=kwargs.pop("progress", False), **kwargs)


def test_find_batch_size_rejects_a_non_callable_trial(cpu4):
    with pytest.raises(InvalidArgument, match="trial must be a Task or a callable"):
        find_batch_size(42, backend=cpu4)


def test_a_task_trial_of_another_mode_is_rejected(cpu4):
    trial = TaskTrial(build_task(_small_vision, cpu4), "train")
    with pytest.raises(InvalidArgument, match="built for mode='train'"):
        find_batch_size(trial, mode="val", backend=cpu4, progress=False)


# --------------------------------------------------------------------------- tasks


@pytest.mark.parametrize(
    "spec, match",
    [
        pytest.param("causl-lm", "did you mean 'causal-lm'", id="misspelt-builtin"),
        pytest.param(
            "no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'", id="missing-module"
        ),
        pytest.param("batchfit.autobatch.task:nope", "has no callable 'nope'", id="missing-function"),
        pytest.param("/no/such/file.py:make", "does not exist", id="missing-file"),
        pytest.param("", "task must be a string", id="empty"),
    ],
)
def test_load_task_rejects_unknown_tasks(spec, match):
    with pytest.raises(InvalidArgument, match=match):
        load_task(spec)


def test_build_task_names_what_a_task_lacks(cpu4):
    with pytest.raises(InvalidArgument, match=r"lacks make_batch\(batch_size, mode\), loss\(model, batch\)"):
        build_task(lambda: type("T", (), {"model": torch.nn.Linear(1, 1)})(), cpu4)


def test_example_task_file_loads_and_runs(cpu4):
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "autobatch_task.py")
    result = sweep(
        f"{path}:make_task",
        fractions=[0.8],
        modes=["val"],
        memory_limit="4MiB",
        backend="cpu",
        max_batch_size=16,
    )
    assert result[0].batch_size >= 1


@pytest.mark.parametrize(
    "factory, limit",
    [
        pytest.param(_small_vision, "1MiB", id="vision-cnn"),
        # the first tier's time (issue 41): vision-cnn's sweep stays, and the causal LM's cpu search above
        pytest.param(lambda: causal_lm(seq_len=32), "8MiB", id="causal-lm", marks=pytest.mark.slow),
    ],
)
def test_estimate_backend_matches_cpu_without_reserve_or_rounding(factory, limit):
    kwargs = dict(fractions=[0.8], modes=["train", "val"], max_batch_size=64)
    on_cpu = sweep(factory, backend="cpu", memory_limit=limit, **kwargs)
    estimate = get_backend("estimate", memory_limit=limit, reserve_bytes=0, round_to=1)
    estimated = sweep(factory, backend=estimate, **kwargs)
    assert [r.batch_size for r in estimated] == [r.batch_size for r in on_cpu]
    assert [r.peak_bytes for r in estimated] == [r.peak_bytes for r in on_cpu]


# --------------------------------------------------------------------------- reports


def _result(mode: str, fraction: float) -> BatchSizeResult:
    trials = (
        Trial(1, 100, True, chosen_by="min"),
        Trial(9, 950, False, exact=False, chosen_by="model"),
        Trial(8, 800, True, chosen_by="model"),
    )
    return BatchSizeResult(8, mode, fraction, 900, 1000, 800, trials, 12, "cpu", max_batch_size=16)


def test_report_rows_have_the_schema_in_order():
    rows = report_rows([_result("train", 0.9)])
    assert tuple(rows[0]) == REPORT_FIELDS
    assert rows[0]["trials"] == 3
    assert rows[0]["trial_log"][1] == {
        "batch_size": 9,
        "peak_bytes": 950,
        "fits": False,
        "exact": False,
        "chosen_by": "model",
    }


def test_jsonl_and_csv_reports_round_trip(tmp_path):
    rows = report_rows([_result("train", 0.9), _result("val", 0.9)])
    assert write_report(tmp_path / "r.jsonl", rows) == "jsonl"
    assert [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()] == rows
    assert write_report(tmp_path / "r.csv", rows) == "csv"
    with open(tmp_path / "r.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert tuple(table[0]) == REPORT_FIELDS
    assert table[1]["mode"] == "val" and table[1]["batch_size"] == "8"
    assert table[0]["trial_log"] == "1:100:fit 9:>=950:over 8:800:fit"


def test_trial_log_text_marks_lower_bounds():
    assert trial_log_text([{"batch_size": 3, "peak_bytes": None, "fits": True}]) == "3:?:fit"


def test_unknown_report_extension_is_rejected(tmp_path):
    with pytest.raises(InvalidArgument, match=r"output must end in .jsonl or .csv"):
        write_report(tmp_path / "r.txt", [])


# --------------------------------------------------------------------------- sweep


def test_sweep_returns_modes_times_fractions_in_order():
    results = sweep(
        _small_vision, fractions=[0.5, 0.9], modes=["val", "train"], memory_limit="1MiB", backend="cpu"
    )
    assert [(r.mode, r.memory_fraction) for r in results] == [
        ("val", 0.5),
        ("val", 0.9),
        ("train", 0.5),
        ("train", 0.9),
    ]
    assert results[0].batch_size <= results[1].batch_size  # a larger fraction never chooses less


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"fractions": [0.5, 0]}, r"fraction must be in \(0, 1\]", id="fraction-zero"),
        pytest.param({"fractions": [1.01]}, r"fraction must be in \(0, 1\]", id="fraction-above-one"),
        pytest.param({"fractions": []}, "fractions must be a non-empty list", id="no-fractions"),
        pytest.param({"modes": ["train", "eval"]}, "mode must be one of", id="mode-unknown"),
        pytest.param({"modes": "train"}, "modes must be a non-empty list", id="modes-string"),
        pytest.param(
            {"min_batch_size": 9, "max_batch_size": 3},
            "max_batch_size must be >= min_batch_size=9",
            id="min-above-max",
        ),
        pytest.param({"task": "nope"}, "task must be 'module:function'", id="task-unknown"),
        pytest.param({"memory_limit": None}, "a memory limit is needed", id="no-memory"),
    ],
)
def test_sweep_rejects_bad_arguments_before_building(kwargs, match):
    kwargs = {"task": "vision-cnn", "memory_limit": "4MiB", "backend": "cpu", **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        sweep(kwargs.pop("task"), **kwargs)


# --------------------------------------------------------------------------- two gloo ranks


def _rank_worker(rank: int) -> tuple:
    # rank 1 has half the memory of rank 0 (injected limit)
    backend = get_backend("cpu", memory_limit=(1 << 20) if rank == 0 else (1 << 19))
    result = find_batch_size(lambda b: torch.zeros(b, 1024), backend=backend, progress=False)
    agreed = (result.batch_size, [t.batch_size for t in result.trials], result.target_bytes)

    def failing(b: int) -> None:  # rank 1 breaks at the third trial; rank 0 must not wait for it
        if rank == 1 and b > 1:
            raise KeyError("rank 1 broke")
        torch.zeros(b, 1024)

    try:
        find_batch_size(failing, backend=backend, progress=False)
        failure = "no error"
    except KeyError:
        failure = "KeyError"
    except BatchfitError as exc:
        failure = str(exc)
    tiny = get_backend("cpu", memory_limit=(1 << 20) if rank == 0 else 4096)  # rank 1: not even 1 sample
    try:
        find_batch_size(lambda b: torch.zeros(b, 1024), backend=tiny, progress=False)
        nothing = "no error"
    except DoesNotFitError as exc:
        nothing = str(exc)
    return agreed, failure, nothing


@pytest.mark.timeout(120)
@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_two_ranks_with_different_memory_agree_and_never_wait_on_each_other():
    # one spawn, three scenarios: different limits, an error on one rank, nothing fits on one rank
    got = run_ranks(_rank_worker)
    # rank 1 alone: floor(0.8 * 512 KiB) = 419_430 bytes, 4 KiB per sample -> 102 (rank 0 alone: 204)
    assert got[0][0] == got[1][0]
    assert got[0][0][0] == 102 and got[0][0][2] == 419_430
    assert got[1][1] == "KeyError"
    assert got[0][1].startswith("rank 1 raised during the trial at batch_size=")
    # 4 KiB per sample against floor(0.8 * 4096) = 3276 bytes on rank 1: both ranks raise
    assert all("even min_batch_size=1 does not fit" in got[r][2] for r in (0, 1)), got
    assert "the smallest 0.8 × usable over 2 ranks = 3,276 bytes" in got[0][2]


def test_a_task_trains_with_the_profiler_s_optimizer_and_state():
    # one step path: AdamW with foreach=True (the CUDA default) and its state created before any trial
    from batchfit.autobatch.task import TaskTrial

    trial = TaskTrial(vision_cnn(width=4, image_size=16), "train")
    assert trial.optimizer.defaults["foreach"] is True
    trial.prepare()
    params = [p for p in trial.model.parameters() if p.requires_grad]
    assert all(float(trial.optimizer.state[p]["step"]) == 0 for p in params)
    assert all(p.grad is None for p in params)
