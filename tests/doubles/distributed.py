"""The one double of megatron-core's DistributedOptimizer (distrib_optimizer.py, 0.16.1-0.19.2).

Why it stays: the real class asserts its inner optimizer is ``Adam`` (TE's or Apex's FusedAdam,
else torch's AdamW), ``torch.optim.AdamW`` or ``HybridDeviceOptimizer``
(``DistributedOptimizer.__init__``, distrib_optimizer.py:514), so it refuses the portable
optimizers the library ships -- :class:`~wrapped_optim.PrecisionAwareAdamW` (standing in for
TE's FusedAdam, which does not install here) and
:class:`~wrapped_optim.optimizers.hybrid_offload._optimizer.HybridOffloadOptimizer`
(precision-aware mode included). With torch's AdamW or Megatron's HybridDeviceOptimizer inside, the
tests use the
real class (``tests/megatron_real``); the ChainedOptimizer around this double is always the
real one, so the double carries the MegatronOptimizer surface that ``ChainedOptimizer.step``
calls (``prepare_grads``, ``get_grad_norm``, ``get_grad_stats_parallel_group``,
``get_parameters``, ``step_with_ready_grads``).

One rank owns every parameter whole (each shard's ``Range`` is the whole parameter). Two ways
in, as Megatron has them:

* ``DistributedOptimizerDouble(optimizer, config, ddp_config)``: the inner optimizer already
  steps the model parameters (a precision-aware holder keeps the FP32 masters itself, as
  Megatron's ``use_precision_aware_optimizer`` does); its 16-bit params are listed in
  ``shard_fp32_from_float16_groups``;
* :meth:`DistributedOptimizerDouble.of_model` builds Megatron's groups from a model --
  ``model_float16_groups`` / ``shard_fp32_from_float16_groups`` (FP32 main shards, or ``None``
  in precision-aware mode, where the inner optimizer steps 16-bit shard views and holds the
  masters), ``model_fp32_groups`` / ``shard_fp32_groups`` -- and copies the main shards back
  into the model after each step.

Checkpoint semantics kept from the real class: ``state_dict()`` holds the inner param groups
(with the shared ``step`` when the inner optimizer keeps per-param step tensors, as torch's
do) and no parameter state; ``load_state_dict`` builds its scaffold from the inner
optimizer's ``state_dict()`` (``dummy_step`` for an empty hybrid optimizer; empty tensors of
the configured dtypes for an empty holder), writes the saved step into every per-param state,
loads, then writes each parameter's tensors with ``set_scaled_state`` (precision-aware holder),
by assignment (precision-aware hybrid optimizer, ``param`` as ``master_param``) or by
``copy_`` into *every* existing state tensor (failing on one the payload lacks).
``sharded_state_dict(..., is_loading=True)`` loads ``state_dict()`` back first, as Megatron
does. ``checkpoint="fully_reshardable"`` makes ``state_dict()`` also carry the
``fully_reshardable`` parameter state (``fp32_param``, ``exp_avg``, ``exp_avg_sq`` by model
param), the one-object checkpoint a Bridge save writes.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any, Literal

import torch

__all__ = [
    "CORE_DEFAULTS",
    "FIELDS_SINCE",
    "DistributedOptimizerDouble",
    "Range",
    "ddp_config",
    "megatron_config",
]

_HALF = (torch.bfloat16, torch.float16)


# OptimizerConfig fields the double leaves at megatron-core's defaults: the real
# ChainedOptimizer around it reads them (tests/adapters/test_doubles_match_core.py checks both lists
# against the installed Core's OptimizerConfig and ChainedOptimizer source).
CORE_DEFAULTS: dict[str, Any] = {
    "fp16": False,
    "log_num_zeros_in_grad": False,
    "overlap_param_gather_with_optimizer_step": False,
    "overlap_param_gather": False,
    "reuse_grad_buf_for_mxfp8_param_ag": False,
    "barrier_with_L1_time": False,
    "timers": None,
    "grad_norm_skip_threshold": math.inf,
}
# Fields of CORE_DEFAULTS that only newer supported Cores have: name -> first release.
FIELDS_SINCE: dict[str, tuple[int, int]] = {"grad_norm_skip_threshold": (0, 19)}


def megatron_config(
    *,
    precision_aware: bool = True,
    cpu_offload: bool = False,
    exp_avg_dtype: torch.dtype = torch.bfloat16,
    exp_avg_sq_dtype: torch.dtype = torch.bfloat16,
    main_params_dtype: torch.dtype = torch.float32,
) -> SimpleNamespace:
    """The OptimizerConfig fields the engine, the double and ChainedOptimizer.step read."""
    return SimpleNamespace(
        use_precision_aware_optimizer=precision_aware,
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware,
        optimizer_cpu_offload=cpu_offload,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
        main_params_dtype=main_params_dtype,
        store_param_remainders=False,
        bf16=True,
        clip_grad=0.0,
        **CORE_DEFAULTS,
    )


def ddp_config(*, megatron_fsdp: bool = False) -> SimpleNamespace:
    """The DistributedDataParallelConfig field the engine reads."""
    return SimpleNamespace(use_megatron_fsdp=megatron_fsdp)


class Range:
    """Megatron's index range of a shard."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.size = start, end, end - start


