"""verl's side of the tailspec backend: the replica verl launches (``rollout.name=tailspec``) and
the Ray actor that serves each replica (a :class:`TailspecServer` in verl's server shape).

Speculation is set under ``actor_rollout_ref.rollout.engine_kwargs.tailspec``, with tailspec's own
config tree (``strategy``, ``engine.*``, ``training.*``; errors name the key) and ``drafter``: a
drafter LM's folder (safetensors), an EAGLE-3 checkpoint folder, or ``self:L``. One engine serves
one device, so a replica is one server: tensor, data and pipeline parallel sizes must be 1.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import torch

from ...drafter.eagle3.checkpoint import CONFIG_FILE, FORMAT, load_checkpoint
from ...extras import need
from ...safe_files import load_causal_lm, read_json
from .server import TailspecServer

_replica = need("verl.workers.rollout.replica", "verl", "the verl rollout backend (rollout.name=tailspec)")
ray = need("ray", "verl", "the verl rollout backend")
RolloutReplica, TokenOutput = _replica.RolloutReplica, _replica.TokenOutput
omega_conf_to_dataclass = need("verl.utils.config", "verl", "the verl rollout backend").omega_conf_to_dataclass

logger = logging.getLogger(__name__)


def server_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """The Ray name of a replica's server actor: the policy's (the trainer-side adapter finds it by
    its rank), or a reward or teacher model's (``role``), with verl's ``name_suffix``."""
    return f"tailspec_server_{role}{replica_rank}_0{suffix}"


def tailspec_settings(rollout_config: Any) -> dict[str, Any]:
    """``engine_kwargs.tailspec`` as a dict. Where it names no strategy, ``adaptive``: it picks per
    step among plain decoding, the suffix drafter and, given a drafter, the drafting arms, from
    measured costs (tailspec's own default, ``none``, suits a library call more than a backend)."""
    kwargs = getattr(rollout_config, "engine_kwargs", None) or {}
    settings = kwargs.get("tailspec") if hasattr(kwargs, "get") else None
    settings = dict(settings or {})
    if not all(isinstance(k, str) for k in settings):
        raise ValueError("actor_rollout_ref.rollout.engine_kwargs.tailspec must map setting names to values")
    engine = settings.get("engine")
    named = "strategy" in settings or "engine.strategy" in settings or (hasattr(engine, "get") and "strategy" in engine)
    if not named:
        settings["strategy"] = "adaptive"
    return settings


def check_settings(settings: dict[str, Any]) -> None:
    """Refuse a wrong ``engine_kwargs.tailspec`` in one line naming the key, before any server starts."""
    from ..config import SpecRolloutConfig

    rest = {k: v for k, v in settings.items() if k != "drafter"}
    try:
        SpecRolloutConfig().with_overrides(**rest)
    except ValueError as e:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.tailspec: {e}") from None


def load_drafter(spec: Any, dtype: torch.dtype) -> Any:
    """``engine_kwargs.tailspec.drafter``: None, ``self:L``, a drafter LM's folder or an EAGLE-3
    checkpoint's (read as data only: safetensors and JSON)."""
    if spec is None or (isinstance(spec, str) and spec.startswith("self:")):
        return spec
    folder = Path(str(spec)).expanduser()
    if not folder.is_dir():
        raise ValueError(
            f"engine_kwargs.tailspec.drafter: no folder at {spec!r} (a drafter LM, an EAGLE-3 checkpoint or self:L)"
        )
    if (folder / CONFIG_FILE).is_file() and read_json(folder / CONFIG_FILE).get("format") == FORMAT:
        return load_checkpoint(folder).head.to(dtype).eval()
    return load_causal_lm(folder, dtype=dtype).eval()


class TailspecServerActor:
    """One replica's server, as verl's agent loop and adapter call it (a Ray actor)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int) -> None:
        from transformers import AutoTokenizer

        self.config = omega_conf_to_dataclass(config)
        self.replica_rank = replica_rank
        path = getattr(model_config, "local_path", None) or model_config.path
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dtype = getattr(torch, str(getattr(self.config, "dtype", "bfloat16")), torch.bfloat16)
        dtype = dtype if device.type == "cuda" else torch.float32
        model = load_causal_lm(path, dtype=dtype).to(device)
        settings = tailspec_settings(self.config)
        drafter = load_drafter(settings.pop("drafter", None), dtype)
        if isinstance(drafter, torch.nn.Module):
            drafter = drafter.to(device)
        tokenizer = AutoTokenizer.from_pretrained(getattr(model_config, "local_tokenizer_path", None) or path)
        self.server = TailspecServer(
            model,
            tokenizer,
            settings=settings,
            drafter=drafter,
            response_length=int(self.config.response_length),
            seed=int(getattr(self.config, "seed", 0) or 0),
        )
        self.global_steps: int | None = None

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError(f"request {request_id}: tailspec serves text; this request holds images, video or audio")
        out = await self.server.generate(prompt_ids, sampling_params, request_id)
        extra = {**out.extra_fields, "global_steps": self.global_steps}
        return TokenOutput(
            token_ids=out.token_ids,
            log_probs=out.log_probs,
            stop_reason=out.stop_reason,
            num_preempted=out.num_preempted,
            extra_fields=extra,
        )

    async def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], last: bool) -> int:
        return await self.server.update_weights(named_tensors, last=last)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.server.wake_up(tags)

    async def sleep(self) -> None:
        await self.server.sleep()

    async def release_kv_cache(self) -> None:
        await self.server.sleep()

    async def resume_kv_cache(self) -> None:
        await self.server.wake_up(["kv_cache"])

    async def clear_kv_cache(self) -> None:
        await self.server.clear_kv_cache()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        return await self.server.abort_all_requests(reject_request=reject_request)

    async def resume_generation(self) -> None:
        await self.server.resume_generation()

    async def resume_engine_generation(self) -> None:
        await self.server.resume_generation()

    async def open_submission_gate(self) -> None:
        await self.server.resume_generation()

    async def wait_for_requests_to_drain(self) -> None:
        while self.server.busy:
            await asyncio.sleep(0.01)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def metrics(self) -> dict[str, float]:
        return self.server.metrics()

    def get_server_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), 0

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


class TailspecReplica(RolloutReplica):
    """A replica of one :class:`TailspecServerActor`, beside its worker's device in verl's hybrid
    and colocated modes, and on Ray's CPUs where there is no GPU (tests, the CPU example)."""

    def rollout_worker_use_gpu(self) -> bool:
        return torch.cuda.is_available()

    async def init_standalone(self) -> None:
        if torch.cuda.is_available():
            await super().init_standalone()
            return
        from verl.workers.rollout.replica import RolloutMode

        self.rollout_mode = RolloutMode.STANDALONE  # no GPU to place: the server takes Ray CPUs
        await self.launch_servers()

    async def launch_servers(self) -> None:
        check_settings(tailspec_settings(self.config))
        if self.world_size != 1:
            raise ValueError(
                "actor_rollout_ref.rollout: tailspec serves a replica from one engine on one device, so "
                "tensor_model_parallel_size, data_parallel_size and pipeline_model_parallel_size must be 1, "
                f"got a replica of {self.world_size}"
            )
        role = "reward_" if self.is_reward_model else "teacher_" if self.is_teacher_model else ""
        name = server_name(self.replica_rank, role, self.name_suffix)
        options: dict[str, Any] = {"name": name, "max_concurrency": self.max_concurrency}
        if self.workers:  # beside the trainer's worker: its node, its device
            node, device = await self.workers[0].__ray_call__.remote(
                lambda worker: (
                    ray.get_runtime_context().get_node_id(),
                    (ray.get_runtime_context().get_accelerator_ids().get("GPU") or [None])[0],
                )
            )
            options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node, soft=False
            )
            if device is not None:
                options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": str(device)}}
        else:
            options["num_cpus"] = 1
        server = (
            ray.remote(TailspecServerActor).options(**options).remote(self.config, self.model_config, self.replica_rank)
        )
        self.servers.append(server)
        self._server_handle = server
        address, port = await server.get_server_address.remote()
        self._server_address = f"{address}:{port}"
        logger.info("tailspec replica %d: server %s", self.replica_rank, name)
