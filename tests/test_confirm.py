"""``batchfit profile --confirm`` and calibration files: estimate vs the real run per category, does-not-fit, round trip.

The cpu confirms run real CPU tensors; the cuda path runs through a stub of ``torch.cuda``'s
statistics (the step's tensors stay on the CPU: no CUDA tensor is ever created).
"""

from __future__ import annotations

import contextlib
import io
import json
import types

import pytest
import torch

from batchfit import Sharding
from batchfit.budget import ProfileOptions, profile_model
from batchfit.budget.confirm import confirm_profile, plan_confirm, run_confirm
from batchfit.cli import main
from batchfit.errors import DoesNotFitError, InvalidArgument
from batchfit.memory import CudaBackend
from batchfit.memory.calibration import Calibration, calibrated_limits, load_calibration
from multirank import run_ranks

MiB = 1024**2
# The tiny preset confirmed on a simulated 64 MiB cpu device, one length (the confirm runs the
# binding one only, so one length keeps the estimate short).
CPU = ["--model", "tiny", "--max-seq-len", "256", "--backend", "cpu", "--memory", "64MiB", "--no-progress"]
# What a training step of the tiny preset holds, as the cpu tracker names it (checkpointing on: the CLI's default).
CPU_CATEGORIES = {"parameters", "gradients", "buffers", "optimizer_state", "activations", "logprob_head"}

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def cpu_confirm(tmp_path_factory):
    """One ``profile --confirm --backend cpu --json --calibration FILE`` run shared by the tests below."""
    path = tmp_path_factory.mktemp("confirm") / "cpu.json"
    code, out, err = _run(["profile", *CPU, "--confirm", "--json", "--calibration", str(path)])
    assert (code, err) == (0, "")
    return json.loads(out), path


def test_cpu_confirm_matches_the_estimate_per_category_within_one_percent(cpu_confirm):
    data, _ = cpu_confirm
    policy = data["confirm"]["roles"]["policy"]
    assert set(policy["categories"]) == CPU_CATEGORIES
    for category, c in policy["categories"].items():
        assert abs(c["relative_error"]) <= 0.01, category
        # one tracker on both sides, compared at the run's rounding (1 B): equal to the byte
        assert c["estimated_bytes"] == c["measured_bytes"] > 0, category
    assert abs(policy["peak"]["relative_error"]) <= 0.01
    assert data["confirm"]["max_relative_error"] <= 0.01
    assert policy["fits"] and policy["within_budget_limit"] and data["confirm"]["fits"]


def test_the_confirm_runs_the_budgets_binding_shape(cpu_confirm):
    data, _ = cpu_confirm
    policy, budget = data["confirm"]["roles"]["policy"], data["budgets"]["policy"]
    binding = next(p for p in budget["points"] if p["tokens"] == budget["tokens"])
    assert policy["lengths"] == [binding["seq_len"]] * binding["max_batch_size"]  # padded: b rows of s
    assert policy["tokens"] == budget["tokens"]
    # the search's own peak rounds storages to 512 B: above the run's exact bytes, by less than 512 B a storage
    assert policy["profiled_peak_bytes"] == binding["peak_bytes"] > policy["peak"]["measured_bytes"]


