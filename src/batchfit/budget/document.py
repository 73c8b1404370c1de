"""The ``batchfit profile --json`` document (:meth:`batchfit.frameworks.profile_request.ProfileAnswer.to_dict`): one schema version, unambiguous names, stable types.

NOTE [ The --json schema ]
Schema 2 (issue 40) over what the library's ``to_dict`` gives:

- ``schema_version`` (an int, first key) in every document ``profile --json`` prints, its error
  document (``{"schema_version": 2, "error": {...}}``) included. It changes when a key is
  renamed, removed or changes type; added keys do not change it.
- ``device_memory_bytes``: the device's memory per rank (``--memory``; ``null``: the device's
  total), told apart from each budget's ``limit_bytes`` (``safety_margin × usable_bytes``, what
  the probes compared peaks against) and ``usable_bytes`` (device minus reserve).
- ``budget_provenance``: ``"estimated"`` (estimate backend) or ``"measured"``, the word the
  top-level ``budget`` held (a budget is a number everywhere else: ``combined.tokens``).
- ``logprobs``: always an object, ``{"head": "full" | "chunked" | "fused" | …}``, with a
  framework's head as its fields beside (``{"head": "verl", "framework": "verl", "entropy": …}``);
  schema 1 gave a string for batchfit's heads and an object for a framework's.
- Aliases for one version, listed in ``deprecated_keys`` (old → new): ``memory_limit``
  (= ``device_memory_bytes``) and ``budget`` (= ``budget_provenance``). Schema 3 drops them.

``docs/budget.md`` ("The document's schema") says the same for users.
"""

from __future__ import annotations

from typing import Any

#: The version of the ``--json`` document (NOTE [ The --json schema ]).
SCHEMA_VERSION = 2

#: Schema 1's keys kept one version as aliases: old → new.
DEPRECATED_KEYS = {"memory_limit": "device_memory_bytes", "budget": "budget_provenance"}


def logprobs_object(value: Any) -> dict[str, Any]:
    """``logprobs`` as one type: ``"fused"`` → ``{"head": "fused"}``; a framework head's fields gain ``head`` = its framework."""
    if isinstance(value, dict):
        return {"head": value.get("framework", "framework"), **value}
    return {"head": value}


def _profile(data: dict[str, Any]) -> dict[str, Any]:
    """One model's profile dict (``ModelProfile.to_dict``) in schema 2's names (aliases kept)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "memory_limit":
            out["device_memory_bytes"] = value
        elif key == "logprobs":
            value = logprobs_object(value)
        out[key] = value
    return out


def profile_document(data: dict[str, Any], *, provenance: str | None = None) -> dict[str, Any]:
    """``data`` (a profile's or a run's ``to_dict``, with the CLI's additions) as the schema-2 document.

    Args:
        data: ``ModelProfile.to_dict()`` (its keys at the top) or ``RunProfile.to_dict()``
            (each model's under ``profiles``), plus what the command adds.
        provenance: ``"estimated"`` or ``"measured"`` (``budget_provenance``); ``None``: left out.

    Returns:
        A new dict: ``schema_version`` first, then the keys of ``data`` renamed and typed as
        NOTE [ The --json schema ] says, ``deprecated_keys`` last. ``data`` is not changed.
    """
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **_profile(data)}
    if isinstance(data.get("profiles"), dict):
        out["profiles"] = {name: _profile(p) for name, p in data["profiles"].items()}
    if provenance is not None:
        out["budget_provenance"] = provenance
        out["budget"] = provenance  # schema 1's alias
    out["deprecated_keys"] = {old: new for old, new in DEPRECATED_KEYS.items() if old in out}
    return out


def error_document(error: dict[str, Any]) -> dict[str, Any]:
    """The error document: ``{"schema_version": 2, "error": error}``."""
    return {"schema_version": SCHEMA_VERSION, "error": error}
