"""verl rolls out through tailspec on CPU: verl's own LLMServerManager and AgentLoopManager with
``rollout.name=tailspec`` (found through tailspec's ``verl.plugins`` entry point: no code of ours is
called here but the config), the shipped deep policy and its drafter LM, ``adaptive`` speculation,
the drafter trained online between weight pushes. Per step: the agent loop's batch, its tokens/s,
the accept length and the drafter's version verl got back.

verl's trainer needs GPUs (NCCL), so after each step this pushes the policy's weights back through
tailspec's trainer-side adapter as the trainer would after an optimizer step (here unchanged).

    make test-verl   # once: .venv-verl, an environment holding torch 2.13.0 and tailspec[verl]
    .venv-verl/bin/python examples/verl/cpu_rollout.py --steps 4 --prompts 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import numpy as np
import ray
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.workers.rollout.base import get_rollout_class
from verl.workers.rollout.llm_server import LLMServerManager

from tailspec.packed_weights import unpacked_dir
from tailspec.tasks.chain_sum import make_grpo_dataset
from tailspec.tasks.sft import assets_dir, load_shipped
from tailspec.trainer_hooks.verl.agent_loop import TailspecAgentLoopManager


def verl_config(policy_dir: str, settings: dict, response_length: int):
    import verl.trainer.config as trainer_config

    cfg = OmegaConf.load(os.path.join(os.path.dirname(trainer_config.__file__), "_generated_ppo_trainer.yaml"))
    cfg.actor_rollout_ref.model.path = policy_dir
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name, rollout.nnodes, rollout.n_gpus_per_node, rollout.tensor_model_parallel_size = "tailspec", 1, 1, 1
    rollout.prompt_length, rollout.response_length = 128, response_length
    rollout.temperature, rollout.agent.num_workers = 1.0, 1
    rollout.engine_kwargs = {"tailspec": settings}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", default="deep", choices=["tiny", "deep"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--strategy", default="adaptive")
    args = parser.parse_args()
    torch.set_num_threads(1)

    policy_dir = str(unpacked_dir(assets_dir(args.policy) / "policy"))
    drafter_dir = str(unpacked_dir(assets_dir(args.policy) / "drafter"))
    settings = {"strategy": args.strategy, "drafter": drafter_dir, "drafter_train_steps": 4}
    cfg = verl_config(policy_dir, settings, args.response_length)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    manager = LLMServerManager.create(config=cfg)
    agents = TailspecAgentLoopManager.create(config=cfg, llm_client=manager.get_client())
    os.environ.setdefault("RANK", "0")
    adapter = get_rollout_class("tailspec", "async")(
        config=cfg.actor_rollout_ref.rollout, model_config=cfg.actor_rollout_ref.model, device_mesh=None
    )
    policy, _ = load_shipped(args.policy, "policy")
    print("step  prompts  tokens  seconds  tokens/s  accept length  drafter version")
    for step in range(args.steps):
        rows = make_grpo_dataset(args.prompts, seed=100 + step)
        batch = DataProto.from_dict(non_tensors={"raw_prompt": np.array([r["prompt"] for r in rows], dtype=object)})
        start = time.perf_counter()
        out = agents.generate_sequences(batch)
        seconds = time.perf_counter() - start
        tokens = int(out.batch["response_mask"].sum())
        summary = out.meta_info["timing"]  # what verl's trainer logs, as timing_s/tailspec/...
        accept, version = summary["tailspec/accept_length/mean"], int(summary["tailspec/drafter_version"])
        rate = tokens / seconds
        print(f"{step:4d}  {args.prompts:7d}  {tokens:6d}  {seconds:7.2f}  {rate:8.1f}  {accept:13.2f}  {version:15d}")
        asyncio.run(adapter.update_weights((name, t) for name, t in policy.state_dict().items()))
    ray.shutdown()


if __name__ == "__main__":
    main()
