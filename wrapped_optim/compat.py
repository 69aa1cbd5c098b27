"""The seed systems' own entry points, on wrapped_optim's machinery.

Code written against Megatron-Bridge (``megatron.bridge.training.optim``) or Megatron-FSDP
(``megatron_fsdp.experimental``) switches by changing an import::

    # from megatron.bridge.training.optim import memory_efficient_fp32_optimizer_state_loading
    from wrapped_optim.compat import memory_efficient_fp32_optimizer_state_loading

Whose specification each function follows (the signatures match the release named;
``tests/test_bridge_parity.py`` pins them):

* Megatron-Bridge 0.6.2: ``memory_efficient_fp32_optimizer_state_loading``,
  ``sync_hybrid_device_optimizer_fp32_master_copies``;
* Megatron-FSDP 0.6.1: ``fully_shard_optimizer``;
* the newer Bridge specification, in no Bridge release up to 0.6.2:
  ``memory_efficient_precision_aware_optimizer_state_checkpointing``,
  ``hybrid_optimizer_state_loading``, and a post-load sync that keeps restored masters
  after a full resume (Bridge 0.6.2 calls the sync after every load and rebuilds them from
  the weights);
* this project's own: ``init_optimizer_state``.

Each function runs the engine the corresponding wrapper uses (the staging engine of
``StagedCheckpointOptimizer``, the master-copy adapter of
``HybridSyncOptimizer``, ``FSDPAwareOptimizer``)
and yields / returns what the reference does. Differences, all deliberate:

* eligibility is decided by structure (protocols, Megatron config flags) on every leaf of the
  stack, so the portable optimizers qualify as well as TE's FusedAdam, and wrapped stacks
  work;
* save staging reads compressed state chunk by chunk when the holder can (one chunk of
  expansion on the device instead of one whole tensor);
* ``fully_shard_optimizer`` *returns* a decorated optimizer instead of registering step
  hooks in place (use the result), so a failing step still restores the grads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim.patching import patch_attribute

__all__ = [
    "fully_shard_optimizer",
    "hybrid_optimizer_state_loading",
    "init_optimizer_state",
    "memory_efficient_fp32_optimizer_state_loading",
    "memory_efficient_precision_aware_optimizer_state_checkpointing",
    "sync_hybrid_device_optimizer_fp32_master_copies",
]


@contextmanager
def memory_efficient_precision_aware_optimizer_state_checkpointing(
    optimizer: Any, *, enabled: bool, chunk_bytes: int = 64 << 20
) -> Iterator[int]:
    """Save staging: expanded precision-aware state goes to the host as it is read.

    Follows the newer Bridge specification; not in Megatron-Bridge 0.6.2.

    Wrap ``state_dict()`` / ``sharded_state_dict(...)`` / ``load_state_dict(...)`` in it.
    Yields the number of precision-aware holders staged (0 when ``enabled`` is false, the
    optimizer is ``None`` or nothing qualifies); every holder is restored on exit, also when
    the block raises. A holder whose ``get_unscaled_state`` returns a non-tensor raises
    ``TypeError``; one without a callable accessor ``RuntimeError``.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with memory_efficient_precision_aware_optimizer_state_checkpointing(
        ...         sgd, enabled=True) as staged:
        ...     staged
        0
    """
    if not enabled or optimizer is None:
        yield 0
        return
    from wrapped_optim._staging.engine import staged_save

    with staged_save(optimizer, chunk_bytes=chunk_bytes) as stats:
        yield stats.staged_holders


@contextmanager
def memory_efficient_fp32_optimizer_state_loading(optimizer: Any) -> Iterator[int]:
    """Megatron-Bridge 0.6.2's FP32 no-copy load: distributed FP32 Adams adopt the loader's tensors.

    Yields the number of eligible optimizers (a distributed optimizer's standard FusedAdam-like
    leaf with FP32 moments and params, not precision-aware, not offloaded, not Megatron-FSDP).
    Inside the block their ``load_state_dict`` takes torch's base loader for a state holding
    exactly FP32 ``exp_avg``/``exp_avg_sq``; anything else goes to their own loader. Restored
    on exit (also on error), after which the CUDA allocator cache is released if anything was
    adopted.

    Bridge wraps its whole checkpoint load in this context, so the block also carries the
    repairs megatron-core's distributed checkpoint loaders need for an exact resume
    (``wrapped_optim._adapters.megatron_checkpoint.megatron_load_repairs``: loading
    scaffold of a fresh optimizer, per-parameter steps, HybridDeviceOptimizer's FP32 update,
    its optimizer classes for the weights-only read).

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with memory_efficient_fp32_optimizer_state_loading(sgd) as patched:
        ...     patched
        0
    """
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

    Follows the newer Bridge specification; not in Megatron-Bridge 0.6.2 (whose loads leave
    the hybrid optimizer's copies as they were and then rebuild every master from the model's
    weights, see ``sync_hybrid_device_optimizer_fp32_master_copies``).

    Inside the block, hybrid offload optimizers load checkpoints that keep Adam's step in the
    group metadata only, or drop the ``master_param`` alias (fully reshardable payloads):
    Megatron DistributedOptimizers around one supply the saved group step and the checkpoint's
    FP32 param to their per-parameter loader; a hybrid optimizer loaded directly gets the
    entries put back into (a copy of) the torch-format state dict. Yields the number of
    optimizers prepared; everything is restored on exit, also on error. After a block that did
    not raise, the loaded masters are pushed to every copy level and the model weights, so
    the next step continues from them. ``sync_hybrid_device_optimizer_fp32_master_copies``
    after it (Bridge's order) keeps them.

    Examples:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with hybrid_optimizer_state_loading(sgd) as prepared:
        ...     prepared
        0
    """
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

    Megatron-Bridge calls it after *every* checkpoint load. For each parameter of every hybrid
    offload optimizer (Megatron's HybridDeviceOptimizer, alone or under a
    DistributedOptimizer/ChainedOptimizer, or the portable HybridOffloadOptimizer):

    - the optimizer's master disagrees with the model weight (rounded to the weight's dtype):
      the weights were loaded without optimizer state (a model-only load, fine-tuning), so
      every level -- the distributed optimizer's FP32 shard, the host clone, the FP32 working
      copy -- takes the weight's value;
    - the master agrees: optimizer state was restored with the weights (a full resume), so
      the master keeps its low bits and is pushed to every other level (repairing working
      copies that a loader replaced without refreshing) and the restored state is handed to
      the sub-optimizers that step it.

    Source: Megatron-Bridge 0.6.2's helper of the same name and signature, which refreshes
    every level from the weights unconditionally -- after a full resume that drops the
    restored masters' low bits; this follows the newer specification instead.
    Returns ``True`` when the stack has a hybrid offload optimizer (synced), ``False`` (doing
    nothing) otherwise or for ``None``.

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
    return True


