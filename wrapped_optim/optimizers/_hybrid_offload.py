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

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from wrapped_optim._adapters.hybrid import MasterCopies
from wrapped_optim._adapters.precision import is_precision_aware_holder
from wrapped_optim._rollback import OptimizerSnapshot
from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks
from wrapped_optim.optimizers import _fused_host_step as fused_host_step
from wrapped_optim.optimizers import _offload_grads as offload_grads
from wrapped_optim.optimizers import _offload_loading as offload_loading
from wrapped_optim.optimizers import _offload_state as offload_state
from wrapped_optim.optimizers import cpu_kernel
from wrapped_optim.optimizers._transfers import copy_all

__all__ = ["HybridOffloadOptimizer"]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Megatron HybridDeviceOptimizer options that only tune CUDA transfers: accepted so that
# constructor calls can be switched unchanged, never passed to the sub-optimizers.
_TRANSFER_OPTIONS = ("pin_cpu_grads", "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d")


_NOT_ADOPTED = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})
_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # values without a plain comparison: not adopted
        return False


class HybridOffloadOptimizer(torch.optim.Optimizer):
    """Steps part of the parameters on the host and the rest on their device.

    Parameters are walked in group order and offloaded until ``offload_fraction`` of the total
    numel is reached. An offloaded parameter gets a host copy (FP32 when the parameter is 16-bit
    and ``param_update_in_fp32``), stepped by one ``cpu_optimizer_cls`` instance; a 16-bit
    parameter left on its device gets an FP32 working copy there, and everything on the device
    is stepped by one ``gpu_optimizer_cls`` instance. The default host optimizer is torch's
    ``AdamW`` (its state and checkpoint format), stepped by the *fused host step*
    (:mod:`~wrapped_optim.optimizers._fused_host_step`) where it applies — a bf16 or FP32 CPU
    param with an FP32 host copy: one pass of the compiled CPU kernel reads the grad, updates
    copy and moments and writes the param, within FP32 rounding of torch's arithmetic, not bitwise
    — and by ``AdamW(fused=True)`` elsewhere. Pass ``fused=...`` or ``foreach=...`` to get
    exactly torch's implementation, ``fused_host_step=False`` to never use the fused step
    (``True``: raise if the kernel cannot be built), or any ``cpu_optimizer_cls``, e.g.
    :class:`~wrapped_optim.optimizers.PrecisionAwareAdamW` for compressed host state (fused,
    bitwise, where it would update the copy with the same kernel).
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

    Examples:
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
    fused_host_step: bool | None = None
    _fused_params: frozenset[torch.Tensor] = frozenset()  # written by this step's fused step
    _shared_grads: set[torch.Tensor]

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        gpu_optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        param_update_in_fp32: bool = True,
        atomic_step: bool = False,
        fused_host_step: bool | None = None,
        **defaults: Any,
    ) -> None:
        if not 0.0 <= float(offload_fraction) <= 1.0:
            raise ValueError(f"offload_fraction must be within [0, 1], got {offload_fraction}")
        if fused_host_step and not cpu_kernel.available():
            raise RuntimeError(
                "fused_host_step=True, but the CPU AdamW kernel is unavailable: "
                f"{cpu_kernel.status().reason}. Pass fused_host_step=None to use it only "
                "where it can be built."
            )
        self.pin_cpu_params = bool(defaults.pop("pin_cpu_params", True))
        self.pin_cpu_grads = bool(defaults.pop("pin_cpu_grads", True))
        defaults.pop("overlap_cpu_optimizer_d2h_h2d", None)
        self.offload_fraction = float(offload_fraction)
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = bool(param_update_in_fp32)
        self.atomic_step = bool(atomic_step)
        self.fused_host_step = fused_host_step
        self._copy_back_pending = False
        self._fused_params = frozenset()
        self._shared_grads = set()  # host copies whose .grad is their param's own grad
        self._built = False
        self._keywords = dict(defaults)  # the sub-optimizers' constructor keywords
        super().__init__(params, defaults)
        self._build()
        self._adopt_sub_defaults()

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
        # The caller's keywords also go in as constructor keywords, as Megatron's
        # HybridDeviceOptimizer does: options such as PrecisionAwareAdamW's exp_avg_dtype are
        # constructor-only. (Not our defaults: those gain the sub-optimizers' own defaults,
        # some of which their constructors do not take, e.g. AdamW's decoupled_weight_decay.)
        cpu_optimizers: list[torch.optim.Optimizer] = (
            [self.cpu_optimizer_cls(host_groups, **self._host_options())] if host_groups else []
        )
        gpu_optimizer: torch.optim.Optimizer | None = (
            self.gpu_optimizer_cls(device_groups, **self._keywords) if device_groups else None
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

    def _adopt_sub_defaults(self) -> None:
        """Our ``defaults`` and groups gain the hyper-parameters the sub-optimizers filled in
        (``betas``, ``eps``, ``weight_decay``, ...) and agree on, as a torch optimizer's hold
        all of them: schedulers that read or cycle them (``OneCycleLR`` with
        ``cycle_momentum``) see them, and :meth:`step` passes changes on. Implementation
        switches (``fused``, ``foreach``, ...) stay the caller's."""
        subs = self._sub_optimizers_with_groups()
        if not subs:
            return
        common = set.intersection(*(set(sub.defaults) for sub, _ in subs)) - _NOT_ADOPTED
        for key in sorted(common - set(self.defaults)):
            values = [sub.defaults[key] for sub, _ in subs]
            if all(_same(v, values[0]) for v in values):
                self.defaults[key] = values[0]
        for group_index, group in enumerate(self.param_groups):
            found: dict[str, list[Any]] = {}
            for sub, group_indices in subs:
                if group_index in group_indices:
                    sub_group = sub.param_groups[group_indices.index(group_index)]
                    for key in common - set(group):
                        found.setdefault(key, []).append(sub_group.get(key, _ABSENT))
            for key, values in sorted(found.items()):
                if values[0] is not _ABSENT and all(_same(v, values[0]) for v in values):
                    group[key] = values[0]

    def _host_options(self) -> dict[str, Any]:
        """The host sub-optimizer's keywords: torch's AdamW (the default) gets its fused CPU
        kernel (one pass over the copies, ~7x its default per-tensor loop on a CPU) unless
        the caller chose ``fused`` or ``foreach`` themselves."""
        options = dict(self._keywords)
        if self.cpu_optimizer_cls is torch.optim.AdamW and not self._implementation_chosen():
            options["fused"] = True
        return options

    def _implementation_chosen(self, group_index: int | None = None) -> bool:
        """Whether the caller picked torch's AdamW implementation (a ``fused`` or ``foreach``
        keyword) for the host sub-optimizer, or, given ``group_index``, for that group: then
        they get exactly it (no fused CPU default, no fused host step)."""
        options = set(self._keywords)
        if group_index is not None:
            options |= set(self.param_groups[group_index])
        return bool(options & {"fused", "foreach"})

    @property
    def sub_optimizer_keywords(self) -> dict[str, Any]:
        """The keyword arguments the sub-optimizers are constructed with: the caller's
        (``lr``, ``exp_avg_dtype``, ...), without the defaults :attr:`defaults` gains from
        the sub-optimizers (a copy).

        Examples:
            >>> import torch
            >>> opt = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1)
            >>> opt.sub_optimizer_keywords, opt.defaults["betas"]
            ({'lr': 0.1}, (0.9, 0.999))
        """
        return dict(self._keywords)

    @property
    def sub_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host sub-optimizer (if any parameter is offloaded), then the device one.

        Examples:
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

        Examples:
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

    def _copy_grads_to_copies(self, fused: Collection[torch.Tensor] = ()) -> None:
        """Gives every copy its grad (:func:`offload_grads.give_grads`); one in ``fused`` gets
        None (the fused host step reads its param's grad itself)."""
        offload_grads.give_grads(self, fused)

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
        """Publishes :attr:`state` (:func:`offload_state.exposed_state`: host entries take
        writes in place)."""
        self.state = offload_state.exposed_state(
            self.cpu_optimizers,
            self.gpu_optimizer,
            self.inner_param_to_orig_param,
            self.param_update_in_fp32,
        )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Copies grads to the copies, steps both sub-optimizers, copies the results back.

        A closure is evaluated once, before the sub-optimizers step. With two
        sub-optimizers the host one steps first; with ``atomic_step=True`` (off by default)
        a snapshot of its params and state is kept until the device one has stepped too — if
        that raises, the host one is put back, so the step is all or nothing; without it
        such a fault leaves the host half advanced. The copy-back is idempotent:
        one that raises is retried at once and, if it fails again, at the start of the next
        ``step`` or ``state_dict``.

        Examples:
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
        fused = fused_host_step.plan(self)
        self._copy_grads_to_copies({entry.inner for entry in fused})
        subs = self.sub_optimizers  # the host one first: its snapshot lives in host memory
        atomic = self.atomic_step and len(subs) > 1 and subs[0] in self.cpu_optimizers
        snapshot = OptimizerSnapshot.take(subs[0]) if atomic else None
        # The fused host step writes its params before the step commits: kept too.
        written = [(e.param, e.param.detach().clone()) for e in fused] if atomic else []
        try:
            for sub in subs:
                sub.step()
                if sub in self.cpu_optimizers:
                    fused_host_step.run([entry for entry in fused if entry.optimizer is sub])
        except BaseException:
            if snapshot is not None:
                snapshot.restore()
                with torch.no_grad():
                    for param, value in written:
                        param.copy_(value)
            self._expose_state()
            raise
        del snapshot, written
        self._fused_params = frozenset(entry.param for entry in fused)
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
        """Copies each stepped copy into its param (the fused host step wrote its own)."""
        done = self._fused_params
        copy_all(
            [
                (p, inner)
                for p, inner in self.param_to_inner_param.items()
                if inner is not p and p not in done
            ]
        )
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

        Examples:
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

        Examples:
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

        Examples:
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

        With plain sub-optimizers this is what torch's ``Optimizer.state_dict`` makes of
        :attr:`state`, each param's entry the sub-optimizer's own dict, as torch's (a plain
        dict, never the in-place view ``state`` holds for a host param).
        A param stepped by a precision-aware holder gets each of its states read through the
        holder's ``get_unscaled_state`` (the instance attribute, so instance-level patches
        such as staging's take effect): FP32 expansions instead of the raw storage, plus
        ``master_param``; the holder's step count is in ``param_groups`` (``"step"``), as
        FusedAdam keeps it.

        Examples:
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
        portable = offload_loading.holder_state_dict
        return state_dict_with_hooks(self, lambda: portable(self, holder_of))

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

        Examples:
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
            >>> twin.load_state_dict(saved)  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            wrapped_optim._formats.errors.OptimizerCheckpointError: param 0: state ...
        """
        load_state_dict_with_hooks(self, state_dict, lambda sd: offload_loading.load(self, sd))
