"""``batchfit profile``: the token budget of a model on a (real or estimated) device.

The command's parser. Its modules: :mod:`batchfit.cli.profile_request` (the flags checked and
resolved against ``--config``), :mod:`batchfit.cli.profile_runs` (the run modes: a plain profile,
``--config``/``--emit``, ``--confirm``), :mod:`batchfit.cli.render_profile` (the tables),
:mod:`batchfit.cli.probe_progress` (the progress bar or lines).

It calls :func:`batchfit.budget.model_profile.profile_model`, renders a table per role,
the budget and the memory model (or ``--json``), a rich progress bar while probing, and
``--plot`` (matplotlib, imported only then). ``--confirm`` calls
:func:`batchfit.budget.confirm.plan_confirm` and :func:`~batchfit.budget.confirm.run_confirm`
(the estimate before any process group is joined, the real runs on the ranks) and renders the
estimate and then the confirm table per role; ``--calibration FILE`` writes (with ``--confirm``)
or reads a :class:`~batchfit.memory.calibration.Calibration`.
"""

from __future__ import annotations

import argparse

from batchfit.budget.model_profile import ROLES
from batchfit.cli.profile_request import (
    DEFAULT_CPU_MODEL,
    DEFAULT_ESTIMATE_WORLD_SIZE,
    DEFAULT_GRADIENT_CHECKPOINTING,
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MODEL,
    FLAGS,
)
from batchfit.cli.profile_runs import run
from batchfit.errors import Vocabulary
from batchfit.memory import DEFAULT_ESTIMATE_TARGET
from batchfit.memory.cuda_untracked import ALLOCATOR_MARGINS, ALLOCATORS

