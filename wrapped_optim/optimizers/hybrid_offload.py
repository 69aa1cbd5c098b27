"""A portable hybrid offload optimizer: Megatron HybridDeviceOptimizer's structure on any device.

Megatron-Core's ``HybridDeviceOptimizer`` needs CUDA. This optimizer keeps its structure and its
keyword names (``offload_fraction``, ``cpu_optimizer_cls``, ``gpu_optimizer_cls``,
``param_update_in_fp32``) and its attribute names (``gpu_params_map_cpu_copy``,
``param_to_fp32_param``, ``sub_optimizers``, ``update_fp32_param_by_new_param``), so users can
switch and so its failure modes (copies that go stale when the model weights change behind the
optimizer's back) are real on a CPU too: every offloaded parameter gets a *distinct* host copy,
even when the parameter already lives on the host.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from wrapped_optim.adapters.hybrid import MasterCopies

__all__ = ["HybridOffloadOptimizer"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Megatron HybridDeviceOptimizer options that only tune CUDA transfers: accepted so that
# constructor calls can be switched unchanged, never passed to the sub-optimizers.
_TRANSFER_OPTIONS = ("pin_cpu_grads", "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d")


class HybridOffloadOptimizer(torch.optim.Optimizer):
    """Steps part of the parameters on the host and the rest on their device.

    Parameters are walked in group order and offloaded until ``offload_fraction`` of the total
    numel is reached. An offloaded parameter gets a host copy (FP32 when the parameter is 16-bit
    and ``param_update_in_fp32``), stepped by one ``cpu_optimizer_cls`` instance; a 16-bit
    parameter left on its device gets an FP32 working copy there, and everything on the device
    is stepped by one ``gpu_optimizer_cls`` instance. ``step`` copies gradients to the copies,
    steps both sub-optimizers and copies the results back into the parameters; ``state`` shows
    the sub-optimizers' state under the original parameters, with the stepped copy as
    ``"master_param"`` (when ``param_update_in_fp32``). ``**defaults`` (``lr``, ``betas``, ...)
    go to both sub-optimizers; group options are re-synced into them before every step, so LR
    schedulers work.

    ``load_state_dict`` rebuilds the copies and the sub-optimizers from the current parameters
    and then pushes the loaded state in, restoring each ``master_param`` into its copy (the model
    weights are not touched: :class:`wrapped_optim.HybridSyncOptimizer` does that). It validates
    the whole payload before changing anything and never aliases the caller's tensors.

    The copies are only refreshed from the weights by :meth:`update_fp32_param_by_new_param`
    (FP32 copies, as Megatron's) — after a model-only load, wrap the optimizer in
    :class:`wrapped_optim.HybridSyncOptimizer` or the first step writes stale copies back.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> opt = HybridOffloadOptimizer(model.parameters(), offload_fraction=0.5, lr=0.01)
        >>> [p in opt.gpu_params_map_cpu_copy for p in model.parameters()]
        [True, False]
        >>> model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()
        >>> sorted(opt.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'master_param', 'step']
        >>> opt.state[model.weight]["master_param"].dtype
        torch.float32
    """

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        gpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        param_update_in_fp32: bool = True,
        **defaults: Any,
    ) -> None:
        if not 0.0 <= float(offload_fraction) <= 1.0:
            raise ValueError(f"offload_fraction must be within [0, 1], got {offload_fraction}")
        self.pin_cpu_params = bool(defaults.pop("pin_cpu_params", True))
        self.pin_cpu_grads = bool(defaults.pop("pin_cpu_grads", True))
        defaults.pop("overlap_cpu_optimizer_d2h_h2d", None)
        self.offload_fraction = float(offload_fraction)
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = bool(param_update_in_fp32)
        self._built = False
        super().__init__(params, defaults)
        self._build()

    # ------------------------------------------------------------------------------------
    # Layout
    # ------------------------------------------------------------------------------------
    def _wants_fp32_copy(self, param: torch.Tensor) -> bool:
        return self.param_update_in_fp32 and param.dtype in _LOW_PRECISION

    def _placement(self) -> dict[torch.Tensor, tuple[bool, torch.dtype, torch.device]]:
        """For every param: (offloaded, dtype of its stepped copy, device of that copy)."""
        params = [p for group in self.param_groups for p in group["params"]]
        threshold = self.offload_fraction * sum(p.numel() for p in params)
        offloaded_numel = 0
        placement = {}
        for param in params:
            dtype = torch.float32 if self._wants_fp32_copy(param) else param.dtype
            if offloaded_numel < threshold:
                offloaded_numel += param.numel()
                placement[param] = (True, dtype, torch.device("cpu"))
            else:
                placement[param] = (False, dtype, param.device)
        return placement

    @torch.no_grad()
    def _build(self) -> None:
        """(Re)creates every copy from the current params and fresh sub-optimizers."""
        self.gpu_params_map_cpu_copy: dict[torch.Tensor, torch.Tensor] = {}
        self.cpu_copys_map_gpu_param: dict[torch.Tensor, torch.Tensor] = {}
        self.param_to_fp32_param: dict[torch.Tensor, torch.Tensor] = {}
        self.param_to_inner_param: dict[torch.Tensor, torch.Tensor] = {}
        self.inner_param_to_orig_param: dict[torch.Tensor, torch.Tensor] = {}
        placement = self._placement()
        host_groups: list[dict[str, Any]] = []
        device_groups: list[dict[str, Any]] = []
        self._host_group_index: list[int] = []
        self._device_group_index: list[int] = []
        for group_index, group in enumerate(self.param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            host_params, device_params = [], []
            for param in group["params"]:
                offloaded, dtype, _ = placement[param]
                if offloaded:
                    pin = param.is_cuda and self.pin_cpu_params
                    inner = torch.empty(param.shape, dtype=dtype, device="cpu", pin_memory=pin)
                    inner.copy_(param.detach())
                    self.gpu_params_map_cpu_copy[param] = inner
                    self.cpu_copys_map_gpu_param[inner] = param
                    host_params.append(inner)
                elif dtype != param.dtype:
                    inner = param.detach().to(dtype=dtype, copy=True)
                    device_params.append(inner)
                else:
                    inner = param
                    device_params.append(param)
                if dtype != param.dtype:
                    self.param_to_fp32_param[param] = inner
                self.param_to_inner_param[param] = inner
                self.inner_param_to_orig_param[inner] = param
            if host_params:
                host_groups.append({**options, "params": host_params})
                self._host_group_index.append(group_index)
            if device_params:
                device_groups.append({**options, "params": device_params})
                self._device_group_index.append(group_index)
        self.cpu_optimizers: list[torch.optim.Optimizer] = (
            [self.cpu_optimizer_cls(host_groups)] if host_groups else []
        )
        self.gpu_optimizer: torch.optim.Optimizer | None = (
            self.gpu_optimizer_cls(device_groups) if device_groups else None
        )
        self._built = True

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host sub-optimizer (if any parameter is offloaded), then the device one.

        Example:
            >>> import torch
            >>> params = [torch.nn.Parameter(torch.ones(2)) for _ in range(2)]
            >>> len(HybridOffloadOptimizer(params, offload_fraction=0.5).sub_optimizers)
            2
        """
        subs = list(self.cpu_optimizers)
        if self.gpu_optimizer is not None:
            subs.append(self.gpu_optimizer)
        return subs

    def _sub_optimizers_with_groups(self) -> list[tuple[torch.optim.Optimizer, list[int]]]:
        pairs = [(cpu, self._host_group_index) for cpu in self.cpu_optimizers]
        if self.gpu_optimizer is not None:
            pairs.append((self.gpu_optimizer, self._device_group_index))
        return pairs

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group while constructing; afterwards the layout is fixed (build a new one).

        Example:
            >>> import torch
            >>> opt = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))])
            >>> opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            RuntimeError: HybridOffloadOptimizer decides its offload layout at construction; ...
        """
        if self._built:
            raise RuntimeError(
                "HybridOffloadOptimizer decides its offload layout at construction; "
                "add_param_group afterwards is not supported — build a new optimizer"
            )
        super().add_param_group(param_group)

    # ------------------------------------------------------------------------------------
    # Stepping
    # ------------------------------------------------------------------------------------
    def _sync_groups_to_sub_optimizers(self) -> None:
        for sub, group_indices in self._sub_optimizers_with_groups():
            for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
                for key, value in self.param_groups[group_index].items():
                    if key != "params":
                        sub_group[key] = value

    @torch.no_grad()
    def _copy_grads_to_copies(self) -> None:
        for param, inner in self.param_to_inner_param.items():
            if inner is param:
                continue
            grad = getattr(param, "decoupled_grad", None)
            if grad is None:
                grad = param.grad
            if grad is None:
                inner.grad = None
                continue
            if inner.grad is None or inner.grad.shape != inner.shape:
                pin = inner.device.type == "cpu" and param.is_cuda and self.pin_cpu_grads
                inner.grad = torch.empty(
                    inner.shape, dtype=inner.dtype, device=inner.device, pin_memory=pin
                )
            inner.grad.copy_(grad)

    def _expose_state(self) -> None:
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for sub in self.sub_optimizers:
            for inner, inner_state in sub.state.items():
                param = self.inner_param_to_orig_param[inner]
                if self.param_update_in_fp32:
                    inner_state["master_param"] = inner
                state[param] = inner_state
        self.state = state

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Copies grads to the copies, steps both sub-optimizers, copies the results back.

        A closure is evaluated once, before the sub-optimizers step.

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.5, weight_decay=0.0)
            >>> p.grad = torch.ones(2, dtype=torch.bfloat16)
            >>> opt.step()
            >>> p.tolist()
            [0.5, 0.5]
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups_to_sub_optimizers()
        self._copy_grads_to_copies()
        for sub in reversed(self.sub_optimizers):  # device first, as Megatron does
            sub.step()
        with torch.no_grad():
            for param, inner in self.param_to_inner_param.items():
                if inner is not param:
                    param.copy_(inner)
        self._expose_state()
        return loss

    def dummy_step(self) -> None:
        """Creates the sub-optimizers' state without changing any parameter.

        Megatron's DistributedOptimizer calls this before loading into an empty hybrid
        optimizer. Unlike Megatron's (random gradients, a real step), it steps with zero
        gradients at a zero learning rate, so weights and copies keep their values.

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = HybridOffloadOptimizer([p], lr=0.1)
            >>> opt.dummy_step()
            >>> p.tolist(), sorted(opt.state[p])
            ([1.0, 1.0], ['exp_avg', 'exp_avg_sq', 'master_param', 'step'])
        """
        saved_lrs = [group.get("lr") for group in self.param_groups]
        saved_grads = [(p, p.grad) for group in self.param_groups for p in group["params"]]
        try:
            for group in self.param_groups:
                if "lr" in group:
                    lr = group["lr"]
                    group["lr"] = lr * 0 if isinstance(lr, torch.Tensor) else 0.0
            for param, _ in saved_grads:
                param.grad = torch.zeros_like(param)
            self.step()
        finally:
            for group, lr in zip(self.param_groups, saved_lrs, strict=True):
                if lr is not None:
                    group["lr"] = lr
            for param, grad in saved_grads:
                param.grad = grad
        self._sync_groups_to_sub_optimizers()

    # ------------------------------------------------------------------------------------
    # Copies
    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_fp32_param_by_new_param(self) -> None:
        """Refreshes the FP32 copies (only those) from the parameters, as Megatron's does.

        Host copies of FP32 parameters are *not* refreshed — use
        :meth:`wrapped_optim.HybridSyncOptimizer.reload_model_params` to refresh every copy.

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=0.0, lr=0.1)
            >>> with torch.no_grad():
            ...     _ = p.fill_(3.0)
            >>> opt.update_fp32_param_by_new_param()
            >>> opt.param_to_fp32_param[p].tolist()
            [3.0, 3.0]
        """
        for param, fp32_param in self.param_to_fp32_param.items():
            fp32_param.copy_(param)

    def master_copies(self) -> list[MasterCopies]:
        """Each parameter with a distinct copy: the copy this optimizer steps is its master
        (or a master a loader restored into ``state``, which the copy must then follow).

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
            >>> [entry.master is opt.gpu_params_map_cpu_copy[p] for entry in opt.master_copies()]
            [True]
        """
        entries = []
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                inner = self.param_to_inner_param[param]
                # A loader may have put a restored master into the state (Megatron's
                # precision-aware path does): then it is the master and the copy follows it.
                saved = self.state[param].get("master_param") if param in self.state else None
                if isinstance(saved, torch.Tensor) and saved is not inner and saved is not param:
                    copies = () if inner is param else (inner,)
                    master = saved
                elif inner is not param:
                    master, copies = inner, ()
                else:
                    continue
                name = f"group {group_index} param {index} ({tuple(param.shape)})"
                entries.append(MasterCopies(name, param, master, copies))
        return entries

    # ------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; the copies, their maps
        # and the sub-optimizers are part of this optimizer. Hooks are dropped, as torch does.
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict; rebuilds copies and sub-optimizers, then pushes the state in.

        Every check happens before the first change: a rejected payload leaves the optimizer
        exactly as it was, and the payload's tensors are copied, never adopted.

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0)
            >>> p.grad = torch.ones(2, dtype=torch.bfloat16)
            >>> opt.step()
            >>> saved = opt.state_dict()
            >>> twin = HybridOffloadOptimizer([torch.nn.Parameter(p.detach().clone())])
            >>> twin.load_state_dict(saved)
            >>> twin_master = twin.state[twin.param_groups[0]["params"][0]]["master_param"]
            >>> torch.equal(twin_master, opt.state[p]["master_param"])
            True
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        groups, states = self._prepare_load(state_dict)
        # Commit: nothing below can fail on a validated payload.
        self.param_groups[:] = groups
        self._build()
        self.state = defaultdict(dict)
        with torch.no_grad():
            for sub in self.sub_optimizers:
                for inner in [p for group in sub.param_groups for p in group["params"]]:
                    param = self.inner_param_to_orig_param[inner]
                    if param not in states:
                        continue
                    entry = states[param]
                    master = entry.pop("master_param", None)
                    if master is not None:
                        inner.copy_(master.reshape(inner.shape))
                        if self.param_update_in_fp32:
                            entry["master_param"] = inner
                    sub.state[inner] = entry
                    self.state[param] = entry
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _prepare_load(
        self, state_dict: Mapping[str, Any]
    ) -> tuple[list[dict[str, Any]], dict[torch.Tensor, dict[str, Any]]]:
        if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
            raise ValueError("an optimizer state dict needs 'state' and 'param_groups' entries")
        saved_groups = state_dict["param_groups"]
        saved_states = state_dict.get("state", {})
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        index_to_param: dict[Any, torch.Tensor] = {}
        groups = []
        for group_index, (group, saved) in enumerate(
            zip(self.param_groups, saved_groups, strict=True)
        ):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {group_index} has {len(group['params'])} params, the state "
                    f"dict's has {len(saved['params'])}"
                )
            index_to_param.update(zip(saved["params"], group["params"], strict=True))
            groups.append({**saved, "params": group["params"]})
        placement = self._placement()
        states: dict[torch.Tensor, dict[str, Any]] = {}
        for index, entry in saved_states.items():
            if index not in index_to_param:
                raise ValueError(f"state entry {index!r} belongs to no param of any group")
            param = index_to_param[index]
            _, dtype, device = placement[param]
            states[param] = {
                key: self._loaded_value(index, param, key, value, dtype, device)
                for key, value in entry.items()
            }
        return groups, states

    @staticmethod
    def _loaded_value(
        index: Any,
        param: torch.Tensor,
        key: str,
        value: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if key == "step":
            return value.detach().clone()
        if key == "master_param" and (
            not value.is_floating_point() or value.numel() != param.numel()
        ):
            raise ValueError(
                f"master_param of param {index!r} must be a floating tensor with "
                f"{param.numel()} elements, got {value.dtype} with {value.numel()}"
            )
        if value.is_floating_point():
            return value.detach().to(device=device, dtype=dtype, copy=True)
        return value.detach().to(device=device, copy=True)
