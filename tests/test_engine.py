"""batchfit.budget.engine: what a rollout engine keeps on the trainer's GPUs, read from each framework's config.

Also the allocator setting a budget assumes (NOTE [ The allocator's share ]) and verl's optimizer
offload in the log-prob pass: the other terms of "the device as the run holds it" (issue 39).
"""

from __future__ import annotations

import pytest
import yaml

from batchfit.budget import ProfileOptions, profile_model
from batchfit.budget.engine import (
    ENGINE_CONTEXT_BYTES,
    EngineReserve,
    awake_engine_bytes,
    check_awake_phase,
    engine_reserve,
)
from batchfit.cli import main
from batchfit.errors import DoesNotFitError, InvalidArgument
from batchfit.frameworks import read_run_config
from batchfit.frameworks.flags import read_command
from batchfit.models import load_config
from batchfit.plan.placement import RolloutEngine, vllm_capture_sizes
from recorder_helpers import use_recorder

MiB, GiB = 2**20, 2**30
QWEN_7B = load_config("qwen2.5-7b")  # 28 decoder layers


# ----------------------------------------------------------------------------- the model of a sleeping engine


def test_vllm_default_capture_list_has_51_piecewise_and_35_full_graphs_at_256_sequences():
    sizes = vllm_capture_sizes(256)
    assert len(sizes) == 51 and sizes[:4] == (1, 2, 4, 8) and sizes[-1] == 512  # [1,2,4] + 31 steps of 8 + 17 of 16
    assert RolloutEngine(max_num_seqs=256).graph_count() == 51 + 35
    assert vllm_capture_sizes(8) == (1, 2, 4, 8, 16)  # top = min(2 × 8, 512)
    assert RolloutEngine(max_num_seqs=1024).graph_count() == 51 + 51  # every size is a decode size too


def test_a_sleeping_tp2_vllm_engine_keeps_its_context_nccl_and_graph_pool():
    reserve = engine_reserve(RolloutEngine(tensor_parallel=2, max_num_seqs=256), QWEN_7B, device_bytes=80 * GiB)
    assert reserve.context_bytes == 512 * MiB
    assert reserve.communicator_bytes == GiB + 32 * MiB  # NCCL + vLLM's custom all-reduce
    assert reserve.graph_pool_bytes == 946_864_128  # 86 graphs × 28 layers × 384 KiB
    assert reserve.bytes == 512 * MiB + GiB + 32 * MiB + 946_864_128
    assert reserve.describe().startswith("vllm asleep (TP 2): CUDA context 512.00 MiB + NCCL 1.03 GiB + CUDA graphs")


@pytest.mark.parametrize(
    "engine, expected",
    [
        (RolloutEngine(tensor_parallel=1, cuda_graphs=False), ENGINE_CONTEXT_BYTES),  # eager, TP 1: the context alone
        (RolloutEngine(tensor_parallel=1, cuda_graphs=False, own_process=False), 0),  # TRL's in-process engine
        (RolloutEngine(colocated=False, tensor_parallel=8), 0),  # its own GPUs
        (RolloutEngine(tensor_parallel=1, capture_sizes=(1, 2, 4), max_num_seqs=256), 512 * MiB + 6 * 28 * 384 * 1024),
        (RolloutEngine(name="sglang", tensor_parallel=1, releases_graphs=True), 512 * MiB),  # slime releases every tag
        (RolloutEngine(name="sglang", tensor_parallel=1), 512 * MiB + 256 * 2_000_000),  # verl keeps SGLang's graphs
    ],
    ids=["eager", "in-process", "own-gpus", "three-sizes", "sglang-released", "sglang-graphs-kept"],
)
def test_what_an_engine_keeps_asleep_follows_its_settings(engine, expected):
    assert engine_reserve(engine, QWEN_7B, device_bytes=80 * GiB).bytes == expected


def test_an_engine_that_does_not_sleep_keeps_its_whole_share():
    engine = RolloutEngine(memory_fraction=0.5, sleeps=False, own_process=False)
    reserve = engine_reserve(engine, QWEN_7B, device_bytes=80 * GiB)
    assert reserve.bytes == 40 * GiB and "awake (it does not sleep)" in reserve.describe()
    with pytest.raises(InvalidArgument, match="does not sleep, so it keeps a share of the device"):
        engine_reserve(engine, QWEN_7B, device_bytes=None)