__all__ = ["FLAGS", "add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``batchfit profile`` on the dispatcher's subparsers."""
    p = sub.add_parser(
        "profile",
        help="find the token budget per rank: the largest micro-batch cost that fits in memory",
        description=(
            "Probe a training step (forward, backward, AdamW step) at several sequence lengths, longest first, "
            "and report the token budget C per rank: any micro-batch with cost <= C fits. Models are sharded "
            "with PyTorch's own FSDP2 or DDP. Without a GPU the estimate backend predicts a target device in "
            f"seconds by simulating the ranks (default: {DEFAULT_MODEL} at {DEFAULT_MAX_SEQ_LEN} tokens, fsdp2 "
            f"over {DEFAULT_ESTIMATE_WORLD_SIZE} × {DEFAULT_ESTIMATE_TARGET}, gradient checkpointing). With "
            "--backend cpu or cuda under torchrun every rank measures for real and rank 0 prints."
        ),
    )
    p.add_argument(
        "--model",
        metavar="PRESET|DIR|ID",
        help=f"default {DEFAULT_MODEL} ({DEFAULT_CPU_MODEL} with --backend cpu, which runs it for real)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="a SkyRL or verl config (YAML/JSON), or an OpenRLHF or slime launch command (a shell script, or a "
        "file of its flags): the model, max sequence length, GPUs, sharding, offload, "
        "checkpointing and the roles it runs come from it; flags override",
    )
    p.add_argument(
        "--emit",
        metavar="verl|skyrl|openrlhf|slime",
        help="with --config: print the keys to set in that framework's config (YAML, a comment per key; "
        "openrlhf and slime: the flags to add to the launch command)",
    )
    p.add_argument(
        "--emit-format", default="yaml", metavar="yaml|overrides", help="yaml (default) or Hydra overrides"
    )
    p.add_argument(
        "--max-seq-len", type=int, metavar="N", help=f"default {DEFAULT_MAX_SEQ_LEN} (or the config's)"
    )
    p.add_argument(
        "--backend",
        default="auto",
        metavar="NAME",
        help="auto (cuda if available, else estimate), cpu, estimate, cuda",
    )
    p.add_argument(
        "--memory",
        metavar="SIZE",
        help=f"device memory per rank: 80GiB, 80GB or a preset (h100-80gb, a100-40gb, l4); estimate default {DEFAULT_ESTIMATE_TARGET}, cuda default the device's",
    )
    p.add_argument(
        "--reserve",
        metavar="SIZE",
        help="memory per rank no tracker sees (CUDA context, NCCL, workspaces), taken off --memory: estimate default the CUDA context, cuBLAS workspaces and NCCL buffers (593.75 MiB sharded, 337.75 MiB on one GPU), cpu 0, cuda measured; 0 for none",
    )
    p.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help=f"data-parallel ranks: simulated with --backend estimate (default {DEFAULT_ESTIMATE_WORLD_SIZE}); with cpu/cuda the torchrun group's size (the default)",
    )
    p.add_argument(
        "--sharding",
        metavar="none|ddp|fsdp1|fsdp2|zero1|zero2",
        help="how the model is spread over the ranks (default fsdp2 when estimating or under torchrun, else none; "
        "fsdp1: FullyShardedDataParallel as verl's strategy fsdp wraps it; zero1/zero2: DeepSpeed ZeRO-1/2, "
        "parameters replicated, optimizer state (zero2: and gradients) partitioned)",
    )
    p.add_argument(
        "--no-reshard-after-forward",
        dest="reshard_after_forward",
        action="store_false",
        default=None,
        help="fsdp2: keep every layer's gathered parameters from forward to backward",
    )
    p.add_argument(
        "--mixed-precision",
        metavar="bf16|none",
        help="fsdp2: bf16 = fp32 sharded parameters, bf16 compute, fp32 gradient reduction (the default with fsdp2)",
    )
    p.add_argument(
        "--offload",
        metavar="none|cpu",
        help="fsdp2: cpu = parameters, gradients, optimizer on the host (default none)",
    )
    p.add_argument(
        "--sequence-parallel",
        type=int,
        metavar="N",
        help="Ulysses sequence parallelism: each packed micro-batch split over N ranks (divides --world-size; fsdp1/fsdp2; "
        "default 1, or the config's ulysses_sequence_parallel_size / sequence_parallel_size)",
    )
    p.add_argument(
        "--context-parallel",
        type=int,
        metavar="N",
        help="ring attention over N ranks: refused above 1 (PyTorch's context_parallel has no CPU sharding strategy "
        "for sdpa and no packed rows); use --sequence-parallel",
    )
    p.add_argument(
        "--dtype",
        metavar="bf16|fp32",
        help="dtype parameters are stored in (default fp32 under --mixed-precision bf16, else bf16)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"activation checkpointing of every layer (default {'on' if DEFAULT_GRADIENT_CHECKPOINTING else 'off'}, "
        "or the config's)",
    )
    p.add_argument(
        "--activation-offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="offload what each decoder layer saves for backward to host memory, as verl's "
        "enable_activation_offload does (default off, or the config's): the device budget rises, the host "
        "bytes are shown beside it",
    )
    p.add_argument(
        "--roles",
        metavar="R,R",
        help=f"{','.join(ROLES)} (default policy; with --config every pass the run makes)",
    )
    p.add_argument(
        "--logprobs",
        metavar="full|chunked|fused|verl|skyrl|trl",
        help="log-prob computation of the policy/reference step (default full: fp32 log_softmax of all logits; "
        "verl, skyrl: the head that framework runs; trl: TRL's own fused kernel, needs TRL; with --config the "
        "framework's head as its keys set it)",
    )
    p.add_argument(
        "--response-only",
        action="store_true",
        help="run the policy's and reference's head only on the loss (response) tokens "
        "(batchfit.train.model_logprobs(only_loss_tokens=True)): the budget gets a second cap R on the "
        "response tokens of a micro-batch",
    )
    p.add_argument(
        "--response-fraction",
        type=float,
        metavar="F",
        help="with --response-only: the share of a sequence's tokens that are response tokens, in (0, 1] "
        "(4:1 prompt:response = 0.2; default the config's max response / (max prompt + max response), "
        "else 1: every token)",
    )
    p.add_argument(
        "--cost",
        metavar="padded|packed",
        help="micro-batch cost (default padded; with --config packed when the framework removes padding)",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        metavar="N",
        help="train LoRA adapters of rank N on a frozen base, built with PEFT (pip install -e '.[lora]' in batchfit's checkout); "
        "0 = full fine-tuning (default 0, or the config's policy LoRA)",
    )
    p.add_argument(
        "--lora-alpha",
        type=float,
        metavar="A",
        help="with --lora-rank: lora_alpha (default 16, as verl and SkyRL)",
    )
    p.add_argument(
        "--lora-targets",
        metavar="all-linear|NAME,NAME",
        help="with --lora-rank: the modules to adapt (default all-linear: every linear layer but the LM head)",
    )
    p.add_argument(
        "--experts-implementation",
        metavar="grouped_mm|batched_mm|eager",
        help="how a mixture of experts runs its experts (default: what the installed transformers runs, grouped_mm in "
        "5.x); eager, the per-expert loop, is budgeted for the worst routing (every expert hit, the other tokens all on the same experts)",
    )
    p.add_argument(
        "--compare-routing",
        action="store_true",
        help="with the eager experts (budgeted for the worst routing): also search the budget with balanced routing "
        "and print both (slow: the loop runs every expert)",
    )
    p.add_argument(
        "--expert-parallel",
        type=int,
        metavar="N",
        help="expert parallelism is not modelled: any N above 1 is refused (docs/moe.md)",
    )
    p.add_argument(
        "--safety-margin",
        type=float,
        metavar="F",
        help="fraction of usable memory (default: what --allocator needs, "
        + ", ".join(f"{ALLOCATOR_MARGINS[a]:g} for {a}" for a in ALLOCATORS)
        + "; or the --calibration file's)",
    )
    p.add_argument(
        "--allocator",
        metavar="|".join(ALLOCATORS),
        help="the CUDA allocator setting the training processes run with: expandable_segments "
        "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; the default, and what --emit turns on) or caching (the "
        "default segments, which fragment over a run: a lower margin); with --config the framework's own",
    )
    p.add_argument(
        "--engine-reserve",
        metavar="SIZE",
        help="memory per GPU a rollout engine sharing the GPUs keeps while it sleeps (CUDA context, NCCL, CUDA "
        "graphs), taken off --memory; with --config the config's engine modelled (vLLM, SGLang); 0 for none",
    )
    p.add_argument(
        "--depth-extrapolation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure two shallow copies and extrapolate to the model's depth (default: on when estimating)",
    )
    p.add_argument(
        "--confirm",
        action="store_true",
        help="estimate first, then run the real step once at each role's budget on the device (--backend cpu "
        "or cuda) and report estimate vs measured per category; exit 1 when a run does not fit",
    )
    p.add_argument(
        "--calibration",
        metavar="FILE",
        help="with --confirm: write what the runs measured on this device (JSON); without: read such a file and "
        "profile with its memory, reserve and safety margin",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot peak memory vs. tokens per probed length")
    p.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress (a bar on a terminal; else a line per probe on stderr)",
    )
    p.set_defaults(func=run, vocabulary=Vocabulary(FLAGS))
