"""The longest prompt of a whole TRL GRPO dataset, tokenized as TRL tokenizes it: ``max_prompt_length`` for :func:`~batchfit.integrations.trl.grpo_config`.

TRL 1.16 does not truncate prompts, so :func:`~batchfit.integrations.trl.grpo_config` needs the
longest prompt the run will see; a length measured on the first rows is the trap of NOTE [ Every
row's length, not a sample ] (:mod:`batchfit.integrations.row_lengths`). :func:`longest_prompt`
tokenizes every row's ``"prompt"`` the way ``GRPOTrainer._tokenize_prompts`` does (TRL 1.16,
``trl/trainer/grpo_trainer.py``): a conversational prompt (TRL's own ``is_conversational``) through
``processing_class.apply_chat_template(conversation=..., tools=..., chat_template=...,
add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs)``, a text
prompt through ``processing_class(text=...)``. Not modelled: per-row tools of
``environment_factories`` and images of vision-language prompts. Importing this module imports
nothing; :func:`longest_prompt` imports TRL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchfit.errors import InvalidArgument
from batchfit.integrations.row_lengths import LongestRow
from batchfit.validation import check_positive_int

__all__ = ["longest_prompt"]


def longest_prompt(
    dataset: Any,
    processing_class: Any,
    *,
    tools: list[Any] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    rows_per_call: int = 1024,
) -> LongestRow:
    """The longest of every row's ``"prompt"`` in tokens, as ``GRPOTrainer`` tokenizes it.

    Args:
        dataset: the ``train_dataset`` you give ``GRPOTrainer`` (a ``datasets.Dataset`` or a
            sequence of mappings with a ``"prompt"``).
        processing_class: the tokenizer you give ``GRPOTrainer``.
        tools, chat_template, chat_template_kwargs: what you give ``GRPOTrainer`` / ``GRPOConfig``
            (``tools=``, ``GRPOConfig.chat_template_kwargs``), as TRL passes them to the template.
        rows_per_call: prompts tokenized per call.

    Returns:
        :class:`~batchfit.integrations.row_lengths.LongestRow`; pass ``.length`` as
        ``grpo_config(max_prompt_length=...)``.

    Raises:
        InvalidArgument: an empty or non-indexable dataset, a row without ``"prompt"``, or TRL
            not installed.
    """
    try:
        from trl.data_utils import is_conversational
    except ImportError as exc:  # the optional extra
        raise InvalidArgument(
            "longest_prompt tokenizes as TRL does and needs TRL: pip install -e '.[trl]' in batchfit's checkout"
        ) from exc
    step = check_positive_int("rows_per_call", rows_per_call)
    try:
        count = len(dataset)
    except TypeError:
        raise InvalidArgument(
            f"dataset must be an indexable dataset (len() and [i]), but got {type(dataset).__name__}; pass a datasets.Dataset or a list of rows"
        ) from None
    if count == 0:
        raise InvalidArgument("dataset is empty (len=0); pass the rows GRPOTrainer will train on")
    best, best_at, shortest = -1, 0, None
    conversational = None
    for start in range(0, count, step):
        prompts = _prompts(dataset, start, min(start + step, count))
        if conversational is None:
            conversational = is_conversational({"prompt": prompts[0]})
        if conversational:
            ids = processing_class.apply_chat_template(
                conversation=prompts, tools=tools or None, chat_template=chat_template, add_generation_prompt=True,
                tokenize=True, return_dict=True, **dict(chat_template_kwargs or {}),
            )["input_ids"]  # fmt: skip
        else:
            ids = processing_class(text=prompts)["input_ids"]
        for offset, row in enumerate(ids):
            length = len(row)
            if length > best:
                best, best_at = length, start + offset
            shortest = length if shortest is None else min(shortest, length)
    how = "apply_chat_template(add_generation_prompt=True)" if conversational else "processing_class(text=...)"
    return LongestRow(index=best_at, length=best, rows=count, shortest=shortest or 0,
                      source=f"every row's prompt tokenized as GRPOTrainer does: {how}")


def _prompts(dataset: Any, start: int, stop: int) -> list[Any]:
    if hasattr(dataset, "column_names") and hasattr(dataset, "select"):  # a datasets.Dataset: one column slice
        if "prompt" not in dataset.column_names:
            raise InvalidArgument(
                f"GRPOTrainer reads each row's 'prompt', but the dataset has columns {dataset.column_names}; rename the prompt column to 'prompt'"
            )
        return list(dataset[start:stop]["prompt"])
    rows = [dataset[i] for i in range(start, stop)]
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise InvalidArgument(
                f"GRPOTrainer reads each row's 'prompt', but row {start + i} is {type(row).__name__} without one; give every row a 'prompt'"
            )
    return [row["prompt"] for row in rows]
