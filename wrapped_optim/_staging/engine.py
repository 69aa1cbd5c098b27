"""The staging engine behind ``StagedCheckpointOptimizer``: three scoped changes of foreign
optimizers (``staged_save``, ``staged_load``, ``fp32_no_copy_load``), decided per leaf by
structure and explained by ``staging_decisions`` / ``no_copy_decisions``. How each works is in
docs/staged.md ("How it works").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import torch

from wrapped_optim._adapters.dtensor import is_dtensor
from wrapped_optim._adapters.hybrid import is_hybrid_offload
from wrapped_optim._adapters.precision import supports_chunked_state
from wrapped_optim._adapters.walk import LeafContext, walk_leaves
from wrapped_optim._layer_policy import MegatronSettings, no_copy_blocker, staging_blocker
from wrapped_optim._staging.buffers import DeviceScratch, PinnedPool, copy_chunks_through_pinned
from wrapped_optim._staging.ledger import device_ledger
from wrapped_optim.patching import patch_attribute

__all__ = [
    "LeafDecision",
    "PinnedPool",
    "StagingStats",
    "fp32_no_copy_load",
    "leaf_settings",
    "no_copy_decisions",
    "staged_load",
    "staged_save",
    "staging_decisions",
]

logger = logging.getLogger(__name__)

_FP32 = torch.float32
# A host-resident source is decoded straight into the host buffer, at most this many elements
# per chunk call (64 MiB of FP32), whatever chunk_bytes is: no device memory is involved (the
# engine allocates nothing but the host buffer, and PrecisionAwareAdamW's chunk read allocates
# nothing of the call's size), and every call costs a fixed overhead plus, with several torch
# threads, a parallel region whose join waits for the slowest thread. 64K-element calls
# measured 1.3-1.7x the bare decode; 1M-element calls 1.4x its CPU time at 100M parameters on
# a loaded two-core machine with two threads (1.05x with one); 16M-element calls as many
# regions as the bare decode.
_HOST_SCRATCH_NUMEL = 1 << 24
_ADAM_MOMENTS = frozenset({"exp_avg", "exp_avg_sq"})


# --------------------------------------------------------------------------------------
# Decisions
# --------------------------------------------------------------------------------------
@attrs.frozen
class LeafDecision:
    """Whether one leaf of a stack takes part in a staging path, and why (not).

    Attributes:
        index: the leaf's position in walk order.
        optimizer: the leaf optimizer (``None`` for a stub).
        eligible: whether the path applies to this leaf.
        reason: ``"eligible"`` or the first gate that failed, in words.
        chunked: for save/load staging, whether the holder offers the chunk API.

    Example:
        >>> LeafDecision(index=0, optimizer=None, eligible=False, reason="stub").reason
        'stub'
    """

    index: int
    optimizer: Any
    eligible: bool
    reason: str
    chunked: bool = False


@attrs.define
class StagingStats:
    """What the engine did during one checkpoint call (the wrapper keeps the last one).

    Example:
        >>> StagingStats().staged_holders
        0
    """

    staged_holders: int = 0
    chunked_reads: int = 0
    whole_tensor_reads: int = 0
    direct_reads: int = 0
    passthrough_reads: int = 0
    chunked_writes: int = 0
    protected_writes: int = 0
    adoptions: int = 0


def _dtype_map(obj: Any) -> Mapping[str, Any] | None:
    mapping = getattr(obj, "name_to_dtype_map", None)
    return mapping if isinstance(mapping, Mapping) else None


def _compressed(obj: Any) -> bool:
    mapping = _dtype_map(obj)
    return mapping is not None and any(dtype != _FP32 for dtype in mapping.values())


def _supports_chunks(obj: Any) -> bool:
    return supports_chunked_state(obj)


# DTensor states are sharded views of a global tensor; they are handed through unstaged.


def _save_gate(leaf: LeafContext) -> str | None:
    if leaf.is_stub:
        return "stub optimizer (no parameters on this rank)"
    blocker = staging_blocker(MegatronSettings.of(leaf.config, leaf.ddp_config))
    if blocker is not None:
        return blocker
    if _dtype_map(leaf.optimizer) is None:
        return f"{type(leaf.optimizer).__name__} is not a precision-aware holder"
    if not _compressed(leaf.optimizer):
        return "every state is FP32"
    return None


def _unique(decisions: Iterator[LeafDecision]) -> list[LeafDecision]:
    seen: set[int] = set()
    result = []
    for decision in decisions:
        if decision.eligible and id(decision.optimizer) in seen:
            decision = attrs.evolve(decision, eligible=False, reason="already staged")
        if decision.eligible:
            seen.add(id(decision.optimizer))
        result.append(decision)
    return result


def staging_decisions(stack: Any) -> list[LeafDecision]:
    """For every leaf of ``stack``: is its state staged on save and load, and why (not).

    Gates, in order: not a stub; with a Megatron config, ``use_precision_aware_optimizer``
    on and ``optimizer_cpu_offload`` off; ``ddp_config.use_megatron_fsdp`` off; the leaf
    has a ``name_to_dtype_map`` with at least one non-FP32 state. A hybrid offload leaf
    (:func:`~wrapped_optim._adapters.hybrid.is_hybrid_offload`) is followed by one decision
    per sub-optimizer (same index, same container context, same gates): its sub-optimizers
    are the holders.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> [d.reason for d in staging_decisions(sgd)]
        ['SGD is not a precision-aware holder']
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
        >>> hybrid = HybridOffloadOptimizer(
        ...     [torch.nn.Parameter(torch.ones(2))], offload_fraction=1.0,
        ...     cpu_optimizer_cls=PrecisionAwareAdamW, exp_avg_dtype=torch.bfloat16)
        >>> [d.reason for d in staging_decisions(hybrid)]
        ['HybridOffloadOptimizer is not a precision-aware holder', 'eligible']
    """

    def candidates(leaf: LeafContext) -> Iterator[LeafContext]:
        yield leaf
        if not leaf.is_stub and is_hybrid_offload(leaf.optimizer):
            # Its sub-optimizers hold the state, in the leaf's context (same gates).
            for sub in leaf.optimizer.sub_optimizers:
                yield attrs.evolve(leaf, optimizer=sub)

    def decide() -> Iterator[LeafDecision]:
        for leaf in walk_leaves(stack):
            for candidate in candidates(leaf):
                reason = _save_gate(candidate)
                yield LeafDecision(
                    index=candidate.index,
                    optimizer=candidate.optimizer,
                    eligible=reason is None,
                    reason=reason or "eligible",
                    chunked=reason is None and _supports_chunks(candidate.optimizer),
                )

    return _unique(decide())


# --------------------------------------------------------------------------------------
# Save staging
# --------------------------------------------------------------------------------------
def _stored_state(holder: Any, param: torch.Tensor, name: str) -> torch.Tensor | None:
    try:
        stored = holder.state[param][name]
    except (AttributeError, KeyError, TypeError):  # no state (None or absent), none for param
        return None
    # The expansion has the parameter's shape; the storage may be smaller (block-scaled
    # codes: a byte or half a byte per value), never larger.
    if not isinstance(stored, torch.Tensor) or stored.numel() > param.numel():
        return None
    return stored


def _on_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is host memory: on the CPU and not claiming to be a CUDA tensor (a
    CPU emulation of a device, such as a test shim's, answers ``is_cuda`` for its device
    tensors: their state is staged as device state, through one chunk of scratch)."""
    return tensor.device.type == "cpu" and not tensor.is_cuda


