"""What would make one sequence fit: the term of its peak that is too large, and the remedies that act on it.

A "does not fit" refusal names remedies. Offered blind, they point the wrong way (offloading 6 GiB of
activations when 85 GiB of sharded state is what exceeds the limit). This module reads the refused
sequence's breakdown (one rank's peak by category, :mod:`batchfit.memory.categories`) in **terms**, the
parts a remedy acts on:

- ``sharded state``: parameters, gradients, optimizer state (and its step's temporaries): what FSDP2
  shards over the ranks, CPU offload moves to the host, and LoRA freezes (no gradients, no optimizer state);
- ``gathered layers``: the parameters FSDP gathers and the gradient communication buffers;
- ``activations``: activations and inputs: checkpointing, activation offload, sequence parallelism, a
  shorter sequence;
- ``logprob head``: the head's logits and their gradients: a fused head, the head on the loss tokens.

:func:`pertinent` keeps a remedy only when removing *all* of the terms it acts on would bring the peak under
the limit: a remedy that cannot help is left out. The remedies that change the run's state (CPU offload,
LoRA, more GPUs, sequence parallelism) are measured by the caller (:mod:`batchfit.budget.model_profile`),
each with a probe; :func:`fitting` is the pure choice over them (STYLE 5: a search takes a probe function).

Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchfit.errors import Phrase, Setting

__all__ = [
    "REMEDY_TERMS",
    "TERMS",
    "Candidate",
    "fitting",
    "largest_term",
    "memory_needed",
    "pertinent",
    "term_bytes",
    "term_words",
]

#: term → the breakdown categories it sums (:mod:`batchfit.memory.categories`' names).
TERMS: dict[str, tuple[str, ...]] = {
    "sharded state": ("parameters", "gradients", "optimizer_state", "optimizer_step"),
    "gathered layers": ("gathered_parameters", "communication"),
    "activations": ("activations", "inputs"),
    "logprob head": ("logprob_head",),
}

#: A remedy's setting → the terms it can remove (at most all of them): what :func:`pertinent` judges it by.
REMEDY_TERMS: dict[str, tuple[str, ...]] = {
    "max_seq_len": ("activations", "logprob head"),
    "gradient_checkpointing": ("activations",),
    "activation_offload": ("activations",),
    "logprobs": ("logprob head",),
    "response_only": ("logprob head",),
}


def term_bytes(breakdown: Mapping[str, int]) -> dict[str, int]:
    """The breakdown summed into :data:`TERMS`, largest first (a category of no term is its own term).

    >>> term_bytes({"parameters": 2, "gradients": 2, "activations": 3, "logprob_head": 1})
    {'sharded state': 4, 'activations': 3, 'logprob head': 1}
    """
    out: dict[str, int] = {}
    known = {c: t for t, cats in TERMS.items() for c in cats}
    for category, nbytes in breakdown.items():
        if nbytes > 0:
            term = known.get(category, category.replace("_", " "))
            out[term] = out.get(term, 0) + int(nbytes)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def largest_term(breakdown: Mapping[str, int]) -> tuple[str, int] | None:
    """The largest term and its bytes, ``None`` for an empty breakdown."""
    terms = term_bytes(breakdown)
    return next(iter(terms.items()), None)


def term_words(breakdown: Mapping[str, int], needed: int, limit: int, fmt: Callable[[int], str]) -> str:
    """The term that is too large, in words: ``the sharded state (parameters, gradients, optimizer state) takes
    85.50 GiB of the 113.95 GiB, alone above the 67.21 GiB limit``.

    Names whether that term alone exceeds the limit, or the rest without it would fit.
    """
    top = largest_term(breakdown)
    if top is None:
        return ""
    term, nbytes = top
    cats = [c.replace("_", " ") for c in TERMS.get(term, ()) if breakdown.get(c, 0) > 0]
    what = f"the {term}" + (f" ({', '.join(cats)})" if len(cats) > 1 else "")
    words = f"{what} takes {fmt(nbytes)} of the {fmt(needed)}"
    if nbytes > limit:
        return words + f", alone above the {fmt(limit)} limit"
    if needed - nbytes <= limit:
        return words + f": without it the rest ({fmt(needed - nbytes)}) is under the {fmt(limit)} limit"
    return words


def _settings(remedy: Phrase) -> list[str]:
    names = []
    for part in remedy.parts:
        for setting in part if isinstance(part, tuple) else (part,):
            if isinstance(setting, Setting):
                names.append(setting.name)
    return names


def pertinent(remedies: Iterable[Phrase], breakdown: Mapping[str, int], needed: int, limit: int) -> list[Phrase]:
    """The remedies that could make ``needed`` fit under ``limit``: each of :data:`REMEDY_TERMS`' kept only when the
    terms it acts on, removed entirely, would bring the peak under the limit; the others (memory, sharding) as given.

    >>> head = Phrase("fuse the head (", Setting("logprobs", "fused"), ")")
    >>> pertinent([head], {"parameters": 90, "logprob_head": 5}, needed=95, limit=60)
    []
    >>> len(pertinent([head], {"parameters": 50, "logprob_head": 45}, needed=95, limit=60))
    1
    """
    terms = term_bytes(breakdown)
    kept = []
    for remedy in remedies:
        acts_on = {t for name in _settings(remedy) for t in REMEDY_TERMS.get(name, ())}
        named = [name for name in _settings(remedy) if name in REMEDY_TERMS]
        if named and needed - sum(terms.get(t, 0) for t in acts_on) > limit:
            continue  # even all of what it removes leaves the peak above the limit
        kept.append(remedy)
    return kept


def memory_needed(needed: int, margin: float, reserve: int) -> str:
    """The device memory at which ``needed`` bytes fit, ``needed / margin + reserve``, rounded up to a whole GiB
    (a whole MiB below 4 GiB), as ``--memory`` takes it.

    >>> memory_needed(113 * 2**30, 0.85, 2**29), memory_needed(81 * 2**20, 0.85, 0)
    ('134GiB', '96MiB')
    """
    total = needed / margin + reserve
    if total >= 4 * 2**30:
        return f"{math.ceil(total / 2**30)}GiB"
    return f"{math.ceil(total / 2**20)}MiB"


@dataclass(frozen=True)
class Candidate:
    """A remedy that changes the run: what it says, and the change the caller measures it with.

    Attributes:
        remedy: the phrase offered when it fits (its settings in the caller's vocabulary).
        change: the caller's description of the run it measures (options to change); opaque here.
    """

    remedy: Phrase
    change: Any


def fitting(candidates: Sequence[Candidate], fits: Callable[[Candidate], bool]) -> list[Candidate]:
    """The candidates ``fits`` says fit, in their order: each probed once.

    >>> c = [Candidate(Phrase("a"), 1), Candidate(Phrase("b"), 2)]
    >>> [x.change for x in fitting(c, lambda x: x.change > 1)]
    [2]
    """
    return [c for c in candidates if fits(c)]
