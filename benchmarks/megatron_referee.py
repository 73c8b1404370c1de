"""Korthikanti et al. 2022, Table 2, against the Megatron probe: activation bytes per transformer layer.

Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro, "Reducing Activation Recomputation
in Large Transformer Models" (MLSys 2023, arXiv:2205.05198), Table 2, bytes per layer with 16-bit
activations and dropout on: ``sbh(34 + 5as/h)`` without parallelism, ``sbh(10 + 24/t + 5as/(ht))``
with tensor parallelism, ``sbh(34/t + 5as/(ht))`` with tensor and sequence parallelism.

The probe's figure is the difference of two depths (NOTE [ Per-layer activations from two depths ]):
the activation bytes at the forward's peak of :class:`batchfit.budget.megatron_probe.MegatronStep`'s first
step (estimate backend, the simulated world of ``t`` ranks) at 3 layers minus at 2.

Run: ``python benchmarks/megatron_referee.py`` (about a minute; ``--json`` for the rows).

NOTE [ Per-layer activations from two depths ]
The activations are read at the peak of the forward's head phase (``forward:head``, NOTE [ Phases
and regions ]), where every layer's saved tensors are alive; the head, the embedding and the loss
are the same at any depth, so the difference of two depths is one layer's saved tensors. The
step's own peak is no place to read them: on a small model it can be the optimizer step, where no
activation is left (tiny TP 2 + SP at 128 tokens: a difference of 0); at h = 2048 it is in the
backward and gives the same difference as the head phase. The probe counts
sequence parallelism's all-gather outputs under ``gathered_parameters`` and its reduce-scatter
inputs under ``communication`` (the tracker's FSDP names for those collectives), so those two are
added to ``activations``.

NOTE [ The configuration Table 2 describes ]
The table is a GPT: multi-head attention (``a`` query heads, as many key/value heads), an MLP of
``4h`` with GeLU, LayerNorm, learned absolute positions, linear biases, dropout after the attention
probabilities, the attention's output and the MLP's output, all in 16 bits. The presets are none
of it (SwiGLU MLPs of ~5.4h, RMSNorm, RoPE, grouped-query attention, no dropout), so the referee
builds a Llama config of that shape (``h = 2048, a = 16, 4h``) and overrides Megatron's config to
the table's model: ``normalization="LayerNorm"``, ``gated_linear_unit=False``, ``activation_func=gelu``,
``add_bias_linear=True``, ``hidden_dropout = attention_dropout = 0.1``, no bias/GeLU or bias/dropout
fusion (CUDA kernels), ``position_embedding_type="learned_absolute"``. Dropout runs: the CPU
patches make ``CudaRNGStatesTracker.fork`` a null context, so the attention dropout of the
tensor-parallel region draws from torch's CPU generator instead of a forked CUDA one; the values
differ from a GPU's, the shapes and the bytes do not (a bool mask and a 16-bit output per dropout).

NOTE [ Where the probe differs from Table 2 ]
With ``attention_softmax_in_fp32=False`` (16-bit softmax, the table's assumption) the probe equals
the table plus LayerNorm's saved mean and reciprocal standard deviation, which the table leaves
out: two ``[s, b, 1]`` tensors per norm, two norms per layer, split over the TP group only under
SP. On a CPU tensor torch keeps them in the input's dtype (``8sb`` bytes in bf16; CUDA's kernel
keeps them in fp32, ``16sb``): 16,384 B on 478 MB at h = 2048, s = 2048, a ratio of 1.0000. The
dropout masks are CUDA's one-byte bool masks (NOTE [ Dropout as CUDA runs it ] in
:mod:`batchfit.models.megatron`; a CPU's ``F.dropout`` would keep a mask of the input's dtype,
``+as²b + 2sbh`` in bf16) and the learned position embedding is made in bf16 (NOTE [ Megatron's
parameters in one dtype ]; fp32, it doubled every activation).
Megatron's default is ``attention_softmax_in_fp32=True`` (mbridge leaves it, verl runs it):
``FusedScaleMaskSoftmax`` without the fused kernel casts the scores to fp32, softmaxes there and
keeps the fp32 probabilities for softmax's backward, ``4as²b/t`` bytes instead of ``2as²b/t``, so
the attention term is ``7as²b/t`` where the table has ``5as²b/t``: exactly ``+2as²b/t`` measured,
1.28× the table at h = 2048, s = 2048 (5as/h = 80, the attention term dominates). The presets add
their own terms (docs/megatron.md): SwiGLU's fc1 of ``2 × ffn`` (~5.4h) saves its output, the SiLU
output and the product; RoPE saves the rotated query and key; grouped-query attention has fewer
key/value heads.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from typing import Any

#: Korthikanti et al.'s shape (h/a = 128, like GPT-3 175B; 5as/h = 80, as GPT-3's).
HIDDEN, HEADS, SEQ, BATCH, VOCAB = 2048, 16, 2048, 1, 32000
#: (tensor_parallel, sequence_parallel) rows of Table 2 measured here.
ROWS = ((1, False), (2, False), (2, True))


def table_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer (16-bit, dropout on, no recomputation)."""
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def referee_config(hidden: int = HIDDEN, heads: int = HEADS, seq: int = SEQ, vocab: int = VOCAB) -> Any:
    """The Llama config of Table 2's shape (multi-head, 4h MLP); Megatron's overrides make it the table's GPT."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * hidden,
        num_hidden_layers=2,
        vocab_size=vocab,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )


def table_overrides(softmax_in_fp32: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields of Table 2's model (NOTE [ The configuration Table 2 describes ])."""
    import torch.nn.functional as F

    return {
        "normalization": "LayerNorm",
        "gated_linear_unit": False,
        "activation_func": F.gelu,
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "attention_softmax_in_fp32": softmax_in_fp32,
        "apply_query_key_layer_scaling": False,
    }