def _read_chunked(
    holder: Any, param: torch.Tensor, name: str, stored: torch.Tensor, scratch: DeviceScratch
) -> torch.Tensor:
    device = stored.device
    numel = param.numel()
    host = torch.empty(param.shape, dtype=_FP32)  # pageable: the checkpoint's own memory
    flat = host.view(-1)
    step = scratch.chunk_numel(_FP32)
    if _on_host(stored):
        # The state already lives on the host: decode straight into the host buffer, in
        # calls of up to _HOST_SCRATCH_NUMEL elements, with no scratch to copy from.
        step = _HOST_SCRATCH_NUMEL
        for start in range(0, numel, step):
            holder.read_unscaled_state_chunk(param, name, start, flat[start : start + step])
        return host
    buffer = scratch.get(device, _FP32, min(numel, step))
    try:
        if device.type == "cuda":
            with torch.cuda.device(device):
                copy_chunks_through_pinned(holder, param, name, buffer, flat)
        else:
            for start in range(0, numel, step):
                count = min(step, numel - start)
                out = buffer[:count]
                holder.read_unscaled_state_chunk(param, name, start, out)
                flat[start : start + count].copy_(out)
    finally:
        # Alive only during one state's read, so no other path ever sees it beside its own.
        del buffer
        scratch.close()
    return host


