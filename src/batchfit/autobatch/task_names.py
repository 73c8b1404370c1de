"""The names of AutoBatch's modes and built-in tasks: light to import (no torch), for the command line's parser."""

from __future__ import annotations

__all__ = ["BUILTIN_TASKS", "DEFAULT_TASK", "MODES"]

#: The modes a batch size is searched in: a training step (forward, backward, optimizer) or evaluation.
MODES = ("train", "val")
#: Built-in task name → ``module:function`` that builds it (:mod:`batchfit.autobatch.builtin_tasks`).
BUILTIN_TASKS = {
    "causal-lm": "batchfit.autobatch.builtin_tasks:causal_lm",
    "vision-cnn": "batchfit.autobatch.builtin_tasks:vision_cnn",
}
DEFAULT_TASK = "causal-lm"
