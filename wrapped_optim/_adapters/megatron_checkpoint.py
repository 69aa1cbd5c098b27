"""Scoped repairs for megatron-core's distributed checkpoint loaders, each installed through
``patch_attribute`` for one load call and only while a probe shows Core's defect; the defects
are listed in docs/guides/megatron_bridge.md and at each repair below.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from types import SimpleNamespace
from typing import Any, cast

import torch

from wrapped_optim._adapters.hybrid import is_megatron_hdo
from wrapped_optim._adapters.megatron import unshare_steps
from wrapped_optim._adapters.megatron_precision import precision_setter_repairs
from wrapped_optim._adapters.walk import LeafContext, walk_leaves
from wrapped_optim._formats.pickled_classes import optimizer_classes_named_in
from wrapped_optim.patching import patch_attribute

__all__ = [
    "allow_optimizer_classes_in_next_common_read",
    "create_missing_state",
    "end_common_read",
    "megatron_load_repairs",
    "megatron_sharded_state_dict",
    "sharded_loaders",
]

_LOG = logging.getLogger(__name__)
_SETTER = "_set_main_param_and_optimizer_states"
_GETTER = "_get_main_param_and_optimizer_states"
_FP32_UPDATE = "_update_fp32_params_by_new_state"
_COMMON_FILE = "common.pt"  # Core's COMMON_STATE_FNAME (0.16.1, 0.19.2)


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


@functools.cache
def _scaffold_requests_master_alias(getter: Callable[..., Any] | None) -> bool:
    """Whether Core's parameter-state getter hands a HybridDeviceOptimizer's ``master_param``
    alias on next to ``param`` (0.16.1, 0.19.2), run on a stand-in: the dp_reshardable loading
    scaffold then requests ``master_param``, which a checkpoint saved without offload lacks."""
    if getter is None:
        return False
    param = torch.zeros(1)
    state = {"exp_avg": torch.zeros(1), "master_param": torch.zeros(1)}
    stand_in = SimpleNamespace(
        model_param_group_index_map={0: (0, 0)},
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False),
        optimizer=SimpleNamespace(param_groups=[{"params": [param]}], state={param: state}),
    )
    try:
        tensors = getter(stand_in, 0)
    except Exception:  # not shown to be fixed
        return True
    return "master_param" in tensors and "param" in tensors


class _ProbeOptimizer(torch.optim.SGD):
    """An optimizer class no allow-list holds, for :func:`_common_read_refuses_classes`."""


@functools.cache
def _common_read_refuses_classes(load_common: Callable[..., Any]) -> bool:
    """Whether Core's common-state loader refuses an optimizer class (0.16.1: it reads with
    torch's weights-only unpickler), run on a one-entry file in a temporary directory."""
    with tempfile.TemporaryDirectory() as directory:
        torch.save({"class": _ProbeOptimizer}, os.path.join(directory, _COMMON_FILE))
        try:
            loaded = load_common(SimpleNamespace(), directory)
        except pickle.UnpicklingError:
            return True
        except Exception:  # not shown to be fixed
            return True
    return loaded.get("class") is not _ProbeOptimizer


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


def _getter_without_alias(original: Callable[..., Any]) -> Callable[..., Any]:
    """Core's parameter-state getter without the ``master_param`` alias of ``param``.

    Defect: under a DistributedOptimizer a HybridDeviceOptimizer's state holds
    ``master_param``, which equals the main param (``param``); the dp_reshardable loading
    scaffold requests it, so a checkpoint saved without offload does not load
    (``KeyError: ...master_param from model not in state dict``). The setter repair takes it
    from ``param`` again.
    """

    def get_main_param_and_optimizer_states(model_param: Any) -> Any:
        tensors = original(model_param)
        if "param" in tensors:
            tensors.pop("master_param", None)
        return tensors

    return get_main_param_and_optimizer_states


def _common_loader() -> Any:
    """Core's registered common-state load strategy (one instance), when its weights-only read
    refuses optimizer classes; else ``None``."""
    try:
        from megatron.core.dist_checkpointing.strategies.base import (
            StrategyAction,
            get_default_strategy,
        )

        strategy = get_default_strategy(StrategyAction.LOAD_COMMON, "torch", 1)
    except Exception:  # no megatron-core, or a Core with another registry
        return None
    load_common = _function_of(strategy, "load_common")
    if load_common is None or not _common_read_refuses_classes(load_common):
        return None
    return strategy


def _optimizer_classes_named_in(checkpoint_dir: Any) -> list[Any]:
    """The optimizer classes the checkpoint's common state names that this process has
    imported already (nothing is imported; other globals stay refused)."""
    return optimizer_classes_named_in(os.path.join(str(checkpoint_dir), _COMMON_FILE))


