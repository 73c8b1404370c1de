"""prime-rl's ``rl`` TOML config (PrimeIntellect-ai/prime-rl@559b4477): reading, its batch rules, and the keys ``--emit prime_rl`` writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import tomllib
import yaml

from batchfit.errors import BatchConfigError, InvalidArgument
from batchfit.frameworks import prime_rl, prime_rl_emit, read_run_config
from batchfit.frameworks.source import detect_vocabulary, flatten, framework_schema
from batchfit.models import preset_info

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE = EXAMPLES / "prime_rl_rl.toml"


def _config(**keys) -> dict:
    """The example's mapping with ``keys`` (``a__b`` for ``a.b``) set."""
    data = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    for dotted, value in keys.items():
        node = data
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return data


def test_the_schema_holds_every_key_of_the_defaults():
    defaults = yaml.safe_load((Path(prime_rl.__file__).parent / "defaults" / "prime_rl.yaml").read_text())
    assert set(flatten(defaults)) <= framework_schema("prime_rl").keys
    assert prime_rl.COMMIT[:8] in framework_schema("prime_rl").title


def test_the_toml_reads_with_tomllib_and_is_told_from_its_keys():
    data = prime_rl.read_toml(EXAMPLE)
    assert data["seq_len"] == 8192 and data["deployment"]["num_train_gpus"] == 4
    assert detect_vocabulary(data) == "prime_rl"
    for name in ("skyrl_grpo.yaml", "skyrl_ppo.yaml", "verl_grpo.yaml", "grpo_4gpu.yaml"):
        path = EXAMPLES / name
        if path.exists():
            assert detect_vocabulary(yaml.safe_load(path.read_text())) != "prime_rl", name


def test_a_file_that_is_not_toml_is_one_fault(tmp_path):
    bad = tmp_path / "rl.toml"
    bad.write_text("seq_len = = 3\n")
    with pytest.raises(BatchConfigError, match="is not TOML"):
        prime_rl.read_toml(bad)


def test_the_example_reads_as_one_packed_row_per_micro_batch():
    run = read_run_config(_config())
    b = run.batch
    # batch_size 256 samples / group_size 16 = 16 problems, one optimizer step per step
    assert (b.train_batch_size, b.n_samples_per_prompt, b.policy_mini_batch_size) == (16, 16, 16)
    # the shared seq_len is the packed micro-batch and the longest sample (NOTE [ prime-rl's micro-batch is one packed row ])
    assert (b.max_tokens_per_micro_batch, run.max_seq_len, run.world_size) == (8192, 8192, 4)
    assert (run.strategy, run.dtype, run.mixed_precision, run.allocator) == ("fsdp2", "fp32", "bf16", "expandable_segments")
    assert run.gradient_checkpointing is True and run.remove_padding is True and run.fused_kernels is True
    assert [(s.role, s.key, s.value) for s in run.configured] == [("policy", "seq_len", 8192)]
    assert any("optim_cpu_offload" in n for n in run.notes) and any("ac_offloading" in n for n in run.notes)
    run.plan()


def test_explicit_component_lengths_win_over_the_shared_one():
    run = read_run_config(_config(orchestrator__seq_len=4096))
    assert run.batch.max_tokens_per_micro_batch == 4096 and run.max_seq_len == 4096


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        pytest.param({"orchestrator__token_batch_size": 100_000}, "Set exactly one of batch_size or token_batch_size", id="xor"),
        pytest.param({"orchestrator__batch_size": 250}, "not a multiple of orchestrator.group_size=16", id="group"),
        pytest.param({"trainer__model__seq_len": 4096}, r"trainer\.model\.seq_len=4096 is below orchestrator\.seq_len=8192", id="shared-len"),
        pytest.param({"deployment__num_train_gpus": 6}, r"num_train_gpus=6 \+ num_infer_gpus=4 exceed", id="gpus"),
        pytest.param({"trainer__model__cp": 3}, "cp=3 does not divide the trainer's 4 GPUs", id="cp-divides"),
        pytest.param({"trainer__model__seq_lenn": 4096}, "did you mean 'trainer.model.seq_len'", id="misspelt"),
    ],
)
def test_what_prime_rl_refuses_is_a_fault_in_its_own_keys(keys, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_config(**keys)).plan()


def test_a_token_batch_has_no_sample_count_but_profiles():
    data = _config()
    del data["orchestrator"]["batch_size"]
    data["orchestrator"]["token_batch_size"] = 200_000
    run = read_run_config(data)
    assert run.batch.train_batch_size is None and any("token_batch_size=200000" in n for n in run.notes)


def test_ring_context_parallelism_is_refused_and_ulysses_is_sequence_parallelism():
    from batchfit.frameworks.config_options import run_profile_options

    ring = read_run_config(_config(trainer__model__cp=2))
    assert ring.batch.context_parallel == 2
    with pytest.raises(InvalidArgument, match=r"trainer\.model\.cp=2 splits each sequence with ring attention"):
        run_profile_options(ring, {})
    ulysses = read_run_config(_config(trainer__model__cp=2, trainer__model__cp_style="ulysses"))
    assert (ulysses.batch.sequence_parallel, ulysses.batch.context_parallel) == (2, 1)