def test_confirm_json_schema(cpu_confirm):
    data, path = cpu_confirm
    assert {"model", "backend", "budgets", "combined", "confirm", "calibration"} <= set(data)
    assert data["backend"] == "estimate"  # the profile is the estimate; the confirm says where it ran
    confirm = data["confirm"]
    assert set(confirm) == {
        "model", "backend", "device", "memory_limit", "reserve_bytes", "limit_bytes", "round_to",
        "profiled_round_to", "untracked_bytes", "world_size", "differences", "fits", "max_relative_error",
        "estimate_seconds", "allocator", "roles",
    }  # fmt: skip
    assert (confirm["backend"], confirm["device"], confirm["world_size"]) == ("cpu", "cpu", 1)
    assert confirm["allocator"] == ""  # cpu: no caching allocator (cuda: NOTE [ The allocator setting ])
    assert (confirm["memory_limit"], confirm["reserve_bytes"], confirm["limit_bytes"]) == (
        64 * MiB,
        0,
        64 * MiB,
    )
    assert (confirm["round_to"], confirm["profiled_round_to"], confirm["untracked_bytes"]) == (1, 512, None)
    assert any("1 B" in d and "512 B" in d for d in confirm["differences"])  # says what differs
    policy = confirm["roles"]["policy"]
    assert set(policy) == {
        "cost", "seq_len", "lengths", "tokens", "shape", "categories", "peak", "max_category_error",
        "profiled_peak_bytes", "reserved_bytes", "allocator_overhead_bytes", "limit_bytes", "budget_limit_bytes",
        "safety_margin", "fits", "within_budget_limit", "exceeded", "max_rank_bytes", "seconds",
    }  # fmt: skip
    assert set(policy["categories"]["parameters"]) == {
        "estimated_bytes", "measured_bytes", "difference_bytes", "relative_error",
    }  # fmt: skip
    assert (policy["reserved_bytes"], policy["allocator_overhead_bytes"]) == (None, None)  # cpu: no allocator
    assert policy["budget_limit_bytes"] == int(0.85 * 64 * MiB)  # margin 0.85 × (64 MiB − reserve 0)
    assert data["calibration"]["path"] == str(path) and data["calibration"]["written"] is True


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_confirm_table_shows_the_estimate_first_then_each_category(capsys):
    assert main(["profile", *CPU, "--confirm"]) == 0
    out = capsys.readouterr().out
    estimate, confirm = out.split("confirm on cpu")
    assert "token budget C =" in estimate and "per-rank memory at the budget's peak" in estimate
    assert "policy on cpu:" in confirm and "(padded)" in confirm
    for word in ("category", "estimate", "measured", "error", *CPU_CATEGORIES, "peak"):
        assert word in confirm, word
    table = confirm.split("policy on cpu:")[1]
    assert table.count("+0.00%") == len(CPU_CATEGORIES) + 1  # every category and the peak
    assert "what differs:" in confirm and "fits:" in confirm


# the first tier's time (issue 41): two cpu profiles more; the confirm writes the file (tests above) and
# test_engine.py's test_a_calibrated_profile_assumes_the_allocator_its_runs_had profiles with one
@pytest.mark.slow
def test_calibration_round_trip_applies_its_reserve_and_margin(cpu_confirm):
    data, path = cpu_confirm
    cal = load_calibration(path)
    assert (cal.backend, cal.device, cal.device_total_bytes, cal.untracked_bytes) == (
        "cpu",
        "cpu",
        64 * MiB,
        0,
    )
    assert (cal.estimate_ratio, cal.allocator_overhead_fraction) == (1.0, 0.0)
    assert cal.allocator == ""  # cpu: no caching allocator
    assert set(cal.category_ratios) == CPU_CATEGORIES and set(cal.category_ratios.values()) == {1.0}
    assert Calibration.from_dict(json.loads(path.read_text())) == cal
    # profiling with it: the device's 64 MiB, reserve 0, margin (1 − 0.02) / (1.0 × 1.0) = 0.98
    argv = ["profile", "--model", "tiny", "--max-seq-len", "256", "--backend", "cpu", "--no-progress"]
    code, out, _ = _run([*argv, "--calibration", str(path), "--json"])
    applied = json.loads(out)
    assert code == 0
    assert (applied["memory_limit"], applied["reserve_bytes"]) == (64 * MiB, 0)
    assert applied["budgets"]["policy"]["safety_margin"] == 0.98
    assert applied["budgets"]["policy"]["limit_bytes"] == int(0.98 * 64 * MiB)
    assert applied["calibration"]["path"] == str(path) and applied["calibration"]["safety_margin"] == 0.98
    # a larger margin than the default 0.9 buys a budget at least as large
    assert applied["budgets"]["policy"]["tokens"] >= data["budgets"]["policy"]["tokens"]
    code, out, _ = _run([*argv, "--calibration", str(path)])
    assert code == 0 and f"calibration {path}: reserve 0 B" in out and "safety margin 0.98" in out