def _expansion_to_host(expansion: torch.Tensor) -> torch.Tensor:
    if expansion.device.type == "cpu":
        # A CPU run models the device as separate memory: the host copy is a new tensor.
        return expansion.clone()
    return expansion.to("cpu")


def _live_to_host(value: torch.Tensor) -> torch.Tensor:
    return value if value.device.type == "cpu" else value.to("cpu")


def _check_tensor(holder: Any, accessor: str, name: Any, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{type(holder).__name__}.{accessor}() must return a torch.Tensor for checkpoint "
            f"staging, but returned a {type(value).__name__} for state {name!r}; the holder's "
            "state accessor does not follow TE FusedAdam's contract"
        )
    return value


def _accessor_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The (param, state_name) of an accessor call, wherever the caller put them."""
    param = args[0] if args else kwargs.get("param")
    state_name = args[1] if len(args) > 1 else kwargs.get("state_name")
    return param, state_name


def _staged_reader(
    holder: Any,
    original: Callable[..., Any],
    chunked: bool,
    scratch: DeviceScratch,
    stats: StagingStats,
) -> Callable[..., torch.Tensor]:
    busy = False  # a holder's chunk reader may itself call get_unscaled_state

    # Any call signature passes through: TE's accessor has gained arguments across releases.
    def get_unscaled_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal busy
        if busy:
            return original(*args, **kwargs)
        param, state_name = _accessor_target(args, kwargs)
        if is_dtensor(param):
            stats.passthrough_reads += 1
            return original(*args, **kwargs)
        mapping = _dtype_map(holder) or {}
        compressed = mapping.get(state_name, _FP32) != _FP32
        # Only the plain (param, state_name) call has a chunked equivalent.
        if compressed and chunked and len(args) + len(kwargs) == 2:
            stored = _stored_state(holder, param, state_name)
            if stored is not None:
                stats.chunked_reads += 1
                busy = True
                try:
                    return _read_chunked(holder, param, state_name, stored, scratch)
                finally:
                    busy = False
        value = _check_tensor(holder, "get_unscaled_state", state_name, original(*args, **kwargs))
        if not compressed:
            # FP32 state (or an int16 remainder): the live tensor, copied straight to the host.
            stats.direct_reads += 1
            return _live_to_host(value)
        stats.whole_tensor_reads += 1
        nbytes = value.numel() * value.element_size()
        device_ledger.allocate(nbytes)
        try:
            return _expansion_to_host(value)
        finally:
            del value
            device_ledger.release(nbytes)

    return get_unscaled_state


def _accessor(holder: Any, name: str) -> Callable[..., Any]:
    accessor = getattr(holder, name, None)
    if not callable(accessor):
        kind = type(holder).__name__
        raise RuntimeError(
            f"checkpoint staging requires {kind}.{name}() to be callable: {kind} declares "
            f"precision-aware state (name_to_dtype_map) but its {name} is a "
            f"{type(accessor).__name__}; give it TE FusedAdam's state accessors"
        )
    return accessor


@contextlib.contextmanager
def staged_save(
    stack: Any,
    *,
    chunk_bytes: int = 64 << 20,
    chunked: bool = True,
    stats: StagingStats | None = None,
) -> Iterator[StagingStats]:
    """Within the block, eligible holders of ``stack`` return their states on the host.

    Wrap ``state_dict()``, Megatron's ``sharded_state_dict(...)`` and ``load_state_dict()``
    (whose scaffold is built by calling ``state_dict``). ``chunked=False`` forces the
    whole-tensor path even for holders with the chunk API (benchmarks use it). Every patch
    is removed on exit, also when the block raises.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with staged_save(sgd) as stats:
        ...     _ = sgd.state_dict()
        >>> stats.staged_holders
        0
    """
    if chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must be at least 4 (one FP32 element), got {chunk_bytes}")
    stats = stats if stats is not None else StagingStats()
    scratch = DeviceScratch(chunk_bytes)
    with contextlib.ExitStack() as patches:
        patches.callback(scratch.close)
        for decision in staging_decisions(stack):
            if not decision.eligible:
                continue
            holder = decision.optimizer
            original = _accessor(holder, "get_unscaled_state")
            reader = _staged_reader(holder, original, chunked and decision.chunked, scratch, stats)
            patches.enter_context(patch_attribute(holder, "get_unscaled_state", reader))
            stats.staged_holders += 1
        if stats.staged_holders:
            logger.info("staging checkpoint state of %d optimizer(s) to host", stats.staged_holders)
        yield stats


# --------------------------------------------------------------------------------------
# Load staging
# --------------------------------------------------------------------------------------
def _chunked_writer(
    holder: Any,
    original: Callable[[torch.Tensor, str, Any], Any],
    chunk_bytes: int,
    stats: StagingStats,
) -> Callable[[torch.Tensor, str, Any], Any]:
    chunk_numel = max(1, chunk_bytes // 4)
    busy = False  # a holder's chunk writer may itself call set_scaled_state

    def set_scaled_state(param: torch.Tensor, state_name: str, unscaled_state: Any) -> Any:
        nonlocal busy
        if (
            busy
            or is_dtensor(param)
            or not isinstance(unscaled_state, torch.Tensor)
            or unscaled_state.numel() != param.numel()
            or unscaled_state.dtype not in (_FP32, torch.int16)
        ):
            # Not ours to handle: the holder's own loader validates and reports it.
            return original(param, state_name, unscaled_state)
        in_flight = min(chunk_numel, param.numel()) * 4
        device_ledger.allocate(in_flight)
        busy = True
        try:
            holder.write_scaled_state_chunked(param, state_name, unscaled_state, chunk_numel)
        finally:
            busy = False
            device_ledger.release(in_flight)
        stats.chunked_writes += 1
        return None

    return set_scaled_state


def _protective_writer(
    holder: Any, original: Callable[[torch.Tensor, str, Any], Any], stats: StagingStats
) -> Callable[[torch.Tensor, str, Any], Any]:
    def set_scaled_state(param: torch.Tensor, state_name: str, unscaled_state: Any) -> Any:
        mapping = _dtype_map(holder) or {}
        if isinstance(unscaled_state, torch.Tensor) and mapping.get(state_name) == torch.float16:
            # TE's fp16 path divides its argument by the scale in place.
            stats.protected_writes += 1
            unscaled_state = unscaled_state.clone()
        return original(param, state_name, unscaled_state)

    return set_scaled_state


@contextlib.contextmanager
def staged_load(
    stack: Any, *, chunk_bytes: int = 64 << 20, stats: StagingStats | None = None
) -> Iterator[StagingStats]:
    """Within the block, eligible holders quantize FP32 checkpoint state chunk by chunk.

    Holders with the chunk API write through ``write_scaled_state_chunked``: the checkpoint
    tensor may live on the host or the device, is never modified, and at most one chunk of
    it is on the device at a time. Holders without it keep their own ``set_scaled_state``,
    but get a copy where they would scale the caller's fp16-bound tensor in place.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with staged_load(sgd) as stats:
        ...     sgd.load_state_dict(sgd.state_dict())
        >>> stats.chunked_writes
        0
    """
    if chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must be at least 4 (one FP32 element), got {chunk_bytes}")
    stats = stats if stats is not None else StagingStats()
    with contextlib.ExitStack() as patches:
        for decision in staging_decisions(stack):
            if not decision.eligible:
                continue
            holder = decision.optimizer
            original = _accessor(holder, "set_scaled_state")
            if decision.chunked:
                writer = _chunked_writer(holder, original, chunk_bytes, stats)
            else:
                writer = _protective_writer(holder, original, stats)
            patches.enter_context(patch_attribute(holder, "set_scaled_state", writer))
        yield stats


# --------------------------------------------------------------------------------------
# FP32 no-copy load
# --------------------------------------------------------------------------------------
def leaf_settings(leaf: LeafContext) -> MegatronSettings:
    """The Megatron settings of ``leaf``'s container; ``distributed`` when it is a distributed
    optimizer (it has ``shard_fp32_from_float16_groups``).

    Example:
        >>> import torch
        >>> from wrapped_optim._adapters.walk import walk_leaves
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> leaf_settings(next(walk_leaves(sgd))).distributed
        False
    """
    distributed = hasattr(leaf.container, "shard_fp32_from_float16_groups")
    return MegatronSettings.of(leaf.config, leaf.ddp_config, distributed=distributed)


def _no_copy_gate(leaf: LeafContext) -> str | None:
    if leaf.is_stub:
        return "stub optimizer (no parameters on this rank)"
    blocker = no_copy_blocker(leaf_settings(leaf))
    if blocker is not None:
        return blocker
    inner = leaf.optimizer
    mapping = _dtype_map(inner)
    if mapping is None or not callable(getattr(inner, "set_scaled_state", None)):
        return f"{type(inner).__name__} is not a precision-aware holder"
    if not callable(inner.load_state_dict):  # a torch optimizer's, unless replaced
        return f"{type(inner).__name__} has no load_state_dict"
    if getattr(inner, "master_weights", False):
        return "master_weights is on"
    if getattr(inner, "store_param_remainders", False):
        return "store_param_remainders is on"
    for name in sorted(_ADAM_MOMENTS):
        if mapping.get(name, _FP32) != _FP32:
            return f"{name} is stored as {mapping[name]}, not FP32"
    for group in inner.param_groups:  # a distributed optimizer's leaf: a torch optimizer
        for param in group["params"]:
            if param.dtype != _FP32:
                return f"a parameter is {param.dtype}, not FP32"
    return None


def no_copy_decisions(stack: Any) -> list[LeafDecision]:
    """For every leaf: may it adopt FP32 checkpoint tensors on load, and why (not).

    Gates (the reference's): not a stub, inside a distributed optimizer
    (``shard_fp32_from_float16_groups``), not Megatron-FSDP, not precision-aware, not CPU
    offload; the leaf is a precision-aware holder with ``master_weights`` and
    ``store_param_remainders`` off, FP32 ``exp_avg``/``exp_avg_sq`` and only FP32 parameters.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> [d.reason for d in no_copy_decisions(sgd)]
        ['not inside a distributed optimizer']
    """

    def decide() -> Iterator[LeafDecision]:
        for leaf in walk_leaves(stack):
            reason = _no_copy_gate(leaf)
            yield LeafDecision(leaf.index, leaf.optimizer, reason is None, reason or "eligible")

    return _unique(decide())


def _plain_fp32_adam_state(state_dict: Any) -> bool:
    """Exactly ``{exp_avg, exp_avg_sq}`` FP32 tensors for every parameter of every group."""
    if not isinstance(state_dict, Mapping):
        return False
    state = state_dict.get("state")
    groups = state_dict.get("param_groups")
    if not isinstance(state, Mapping) or not isinstance(groups, list | tuple):
        return False
    try:
        ids = [index for group in groups for index in group["params"]]
    except (KeyError, TypeError):
        return False
    if not ids or set(state.keys()) != set(ids):
        return False
    for entry in state.values():
        if not isinstance(entry, Mapping) or set(entry.keys()) != _ADAM_MOMENTS:
            return False
        for value in entry.values():
            if not isinstance(value, torch.Tensor) or value.dtype != _FP32:
                return False
    return True


def _adopting_loader(
    inner: Any, original: Callable[[Any], Any], stats: StagingStats
) -> Callable[[Any], Any]:
    def load_state_dict(state_dict: Any) -> Any:
        if _plain_fp32_adam_state(state_dict):
            # torch's own loader keeps tensors whose dtype and device already match.
            stats.adoptions += 1
            return torch.optim.Optimizer.load_state_dict(inner, state_dict)
        return original(state_dict)

    return load_state_dict


def _release_allocator_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def fp32_no_copy_load(stack: Any, *, stats: StagingStats | None = None) -> Iterator[StagingStats]:
    """Within the block, eligible FP32 distributed Adams adopt loaded tensors without copies.

    Their ``load_state_dict`` becomes torch's base ``Optimizer.load_state_dict`` for a state
    dict holding exactly FP32 ``exp_avg``/``exp_avg_sq`` for every parameter; any other
    incoming state goes to the original loader. On exit the patches are removed and, after
    an adoption, the CUDA allocator cache is released.

    Example:
        >>> import torch
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> with fp32_no_copy_load(sgd) as stats:
        ...     sgd.load_state_dict(sgd.state_dict())
        >>> stats.adoptions
        0
    """
    stats = stats if stats is not None else StagingStats()
    adoptions_before = stats.adoptions
    try:
        with contextlib.ExitStack() as patches:
            for decision in no_copy_decisions(stack):
                if not decision.eligible:
                    continue
                inner = decision.optimizer
                loader = _adopting_loader(inner, inner.load_state_dict, stats)
                patches.enter_context(patch_attribute(inner, "load_state_dict", loader))
            yield stats
    finally:
        if stats.adoptions > adoptions_before:
            _release_allocator_cache()