def test_vllm_awake_takes_its_fraction_of_the_total_and_its_context():
    assert awake_engine_bytes(RolloutEngine(memory_fraction=0.5), 80 * GiB) == 40 * GiB + 512 * MiB
    assert awake_engine_bytes(RolloutEngine(), 80 * GiB) == 79_027_398_247 + 512 * MiB  # ceil(0.92 × 85,899,345,920)


def test_a_vllm_engine_that_cannot_start_beside_the_trainer_is_refused_with_both_figures_and_the_fix():
    engine = RolloutEngine(memory_fraction=0.9, keys={"memory_fraction": "rollout.gpu_memory_utilization"})
    with pytest.raises(DoesNotFitError, match=r"rollout.gpu_memory_utilization=0.9 asks for 72.50 GiB of 80.00 GiB per GPU, but the trainer keeps 20.00 GiB there") as caught:
        check_awake_phase(engine, device_bytes=80 * GiB, trainer_bytes=20 * GiB, untracked_bytes=0, fix="offload it")
    # (80 − 20 − 0.5) GiB / 80 GiB = 0.74375 → 0.74
    assert "lower rollout.gpu_memory_utilization to 0.74 or less, or offload it" in str(caught.value)
    phase = check_awake_phase(RolloutEngine(memory_fraction=0.7), device_bytes=80 * GiB, trainer_bytes=20 * GiB, untracked_bytes=0, fix="")
    assert phase.spare_bytes == 80 * GiB - 56 * GiB - 512 * MiB - 20 * GiB  # 0.7 × 80 GiB + its context, the trainer's 20 GiB
    assert phase.describe().endswith("of 80.00 GiB: 3.50 GiB to spare")
    assert check_awake_phase(RolloutEngine(name="sglang"), device_bytes=80 * GiB, trainer_bytes=79 * GiB, untracked_bytes=0, fix="") is None


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"name": "trtllm"}, r"engine must be one of 'vllm', 'sglang'"),
        ({"tensor_parallel": 0, "keys": {"tensor_parallel": "rollout.tp"}}, r"rollout.tp must be"),
        ({"memory_fraction": 1.5, "keys": {"memory_fraction": "gmu"}}, r"gmu must be"),
        ({"capture_sizes": "8"}, r"capture_sizes must be a list of batch sizes"),
        ({"capture_sizes": (1, -2)}, r"capture_sizes must be"),
    ],
    ids=["engine", "tp", "fraction", "sizes-text", "sizes-negative"],
)
def test_a_bad_engine_setting_names_its_key(settings, match):
    with pytest.raises(InvalidArgument, match=match):
        RolloutEngine(**settings)


# ----------------------------------------------------------------------------- the frameworks' configs


