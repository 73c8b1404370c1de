#!/bin/bash
# GRPO on one 8-GPU node with OpenRLHF 0.11.2's hybrid engine: vLLM, the actor and the reference
# share the GPUs and sleep in turn. `batchfit plan` checks the batch flags the way OpenRLHF and
# DeepSpeed will; `batchfit profile --config examples/openrlhf_grpo.sh --emit openrlhf` prints the
# token-budget flags to add. The model is a batchfit preset here: point it at your checkpoint
# (a directory with config.json is enough).
set -x

python3 -m openrlhf.cli.train_ppo_ray \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 8 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 8 \
   --vllm.num_engines 4 \
   --vllm.tensor_parallel_size 2 \
   --vllm.gpu_memory_utilization 0.6 \
   --vllm.enable_sleep \
   --train.colocate_all \
   --ds.enable_sleep \
   --actor.model_name_or_path qwen2.5-7b \
   --reward.remote_url http://localhost:5000/get_reward \
   --rollout.batch_size 128 \
   --rollout.n_samples_per_prompt 8 \
   --rollout.micro_batch_size 16 \
   --train.batch_size 256 \
   --train.micro_batch_size 4 \
   --train.max_epochs 1 \
   --data.max_len 4096 \
   --rollout.max_new_tokens 3072 \
   --ds.zero_stage 3 \
   --ds.param_dtype bf16 \
   --algo.advantage.estimator group_norm \
   --algo.kl.init_coef 0.001 \
   --algo.kl.use_loss \
   --algo.kl.estimator k3 \
   --actor.adam.lr 5e-7 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 \
   --data.input_key context_messages \
   --data.apply_chat_template \
   --actor.gradient_checkpointing_enable