class _CommonReadAllowance:
    """Core's common-state read, allowed the optimizer classes its file names, for as long as
    someone holds it: one instance patch of the registered strategy's ``load_common``.

    Defect: a HybridDeviceOptimizer keeps its sub-optimizer classes in its param groups; a
    fully_reshardable checkpoint stores them in its common state, which Core 0.16.1 reads with
    torch's weights-only unpickler (``UnpicklingError``). torch's allow-list holds them only
    during that read.

    Holders: a ``with held()`` block (the compat helpers around a whole load), or a wrapper
    whose loading scaffold waits for the read (:func:`allow_optimizer_classes_in_next_common_read`):
    the read, the wrapper's load or its next step releases it.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._blocks = 0
        self._armed: dict[int, weakref.finalize[Any, Any]] = {}
        self._patch: ExitStack | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._blocks += 1
            self._update()
        try:
            yield
        finally:
            with self._lock:
                self._blocks -= 1
                self._update()

    def arm(self, owner: Any) -> None:
        with self._lock:
            if id(owner) not in self._armed:
                self._armed[id(owner)] = weakref.finalize(owner, self.disarm, id(owner))
            self._update()

    def disarm(self, key: int) -> None:
        with self._lock:
            finalizer = self._armed.pop(key, None)
            if finalizer is not None:
                finalizer.detach()
            self._update()

    def _update(self) -> None:
        strategy = _common_loader() if self._blocks or self._armed else None
        if strategy is None and self._patch is not None:
            patch, self._patch = self._patch, None
            patch.close()
        elif strategy is not None and self._patch is None:
            patch = ExitStack()
            patch.enter_context(patch_attribute(strategy, "load_common", self._allowing(strategy)))
            self._patch = patch

    def _allowing(self, strategy: Any) -> Callable[..., Any]:
        original = strategy.load_common

        def load_common(checkpoint_dir: Any) -> Any:
            try:
                classes = _optimizer_classes_named_in(checkpoint_dir)
                with torch.serialization.safe_globals(list[Any](classes)):
                    return original(checkpoint_dir)
            finally:
                for key in list(self._armed):  # the read the scaffolds waited for
                    self.disarm(key)

        return load_common


_common_read_allowance = _CommonReadAllowance()


def megatron_sharded_state_dict(inner: Any) -> Callable[..., Any]:
    """The ``sharded_state_dict`` a wrapper passes Megatron's call on to: ``inner``'s own,
    or an ``AttributeError`` naming ``inner`` when it is no Megatron optimizer (the one guard
    every wrapper that defines ``sharded_state_dict`` shares).

    Example:
        >>> import torch
        >>> megatron_sharded_state_dict(torch.optim.SGD([torch.ones(1)], lr=1))
        Traceback (most recent call last):
        ...
        AttributeError: SGD has no sharded_state_dict (not a Megatron optimizer)
    """
    method = getattr(inner, "sharded_state_dict", None)
    if method is None:
        raise AttributeError(
            f"{type(inner).__name__} has no sharded_state_dict (not a Megatron optimizer)"
        )
    return cast("Callable[..., Any]", method)


def allow_optimizer_classes_in_next_common_read(owner: Any) -> None:
    """Core's next common-state read (the ``dist_checkpointing.load`` that follows ``owner``'s
    loading scaffold) may unpickle the optimizer classes its file names; only during that read.

    Released by the read, by :func:`end_common_read` (``owner``'s load or next step) or when
    ``owner`` is collected. Nothing happens when Core's read accepts the classes itself.

    Example:
        >>> import torch
        >>> owner = torch.optim.SGD([torch.ones(1)], lr=1)
        >>> allow_optimizer_classes_in_next_common_read(owner)
        >>> end_common_read(owner)
        >>> torch.optim.SGD in torch.serialization.get_safe_globals()
        False
    """
    _common_read_allowance.arm(owner)


def end_common_read(owner: Any) -> None:
    """Releases what :func:`allow_optimizer_classes_in_next_common_read` armed for ``owner``."""
    _common_read_allowance.disarm(id(owner))


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


def _hybrid_repairs(container: Any, hybrid: Any, patches: ExitStack) -> int:
    """The repairs for a HybridDeviceOptimizer under ``container``, entered into ``patches``;
    returns how many."""
    count = 0
    if _scaffold_requests_master_alias(_function_of(container, _GETTER)):
        original_getter = getattr(container, _GETTER)
        patches.enter_context(
            patch_attribute(container, _GETTER, _getter_without_alias(original_getter))
        )
        count += 1
    update = _function_of(hybrid, _FP32_UPDATE)
    if update is not None and _fp32_update_requires_every_param(update):
        patches.enter_context(patch_attribute(hybrid, _FP32_UPDATE, _tolerant_fp32_update(hybrid)))
        count += 1
    return count


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
            if is_megatron_hdo(leaf.optimizer):
                count += _hybrid_repairs(container, leaf.optimizer, patches)
        if seen and _common_loader() is not None:
            patches.enter_context(_common_read_allowance.held())
            count += 1
        yield count
    if seen:
        # DistributedOptimizer.load_state_dict (torch's Adam inside) writes ONE step tensor
        # into every parameter's state; torch's Adam would then count it once per parameter.
        unshare_steps(stack)