@pytest.mark.parametrize(
    ("document", "field"),
    [
        pytest.param("{not json", "is not valid JSON", id="not-json"),
        pytest.param('["a list"]', "must hold a JSON object", id="not-an-object"),
        pytest.param({"format": "other"}, "field format", id="format"),
        pytest.param({"version": 2}, "field version", id="version"),
        pytest.param({"drop": "estimate_ratio"}, "field estimate_ratio is missing", id="missing"),
        pytest.param({"colour": "red"}, "field 'colour' is unknown", id="unknown"),
        pytest.param(
            {"estimate_ratio": 0}, "field estimate_ratio must be a finite number > 0", id="ratio-zero"
        ),
        pytest.param({"untracked_bytes": -1}, "field untracked_bytes must be an integer >= 0", id="negative"),
        pytest.param({"untracked_bytes": True}, "field untracked_bytes must be an integer >= 0", id="bool"),
        pytest.param({"backend": "tpu"}, "field backend must be one of cpu, cuda", id="backend"),
        pytest.param(
            {"untracked_bytes": 64 * MiB}, "field untracked_bytes must be below", id="untracked-total"
        ),
        pytest.param({"runs": [{"role": "policy"}]}, r"field runs[0].seq_len is missing", id="run"),
        pytest.param({"category_ratios": {"parameters": "x"}}, "field category_ratios must be", id="ratios"),
        pytest.param({"allocator": "cudaMallocAsync"}, "field allocator must be one of", id="allocator"),
    ],
)
def test_a_bad_calibration_file_is_one_line_naming_the_path_and_field_exit_2(
    cpu_confirm, tmp_path, document, field
):
    _, good = cpu_confirm
    bad = tmp_path / "bad.json"
    if isinstance(document, str):
        bad.write_text(document)
    else:
        data, changes = json.loads(good.read_text()), dict(document)
        data.pop(changes.pop("drop", None), None)
        bad.write_text(json.dumps({**data, **changes}))
    code, out, err = _run(["profile", "--backend", "cpu", "--calibration", str(bad)])
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and f"calibration file '{bad}'" in err and field in err
    with pytest.raises(InvalidArgument, match="calibration file"):
        load_calibration(bad)


def test_a_missing_calibration_file_is_one_line_exit_2(tmp_path):
    code, _, err = _run(["profile", "--calibration", str(tmp_path / "none.json")])
    assert code == 2 and err.count("\n") == 1 and "does not exist" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(
            ["--confirm", "--backend", "estimate"], "--confirm runs the real step on a device", id="estimate"
        ),
        pytest.param(
            ["--confirm", "--backend", "cpu", "--memory", "64MiB", "--config", "examples/verl_grpo.yaml"],
            "--confirm runs one model's step and cannot be combined with --config",
            id="config",
        ),
        pytest.param(
            ["--confirm", "--backend", "cpu", "--memory", "64MiB", "--calibration", "/no/such/dir/cal.json"],
            "the folder '/no/such/dir' does not exist",
            id="calibration-folder",
        ),
        pytest.param(
            ["--confirm", "--backend", "cpu", "--memory", "64MiB", "--sharding", "fsdp2"],
            "runs on real ranks: launch with torchrun",
            id="sharded-without-ranks",
        ),
        pytest.param(
            ["--confirm", "--backend", "cpu"], "--memory is required with --backend cpu", id="cpu-memory"
        ),
    ],
)
def test_bad_confirm_flags_are_one_line_exit_2(argv, message):
    code, out, err = _run(["profile", "--no-progress", *argv])
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(
    "flag", [["--reserve", "1MiB"], ["--safety-margin", "0.8"]], ids=["reserve", "margin"]
)
def test_reserve_or_margin_beside_a_calibration_to_read_is_one_line_exit_2(cpu_confirm, flag):
    _, path = cpu_confirm
    code, _, err = _run(["profile", "--backend", "cpu", "--calibration", str(path), *flag])
    assert code == 2 and err.count("\n") == 1 and f"{flag[0]} cannot be combined with --calibration" in err


def test_a_cpu_calibration_does_not_apply_to_cuda(cpu_confirm):
    _, path = cpu_confirm
    code, _, err = _run(["profile", "--backend", "cuda", "--calibration", str(path)])
    assert code == 2 and "was measured on cpu and does not apply to --backend cuda" in err


def test_the_auto_backend_without_a_gpu_cannot_confirm():
    if torch.cuda.is_available():  # pragma: no cover - this project's machines have no GPU
        pytest.skip("auto picks cuda here")
    code, _, err = _run(["profile", "--confirm", "--no-progress"])
    assert code == 2 and "auto chose estimate: no GPU here" in err


