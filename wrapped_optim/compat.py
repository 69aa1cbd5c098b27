"""Megatron-Bridge's and Megatron-FSDP's own entry points, on wrapped_optim's machinery:
code written against them switches by changing an import. Which release each follows, and what
differs, is in the docs' Configuration page ("compat").
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim.patching import patch_attribute
from wrapped_optim.wrapper import unwrap

__all__ = [
    "fully_shard_optimizer",
    "hybrid_optimizer_state_loading",
    "init_optimizer_state",
    "memory_efficient_fp32_optimizer_state_loading",
    "memory_efficient_precision_aware_optimizer_state_checkpointing",
    "sync_hybrid_device_optimizer_fp32_master_copies",
]


class _Chain:
    """The children of a chain that the walk understands, as a chain of their own."""

    def __init__(self, children: list[Any]) -> None:
        self.chained_optimizers = children


def _understood(optimizer: Any) -> Any:
    """``optimizer`` as far as these helpers handle it; ``None`` when not at all.

    Upstream's helpers leave alone what they do not recognise (Bridge specifies its sync as
    doing nothing and answering False there), so an unknown object, or an unknown child of a
    ChainedOptimizer, is left out instead of raising.
    """
    if optimizer is None:
        return None
    try:
        for _ in walk_leaves(optimizer):
            pass
    except TypeError:
        children = getattr(unwrap(optimizer), "chained_optimizers", None)
        if not isinstance(children, (list, tuple)):
            return None
        kept = [child for child in map(_understood, children) if child is not None]
        return _Chain(kept) if kept else None
    return optimizer


@contextmanager
def memory_efficient_precision_aware_optimizer_state_checkpointing(
    optimizer: Any, *, enabled: bool, chunk_bytes: int = 64 << 20
) -> Iterator[int]:
    """Save staging: expanded precision-aware state goes to the host as it is read.

    Follows the newer Bridge specification (not in Megatron-Bridge 0.6.2). Wrap
    ``state_dict()``, ``sharded_state_dict(...)`` or ``load_state_dict(...)`` in it; every
    holder is restored on exit, also when the block raises.

    Args:
        optimizer: The optimizer or stack (``None``, or what it does not recognise, does
            nothing).
        enabled: Whether to stage at all (Bridge's config switch).
        chunk_bytes: Device bytes one chunk of FP32 expansion may take.

    Yields:
        The number of precision-aware holders staged (0 when nothing qualifies).

    Raises:
        TypeError: a holder's ``get_unscaled_state`` returns a non-tensor.
        RuntimeError: a holder has no callable state accessor.

    The wrapper around ``get_unscaled_state`` passes any call signature through (TE's has
    changed across releases); only a plain ``(param, state_name)`` call reads by chunk.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with memory_efficient_precision_aware_optimizer_state_checkpointing(
        ...         sgd, enabled=True) as staged:
        ...     staged
        0
    """
    optimizer = _understood(optimizer) if enabled else None
    if optimizer is None:
        yield 0
        return
    from wrapped_optim._staging.engine import staged_save

    with staged_save(optimizer, chunk_bytes=chunk_bytes) as stats:
        yield stats.staged_holders


@contextmanager
def memory_efficient_fp32_optimizer_state_loading(optimizer: Any) -> Iterator[int]:
    """Megatron-Bridge 0.6.2's FP32 no-copy load: distributed FP32 Adams adopt loaded tensors.

    Inside the block, an eligible optimizer (a distributed optimizer's precision-aware holder leaf
    with FP32 moments and params, not precision-aware, offloaded or Megatron-FSDP) loads a
    state of exactly FP32 ``exp_avg``/``exp_avg_sq`` with torch's base loader, without a
    copy. The block also carries the repairs megatron-core's checkpoint loaders need for an
    exact resume. Everything is restored on exit, also on error.

    Args:
        optimizer: The optimizer or stack (``None``, or what it does not recognise, does
            nothing).

    Yields:
        The number of eligible optimizers.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with memory_efficient_fp32_optimizer_state_loading(sgd) as patched:
        ...     patched
        0
    """
    optimizer = _understood(optimizer)
    if optimizer is None:
        yield 0
        return
    from wrapped_optim._adapters.megatron_checkpoint import megatron_load_repairs
    from wrapped_optim._staging.engine import fp32_no_copy_load, no_copy_decisions

    eligible = sum(1 for decision in no_copy_decisions(optimizer) if decision.eligible)
    with megatron_load_repairs(optimizer), fp32_no_copy_load(optimizer):
        yield eligible


@contextmanager
def hybrid_optimizer_state_loading(optimizer: Any) -> Iterator[int]:
    """Hybrid state loading: payloads may omit per-parameter ``step``/``master_param``.

    Follows the newer Bridge specification (not in Megatron-Bridge 0.6.2). Inside the block,
    hybrid offload optimizers load checkpoints that keep Adam's step in the group metadata
    only or drop the ``master_param`` alias; everything is restored on exit, also on error.
    After a block that did not raise, the loaded masters are pushed to every copy level and
    the model weights.

    Args:
        optimizer: The optimizer or stack (``None``, or what it does not recognise, does
            nothing).

    Yields:
        The number of optimizers prepared.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with hybrid_optimizer_state_loading(sgd) as prepared:
        ...     prepared
        0
    """
    optimizer = _understood(optimizer)
    if optimizer is None:
        yield 0
        return
    from wrapped_optim._adapters.hybrid import (
        hybrid_master_copies,
        is_hybrid_offload,
        push_state_to_sub_optimizers,
        restore_omitted_state,
    )
    from wrapped_optim._adapters.megatron_checkpoint import megatron_load_repairs, sharded_loaders

    with ExitStack() as scopes:
        scopes.enter_context(megatron_load_repairs(optimizer))
        prepared = len(
            {
                id(leaf.container)
                for leaf in sharded_loaders(optimizer)
                if is_hybrid_offload(leaf.optimizer)
            }
        )
        seen: set[int] = set()
        for leaf in walk_leaves(optimizer):
            hybrid = leaf.optimizer
            if leaf.is_stub or not is_hybrid_offload(hybrid) or id(hybrid) in seen:
                continue
            seen.add(id(hybrid))
            if leaf.container is not None and hasattr(
                leaf.container, "_set_main_param_and_optimizer_states"
            ):
                continue  # prepared by megatron_load_repairs
            original = hybrid.load_state_dict

            def load_state_dict(state_dict: Any, _original: Any = original) -> Any:
                return _original(restore_omitted_state(state_dict))

            scopes.enter_context(patch_attribute(hybrid, "load_state_dict", load_state_dict))
            prepared += 1
        yield prepared
    if prepared:
        # The restored masters reach the host clones, sub-optimizers and weights, as the
        # hybrid layer does after a load: Megatron's loaders write only the optimizer's own
        # state, and the next step would otherwise run on the pre-load copies.
        push_state_to_sub_optimizers(optimizer)
        for entry in hybrid_master_copies(optimizer):
            entry.push_master()


def sync_hybrid_device_optimizer_fp32_master_copies(optimizer: Any) -> bool:
    """Bridge's post-load sync of every FP32 master level, for both kinds of load.

    For each parameter of every hybrid offload optimizer: a master that disagrees with the
    model weight (a model-only load) is refreshed at every level from the weight; a master
    that agrees (a full resume) keeps its low bits and is pushed to every other level.
    Megatron-Bridge 0.6.2's helper of the same name refreshes from the weights always.

    Args:
        optimizer: The optimizer or stack (``None``, or what it does not recognise, does
            nothing).

    Returns:
        ``True`` when the stack has a hybrid offload optimizer (synced), else ``False``.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
        >>> with torch.no_grad():
        ...     _ = p.fill_(2.0)  # a model-only load
        >>> sync_hybrid_device_optimizer_fp32_master_copies(opt)
        True
        >>> opt.gpu_params_map_cpu_copy[p].tolist()
        [2.0, 2.0]
    """
    optimizer = _understood(optimizer)
    if optimizer is None:
        return False
    from wrapped_optim._adapters.hybrid import (
        find_hybrid_offload,
        hybrid_master_copies,
        push_state_to_sub_optimizers,
    )

    if not find_hybrid_offload(optimizer):
        return False
    entries = hybrid_master_copies(optimizer)
    kept = [entry for entry in entries if "master" not in entry.stale_levels()]
    if kept:
        push_state_to_sub_optimizers(optimizer)
    for entry in entries:
        if any(entry is other for other in kept):
            entry.push_master()
        else:
            entry.refresh_from_weight()
    _watch_steps(optimizer)
    return True


# Each hybrid optimizer synced through the function above -> the watch its step hooks use.
_WATCHES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _watch_steps(optimizer: Any) -> None:
    """From now on every step of each hybrid optimizer in ``optimizer`` first checks the
    weights written since its last step (version counters) against their masters and raises
    ``StaleMasterError`` on a disagreement; its own step's writes are recorded after it."""
    from wrapped_optim._adapters.hybrid import WeightWatch, leaf_master_copies

    for hybrid, entries in leaf_master_copies(optimizer):
        watch = _WATCHES.get(hybrid)
        if watch is None:
            watch = _WATCHES[hybrid] = WeightWatch()
            hybrid.register_step_pre_hook(functools.partial(_check_watch, watch))
            hybrid.register_step_post_hook(functools.partial(_refresh_watch, watch))
        watch.record(entries)


def _check_watch(watch: Any, *_: Any) -> None:
    from wrapped_optim.hybrid import _stale_master_error

    moved = watch.moved()
    if not moved:
        return
    stale = [entry for entry in moved if entry.stale_levels()]
    if stale:
        raise _stale_master_error(
            stale,
            "Call sync_hybrid_device_optimizer_fp32_master_copies(optimizer) after changing "
            "the weights (it refreshes every master level from them)",
        )
    watch.refresh()


def _refresh_watch(watch: Any, *_: Any) -> None:
    watch.refresh()


def fully_shard_optimizer(optimizer: Any, *, precision_aware: bool = False) -> Any:
    """Megatron-FSDP 0.6.1's optimizer adapter: adapts the instance it is given, in place.

    As upstream does, it registers step hooks on the instance (torch's
    ``register_step_pre_hook``/``register_step_post_hook``): before each step, grads whose dtype
    differs from their parameter's are cast (unless ``precision_aware``); after it, the
    original grads are put back and the compute weights refreshed. A step that raises skips
    the post-hook; the next ``step()`` puts the original grads back first. Closures are
    refused, as upstream refuses them (their grads are made inside the step, out of a hook's
    reach). Called again, it only sets ``precision_aware``; a stack that has the
    ``FSDPAwareOptimizer`` layer already gets that layer's flag set. Use
    ``FSDPAwareOptimizer`` itself for a decorating wrapper (closures included).

    Args:
        optimizer: The optimizer or stack to adapt.
        precision_aware: The optimizer reads grads in another dtype than the weights itself.

    Returns:
        ``optimizer`` itself (Megatron-FSDP's returns nothing; its callers ignore the value).

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> opt = torch.optim.SGD([p], lr=0.5)
        >>> _ = fully_shard_optimizer(opt)
        >>> (p * 2).sum().backward()
        >>> opt.step()
        >>> p.tolist()
        [0.0, 0.0]
    """
    from wrapped_optim._fsdp_in_place import adapt_in_place

    adapt_in_place(optimizer, precision_aware=bool(precision_aware))
    return optimizer


def init_optimizer_state(optimizer: Any) -> bool:
    """Creates the state a DCP load fills, without touching weights, grads or hyper-parameters.

    This project's own (neither Bridge nor Megatron-FSDP has it); the same as
    ``wrapped_optim.init_optimizer_state``.

    Args:
        optimizer: Any optimizer or wrapper stack.

    Returns:
        ``True`` when it created state; ``False`` when every leaf already had state, or
        for ``None`` or anything it does not recognise.

    Examples:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> init_optimizer_state(opt), sorted(opt.state_dict()["state"][0])
        (True, ['exp_avg', 'exp_avg_sq', 'step'])
    """
    from wrapped_optim.fsdp import init_optimizer_state as initialise

    optimizer = _understood(optimizer)
    return False if optimizer is None else initialise(optimizer)
