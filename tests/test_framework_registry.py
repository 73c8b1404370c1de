"""The frameworks' registry: one spec per framework, asked by name; an unknown name is a ValueError."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchfit import BatchConfig
from batchfit.frameworks import SPECS
from batchfit.frameworks.emit import FLAG_TARGETS, TARGETS, target_head, target_reference_dtype
from batchfit.frameworks.registry import FrameworkSpec, framework_names, get_framework, register_framework
from batchfit.plan import rules


def test_every_framework_is_registered_once_in_emit_order():
    assert framework_names() == ("verl", "skyrl", "openrlhf", "slime", "areal", "nemo_rl", "roll", "prime_rl")
    assert framework_names() == TARGETS and FLAG_TARGETS == ("openrlhf", "slime")
    assert all(get_framework(spec.name) is spec for spec in SPECS)


def test_an_unknown_framework_is_a_value_error_naming_it_and_the_choices():
    with pytest.raises(ValueError, match=r"framework='verll' .*choices: verl, skyrl, openrlhf, slime, areal, nemo_rl, roll, prime_rl; did you mean 'verl'"):
        get_framework("verll")
    with pytest.raises(ValueError, match=r"framework='x' has no batch rules; choices: batchfit, skyrl, verl"):
        rules.batch_rules("x")


def test_registering_another_spec_under_a_taken_name_is_refused():
    register_framework(get_framework("verl"))  # the same spec again: nothing changes
    spec = FrameworkSpec(name="verl", title="verl 0", markers=("x.y",), read_config=lambda data, given: None)
    with pytest.raises(ValueError, match="registered already"):
        register_framework(spec)


@pytest.mark.parametrize("readers", [{}, {"read_config": print, "read_command": print}], ids=["none", "both"])
def test_a_spec_has_exactly_one_reader(readers):
    with pytest.raises(ValueError, match="exactly one of read_config"):
        FrameworkSpec(name="x", title="x 1", **readers)


def test_a_specs_batch_rules_are_what_batch_config_plans_under_its_name():
    # the plan's table: batchfit's own rules, and those of the specs that have them (sorted)
    assert rules.framework_names() == ("batchfit", "skyrl", "verl")
    for spec in SPECS:
        if spec.batch_rules is not None:
            assert rules.batch_rules(spec.name) is spec.batch_rules
    # 3 prompts × 2 samples over 2 GPUs, mini-batches of 2 prompts: verl pads the step's 6 samples to 8,
    # a multiple of lcm(dp 2, 2 × 2) = 4, and runs 8 / 4 = 2 mini-batches; batchfit refuses 3 % 2
    config = BatchConfig(train_batch_size=3, policy_mini_batch_size=2, n_samples_per_prompt=2, world_size=2)
    plan = config.replace(framework="verl").plan()
    assert (plan.samples_per_step_per_gpu, plan.mini_batches_per_epoch) == (4, 2)
    assert "with 2 rows that train nothing, to 8" in plan.warnings[0]
    with pytest.raises(ValueError, match="train_batch_size=3 is not a multiple of policy_mini_batch_size=2"):
        config.plan()


@pytest.mark.parametrize(
    ("target", "head", "dtype"),
    [("verl", "verl", "fp32"), ("skyrl", "skyrl", "bf16"), ("openrlhf", "full", "bf16"), ("slime", "full", "bf16")],
)
def test_each_target_declares_its_head_and_reference_dtype(target, head, dtype):
    assert (target_head(target), target_reference_dtype(target)) == (head, dtype)


def test_each_config_framework_names_its_gpu_keys_and_what_its_fsdp_means():
    verl, skyrl = get_framework("verl"), get_framework("skyrl")
    assert (verl.fsdp, skyrl.fsdp, get_framework("openrlhf").fsdp) == ("fsdp1", "fsdp2", "fsdp2")
    assert verl.gpu_keys == {"num_nodes": "trainer.nnodes", "gpus_per_node": "trainer.n_gpus_per_node"}
    assert skyrl.gpu_keys["gpus_per_node"] == "trainer.placement.policy_num_gpus_per_node"
    assert [spec.name for spec in SPECS if spec.emit_needs_plan] == ["skyrl"]


def test_the_registry_is_full_after_import_batchfit_without_torch():
    # the package root imports batchfit.frameworks (NOTE [ Rules registered from above ]): it must stay light
    code = (
        "import sys, batchfit; from batchfit.plan.rules import framework_names; "
        "print(framework_names(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('batchfit', 'skyrl', 'verl') False"


def test_each_framework_names_its_emit_module_which_writes_its_token_and_assumption_keys():
    for spec in SPECS:
        module = spec.emit_module()
        assert module.__name__ == f"batchfit.frameworks.{spec.name}_emit"
        assert callable(module.token_keys) and callable(module.assumption_keys)
    with pytest.raises(ValueError, match=r"framework 'x' has no emit module \(FrameworkSpec.emit is None\)"):
        FrameworkSpec(name="x", title="x 1", markers=("x.y",), read_config=print).emit_module()


def test_import_batchfit_imports_no_emit_module():
    # a spec names its emit module by its dotted path, imported on first use (emitting imports torch)
    code = "import sys, batchfit; print(sorted(name for name in sys.modules if name.endswith('_emit')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
