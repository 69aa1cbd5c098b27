"""The base class of every wrapper, and the walk down a stack of them.

A wrapper stays a ``torch.optim.Optimizer`` so that schedulers, checkpointers and training
loops accept it unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks

__all__ = ["OptimizerWrapper"]

T = TypeVar("T")

# Instance attributes that belong to the wrapper itself and are never forwarded to the inner
# optimizer, even when assigned (torch's Optimizer and its LR schedulers set several of these).
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class OptimizerWrapper(torch.optim.Optimizer):
    """Decorates an optimizer while remaining one.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's own objects, and
    any attribute the wrapper does not define is read from the inner optimizer, so Megatron's
    optimizer API works through a whole stack. Hooks registered on a wrapper fire around the
    whole stack below it. Subclasses override ``_step``, ``_state_dict``,
    ``_load_state_dict`` and ``_extra_repr``; see [Concepts](../concepts.md#the-stack).

    Args:
        inner: The optimizer to decorate: a torch optimizer, a Megatron optimizer or another
            wrapper.

    Raises:
        TypeError: ``inner`` is ``None`` or has no ``step`` and ``state_dict``.
        ValueError: one of this package's layers is already in ``inner``'s stack.

    Examples:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = OptimizerWrapper(torch.optim.SGD([p], lr=0.1))
        >>> p.grad = torch.ones(2)
        >>> opt.step()
        >>> p.data
        tensor([0.9000, 0.9000])
        >>> opt.param_groups is opt.inner.param_groups
        True
        >>> opt.unwrap() is opt.inner
        True
    """

    inner: Any

    def __init__(self, inner: Any) -> None:
        # Optimizer.__init__ is deliberately not called: it would build param_groups and state
        # of our own. Only the hook registries it would create are needed.
        if inner is None:
            raise TypeError(f"{type(self).__name__} needs an optimizer to wrap, got None")
        if not hasattr(inner, "step") or not hasattr(inner, "state_dict"):
            raise TypeError(
                f"{type(self).__name__} wraps optimizers (objects with step and state_dict); "
                f"got {type(inner).__name__}"
            )
        _refuse_a_second(type(self), inner)
        self.__dict__["inner"] = inner
        self._init_hook_registries()

    def _init_hook_registries(self) -> None:
        for name in _HOOK_DICTS:
            self.__dict__[name] = OrderedDict()

    # ----------------------------------------------------------------------------------
    # Forwarded state
    # ----------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups (the same list object)."""
        return cast(list[dict[str, Any]], self.inner.param_groups)

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        """The inner optimizer's per-parameter state (the same mapping object)."""
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The inner optimizer's defaults; Megatron optimizers have none (AttributeError)."""
        return cast(dict[str, Any], self.inner.defaults)

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    # torch's GradScaler steps an optimizer that unscales in its own fused kernel
    # (``_step_supports_amp_scaling``, read through to the leaf) by setting ``grad_scale`` and
    # ``found_inf`` on the object it steps, then deleting them; the leaf reads them from
    # itself. Kept on a wrapper, they would never reach it: the leaf would step on scaled
    # grads and ignore infs. So reads, writes and deletions all go to the inner optimizer.
    @property
    def grad_scale(self) -> Any:
        """The GradScaler's scale for a fused leaf's step, kept on the inner optimizer."""
        return self.inner.grad_scale

    @grad_scale.setter
    def grad_scale(self, value: Any) -> None:
        self.inner.grad_scale = value

    @grad_scale.deleter
    def grad_scale(self) -> None:
        del self.inner.grad_scale

    @property
    def found_inf(self) -> Any:
        """The GradScaler's inf flag for a fused leaf's step, kept on the inner optimizer."""
        return self.inner.found_inf

    @found_inf.setter
    def found_inf(self, value: Any) -> None:
        self.inner.found_inf = value

    @found_inf.deleter
    def found_inf(self) -> None:
        del self.inner.found_inf

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails. Never forward dunders or lookups made before
        # ``inner`` exists (unpickling, copy), which would otherwise recurse.
        if name.startswith("__") or "inner" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")
        return getattr(self.__dict__["inner"], name)

    # ----------------------------------------------------------------------------------
    # The optimizer contract
    # ----------------------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs the wrapper's step, with the wrapper's own hooks around the whole stack below.

        Args:
            closure: Re-evaluates the model and returns the loss; passed down to the inner
                optimizer (Megatron optimizers take none).

        Returns:
            The loss the closure returned, or whatever the inner step returns.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = OptimizerWrapper(torch.optim.SGD([p], lr=0.5))
            >>> _ = opt.register_step_post_hook(lambda o, args, kwargs: print(type(o).__name__))
            >>> def closure():
            ...     opt.zero_grad()
            ...     loss = p.square().sum()
            ...     loss.backward()
            ...     return loss
            >>> opt.step(closure)
            OptimizerWrapper
            tensor(2., grad_fn=<SumBackward0>)
            >>> p.data
            tensor([0., 0.])
        """
        for pre_hook in self._optimizer_step_pre_hooks.values():
            result = pre_hook(self, (closure,) if closure is not None else (), {})
            if result is not None:
                # torch's contract: a pre-hook may return new (args, kwargs).
                args, kwargs = result
                closure = args[0] if args else kwargs.get("closure")
        loss = self._step(closure)
        for post_hook in self._optimizer_step_post_hooks.values():
            post_hook(self, (closure,) if closure is not None else (), {})
        return loss

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        return self._inner_step(closure)

    def _inner_step(self, closure: Callable[[], Any] | None) -> Any:
        # Megatron optimizers' step() takes no closure.
        if closure is None:
            return self.inner.step()
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients, through the inner optimizer (which alone knows its grad buffers).

        Args:
            set_to_none: Set the gradients to ``None`` instead of zero.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = OptimizerWrapper(torch.optim.SGD([p], lr=0.1))
            >>> p.grad = torch.ones(2)
            >>> opt.zero_grad()
            >>> p.grad is None
            True
        """
        self.inner.zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group to the inner optimizer, with the inner optimizer's defaults.

        Args:
            param_group: The group: ``{"params": [...], <option>: <value>, ...}``.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1, momentum=0.9)
            >>> opt = OptimizerWrapper(sgd)
            >>> opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))], "lr": 0.01})
            >>> len(sgd.param_groups), sgd.param_groups[1]["lr"], sgd.param_groups[1]["momentum"]
            (2, 0.01, 0.9)
        """
        self.inner.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """Returns the inner optimizer's state dict; wrappers add nothing to the format.

        A checkpoint therefore does not depend on which wrappers were stacked when it was
        written. Hooks registered on the wrapper run around the call.

        Returns:
            The state dict, in the bare optimizer's format.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
            >>> opt = OptimizerWrapper(sgd)
            >>> p.grad = torch.ones(2)
            >>> opt.step()
            >>> state = opt.state_dict()
            >>> sorted(state), state["param_groups"] == sgd.state_dict()["param_groups"]
            (['param_groups', 'state'], True)
            >>> state["state"][0]["momentum_buffer"]
            tensor([1., 1.])
        """
        return state_dict_with_hooks(self, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.inner.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict written by this stack, another stack or the bare optimizer.

        The format is the inner optimizer's own, so resuming works whatever wrappers were
        stacked at save time; hooks registered on the wrapper run around the whole load.

        Args:
            state_dict: A state dict in the bare optimizer's format.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> bare = torch.optim.SGD([p], lr=0.1, momentum=0.9)
            >>> p.grad = torch.ones(2)
            >>> bare.step()
            >>> opt = OptimizerWrapper(torch.optim.SGD([p], lr=0.5, momentum=0.9))
            >>> opt.load_state_dict(bare.state_dict())
            >>> opt.param_groups[0]["lr"], opt.inner.state[p]["momentum_buffer"].tolist()
            (0.1, [1.0, 1.0])
        """
        load_state_dict_with_hooks(self, state_dict, self._load_state_dict)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def sync_after_load(self) -> None:
        """Has every layer re-establish what it derives from the state, innermost first.

        ``load_state_dict`` does this itself (e.g. hybrid master copies pushed everywhere). A
        loader that writes state directly into the optimizer's tensors --
        ``wrapped_optim.checkpoint.load_optimizer``, or your own -- calls this afterwards
        so the layers do the same.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> opt = OptimizerWrapper(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
            >>> opt.sync_after_load()  # a plain wrapper has nothing to re-establish
        """
        if isinstance(self.inner, OptimizerWrapper):
            self.inner.sync_after_load()
        self._on_state_loaded()

    def _on_state_loaded(self) -> None:
        """What this layer re-establishes after its stack's state was loaded."""

    # ----------------------------------------------------------------------------------
    # Navigating the stack
    # ----------------------------------------------------------------------------------
    def layers(self) -> list[Any]:
        """Every layer of the stack, outermost (this wrapper) to innermost.

        ``wrapped_optim.layers`` does the same for any optimizer, wrapped or bare.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> stack = OptimizerWrapper(OptimizerWrapper(sgd))
            >>> [type(layer).__name__ for layer in stack.layers()]
            ['OptimizerWrapper', 'OptimizerWrapper', 'SGD']
        """
        return layers(self)

    def unwrap(self) -> Any:
        """The innermost optimizer: the first layer of the stack that is not a wrapper.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> OptimizerWrapper(OptimizerWrapper(sgd)).unwrap() is sgd
            True
        """
        return unwrap(self)

    def find_layer(self, cls: type[T]) -> T | None:
        """The outermost layer that is an instance of ``cls``, or ``None``.

        Examples:
            >>> import torch
            >>> from wrapped_optim import OptimizerWrapper
            >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
            >>> OptimizerWrapper(sgd).find_layer(torch.optim.SGD) is sgd
            True
            >>> OptimizerWrapper(sgd).find_layer(torch.optim.Adam) is None
            True
        """
        return find_layer(self, cls)

    # ----------------------------------------------------------------------------------
    # Presentation and serialisation
    # ----------------------------------------------------------------------------------
    def _extra_repr(self) -> str:
        """Options shown in the repr, e.g. ``"chunk_bytes=67108864"``."""
        return ""

    def __repr__(self) -> str:
        # One line per layer: this one, then the inner stack's lines indented under it.
        if isinstance(self.inner, OptimizerWrapper):
            first, *rest = repr(self.inner).split("\n")
        else:
            groups = getattr(self.inner, "param_groups", None)
            count = len(groups) if isinstance(groups, list) else "?"
            first, rest = f"{type(self.inner).__name__}(param_groups={count})", []
        own = f"{type(self).__name__}({self._extra_repr()})"
        return "\n".join([own, "└─ " + first, *("   " + line for line in rest)])

    def __getstate__(self) -> dict[str, Any]:
        # Hooks and an LR scheduler's instance-level ``step`` patch hold closures and weak
        # references; torch's Optimizer drops them when pickled too.
        state = dict(self.__dict__)
        for name in (*_HOOK_DICTS, "step", "_opt_called"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_hook_registries()


# --------------------------------------------------------------------------------------
# The one walk down a stack, for any optimizer, wrapped or bare
# --------------------------------------------------------------------------------------
def _stack_layers(optimizer: Any) -> Iterator[Any]:
    layer = optimizer
    while isinstance(layer, OptimizerWrapper):
        yield layer
        layer = layer.inner
    yield layer


def _refuse_a_second(cls: type, inner: Any) -> None:
    """Each of this package's layers (staged, hybrid sync, FSDP-aware) appears once per
    stack: a second one would stage, sync or cast the same optimizer twice. The pass-through
    base and users' own subclasses may repeat."""
    if cls is OptimizerWrapper or not cls.__module__.startswith("wrapped_optim."):
        return
    if any(type(layer) is cls for layer in _stack_layers(inner)):
        chain = " -> ".join(type(layer).__name__ for layer in _stack_layers(inner))
        raise ValueError(
            f"{cls.__name__} is already in this optimizer's stack ({chain}); wrap it once. "
            "wrapped_optim.wrap(optimizer, config) builds or updates a stack without "
            f"doubling a layer, and find_layer(optimizer, {cls.__name__}) returns the one "
            "there"
        )


def layers(optimizer: Any) -> list[Any]:
    """Lists the objects of an optimizer's stack, outermost to innermost.

    Args:
        optimizer: Any optimizer, wrapped or bare (a bare one is its own one-element stack).

    Returns:
        The wrappers, outermost first, then the innermost optimizer.

    Examples:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper, layers
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> layers(sgd) == [sgd]
        True
        >>> [type(layer).__name__ for layer in layers(OptimizerWrapper(sgd))]
        ['OptimizerWrapper', 'SGD']
    """
    return list(_stack_layers(optimizer))


def unwrap(optimizer: Any) -> Any:
    """Returns the innermost optimizer of a stack.

    Args:
        optimizer: Any optimizer, wrapped or bare.

    Returns:
        The first object below every wrapper (``optimizer`` itself when it is bare).

    Examples:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper, unwrap
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> unwrap(OptimizerWrapper(OptimizerWrapper(sgd))) is sgd, unwrap(sgd) is sgd
        (True, True)
    """
    layer = optimizer
    while isinstance(layer, OptimizerWrapper):
        layer = layer.inner
    return layer


def find_layer(optimizer: Any, cls: type[T]) -> T | None:
    """Finds the outermost layer of a stack that is an instance of a class.

    Args:
        optimizer: Any optimizer, wrapped or bare.
        cls: The class to look for (a wrapper or an optimizer class).

    Returns:
        The outermost layer that is a ``cls``, or ``None`` when there is none.

    Examples:
        >>> import torch
        >>> from wrapped_optim import StagedCheckpointOptimizer, find_layer, wrap
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> find_layer(wrap(sgd), StagedCheckpointOptimizer) is None  # wrap added nothing
        True
        >>> find_layer(sgd, torch.optim.SGD) is sgd
        True
        >>> staged = wrap(sgd, {"staged": True})
        >>> find_layer(staged, StagedCheckpointOptimizer) is staged
        True
    """
    for layer in _stack_layers(optimizer):
        if isinstance(layer, cls):
            return layer
    return None
