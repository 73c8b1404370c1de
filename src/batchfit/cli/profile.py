"""``batchfit profile``: the token budget of a model on a (real or estimated) device.

The command's parser, one flag per row of the settings' table (:mod:`batchfit.budget.settings`).
:mod:`batchfit.cli.profile_runs` resolves the flags into a request
(:func:`batchfit.frameworks.profile_request.resolve_request`), makes its one library call (a plain
profile, ``--config``/``--emit``, ``--confirm``) and renders it: :mod:`batchfit.cli.render_profile`
(the tables), :mod:`batchfit.cli.probe_progress` (the progress bar or lines), ``--json`` (the
answer's :meth:`~batchfit.frameworks.profile_request.ProfileAnswer.to_dict`) and ``--plot``
(matplotlib, imported only then). ``--confirm`` calls :func:`batchfit.budget.confirm.plan_confirm`
and :func:`~batchfit.budget.confirm.run_confirm` (the estimate before any process group is joined,
the real runs on the ranks); ``--calibration FILE`` writes (with ``--confirm``) or reads a
:class:`~batchfit.memory.calibration.Calibration`.
"""

from __future__ import annotations

import argparse

from batchfit.budget.settings import (
    DEFAULT_ESTIMATE_TARGET,
    DEFAULT_ESTIMATE_WORLD_SIZE,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MODEL,
    add_arguments,
    flag_vocabulary,
)

__all__ = ["add_parser"]


def run(args: argparse.Namespace) -> int:
    """``batchfit profile``: :func:`batchfit.cli.profile_runs.run`, imported only to run (NOTE [ A light --help ] in
    :mod:`batchfit.cli`: the parser, ``--help`` and argument errors import no torch)."""
    from batchfit.cli.profile_runs import run as run_profile

    return run_profile(args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``batchfit profile`` on the dispatcher's subparsers: one flag per row of the settings' table
    (NOTE [ One table of profile settings ] in :mod:`batchfit.budget.settings`)."""
    p = sub.add_parser(
        "profile",
        help="find the token budget per rank: the largest micro-batch cost that fits in memory",
        description=(
            "Probe a training step (forward, backward, AdamW step) at several sequence lengths, longest first, "
            "and report the token budget C per rank: any micro-batch with cost <= C fits. Models are sharded "
            "with PyTorch's own FSDP2 or DDP. Without a GPU the estimate backend predicts a target device in "
            f"seconds by simulating the ranks (default: {DEFAULT_MODEL} at {DEFAULT_MAX_SEQ_LEN} tokens, fsdp2 "
            f"over {DEFAULT_ESTIMATE_WORLD_SIZE} × {DEFAULT_ESTIMATE_TARGET}, gradient checkpointing). With "
            "--backend cpu or cuda under torchrun every rank measures for real and rank 0 prints."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=run, vocabulary=flag_vocabulary())
