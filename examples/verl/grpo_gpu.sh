#!/usr/bin/env bash
# GRPO with verl 0.9.1 on one 8-GPU node, rollouts through tailspec (rollout.name=tailspec): each GPU's
# trainer worker has a tailspec server beside it (hybrid mode), speculating with `adaptive` from a
# drafter LM that trains online on the rollouts and follows every weight push; tailspec's agent loop
# manager adds each batch's accept length, drafter version and health to verl's logged metrics
# (timing_s/tailspec/...).
#   pip install "tailspec[verl]"   # keeps the environment's torch; verl 0.9.1 with transformers <5.11
# Not run here (no GPU in tailspec's CI); the same backend runs verl's LLMServerManager and
# AgentLoopManager on CPU in make test-verl and examples/verl/cpu_rollout.py.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-1.7B}
DRAFTER=${DRAFTER:-/path/to/drafter_lm}   # a smaller LM with the policy's vocabulary (safetensors), or self:8
python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$HOME/data/gsm8k/train.parquet" \
  data.val_files="$HOME/data/gsm8k/test.parquet" \
  data.train_batch_size=256 \
  data.max_prompt_length=512 \
  data.max_response_length=4096 \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.actor.optim.lr=1e-6 \
  actor_rollout_ref.actor.ppo_mini_batch_size=64 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.use_kl_loss=True \
  actor_rollout_ref.rollout.name=tailspec \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
  +actor_rollout_ref.rollout.engine_kwargs.tailspec.strategy=adaptive \
  +actor_rollout_ref.rollout.engine_kwargs.tailspec.drafter="$DRAFTER" \
  +actor_rollout_ref.rollout.engine_kwargs.tailspec.drafter_train_steps=4 \
  +actor_rollout_ref.rollout.engine_kwargs.tailspec.engine.dtype=bfloat16 \
  +actor_rollout_ref.rollout.agent.agent_loop_manager_class=tailspec.trainer_hooks.verl.agent_loop.TailspecAgentLoopManager \
  trainer.n_gpus_per_node=8 \
  trainer.nnodes=1 \
  trainer.total_epochs=1 \
  trainer.logger='["console"]' \
  "$@"