def _write(tmp_path, name, config):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def _verl(tmp_path, rollout=None, fsdp=None, model="tiny"):
    config = {
        "data": {"train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 48},
        "actor_rollout_ref": {
            "model": {"path": model, "use_remove_padding": True},
            "actor": {"strategy": "fsdp2", "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1,
                      "fsdp_config": fsdp or {}},
            "rollout": {"n": 2, "name": "vllm", "log_prob_micro_batch_size_per_gpu": 2, **(rollout or {})},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 2},
    }  # fmt: skip
    return _write(tmp_path, "verl.yaml", config)


def test_verl_reads_its_rollout_engine_asleep_at_level_2_on_the_actors_gpus(tmp_path):
    run = read_run_config(_verl(tmp_path, {"tensor_model_parallel_size": 4, "gpu_memory_utilization": 0.6}))
    engine = run.engine
    assert (engine.name, engine.colocated, engine.tensor_parallel, engine.memory_fraction) == ("vllm", True, 4, 0.6)
    assert engine.sleeps and engine.sleep_level == 2 and engine.cuda_graphs and engine.max_num_seqs == 256
    assert run.allocator == "expandable_segments"  # engine_workers.update_weights turns them on
    assert run.generation_resident == {"policy": ("parameters", "optimizer_state")}


@pytest.mark.parametrize(
    "rollout, check",
    [
        ({"enforce_eager": True}, lambda e: not e.cuda_graphs),
        ({"free_cache_engine": False}, lambda e: not e.sleeps),
        ({"cudagraph_capture_sizes": [1, 2, 4, 8]}, lambda e: e.capture_sizes == (1, 2, 4, 8) and e.graph_count() == 8),
        ({"name": "sglang"}, lambda e: e.name == "sglang" and not e.releases_graphs),
    ],
    ids=["eager", "awake", "capture-sizes", "sglang"],
)
def test_verl_engine_keys_change_what_it_keeps(tmp_path, rollout, check):
    assert check(read_run_config(_verl(tmp_path, rollout)).engine)


def test_a_verl_rollout_without_a_name_is_taken_for_vllm_and_says_so(tmp_path):
    path = _verl(tmp_path)
    config = yaml.safe_load(path.read_text())
    del config["actor_rollout_ref"]["rollout"]["name"]
    run = read_run_config(_write(tmp_path, "noname.yaml", config))
    assert run.engine.name == "vllm" and any("rollout.name=None" in note for note in run.notes)


def _skyrl(tmp_path, **trainer):
    config = {
        "trainer": {
            "train_batch_size": 8, "policy_mini_batch_size": 4, "micro_train_batch_size_per_gpu": 1,
            "placement": {"colocate_all": True, "policy_num_gpus_per_node": 2},
            "policy": {"model": {"path": "tiny"}},
            "algorithm": {"advantage_estimator": "grpo", "use_kl_loss": False},
            **trainer,
        },
        "generator": {"n_samples_per_prompt": 2, "max_input_length": 16, "sampling_params": {"max_generate_length": 48},
                      "inference_engine": {"tensor_parallel_size": 2}},
    }  # fmt: skip
    return _write(tmp_path, "skyrl.yaml", config)


def test_skyrl_colocate_all_puts_a_sleeping_engine_on_the_trainers_gpus(tmp_path):
    run = read_run_config(_skyrl(tmp_path))
    assert run.engine.colocated and run.engine.sleeps and run.engine.tensor_parallel == 2
    assert run.engine.memory_fraction == 0.8 and run.engine.max_num_seqs == 1024  # SkyRL 0.4.0's defaults
    assert run.allocator == "expandable_segments" and run.generation_resident == {}  # everything offloaded
    apart = read_run_config(_skyrl(tmp_path, placement={"colocate_all": False, "policy_num_gpus_per_node": 2}))
    assert not apart.engine.colocated
    caching = read_run_config(_skyrl(tmp_path, use_expandable_segments=False))
    assert caching.allocator == "caching"
    kept = read_run_config(_skyrl(tmp_path, policy={"model": {"path": "tiny"}, "optimizer_config": {"offload_after_step": False}}))
    assert kept.generation_resident == {"policy": ("optimizer_state",)}


OPENRLHF = """\
{prefix}
python3 -m openrlhf.cli.train_ppo_ray \\
   --actor.model_name_or_path tiny --data.max_len 64 \\
   --actor.num_nodes 1 --actor.num_gpus_per_node 2 \\
   --rollout.batch_size 8 --rollout.n_samples_per_prompt 2 --train.batch_size 8 \\
   --train.micro_batch_size 1 --rollout.micro_batch_size 2 \\
   --vllm.num_engines 1 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.5 \\
   --vllm.enable_sleep --train.colocate_all --ds.enable_sleep
"""


def test_openrlhf_sleeps_its_engines_at_level_1_and_runs_the_launchs_allocator(tmp_path):
    plain = tmp_path / "run.sh"
    plain.write_text(OPENRLHF.format(prefix=""))
    run = read_run_config(plain)
    assert run.engine.sleeps and run.engine.sleep_level == 1 and run.engine.memory_fraction == 0.5
    assert run.allocator == "caching"  # OpenRLHF sets no PYTORCH_CUDA_ALLOC_CONF
    # --ds.enable_sleep keeps the bf16 parameters; the reference (KL's init_coef is on by default) keeps its own
    assert run.generation_resident == {"policy": ("parameters",), "reference": ("parameters",)}
    exported = tmp_path / "exported.sh"
    exported.write_text(OPENRLHF.format(prefix="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"))
    assert read_run_config(exported).allocator == "expandable_segments"


def test_a_launch_scripts_environment_is_what_it_exports_prefixes_and_passes_to_ray(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(
        "export A=1\nB=2\nC=3\nexport C\n"
        'ray job submit --runtime-env-json=\'{"env_vars": {"D": "4"}}\' -- E=5 python3 -m openrlhf.cli.train_ppo_ray --x 1\n'
    )
    assert read_command(script).environment == {"A": "1", "C": "3", "D": "4"}  # B is not exported; E is after "--"


def test_slime_turns_expandable_segments_on_only_when_asked(tmp_path):
    base = (tmp_path / "base.sh", "")
    asked = (tmp_path / "asked.sh", "export SLIME_ENABLE_EXPANDABLE_SEGMENTS=1\n")
    command = (
        "python3 train.py --hf-checkpoint tiny --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-batch-size 8 "
        "--n-samples-per-prompt 2 --global-batch-size 8 --micro-batch-size 1 --colocate --rollout-num-gpus-per-engine 2 "
        "--sglang-mem-fraction-static 0.7 --sglang-cuda-graph-max-bs 64\n"
    )
    for path, prefix in (base, asked):
        path.write_text(prefix + command)
    run = read_run_config(base[0])
    assert run.allocator == "caching" and run.engine.name == "sglang" and run.engine.colocated
    assert run.engine.memory_fraction == 0.7 and run.engine.releases_graphs and run.engine.tensor_parallel == 2
    assert read_run_config(asked[0]).allocator == "expandable_segments"


# ----------------------------------------------------------------------------- the profile


PROFILE = ["profile", "--backend", "estimate", "--memory", "3GiB", "--reserve", "0", "--no-progress", "--max-seq-len", "32"]


def _emit(capsys, args):
    """``profile --config … --emit …``'s keys, read back from its YAML."""
    assert main([*PROFILE, *args]) == 0, capsys.readouterr().err
    return yaml.safe_load(capsys.readouterr().out)


def test_every_pass_is_profiled_with_the_configs_engine_and_engine_reserve_replaces_it(tmp_path, capsys, monkeypatch):
    recorder = use_recorder(monkeypatch)
    _emit(capsys, ["--config", str(_verl(tmp_path)), "--emit", "verl"])
    # tiny: 512 MiB context + 1 GiB NCCL + 32 MiB all-reduce (TP 2, verl's default) + 86 graphs × 2 layers × 384 KiB
    engine = 512 * MiB + GiB + 32 * MiB + 86 * 2 * 384 * 1024
    assert [e.bytes for e in recorder.engines] == [engine]  # the policy's profile: its update and old log-probs
    assert recorder.engines[0].engine.tensor_parallel == 2
    _emit(capsys, ["--config", str(_verl(tmp_path)), "--emit", "verl", "--engine-reserve", "0"])
    assert recorder.engines[1].given_bytes == 0


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_an_engine_lowers_the_usable_memory_by_its_bytes_and_nothing_else():
    engine = EngineReserve(context_bytes=8 * MiB)
    settings = dict(max_seq_len=32, backend="estimate", memory_limit="64MiB", reserve_bytes=0)
    alone = profile_model("tiny", **settings)
    shared = profile_model("tiny", engine=engine, **settings)
    assert alone.combined.usable_bytes - shared.combined.usable_bytes == 8 * MiB
    assert shared.combined.tokens < alone.combined.tokens and shared.engine_bytes == 8 * MiB
    assert shared.reserve_bytes == alone.reserve_bytes == 0  # the engine is its own term
    given = profile_model("tiny", engine=engine, engine_reserve=0, **settings)  # engine_reserve replaces the model
    assert given.combined.tokens == alone.combined.tokens and given.engine.given_bytes == 0


def test_the_verl_emit_header_states_the_engine_and_the_allocator(tmp_path, capsys, monkeypatch):
    use_recorder(monkeypatch)
    assert main([*PROFILE, "--config", str(_verl(tmp_path)), "--emit", "verl"]) == 0
    out = capsys.readouterr().out
    assert "# allocator: expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert "# rollout engine: vllm asleep (TP 2): CUDA context 512.00 MiB + NCCL 1.03 GiB + CUDA graphs 64.50 MiB" in out
    assert "# awake phase: while vLLM generates: it takes 2.00 GiB, the trainer keeps" in out  # 0.5 × 3 GiB + 512 MiB
    assert "verl 0.9.1 switches them on in the trainer after each weight sync" in out  # the allocator's comment


def test_skyrl_colocate_all_takes_its_engine_off_and_the_emit_writes_its_allocator_key(tmp_path, capsys, monkeypatch):
    recorder = use_recorder(monkeypatch)
    path = str(_skyrl(tmp_path))
    keys = _emit(capsys, ["--config", path, "--emit", "skyrl"])
    assert recorder.engines[0].bytes > 0 and keys["trainer"]["use_expandable_segments"] is True
    assert {call[1].allocator for call in recorder.calls} == {"expandable_segments"}
    keys = _emit(capsys, ["--config", path, "--emit", "skyrl", "--allocator", "caching"])
    assert keys["trainer"]["use_expandable_segments"] is False
    assert {call[1].safety_margin for call in recorder.calls[1:]} == {0.83}


def test_a_colocated_vllm_that_cannot_start_beside_the_actor_is_refused_in_one_line(tmp_path, capsys):
    path = _verl(tmp_path, {"gpu_memory_utilization": 0.99})
    assert main([*PROFILE, "--config", str(path)]) == 1  # does not fit
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "cannot start while the trainer keeps its state on the GPU" in err
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.99" in err and "param_offload=true" in err
    assert "asks for 3.47 GiB of 3.00 GiB per GPU" in err  # ceil(0.99 × 3 GiB) + the engine's 512 MiB context


def test_verls_optimizer_offload_runs_the_log_prob_pass_without_the_optimizer_state(tmp_path, capsys, monkeypatch):
    settings = dict(max_seq_len=32, backend="estimate", memory_limit="64MiB", reserve_bytes=0, roles=("policy_forward",))
    kept = profile_model("tiny", **settings).budgets["policy_forward"]
    off = profile_model("tiny", optimizer_offload=True, **settings).budgets["policy_forward"]
    assert kept.breakdown["optimizer_state"] > 0 and not off.breakdown.get("optimizer_state")
    assert off.tokens > kept.tokens
    recorder = use_recorder(monkeypatch)
    keys = _emit(capsys, ["--config", str(_verl(tmp_path, fsdp={"optimizer_offload": True})), "--emit", "verl"])
    assert {call[1].optimizer_offload for call in recorder.calls} == {True}
    assert keys["actor_rollout_ref"]["actor"]["fsdp_config"]["optimizer_offload"] is True
    _emit(capsys, ["--config", str(_verl(tmp_path, fsdp={"optimizer_offload": True})), "--emit", "skyrl"])
    assert recorder.calls[-1][1].optimizer_offload is False  # SkyRL's run keeps the state: not assumed there


# the first tier's time (issue 41): two profiles; the caching allocator's margin 0.83 stays in the first tier
# (test_skyrl_colocate_all_takes_its_engine_off_and_the_emit_writes_its_allocator_key)
@pytest.mark.slow
def test_the_allocator_chooses_the_margin_unless_one_is_given():
    options = ProfileOptions(max_seq_len=64)
    assert (options.allocator, options.safety_margin) == ("expandable_segments", 0.85)
    caching = options.replace(allocator="caching")
    assert caching.safety_margin == 0.83 and caching.replace(allocator="expandable_segments").safety_margin == 0.85
    given = ProfileOptions(max_seq_len=64, safety_margin=0.7).replace(allocator="caching")
    assert given.safety_margin == 0.7
    settings = dict(max_seq_len=32, backend="estimate", memory_limit="64MiB", reserve_bytes=0)
    a = profile_model("tiny", **settings)
    b = profile_model("tiny", allocator="caching", **settings)
    assert b.combined.limit_bytes < a.combined.limit_bytes and b.device_terms()[-1][0].startswith("limit: safety margin 0.83")


# the first tier's time (issue 41): engine_reserve taken as given stays in the first tier
# (test_an_engine_lowers_the_usable_memory_by_its_bytes_and_nothing_else, engine_reserve=0)
@pytest.mark.slow
def test_engine_reserve_given_to_a_model_profile_is_taken_off_and_named():
    p = profile_model("tiny", max_seq_len=32, backend="estimate", memory_limit="64MiB", reserve_bytes=0, engine_reserve="8MiB")
    terms = dict(p.device_terms())
    assert terms["rollout engine: engine_reserve 8.00 MiB (given)"] == 8 * MiB
    assert terms["usable"] == p.combined.usable_bytes == 64 * MiB - 8 * MiB


@pytest.mark.slow  # the first tier's time (issue 41): a fast test of the same capability stays
def test_a_calibrated_profile_assumes_the_allocator_its_runs_had(tmp_path, capsys):
    from batchfit.memory.calibration import Calibration

    path = tmp_path / "cal.json"
    Calibration(
        backend="cuda", device="gpu", device_total_bytes=GiB, untracked_bytes=0, allocator_overhead_bytes=0,
        allocator_overhead_fraction=0.10, estimate_ratio=1.0, allocator="caching",
    ).save(path)  # fmt: skip
    flags = ["profile", "--model", "tiny", "--max-seq-len", "32", "--backend", "estimate", "--no-progress"]
    assert main([*flags, "--calibration", str(path), "--allocator", "expandable_segments"]) == 2
    assert "--allocator expandable_segments differs from the calibration's (caching" in capsys.readouterr().err
    assert main([*flags, "--calibration", str(path)]) == 0
    out = capsys.readouterr().out
    assert "allocator: caching (the default segments" in out and "safety margin 0.89" in out  # 0.98 / 1.10 = 0.8909