# ------------------------------------------------------------------------------------ library


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_a_confirm_run_that_does_not_fit_raises_with_the_role_shape_and_bytes():
    # a budget estimated for 64 MiB, confirmed on a 40 MiB device: the cpu run is stopped at the limit
    options = ProfileOptions(
        max_seq_len=128, backend="estimate", memory_limit="64MiB", reserve_bytes=0, seq_lens=[128]
    )
    profile = profile_model("tiny", options)
    with pytest.raises(DoesNotFitError) as info:
        confirm_profile(profile, options.replace(backend="cpu", memory_limit="40MiB"))
    message = str(info.value)
    assert message.startswith(
        f"policy: the confirm run of {profile.budgets['policy'].binding_point.max_batch_size} × 128"
    )
    assert (
        "on cpu was stopped at the limit after" in message
        and "the device allows (memory 40.00 MiB" in message
    )
    assert "Lower the safety margin to" in message and "raise the reserve by at least" in message
    report = info.value.report
    assert not report.fits and report.roles["policy"].exceeded and report.calibration() is None
    assert info.value.needed > info.value.available == 40 * MiB
    # check=False reports instead of raising
    report = confirm_profile(profile, options.replace(backend="cpu", memory_limit="40MiB"), check=False)
    assert not report.fits and report.error() is not None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        pytest.param({"backend": "estimate"}, "backend must be 'cpu' or 'cuda'", id="estimate"),
        pytest.param({"backend": "cpu"}, "memory_limit is required with backend='cpu'", id="cpu-memory"),
        pytest.param(
            {"backend": "cpu", "memory_limit": "64MiB", "sharding": Sharding("fsdp2", world_size=2)},
            "torchrun --nproc-per-node 2 batchfit profile --confirm",
            id="sharded-in-one-process",
        ),
    ],
)
def test_confirm_profile_rejects_what_it_cannot_run(settings, message):
    with pytest.raises(InvalidArgument, match=message):
        confirm_profile("tiny", max_seq_len=64, **settings)


def test_a_profile_made_with_other_settings_is_refused():
    options = ProfileOptions(
        max_seq_len=64, backend="estimate", memory_limit="64MiB", reserve_bytes=0, seq_lens=[64]
    )
    profile = profile_model("tiny", options)
    with pytest.raises(
        InvalidArgument, match="the profile was made with logprobs='full' but options say logprobs='fused'"
    ):
        plan_confirm(profile, options.replace(backend="cpu", logprobs="fused"))
    with pytest.raises(InvalidArgument, match="profile with backend='estimate'"):
        plan_confirm(
            "tiny",
            options.replace(backend="cpu"),
            profile=profile_model("tiny", options.replace(backend="cpu")),
        )


def _confirm_rank(rank: int, plan) -> dict:
    report = run_confirm(plan)
    return report.to_dict()


@pytest.mark.slow
def test_an_fsdp2_confirm_on_two_gloo_ranks_matches_the_estimate_per_category():
    # the estimate simulates 2 ranks before any process group exists; the ranks then run it for real
    sharding = Sharding("fsdp2", world_size=2)
    plan = plan_confirm(
        "tiny", max_seq_len=128, backend="cpu", memory_limit="64MiB", sharding=sharding, seq_lens=[128]
    )
    with pytest.raises(InvalidArgument, match="runs on 2 real ranks, but this process is one of 1"):
        run_confirm(plan)
    reports = run_ranks(_confirm_rank, plan, world=2, timeout=240)
    assert {r["world_size"] for r in reports.values()} == {2} and all(r["fits"] for r in reports.values())
    rank0 = reports[0]["roles"]["policy"]  # the simulated rank is rank 0
    assert {"parameters", "optimizer_state", "logprob_head"} <= set(rank0["categories"])
    for category, c in rank0["categories"].items():
        assert c["estimated_bytes"] == c["measured_bytes"], category
    assert reports[0]["roles"]["policy"]["max_rank_bytes"] == reports[1]["roles"]["policy"]["max_rank_bytes"]