def activation_bytes(measurement: Any) -> int:
    """Activations at the peak, sequence parallelism's collective buffers included (NOTE [ Per-layer activations from two depths ])."""
    got = measurement.phase_breakdowns.get("forward:head") or measurement.breakdown
    return sum(got.get(c, 0) for c in ("activations", "gathered_parameters", "communication"))


def measured_per_layer(t: int, sp: bool, *, softmax_in_fp32: bool, seq: int = SEQ, batch: int = BATCH, config: Any = None) -> dict[str, Any]:
    """The probe's activation bytes per layer (3 layers minus 2) at ``t``-way TP (± SP), with its timings."""
    import torch

    from batchfit.budget.megatron_probe import MegatronStep
    from batchfit.memory import get_backend

    warnings.filterwarnings("ignore")
    config = referee_config(seq=seq) if config is None else config
    out: dict[str, Any] = {}
    start = time.perf_counter()
    for layers in (2, 3):
        backend = get_backend("estimate", reserve_bytes=0, round_to=1)
        step = MegatronStep(
            config,
            tensor_parallel=t,
            sequence_parallel=sp,
            backend=backend,
            dtype=torch.bfloat16,
            gpt_args={"position_embedding_type": "learned_absolute"},
            num_layers=layers,
            **table_overrides(softmax_in_fp32),
        )
        m = step.measure([seq] * batch)
        out[layers] = (m.peak_bytes, activation_bytes(m), m.peak_position if hasattr(m, "peak_position") else None)
    return {"per_layer": out[3][1] - out[2][1], "peaks": (out[2][0], out[3][0]), "seconds": time.perf_counter() - start}


def rows(seq: int = SEQ, batch: int = BATCH) -> list[dict[str, Any]]:
    """Every row of :data:`ROWS`, 16-bit and fp32 softmax, beside the table."""
    out = []
    for t, sp in ROWS:
        table = table_bytes(seq, batch, HIDDEN, HEADS, t, sp)
        for fp32 in (False, True):
            got = measured_per_layer(t, sp, softmax_in_fp32=fp32, seq=seq, batch=batch)
            out.append({
                "t": t, "sp": sp, "softmax_in_fp32": fp32, "table": round(table), "measured": got["per_layer"],
                "ratio": got["per_layer"] / table, "seconds": round(got["seconds"], 1),
            })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    got = rows(seq=args.seq)
    if args.json:
        print(json.dumps(got, indent=1))
        return
    print(f"h={HIDDEN} a={HEADS} s={args.seq} b={BATCH} bf16, dropout 0.1")
    for r in got:
        print(f"t={r['t']} sp={r['sp']!s:5} fp32-softmax={r['softmax_in_fp32']!s:5} table {r['table']:>13,} "
              f"measured {r['measured']:>13,}  ratio {r['ratio']:.4f}  ({r['seconds']} s)")


if __name__ == "__main__":
    main()
