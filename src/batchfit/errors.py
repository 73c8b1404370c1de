"""The one exception family of batchfit.

Every error batchfit raises on purpose derives from :class:`BatchfitError`. Errors about
bad values are also :class:`ValueError`, so callers that only know the standard library
can still catch them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class BatchfitError(Exception):
    """Base class of every error batchfit raises on purpose."""


class InvalidArgument(BatchfitError, ValueError):
    """An argument has the wrong type or a value outside its domain.

    Raised by the checks in :mod:`batchfit.validation`; the message names the argument,
    the value received and what would be accepted.
    """


class TaskError(InvalidArgument):
    """The user's own code (an AutoBatch task file or factory) raised or does not parse.

    The message names the file and line and the exception; the original exception is the
    ``__cause__`` (the CLI prints its traceback with ``--debug``). ``location`` is
    ``"file:line"`` or ``""``.
    """

    def __init__(self, message: str, location: str = ""):
        self.location = location
        super().__init__(message)


class BatchConfigError(InvalidArgument):
    """A batch-size configuration breaks one or more rules.

    Raised by :meth:`batchfit.BatchConfig.plan` (and the config loaders) with **every**
    fault at once; ``faults`` holds one message per fault, each naming the fields, their
    values, the rule broken and the nearest valid values.
    """

    def __init__(self, faults: list[str]):
        self.faults = list(faults)
        n = len(self.faults)
        head = f"{n} fault in the batch configuration" if n == 1 else f"{n} faults in the batch configuration"
        super().__init__(head + ":\n" + "\n".join(f"  - {f}" for f in self.faults))


class BatchError(InvalidArgument):
    """A per-sample batch (a mapping of fields) or its uids are malformed.

    Raised by :mod:`batchfit.batches.minibatch` and :mod:`batchfit.batches.batch`: fields with different
    sample counts, a uid that reappears after another uid, a prompt count that does not
    split into whole mini-batches.
    """


class BudgetError(InvalidArgument):
    """A token budget cannot hold what was asked of it.

    Raised by :mod:`batchfit.plan.packing` when one sequence alone costs more than the budget
    (and ``oversize="raise"``), or when a budget is not a positive number of tokens.
    """


# NOTE [ Messages in the caller's vocabulary ]
# A message that tells the user what to change names settings, and the user knows them by
# the names of the door they came in by: keyword arguments from the library
# (logprobs='fused', memory_limit), flags from the command line (--logprobs fused, --memory).
# So such messages are built as a Phrase — words and Setting parts (a keyword name and,
# when the remedy has one, its value) — and written out by a Vocabulary chosen once where the
# user calls in: the library's is KEYWORDS (str(error) uses it); each CLI command registers
# its table of keyword name → flag (batchfit.cli.profile.FLAGS) and its errors are written
# with it by batchfit.cli.report_error. A setting the table lacks keeps its keyword name.


@dataclass(frozen=True)
class Setting:
    """A setting a message names: its keyword name, and the value to give it (``None``: no one value).

    ``name="sharding"`` takes a mapping of :class:`~batchfit.parallel.Sharding`'s fields
    (``{"strategy": "fsdp2", "world_size": 16}``; a field of value ``None`` is written ``N``).
    """

    name: str
    value: Any = None


class Vocabulary:
    """How a message writes the settings it names (NOTE [ Messages in the caller's vocabulary ]).

    Args:
        flags: keyword name → the command-line flag that sets it (``{"memory_limit": "--memory"}``);
            ``None`` writes keyword arguments (:data:`KEYWORDS`).

    Example:
        >>> KEYWORDS.say(Setting("logprobs", "fused")), Vocabulary({"logprobs": "--logprobs"}).say(Setting("logprobs", "fused"))
        ("logprobs='fused'", '--logprobs fused')
    """

    def __init__(self, flags: Mapping[str, str] | None = None):
        self.flags = None if flags is None else dict(flags)

    def say(self, setting: Setting) -> str:
        """``setting`` as the caller writes it: ``logprobs='fused'`` or ``--logprobs fused``, ``memory_limit`` or ``--memory``."""
        name, value = setting.name, setting.value
        flag = None if self.flags is None else self.flags.get(name)
        if name == "sharding" and isinstance(value, Mapping):
            fields = {k: ("N" if v is None else v) for k, v in value.items()}
            strategy = fields.pop("strategy", None)
            if flag is None:
                args = [] if strategy is None else [repr(strategy)]
                args += [f"{k}={v}" if v == "N" else f"{k}={v!r}" for k, v in fields.items()]
                return f"sharding=Sharding({', '.join(args)})"
            words = [] if strategy is None else [f"{flag} {strategy}"]
            return " ".join(words + [self.say(Setting(k, v)) for k, v in fields.items()])
        if flag is None:
            if value is None:
                return name
            return f"{name}=N" if value == "N" else f"{name}={value!r}"  # N: a sharding field to choose
        if value is None or value is True:
            return flag
        if value is False:
            return f"--no-{flag.removeprefix('--')}"
        return f"{flag} {value}"

    def say_all(self, settings: Iterable[Setting]) -> str:
        """Several settings together: ``sharding=…, gradient_checkpointing=True`` or ``--sharding … --gradient-checkpointing``."""
        return (" " if self.flags is not None else ", ").join(self.say(s) for s in settings)


#: The library's vocabulary: keyword arguments.
KEYWORDS = Vocabulary()

# a value as the library writes it: 'a' or 'b' (quoted, maybe a list of choices), or a bare token
_VALUE = r"('[^']*'(?: or '[^']*')*|[^\s,;:()]+)"


def as_flags(message: str, flags: Mapping[str, str]) -> str:
    """``message`` with each keyword of ``flags`` written as its flag: ``name=value`` → ``--flag value``, ``name`` → ``--flag``.

    For a library message written in keywords whose settings are not :class:`Setting` parts
    (a rule's prose). Quotes around values are dropped (a flag's value is typed bare). Only
    whole names are renamed: a dotted config key (``trainer.world_size``) or a longer name is
    left alone.

    Example:
        >>> as_flags("offload='cpu' needs strategy='fsdp1' or 'fsdp2'; use offload='none'",
        ...          {"offload": "--offload", "strategy": "--sharding"})
        '--offload cpu needs --sharding fsdp1 or fsdp2; use --offload none'
    """
    for name in sorted(flags, key=len, reverse=True):
        flag = flags[name]
        message = re.sub(
            rf"(?<![\w.-]){re.escape(name)}={_VALUE}",
            lambda m, flag=flag: f"{flag} {m.group(1).replace(chr(39), '')}",
            message,
        )
        message = re.sub(rf"(?<![\w.-]){re.escape(name)}(?![\w])", flag, message)
    return message


class Phrase:
    """Text that names settings: words (``str``), :class:`Setting` parts and tuples of them said together.

    Example:
        >>> p = Phrase("compute log-probs fused (", Setting("logprobs", "fused"), ")")
        >>> str(p), p.say(Vocabulary({"logprobs": "--logprobs"}))
        ("compute log-probs fused (logprobs='fused')", 'compute log-probs fused (--logprobs fused)')
    """

    def __init__(self, *parts: str | Setting | tuple[Setting, ...]):
        self.parts = parts

    def say(self, vocabulary: Vocabulary | None = None) -> str:
        """The text in ``vocabulary`` (``None``: :data:`KEYWORDS`)."""
        vocabulary = KEYWORDS if vocabulary is None else vocabulary
        out = []
        for part in self.parts:
            if isinstance(part, Setting):
                out.append(vocabulary.say(part))
            elif isinstance(part, tuple):
                out.append(vocabulary.say_all(part))
            else:
                out.append(str(part))
        return "".join(out)

    def changes(self, vocabulary: Vocabulary | None = None) -> list[str]:
        """The settings it names, each as ``vocabulary`` writes it (a tuple of them as one)."""
        vocabulary = KEYWORDS if vocabulary is None else vocabulary
        said = []
        for part in self.parts:
            if isinstance(part, Setting):
                said.append(vocabulary.say(part))
            elif isinstance(part, tuple):
                said.append(vocabulary.say_all(part))
        return said

    def __add__(self, other: str | Phrase) -> Phrase:
        return Phrase(*self.parts, *(other.parts if isinstance(other, Phrase) else (other,)))

    def __radd__(self, other: str) -> Phrase:
        return Phrase(other, *self.parts)

    def __str__(self) -> str:
        return self.say()

    def __repr__(self) -> str:
        return f"Phrase({self.say()!r})"


class DoesNotFitError(BatchfitError):
    """Nothing fits in memory: even the smallest candidate exceeds the limit.

    Raised by the budget and batch-size searches. ``needed`` and ``available`` are bytes
    (``None`` when unknown), so callers can say by how much it failed. The budget search
    also gives the one sequence's ``breakdown`` (bytes by category, one rank's), the
    ``reserve_bytes`` and ``usable_bytes`` the limit was taken from, and ``remedies``: what
    would make it fit, naming settings (NOTE [ Messages in the caller's vocabulary ]);
    ``str(error)`` names them as keyword arguments, :meth:`say` in any vocabulary.
    """

    def __init__(
        self,
        message: str | Phrase,
        *,
        needed: int | None = None,
        available: int | None = None,
        breakdown: Mapping[str, int] | None = None,
        reserve_bytes: int | None = None,
        usable_bytes: int | None = None,
        remedies: Sequence[str | Phrase] = (),
    ):
        self.message = message if isinstance(message, Phrase) else Phrase(message)
        self.needed = needed
        self.available = available
        self.breakdown = dict(breakdown or {})
        self.reserve_bytes = reserve_bytes
        self.usable_bytes = usable_bytes
        self.remedies = tuple(r if isinstance(r, Phrase) else Phrase(r) for r in remedies)
        #: the smallest fsdp2 world size that would fit, when the raiser looked for one
        self.world_size_hint: int | None = None
        #: the smallest sequence-parallel size that would fit one sequence (at ``world_size_hint`` ranks), when looked for
        self.sequence_parallel_hint: int | None = None
        super().__init__(self.say())

    def say(self, vocabulary: Vocabulary | None = None) -> str:
        """The message, its settings and remedies written in ``vocabulary`` (``None``: :data:`KEYWORDS`)."""
        text = self.message.say(vocabulary)
        if self.remedies:
            text += "; to make it fit: " + "; ".join(r.say(vocabulary) for r in self.remedies)
        return text

    def to_dict(self, vocabulary: Vocabulary | None = None) -> dict[str, Any]:
        """The numbers and the remedies as plain values (the CLI's ``--json`` error), settings in ``vocabulary``."""
        out = {
            "needed_bytes": self.needed,
            "limit_bytes": self.available,
            "reserve_bytes": self.reserve_bytes,
            "usable_bytes": self.usable_bytes,
            "breakdown": dict(self.breakdown),
            "remedies": [{"text": r.say(vocabulary), "change": r.changes(vocabulary)} for r in self.remedies],
            "world_size_hint": self.world_size_hint,
        }
        if self.sequence_parallel_hint is not None:
            out["sequence_parallel_hint"] = self.sequence_parallel_hint
        return out

    def replace(self, message: str | Phrase | None = None, *, remedies: Sequence[str | Phrase] | None = None) -> DoesNotFitError:
        """The same error with another message or remedies; its numbers, hint and other attributes kept."""
        out = DoesNotFitError(
            self.message if message is None else message,
            needed=self.needed,
            available=self.available,
            breakdown=self.breakdown,
            reserve_bytes=self.reserve_bytes,
            usable_bytes=self.usable_bytes,
            remedies=self.remedies if remedies is None else remedies,
        )
        out.world_size_hint = self.world_size_hint
        out.sequence_parallel_hint = self.sequence_parallel_hint
        out.__dict__.update({k: v for k, v in vars(self).items() if k not in vars(out)})  # e.g. marks set on it
        return out


class ProbeAbandoned(BatchfitError):
    """A probe on real ranks was left in the middle of its collectives: the search cannot go on.

    Raised on every rank by the budget search when one rank ran out of memory in the middle
    of a sharded step and the others gave up the collective they were waiting in (NOTE [ One
    rank runs out ] in :mod:`batchfit.budget.guard`). The message names the rank and the probe.
    """

