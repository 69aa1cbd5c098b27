"""Structural doubles of Megatron-Core's optimizer containers and of TE's FusedAdam surface.

Megatron's DistributedOptimizer needs CUDA and process groups to construct, and Transformer
Engine cannot be installed here. These doubles carry the attributes and call patterns of
megatron-core 0.16.1 (``megatron/core/optimizer/distrib_optimizer.py`` and ``optimizer.py``)
that the staging engine depends on:

* ``config``, ``ddp_config``, ``is_stub_optimizer``, ``optimizer``,
  ``shard_fp32_from_float16_groups`` on a distributed optimizer;
* ``state_dict()`` built from the inner optimizer's ``state_dict()`` without per-param state;
* ``sharded_state_dict(model_sharded_state_dict, is_loading, **kwargs)`` that calls
  ``state_dict()``, loads ``state_dict()`` back when ``is_loading`` and gathers the
  per-parameter tensors with ``optimizer.get_unscaled_state`` (precision-aware) or the raw
  state (otherwise), like ``_get_main_param_and_optimizer_states``;
* ``load_state_dict(state_dict)`` that builds its scaffold by calling the inner
  optimizer's ``state_dict()`` (or allocates empty tensors of the configured dtypes when the
  inner optimizer has no state yet), loads it into the inner optimizer and then writes the
  parameter state with ``set_scaled_state`` (precision-aware) or ``copy_``;
* ``chained_optimizers`` / ``config`` / ``is_stub_optimizer`` on a ChainedOptimizer.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tests.doubles.chained import ChainedOptimizerDouble as ChainedOptimizerDouble


def megatron_config(
    *,
    precision_aware: bool = True,
    cpu_offload: bool = False,
    exp_avg_dtype: torch.dtype = torch.bfloat16,
    exp_avg_sq_dtype: torch.dtype = torch.bfloat16,
    main_params_dtype: torch.dtype = torch.float32,
) -> SimpleNamespace:
    """The OptimizerConfig fields the engine and the doubles read."""
    return SimpleNamespace(
        use_precision_aware_optimizer=precision_aware,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware,
        optimizer_cpu_offload=cpu_offload,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
        main_params_dtype=main_params_dtype,
        store_param_remainders=False,
        bf16=True,
        fp16=False,
    )


def ddp_config(*, megatron_fsdp: bool = False) -> SimpleNamespace:
    """The DistributedDataParallelConfig field the engine reads."""
    return SimpleNamespace(use_megatron_fsdp=megatron_fsdp)


class DistributedOptimizerDouble:
    """Shaped like megatron.core.optimizer.DistributedOptimizer around one leaf optimizer."""

    checkpoint_fully_reshardable_formats = frozenset({"fully_reshardable"})

    def __init__(self, optimizer: Any, config: Any, ddp_config: Any) -> None:
        self.optimizer = optimizer
        self.config = config
        self.ddp_config = ddp_config
        self.model_chunks: list[Any] = []
        self.is_stub_optimizer = optimizer is None
        self.data_parallel_group_idx = 0
        self.calls: list[str] = []
        if optimizer is None:
            return
        # Our shards are whole parameters; FP32 main copies exist only for 16-bit params.
        self.shard_fp32_from_float16_groups: list[list[torch.Tensor]] = [
            [p for p in group["params"] if p.dtype != torch.float32]
            for group in optimizer.param_groups
        ]
        self.model_param_group_index_map = {
            p: (gi, oi)
            for gi, group in enumerate(optimizer.param_groups)
            for oi, p in enumerate(group["params"])
        }

    # forwarding like MegatronOptimizer
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups  # type: ignore[no-any-return]

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self) -> None:
        if not self.is_stub_optimizer:
            self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not self.is_stub_optimizer:
            self.optimizer.zero_grad(set_to_none)

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _precision_aware(self) -> bool:
        return bool(self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def state_dict(self) -> dict[str, Any]:
        self.calls.append("state_dict")
        if self.is_stub_optimizer:
            return {"optimizer": {"param_groups": []}}
        inner = self.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        return {"optimizer": {"param_groups": groups}}

    def _get_main_param_and_optimizer_states(self, param: torch.Tensor) -> dict[str, Any]:
        if self._precision_aware():
            tensors = {k: self.optimizer.get_unscaled_state(param, k) for k in self.state[param]}
            tensors["param"] = tensors.pop("master_param", param)
            return tensors
        return {"param": param, **self.state[param]}

    def get_parameter_state(self) -> dict[int, dict[str, Any]]:
        return {
            index: self._get_main_param_and_optimizer_states(p)
            for index, p in enumerate(self._params())
            if p in self.state
        }

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        sharding_type: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.calls.append(f"sharded_state_dict(is_loading={is_loading})")
        state_dict = self.state_dict()
        if is_loading:
            self.load_state_dict(self.state_dict())
        state_dict["param_state"] = self.get_parameter_state()
        state_dict["param_state_sharding_type"] = "fully_sharded_model_space"
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        inner = self.optimizer.state_dict()  # Megatron builds its scaffold through this call
        saved_groups = state_dict["optimizer"]["param_groups"]
        groups = [
            {**saved, "params": current["params"]}
            for saved, current in zip(saved_groups, inner["param_groups"], strict=True)
        ]
        if len(self.optimizer.state) == 0:
            scaffold: dict[int, dict[str, torch.Tensor]] = {}
            for index, p in enumerate(self._params()):
                tensors = {
                    "exp_avg": torch.empty(p.shape, dtype=self.config.exp_avg_dtype),
                    "exp_avg_sq": torch.empty(p.shape, dtype=self.config.exp_avg_sq_dtype),
                }
                if self._precision_aware() and getattr(self.optimizer, "master_weights", False):
                    tensors["master_param"] = torch.empty(
                        p.shape, dtype=self.config.main_params_dtype
                    )
                scaffold[index] = tensors
        else:
            scaffold = inner["state"]
        self.optimizer.load_state_dict({"state": scaffold, "param_groups": groups})
        if "param_state" in state_dict:
            params = self._params()
            for index, tensors in state_dict["param_state"].items():
                self._set_main_param_and_optimizer_states(params[index], tensors)

    def _set_main_param_and_optimizer_states(
        self, param: torch.Tensor, tensors: dict[str, torch.Tensor]
    ) -> None:
        if self._precision_aware():
            for key, value in tensors.items():
                if key == "param":
                    if "master_param" in self.state[param]:
                        self.optimizer.set_scaled_state(param, "master_param", value)
                else:
                    self.optimizer.set_scaled_state(param, key, value)
            return
        destination = {"param": param, **self.state[param]}
        with torch.no_grad():
            for key in destination:
                destination[key].copy_(tensors[key])


def te_style(holder_cls: type) -> type:
    """A subclass of ``holder_cls`` with TE FusedAdam's surface: no chunk API.

    The chunk methods are set to ``None`` on the class, the protocol convention for "not
    offered", so ``supports_chunked_state`` and the staging engine see a whole-tensor holder.
    """
    return type(
        f"TEStyle{holder_cls.__name__}",
        (holder_cls,),
        {"read_unscaled_state_chunk": None, "write_scaled_state_chunked": None},
    )


def te_fp16_bug(holder_cls: type) -> type:
    """Like :func:`te_style`, and like TE its set_scaled_state scales the caller's fp16 input."""
    base = te_style(holder_cls)

    def set_scaled_state(self: Any, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        base.set_scaled_state(self, param, name, value)  # type: ignore[attr-defined]
        if self.name_to_dtype_map[name] == torch.float16:
            value.div_(2.0)  # the caller's tensor is changed, as TE does

    return type(f"TEFp16{holder_cls.__name__}", (base,), {"set_scaled_state": set_scaled_state})
