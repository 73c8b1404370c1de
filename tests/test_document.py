"""The ``--json`` document's schema (NOTE [ The --json schema ] in batchfit.budget.document)."""

from __future__ import annotations

import json

from batchfit.budget.document import SCHEMA_VERSION, logprobs_object, profile_document
from batchfit.cli import main


def test_a_profile_document_has_a_version_and_unambiguous_names_and_types():
    data = {"model": "m", "logprobs": "fused", "memory_limit": 80 * 2**30, "budgets": {}}
    doc = profile_document(data, provenance="estimated")
    assert list(doc)[:2] == ["schema_version", "model"] and doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["device_memory_bytes"] == doc["memory_limit"] == 80 * 2**30  # the device; its old name an alias
    assert doc["budget_provenance"] == doc["budget"] == "estimated"
    assert doc["deprecated_keys"] == {"memory_limit": "device_memory_bytes", "budget": "budget_provenance"}
    assert doc["logprobs"] == {"head": "fused"}
    assert data["logprobs"] == "fused" and "schema_version" not in data  # the input is left alone


def test_logprobs_is_an_object_in_every_mode_and_each_run_profile_is_renamed():
    head = {"framework": "verl", "entropy": "full", "forward_entropy": "full"}
    assert logprobs_object("full") == {"head": "full"}
    assert logprobs_object(head) == {"head": "verl", **head}
    run = {"vocabulary": "verl", "profiles": {"policy": {"logprobs": head, "memory_limit": None}}}
    doc = profile_document(run)
    assert doc["profiles"]["policy"]["logprobs"]["head"] == "verl"
    assert doc["profiles"]["policy"]["device_memory_bytes"] is None  # null: the device's total
    assert "budget" not in doc and doc["deprecated_keys"] == {}  # no provenance given: no alias to list
    assert run["profiles"]["policy"]["logprobs"] is head  # the input is left alone


def test_an_error_document_carries_the_version(capsys):
    # a usage error before any profiling: one line on stderr, the document on stdout
    assert main(["profile", "--model", "tiny", "--backend", "estimate", "--memory", "1KiB", "--json", "--no-progress"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema_version"] == 2 and doc["error"]["type"] == "InvalidArgument"
