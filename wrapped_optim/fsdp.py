"""FSDPAwareOptimizer and init_optimizer_state: torch optimizers over sharded parameters
whose grads have another dtype than their weights (Megatron-FSDP's bf16 main grads).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import torch

from wrapped_optim._adapters.megatron_fsdp import (
    fsdp_parameter_group_of,
    grad_dtype_attr,
    grad_dtype_of,
    iter_params,
    local_tensor,
    swap_grad,
)
from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim._rollback import GroupOptions
from wrapped_optim.wrapper import OptimizerWrapper, find_layer

__all__ = ["FSDPAwareOptimizer", "init_optimizer_state"]

RefreshFn = Callable[[dict[str, Any]], None]

# Hyper-parameters zeroed while init_optimizer_state steps, so the step cannot move a weight
# nor leave weight-decay traces in the new state.
_ZEROED_HYPERPARAMETERS = ("lr", "weight_decay")

# State entries whose mere presence changes an optimizer's update rule: torch's SGD adopts the
# first grad as its momentum buffer (buf = g) when it has none, but decays an existing one
# (buf = momentum * buf + (1 - dampening) * g). init_optimizer_state's zero buffers are load
# targets only; until something writes into them, the first real step must not see them.
_ADOPTED_ON_FIRST_STEP: tuple[tuple[type[torch.optim.Optimizer], tuple[str, ...]], ...] = (
    (torch.optim.SGD, ("momentum_buffer",)),
)


class _CastBuffers:
    """One persistent data-dtype grad buffer per parameter, reused while its layout holds."""

    def __init__(self) -> None:
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.allocations = 0

    def for_grad(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        entry = self._buffers.get(id(param))
        if entry is not None and entry[0] is param and _same_layout(entry[1], grad, param.dtype):
            return entry[1]
        # empty_like keeps a DTensor grad's mesh and placements.
        buffer = torch.empty_like(grad, dtype=param.dtype)
        self._buffers[id(param)] = (param, buffer)
        self.allocations += 1
        return buffer

    def nbytes(self) -> int:
        return sum(
            local_tensor(buffer).numel() * buffer.element_size()
            for _, buffer in self._buffers.values()
        )

    def clear(self) -> None:
        self._buffers.clear()


def _same_layout(buffer: torch.Tensor, grad: torch.Tensor, dtype: torch.dtype) -> bool:
    if type(buffer) is not type(grad) or buffer.dtype != dtype or buffer.shape != grad.shape:
        return False
    if getattr(buffer, "placements", None) != getattr(grad, "placements", None):
        return False
    if getattr(buffer, "device_mesh", None) != getattr(grad, "device_mesh", None):
        return False
    local_buffer, local_grad = local_tensor(buffer), local_tensor(grad)
    return local_buffer.shape == local_grad.shape and local_buffer.device == local_grad.device


def _restore_grads(swapped: list[tuple[torch.Tensor, torch.Tensor | None, Any]]) -> None:
    # Every parameter is restored even if one fails; the first failure is re-raised.
    failure: BaseException | None = None
    for param, grad, grad_dtype in reversed(swapped):
        try:
            swap_grad(param, grad, grad_dtype)
        except BaseException as error:
            failure = failure or error
    swapped.clear()
    if failure is not None:
        raise failure


def _cast_grads(
    params: Iterable[torch.Tensor],
    buffers: _CastBuffers,
    swapped: list[tuple[torch.Tensor, torch.Tensor | None, Any]],
) -> None:
    """Swaps every grad whose dtype differs from its parameter's for a cast copy.

    Each swap is recorded in ``swapped`` as it happens, so ``_restore_grads`` puts back
    every original grad object (and ``grad_dtype``) even if a later swap fails.
    """
    for param in params:
        grad = param.grad
        if grad is None or grad.dtype == param.dtype:
            continue
        buffer = buffers.for_grad(param, grad)
        with torch.no_grad():
            local_tensor(buffer).copy_(local_tensor(grad))
        swapped.append((param, grad, grad_dtype_attr(param)))
        swap_grad(param, buffer, param.dtype)


@contextmanager
def _grads_in_data_dtype(
    params: list[torch.Tensor], buffers: _CastBuffers
) -> Iterator[Callable[[Callable[[], Any]], Callable[[], Any]]]:
    """Casts grads to their parameter's dtype for the block, then puts the originals back.

    Yields a function that turns a step closure into one that restores the original grads
    before each evaluation (the closure zeroes, accumulates into and clips the grads autograd
    owns) and casts the new grads after it, so an optimizer that evaluates its closure inside
    ``step`` -- once, like Adam, or several times, like LBFGS -- steps on cast grads.
    The original grad objects and ``grad_dtype`` values are put back when the block exits,
    also when it raises.
    """
    swapped: list[tuple[torch.Tensor, torch.Tensor | None, Any]] = []

    def casting(closure: Callable[[], Any]) -> Callable[[], Any]:
        def evaluate() -> Any:
            _restore_grads(swapped)
            loss = closure()
            _cast_grads(params, buffers, swapped)
            return loss

        return evaluate

    try:
        _cast_grads(params, buffers, swapped)
        yield casting
    finally:
        _restore_grads(swapped)


class FSDPAwareOptimizer(OptimizerWrapper):
    """Steps any optimizer on sharded parameters whose grad dtype differs from their dtype.

    Around each step of the wrapped stack, grads of a foreign dtype are swapped for copies in
    the parameter's dtype (kept in buffers reused from step to step), the inner step runs,
    the original grads are put back (also when the step raises), and after a successful step
    the compute weights are refreshed once per parameter group. A closure's grads are cast
    after each evaluation. See [FSDP-aware stepping](../fsdp.md#how-it-works).

    Args:
        inner: The optimizer (or wrapper stack) to decorate.
        precision_aware: The optimizer reads grads in another dtype than the weights itself
            (TE's ``FusedAdam``, ``PrecisionAwareAdamW``): nothing is cast.
        refresh: Called with each optimizer parameter group that holds parameters not owned
            by Megatron-FSDP, after every successful step (e.g. to copy FP32 masters into the
            model's compute weights).

    Raises:
        TypeError: ``refresh`` is not callable.

    Examples:
        >>> import torch
        >>> from wrapped_optim.fsdp import FSDPAwareOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> (p * 3).sum().backward()
        >>> p.grad.dtype
        torch.bfloat16
        >>> opt = FSDPAwareOptimizer(torch.optim.SGD([p], lr=0.5))
        >>> opt.step()
        >>> p.data, p.grad.dtype
        (tensor([-0.5000, -0.5000]), torch.bfloat16)
    """

    def __init__(
        self, inner: Any, *, precision_aware: bool = False, refresh: RefreshFn | None = None
    ) -> None:
        super().__init__(inner)
        if refresh is not None and not callable(refresh):
            raise TypeError(
                f"refresh must be a callable taking a parameter group, got {type(refresh).__name__}"
            )
        self.precision_aware = bool(precision_aware)
        self.refresh = refresh
        self._cast_buffers = _CastBuffers()

    # ----------------------------------------------------------------------------------
    def _step(self, closure: Callable[[], Any] | None) -> Any:
        params = list(iter_params(self.inner))
        if self.precision_aware:
            loss = self._inner_step(closure)
        else:
            with _grads_in_data_dtype(params, self._cast_buffers) as casting:
                loss = self._inner_step(None if closure is None else casting(closure))
        # Not reached when the step raised: a refresh may be collective (Megatron-FSDP
        # redistributes compute weights), and other ranks may not have failed.
        self.refresh_compute_weights()
        return loss

    def refresh_compute_weights(self) -> None:
        """Refreshes compute weights from the (updated) main weights, once per group.

        Called after every successful step; call it yourself after loading main weights
        (e.g. a model checkpoint into Megatron-FSDP's sharded parameters) or after a step
        that raised. Collective under Megatron-FSDP when compute and main weights are
        placed differently: call it on every rank.

        Examples:
            >>> import torch
            >>> from wrapped_optim.fsdp import FSDPAwareOptimizer
            >>> p = torch.nn.Parameter(torch.ones(1))
            >>> seen = []
            >>> opt = FSDPAwareOptimizer(torch.optim.SGD([p]), refresh=seen.append)
            >>> opt.refresh_compute_weights()
            >>> len(seen)
            1
        """
        fsdp_groups: dict[int, Any] = {}
        other_groups: list[dict[str, Any]] = []
        for leaf in walk_leaves(self.inner):
            if leaf.optimizer is None:
                continue
            for group in leaf.optimizer.param_groups:
                owners = [fsdp_parameter_group_of(param) for param in group["params"]]
                for owner in owners:
                    if owner is not None:
                        fsdp_groups.setdefault(id(owner), owner)
                if None in owners:
                    other_groups.append(group)
        for owner in fsdp_groups.values():
            owner.sync_model_weight_from_main_weight()
        if self.refresh is not None:
            for group in other_groups:
                self.refresh(group)

    def release_cast_buffers(self) -> None:
        """Frees the kept cast buffers (the next step allocates them again).

        Examples:
            >>> import torch
            >>> from wrapped_optim.fsdp import FSDPAwareOptimizer
            >>> opt = FSDPAwareOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]))
            >>> opt.release_cast_buffers()
            >>> opt.cast_buffer_bytes
            0
        """
        self._cast_buffers.clear()

    @property
    def cast_buffer_bytes(self) -> int:
        """Rank-local bytes held by the kept cast buffers.

        Examples:
            >>> import torch
            >>> from wrapped_optim.fsdp import FSDPAwareOptimizer
            >>> p = torch.nn.Parameter(torch.ones(4))
            >>> p.grad_dtype = torch.bfloat16
            >>> p.grad = torch.ones(4, dtype=torch.bfloat16)
            >>> opt = FSDPAwareOptimizer(torch.optim.SGD([p]))
            >>> opt.step()
            >>> opt.cast_buffer_bytes
            16
        """
        return self._cast_buffers.nbytes()

    # ----------------------------------------------------------------------------------
    def _extra_repr(self) -> str:
        refresh = getattr(self.refresh, "__qualname__", repr(self.refresh))
        return f"precision_aware={self.precision_aware}, refresh={refresh}"

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_cast_buffers"]  # set in __init__ and __setstate__: always there
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._cast_buffers = _CastBuffers()


# --------------------------------------------------------------------------------------
# init_optimizer_state
# --------------------------------------------------------------------------------------
def _keep_step_counter(group: dict[str, Any], key: str) -> None:
    """What a successful initialising step may leave in a group: its step counter."""
    if key == "step":
        # A group-level step counter the step created (TE FusedAdam, PrecisionAwareAdamW):
        # keep it, at 0 — what an untouched optimizer counts from — so that a DCP load,
        # which only fills keys its template has, restores the saved count.
        _zero_counter(group, key)
    else:
        del group[key]


def _zero_hyperparameters(group: dict[str, Any]) -> None:
    for key in _ZEROED_HYPERPARAMETERS:
        value = group.get(key)
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.zero_()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            group[key] = type(value)(0)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # An empty tensor views as an empty byte string too.
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _zero_counter(mapping: MutableMapping[Any, Any], key: str) -> None:
    value = mapping.get(key)
    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.zero_()  # in place: keeps its dtype, device and identity
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        mapping[key] = type(value)(0)


def _reset_step_counters(leaf: torch.optim.Optimizer) -> None:
    for state in leaf.state.values():
        if isinstance(state, MutableMapping) and "step" in state:
            _zero_counter(state, "step")


def _stack_is_precision_aware(optimizer: Any) -> bool:
    layer = find_layer(optimizer, FSDPAwareOptimizer)
    return layer is not None and layer.precision_aware


def _init_leaf(leaf: torch.optim.Optimizer, precision_aware: bool, *, every_param: bool) -> None:
    params = [
        param
        for group in leaf.param_groups
        for param in group["params"]
        if every_param or param.requires_grad
    ]
    locals_before = [local_tensor(param).detach().clone() for param in params]
    saved_grads = [(param, param.grad, grad_dtype_attr(param)) for param in params]
    options = GroupOptions.take(leaf.param_groups)
    succeeded = False
    try:
        for param in params:
            zero = torch.zeros_like(param, dtype=grad_dtype_of(param))
            swap_grad(param, zero, grad_dtype_attr(param))
        for group in leaf.param_groups:
            _zero_hyperparameters(group)
        if precision_aware:
            leaf.step()
        else:
            with _grads_in_data_dtype(params, _CastBuffers()):
                leaf.step()
        succeeded = True
    finally:
        # After a failed step the state is dropped, so no counter is kept either.
        options.restore(leaf.param_groups, new_key=_keep_step_counter if succeeded else None)
        with torch.no_grad():
            for param, before in zip(params, locals_before, strict=True):
                now = local_tensor(param)
                if not _bytes_equal(now, before):
                    now.copy_(before)
        _restore_grads(saved_grads)
        if not succeeded:
            leaf.state.clear()
    _reset_step_counters(leaf)
    _hide_placeholders_from_first_step(leaf)


def _write_count(tensor: torch.Tensor) -> tuple[int, int]:
    # Version counters of the tensor and its rank-local storage (a DTensor's shard is written
    # in place by a DCP load): any in-place write bumps one of them.
    return tensor._version, local_tensor(tensor)._version


def _hide_placeholders_from_first_step(leaf: torch.optim.Optimizer) -> None:
    """Makes the leaf's first real step ignore the state entries it would adopt from the grad.

    The entries stay in ``leaf.state`` (a checkpoint load needs them as targets). A step
    pre-hook removes, just before the first step, every such entry that is still the very
    tensor created here and has not been written since; the step then creates it from the grad
    as on an untouched optimizer. Anything loaded (new tensors, or in-place writes as DCP
    does) is kept.
    """
    keys = tuple(
        key for cls, names in _ADOPTED_ON_FIRST_STEP if isinstance(leaf, cls) for key in names
    )
    marks: list[tuple[torch.Tensor, str, weakref.ref[torch.Tensor], tuple[int, int]]] = []
    for param, state in leaf.state.items():
        for key in keys:
            value = state.get(key) if isinstance(state, MutableMapping) else None
            if isinstance(value, torch.Tensor):
                marks.append((param, key, weakref.ref(value), _write_count(value)))
    if not marks:
        return

    def drop_untouched_placeholders(optimizer: Any, args: Any, kwargs: Any) -> None:
        # One-shot. Removing a hook while torch iterates its hooks is an error, so this one
        # stays registered but holds nothing after its first call.
        for param, key, placeholder, count in marks:
            state = optimizer.state.get(param)
            value = placeholder()
            if (
                value is None
                or not isinstance(state, MutableMapping)
                or state.get(key) is not value
            ):
                continue  # replaced, e.g. by load_state_dict
            if _write_count(state[key]) != count:
                continue  # loaded into in place, e.g. by a DCP load
            del state[key]
            if not state:
                del optimizer.state[param]
        marks.clear()

    leaf.register_step_pre_hook(drop_untouched_placeholders)


def init_optimizer_state(optimizer: Any) -> bool:
    """Creates the optimizer state a checkpoint load fills, without changing anything else.

    ``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` loads into existing state
    tensors. This steps every leaf optimizer of the stack that has no state yet once, with
    zero grads in each parameter's grad dtype and ``lr`` and ``weight_decay`` at 0, then
    restores the weights bit for bit, the grads, the parameter groups and the step counters.
    State a first step would adopt from the grad (SGD's ``momentum_buffer``) stays a zero
    load target that the first real step ignores unless a load wrote into it. If the step
    raises, everything is restored. See [init_optimizer_state](../fsdp.md#init_optimizer_state).

    Args:
        optimizer: Any optimizer or wrapper stack, including Megatron optimizers.

    Returns:
        ``True`` when state was created; ``False`` (having done nothing) when every leaf
        already had state.

    Examples:
        >>> import torch
        >>> from wrapped_optim.fsdp import init_optimizer_state
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> opt = torch.optim.AdamW([p], lr=torch.tensor(0.1))
        >>> init_optimizer_state(opt)
        True
        >>> sorted(opt.state[p]), opt.state[p]["step"].item(), p.grad, p.data
        (['exp_avg', 'exp_avg_sq', 'step'], 0.0, None, tensor([1., 1.]))
        >>> init_optimizer_state(opt)
        False
        >>> q = torch.nn.Parameter(torch.ones(1))
        >>> sgd = torch.optim.SGD([q], lr=0.1, momentum=0.9, dampening=0.5)
        >>> init_optimizer_state(sgd), sgd.state[q]["momentum_buffer"]
        (True, tensor([0.]))
        >>> q.grad = torch.ones(1)
        >>> sgd.step()  # adopts the grad as torch's first step does: buf = grad
        >>> sgd.state[q]["momentum_buffer"], q.data
        (tensor([1.]), tensor([0.9000]))
    """
    precision_aware = _stack_is_precision_aware(optimizer)
    created = False
    for leaf in walk_leaves(optimizer):
        if leaf.optimizer is None or leaf.is_stub or leaf.optimizer.state:
            continue
        # A Megatron optimizer's leaf steps main params (detached FP32 shards or copies):
        # their requires_grad is not the model's, and the container gives every one a grad.
        _init_leaf(leaf.optimizer, precision_aware, every_param=leaf.container is not None)
        created = created or bool(leaf.optimizer.state)
    return created
