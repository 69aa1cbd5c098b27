"""HybridOffloadOptimizer: Megatron HybridDeviceOptimizer's structure, on any device.

The class gathers operands; its layout, step, loading and state rules are functions over an
``wrapped_optim.optimizers.hybrid_offload._layout.OffloadLayout`` (see docs/hybrid.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import wrapped_optim.optimizers.kernels.cpu_kernel as cpu_kernel
from wrapped_optim._adapters.hybrid import MasterCopies
from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks
from wrapped_optim.optimizers._step_checks import check_operands, describe_param
from wrapped_optim.optimizers.hybrid_offload._grads import give_grads
from wrapped_optim.optimizers.hybrid_offload._host_step import FusedEntry, grad_of, plan
from wrapped_optim.optimizers.hybrid_offload._layout import (
    OffloadLayout,
    Placement,
    adopt_sub_defaults,
    build_layout,
    host_keywords,
    placement,
)
from wrapped_optim.optimizers.hybrid_offload._loading import (
    LoadUndo,
    holder_state_dict,
    load_plain,
    load_with_holders,
    prepare_load,
)
from wrapped_optim.optimizers.hybrid_offload._state import exposed_state
from wrapped_optim.optimizers.hybrid_offload._state_rules import References
from wrapped_optim.optimizers.hybrid_offload._step import (
    COPY_IN,
    COPY_OUT,
    copy_back,
    step_sub_optimizers,
    sync_groups,
    sync_steps_from_holders,
)

__all__ = ["HybridOffloadOptimizer", "fused_plan"]


class HybridOffloadOptimizer(torch.optim.Optimizer):
    """Steps part of the parameters on the host and the rest on their device.

    Megatron-Core's ``HybridDeviceOptimizer`` with its keywords and attribute names
    (``gpu_params_map_cpu_copy``, ``param_to_fp32_param``, ``sub_optimizers``, ...), on any
    device: every offloaded parameter gets a distinct host copy, stepped by the host
    sub-optimizer and copied back. See docs/hybrid.md for how it works.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        offload_fraction: share of the total numel offloaded, in group order, in ``[0, 1]``.
        cpu_optimizer_cls: class of the host sub-optimizer (torch's ``AdamW``, fused).
        gpu_optimizer_cls: class of the sub-optimizer of the params left on their device.
        param_update_in_fp32: step 16-bit params through FP32 copies (``master_param``).
        atomic_step: put the host half back if the device sub-optimizer's step raises.
        fused_host_step: the one-pass CPU kernel step of host copies (``None``: where it applies).
        **defaults: hyper-parameters (``lr``, ``betas``, ...) for both sub-optimizers.

    Raises:
        ValueError: ``offload_fraction`` is outside ``[0, 1]``.
        RuntimeError: ``fused_host_step=True`` but the CPU kernel cannot be built.

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
    """

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
        # Megatron's CUDA transfer options: accepted so that calls switch unchanged.
        self.pin_cpu_params = bool(defaults.pop("pin_cpu_params", True))
        self.pin_cpu_grads = bool(defaults.pop("pin_cpu_grads", True))
        defaults.pop("overlap_cpu_optimizer_d2h_h2d", None)
        self.offload_fraction = float(offload_fraction)
        self.cpu_optimizer_cls = cpu_optimizer_cls
        self.gpu_optimizer_cls = gpu_optimizer_cls
        self.param_update_in_fp32 = bool(param_update_in_fp32)
        self.atomic_step = bool(atomic_step)
        self.fused_host_step: bool | None = fused_host_step
        self._copy_back_pending = False
        self._fused_params: frozenset[torch.Tensor] = frozenset()  # written by the fused step
        self._built = False
        self._keywords = dict(defaults)  # the sub-optimizers' constructor keywords
        super().__init__(params, defaults)
        self._layout = self._build_layout(self.param_groups)
        self._built = True
        adopt_sub_defaults(self._layout, self.defaults, self.param_groups)

    # ------------------------------------------------------------------------------------
    # Layout
    # ------------------------------------------------------------------------------------
    def _placement(self) -> Placement:
        return placement(self.param_groups, self.offload_fraction, self.param_update_in_fp32)

    def _build_layout(self, param_groups: list[dict[str, Any]]) -> OffloadLayout:
        """New copies of the current params and new sub-optimizers over them, with the group
        options of ``param_groups``; nothing of this optimizer changes."""
        # The caller's keywords go in as constructor keywords, as Megatron's do (some options,
        # such as PrecisionAwareAdamW's exp_avg_dtype, are constructor-only).
        return build_layout(
            param_groups,
            self._placement(),
            self.cpu_optimizer_cls,
            host_keywords(self.cpu_optimizer_cls, self._keywords),
            self.gpu_optimizer_cls,
            self._keywords,
            pin_cpu_params=self.pin_cpu_params,
        )

    @property
    def layout(self) -> OffloadLayout:
        """The copies and sub-optimizers this optimizer steps (replaced by a load).

        Examples:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0)
            >>> opt.layout.param_to_inner_param[p] is opt.gpu_params_map_cpu_copy[p]
            True
        """
        return self._layout

    @property
    def gpu_params_map_cpu_copy(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each offloaded param -> its host copy."""
        return self._layout.gpu_params_map_cpu_copy

    @property
    def cpu_copys_map_gpu_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each host copy -> its param."""
        return self._layout.cpu_copys_map_gpu_param

    @property
    def param_to_fp32_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each param stepped through a copy of another dtype -> that copy."""
        return self._layout.param_to_fp32_param

    @property
    def param_to_inner_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each param -> the tensor stepped for it (a copy, or itself)."""
        return self._layout.param_to_inner_param

    @property
    def inner_param_to_orig_param(self) -> dict[torch.Tensor, torch.Tensor]:
        """Each stepped tensor -> its param."""
        return self._layout.inner_param_to_orig_param

    @property
    def cpu_optimizers(self) -> list[torch.optim.Optimizer]:
        """The host sub-optimizer, if any parameter is offloaded."""
        return self._layout.cpu_optimizers

    @property
    def gpu_optimizer(self) -> torch.optim.Optimizer | None:
        """The sub-optimizer of the params left on their device, if any."""
        return self._layout.gpu_optimizer

    @property
    def sub_optimizer_keywords(self) -> dict[str, Any]:
        """The keyword arguments the sub-optimizers are constructed with: the caller's
        (``lr``, ``exp_avg_dtype``, ...), without the defaults ``defaults`` gains from
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
        return self._layout.sub_optimizers

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
    def _expose_state(self) -> None:
        """Publishes ``state`` (host entries take writes in place)."""
        self.state = exposed_state(
            self._layout.cpu_optimizers,
            self._layout.gpu_optimizer,
            self._layout.inner_param_to_orig_param,
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
        layout = self._layout
        self._check_operands()
        sync_groups(layout, self.param_groups)
        fused = fused_plan(self)
        with torch.profiler.record_function(COPY_IN):
            give_grads(layout, {entry.inner for entry in fused}, pin_cpu_grads=self.pin_cpu_grads)
        try:
            step_sub_optimizers(layout, fused, atomic=self.atomic_step)
        except BaseException:
            self._expose_state()
            raise
        self._fused_params = frozenset(entry.param for entry in fused)
        # Committed: the copies hold the new values; what follows only publishes them.
        self._copy_back_pending = True
        sync_steps_from_holders(layout, self.param_groups)
        self._expose_state()
        try:
            self._copy_back()
        except Exception:
            self._copy_back()  # a transient fault: once more, then the next call retries
        return loss

    def _check_operands(self) -> None:
        """Every param about to step against its grad and the copy stepped for it (see
        ``_step_checks``): a param resized behind the optimizer's back is refused before
        any grad is copied or any sub-optimizer steps."""
        inner_of = self._layout.param_to_inner_param
        # Block-scaled moments hold a byte (or half a byte) per element: their sub-optimizer
        # checks them (codes and block scales) in its own step.
        blocked = {
            id(state[name])
            for sub in self._layout.sub_optimizers
            if getattr(getattr(sub, "layout", None), "block_format", None) is not None
            for state in sub.state.values()
            for name in ("exp_avg", "exp_avg_sq")
            if name in state
        }
        for group_index, group in enumerate(self.param_groups):
            for index, param in enumerate(group["params"]):
                grad = grad_of(param)
                if grad is None:
                    continue
                inner = inner_of.get(param, param)
                kept = {
                    f"state {name!r}": value
                    for name, value in self.state.get(param, {}).items()
                    if isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and id(value) not in blocked
                }
                if inner is not param:
                    kept["its stepped copy"] = inner
                check_operands(
                    describe_param(group_index, index, param), param, grad, kept,
                    same_device=False, contiguous=False,
                )  # fmt: skip

    def _copy_back(self) -> None:
        """Copies each stepped copy into its param (the fused host step wrote its own)."""
        with torch.profiler.record_function(COPY_OUT):
            copy_back(self._layout, self._fused_params)
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
        sync_groups(self._layout, self.param_groups)

    # ------------------------------------------------------------------------------------
    # Copies
    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def update_fp32_param_by_new_param(self) -> None:
        """Refreshes the FP32 copies (only those) from the parameters, as Megatron's does.

        Host copies of FP32 parameters are *not* refreshed — use
        ``wrapped_optim.HybridSyncOptimizer.reload_model_params`` to refresh every copy.

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

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; precision-aware sub-optimizers' params in FusedAdam's format.

        With plain sub-optimizers this is what torch's ``Optimizer.state_dict`` makes of
        ``state``, each param's entry the sub-optimizer's own dict, as torch's (a plain
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
        return state_dict_with_hooks(
            self,
            lambda: holder_state_dict(
                self._layout, self.param_groups, self.state, with_master=self.param_update_in_fp32
            ),
        )

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
        load_state_dict_with_hooks(self, state_dict, self._load)

    def load_undo(self) -> LoadUndo:
        """What ``load_state_dict`` would change, kept so that a load that returned can be
        undone (``wrapped_optim.checkpoint.load_optimizer`` uses it when a later step of
        the load fails: a wrapper's ``sync_after_load``, a load post-hook).

        Keep the bytes of ``.overwrites`` (the tensors a load writes in place: stepped
        copies, precision-aware sub-optimizers' stored state) yourself, write them back, then
        call ``.restore()`` for the rest (layout, groups, sub-optimizers' state entries,
        options and scales, the exposed ``state``). It holds references, not state.

        Examples:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
            >>> p.grad = torch.ones(2); opt.step()
            >>> saved = opt.state_dict()
            >>> undo = opt.load_undo()
            >>> kept = [t.clone() for t in undo.overwrites]
            >>> saved["param_groups"][0]["lr"] = 0.5
            >>> opt.load_state_dict(saved)
            >>> for tensor, old in zip(undo.overwrites, kept):
            ...     _ = tensor.copy_(old)
            >>> undo.restore()
            >>> opt.param_groups[0]["lr"], opt.sub_optimizers[0].param_groups[0]["lr"]
            (0.1, 0.1)
        """
        pending = self._copy_back_pending

        def finish(layout: OffloadLayout) -> None:
            self._layout = layout
            self._expose_state()
            self._copy_back_pending = pending

        return LoadUndo(self._layout, self.param_groups, finish)

    def _load(self, state_dict: dict[str, Any]) -> None:
        """Validates ``state_dict`` whole, then loads it (see ``load_state_dict``)."""
        layout, fp32 = self._layout, self.param_update_in_fp32
        references = References(
            layout, (self.cpu_optimizer_cls, self.gpu_optimizer_cls), self._keywords
        )
        groups, states, holder_states = prepare_load(
            layout, self.param_groups, state_dict, self._placement(), references
        )
        if layout.holders():
            try:
                load_with_holders(
                    layout,
                    self.param_groups,
                    groups,
                    states,
                    holder_states,
                    with_master=fp32,
                )
            finally:
                self._expose_state()
        else:
            new_layout, new_state = load_plain(self._build_layout, groups, states, with_master=fp32)
            # Commit: plain assignments only.
            self.param_groups[:] = groups
            self._layout = new_layout
            self.state = new_state
        self._copy_back_pending = False


def fused_plan(opt: HybridOffloadOptimizer) -> list[FusedEntry]:
    """The params the fused host step updates in ``opt``'s next step, from its options.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
        >>> p.grad = torch.ones(4, dtype=torch.bfloat16)
        >>> len(fused_plan(opt)) == (1 if cpu_kernel.available() else 0)
        True
    """
    return plan(
        opt.layout,
        opt.param_groups,
        enabled=opt.fused_host_step,
        cpu_optimizer_cls=opt.cpu_optimizer_cls,
        keywords=opt.sub_optimizer_keywords,
    )
