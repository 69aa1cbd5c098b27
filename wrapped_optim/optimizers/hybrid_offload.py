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

import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from wrapped_optim.adapters.hybrid import MasterCopies
from wrapped_optim.adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim.optimizers.transfers import copy_all
from wrapped_optim.state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks

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
    is stepped by one ``gpu_optimizer_cls`` instance. The default host optimizer is torch's
    ``AdamW`` with ``fused=True`` (its one-pass CPU kernel; pass ``fused=False`` or
    ``foreach=...`` to get torch's other implementations, or any ``cpu_optimizer_cls``, e.g.
    :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` for compressed host state).
    ``step`` copies gradients to the copies,
    steps both sub-optimizers and copies the results back into the parameters; ``state`` shows
    the sub-optimizers' state under the original parameters, with the stepped copy as
    ``"master_param"`` (when ``param_update_in_fp32``). ``**defaults`` (``lr``, ``betas``, ...)
    go to both sub-optimizers; group options are re-synced into them before every step, so LR
    schedulers work. The host sub-optimizer steps first. With ``atomic_step=True`` a step is
    all or nothing: the host half is put back if the device one raises (this keeps one copy of
    the host params and state during the step and costs 1.3-1.7x step time on a CPU); the
    default, ``atomic_step=False``, skips that copy and, like torch's optimizers, leaves the
    host half advanced on such a fault.

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

    gpu_params_map_cpu_copy: dict[torch.Tensor, torch.Tensor]
    cpu_copys_map_gpu_param: dict[torch.Tensor, torch.Tensor]
    param_to_fp32_param: dict[torch.Tensor, torch.Tensor]
    param_to_inner_param: dict[torch.Tensor, torch.Tensor]
    inner_param_to_orig_param: dict[torch.Tensor, torch.Tensor]
    cpu_optimizers: list[torch.optim.Optimizer]
    gpu_optimizer: torch.optim.Optimizer | None
    _host_group_index: list[int]
    _device_group_index: list[int]
    # Class-level defaults, for instances pickled before these existed.
    atomic_step: bool = False
    _copy_back_pending: bool = False

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        gpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        param_update_in_fp32: bool = True,
        atomic_step: bool = False,
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
        self.atomic_step = bool(atomic_step)
        self._copy_back_pending = False
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

    def _build(self) -> None:
        """(Re)creates every copy from the current params and fresh sub-optimizers."""
        self._adopt(self._new_layout(self.param_groups))

    def _adopt(self, layout: dict[str, Any]) -> None:
        """Installs a layout made by :meth:`_new_layout`: plain assignments, nothing can fail."""
        for name, value in layout.items():
            setattr(self, name, value)
        self._built = True

    @torch.no_grad()
    def _new_layout(self, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
        """New copies of the current params and new sub-optimizers over them, for the group
        options of ``param_groups``; nothing of this optimizer changes (see :meth:`_adopt`)."""
        gpu_params_map_cpu_copy: dict[torch.Tensor, torch.Tensor] = {}
        cpu_copys_map_gpu_param: dict[torch.Tensor, torch.Tensor] = {}
        param_to_fp32_param: dict[torch.Tensor, torch.Tensor] = {}
        param_to_inner_param: dict[torch.Tensor, torch.Tensor] = {}
        inner_param_to_orig_param: dict[torch.Tensor, torch.Tensor] = {}
        placement = self._placement()
        host_groups: list[dict[str, Any]] = []
        device_groups: list[dict[str, Any]] = []
        host_group_index: list[int] = []
        device_group_index: list[int] = []
        for group_index, group in enumerate(param_groups):
            options = {k: v for k, v in group.items() if k != "params"}
            host_params, device_params = [], []
            for param in group["params"]:
                offloaded, dtype, _ = placement[param]
                if offloaded:
                    pin = param.is_cuda and self.pin_cpu_params
                    inner = torch.empty(param.shape, dtype=dtype, device="cpu", pin_memory=pin)
                    inner.copy_(param.detach())
                    gpu_params_map_cpu_copy[param] = inner
                    cpu_copys_map_gpu_param[inner] = param
                    host_params.append(inner)
                elif dtype != param.dtype:
                    inner = param.detach().to(dtype=dtype, copy=True)
                    device_params.append(inner)
                else:
                    inner = param
                    device_params.append(param)
                if dtype != param.dtype:
                    param_to_fp32_param[param] = inner
                param_to_inner_param[param] = inner
                inner_param_to_orig_param[inner] = param
            if host_params:
                host_groups.append({**options, "params": host_params})
                host_group_index.append(group_index)
            if device_params:
                device_groups.append({**options, "params": device_params})
                device_group_index.append(group_index)
        # The defaults also go in as constructor keywords, as Megatron's HybridDeviceOptimizer
        # does: options such as PrecisionAwareAdamW's exp_avg_dtype are constructor-only.
        cpu_optimizers: list[torch.optim.Optimizer] = (
            [self.cpu_optimizer_cls(host_groups, **self._host_options())] if host_groups else []
        )
        gpu_optimizer: torch.optim.Optimizer | None = (
            self.gpu_optimizer_cls(device_groups, **self.defaults) if device_groups else None
        )
        return {
            "gpu_params_map_cpu_copy": gpu_params_map_cpu_copy,
            "cpu_copys_map_gpu_param": cpu_copys_map_gpu_param,
            "param_to_fp32_param": param_to_fp32_param,
            "param_to_inner_param": param_to_inner_param,
            "inner_param_to_orig_param": inner_param_to_orig_param,
            "_host_group_index": host_group_index,
            "_device_group_index": device_group_index,
            "cpu_optimizers": cpu_optimizers,
            "gpu_optimizer": gpu_optimizer,
        }

    def _host_options(self) -> dict[str, Any]:
        """The host sub-optimizer's keywords: torch's AdamW (the default) gets its fused CPU
        kernel (one pass over the copies, ~7x its default per-tensor loop on a CPU) unless
        the caller chose ``fused`` or ``foreach`` themselves."""
        options = dict(self.defaults)
        if self.cpu_optimizer_cls is torch.optim.AdamW and not {"fused", "foreach"} & set(options):
            options["fused"] = True
        return options

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
        pairs = []
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
            pairs.append((inner.grad, grad))
        copy_all(pairs)

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

        A closure is evaluated once, before the sub-optimizers step. A step is all or
        nothing: with two sub-optimizers, the host one steps first and, when ``atomic_step``
        (the default), a snapshot of its params and state is kept until the device one has
        stepped too — if that raises, the host one is put back. The copy-back is idempotent:
        one that raises is retried at once and, if it fails again, at the start of the next
        ``step`` or ``state_dict``.

        Example:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.5, weight_decay=0.0)
            >>> p.grad = torch.ones(2, dtype=torch.bfloat16)
            >>> opt.step()
            >>> p.tolist()
            [0.5, 0.5]
        """
        self._finish_copy_back()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups_to_sub_optimizers()
        self._copy_grads_to_copies()
        subs = self.sub_optimizers  # the host one first: its snapshot lives in host memory
        snapshot = (
            _SubSnapshot.take(subs[0])
            if self.atomic_step and len(subs) > 1 and subs[0] in self.cpu_optimizers
            else None
        )
        try:
            for sub in subs:
                sub.step()
        except BaseException:
            if snapshot is not None:
                snapshot.restore()
            self._expose_state()
            raise
        del snapshot
        # Committed: the copies hold the new values; what follows only publishes them.
        self._copy_back_pending = True
        self._sync_steps_from_holders()
        self._expose_state()
        try:
            self._copy_back()
        except Exception:
            self._copy_back()  # a transient fault: once more, then the next call retries
        return loss

    @torch.no_grad()
    def _copy_back(self) -> None:
        copy_all([(p, inner) for p, inner in self.param_to_inner_param.items() if inner is not p])
        self._copy_back_pending = False

    def _finish_copy_back(self) -> None:
        """Completes a copy-back that raised twice (the params then lag their copies)."""
        if self._copy_back_pending:
            self._copy_back()

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
        self._finish_copy_back()
        holder_of = self._holder_of()
        if not holder_of:
            return super().state_dict()
        return state_dict_with_hooks(self, lambda: self._holder_state_dict(holder_of))

    def _holder_state_dict(self, holder_of: dict[int, torch.optim.Optimizer]) -> dict[str, Any]:
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
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict; rebuilds copies and sub-optimizers, then pushes the state in.

        The whole payload is validated before the first change (structure, group
        hyper-parameters, and every param's state: the names its sub-optimizer keeps, shapes,
        dtypes, finiteness, steps): a rejected payload raises ``ValueError`` naming the param
        and state, and leaves the optimizer exactly as it was. The payload's tensors are
        copied, never adopted. Expected state names, for a plain torch sub-optimizer: those
        the param's current state has; for a param without state yet, those a throwaway
        instance of the sub-optimizer class creates for a two-element param of the same dtype
        and group options in one step.

        With plain sub-optimizers, the new copies, sub-optimizers and state are built beside
        the current ones and swapped in by plain assignments, so a fault while building
        changes nothing. With a precision-aware sub-optimizer nothing is rebuilt: each state
        is written into it through its ``set_scaled_state`` (the instance attribute) and its
        group step is restored from the saved ``param_groups``; a plain sub-optimizer beside
        it gets its state replaced, as torch's own loader does; the copies keep their identity
        and take the current weights, then the saved masters. What that path overwrites is
        kept until it has finished and put back if anything raises.

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
            >>> saved["state"][0]["exp_avg"] = torch.zeros(5)
            >>> twin.load_state_dict(saved)
            Traceback (most recent call last):
            ValueError: param 0: state 'exp_avg' has shape (5,), the param has (2,)
        """
        load_state_dict_with_hooks(self, state_dict, self._load_validated)

    def _load_validated(self, state_dict: dict[str, Any]) -> None:
        groups, states, holder_states = self._prepare_load(state_dict)
        if self._holders():
            self._load_with_holders(groups, states, holder_states)
        else:
            self._load_plain(groups, states)

    @torch.no_grad()
    def _load_plain(
        self, groups: list[dict[str, Any]], states: dict[torch.Tensor, dict[str, Any]]
    ) -> None:
        """Builds the loaded layout beside the current one, then swaps it in."""
        layout = self._new_layout(groups)
        subs = list(layout["cpu_optimizers"])
        if layout["gpu_optimizer"] is not None:
            subs.append(layout["gpu_optimizer"])
        orig_of = layout["inner_param_to_orig_param"]
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        # A param that is its own stepped copy takes its master last, undone on a fault.
        own_masters: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sub in subs:
            for inner in [p for group in sub.param_groups for p in group["params"]]:
                param = orig_of[inner]
                if param not in states:
                    continue
                entry = dict(states[param])
                master = entry.pop("master_param", None)
                if master is not None:
                    if inner is param:
                        own_masters.append((param, master))
                    else:
                        inner.copy_(master.reshape(inner.shape))
                    if self.param_update_in_fp32:
                        entry["master_param"] = inner
                sub.state[inner] = entry
                new_state[param] = entry
        _write_all(own_masters)
        # Commit: plain assignments only.
        self.param_groups[:] = groups
        self._adopt(layout)
        self.state = new_state
        self._copy_back_pending = False

    def _load_with_holders(
        self,
        groups: list[dict[str, Any]],
        states: dict[torch.Tensor, dict[str, Any]],
        holder_states: dict[torch.Tensor, dict[str, torch.Tensor]],
    ) -> None:
        """Loads in place, keeping what it overwrites until it has finished."""
        old_groups = list(self.param_groups)
        # A plain sub-optimizer's state is replaced, a holder's written into.
        snapshots = [
            _SubSnapshot.take(sub, clone_state=is_precision_aware_holder(sub))
            for sub in self.sub_optimizers
        ]
        try:
            self.param_groups[:] = groups
            self._commit_with_holders(states, holder_states)
        except BaseException:
            self.param_groups[:] = old_groups
            for snapshot in snapshots:
                snapshot.restore()
            self._expose_state()
            raise
        self._copy_back_pending = False

    def _load_plain_entry(
        self,
        sub: torch.optim.Optimizer,
        inner: torch.Tensor,
        states: dict[torch.Tensor, dict[str, Any]],
    ) -> None:
        param = self.inner_param_to_orig_param[inner]
        if param not in states:
            return
        entry = dict(states[param])
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
        self, state_dict: Any
    ) -> tuple[
        list[dict[str, Any]],
        dict[torch.Tensor, dict[str, Any]],
        dict[torch.Tensor, dict[str, torch.Tensor]],
    ]:
        """Validates the whole payload; returns the merged groups and copied states."""
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                "an optimizer state dict must be a dict with 'state' and 'param_groups', got "
                f"{type(state_dict).__name__}"
            )
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise ValueError(f"the optimizer state dict has no {key!r} entry")
        saved_groups = state_dict["param_groups"]
        saved_states = state_dict["state"]
        if not isinstance(saved_states, Mapping):
            raise ValueError(
                f"the state dict's 'state' must be a dict, got {type(saved_states).__name__}"
            )
        if not isinstance(saved_groups, list | tuple) or len(saved_groups) != len(
            self.param_groups
        ):
            count = len(saved_groups) if isinstance(saved_groups, list | tuple) else "no list of"
            raise ValueError(
                f"the state dict has {count} param groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        index_to_param: dict[Any, torch.Tensor] = {}
        group_of: dict[int, int] = {}
        groups = []
        for group_index, (group, saved) in enumerate(
            zip(self.param_groups, saved_groups, strict=True)
        ):
            if not isinstance(saved, Mapping) or not isinstance(saved.get("params"), list | tuple):
                raise ValueError(f"param group {group_index} of the state dict has no params list")
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"param group {group_index} has {len(group['params'])} params, the state "
                    f"dict's has {len(saved['params'])}"
                )
            index_to_param.update(zip(saved["params"], group["params"], strict=True))
            group_of.update({id(p): group_index for p in group["params"]})
            # Switches the checkpoint lacks keep this optimizer's value (see
            # _check_hyper_parameters); a step count only ever comes from the checkpoint.
            merged = {k: v for k, v in group.items() if k not in ("params", "step")}
            merged.update({k: _clone_value(v) for k, v in saved.items() if k != "params"})
            groups.append({**merged, "params": group["params"]})
        placement = self._placement()
        holder_of = self._holder_of()
        references = _References(self)
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
            states[param] = _plain_entry(
                index, param, entry, references.expected(inner), dtype, device
            )
        for group_index, (group, saved) in enumerate(
            zip(self.param_groups, saved_groups, strict=True)
        ):
            _check_hyper_parameters(group_index, group, saved)
        for group_index, (_, step) in param_steps.items():
            groups[group_index].setdefault("step", step)
        if holder_of:
            for group_index, group in enumerate(groups):
                if "step" in group and any(
                    id(self.param_to_inner_param[p]) in holder_of for p in group["params"]
                ):
                    _step_count(group["step"], f"param group {group_index}")
        return groups, states, holder_states


# ----------------------------------------------------------------------------------------
# Plain torch sub-optimizers: what their state must look like
# ----------------------------------------------------------------------------------------
# States that are sums of squares: a negative value makes the next update NaN.
_NON_NEGATIVE_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta"})


@attrs.frozen
class _Expected:
    """What one state of a plain sub-optimizer looks like (from a live or a probe state)."""

    tensor: bool
    elementwise: bool = False  # shaped like its param
    floating: bool = False
    shape: tuple[int, ...] = ()
    template: torch.Tensor | None = None  # dtype and device of a scalar tensor (a step)

    @classmethod
    def of(cls, value: Any, param_shape: torch.Size) -> _Expected:
        if not isinstance(value, torch.Tensor):
            return cls(tensor=False)
        return cls(
            tensor=True,
            elementwise=value.shape == param_shape,
            floating=value.is_floating_point(),
            shape=tuple(value.shape),
            template=value if value.dim() == 0 else None,
        )


class _References:
    """The state names (and kinds) each copy's sub-optimizer keeps, for validating a load.

    A copy with state: its current state. One without: the state a throwaway instance of
    the sub-optimizer class creates, in one step, for a two-element param of the copy's
    dtype and device under the same group options (probed once per group and dtype; a class
    that cannot be probed so gives ``None``: the names are not checked).
    """

    def __init__(self, owner: HybridOffloadOptimizer) -> None:
        self.owner = owner
        self.sub_of: dict[int, tuple[torch.optim.Optimizer, int]] = {}
        for sub in owner.sub_optimizers:
            for group_index, group in enumerate(sub.param_groups):
                for inner in group["params"]:
                    self.sub_of[id(inner)] = (sub, group_index)
        self.probes: dict[tuple[int, int, torch.dtype, torch.device], Any] = {}

    def expected(self, inner: torch.Tensor) -> dict[str, _Expected] | None:
        sub, group_index = self.sub_of[id(inner)]
        current = sub.state.get(inner)
        if current:
            return {
                name: _Expected.of(value, inner.shape)
                for name, value in current.items()
                if name != "master_param"
            }
        key = (id(sub), group_index, inner.dtype, inner.device)
        if key not in self.probes:
            self.probes[key] = self._probe(sub, group_index, inner)
        probed = self.probes[key]
        if probed is None:
            return None
        return {
            name: attrs.evolve(kind, elementwise=True, shape=tuple(inner.shape))
            if kind.elementwise
            else kind
            for name, kind in probed.items()
        }

    def _probe(
        self, sub: torch.optim.Optimizer, group_index: int, inner: torch.Tensor
    ) -> dict[str, _Expected] | None:
        owner = self.owner
        factory = (
            owner.cpu_optimizer_cls if sub in owner.cpu_optimizers else owner.gpu_optimizer_cls
        )
        options = {
            k: _clone_value(v) for k, v in sub.param_groups[group_index].items() if k != "params"
        }
        probe = torch.zeros(2, dtype=inner.dtype, device=inner.device, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            twin = factory([{**options, "params": [probe]}], **owner.defaults)
            twin.step()
            state = dict(twin.state.get(probe) or {})
        except Exception:
            return None
        return {
            name: _Expected.of(value, probe.shape)
            for name, value in state.items()
            if name != "master_param"
        }


def _plain_entry(
    index: Any,
    param: torch.Tensor,
    entry: Any,
    expected: dict[str, _Expected] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    """Validates one param's saved state for a plain sub-optimizer and copies it."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"state of param {index!r} must be a dict, got {type(entry).__name__}")
    if expected is not None:
        names = set(entry) - {"master_param"}
        unknown = sorted(names - set(expected))
        missing = sorted(set(expected) - names)
        problems = [f"unknown state {name!r}" for name in unknown]
        if missing:
            problems.append(f"missing state {missing}")
        if problems:
            raise ValueError(
                f"param {index!r}: {', '.join(problems)}; its sub-optimizer keeps "
                f"{sorted(expected)} (and master_param)"
            )
    return {
        name: _plain_value(
            index, param, name, value, None if expected is None else expected[name], dtype, device
        )
        if name != "master_param"
        else _master_value(index, param, value, dtype, device)
        for name, value in entry.items()
    }


def _master_value(
    index: Any, param: torch.Tensor, value: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if (
        not isinstance(value, torch.Tensor)
        or not value.is_floating_point()
        or value.numel() != param.numel()
    ):
        got = (
            f"{value.dtype} with {value.numel()}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ValueError(
            f"master_param of param {index!r} must be a floating tensor with "
            f"{param.numel()} elements, got {got}"
        )
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"param {index!r}: state 'master_param' has non-finite values")
    return value.detach().to(device=device, dtype=dtype, copy=True)


def _plain_value(
    index: Any,
    param: torch.Tensor,
    name: str,
    value: Any,
    kind: _Expected | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Any:
    """One checked, copied state value (never the caller's tensor)."""
    if name == "step":
        _step_count(value, f"param {index!r}")
        template = kind.template if kind is not None else None
        if isinstance(value, torch.Tensor):
            if template is not None:
                return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
            return value.detach().clone()
        if template is not None:
            return torch.tensor(float(value), dtype=template.dtype, device=template.device)
        return value
    if kind is not None and not kind.tensor:
        if isinstance(value, torch.Tensor):
            raise ValueError(
                f"param {index!r}: state {name!r} must not be a tensor, got {type(value).__name__}"
            )
        return value
    if not isinstance(value, torch.Tensor):
        if kind is None:
            return value
        raise ValueError(
            f"param {index!r}: state {name!r} must be a tensor, got {type(value).__name__}"
        )
    if kind is not None:
        want = tuple(param.shape) if kind.elementwise else kind.shape
        if tuple(value.shape) != want:
            raise ValueError(
                f"param {index!r}: state {name!r} has shape {tuple(value.shape)}, the "
                f"{'param has' if kind.elementwise else 'sub-optimizer keeps'} {want}"
            )
        if kind.floating and not value.is_floating_point():
            raise ValueError(f"param {index!r}: state {name!r} is {value.dtype}, not floating")
    if value.is_floating_point() or value.is_complex():
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"param {index!r}: state {name!r} has non-finite values")
        if name in _NON_NEGATIVE_STATES and value.is_floating_point() and bool((value < 0).any()):
            raise ValueError(f"param {index!r}: state {name!r} has negative values")
    if kind is not None and not kind.elementwise:
        template = kind.template
        if template is not None:
            return value.detach().to(dtype=template.dtype, device=template.device, copy=True)
        return value.detach().clone()
    if value.is_floating_point():
        return value.detach().to(device=device, dtype=dtype, copy=True)
    return value.detach().to(device=device, copy=True)


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_hyper_parameters(group_index: int, group: Mapping[str, Any], saved: Any) -> None:
    """The saved group has every numeric hyper-parameter of this group, each of its kind.

    A missing switch (a bool or ``None`` option, such as ``foreach`` or a flag a newer torch
    added) takes this optimizer's value, as torch's ``__setstate__`` fills such keys in.
    """
    where = f"param group {group_index}"
    for key, current in group.items():
        if key in ("params", "param_names", "step"):
            continue
        numeric = _is_number(current) or (
            isinstance(current, tuple | list) and all(_is_number(v) for v in current)
        )
        if key not in saved:
            if numeric:
                raise ValueError(f"{where}: missing hyper-parameter {key!r}")
            continue
        value = saved[key]
        if _is_number(current):
            number = (
                value.item() if _is_number(value) and isinstance(value, torch.Tensor) else value
            )
            if not _is_number(value) or not math.isfinite(float(number)):
                raise ValueError(
                    f"{where}: hyper-parameter {key!r} must be a finite number like "
                    f"{current!r}, got {value!r}"
                )
        elif isinstance(current, tuple | list) and numeric:
            if (
                not isinstance(value, tuple | list)
                or len(value) != len(current)
                or not all(_is_number(v) for v in value)
            ):
                raise ValueError(
                    f"{where}: hyper-parameter {key!r} must be {len(current)} numbers like "
                    f"{current!r}, got {value!r}"
                )
        elif isinstance(current, bool) and not isinstance(value, bool):
            raise ValueError(
                f"{where}: hyper-parameter {key!r} must be a bool like {current!r}, got {value!r}"
            )
        elif isinstance(current, str) and not isinstance(value, str):
            raise ValueError(
                f"{where}: hyper-parameter {key!r} must be a str like {current!r}, got {value!r}"
            )


def _write_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``target.copy_(source)`` for every pair, all or nothing."""
    if not pairs:
        return
    kept = [target.detach().clone() for target, _ in pairs]
    done = 0
    try:
        with torch.no_grad():
            for target, source in pairs:
                target.copy_(source.reshape(target.shape))
                done += 1
    except BaseException:
        with torch.no_grad():
            for (target, _), old in zip(pairs[: done + 1], kept, strict=False):
                target.copy_(old)
        raise


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


# ----------------------------------------------------------------------------------------
# Step rollback
# ----------------------------------------------------------------------------------------
class _SubSnapshot:
    """What a sub-optimizer's step or a load changes, kept so that it can be undone exactly.

    Kept: its params (the copies) and group options, its raw ``state`` (the stored tensors,
    compressed ones as they are), and the instance dicts keyed by its params, such as a
    precision-aware holder's scales. With ``clone_state=False`` (for a caller that replaces
    ``state`` entries instead of writing into them) the state is only referenced. Restoring
    writes the params back and refills those dicts in place (no attribute is reassigned).
    """

    def __init__(
        self,
        sub: torch.optim.Optimizer,
        params: dict[torch.Tensor, torch.Tensor],
        state: dict[torch.Tensor, dict[str, Any]],
        options: list[dict[str, Any]],
        tables: dict[str, dict[Any, Any]],
    ) -> None:
        self.sub = sub
        self.params = params
        self.state = state
        self.options = options
        self.tables = tables

    @classmethod
    @torch.no_grad()
    def take(cls, sub: torch.optim.Optimizer, *, clone_state: bool = True) -> _SubSnapshot:
        params = {p: p.detach().clone() for group in sub.param_groups for p in group["params"]}
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for param, entry in sub.state.items():
            if not clone_state:
                state[param] = entry
            else:
                state[param] = {
                    name: value if value is param else _deep_clone(value)
                    for name, value in entry.items()
                }
        # The same option objects (a scheduler may hold a tensor lr); a step count is copied.
        options = [
            {k: _clone_value(v) if k == "step" else v for k, v in group.items() if k != "params"}
            for group in sub.param_groups
        ]
        tables = {
            name: {key: _deep_clone(value) for key, value in table.items()}
            for name, table in vars(sub).items()
            if name != "state" and _keyed_by(table, params)
        }
        return cls(sub, params, state, options, tables)

    @torch.no_grad()
    def restore(self) -> None:
        sub = self.sub
        for param, value in self.params.items():
            param.copy_(value)
        for group, options in zip(sub.param_groups, self.options, strict=True):
            params = group["params"]
            group.clear()
            group.update(options, params=params)
        sub.state.clear()
        sub.state.update(self.state)
        for name, saved in self.tables.items():
            table = vars(sub).get(name)
            if isinstance(table, dict):
                table.clear()
                table.update(saved)


def _keyed_by(table: Any, params: dict[torch.Tensor, torch.Tensor]) -> bool:
    """A plain dict (not a hook registry) whose keys are all params of the sub-optimizer."""
    return (
        isinstance(table, dict)
        and not isinstance(table, OrderedDict)
        and all(isinstance(key, torch.Tensor) and key in params for key in table)
    )


def _deep_clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _deep_clone(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_deep_clone(v) for v in value)
    return value


def _clone_value(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value
