#!/bin/bash
# GRPO with slime on one 8-GPU node with Megatron's tensor 2 × pipeline 2 layout (data parallel 2),
# laid out like slime's own scripts/run-*.sh. `batchfit plan` checks the batch flags the way slime
# and Megatron will; `batchfit profile --config examples/slime_megatron.sh --emit slime` profiles
# the layout on Megatron-core's own GPTModel and prints --max-tokens-per-gpu (docs/megatron.md).
# The model is a batchfit preset here: point --hf-checkpoint at your checkpoint (a directory with
# config.json is enough).
set -ex

NUM_GPUS=${NUM_GPUS:-8}

CKPT_ARGS=(
   --hf-checkpoint qwen2.5-0.5b
   --ref-load /root/Qwen2.5-7B_torch_dist
)

ROLLOUT_ARGS=(
   --prompt-data /root/dapo-math-17k/dapo-math-17k.jsonl
   --input-key prompt
   --label-key label
   --apply-chat-template
   --rollout-shuffle
   --num-rollout 3000
   --rollout-batch-size 32
   --n-samples-per-prompt 8
   --rollout-max-prompt-len 1024
   --rollout-max-response-len 3072
   --rollout-temperature 1
   --global-batch-size 256
)

PERF_ARGS=(
   --tensor-model-parallel-size 2
   --sequence-parallel
   --pipeline-model-parallel-size 2
   --context-parallel-size 1
   --recompute-granularity full
   --recompute-method uniform
   --recompute-num-layers 1
   --use-dynamic-batch-size
   --max-tokens-per-gpu 8192
)

GRPO_ARGS=(
   --advantage-estimator grpo
   --use-kl-loss
   --kl-loss-coef 0.00
   --kl-loss-type low_var_kl
   --eps-clip 0.2
   --eps-clip-high 0.28
)

python3 train.py \
   --actor-num-nodes 1 \
   --actor-num-gpus-per-node ${NUM_GPUS} \
   --colocate \
   ${CKPT_ARGS[@]} \
   ${ROLLOUT_ARGS[@]} \
   ${PERF_ARGS[@]} \
   ${GRPO_ARGS[@]} \
   --optimizer adam \
   --lr 1e-6