class DistributedOptimizerDouble:
    """Shaped like megatron.core.optimizer.DistributedOptimizer (see the module docstring)."""

    checkpoint_fully_reshardable_formats = frozenset({"fully_reshardable"})

    def __init__(
        self,
        optimizer: Any,
        config: Any,
        ddp_config: Any,
        *,
        checkpoint: Literal["fully_reshardable"] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.config = config
        self.ddp_config = ddp_config
        self.checkpoint = checkpoint
        self.model_chunks: list[Any] = []
        self.is_stub_optimizer = optimizer is None
        self.calls: list[str] = []
        self.model_params: list[torch.nn.Parameter] = []
        self.model_float16_groups: list[list[Any]] | None = None
        if optimizer is None:
            return
        # The holder steps the model params themselves: shard == param, no main copies.
        self.model_params = [p for group in optimizer.param_groups for p in group["params"]]
        self.shard_fp32_from_float16_groups: list[list[Any]] = [
            [p for p in group["params"] if p.dtype != torch.float32]
            for group in optimizer.param_groups
        ]
        self.model_param_group_index_map = {
            p: (gi, oi)
            for gi, group in enumerate(optimizer.param_groups)
            for oi, p in enumerate(group["params"])
        }

    @classmethod
    def of_model(
        cls,
        model: torch.nn.Module,
        make_optimizer: Any,
        precision_aware: bool,
        *,
        checkpoint: Literal["fully_reshardable"] | None = "fully_reshardable",
    ) -> DistributedOptimizerDouble:
        """Megatron's groups built from ``model``, the inner optimizer from
        ``make_optimizer(param_groups)`` over the FP32 shards and the main (or, precision-aware,
        16-bit) shards."""
        self = cls(
            None,
            megatron_config(precision_aware=precision_aware, cpu_offload=True),
            ddp_config(),
            checkpoint=checkpoint,
        )
        self.is_stub_optimizer = False
        self.model_params = list(model.parameters())
        self.model_float16_groups = [[]]
        self.shard_float16_groups: list[list[Any]] = [[]]
        self.shard_fp32_from_float16_groups = [[]]
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
        half = self.shard_float16_groups[0] if precision_aware else None
        optimizer_params = [
            *self.shard_fp32_groups[0],
            *(half or self.shard_fp32_from_float16_groups[0]),
        ]
        order = [*self.model_fp32_groups[0], *self.model_float16_groups[0]]
        self.model_param_group_index_map = {p: (0, i) for i, p in enumerate(order)}
        self.optimizer = make_optimizer([{"params": optimizer_params}])
        return self

    # -- MegatronOptimizer's forwarding -------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups  # type: ignore[no-any-return]

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _get_model_param_range_map(self, param: torch.nn.Parameter) -> dict[str, Range]:
        return {"param": Range(0, param.numel())}

    def _optimizer_param(self, model_param: torch.nn.Parameter) -> torch.Tensor:
        group_index, group_order = self.model_param_group_index_map[model_param]
        return self.optimizer.param_groups[group_index]["params"][group_order]

    def _precision_aware(self) -> bool:
        return bool(self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)

    def _holder(self) -> bool:
        """A precision-aware holder (TE FusedAdam's accessors), not a hybrid optimizer."""
        return callable(getattr(self.optimizer, "get_unscaled_state", None))

    # -- stepping, as ChainedOptimizer.step drives it ----------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.is_stub_optimizer:
            return
        if self.model_float16_groups is not None:
            for p in self.model_params:
                p.grad = None
                shard = self._optimizer_param(p)
                if getattr(shard, "decoupled_grad", None) is not None:
                    shard.decoupled_grad = None
        self.optimizer.zero_grad(set_to_none)

    def get_parameters(self) -> list[torch.Tensor]:
        return [] if self.is_stub_optimizer else list(self.model_params)

    def get_grad_stats_parallel_group(self) -> Any:
        return self  # its own "group": ChainedOptimizer adds the norms up per optimizer

    def get_grad_norm(self) -> None:
        return None  # clip_grad is 0: nothing reads it

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """The main grads: model grads copied to the shards (FP32, ``decoupled_grad`` beside a
        16-bit shard in precision-aware mode). Returns found-inf (never)."""
        if self.model_float16_groups is None:
            return False
        for p in self.model_params:
            if p.grad is None:
                continue
            shard = self._optimizer_param(p)
            grad = p.grad.detach().view(-1).float()
            if shard.dtype in _HALF:
                shard.decoupled_grad = grad
            else:
                shard.grad = grad.to(shard.dtype)
        return False

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        if self.is_stub_optimizer:
            return True
        self.optimizer.step()
        if self.model_float16_groups is not None and not self._precision_aware():
            for p, main in zip(
                self.model_float16_groups[0], self.shard_fp32_from_float16_groups[0], strict=True
            ):
                p.view(-1).copy_(main)
        return True

    def step(self) -> tuple[bool, None, None]:
        self.prepare_grads()
        return self.step_with_ready_grads(), None, None

    # -- checkpoints ------------------------------------------------------------------
    def _get_main_param_and_optimizer_states(self, model_param: Any) -> dict[str, torch.Tensor]:
        main = self._optimizer_param(model_param)
        state = self.state[main]
        if self._precision_aware() and self._holder():
            tensors = {k: self.optimizer.get_unscaled_state(main, k) for k in state}
            tensors["param"] = tensors.pop("master_param", main)
            return tensors
        if self._precision_aware():
            tensors = dict(state)
            tensors["param"] = tensors.pop("master_param")
            return tensors
        return {"param": main, **state}

    @torch.no_grad()
    def _set_main_param_and_optimizer_states(self, model_param: Any, tensors: Any) -> None:
        main = self._optimizer_param(model_param)
        if self._precision_aware() and self._holder():
            for key, value in tensors.items():
                if key != "param":
                    self.optimizer.set_scaled_state(main, key, value)
                elif "master_param" in self.state[main]:
                    self.optimizer.set_scaled_state(main, "master_param", value)
            return
        if self._precision_aware():
            for key, value in tensors.items():
                self.state[main]["master_param" if key == "param" else key] = value
            return
        destination = {"param": main, **self.state[main]}
        for key in destination:
            destination[key].copy_(tensors[key])  # KeyError for an entry the payload lacks

    def _parameter_state(self) -> dict[int, dict[str, Any]]:
        return {
            index: self._get_main_param_and_optimizer_states(p)
            for index, p in enumerate(self.model_params)
            if self._optimizer_param(p) in self.state
        }

    def _fully_reshardable(self) -> dict[int, dict[str, torch.Tensor]]:
        return {
            index: {
                ("fp32_param" if k == "param" else k): v.detach().clone().view(p.shape)
                for k, v in self._get_main_param_and_optimizer_states(p).items()
                if k in ("param", "exp_avg", "exp_avg_sq")
            }
            for index, p in enumerate(self.model_params)
        }

    def state_dict(self) -> dict[str, Any]:
        self.calls.append("state_dict")
        if self.is_stub_optimizer:
            return {"optimizer": {"param_groups": []}}
        inner = self.optimizer.state_dict()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in inner["param_groups"]]
        steps = {
            float(s["step"])
            for s in self.optimizer.state.values()
            if isinstance(s.get("step"), torch.Tensor)
        }
        if steps:  # torch's per-param step, stored per group (Megatron without TE/Apex)
            for group in groups:
                group["step"] = int(steps.pop()) if steps else None
        state_dict: dict[str, Any] = {"optimizer": {"param_groups": groups}}
        if self.checkpoint == "fully_reshardable":
            state_dict["param_state_sharding_type"] = "fully_reshardable"
            state_dict["param_state"] = self._fully_reshardable()
        return state_dict

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Any = None,
        is_loading: bool = False,
        sharding_type: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.calls.append(f"sharded_state_dict(is_loading={is_loading})")
        checkpoint, self.checkpoint = self.checkpoint, None
        try:
            state_dict = self.state_dict()
        finally:
            self.checkpoint = checkpoint
        if is_loading:
            self.load_state_dict(dict(state_dict))
        state_dict["param_state"] = self._parameter_state()
        state_dict["param_state_sharding_type"] = "fully_sharded_model_space"
        return state_dict

    def _scaffold(self) -> dict[int, dict[str, torch.Tensor]]:
        """Empty state tensors of the configured dtypes, for a holder with no state yet."""
        scaffold: dict[int, dict[str, torch.Tensor]] = {}
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        for index, p in enumerate(params):
            tensors = {
                "exp_avg": torch.empty(p.shape, dtype=self.config.exp_avg_dtype),
                "exp_avg_sq": torch.empty(p.shape, dtype=self.config.exp_avg_sq_dtype),
            }
            if self._precision_aware() and getattr(self.optimizer, "master_weights", False):
                tensors["master_param"] = torch.empty(p.shape, dtype=self.config.main_params_dtype)
            scaffold[index] = tensors
        return scaffold

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls.append("load_state_dict")
        if len(self.optimizer.state) == 0 and callable(getattr(self.optimizer, "dummy_step", None)):
            self.optimizer.dummy_step()
        inner = self.optimizer.state_dict()  # Megatron builds its scaffold through this call
        saved_groups = state_dict["optimizer"]["param_groups"]
        steps = {g["step"] for g in saved_groups if g.get("step") is not None}
        if steps and _steps_in_state(inner):  # torch's per-param step: one value for all
            step = torch.tensor(float(steps.pop()), dtype=torch.float32)
            for value in self.optimizer.state.values():
                value["step"] = step.clone()
        groups = [
            {**saved, "params": current["params"]}
            for saved, current in zip(saved_groups, inner["param_groups"], strict=True)
        ]
        scaffold = inner["state"] if len(self.optimizer.state) else self._scaffold()
        self.optimizer.load_state_dict({"state": scaffold, "param_groups": groups})
        for index, tensors in state_dict.get("param_state", {}).items():
            p = self.model_params[index]
            param_range = self._get_model_param_range_map(p)["param"]
            flat = {
                ("param" if k == "fp32_param" else k): v.flatten()[
                    param_range.start : param_range.end
                ].view_as(self._optimizer_param(p))
                for k, v in tensors.items()
                if k != "step"
            }
            self._set_main_param_and_optimizer_states(p, flat)

    def reload_model_params(self, state_dict: Any = None) -> None:
        # Megatron's _copy_model_params_to_main_params for a hybrid optimizer.
        self.optimizer.update_fp32_param_by_new_param()


def _steps_in_state(inner_state_dict: dict[str, Any]) -> bool:
    """Whether the inner optimizer keeps its step per parameter (torch's optimizers)."""
    return any("step" in entry for entry in inner_state_dict["state"].values())
