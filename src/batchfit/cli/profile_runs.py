"""``batchfit profile``'s run modes: a plain profile, ``--config`` (and ``--emit``), ``--confirm``.

:func:`run` resolves the command's flags once into a library
:class:`~batchfit.frameworks.profile_request.ProfileRequest` (NOTE [ One resolver for every caller ]);
each mode makes its library call and renders the answer; ``--json`` prints the answer's
:meth:`~batchfit.frameworks.profile_request.ProfileAnswer.to_dict`, what a Python caller gets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from batchfit.budget.profile_cache import ProfileCache, caching
from batchfit.cli._ranks import process_group
from batchfit.cli.probe_progress import ProbeProgress
from batchfit.cli.render_profile import device_lines, render_profile
from batchfit.frameworks.profile_request import (
    ProfileAnswer,
    ProfileRequest,
    confirm_document,
    resolve_request,
)
from batchfit.memory import backend_class


def request_from_args(args: argparse.Namespace) -> ProfileRequest:
    """The request of ``batchfit profile``'s parsed flags (``args`` is left as it is), in the flags' words.

    Raises:
        InvalidArgument: a bad value or combination (one line each, exit 2).
        BatchConfigError: the ``--config`` cannot be read (one line per fault).
    """
    from batchfit.budget.settings import SETTINGS

    request = resolve_request({row.name: getattr(args, row.name) for row in SETTINGS}, vocabulary=args.vocabulary)
    if request.plot:
        from batchfit.cli.render_budget import require_matplotlib

        require_matplotlib(request.plot)
    return request


def run(args: argparse.Namespace) -> int:
    """``batchfit profile``: the request from the flags, then its run mode; the exit code."""
    from rich.console import Console

    request = request_from_args(args)
    if request.confirm:
        return _run_confirm(request)
    with _process_group(request) as rank:
        console = Console(soft_wrap=True)
        err = Console(stderr=True)
        show_progress = request.progress and not request.json and rank == 0  # a bar, or lines when not a terminal
        with ProbeProgress(err, show_progress) as callback, caching(enabled=request.cache) as cache:
            answer = request.profile(progress=callback)
        if rank != 0:
            return 0
        if cache is not None and cache.hits:
            _say_cached(err, cache)
        if request.plot:
            from batchfit.cli.render_budget import plot_budget

            plot_budget(answer.budgets, request.plot)
        if request.json:
            json.dump(answer.to_dict(), sys.stdout, indent=2)  # NOTE [ The --json schema ] in batchfit.budget.document
            sys.stdout.write("\n")
            return 0
        if answer.result is not None:
            return _render_config(answer, console)
        render_profile(console, answer.profile, request)
    return 0


def _say_cached(err: Any, cache: ProfileCache) -> None:
    """One line on stderr: how many of the run's profiles came from the cache (NOTE [ A profile is a function of its inputs ])."""
    total = len(cache.hits) + len(cache.misses)
    what = "the profile" if total == 1 else f"{len(cache.hits)} of {total} measurements"
    err.print(
        f"batchfit: {what} answered from the cache in {cache.directory} (same model, settings and batchfit); "
        "--no-cache measures again",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def _run_confirm(request: ProfileRequest) -> int:
    """``--confirm``: estimate (before joining any ranks), run the real step at each budget, render, save the calibration.

    The estimate simulates the ranks, so under torchrun it runs before the process group is
    joined (:func:`~batchfit.budget.confirm.plan_confirm`); the runs then happen on the real
    ranks (:func:`~batchfit.budget.confirm.run_confirm`), and rank 0 prints.
    """
    from rich.console import Console

    from batchfit.budget.confirm import plan_confirm, run_confirm

    err = Console(stderr=True)
    first = os.environ.get("RANK", "0") == "0"
    show_progress = request.progress and not request.json and first  # a bar, or lines when not a terminal
    _select_device(request)  # cuda: plan_confirm reads this rank's device
    with ProbeProgress(err, show_progress) as callback:
        plan = plan_confirm(request.model, request.options.replace(progress=callback), roles=request.roles)
    with _process_group(request) as rank:
        report = run_confirm(plan, check=False)
    error = report.error()
    if rank != 0:
        return 0 if error is None else 1
    calibration = report.calibration() if request.calibration_path else None
    if calibration is not None:
        from batchfit.fileio import replacing

        with replacing(request.calibration_path) as tmp:  # NOTE [ Writes replace, never truncate ]
            calibration.save(tmp)
    if request.plot:
        from batchfit.cli.render_budget import plot_budget

        plot_budget(report.profile.budgets, request.plot)
    if request.json:
        json.dump(confirm_document(request, report, calibration), sys.stdout, indent=2)  # NOTE [ The --json schema ]
        sys.stdout.write("\n")
        if error is not None:
            sys.stderr.write(f"batchfit profile: error: {error}\n")
            return 1
        return 0
    from batchfit.cli.render_budget import confirm_lines, confirm_table

    console = Console(soft_wrap=True)
    render_profile(console, report.profile, request)
    console.print()
    head, *rest = confirm_lines(report)
    console.print(head, highlight=False)
    for line in rest:
        console.print(f"  {line}", highlight=False)
    for role, confirmation in report.roles.items():
        console.print()
        console.print(confirm_table(confirmation, report.backend))
        for line in confirm_lines(report, role):
            console.print(line, highlight=False)
    if request.calibration_path:
        console.print()
        if calibration is None:
            console.print(
                f"no calibration written to {request.calibration_path}: no confirm run ran to the end",
                highlight=False,
            )
        else:
            from batchfit.memory.calibration import calibrated_limits

            console.print(f"calibration written to {request.calibration_path}", highlight=False)
            console.print(
                f"  profiling with it (--calibration {request.calibration_path}): {calibrated_limits(calibration).describe()}",
                highlight=False,
            )
    if error is not None:
        raise error
    return 0


def _render_config(answer: ProfileAnswer, console: Any) -> int:
    """``--config``: render every pass of the run, or the framework's keys (``--emit``)."""
    from batchfit.frameworks.emit import FLAG_TARGETS, override_comments, provenance, render_keys
    from batchfit.memory import format_bytes

    request, result, keys, notes = answer.request, answer.result, answer.keys, answer.notes
    run = request.run
    if keys is not None:
        target = request.memory if request.memory is not None else "the device"
        header = [
            f"batchfit profile --config {request.config} --emit {request.emit}"
            + (" --response-only" if request.options.response_only else ""),
            f"{', '.join(sorted(set(filter(None, run.models.values()))))}, max_seq_len {request.options.max_seq_len:,}, "
            f"{request.options.sharding.describe()}, {target} per GPU, safety margin {request.options.safety_margin:g}, "
            f"budgets {provenance(request.backend)} ({request.backend} backend)",
        ]
        if result.resident:
            shared = ", ".join(f"{role} {format_bytes(b)}" for role, b in result.resident.items())
            header.append(f"colocated models' state taken off each budget: {shared}")
        header += device_lines(result.profiles.get("policy") or next(iter(result.profiles.values())))
        if result.awake is not None:
            header.append(f"awake phase: {result.awake.describe()}")
        header += [f"note: {note}" for note in (*notes, *run.notes)]
        moe_lines = dict.fromkeys(f"{p.model}: {p.moe.describe()}" for p in result.profiles.values() if p.moe is not None)
        header += [f"note: {line}" for line in moe_lines]  # the passes measured a mixture of experts so
        if request.options.sharding.spec.shards_rows:  # NOTE [ One expert per rank at least ] in batchfit.models.moe
            floors = (p.moe.expert_shard_note(request.options.sharding.world_size) for p in result.profiles.values() if p.moe)
            header += [f"note: {line}" for line in dict.fromkeys(f for f in floors if f)]
        header += [f"note: {line}" for line in _attention_notes(result)]
        header += [f"warning: {warning}" for warning in run.warnings]
        text = render_keys(keys, request.emit, header, request.emit_format)
        sys.stdout.write(text)
        if request.emit_format == "overrides" and request.emit not in FLAG_TARGETS:  # Hydra takes no comments
            sys.stderr.write(override_comments(keys, header))  # what the YAML form's comments say, on stderr
        return 0
    console.print(
        f"config {request.config}: {run.vocabulary} vocabulary; models "
        + ", ".join(f"{role} {model}" for role, model in run.models.items())
        + (f"; colocated {', '.join(run.colocated)}" if run.colocated else ""),
        highlight=False,
    )
    if result.awake is not None:
        console.print(f"awake phase: {result.awake.describe()}", highlight=False)
    for note in (*notes, *run.notes):
        console.print(f"note: {note}", highlight=False)
    for line in _attention_notes(result):
        console.print(f"note: {line}", highlight=False)
    for warning in run.warnings:
        console.print(f"warning: {warning}", highlight=False)
    for role, profile in result.profiles.items():
        console.print()
        console.rule(f"{role} model", style="dim")
        render_profile(console, profile, request)
        if profile.resident_bytes:
            console.print(
                f"colocated models keep {format_bytes(profile.resident_bytes)} per GPU on the device; "
                "taken off the usable memory above",
                highlight=False,
            )
    return 0


@contextlib.contextmanager
def _process_group(request: ProfileRequest) -> Iterator[int]:
    """Under torchrun with cpu/cuda: join the ranks (gloo/nccl) for the run; yields this rank."""
    import torch.distributed as dist

    if request.launched == 1 or backend_class(request.backend).simulated or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    with process_group(request.backend) as rank:  # LOCAL_RANK's GPU for cuda; the one collective timeout
        yield rank


def _select_device(request: ProfileRequest) -> None:
    """Under torchrun with cuda: this rank's GPU (``LOCAL_RANK``) becomes the current device."""
    if backend_class(request.backend).reads_device and request.launched > 1:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _attention_notes(result: Any) -> list[str]:
    """Each model whose attention takes CUDA's math path, once (NOTE [ The estimate runs CUDA's attention kernel ])."""
    notes = (f"{p.model}: {p.attention.note}" for p in result.profiles.values() if p.attention and p.attention.note)
    return list(dict.fromkeys(notes))