def test_a_calibration_save_replaces_the_file_whole_or_leaves_it(tmp_path, monkeypatch):
    import batchfit.fileio

    cal = Calibration(
        backend="cuda", device="gpu", device_total_bytes=80 * 1024**3, untracked_bytes=600 * MiB,
        allocator_overhead_bytes=2 * 1024**3, allocator_overhead_fraction=0.10, estimate_ratio=1.05,
    )  # fmt: skip
    path = tmp_path / "cal.json"
    path.write_text("the old calibration\n")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(batchfit.fileio.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        cal.save(path)
    assert path.read_text() == "the old calibration\n" and [p.name for p in tmp_path.iterdir()] == ["cal.json"]
    monkeypatch.undo()
    cal.save(path)  # NOTE [ Writes replace, never truncate ]
    assert load_calibration(path) == cal and [p.name for p in tmp_path.iterdir()] == ["cal.json"]


def test_calibrated_limits_take_each_term_at_its_worst():
    cal = Calibration(
        backend="cuda", device="gpu", device_total_bytes=80 * 1024**3, untracked_bytes=600 * MiB,
        allocator_overhead_bytes=2 * 1024**3, allocator_overhead_fraction=0.10, estimate_ratio=1.05,
    )  # fmt: skip
    limits = calibrated_limits(cal)
    # (1 − 0.02) / (1.05 × 1.10) = 0.98 / 1.155 = 0.84848… → 0.848 (rounded down)
    assert (limits.memory_limit, limits.reserve_bytes, limits.safety_margin) == (
        80 * 1024**3,
        600 * MiB,
        0.848,
    )
    # an estimate that came out high earns no larger margin: r = max(1, 0.9) = 1 → 0.98 / 1.10 = 0.8909… → 0.890
    high = calibrated_limits(Calibration(**{**cal.__dict__, "estimate_ratio": 0.9}))
    assert high.safety_margin == 0.890
    assert calibrated_limits(cal, slack=0.0).safety_margin == 0.865  # 1 / 1.155 = 0.8658…
    with pytest.raises(InvalidArgument, match="does not apply to backend='cpu'"):
        calibrated_limits(cal, backend="cpu")
    assert calibrated_limits(cal, backend="estimate").profile_settings() == {
        "memory_limit": 80 * 1024**3, "reserve_bytes": 600 * MiB, "safety_margin": 0.848,
    }  # fmt: skip


# ------------------------------------------------------------------------ cuda through a stub

TOTAL = 64 * MiB  # the stub device
USED = 3 * MiB  # total − free
TORCH_RESERVED = 1 * MiB  # torch's cache between runs: the reserve is 3 − 1 = 2 MiB outside torch


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's statistics replaced and the backend's device made the host: no CUDA tensor is ever created."""
    state = types.SimpleNamespace(allocated=0, reserved=0)
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=TOTAL))
    monkeypatch.setattr(cuda, "get_device_name", lambda d=None: "Stub GPU")
    monkeypatch.setattr(cuda, "mem_get_info", lambda d=None: (TOTAL - USED, TOTAL))
    monkeypatch.setattr(cuda, "memory_reserved", lambda d=None: TORCH_RESERVED)
    monkeypatch.setattr(cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda d=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda d=None: state.allocated)
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda d=None: state.reserved)
    monkeypatch.setattr(CudaBackend, "device", property(lambda self: torch.device("cpu")))
    return state


CUDA = ["--model", "tiny", "--max-seq-len", "256", "--backend", "cuda", "--no-progress"]


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_cuda_confirm_reports_reserved_minus_allocated_and_folds_untracked_categories(fake_cuda):
    plan = plan_confirm("tiny", max_seq_len=256, backend="cuda", seq_lens=[256], gradient_checkpointing=True)
    point = plan.points["policy"]
    assert (plan.memory_limit, plan.reserve_bytes, plan.round_to) == (TOTAL, 2 * MiB, 512)
    # cuda rounds as the estimate does: the search's own numbers are compared
    assert point.estimated_peak_bytes == point.profiled_peak_bytes
    fake_cuda.allocated = point.estimated_peak_bytes + 1000  # 1,000 B more than estimated
    fake_cuda.reserved = fake_cuda.allocated + 3 * MiB
    report = run_confirm(plan)
    policy = report.roles["policy"]
    assert (report.device, report.untracked_bytes) == ("Stub GPU", 2 * MiB)
    assert (policy.reserved_bytes, policy.allocator_overhead_bytes) == (fake_cuda.reserved, 3 * MiB)
    # cuda knows the registered state; the estimate's logprob_head and other temporaries join activations
    names = [c.category for c in policy.categories]
    assert set(names) == {"parameters", "gradients", "buffers", "optimizer_state", "activations"}
    assert sum(c.estimated_bytes for c in policy.categories) == point.estimated_peak_bytes
    assert sum(c.measured_bytes for c in policy.categories) == fake_cuda.allocated
    # the registered state is sized from the tensors (here the CPU's exact bytes), the estimate rounds each
    # storage to 512 B as the allocator does: rounding moves bytes between categories, not in the total
    assert all(
        c.measured_bytes <= c.estimated_bytes for c in policy.categories if c.category != "activations"
    )
    assert policy.relative_error == pytest.approx(-1000 / fake_cuda.allocated)
    assert any("summed into activations" in d for d in report.differences)


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_cuda_confirm_writes_a_calibration_that_the_estimate_then_uses(fake_cuda, tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the setting it records
    fake_cuda.allocated, fake_cuda.reserved = 40 * MiB, 42 * MiB  # below the estimate; 2 MiB reserved beyond
    code, out, err = _run(["profile", *CUDA, "--confirm", "--calibration", str(path)])
    assert (code, err) == (0, "")
    assert "reserved − allocated" in out and "outside torch's allocator" in out
    cal = load_calibration(path)
    assert (cal.backend, cal.device, cal.device_total_bytes, cal.untracked_bytes) == (
        "cuda",
        "Stub GPU",
        TOTAL,
        2 * MiB,
    )
    assert (cal.allocator_overhead_bytes, cal.allocator_overhead_fraction) == (2 * MiB, 0.05)  # 2 / 40
    assert cal.allocator == "expandable_segments"
    assert cal.estimate_ratio < 1
    # profiling with it: r = max(1, ratio) = 1, f = 0.05 → margin 0.98 / 1.05 = 0.9333… → 0.933; reserve 2 MiB
    code, out, _ = _run(
        ["profile", *CUDA[:-3], "--backend", "estimate", "--calibration", str(path), "--json"]
    )
    data = json.loads(out)
    assert code == 0
    assert (data["memory_limit"], data["reserve_bytes"]) == (TOTAL, 2 * MiB)
    assert data["budgets"]["policy"]["safety_margin"] == 0.933
    assert data["budgets"]["policy"]["limit_bytes"] == int(0.933 * (TOTAL - 2 * MiB))


@pytest.mark.slow  # the first tier's time (issue 29); the capability keeps fast tests
def test_a_cuda_confirm_that_does_not_fit_exits_1_with_the_message(fake_cuda):
    fake_cuda.allocated, fake_cuda.reserved = 60 * MiB, 63 * MiB  # above 64 − 2 MiB reserve = 62 MiB usable
    code, out, err = _run(["profile", *CUDA, "--confirm"])
    assert code == 1
    assert "policy on cuda:" in out and "DOES NOT FIT" in out  # the tables come first
    assert err.count("\n") == 1
    assert "policy: the confirm run of" in err and "on cuda reserved 63.00 MiB (60.00 MiB allocated)" in err
    assert "more than the 62.00 MiB the device allows (memory 64.00 MiB − reserve 2.00 MiB)" in err
    assert "Lower the safety margin to" in err and "raise the reserve by 1.00 MiB" in err
    code, out, err = _run(["profile", *CUDA, "--confirm", "--json"])
    data = json.loads(out)
    assert code == 1 and data["confirm"]["fits"] is False
    assert data["error"]["type"] == "DoesNotFitError" and data["error"]["faults"] == [
        err.split("error: ", 1)[1].strip()
    ]


def test_a_run_out_of_memory_below_the_limit_says_the_estimate_missed_an_allocation():
    # the H200's tiny float32 run (docs/budget.md): out of memory holding 21,873,486,848 B of a
    # 149,557,477,376 B limit, on a request the estimate did not make (no margin could have helped)
    from batchfit.budget.confirm_report import ConfirmReport, RoleConfirmation

    role = RoleConfirmation(
        role="policy", cost="padded", seq_len=2048, lengths=(2048,) * 4558, tokens=4558 * 2048, categories=(),
        estimated_peak_bytes=127_106_220_544, measured_peak_bytes=21_873_486_848,
        profiled_peak_bytes=127_106_220_544, reserved_bytes=25_713_180_672, limit_bytes=149_557_477_376,
        budget_limit_bytes=127_123_855_769, safety_margin=0.85, fits=False, exceeded=True,
        max_rank_bytes=25_713_180_672, seconds=0.6,
    )  # fmt: skip
    report = ConfirmReport(
        profile=None, model="tiny", backend="cuda", device="NVIDIA H200", memory_limit=150_109_880_320,  # type: ignore[arg-type]
        reserve_bytes=552_402_944, round_to=512, profiled_round_to=512, roles={"policy": role}, untracked_bytes=720_175_104,
    )  # fmt: skip
    message = str(report.error())
    assert message.startswith("policy: the confirm run of 4558 × 2,048 tokens (padded) on cuda ran out of memory holding 23.95 GiB")
    assert "below the 139.29 GiB the device allows: one allocation asked for more than was left" in message
    assert "Search on the device itself (--backend cuda, without --confirm)" in message
    assert "safety margin" not in message and "reserve" not in message
