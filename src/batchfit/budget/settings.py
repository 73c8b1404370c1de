"""The settings of a profile request, each declared once: :data:`SETTINGS`.

NOTE [ One table of profile settings ]
Every setting a profile request takes is one :class:`ProfileSetting`: its keyword, where it
lands (:class:`~batchfit.budget.ProfileOptions`, its :class:`~batchfit.parallel.Sharding`, the
LoRA spec, the request, or how the answer is shown), how the command line reads it (flag, kind,
metavar, help) and the request's default where the library's differs. From this table come:

- ``batchfit profile``'s flags (:func:`add_arguments`: one ``add_argument`` per row, none elsewhere);
- the vocabulary messages are said in (:data:`FLAGS`: keyword → flag, for the rows messages name);
- the partial a caller and a framework config fill (:class:`~batchfit.budget.choices.Choices`,
  keyed by :class:`ProfileOptions`' and :class:`Sharding`'s own fields, no mirror of them);
- the request the library resolves (:func:`batchfit.frameworks.profile_request.resolve_request`),
  which reads the rows' keywords and applies their defaults.

Adding a setting is a row here and, for an ``options`` or ``sharding`` one, its field in
:class:`ProfileOptions` or :class:`Sharding` (``tests/test_settings.py`` holds them together).
This module imports nothing heavy (no torch): the command line builds its parser from it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from batchfit.errors import Vocabulary
from batchfit.memory.sizes import DEFAULT_ESTIMATE_TARGET

__all__ = [
    "DEFAULT_CPU_MODEL",
    "DEFAULT_ESTIMATE_TARGET",
    "DEFAULT_ESTIMATE_WORLD_SIZE",
    "DEFAULT_GRADIENT_CHECKPOINTING",
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_MODEL",
    "FLAGS",
    "HOMES",
    "MAX_ESTIMATE_WORLD_SIZE",
    "PROSE_FLAGS",
    "SETTINGS",
    "ProfileSetting",
    "add_arguments",
    "flag_vocabulary",
    "setting",
]

# A new user's first run: a 7B model at 8k tokens over 8 estimated H100s, trained as the frameworks'
# recipes train it (FSDP2, fp32 master weights with bf16 compute, activation checkpointing).
DEFAULT_MODEL = "qwen2.5-7b"
# The cpu backend really runs the model on this host: its default is the toy preset.
DEFAULT_CPU_MODEL = "tiny"
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_ESTIMATE_WORLD_SIZE = 8
# A request checkpoints every layer unless told not to (or the config says otherwise), as the
# frameworks' 7B recipes do; ProfileOptions itself leaves it off unless asked.
DEFAULT_GRADIENT_CHECKPOINTING = True
# The most ranks the estimate backend simulates (torch's process groups count ranks in a C int;
# a million GPUs is beyond any run).
MAX_ESTIMATE_WORLD_SIZE = 2**20

#: Where a setting lands: a :class:`ProfileOptions` field, a :class:`Sharding` field, the LoRA spec's,
#: the request's own (what to profile: the model, the config, the roles, confirm), or the answer's
#: showing (JSON, a plot, progress).
HOMES = ("options", "sharding", "lora", "request", "output")

# how the command line reads a row: a value (its Python type), a switch that is on when given, a flag
# with a --no- form (None when neither), or a --no- flag that turns a default-on setting off
_KINDS = ("str", "int", "float", "switch", "bool", "off")


@dataclass(frozen=True)
class ProfileSetting:
    """One setting of a profile request (NOTE [ One table of profile settings ]).

    Attributes:
        name: its keyword: the request's key, the argparse ``dest``, and the name messages say.
        flag: the command line's flag (``--max-seq-len``).
        home: one of :data:`HOMES`.
        kind: ``str``, ``int``, ``float`` (a value of that type), ``switch`` (on when given),
            ``bool`` (``--x``/``--no-x``, ``None`` when neither), ``off`` (``--no-x`` turns it off).
        help: the flag's help.
        metavar: the flag's metavar (values only).
        default: what the request holds when the flag is not given (``None``: not given; the
            request's policy, or the library's default, decides).
        field: the attribute it sets in its home (default ``name``: ``sharding``'s is ``strategy``).
        said: a library message's prose may say ``name`` as ``flag`` (a row of :data:`PROSE_FLAGS`);
            off for names that are also plain words (``model``, ``config``, ``dtype``).
    """

    name: str
    flag: str
    home: str
    kind: str
    help: str
    metavar: str | None = None
    default: Any = None
    field: str | None = None
    said: bool = True

    def __post_init__(self) -> None:
        if self.home not in HOMES or self.kind not in _KINDS:  # the table's own consistency, not user input
            raise TypeError(f"setting {self.name}: home {self.home!r} or kind {self.kind!r} unknown")

    @property
    def attribute(self) -> str:
        """The field it sets in its home."""
        return self.field or self.name

    def argparse_kwargs(self) -> dict[str, Any]:
        """The keywords of this row's ``add_argument`` (its dest is :attr:`name`)."""
        import argparse

        kwargs: dict[str, Any] = {"dest": self.name, "help": self.help}
        if self.kind in ("str", "int", "float"):
            if self.kind != "str":
                kwargs["type"] = {"int": int, "float": float}[self.kind]
            kwargs["metavar"] = self.metavar
            kwargs["default"] = self.default
        elif self.kind == "switch":
            kwargs["action"] = "store_true"
        elif self.kind == "bool":
            kwargs.update(action=argparse.BooleanOptionalAction, default=self.default)
        else:  # off
            kwargs.update(action="store_false", default=self.default)
        return kwargs


def _rows() -> Iterator[ProfileSetting]:
    s = ProfileSetting
    yield s("model", "--model", "request", "str", metavar="PRESET|DIR|ID", said=False, help=(
        f"default {DEFAULT_MODEL} ({DEFAULT_CPU_MODEL} with --backend cpu, which runs it for real)"))
    yield s("config", "--config", "request", "str", metavar="FILE", said=False, help=(
        "a SkyRL, verl, AReaL, NeMo-RL or ROLL config (YAML/JSON), a prime-rl config (TOML), or an OpenRLHF or slime "
        "launch command (a shell script, or a file of its flags): the model, max sequence length, GPUs, sharding, offload, "
        "checkpointing and the roles it runs come from it; flags override"))
    yield s("emit", "--emit", "request", "str", metavar="verl|skyrl|openrlhf|slime|areal|nemo_rl|roll|prime_rl", help=(
        "with --config: print the keys to set in that framework's config (YAML, a comment per key; "
        "openrlhf and slime: the flags to add to the launch command)"))
    yield s("emit_format", "--emit-format", "output", "str", metavar="yaml|overrides", default="yaml", said=False,
            help="yaml (default) or Hydra overrides")
    yield s("max_seq_len", "--max-seq-len", "options", "int", metavar="N",
            help=f"default {DEFAULT_MAX_SEQ_LEN} (or the config's)")
    yield s("backend", "--backend", "options", "str", metavar="NAME", default="auto",
            help="auto (cuda if available, else estimate), cpu, estimate, cuda")
    yield s("memory_limit", "--memory", "options", "str", metavar="SIZE", help=(
        "device memory per rank: 80GiB, 80GB or a preset (h100-80gb, a100-40gb, l4); estimate default "
        f"{DEFAULT_ESTIMATE_TARGET}, cuda default the device's"))
    yield s("reserve_bytes", "--reserve", "options", "str", metavar="SIZE", help=(
        "memory per rank no tracker sees (CUDA context, NCCL, workspaces), taken off --memory: estimate default the "
        "CUDA context, cuBLAS workspaces and NCCL buffers (593.75 MiB sharded, 337.75 MiB on one GPU), cpu 0, cuda "
        "measured; 0 for none"))
    yield s("world_size", "--world-size", "sharding", "int", metavar="N", help=(
        f"data-parallel ranks: simulated with --backend estimate (default {DEFAULT_ESTIMATE_WORLD_SIZE}); with "
        "cpu/cuda the torchrun group's size (the default)"))
    yield s("sharding", "--sharding", "sharding", "str", field="strategy", metavar="none|ddp|fsdp1|fsdp2|zero1|zero2|megatron",
            help=(
        "how the model is spread over the ranks (default fsdp2 when estimating or under torchrun, else none; "
        "fsdp1: FullyShardedDataParallel as verl's strategy fsdp wraps it; zero1/zero2: DeepSpeed ZeRO-1/2, "
        "parameters replicated, optimizer state (zero2: and gradients) partitioned; megatron: Megatron-core's "
        "GPTModel over --tensor-parallel × --pipeline-parallel, docs/megatron.md)"))
    yield s("reshard_after_forward", "--no-reshard-after-forward", "sharding", "off", said=False,
            help="fsdp2: keep every layer's gathered parameters from forward to backward")
    yield s("mixed_precision", "--mixed-precision", "sharding", "str", metavar="bf16|none", help=(
        "fsdp2: bf16 = fp32 sharded parameters, bf16 compute, fp32 gradient reduction (the default with fsdp2)"))
    yield s("offload", "--offload", "sharding", "str", metavar="none|cpu",
            help="fsdp2: cpu = parameters, gradients, optimizer on the host (default none)")
    yield s("sequence_parallel", "--sequence-parallel", "sharding", "int", metavar="N", help=(
        "Ulysses sequence parallelism: each packed micro-batch split over N ranks (divides --world-size; fsdp1/fsdp2; "
        "default 1, or the config's ulysses_sequence_parallel_size / sequence_parallel_size)"))
    yield s("tensor_parallel", "--tensor-parallel", "sharding", "int", metavar="N", help=(
        "--sharding megatron: Megatron's tensor-parallel group size (each layer split N ways; default 1, or the "
        "config's tensor_model_parallel_size)"))
    yield s("pipeline_parallel", "--pipeline-parallel", "sharding", "int", metavar="N", help=(
        "--sharding megatron: pipeline stages (1F1B; the stage that binds is reported; default 1, or the config's "
        "pipeline_model_parallel_size); data parallel = --world-size / (tensor × pipeline)"))
    yield s("virtual_pipeline_parallel", "--virtual-pipeline-parallel", "sharding", "int", metavar="N", help=(
        "--sharding megatron: model chunks per pipeline stage (the interleaved 1F1B schedule; needs "
        "--pipeline-parallel > 1 and the layers divisible by pipeline × N; default none, or the config's "
        "virtual_pipeline_model_parallel_size)"))
    yield s("first_pipeline_stage_layers", "--first-pipeline-stage-layers", "sharding", "int", metavar="N", help=(
        "--sharding megatron: decoder layers of the first pipeline stage (Megatron's "
        "num_layers_in_first_pipeline_stage, --decoder-first-pipeline-num-layers); the middle stages split the rest "
        "evenly (default: an even split, or the config's)"))
    yield s("last_pipeline_stage_layers", "--last-pipeline-stage-layers", "sharding", "int", metavar="N", help=(
        "--sharding megatron: decoder layers of the last pipeline stage (Megatron's "
        "num_layers_in_last_pipeline_stage, --decoder-last-pipeline-num-layers; default: an even split, or the config's)"))
    yield s("megatron_sequence_parallel", "--megatron-sequence-parallel", "sharding", "bool", help=(
        "--sharding megatron: Megatron's sequence parallelism, the activations outside attention split over the "
        "tensor-parallel group (default off, or the config's sequence_parallel)"))
    yield s("distributed_optimizer", "--distributed-optimizer", "sharding", "bool", help=(
        "--sharding megatron: the optimizer state sharded over data parallel (use_distributed_optimizer; default "
        "off, or the config's)"))
    yield s("optimizer_cpu_offload", "--optimizer-cpu-offload", "sharding", "bool", help=(
        "--sharding megatron: Megatron's HybridDeviceOptimizer, the main parameters, Adam's moments and a gradient copy "
        "on the host (host bytes beside the budget; needs --precision-aware-optimizer; default off, or the config's)"))
    yield s("optimizer_offload_fraction", "--optimizer-offload-fraction", "sharding", "float", metavar="F", help=(
        "--sharding megatron: the share of the optimizer state --optimizer-cpu-offload moves (default 1.0, Megatron-LM's)"))
    yield s("precision_aware_optimizer", "--precision-aware-optimizer", "sharding", "bool", help=(
        "--sharding megatron: Megatron's precision-aware optimizer (Transformer Engine's FusedAdam, modelled with "
        "PyTorch's tensors in the dtypes below; needs --distributed-optimizer; default off, or the config's)"))
    for name, choices in (("main_params", "fp32|fp16"), ("main_grads", "fp32|bf16"), ("exp_avg", "fp32|fp16|bf16|fp8"),
                          ("exp_avg_sq", "fp32|fp16|bf16|fp8")):
        yield s(f"{name}_dtype", f"--{name.replace('_', '-')}-dtype", "sharding", "str", metavar=choices, help=(
            f"--precision-aware-optimizer: Megatron's {name}_dtype (default fp32, or the config's)"))
    yield s("context_parallel", "--context-parallel", "sharding", "int", metavar="N", help=(
        "--sharding megatron: Megatron's context parallelism, each sequence cut over N ranks and attention a ring "
        "(Transformer Engine's p2p exchange; default 1, or the config's context_parallel_size); data parallel = "
        "--world-size / (tensor × context × pipeline). Refused under other strategies: use --sequence-parallel"))
    yield s("dtype", "--dtype", "options", "str", metavar="bf16|fp32", said=False,
            help="dtype parameters are stored in (default fp32 under --mixed-precision bf16, else bf16)")
    yield s("gradient_checkpointing", "--gradient-checkpointing", "options", "bool", help=(
        f"activation checkpointing of every layer (default {'on' if DEFAULT_GRADIENT_CHECKPOINTING else 'off'}, "
        "or the config's)"))
    yield s("activation_offload", "--activation-offload", "options", "bool", help=(
        "offload what each decoder layer saves for backward to host memory, as verl's "
        "enable_activation_offload does (default off, or the config's): the device budget rises, the host "
        "bytes are shown beside it"))
    yield s("roles", "--roles", "request", "str", metavar="R,R", help=(
        "policy,critic,reference,policy_forward,critic_forward (default policy; with --config every pass the run makes)"))
    yield s("logprobs", "--logprobs", "options", "str", metavar="full|chunked|fused|verl|skyrl|trl", help=(
        "log-prob computation of the policy/reference step (default full: fp32 log_softmax of all logits; "
        "verl, skyrl: the head that framework runs; trl: TRL's own fused kernel, needs TRL; with --config the "
        "framework's head as its keys set it)"))
    yield s("response_only", "--response-only", "options", "switch", help=(
        "run the policy's and reference's head only on the loss (response) tokens "
        "(batchfit.train.model_logprobs(only_loss_tokens=True)): the budget gets a second cap R on the "
        "response tokens of a micro-batch"))
    yield s("response_fraction", "--response-fraction", "options", "float", metavar="F", help=(
        "with --response-only: the share of a sequence's tokens that are response tokens, in (0, 1] "
        "(4:1 prompt:response = 0.2; default the config's max response / (max prompt + max response), "
        "else 1: every token)"))
    yield s("cost", "--cost", "options", "str", metavar="padded|packed",
            help="micro-batch cost (default padded; with --config packed when the framework removes padding)")
    yield s("lora_rank", "--lora-rank", "lora", "int", field="rank", metavar="N", help=(
        "train LoRA adapters of rank N on a frozen base, built with PEFT (pip install -e '.[lora]' in batchfit's "
        "checkout); 0 = full fine-tuning (default 0, or the config's policy LoRA)"))
    yield s("lora_alpha", "--lora-alpha", "lora", "float", field="alpha", metavar="A", said=False,
            help="with --lora-rank: lora_alpha (default 16, as verl and SkyRL)")
    yield s("lora_targets", "--lora-targets", "lora", "str", field="targets", metavar="all-linear|NAME,NAME", said=False,
            help="with --lora-rank: the modules to adapt (default all-linear: every linear layer but the LM head)")
    yield s("experts_implementation", "--experts-implementation", "options", "str", metavar="grouped_mm|batched_mm|eager",
            help=(
        "how a mixture of experts runs its experts (default: what the installed transformers runs, grouped_mm in "
        "5.x); eager, the per-expert loop, is budgeted for the worst routing (every expert hit, the other tokens all "
        "on the same experts)"))
    yield s("compare_routing", "--compare-routing", "options", "switch", help=(
        "with the eager experts (budgeted for the worst routing): also search the budget with balanced routing "
        "and print both (slow: the loop runs every expert)"))
    yield s("expert_parallel", "--expert-parallel", "sharding", "int", metavar="N", said=False, help=(
        "fsdp2: each MoE layer's experts spread over N ranks, tokens sent by all-to-all (torchtitan's expert "
        "parallelism; divides --world-size and the experts); megatron: Megatron's expert_model_parallel_size "
        "(divides a pipeline stage's ranks); budgeted for the rank that receives the most "
        "(every rank's tokens routed to its experts), docs/moe.md (default 1)"))
    yield s("expert_tensor_parallel", "--expert-tensor-parallel", "sharding", "int", metavar="N", said=False, help=(
        "megatron: Megatron's expert_tensor_parallel_size, the ranks each expert's matrices are split over "
        "(default: --tensor-parallel, Megatron's own; frameworks set 1 beside a large --expert-parallel)"))
    yield s("megatron_router", "--megatron-router", "options", "str", metavar="FIELD=VALUE,...", help=(
        "--sharding megatron: a mixture of experts' router as Megatron's TransformerConfig fields, "
        "moe_router_load_balancing_type (aux_loss|seq_aux_loss|global_aux_loss|none), moe_aux_loss_coeff, "
        "moe_router_dtype (fp32|fp64), moe_z_loss_coeff (e.g. moe_aux_loss_coeff=0.001,moe_router_dtype=fp32; the "
        "auxiliary and z-losses and fp32 logits keep more for backward); fields not given keep the model's mapping "
        "(mbridge's: no auxiliary loss), or the config's (slime's --moe-* flags)"))
    yield s("safety_margin", "--safety-margin", "options", "float", metavar="F", help=(
        "fraction of usable memory (default: what --allocator needs, 0.85 for expandable_segments, 0.83 for "
        "caching; or the --calibration file's)"))
    yield s("allocator", "--allocator", "options", "str", metavar="expandable_segments|caching", help=(
        "the CUDA allocator setting the training processes run with: expandable_segments "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the default, and what --emit turns on) or caching (the "
        "default segments, which fragment over a run: a lower margin); with --config the framework's own"))
    yield s("engine_reserve", "--engine-reserve", "options", "str", metavar="SIZE", help=(
        "memory per GPU a rollout engine sharing the GPUs keeps while it sleeps (CUDA context, NCCL, CUDA "
        "graphs), taken off --memory; with --config the config's engine modelled (vLLM, SGLang); 0 for none"))
    yield s("depth_extrapolation", "--depth-extrapolation", "options", "bool",
            help="measure two shallow copies and extrapolate to the model's depth (default: on when estimating)")
    yield s("confirm", "--confirm", "request", "switch", said=False, help=(
        "estimate first, then run the real step once at each role's budget on the device (--backend cpu "
        "or cuda) and report estimate vs measured per category; exit 1 when a run does not fit"))
    yield s("calibration", "--calibration", "request", "str", metavar="FILE", said=False, help=(
        "with --confirm: write what the runs measured on this device (JSON); without: read such a file and "
        "profile with its memory, reserve and safety margin"))
    yield s("json", "--json", "output", "switch", said=False, help="print the result as JSON")
    yield s("plot", "--plot", "output", "str", metavar="FILE.png", said=False,
            help="plot peak memory vs. tokens per probed length")
    yield s("progress", "--no-progress", "output", "off", default=True, said=False,
            help="no progress (a bar on a terminal; else a line per probe on stderr)")
    yield s("jobs", "--jobs", "output", "int", metavar="N", said=False, help=(
        "processes a probe measures in: 2 measures the two shallow copies side by side (the default where this "
        "process may use 2 CPUs; estimate backend, outside torchrun), 1 one after the other; the same budgets either way"))
    yield s("cache", "--no-cache", "output", "off", default=True, said=False, help=(
        "measure again instead of answering from the profiles already estimated with the same model, settings and "
        "batchfit (kept in $BATCHFIT_CACHE_DIR, default ~/.cache/batchfit/profiles; BATCHFIT_CACHE=0 turns it off)"))


#: Every setting of a profile request, in the order ``batchfit profile --help`` lists them.
SETTINGS: tuple[ProfileSetting, ...] = tuple(_rows())

_BY_NAME = {row.name: row for row in SETTINGS}

#: Every keyword → the flag that sets it (NOTE [ Messages in the caller's vocabulary ] in
#: :mod:`batchfit.errors`): the command line's :class:`~batchfit.errors.Vocabulary`.
FLAGS: dict[str, str] = {row.name: row.flag for row in SETTINGS}

#: The keywords a library message's prose may be rewritten in as flags (:func:`batchfit.errors.as_flags`):
#: not those that are also plain words (``model``, ``config``, ``dtype``) or a ``--no-`` flag.
PROSE_FLAGS: dict[str, str] = {row.name: row.flag for row in SETTINGS if row.said}


def setting(name: str) -> ProfileSetting:
    """The row of ``name``.

    Raises:
        KeyError: no setting has that name.
    """
    return _BY_NAME[name]


def add_arguments(parser: Any) -> None:
    """Add every row of :data:`SETTINGS` to ``parser`` (an argparse parser), one ``add_argument`` each, dest = the row's name."""
    for row in SETTINGS:
        parser.add_argument(row.flag, **row.argparse_kwargs())


def flag_vocabulary() -> Vocabulary:
    """The command line's vocabulary: :data:`FLAGS`."""
    return Vocabulary(FLAGS)
