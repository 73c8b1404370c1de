"""slime launch commands (batchfit/frameworks/slime.py): read, planned under slime's and Megatron's rules, emitted as flags slime's parser accepts."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from batchfit.budget.options import ProfileOptions
from batchfit.errors import BatchConfigError
from batchfit.frameworks import read_run_config
from batchfit.frameworks.emit import emit_keys, render_flags
from batchfit.frameworks.flags import flag_spec
from batchfit.frameworks.run_profile import role_options
from batchfit.parallel.sharding import Sharding
from script_helpers import flag_words, slime_commit_source

SOURCE = Path(os.environ.get("BATCHFIT_SLIME_SOURCE", "/work/.mirror/THUDM+slime/repo"))
COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"

# The layout of slime's own scripts/run-*.sh: flags grouped in bash arrays, a sourced model file.
RUN = """#!/bin/bash
set -ex
export PYTHONUNBUFFERED=1
SCRIPT_DIR="$(cd -- "$(dirname -- "${{BASH_SOURCE[0]}}")" &>/dev/null && pwd)"
source "${{SCRIPT_DIR}}/models/qwen3-4B.sh"
NUM_GPUS=${{NUM_GPUS:-8}}

CKPT_ARGS=(
   --hf-checkpoint /root/Qwen3-4B
   --ref-load /root/Qwen3-4B_torch_dist
)
ROLLOUT_ARGS=(
   --rollout-batch-size {rollout}
   --n-samples-per-prompt {n}
   --rollout-max-response-len 8192
   --rollout-max-prompt-len 1024
   {gbs}
)
PERF_ARGS=(
   --tensor-model-parallel-size {tp}
   --sequence-parallel
   --recompute-granularity full
   {perf}
)
GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
)
RUNTIME_ENV_JSON="{{
  \\"env_vars\\": {{\\"CUDA_DEVICE_MAX_CONNECTIONS\\": \\"1\\"}}
}}"
ray job submit --address="http://127.0.0.1:8265" \\
   --runtime-env-json="${{RUNTIME_ENV_JSON}}" \\
   -- python3 train.py \\
   --actor-num-nodes 1 \\
   --actor-num-gpus-per-node ${{NUM_GPUS}} \\
   --colocate \\
   ${{MODEL_ARGS[@]}} \\
   ${{CKPT_ARGS[@]}} \\
   ${{ROLLOUT_ARGS[@]}} \\
   ${{PERF_ARGS[@]}} \\
   ${{GRPO_ARGS[@]}} \\
   --num-rollout 3000 {extra}
