"""verl launch scripts as configs: ``python3 -m verl.trainer.main_ppo key=value …`` read as its Hydra overrides.

Every verl recipe is a shell script; ``--config run.sh`` and ``plan run.sh`` read its overrides as the config they
compose (batchfit/frameworks/hydra_overrides.py), the shell words expanded as bash would
(batchfit/frameworks/flags.py: variables, ``$(( … ))``, arrays, quotes, continuations). The fixture
``tests/fixtures/verl_dapo_like.sh`` is a DAPO-style launch written for these tests. The second tier composes the
same overrides with verl's own Hydra config (tests/verl_config_helpers.py): what batchfit reads, verl composes, and
what batchfit refuses as verl's Hydra, verl's Hydra refuses.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from batchfit import BatchConfigError
from batchfit.cli import main
from batchfit.frameworks import read_run_config
from batchfit.frameworks.flags import _substitute, read_command
from batchfit.frameworks.hydra_overrides import parse_value
from recorder_helpers import use_recorder
from verl_config_helpers import compose, needs_verl

DAPO = Path(__file__).resolve().parent / "fixtures" / "verl_dapo_like.sh"
FAST = ["--backend", "estimate", "--memory", "64MiB", "--reserve", "0", "--engine-reserve", "0", "--no-progress", "--max-seq-len", "32"]
LAUNCH = "python3 -m verl.trainer.main_ppo"
BASE = [
    "data.train_batch_size=8",
    "algorithm.adv_estimator=grpo",
    "data.max_prompt_length=16",
    "data.max_response_length=48",
    "actor_rollout_ref.model.path=tiny",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=2",
    "trainer.nnodes=1",
    "trainer.n_gpus_per_node=2",
]


def _script(tmp_path, *args: str, launch: str = LAUNCH, before: str = "") -> Path:
    path = tmp_path / "run.sh"
    path.write_text(before + launch + " \\\n    " + " \\\n    ".join([*BASE, *args]) + "\n")
    return path


def test_a_dapo_like_script_is_read_as_its_hydra_overrides():
    run = read_run_config(DAPO)  # refused on today's main: "holds no launch command and no flags"
    batch = run.batch
    assert run.vocabulary == "verl" and batch.framework == "verl"
    assert (batch.train_batch_size, batch.policy_mini_batch_size, batch.n_samples_per_prompt) == (32, 16, 16)
    # actor_ppo_max_token_len=$(( (max_prompt_length + max_response_length) / sp_size )) = (2048 + 20480) / 2
    assert batch.max_tokens_per_micro_batch == 11_264
    assert (batch.num_nodes, batch.gpus_per_node, batch.sequence_parallel) == (2, 8, 2)  # NNODES=${NNODES:-2}
    assert run.max_seq_len == 2_048 + 20_480 and run.model == "tiny"  # data.max_response_length=$max_response_length
    assert run.optimizer_offload is True  # fsdp_config.optimizer_offload=${offload} from the array ACTOR=( … )
    assert any("data.train_files=${DATA_HOME}/dapo-math-17k.parquet" in note for note in run.notes)  # HOME: not read
    assert any("hydra.job.chdir=False" in note and "$@" in note for note in run.notes)
    assert run.plan().dp_size == 8  # 16 GPUs over Ulysses 2


def test_plan_and_profile_read_a_verl_launch_script(tmp_path, capsys, monkeypatch):
    path = _script(tmp_path, before="set -x\nN=2\n")
    assert main(["plan", str(path)]) == 0
    assert "verl vocabulary" in capsys.readouterr().out
    use_recorder(monkeypatch)
    assert main(["profile", "--config", str(path), *FAST, "--emit", "verl", "--emit-format", "overrides"]) == 0
    assert "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=" in capsys.readouterr().out


def test_the_emitted_overrides_appended_to_the_script_profile_the_same_run(tmp_path, capsys, monkeypatch):
    recorder = use_recorder(monkeypatch)
    path = _script(tmp_path, "actor_rollout_ref.model.enable_gradient_checkpointing=False")
    flags = [*FAST, "--gradient-checkpointing", "--emit", "verl", "--emit-format", "overrides"]
    assert main(["profile", "--config", str(path), *flags]) == 0
    emitted = capsys.readouterr().out.split()
    assert "actor_rollout_ref.model.enable_gradient_checkpointing=true" in emitted
    seen = list(recorder.calls)
    merged = _script(tmp_path, "actor_rollout_ref.model.enable_gradient_checkpointing=False", *emitted)
    assert main(["profile", "--config", str(merged), *flags[:-4], "--emit", "verl", "--emit-format", "overrides"]) == 0
    assert capsys.readouterr().out.split() == emitted
    assert recorder.calls[len(seen) :] == seen, "the script with the emitted lines was profiled as another run"


def test_a_launch_through_an_array_and_ray_is_found(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text(
        "LAUNCH=(uv run --frozen python3)\nDATA=(\n    data.train_batch_size=16\n)\n"
        'ray job submit --address="$RAY_ADDRESS" -- "${LAUNCH[@]}" -m verl.trainer.main_ppo "${DATA[@]}" \\\n'
        + " \\\n".join(f"  {arg}" for arg in BASE[1:])
        + "\n"
    )
    assert read_command(path).launcher == "verl.trainer.main_ppo"
    assert read_run_config(path).batch.train_batch_size == 16


def test_the_shells_redirections_and_pipes_after_the_launch_are_not_overrides(tmp_path):
    path = _script(tmp_path, '"$@"', "2>&1", ">", "run.log", "|", "tee", "-a", "run.log", ";", "echo", "done")
    run = read_run_config(path)  # on a first draft: "'2>&1': not a Hydra override"
    assert run.batch.train_batch_size == 8
    assert any("2>&1" in note and "> run.log" in note and "| tee -a run.log ; echo done" in note for note in run.notes)


def test_a_script_without_a_launch_names_verl_too(tmp_path):
    path = tmp_path / "run.sh"
    path.write_text("echo hello\n")
    with pytest.raises(BatchConfigError, match=r"verl \(verl\.trainer\.main_ppo or recipe\.dapo\.main_dapo key=value"):
        read_run_config(path)


@pytest.mark.parametrize(
    ("word", "value"),
    [
        ("$((1024 * 2))", "2048"),
        ("$(( (a + b) / sp ))", "11264"),  # variables without $, inside nested parentheses
        ("$((${a}*3))", "6144"),
        ("x$((a/1000))y", "x2y"),
        ("$((-7 / 2))", "-3"),  # bash divides towards zero: -3, not Python's -4
        ("$((7 % -3))", "1"),
        ("$((2 ** 10))", "1024"),
    ],
)
def test_bash_arithmetic_is_evaluated_as_bash_does(word, value):
    from batchfit.frameworks.flags import _squeeze_arithmetic

    variables = {"a": "2048", "b": "20480", "sp": "2", "flag": "True"}
    assert _substitute(_squeeze_arithmetic(word), variables, {}) == (value, True)


@pytest.mark.parametrize("word", ["$((flag * 2))", "$((unset + 1))", "$((1 / 0))", "$((a == b))", "$((a = 3))"])
def test_bash_arithmetic_batchfit_cannot_evaluate_stays_unresolved(word):
    assert _substitute(word, {"a": "1", "b": "2", "flag": "True"}, {})[1] is False


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-6", 1e-6),
        ("0.", 0.0),
        ("True", True),
        ("false", False),
        ("null", None),
        ("22528", 22_528),
        ("'1024'", "1024"),
        ("token-mean", "token-mean"),
        ("['console','wandb']", ["console", "wandb"]),
        ("[q_proj,v_proj]", ["q_proj", "v_proj"]),
        ("{a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}),
        ("${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}", "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"),
    ],
)
def test_override_values_read_as_hydras_grammar(text, value):
    assert parse_value(text) == value


# each: an argument, and the words of batchfit's fault; verl's Hydra refuses each too (second tier, below)
REFUSED = {
    "no-plus-for-a-key-verl-lacks": (
        "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "Could not override",
    ),
    "a-dataclass-field-not-in-the-yaml": ("critic.ppo_infer_max_token_len_per_gpu=8192", "Could not override"),
    "plus-for-a-key-verl-has": ("+data.train_batch_size=8", "Could not append"),
    "not-an-override": ("data.max_prompt_length", "an override needs a value"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_verls_hydra_refuses_is_refused_naming_the_fix(tmp_path, case):
    word, words = REFUSED[case]
    with pytest.raises(BatchConfigError, match=words):
        read_run_config(_script(tmp_path, word))


def test_another_option_of_a_config_group_is_refused_and_the_defaults_one_read(tmp_path):
    # Hydra composes it (another engine's config), whose defaults batchfit does not hold
    with pytest.raises(BatchConfigError, match=r"picks another option of the config group 'model_engine'.*--cfg job"):
        read_run_config(_script(tmp_path, "model_engine=megatron"))
    assert read_run_config(_script(tmp_path, "model_engine=dp")).batch.train_batch_size == 8


def test_an_unset_shell_variable_for_a_key_batchfit_reads_is_a_fault(tmp_path):
    with pytest.raises(BatchConfigError, match=r"data.train_batch_size=\$\{BSZ\}: the file does not set that shell variable"):
        read_run_config(_script(tmp_path, "data.train_batch_size=${BSZ}"))


def test_another_verl_trainer_is_refused_and_a_recipes_config_is_read_with_a_warning(tmp_path):
    with pytest.raises(BatchConfigError, match="--config-name ppo_megatron_trainer: that trainer composes another engine"):
        read_run_config(_script(tmp_path, launch=LAUNCH + " --config-name=ppo_megatron_trainer"))
    # Hydra reads --config-name wherever it stands: the keys before it are a recipe config's, not judged as ppo_trainer's
    run = read_run_config(_script(tmp_path, "data.recipe_key=1", "--config-name", "my_recipe.yaml"))
    assert any("composes its own config (my_recipe)" in w for w in run.warnings)
    run = read_run_config(_script(tmp_path, "+data.anything_the_recipe_adds=1", launch="python3 -m recipe.dapo.main_dapo"))
    assert any("recipe.dapo.main_dapo composes its own config (dapo_trainer)" in w for w in run.warnings)


@pytest.mark.slow  # about 1 s each: Hydra's compose of verl's config
@needs_verl
@pytest.mark.parametrize("case", list(REFUSED))
def test_verls_hydra_refuses_what_batchfit_refuses(case):
    from hydra.errors import HydraException

    word, _ = REFUSED[case]
    compose(BASE)  # the base composes
    with pytest.raises(HydraException):
        compose([*BASE, word])


@pytest.mark.slow
@needs_verl
def test_verls_hydra_composes_the_dapo_like_script_as_batchfit_reads_it():
    from omegaconf import OmegaConf

    command = read_command(DAPO)
    args = [word for i, word in enumerate(command.args) if i not in command.unresolved and word != "$@"]
    composed = compose(args)
    assert OmegaConf.select(composed, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu") == 11_264
    assert OmegaConf.select(composed, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu") == 22_528
    assert OmegaConf.select(composed, "trainer.nnodes") == 2
    run = read_run_config(DAPO)
    assert run.batch.max_tokens_per_micro_batch == OmegaConf.select(composed, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
