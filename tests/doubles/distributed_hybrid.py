"""Structural doubles of Megatron-Core's DistributedOptimizer (holding a HybridDeviceOptimizer)
and ChainedOptimizer, for CPU tests.

The real classes need CUDA and process groups to construct. These keep the attribute names and
the semantics that hybrid master syncing depends on (megatron-core 0.16.1,
``optimizer/distrib_optimizer.py``), for one data-parallel rank that owns every parameter whole:

- ``model_float16_groups`` / ``shard_fp32_from_float16_groups`` (FP32 main shards, or ``None``
  per param in precision-aware mode, where the hybrid optimizer steps 16-bit shard views of the
  model params and holds the masters itself), ``model_fp32_groups`` / ``shard_fp32_groups``;
- ``_get_model_param_range_map(p)["param"]`` (a ``Range``), ``model_param_group_index_map``;
- ``_set_main_param_and_optimizer_states``: precision-aware mode assigns each tensor (``param``
  as ``master_param``) into the hybrid optimizer's state; otherwise it copies into *every*
  existing state tensor and fails on one the payload lacks;
- ``load_state_dict``: ``dummy_step`` on an empty hybrid optimizer, the saved group step written
  into every per-param state, the inner load, then the ``fully_reshardable`` parameter loader
  (which skips ``step`` and renames ``fp32_param`` to ``param``);
- ``reload_model_params`` -> ``_copy_model_params_to_main_params``, which for a hybrid optimizer
  only calls its ``update_fp32_param_by_new_param``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.doubles.chained import ChainedOptimizerDouble as ChainedOptimizerDouble

_HALF = (torch.bfloat16, torch.float16)


class Range:
    """Megatron's index range of a shard."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.size = start, end, end - start


class DistributedOptimizerDouble:
    """DistributedOptimizer around a hybrid offload optimizer, one rank owning every param."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """MegatronOptimizer's promoted ``param_groups``."""
        return self.optimizer.param_groups  # type: ignore[no-any-return]

    def __init__(self, model: torch.nn.Module, make_hybrid: Any, precision_aware: bool) -> None:
        self.config = SimpleNamespace(
            optimizer_cpu_offload=True,
            use_precision_aware_optimizer=precision_aware,
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware,
        )
        self.ddp_config = SimpleNamespace(use_megatron_fsdp=False)
        self.is_stub_optimizer = False
        self.model_params = list(model.parameters())
        self._ranges = {p: Range(0, p.numel()) for p in self.model_params}
        self.model_float16_groups: list[list[Any]] = [[]]
        self.shard_float16_groups: list[list[Any]] = [[]]
        self.shard_fp32_from_float16_groups: list[list[Any]] = [[]]
        self.model_fp32_groups: list[list[Any]] = [[]]
        self.shard_fp32_groups: list[list[Any]] = [[]]
        for p in self.model_params:
            shard = p.detach().view(-1)[0 : p.numel()]
            if p.dtype in _HALF:
                main = None if precision_aware else shard.clone().float()
                self.model_float16_groups[0].append(p)
                self.shard_float16_groups[0].append(shard)
                self.shard_fp32_from_float16_groups[0].append(main)
            else:
                self.model_fp32_groups[0].append(p)
                self.shard_fp32_groups[0].append(shard)
        half_shards = self.shard_float16_groups[0] if precision_aware else None
        optimizer_params = [
            *self.shard_fp32_groups[0],
            *(half_shards or self.shard_fp32_from_float16_groups[0]),
        ]
        order = [*self.model_fp32_groups[0], *self.model_float16_groups[0]]
        self.model_param_group_index_map = {p: (0, i) for i, p in enumerate(order)}
        self.optimizer = make_hybrid([{"params": optimizer_params}])

    def _get_model_param_range_map(self, param: torch.nn.Parameter) -> dict[str, Range]:
        return {"param": self._ranges[param]}

    def _optimizer_param(self, model_param: torch.nn.Parameter) -> torch.Tensor:
        group_index, group_order = self.model_param_group_index_map[model_param]
        return self.optimizer.param_groups[group_index]["params"][group_order]

    # -- stepping ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
            shard = self._optimizer_param(p)
            if getattr(shard, "decoupled_grad", None) is not None:
                shard.decoupled_grad = None
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self) -> None:
        precision_aware = self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        for p in self.model_params:
            shard = self._optimizer_param(p)
            if p.grad is None:
                continue
            grad = p.grad.detach().view(-1).float()
            if shard.dtype in _HALF:
                shard.decoupled_grad = grad  # precision-aware: FP32 main grads beside bf16
            else:
                shard.grad = grad.to(shard.dtype)
        self.optimizer.step()
        if not precision_aware:
            for p, main in zip(
                self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0], strict=True
            ):
                p.view(-1).copy_(main)

    # -- checkpoints ------------------------------------------------------------------
    def _get_main_param_and_optimizer_states(self, model_param: Any) -> dict[str, torch.Tensor]:
        main = self._optimizer_param(model_param)
        state = self.optimizer.state[main]
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            tensors = dict(state)
            tensors["param"] = tensors.pop("master_param")
            return tensors
        return {"param": main, **state}

    def _set_main_param_and_optimizer_states(self, model_param: Any, tensors: Any) -> None:
        main = self._optimizer_param(model_param)
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            for key, value in tensors.items():
                self.optimizer.state[main]["master_param" if key == "param" else key] = value
            return
        destination = {"param": main, **self.optimizer.state[main]}
        for key in destination:
            destination[key].copy_(tensors[key])  # KeyError for an entry the payload lacks

    def state_dict(self) -> dict[str, Any]:
        inner = self.optimizer.state_dict()
        steps = {s["step"].item() for s in self.optimizer.state.values()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        for group in groups:
            group["step"] = int(steps.pop()) if steps else None
        param_state = {}
        for index, p in enumerate(self.model_params):
            tensors = self._get_main_param_and_optimizer_states(p)
            param_state[index] = {
                ("fp32_param" if k == "param" else k): v.detach().clone().view(p.shape)
                for k, v in tensors.items()
                if k in ("param", "exp_avg", "exp_avg_sq")
            }
        return {
            "optimizer": {"param_groups": groups},
            "param_state_sharding_type": "fully_reshardable",
            "param_state": param_state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if len(self.optimizer.state) == 0:
            self.optimizer.dummy_step()
        inner = self.optimizer.state_dict()
        steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if "step" in g}
        if steps:
            step = torch.tensor(float(steps.pop()), dtype=torch.float32)
            for value in self.optimizer.state.values():
                value["step"] = step.clone()
        groups = [
            {**saved, "params": current["params"]}
            for saved, current in zip(
                state_dict["optimizer"]["param_groups"], inner["param_groups"], strict=True
            )
        ]
        self.optimizer.load_state_dict({"state": inner["state"], "param_groups": groups})
        for index, p in enumerate(self.model_params):
            param_range = self._ranges[p]
            tensors = {}
            for key, value in state_dict["param_state"][index].items():
                if key == "step":
                    continue
                flat = value.flatten()[param_range.start : param_range.end]
                tensors["param" if key == "fp32_param" else key] = flat
            self._set_main_param_and_optimizer_states(p, tensors)

    def reload_model_params(self, state_dict: Any = None) -> None:
        # Megatron's _copy_model_params_to_main_params for a hybrid optimizer.
        self.optimizer.update_fp32_param_by_new_param()
