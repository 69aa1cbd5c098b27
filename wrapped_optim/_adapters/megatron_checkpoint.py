"""Scoped repairs for megatron-core's distributed checkpoint loaders, each installed through
``patch_attribute`` for one load call and only while a probe shows Core's defect; the defects
are listed in docs/guides/megatron_bridge.md and at each repair below.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from wrapped_optim._adapters.hybrid import is_megatron_hdo
from wrapped_optim._adapters.megatron import unshare_steps
from wrapped_optim._adapters.megatron_precision import precision_setter_repairs
from wrapped_optim._adapters.walk import LeafContext, walk_leaves
from wrapped_optim.patching import patch_attribute

__all__ = [
    "allowed_optimizer_classes",
    "create_missing_state",
    "megatron_load_repairs",
    "sharded_loaders",
]

_LOG = logging.getLogger(__name__)
_SETTER = "_set_main_param_and_optimizer_states"
_FP32_UPDATE = "_update_fp32_params_by_new_state"


def sharded_loaders(stack: Any) -> list[LeafContext]:
    """The leaves of ``stack`` held by a Megatron DistributedOptimizer (not stubs).

    Example:
        >>> import torch
        >>> sharded_loaders(torch.optim.SGD([torch.ones(1)], lr=1))
        []
    """
    return [
        leaf
        for leaf in walk_leaves(stack)
        if not leaf.is_stub and callable(getattr(leaf.container, _SETTER, None))
    ]


# --------------------------------------------------------------------------------------
# Probes: does the installed Core still have the defect?
# --------------------------------------------------------------------------------------
@functools.cache
def _setter_reads_payload_step(setter: Callable[..., Any]) -> bool:
    """Whether Core's parameter-state setter takes a torch-Adam ``step`` from the payload.

    Runs the class's own function on a one-parameter stand-in: a ``KeyError`` for a payload
    without ``step`` (0.16.1, 0.19.2), or a step copied from it, is the defect.
    """
    param = torch.zeros(1)
    state = {"exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1), "step": torch.tensor(1.0)}
    stand_in = SimpleNamespace(
        model_param_group_index_map={0: (0, 0)},
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=SimpleNamespace(param_groups=[{"params": [param]}], state={param: state}),
    )
    payload = {"param": torch.ones(1), "exp_avg": torch.ones(1), "exp_avg_sq": torch.ones(1)}
    try:
        setter(stand_in, 0, payload)
        setter(stand_in, 0, {**payload, "step": torch.tensor(7.0)})
    except Exception:  # KeyError: the defect; anything else: not shown to be fixed
        return True
    return bool(state["step"].item() == 7.0)


@functools.cache
def _fp32_update_requires_every_param(update: Callable[..., Any]) -> bool:
    """Whether HybridDeviceOptimizer's post-load FP32 update fails on a param without an FP32
    working copy (0.16.1, 0.19.2), run on a stand-in."""
    stand_in = SimpleNamespace(
        param_update_in_fp32=True,
        state={torch.zeros(1): {"master_param": torch.ones(1)}},
        param_to_fp32_param={},
    )
    try:
        update(stand_in)
    except Exception:  # KeyError: the defect; anything else: not shown to be fixed
        return True
    return False


@functools.cache
def _scaffold_needs_state(state_dict: Callable[..., Any]) -> bool:
    """Whether Core's ``DistributedOptimizer.state_dict`` (the loading scaffold) fails for a
    torch Adam without state (0.16.1, 0.19.2: it asserts one step across the states; with TE
    or Apex installed it reads the group step and does not), run on a stand-in."""
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    stand_in = SimpleNamespace(optimizer=adam, grad_scaler=None)
    try:
        state_dict(stand_in)
    except Exception:  # AssertionError: the defect; anything else: not shown to be fixed
        return True
    return False


def _function_of(obj: Any, name: str) -> Callable[..., Any] | None:
    """The function behind ``obj.<name>`` (the class's, unbound), for a probe."""
    function = getattr(type(obj), name, None)
    if function is None:
        function = getattr(getattr(obj, name, None), "__func__", None)
    return function


# --------------------------------------------------------------------------------------
# The repairs
# --------------------------------------------------------------------------------------
def _step_supplying_setter(container: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Core's setter, given the group step just loaded and the ``master_param`` alias.

    Defect: ``DistributedOptimizer._set_main_param_and_optimizer_states`` copies every state key
    from the payload: a per-parameter ``step`` (torch's Adam) that fully-reshardable, dp_zero
    and legacy payloads never carry (``KeyError: 'step'``) and that dp_reshardable payloads
    carry only as the scaffold's step (so it rewinds); and the ``master_param`` alias of a
    HybridDeviceOptimizer, which fully-reshardable payloads omit.

    ``DistributedOptimizer.load_state_dict`` writes the checkpoint's group step into every
    per-parameter state before the parameter-state loader runs; that is the value to keep.
    """

    def set_main_param_and_optimizer_states(model_param: Any, tensors: Any) -> Any:
        tensors = dict(tensors)
        group_index, group_order = container.model_param_group_index_map[model_param]
        inner = container.optimizer
        target_param = inner.param_groups[group_index]["params"][group_order]
        target = inner.state.get(target_param) or {}
        if "master_param" in target and "master_param" not in tensors and "param" in tensors:
            tensors["master_param"] = tensors["param"]
        if isinstance(target.get("step"), torch.Tensor):
            tensors["step"] = target["step"].detach().clone()
        return original(model_param, tensors)

    return set_main_param_and_optimizer_states


def _tolerant_fp32_update(hdo: Any) -> Callable[[], None]:
    """HybridDeviceOptimizer's post-load FP32 update, skipping params without an FP32 copy
    (their restored master reaches their copies through the master push after the load).

    Defect: ``_update_fp32_params_by_new_state`` looks FP32 params up in
    ``param_to_fp32_param``, which holds only 16-bit ones (``KeyError: <tensor>`` under a
    DistributedOptimizer, whose main params are FP32).
    """

    def update_fp32_params_by_new_state() -> None:
        if not hdo.param_update_in_fp32:
            return
        for param, value in hdo.state.items():
            fp32_param = hdo.param_to_fp32_param.get(param)
            if fp32_param is not None and isinstance(value.get("master_param"), torch.Tensor):
                fp32_param.data.copy_(value["master_param"])

    return update_fp32_params_by_new_state


def _scaffold_with_state(container: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Core's ``sharded_state_dict`` that, for a load, first gives a stateless leaf its state.

    Defect: ``DistributedOptimizer.state_dict`` asserts one ``step`` across the states (torch's
    Adam inside, TE and Apex absent), so a fresh optimizer cannot build its loading scaffold;
    Core creates state only for Megatron-FSDP.
    """

    def sharded_state_dict(*args: Any, **kwargs: Any) -> Any:
        is_loading = kwargs.get("is_loading", args[1] if len(args) > 1 else False)
        if is_loading:
            create_missing_state(container)
        return original(*args, **kwargs)

    return sharded_state_dict


def create_missing_state(container: Any) -> bool:
    """Creates the state of a DistributedOptimizer's leaf that has none; ``True`` if it did.

    What Core's loading scaffold needs (0.16.1 and 0.19.2 create it only for Megatron-FSDP):
    :func:`wrapped_optim.fsdp.init_optimizer_state`, which leaves weights, masters, grads and
    hyper-parameters as they were.

    Example:
        >>> import torch
        >>> create_missing_state(torch.optim.SGD([torch.ones(1)], lr=1))
        False
    """
    from wrapped_optim.fsdp import init_optimizer_state

    leaf = getattr(container, "optimizer", None)
    if not isinstance(leaf, torch.optim.Optimizer) or len(leaf.state) > 0:
        return False
    if not any(p.numel() for group in leaf.param_groups for p in group["params"]):
        return False
    return init_optimizer_state(container)


def allowed_optimizer_classes(stack: Any) -> list[Callable[..., Any]]:
    """Optimizer classes in the param groups of ``stack``'s hybrid optimizers that torch's
    weights-only unpickler does not allow yet (what a fully-reshardable load needs allowed).

    Defect: fully-reshardable checkpoints write those classes to the common state, and Core's
    weights-only load of it refuses them (``UnpicklingError``).

    Example:
        >>> import torch
        >>> allowed_optimizer_classes(torch.optim.SGD([torch.ones(1)], lr=1))
        []
    """
    allowed = {id(entry) for entry in torch.serialization.get_safe_globals()}
    found: dict[int, Callable[..., Any]] = {}
    for leaf in walk_leaves(stack):
        hybrid = leaf.optimizer
        if leaf.is_stub or not is_megatron_hdo(hybrid):
            continue
        groups: list[Mapping[str, Any]] = [*hybrid.param_groups, hybrid.defaults]
        for group in groups:
            for value in group.values():
                if isinstance(value, type) and id(value) not in allowed:
                    found[id(value)] = value
    return list(found.values())


@contextmanager
def megatron_load_repairs(stack: Any) -> Iterator[int]:
    """Every repair this Core needs for one load, active for the block; yields how many.

    Covers Megatron's whole load sequence when wrapped around it (what compat's loading
    contexts do), or one call of it (what the wrappers do around ``sharded_state_dict(...,
    is_loading=True)`` and ``load_state_dict``). Instances are restored exactly on exit, also
    when the block raises.

    Example:
        >>> import torch
        >>> with megatron_load_repairs(torch.optim.SGD([torch.ones(1)], lr=1)) as repairs:
        ...     repairs
        0
    """
    with ExitStack() as patches:
        count = 0
        seen: set[int] = set()
        for leaf in sharded_loaders(stack):
            container = leaf.container
            if id(container) in seen:
                continue
            seen.add(id(container))
            original_scaffold = getattr(container, "sharded_state_dict", None)
            if callable(original_scaffold) and _scaffold_needs_state(
                _function_of(container, "state_dict")
            ):
                patches.enter_context(
                    patch_attribute(
                        container,
                        "sharded_state_dict",
                        _scaffold_with_state(container, original_scaffold),
                    )
                )
                count += 1
            if _setter_reads_payload_step(_function_of(container, _SETTER)):
                original = getattr(container, _SETTER)
                patches.enter_context(
                    patch_attribute(container, _SETTER, _step_supplying_setter(container, original))
                )
                count += 1
            names, precision_setter = precision_setter_repairs(container)  # outermost
            if precision_setter is not None:
                patches.enter_context(patch_attribute(container, _SETTER, precision_setter))
                _LOG.info("megatron load repairs: %s", "; ".join(names))
                count += len(names)
            hybrid = leaf.optimizer
            update = _function_of(hybrid, _FP32_UPDATE)
            if (
                is_megatron_hdo(hybrid)
                and update is not None
                and _fp32_update_requires_every_param(update)
            ):
                patches.enter_context(
                    patch_attribute(hybrid, _FP32_UPDATE, _tolerant_fp32_update(hybrid))
                )
                count += 1
        classes = allowed_optimizer_classes(stack)
        if classes:
            patches.enter_context(torch.serialization.safe_globals(list[Any](classes)))
            count += 1
        yield count
    if seen:
        # DistributedOptimizer.load_state_dict (torch's Adam inside) writes ONE step tensor
        # into every parameter's state; torch's Adam would then count it once per parameter.
        unshare_steps(stack)
