"""The profile settings a caller chose: :class:`Choices`, a partial :class:`~batchfit.budget.ProfileOptions`.

A caller (the command line, a framework config) says which settings it chose and leaves the
rest unset; :meth:`Choices.or_` fills what one left from another, and :meth:`Choices.options`
makes the :class:`ProfileOptions`. Its keys are :class:`ProfileOptions`' own fields and its
:class:`~batchfit.parallel.Sharding`'s (``strategy``, ``world_size``, …): nothing is restated
(NOTE [ One table of profile settings ] in :mod:`batchfit.budget.settings`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from batchfit.budget.options import ProfileOptions
from batchfit.errors import KEYWORDS, InvalidArgument, Setting, Vocabulary
from batchfit.parallel.sharding import STRATEGIES, Sharding
from batchfit.validation import check_choice, check_positive_int

__all__ = ["OPTION_FIELDS", "SHARDING_FIELDS", "Choices"]

#: The keys a :class:`Choices` takes that are :class:`Sharding`'s fields.
SHARDING_FIELDS = frozenset(f.name for f in dataclasses.fields(Sharding) if f.init)
#: The keys a :class:`Choices` takes that are :class:`ProfileOptions`' (its ``sharding`` is made of the former).
OPTION_FIELDS = frozenset(f.name for f in dataclasses.fields(ProfileOptions) if f.init) - {"sharding"}


class Choices(Mapping[str, Any]):
    """The settings a caller chose (a frozen mapping; a setting not chosen is absent, ``None`` counts as not chosen).

    Example:
        >>> Choices(max_seq_len=1024, strategy="fsdp2").or_(Choices(max_seq_len=8192, world_size=8)).options().sharding.world_size
        8

    Raises:
        InvalidArgument: a key that is neither a :class:`ProfileOptions` nor a :class:`Sharding` field.
    """

    __slots__ = ("_values",)

    def __init__(self, **values: Any):
        unknown = sorted(set(values) - OPTION_FIELDS - SHARDING_FIELDS)
        if unknown:
            fields = ", ".join(sorted(OPTION_FIELDS | SHARDING_FIELDS))
            raise InvalidArgument(f"Choices has no setting {unknown[0]!r}; its settings are {fields}")
        self._values = {k: v for k, v in values.items() if v is not None}

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        """A setting by attribute: its value, ``None`` when not chosen (``AttributeError`` for no such setting)."""
        if name.startswith("_") or name not in OPTION_FIELDS | SHARDING_FIELDS:
            raise AttributeError(name)
        return self._values.get(name)

    def __repr__(self) -> str:
        return f"Choices({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def or_(self, other: Mapping[str, Any]) -> Choices:
        """These choices, each one not made taken from ``other``."""
        return Choices(**{**dict(other), **self._values})

    def replace(self, **changes: Any) -> Choices:
        """These choices with ``changes`` (``None`` unchooses a setting)."""
        return Choices(**{**self._values, **changes})

    def options(self, vocabulary: Vocabulary | None = None) -> ProfileOptions:
        """The :class:`ProfileOptions` of these choices (the library's defaults where none was made).

        Args:
            vocabulary: how a bad value's message names its setting (``None``: keywords).

        Raises:
            InvalidArgument: a bad value, named in ``vocabulary``.
        """
        name = (KEYWORDS if vocabulary is None else vocabulary).say
        sharding = {k: v for k, v in self._values.items() if k in SHARDING_FIELDS}
        if "strategy" in sharding:
            sharding["strategy"] = check_choice(name(Setting("sharding")), sharding["strategy"], STRATEGIES)
        for key in ("world_size", "sequence_parallel", "tensor_parallel", "pipeline_parallel"):
            if key in sharding:
                sharding[key] = check_positive_int(name(Setting(key)), sharding[key])
        # what was chosen (max_seq_len has no default: a missing one is named by ProfileOptions)
        settings: dict[str, Any] = {"max_seq_len": None}
        settings.update({k: v for k, v in self._values.items() if k in OPTION_FIELDS})
        if sharding.get("sequence_parallel", 1) > 1 and "cost" not in settings:
            settings["cost"] = "packed"  # a sequence is split only as a packed row (verl: use_remove_padding)
        settings["sharding"] = Sharding(**sharding)
        return ProfileOptions(**settings, vocabulary=vocabulary)