def fully_shard_optimizer(optimizer: Any, *, precision_aware: bool = False) -> Any:
    """Megatron-FSDP 0.6.1's optimizer adapter, as a decorating wrapper: use the returned one.

    The result steps sharded parameters whose grad dtype differs from their data dtype (grads
    cast for the step unless ``precision_aware``, originals put back afterwards, also when the
    step raises) and refreshes compute weights after each step. The layer goes on top (it is
    the outermost of the canonical stack); an optimizer that already has it is returned as it
    is, or with the top layer rebuilt when ``precision_aware`` differs (never a doubled layer).

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad_dtype = torch.bfloat16
        >>> opt = fully_shard_optimizer(torch.optim.SGD([p], lr=0.5))
        >>> (p * 2).sum().backward()
        >>> opt.step()
        >>> p.tolist()
        [0.0, 0.0]
    """
    from wrapped_optim.fsdp import FSDPAwareOptimizer
    from wrapped_optim.stack import find_layer

    precision_aware = bool(precision_aware)
    existing = find_layer(optimizer, FSDPAwareOptimizer)
    if existing is None:
        return FSDPAwareOptimizer(optimizer, precision_aware=precision_aware)
    if existing.precision_aware == precision_aware:
        return optimizer
    if existing is optimizer:
        return FSDPAwareOptimizer(
            optimizer.inner, precision_aware=precision_aware, refresh=optimizer.refresh
        )
    raise ValueError(
        "the optimizer already has an FSDPAwareOptimizer layer with precision_aware="
        f"{existing.precision_aware} below another wrapper; rebuild the stack instead"
    )


def init_optimizer_state(optimizer: Any) -> bool:
    """Creates the state a DCP load fills, without touching weights, grads or hyper-parameters.

    This project's own (neither Bridge nor Megatron-FSDP has it). See
    ``wrapped_optim.fsdp.init_optimizer_state``; returns ``True`` when it created state.

    Examples:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> init_optimizer_state(opt), sorted(opt.state_dict()["state"][0])
        (True, ['exp_avg', 'exp_avg_sq', 'step'])
    """
    from wrapped_optim.fsdp import init_optimizer_state as initialise

    return initialise(optimizer)
