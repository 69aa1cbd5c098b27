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
from wrapped_optim.adapters.precision import is_precision_aware_holder, supports_chunked_state

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

    Precision-aware sub-optimizers (TE FusedAdam,
    :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW`) are supported as Megatron supports
    them with CPU offload: their state is saved in FusedAdam's portable format (FP32
    expansions read through ``get_unscaled_state``, the step count in ``param_groups``), and
    loaded through ``set_scaled_state`` into the same sub-optimizer instances (so instance-level
    patches, such as staging's, take effect). ``state`` shows their raw storage.

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
        # The defaults also go in as constructor keywords, as Megatron's HybridDeviceOptimizer
        # does: options such as PrecisionAwareAdamW's exp_avg_dtype are constructor-only.
        self.cpu_optimizers: list[torch.optim.Optimizer] = (
            [self.cpu_optimizer_cls(host_groups, **self.defaults)] if host_groups else []
        )
        self.gpu_optimizer: torch.optim.Optimizer | None = (
            self.gpu_optimizer_cls(device_groups, **self.defaults) if device_groups else None
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

    def _holders(self) -> list[torch.optim.Optimizer]:
        return [sub for sub in self.sub_optimizers if is_precision_aware_holder(sub)]

    def _sync_steps_from_holders(self) -> None:
        """A precision-aware holder counts steps per group: carry them in our own groups."""
        for sub, group_indices in self._sub_optimizers_with_groups():
            if not is_precision_aware_holder(sub):
                continue
            for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
                if "step" in sub_group:
                    self.param_groups[group_index]["step"] = sub_group["step"]

    def _expose_state(self) -> None:
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for sub in self.sub_optimizers:
            holder = is_precision_aware_holder(sub)
            for inner, inner_state in sub.state.items():
                param = self.inner_param_to_orig_param[inner]
                if holder:
                    if not inner_state:
                        continue
                    # A view: a holder's own dict must keep only the states it stores.
                    inner_state = dict(inner_state)
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
        self._sync_steps_from_holders()
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

    def _holder_of(self) -> dict[int, torch.optim.Optimizer]:
        """id(stepped copy) -> its precision-aware sub-optimizer."""
        return {
            id(inner): sub
            for sub in self._holders()
            for group in sub.param_groups
            for inner in group["params"]
        }

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; precision-aware sub-optimizers' params in FusedAdam's format.

        With plain sub-optimizers this is torch's ``Optimizer.state_dict`` of :attr:`state`.
        A param stepped by a precision-aware holder gets each of its states read through the
        holder's ``get_unscaled_state`` (the instance attribute, so instance-level patches
        such as staging's take effect): FP32 expansions instead of the raw storage, plus
        ``master_param``; the holder's step count is in ``param_groups`` (``"step"``), as
        FusedAdam keeps it.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridOffloadOptimizer(
            ...     [p], offload_fraction=1.0, cpu_optimizer_cls=PrecisionAwareAdamW,
            ...     exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
            >>> p.grad = torch.ones(2, dtype=torch.bfloat16)
            >>> opt.step()
            >>> sd = opt.state_dict()
            >>> opt.state[p]["exp_avg"].dtype, sd["state"][0]["exp_avg"].dtype
            (torch.bfloat16, torch.float32)
            >>> sorted(sd["state"][0]), sd["param_groups"][0]["step"]
            (['exp_avg', 'exp_avg_sq', 'master_param'], 1)
        """
        holder_of = self._holder_of()
        if not holder_of:
            return super().state_dict()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index_of: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [index_of.setdefault(id(p), len(index_of)) for p in group["params"]]
            groups.append(packed)
        state: dict[int, dict[str, Any]] = {}
        for group in self.param_groups:
            for param in group["params"]:
                inner = self.param_to_inner_param[param]
                sub = holder_of.get(id(inner))
                if sub is None:
                    if param in self.state:
                        state[index_of[id(param)]] = self.state[param]
                    continue
                stored = sub.state.get(inner)
                if not stored:
                    continue
                read = sub.get_unscaled_state  # type: ignore[attr-defined]
                entry = {name: read(inner, name) for name in list(stored)}
                if self.param_update_in_fp32:
                    entry["master_param"] = inner
                state[index_of[id(param)]] = entry
        result: dict[str, Any] = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            hooked = post_hook(self, result)
            if hooked is not None:
                result = hooked
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict; rebuilds copies and sub-optimizers, then pushes the state in.

        Every check happens before the first change: a rejected payload leaves the optimizer
        exactly as it was, and the payload's tensors are copied, never adopted.

        With a precision-aware sub-optimizer nothing is rebuilt: each state is written into
        it through its ``set_scaled_state`` (the instance attribute) and its group step is
        restored from the saved ``param_groups``; a plain sub-optimizer beside it gets its
        state replaced, as torch's own loader does; the copies keep their identity and take
        the current weights, then the saved masters.

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
        groups, states, holder_states = self._prepare_load(state_dict)
        # Commit: nothing below can fail on a validated payload.
        self.param_groups[:] = groups
        if self._holders():
            self._commit_with_holders(states, holder_states)
        else:
            self._build()
            self.state = defaultdict(dict)
            with torch.no_grad():
                for sub in self.sub_optimizers:
                    for inner in [p for group in sub.param_groups for p in group["params"]]:
                        self._load_plain_entry(sub, inner, states)
                        param = self.inner_param_to_orig_param[inner]
                        if param in states:
                            self.state[param] = states[param]
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_plain_entry(
        self,
        sub: torch.optim.Optimizer,
        inner: torch.Tensor,
        states: dict[torch.Tensor, dict[str, Any]],
    ) -> None:
        param = self.inner_param_to_orig_param[inner]
        if param not in states:
            return
        entry = states[param]
        master = entry.pop("master_param", None)
        if master is not None:
            inner.copy_(master.reshape(inner.shape))
            if self.param_update_in_fp32:
                entry["master_param"] = inner
        sub.state[inner] = entry

    @torch.no_grad()
    def _commit_with_holders(
        self,
        states: dict[torch.Tensor, dict[str, Any]],
        holder_states: dict[torch.Tensor, dict[str, torch.Tensor]],
    ) -> None:
        """Loads in place: holders keep their instances (and any instance-level patches)."""
        for param, inner in self.param_to_inner_param.items():
            if inner is not param:
                inner.copy_(param)  # what a rebuild from the current weights would hold
        for sub in self.sub_optimizers:
            inners = [p for group in sub.param_groups for p in group["params"]]
            if not is_precision_aware_holder(sub):
                sub.state = defaultdict(dict)  # as torch's own loader replaces it
                for inner in inners:
                    self._load_plain_entry(sub, inner, states)
                continue
            keeps_masters = bool(getattr(sub, "master_weights", False))
            chunked = supports_chunked_state(sub)
            write = sub.set_scaled_state  # type: ignore[attr-defined]
            for inner in inners:
                entry = holder_states.get(self.inner_param_to_orig_param[inner])
                if entry is None:
                    sub.state.pop(inner, None)
                    continue
                for name, value in entry.items():
                    if name == "master_param":
                        if value.is_floating_point():
                            inner.copy_(value.reshape(inner.shape))
                        if not keeps_masters:
                            continue
                    write(inner, name, _holder_source(value, inner, chunked))
        self._sync_groups_to_sub_optimizers()
        for sub, group_indices in self._sub_optimizers_with_groups():
            if is_precision_aware_holder(sub):
                for sub_group, group_index in zip(sub.param_groups, group_indices, strict=True):
                    if "step" not in self.param_groups[group_index]:
                        sub_group.pop("step", None)  # a fresh holder has not stepped
        self._expose_state()

    def _prepare_load(
        self, state_dict: Mapping[str, Any]
    ) -> tuple[
        list[dict[str, Any]],
        dict[torch.Tensor, dict[str, Any]],
        dict[torch.Tensor, dict[str, torch.Tensor]],
    ]:
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
        group_of: dict[int, int] = {}
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
            group_of.update({id(p): group_index for p in group["params"]})
            groups.append({**saved, "params": group["params"]})
        placement = self._placement()
        holder_of = self._holder_of()
        states: dict[torch.Tensor, dict[str, Any]] = {}
        holder_states: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        param_steps: dict[int, tuple[Any, int]] = {}  # group -> (first param, its step)
        for index, entry in saved_states.items():
            if index not in index_to_param:
                raise ValueError(f"state entry {index!r} belongs to no param of any group")
            param = index_to_param[index]
            inner = self.param_to_inner_param[param]
            sub = holder_of.get(id(inner))
            if sub is not None:
                group_index = group_of[id(param)]
                step, holder_entry = _holder_entry(index, param, inner, entry, sub)
                holder_states[param] = holder_entry
                if step is not None:
                    _agree_on_step(index, step, group_index, groups, param_steps)
                continue
            _, dtype, device = placement[param]
            states[param] = {
                key: self._loaded_value(index, param, key, value, dtype, device)
                for key, value in entry.items()
            }
        for group_index, (_, step) in param_steps.items():
            groups[group_index].setdefault("step", step)
        if holder_of:
            for group_index, group in enumerate(groups):
                if "step" in group and any(
                    id(self.param_to_inner_param[p]) in holder_of for p in group["params"]
                ):
                    _step_count(group["step"], f"param group {group_index}")
        return groups, states, holder_states

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


# ----------------------------------------------------------------------------------------
# Precision-aware sub-optimizers: validating and writing their portable state
# ----------------------------------------------------------------------------------------
def _step_count(value: Any, where: str) -> int:
    """A saved step as an int; a clear error for anything that is not a count."""
    number = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
    if (
        isinstance(number, bool)
        or not isinstance(number, int | float)
        or number < 0
        or not float(number).is_integer()
    ):
        raise ValueError(f"{where}: invalid step {value!r} (expected a non-negative count)")
    return int(number)


def _agree_on_step(
    index: Any,
    step: int,
    group_index: int,
    groups: list[dict[str, Any]],
    param_steps: dict[int, tuple[Any, int]],
) -> None:
    """A per-param step (torch's layout) must match its group's (FusedAdam's layout)."""
    if "step" in groups[group_index]:
        group_step = _step_count(groups[group_index]["step"], f"param group {group_index}")
        if step != group_step:
            raise ValueError(
                f"param {index!r}: step {step} disagrees with the step of its param group "
                f"{group_index} ({group_step})"
            )
        return
    first, seen = param_steps.setdefault(group_index, (index, step))
    if seen != step:
        raise ValueError(
            f"param {index!r}: step {step} disagrees with param {first!r} ({seen}) of the same "
            f"param group {group_index}; a precision-aware sub-optimizer keeps one step a group"
        )


def _holder_entry(
    index: Any,
    param: torch.Tensor,
    inner: torch.Tensor,
    entry: Mapping[str, Any],
    sub: Any,
) -> tuple[int | None, dict[str, torch.Tensor]]:
    """Validates one param's saved state for a precision-aware holder: (its step, states)."""
    name = type(sub).__name__
    keeps_masters = bool(getattr(sub, "master_weights", False))
    stored = {key for key in sub.name_to_dtype_map if key != "master_param"}
    required = stored | ({"master_param"} if keeps_masters else set())
    remainder = bool(getattr(sub, "store_param_remainders", False)) and (
        inner.dtype == torch.bfloat16
    )
    if not isinstance(entry, Mapping):
        raise ValueError(f"state of param {index!r} must be a dict, got {type(entry).__name__}")
    step = None
    states: dict[str, torch.Tensor] = {}
    for key, value in entry.items():
        if key == "step":
            step = _step_count(value, f"param {index!r}")
            continue
        if key not in stored and key != "master_param":
            raise ValueError(
                f"param {index!r}: unknown state {key!r}; {name} stores {sorted(stored)} "
                "(and master_param)"
            )
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"param {index!r}: state {key!r} must be a tensor, got {type(value).__name__}"
            )
        if value.numel() != param.numel():
            raise ValueError(
                f"param {index!r}: state {key!r} has {value.numel()} elements, the param has "
                f"{param.numel()}"
            )
        if key == "master_param" and keeps_masters and remainder:
            if value.dtype != torch.int16:
                raise ValueError(
                    f"param {index!r}: master_param is {value.dtype}, but {name} stores int16 "
                    "remainders of its bf16 params (store_param_remainders)"
                )
        elif not value.is_floating_point():
            raise ValueError(f"param {index!r}: state {key!r} is {value.dtype}, not floating")
        elif not bool(torch.isfinite(value).all()):
            raise ValueError(f"param {index!r}: state {key!r} has non-finite values")
        states[key] = value
    missing = sorted(required - states.keys())
    if missing:
        raise ValueError(f"param {index!r}: missing state {missing} that {name} stores")
    return step, states


def _holder_source(value: torch.Tensor, inner: torch.Tensor, chunked: bool) -> torch.Tensor:
    """What ``set_scaled_state`` gets: never a tensor it may scale in place.

    A chunk-capable holder never modifies its source and may quantize it from wherever it
    lives (staging relies on that); any other holder gets a private FP32 copy on the
    state's device (TE's fp16 path scales its argument in place).
    """
    if value.dtype == torch.int16:  # a remainder master
        return value.detach() if chunked else value.detach().to(inner.device, copy=True)
    if chunked:
        return value.detach().to(torch.float32)
    return value.detach().to(device=inner.device, dtype=torch.float32, copy=True)
