"""What a framework config asks for: the batch layout, and the run that ``profile`` needs to measure."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from batchfit.errors import BatchConfigError
from batchfit.plan.config import BatchConfig, BatchPlan


@dataclass(frozen=True)
class RunConfig:
    """A SkyRL, verl or flat config read into batchfit's terms.

    Attributes:
        vocabulary: ``"flat"``, ``"skyrl"`` or ``"verl"`` (:data:`~batchfit.frameworks.source.VOCABULARIES`).
        batch: the batch sizes, with ``framework`` set to the rules the plan follows.
        model: the policy model (path, hub id or preset), or ``None`` when not given.
        critic_model: the critic model, or ``None`` when the run has no critic.
        reference: the run computes reference log-probs (a KL term).
        max_seq_len: the longest sequence, prompt plus response, or ``None``.
        strategy: the training strategy as the config names it (``fsdp``, ``fsdp2``,
            ``megatron``) or ``None``.
        offload: the sharded parameters live on the CPU (``none`` or ``cpu``).
        gradient_checkpointing: activation checkpointing, or ``None`` when not given.
        logprobs_chunk_size: SkyRL's ``trainer.logprobs_chunk_size``.
        colocated: the models (``policy``, ``critic``, ``reference``) that share the GPUs,
            so that one runs while the others' state stays on the device.
        resident: per colocated model, the state it keeps on the device while another
            model runs (``parameters``, ``optimizer_state``); what the framework offloads
            between phases is left out.
        faults: the framework's own rules that the config breaks (beyond the batch plan's).
        source: batchfit's terms → the config keys they were read from (for messages).
        key_names: :class:`BatchConfig` field → the framework's key, so that the plan's
            faults and warnings name the keys the user wrote.
        source: a mapping of batchfit's terms to the config keys they came from.
    """

    vocabulary: str
    batch: BatchConfig
    model: str | None = None
    critic_model: str | None = None
    reference: bool = False
    max_seq_len: int | None = None
    strategy: str | None = None
    offload: str = "none"
    gradient_checkpointing: bool | None = None
    logprobs_chunk_size: int | None = None
    colocated: tuple[str, ...] = ()
    resident: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)
    faults: tuple[str, ...] = ()
    source: dict[str, str] = field(default_factory=dict, compare=False)
    key_names: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def models(self) -> dict[str, str | None]:
        """Each model role the run has → its model (the reference is the policy's model)."""
        out: dict[str, str | None] = {"policy": self.model}
        if self.critic_model:
            out["critic"] = self.critic_model
        if self.reference:
            out["reference"] = self.model
        return out

    @property
    def world_size(self) -> int:
        """GPUs of the policy (``world_size``, or ``num_nodes × gpus_per_node``, default 1)."""
        cfg = self.batch
        if cfg.world_size is not None:
            return cfg.world_size
        return (cfg.num_nodes or 1) * (cfg.gpus_per_node or 1)

    def plan(self, *, strict: bool = False) -> BatchPlan:
        """The batch plan under the framework's rules, with the config's own faults.

        Raises:
            BatchConfigError: every fault at once: the framework rules the config breaks
                (:attr:`faults`) and the plan's (with ``strict``, its warnings too).
        """
        faults = list(self.faults)
        try:
            plan = self.batch.plan(strict=strict)
        except BatchConfigError as exc:
            faults.extend(self.in_own_words(f) for f in exc.faults)
            plan = None
        if faults or plan is None:
            raise BatchConfigError(faults)
        return dataclasses.replace(plan, warnings=tuple(self.in_own_words(w) for w in plan.warnings))

    def in_own_words(self, message: str) -> str:
        """``message`` with batchfit's field names replaced by the framework's keys."""
        if not self.key_names:
            return message
        names = sorted(self.key_names, key=len, reverse=True)
        pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?![\w])")
        return pattern.sub(lambda m: self.key_names[m.group(1)], message)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def as_int(value: Any) -> Any:
    """``"1024"`` → 1024 (CLI overrides and YAML strings); other values unchanged."""
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        if text.lstrip("-").isdigit():
            return int(text)
    return value


def as_bool(value: Any) -> Any:
    """``"true"``/``"false"`` (and yes/no/1/0) → bool; other values unchanged."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "1", "0"):
        return value.strip().lower() in ("true", "yes", "1")
    return value


# Words that make a key a batch-size key: a misspelt one is a fault, not silently ignored.
_BATCH_WORDS = (
    "batch",
    "token_len",
    "tokens_per",
    "epoch",
    "micro",
    "n_samples",
    "num_gpus",
    "nnodes",
    "n_gpus",
    "num_nodes",
)


def misspelt_keys(flat: Mapping[str, Any], known: set[str]) -> list[str]:
    """One fault per batch-size key in ``flat`` that the framework does not have but nearly does.

    A key is judged only when its last part names a batch quantity (:data:`_BATCH_WORDS`)
    and a known key of the same section is a close spelling; every other unknown key may
    belong to the framework's larger schema and is ignored.
    """
    faults = []
    for key in flat:
        if key in known:
            continue
        section, _, leaf = key.rpartition(".")
        if not any(word in leaf for word in _BATCH_WORDS):
            continue
        siblings = {k.rpartition(".")[2]: k for k in known if k.rpartition(".")[0] == section}
        near = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.8)
        if near and near[0] != leaf:
            faults.append(f"unknown key {key!r}; did you mean {siblings[near[0]]!r}?")
    return faults