def test_a_multi_node_deployment_counts_the_training_nodes():
    run = read_run_config(_config(deployment={"type": "multi_node", "gpus_per_node": 8, "num_train_nodes": 2, "num_infer_nodes": 2}))
    assert run.world_size == 16


def test_the_token_keys_set_the_shared_and_component_lengths():
    keys = prime_rl_emit.token_keys(None, {"policy": 30_000, "policy_forward": 60_000}, lambda r, w: f"{w} [{r}]", 8192, 4)
    by_path = {k.path: k.value for k in keys if k.path}
    # one budget, the update's: the trainer runs no forward-only pass
    assert by_path == {"seq_len": 30_000, "trainer.model.seq_len": 30_000, "orchestrator.seq_len": 30_000}
    short = prime_rl_emit.token_keys(None, {"policy": 4000}, lambda r, w: w, 8192, 4)
    assert any("prime-rl truncates longer samples" in k.comment for k in short if not k.path)


def _assumptions(head="full", **sharding):
    from batchfit.frameworks.assumptions import Assumptions

    s = {"strategy": "fsdp2", "distributed": True, "world_size": 4, "sequence_parallel": 1, "reshard_after_forward": True,
         "mixed_precision": "bf16", "offload": "none", **sharding}  # fmt: skip
    return Assumptions(
        roles=("policy", "policy_forward"),
        sharding=types.SimpleNamespace(**s),
        dtypes={"policy": "fp32"},
        gradient_checkpointing=True,
        cost="packed",
        head=head,
        lora={},
        response_only=False,
    )


def test_the_assumed_settings_are_trainer_model_keys():
    run = read_run_config(_config())
    keys = {k.path: k.value for k in prime_rl_emit.assumption_keys(run, _assumptions(sequence_parallel=2), True) if k.path}
    assert keys["deployment.num_train_gpus"] == 4 and keys["trainer.model.optimization_dtype"] == "float32"
    assert (keys["trainer.model.cp"], keys["trainer.model.cp_style"]) == (2, "ulysses")
    # the config fuses its LM head; the full head's budgets bound it, so no key turns it off
    assert "trainer.model.fused_lm_head_token_chunk_size" not in keys
    fused = {k.path: k.value for k in prime_rl_emit.assumption_keys(run, _assumptions(head="fused"), True) if k.path}
    assert fused["trainer.model.fused_lm_head_token_chunk_size"] == 8192


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"strategy": "fsdp1"}, "--sharding fsdp1"),
        ({"mixed_precision": "none"}, "--mixed-precision none"),
    ],
)
def test_what_prime_rl_cannot_express_is_refused(changes, match):
    from batchfit.frameworks.assumptions import EmitError

    with pytest.raises(EmitError, match=match):
        prime_rl_emit.assumption_keys(read_run_config(_config()), _assumptions(**changes), True)


_CLI = """
import sys
from batchfit.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_tiny_rl_toml_profiles_and_emits_prime_rls_seq_len(tmp_path):
    model = tmp_path / "tiny-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(preset_info("tiny")["config"])))
    text = EXAMPLE.read_text(encoding="utf-8").replace('"qwen3-0.6b"', json.dumps(str(model))).replace("seq_len = 8192", "seq_len = 512")
    path = tmp_path / "rl.toml"
    path.write_text(text, encoding="utf-8")
    argv = ["profile", "--config", str(path), "--backend", "estimate", "--memory", "1GiB", "--reserve", "0",
            "--engine-reserve", "0", "--no-progress", "--emit", "prime_rl"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _CLI, *argv], capture_output=True, text=True, timeout=600, env={**os.environ}, check=False)
    assert done.returncode == 0, done.stderr
    emitted = tomllib.loads(done.stdout)  # prime-rl's own TOML tables
    tokens = emitted["seq_len"]
    assert tokens >= 512 and emitted["trainer"]["model"]["seq_len"] == tokens == emitted["orchestrator"]["seq_len"]
    assert "a hard cap, samples longer are truncated" in done.stdout and "estimated budget" in done.stdout
    assert emitted["deployment"] == {"num_train_gpus": 4}


def test_the_emitted_keys_render_as_toml_prime_rl_reads():
    from batchfit.frameworks.assumptions import Key

    keys = [Key("seq_len", 30_000, "why"), Key("trainer.model.seq_len", 30_000), Key("trainer.model.cp_style", "ulysses"),
            Key("orchestrator.seq_len", 30_000), Key("", False, "a caveat")]  # fmt: skip
    text = prime_rl_emit.render(keys, ["header"])
    assert text.startswith("# header\n# a caveat\n")
    assert tomllib.loads(text) == {"seq_len": 30_000, "trainer": {"model": {"seq_len": 30_000, "cp_style": "ulysses"}}, "orchestrator": {"seq_len": 30_000}}


def test_a_toml_file_reads_as_a_config(tmp_path):
    assert read_run_config(EXAMPLE).batch.max_tokens_per_micro_batch == 8192
    bad = tmp_path / "rl.toml"
    bad.write_text("seq_len = = 3\n")
    with pytest.raises(BatchConfigError, match="is not TOML"):
        read_run_config(bad)