"""


def _script(
    tmp_path,
    rollout=32,
    n=8,
    gbs="--global-batch-size 256",
    tp=2,
    perf="--use-dynamic-batch-size --max-tokens-per-gpu 9216",
    extra="",
):
    path = tmp_path / "run-qwen3-4B.sh"
    path.write_text(RUN.format(rollout=rollout, n=n, gbs=gbs, tp=tp, perf=perf, extra=extra))
    return path


def test_a_slime_script_reads_into_the_run_and_plans(tmp_path):
    run = read_run_config(_script(tmp_path))
    assert run.vocabulary == "slime" and run.model == "/root/Qwen3-4B" and run.max_seq_len == 9216
    assert run.world_size == 8 and run.batch.tensor_parallel == 2 and run.strategy == "megatron"
    assert run.gradient_checkpointing is True  # --recompute-granularity full
    assert run.models == {"policy": "/root/Qwen3-4B"}  # the reference runs on the actor's model
    plan = run.plan()
    # 32 prompts × 8 = 256 samples = one optimizer step; dp = 8 / tp 2 = 4
    assert plan.dp_size == 4 and plan.optimizer_steps_per_step == 1 and plan.policy.mini_batch_size == 32
    assert plan.micro_batching == "tokens" and plan.config.max_tokens_per_micro_batch == 9216
    notes = "\n".join(plan.notes)
    assert "the array MODEL_ARGS is not defined in the file" in notes
    assert "NUM_GPUS=8" in notes
    assert "reference log-probs run on the actor's own model" in notes
    # profiled as its Megatron layout: --sequence-parallel, and slime's distributed optimizer, always on
    assert run.megatron_sequence_parallel is True and run.distributed_optimizer is True
    assert "does not profile" not in notes


def test_without_a_global_batch_size_megatron_trains_micro_times_dp(tmp_path):
    run = read_run_config(_script(tmp_path, gbs="", perf="--micro-batch-size 2", rollout=4, n=8))
    plan = run.plan()
    # Megatron validate_args: global batch = micro 2 × dp 4 = 8 samples = 1 prompt of 8; 4 prompts -> 4 steps
    assert plan.policy.mini_batch_size == 1 and plan.optimizer_steps_per_step == 4
    assert any("Megatron uses --micro-batch-size × data-parallel size = 8" in n for n in plan.notes)


def test_num_steps_per_rollout_sets_the_global_batch_size(tmp_path):
    run = read_run_config(_script(tmp_path, gbs="--num-steps-per-rollout 4"))
    assert run.plan().optimizer_steps_per_step == 4  # 256 samples // 4 = 64 per step


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param(
            {"gbs": "--global-batch-size 96"},
            # 256 % 96 = 64
            r"= 256 samples are not a multiple of --global-batch-size=96: slime drops the last 64 of every rollout \(build_dp_schedule\)",
            id="trailing-dropped",
        ),
        pytest.param(
            {"gbs": "--global-batch-size 512"},
            r"a rollout of 256 samples is smaller than --global-batch-size=512: slime asserts at least one optimizer step",
            id="rollout-smaller",
        ),
        pytest.param(
            {"gbs": "--global-batch-size 128", "perf": "--micro-batch-size 3"},
            # 128 % (3 × 4) = 8
            r"--global-batch-size=128 is not divisible by --micro-batch-size × data-parallel size = 3 × 4 = 12 .*: Megatron's microbatch calculator asserts it",
            id="megatron-calculator",
        ),
        pytest.param(
            {
                "rollout": 5,
                "n": 4,
                "gbs": "--global-batch-size 20",
                "perf": "--micro-batch-size 3 --decrease-batch-size-if-needed",
            },
            # ⌈20 / 3⌉ = 7 micro-batches, not a multiple of dp 4
            r"in micro-batches of --micro-batch-size=3 makes 7, not a multiple of the 4 data-parallel ranks \(build_dp_schedule asserts it\)",
            id="static-schedule",
        ),
        pytest.param(
            {"gbs": "--global-batch-size 128 --num-steps-per-rollout 4"},
            r"--global-batch-size=128 disagrees with .* = 256 // 4 = 64 \(slime_validate_args asserts they match\)",
            id="steps-disagree",
        ),
        pytest.param(
            {"tp": 3},
            r"8 GPUs are not divisible by tensor × pipeline × context parallel = 3 \(Megatron validate_args asserts it\)",
            id="world-not-divisible",
        ),
        pytest.param(
            {"perf": "--use-dynamic-batch-size"},
            r"--use-dynamic-batch-size needs --max-tokens-per-gpu \(slime_validate_args asserts it\)",
            id="dynamic-without-tokens",
        ),
    ],
)
def test_slime_rules_are_faults_in_its_own_words(tmp_path, kwargs, match):
    run = read_run_config(_script(tmp_path, **kwargs))
    with pytest.raises(BatchConfigError, match=match):
        run.plan()


def test_decreasing_the_batch_size_with_dynamic_batches_is_a_warning(tmp_path):
    run = read_run_config(
        _script(
            tmp_path,
            gbs="--global-batch-size 128",
            perf="--micro-batch-size 3 --decrease-batch-size-if-needed --use-dynamic-batch-size --max-tokens-per-gpu 9216",
        )
    )
    assert any(
        "with --decrease-batch-size-if-needed Megatron's calculator rounds it down" in w
        for w in run.plan().warnings
    )


def test_a_token_budget_below_the_longest_sequence_and_flops_balancing_warn(tmp_path):
    run = read_run_config(
        _script(tmp_path, perf="--use-dynamic-batch-size --max-tokens-per-gpu 4096 --balance-by-flops")
    )
    warnings = run.plan().warnings
    assert (
        "--max-tokens-per-gpu=4096 × --context-parallel-size=1 is below the longest sequence, 9216 tokens"
        in warnings[0]
    )
    assert "--balance-by-flops partitions micro-batches by estimated FLOPs" in warnings[1]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        pytest.param(
            "--max-token-per-gpu 8192",
            r"unknown flag --max-token-per-gpu; did you mean --max-tokens-per-gpu\? slime ignores flags it does not know",
            id="misspelt-batch-flag",
        ),
        pytest.param(
            "--n-samples-per-prompt many",
            r"argument --n-samples-per-prompt: invalid int value: 'many'",
            id="bad-int",
        ),
    ],
)
def test_what_slime_would_refuse_or_drop_is_refused_on_reading(tmp_path, extra, match):
    with pytest.raises(BatchConfigError, match=match):
        read_run_config(_script(tmp_path, extra=extra))


def test_the_required_rollout_batch_size_is_required(tmp_path):
    path = tmp_path / "args"
    path.write_text("--global-batch-size 64 --n-samples-per-prompt 8\n")
    with pytest.raises(BatchConfigError, match="the following arguments are required: --rollout-batch-size"):
        read_run_config(path)


def test_megatron_and_sglang_flags_are_ignored_as_slime_does(tmp_path):
    run = read_run_config(
        _script(tmp_path, extra="--num-layers 36 --sglang-mem-fraction-static 0.7 --attention-backend flash")
    )
    assert run.plan().dp_size == 4


def test_profile_reads_slimes_megatron_layout_into_the_sharding(tmp_path):
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_script(tmp_path))
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options
    s = options.sharding
    assert (s.strategy, s.world_size, s.tensor_parallel, s.pipeline_parallel, s.data_parallel_size) == ("megatron", 8, 2, 1, 4)
    assert s.megatron_sequence_parallel and s.distributed_optimizer and options.cost == "packed"


@pytest.mark.parametrize(
    ("extra", "chunk", "grad", "rollout_entropy"),
    [
        ("", None, False, False),  # slime's defaults: one chunk, the entropy a metric, none in the forward passes
        ("--log-probs-chunk-size 2048 --entropy-coef 0.01 --use-rollout-entropy", 2048, True, True),
        ("--entropy-coef 0.00 --log-probs-chunk-size -1", None, False, False),
    ],
)
def test_slimes_flags_select_each_pass_head(tmp_path, extra, chunk, grad, rollout_entropy):
    from batchfit.frameworks.config_options import run_profile_options
    from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

    run = read_run_config(_script(tmp_path, extra=extra))
    heads = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options.logprobs
    assert isinstance(heads, MegatronHeads)
    # loss.py: the update always computes the entropy, with its graph only when --entropy-coef != 0
    assert heads.update == MegatronHead("slime", entropy=True, entropy_grad=grad, chunk_size=chunk)
    # model.py forward_only: with_entropy=args.use_rollout_entropy, for the old and the reference log-probs alike
    assert heads.old_log_probs == heads.reference == MegatronHead("slime", entropy=rollout_entropy, chunk_size=chunk)
    assert heads.for_role("policy") is heads.update and heads.for_role("policy_forward") is heads.old_log_probs


@pytest.mark.parametrize(
    ("extra", "chunks"),
    [
        ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 3", 3),
        # validate_args: num_layers / pipeline size / layers per virtual stage = 36 / 2 / 6
        ("--pipeline-model-parallel-size 2 --num-layers 36 --num-layers-per-virtual-pipeline-stage 6", 3),
        ("--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 1", None),  # 1 is none
        ("", None),
    ],
)
def test_megatrons_virtual_stages_are_read_as_validate_args_derives_them(tmp_path, extra, chunks):
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_script(tmp_path, extra=extra))
    assert run.virtual_pipeline_parallel == chunks and not run.faults
    sharding = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options.sharding
    assert sharding.virtual_pipeline_parallel == chunks
    if chunks:
        profile = types.SimpleNamespace(
            run=run,
            budgets={"policy": types.SimpleNamespace(tokens=8192, backend="estimate", usable_bytes=70 * 2**30, cost="packed")},
            options=role_options(run, run_profile_options(run, {"backend": "estimate", "max_seq_len": 9216}).options),
        )
        words = flag_words(render_flags(emit_keys(profile, "slime", max_seq_len=9216, margin=0.85), []))
        at = words.index("--num-virtual-stages-per-pipeline-rank")
        assert words[at + 1] == str(chunks)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("--num-layers-per-virtual-pipeline-stage 6", "needs the model's --num-layers in the command"),
        ("--num-layers 36 --num-layers-per-virtual-pipeline-stage 5", "is not a multiple of --num-layers-per-virtual"),
        ("--pipeline-model-parallel-layout 'Et|t|tL'", "lays layers out unevenly over the pipeline"),
    ],
)
def test_virtual_stages_batchfit_cannot_count_are_faults(tmp_path, extra, match):
    run = read_run_config(_script(tmp_path, extra="--pipeline-model-parallel-size 2 " + extra))
    assert any(match in fault for fault in run.faults), run.faults


def test_megatrons_own_cross_entropy_cannot_be_emitted_to_slime(tmp_path):
    from batchfit.frameworks.assumptions import EmitError

    run = read_run_config(_script(tmp_path, perf=""))
    options = ProfileOptions(
        max_seq_len=9216, backend="estimate", cost="packed", logprobs="full", gradient_checkpointing=True,
        sharding=Sharding("megatron", world_size=8, tensor_parallel=2, megatron_sequence_parallel=True, distributed_optimizer=True),
    )  # fmt: skip
    profile = types.SimpleNamespace(
        run=run,
        budgets={"policy": types.SimpleNamespace(tokens=8192, backend="estimate", usable_bytes=70 * 2**30, cost="packed")},
        options=role_options(run, options),
    )
    # slime always runs its own head: a budget of Megatron's cross-entropy would not hold for it
    with pytest.raises(EmitError, match="--emit slime cannot carry --logprobs full: slime computes log-probs"):
        emit_keys(profile, "slime", max_seq_len=9216, margin=0.85)


def test_a_megatron_head_outside_megatron_is_refused():
    from batchfit.errors import InvalidArgument
    from batchfit.train.megatron_heads import MegatronHead, MegatronHeads

    head = MegatronHead("slime")
    heads = MegatronHeads(update=head, old_log_probs=head, reference=head)
    with pytest.raises(InvalidArgument, match="runs on Megatron's last pipeline stage, but got sharding='fsdp2'"):
        ProfileOptions(max_seq_len=512, logprobs=heads, sharding="fsdp2")
    with pytest.raises(InvalidArgument, match=r"MegatronHeads\.reference must be a MegatronHead, but got str"):
        MegatronHeads(update=head, old_log_probs=head, reference="slime")


@pytest.mark.slow
def test_slimes_head_runs_in_its_profile_and_its_entropy_graph_costs_tokens(tmp_path, capsys):
    import json

    from batchfit.cli import main

    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    budgets = {}
    for coef in ("0.00", "0.01"):
        script = _script(tmp_path, extra=f"--entropy-coef {coef}")
        argv = ["profile", "--config", str(script), "--backend", "estimate", "--model", "tiny", "--json", "--no-progress"]
        assert main(argv) == 0
        profile = json.loads(capsys.readouterr().out)["profiles"]["policy"]
        heads = profile["megatron"]["heads"]
        assert heads["policy"]["framework"] == "slime" and heads["policy"]["entropy_grad"] is (coef != "0.00")
        budgets[coef] = profile["budgets"]["policy"]["tokens"]
    # the entropy's graph keeps its fp32 softmax and logits through the backward: fewer tokens fit
    assert budgets["0.01"] < budgets["0.00"]


def test_the_emitted_flags_carry_slimes_head_as_profiled(tmp_path):
    from batchfit.frameworks.config_options import run_profile_options

    run = read_run_config(_script(tmp_path, perf="", extra="--log-probs-chunk-size 4096 --use-rollout-entropy"))
    options = run_profile_options(run, {"backend": "estimate", "max_seq_len": 9216}).options
    profile = types.SimpleNamespace(
        run=run,
        budgets={"policy": types.SimpleNamespace(tokens=12_000, backend="estimate", usable_bytes=70 * 2**30, cost="packed")},
        options=role_options(run, options),
    )
    text = render_flags(emit_keys(profile, "slime", max_seq_len=9216, margin=0.85), [])
    words = flag_words(text)
    assert words[-3:] == ["--log-probs-chunk-size", "4096", "--use-rollout-entropy"]
    assert "the update's entropy is a metric (--entropy-coef 0), as profiled" in text
    args, _ = flag_spec("slime").parser().parse_known_args(["--rollout-batch-size", "32", *words])
    assert args.log_probs_chunk_size == 4096 and args.use_rollout_entropy is True


def test_slimes_context_parallelism_is_profiled_and_its_per_gpu_tokens_emitted(tmp_path, capsys):
    import json

    from batchfit.cli import main

    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    pytest.importorskip("mbridge", reason="mbridge is not installed: pip install -e '.[megatron]'")
    script = _script(tmp_path, extra="--context-parallel-size 2")
    assert main(["profile", "--config", str(script), "--backend", "estimate", "--model", "tiny", "--emit", "slime", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    profile, emitted = out["profiles"]["policy"], out["emit"]
    s = profile["sharding"]
    assert (s["tensor_parallel"], s["context_parallel"], s["data_parallel"]) == (2, 2, 2)
    assert emitted["--context-parallel-size"] == 2
    # slime packs --max-tokens-per-gpu × --context-parallel-size tokens per micro-batch: the smallest budget over 2
    smallest = min(b["tokens"] for b in profile["budgets"].values())
    assert emitted["--max-tokens-per-gpu"] == smallest // 2
    yours = [n for n in out["emit_notes"] if n.startswith("actor update: yours --max-tokens-per-gpu=9,216 per GPU")]
    budget = profile["budgets"]["policy"]["tokens"]
    assert yours and f"batchfit {budget // 2:,}:" in yours[0]  # compared in the config's unit, per GPU


def _emitted(run, budgets, backend="estimate"):
    # what `profile --config … --emit slime` profiles: its Megatron layout over its GPUs, packed rows, slime's head
    from batchfit.frameworks.run_step import megatron_heads

    options = ProfileOptions(
        logprobs=megatron_heads(run),
        max_seq_len=run.max_seq_len,
        backend="estimate",
        sharding=Sharding(
            "megatron", world_size=run.world_size, tensor_parallel=run.batch.tensor_parallel,
            megatron_sequence_parallel=run.megatron_sequence_parallel, distributed_optimizer=True,
        ),
        cost="packed",
        gradient_checkpointing=bool(run.gradient_checkpointing),
    )
    profile = types.SimpleNamespace(
        run=run,
        budgets={
            r: types.SimpleNamespace(tokens=t, backend=backend, usable_bytes=70 * 2**30, cost="padded")
            for r, t in budgets.items()
        },
        options=role_options(run, options),
    )
    return render_flags(emit_keys(profile, "slime", max_seq_len=run.max_seq_len, margin=0.85), [])


def test_emitted_flags_are_accepted_by_slimes_parser_and_plan_when_added(tmp_path):
    run = read_run_config(_script(tmp_path, perf=""))
    text = _emitted(run, {"policy": 12_000, "policy_forward": 30_000})
    words = flag_words(text)
    # one token flag (the smallest budget), then what the budget assumes: the GPUs, the layout, full recompute
    megatron = [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
        "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ]
    assert words == [
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "12000",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        "8",
        *megatron,
        "--log-probs-chunk-size",  # slime's head as profiled: one chunk
        "-1",
    ]
    # slime's own flags; the recompute flags are Megatron-LM's, whose parser slime's extends
    args, unknown = flag_spec("slime").parser().parse_known_args(["--rollout-batch-size", "32", *words])
    assert args.use_dynamic_batch_size is True and args.max_tokens_per_gpu == 12_000 and unknown == megatron
    assert args.log_probs_chunk_size == -1
    assert "set by policy: estimated budget 12,000 tokens per GPU" in text
    merged = _script(tmp_path, perf=" ".join(words))
    assert read_run_config(merged).plan().config.max_tokens_per_micro_batch == 12_000


def test_emitted_flags_are_accepted_by_the_real_parser_of_that_commit(tmp_path):
    module, text, _ = slime_commit_source(SOURCE, COMMIT)
    parser = module.build_parser("slime", text)  # slime's own add_slime_arguments, run from its source
    run = read_run_config(_script(tmp_path, perf=""))
    words = flag_words(_emitted(run, {"policy": 12_000}))
    args, unknown = parser.parse_known_args(["--rollout-batch-size", "32", *words])
    assert args.max_tokens_per_gpu == 12_000 and args.use_dynamic_batch_size is True
    assert unknown == [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
        "--sequence-parallel", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1",
    ]
    assert args.log_probs_chunk_size == -1  # slime's own flag


def test_the_shipped_flags_are_that_commits():
    module, text, where = slime_commit_source(SOURCE, COMMIT)
    assert module.flag_data("slime", text, where, COMMIT[:12])["flags"] == list(flag_spec("slime").flags)


def test_the_documented_example_plans():
    example = Path(__file__).parents[1] / "examples" / "slime_grpo.sh"
    run = read_run_config(example)  # docs/frameworks.md, "Worked example: slime"
    assert run.model == "qwen2.5-7b" and run.plan().config.max_tokens_per_micro_batch == 8192


def test_a_cpu_offloaded_precision_aware_optimizer_is_read_into_the_sharding(tmp_path):
    from batchfit.frameworks.config_options import run_profile_options

    extra = "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --use-precision-aware-optimizer --exp-avg-dtype bf16"
    run = read_run_config(_script(tmp_path, extra=extra))
    assert not any("not modelled" in n for n in run.notes)
    s = run_profile_options(run, {"backend": "estimate", "max_seq_len": 4096}).options.sharding
    assert (s.optimizer_cpu_offload, s.optimizer_offload_fraction, s.precision_aware_optimizer) == (True, 0.5, True)
    assert (s.exp_avg_dtype, s.exp_avg_sq_dtype, s.main_params_dtype) == ("bf16", "fp32", "fp32")
