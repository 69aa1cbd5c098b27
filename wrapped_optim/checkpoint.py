"""Streaming optimizer checkpoints through torch.distributed.checkpoint (DCP).

``dcp.save(optimizer.state_dict())`` needs the whole state dict first. For a precision-aware
optimizer that is the FP32 expansion of every compressed moment at once (four bytes per element
and state, on top of the optimizer itself), and ``dcp.load`` into a full scaffold needs the same
again before ``load_state_dict`` quantizes it. Here DCP drives the copy instead:

* save: the state dict handed to DCP holds *placeholders* for compressed states; the save
  planner expands one tensor chunk when the storage writer asks for it (``resolve_data``) and
  releases it once written. FP32 state is read where it lives.
* load: the load planner hands the reader either the live state tensor itself (FP32 state is
  read straight into place) or a host accumulator for a compressed state, which is quantized
  into the holder's storage as soon as its last chunk arrives (``commit_tensor``).

The files are ordinary DCP checkpoints with the optimizer's own ``state_dict`` layout
(``state.<param index>.<name>`` tensors, ``param_groups`` as DCP objects): plain ``dcp.load``
reads them and :func:`load_optimizer` reads what plain ``dcp.save(optimizer.state_dict())``
wrote. Large tensors are written as several DCP chunks (rows of ``chunk_bytes``), which any DCP
reader reassembles.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from itertools import chain
from typing import Any, cast

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import (
    _create_write_items,
    create_read_items_for_chunk_list,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter
from torch.distributed.tensor import DTensor

from wrapped_optim.adapters.dtensor import like_param
from wrapped_optim.adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim.adapters.walk import walk_leaves
from wrapped_optim.patching import patch_attribute
from wrapped_optim.wrapper import OptimizerWrapper

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DeferredState",
    "OptimizerCheckpointError",
    "StreamingLoadPlanner",
    "StreamingSavePlanner",
    "load_optimizer",
    "save_optimizer",
]

DEFAULT_CHUNK_BYTES = 64 << 20
"""Largest tensor chunk (in expanded bytes) that is materialised at once."""

_NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


class OptimizerCheckpointError(ValueError):
    """A checkpoint does not fit the optimizer (names the parameter and state at fault).

    Raised before anything is written into the optimizer, so a caller can catch it and go on
    with the optimizer as it was; a ``ValueError``, like torch's own ``load_state_dict``.

    Example:
        >>> import tempfile, torch
        >>> from wrapped_optim.checkpoint import load_optimizer, save_optimizer
        >>> p = torch.nn.Parameter(torch.ones(4))
        >>> opt = torch.optim.Adam([p], lr=0.1)
        >>> p.grad = torch.ones(4); opt.step()
        >>> other = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save_optimizer(opt, path)
        ...     try:
        ...         load_optimizer(other, path)
        ...     except OptimizerCheckpointError as error:
        ...         print(error)  # doctest: +ELLIPSIS
        state 'exp_avg' of parameter 0 (param group 0): the checkpoint has shape (4,), ...
        >>> len(other.state)  # untouched
        0
    """


# ------------------------------------------------------------------------------------------
# Seeing the optimizer
# ------------------------------------------------------------------------------------------
def _leaf_of(optimizer: Any) -> torch.optim.Optimizer:
    leaves = list(walk_leaves(optimizer))
    if len(leaves) != 1 or leaves[0].container is not None or leaves[0].optimizer is None:
        kinds = ", ".join(type(leaf.optimizer).__name__ for leaf in leaves) or "none"
        raise TypeError(
            "save_optimizer/load_optimizer stream the state of one torch optimizer (possibly "
            f"wrapped); this stack holds {len(leaves)} leaf optimizer(s) ({kinds}) inside "
            "Megatron containers. Checkpoint Megatron optimizers through sharded_state_dict."
        )
    return cast(torch.optim.Optimizer, leaves[0].optimizer)


def _compressed_names(leaf: Any) -> frozenset[str]:
    """State names whose storage is not the FP32 tensor the state dict exposes."""
    if not is_precision_aware_holder(leaf):
        return frozenset()
    return frozenset(
        name for name, dtype in leaf.name_to_dtype_map.items() if dtype != torch.float32
    )


def _uses_remainder(leaf: Any, param: torch.Tensor, name: str) -> bool:
    """TE's rule: an int16 remainder master beside a bf16 parameter (FP32 master only)."""
    return (
        name == "master_param"
        and bool(getattr(leaf, "store_param_remainders", False))
        and bool(getattr(leaf, "master_weights", False))
        and leaf.name_to_dtype_map.get("master_param") == torch.float32
        and param.dtype == torch.bfloat16
    )


def _param_index(leaf: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters in torch's state_dict numbering (first occurrence wins, as torch does)."""
    seen: dict[int, torch.Tensor] = {}
    for group in leaf.param_groups:
        for p in group["params"]:
            seen.setdefault(id(p), p)
    return list(seen.values())


def _state_device(leaf: Any, param: torch.Tensor, name: str) -> torch.device:
    stored = leaf.state.get(param, {}).get(name)
    return stored.device if isinstance(stored, torch.Tensor) else param.device


@attrs.frozen(eq=False)
class DeferredState:
    """A state tensor the state dict only promises: it is expanded chunk by chunk on demand.

    Attributes:
        holder: the precision-aware optimizer owning the storage.
        param: the parameter the state belongs to.
        name: the state name (``"exp_avg"``, ...).
        dtype: the expansion dtype (float32; int16 for a remainder master).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> DeferredState(holder=None, param=p, name="exp_avg", dtype=torch.float32).shape
        torch.Size([3])
    """

    holder: Any
    param: torch.Tensor
    name: str
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> torch.Size:
        """The expanded state's shape: the parameter's."""
        return self.param.shape

    def read(self, start: int, numel: int) -> torch.Tensor:
        """Flat elements ``[start, start + numel)`` of the expansion, as a fresh CPU tensor."""
        device = _state_device(self.holder, self.param, self.name)
        if supports_chunked_state(self.holder):
            out = torch.empty(numel, dtype=self.dtype, device=device)
            self.holder.read_unscaled_state_chunk(self.param, self.name, start, out)
        else:
            full = self.holder.get_unscaled_state(self.param, self.name)
            if isinstance(full, DTensor):
                full = full.to_local()
            stored = self.holder.state.get(self.param, {}).get(self.name)
            aliased = isinstance(stored, torch.Tensor) and (
                stored.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            )
            if start == 0 and numel == full.numel() and not aliased:
                out = full  # a fresh expansion of the whole tensor: ours to hand out and free
            else:
                out = full.reshape(-1)[start : start + numel].clone()
            del full
        return _owned_cpu_copy(out)


def _owned_cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a compact CPU tensor that nobody else references (a copy unless it is one)."""
    if t.device.type == "cpu" and t.is_contiguous() and t._base is None:
        storage = t.untyped_storage()
        if t.storage_offset() == 0 and storage.nbytes() == t.nbytes and t.requires_grad is False:
            return t
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def _is_meta(value: Any) -> bool:
    if isinstance(value, DTensor):
        return bool(value.to_local().is_meta)
    return isinstance(value, torch.Tensor) and value.is_meta


def _placeholder_state_dict(
    leaf: torch.optim.Optimizer,
) -> tuple[dict[str, Any], dict[tuple[int, str], DeferredState]]:
    """``leaf.state_dict()`` with every compressed state replaced by a meta-tensor placeholder.

    The holder's state_dict obtains each state through ``self.get_unscaled_state`` (the
    precision-aware contract), so patching that one instance attribute for the duration of
    the call yields the optimizer's exact layout without expanding anything.
    """
    compressed = _compressed_names(leaf)
    if not compressed:
        return leaf.state_dict(), {}
    original = leaf.get_unscaled_state  # type: ignore[attr-defined]

    def placeholder(param: torch.Tensor, state_name: str) -> torch.Tensor:
        if state_name not in compressed:
            return cast(torch.Tensor, original(param, state_name))
        if isinstance(param, DTensor):  # the local shard's expansion, as a DTensor
            local = torch.empty(param.to_local().shape, dtype=torch.float32, device="meta")
            return like_param(param, local)
        return torch.empty(param.shape, dtype=torch.float32, device="meta")

    with patch_attribute(leaf, "get_unscaled_state", placeholder):
        state_dict = leaf.state_dict()
    params = _param_index(leaf)
    deferred: dict[tuple[int, str], DeferredState] = {}
    for index, entries in state_dict.get("state", {}).items():
        for name, value in entries.items():
            if _is_meta(value):
                deferred[(int(index), str(name))] = DeferredState(leaf, params[int(index)], name)
    return state_dict, deferred


# ------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------
def _row_ranges(shape: torch.Size, itemsize: int, chunk_bytes: int | None) -> list[tuple[int, int]]:
    """Row ranges ``[(start, stop), ...]`` along dim 0 so each holds <= chunk_bytes (>= 1 row)."""
    if len(shape) == 0 or shape[0] <= 1 or chunk_bytes is None:
        return [(0, shape[0] if len(shape) else 1)]
    row_bytes = math.prod(shape[1:]) * itemsize
    if row_bytes == 0:
        return [(0, shape[0])]
    rows = max(1, chunk_bytes // row_bytes)
    return [(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]


def _tensor_write_items(
    fqn: str, shape: torch.Size, dtype: torch.dtype, chunk_bytes: int | None
) -> list[WriteItem]:
    ranges = _row_ranges(shape, torch.empty((), dtype=dtype).element_size(), chunk_bytes)
    properties = TensorProperties(dtype=dtype)
    items = []
    for start, stop in ranges:
        offsets = torch.Size([start] + [0] * (len(shape) - 1)) if len(shape) else torch.Size()
        sizes = torch.Size([stop - start, *shape[1:]]) if len(shape) else torch.Size()
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.TENSOR if len(ranges) == 1 else WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=properties,
                    size=shape,
                ),
            )
        )
    return items


def _shard_write_items(
    shard: WriteItem, dtype: torch.dtype, chunk_bytes: int | None
) -> list[WriteItem]:
    """``shard`` (one rank's DTensor shard) split into row chunks of its own rows."""
    assert shard.tensor_data is not None
    data = shard.tensor_data
    origin, sizes = data.chunk.offsets, data.chunk.sizes
    ranges = _row_ranges(sizes, torch.empty((), dtype=dtype).element_size(), chunk_bytes)
    properties = TensorProperties(dtype=dtype)
    if len(ranges) == 1:
        return [
            dataclasses.replace(shard, tensor_data=dataclasses.replace(data, properties=properties))
        ]
    items = []
    for start, stop in ranges:
        offsets = torch.Size([origin[0] + start, *origin[1:]])
        items.append(
            WriteItem(
                index=MetadataIndex(shard.index.fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=offsets, sizes=torch.Size([stop - start, *sizes[1:]])
                    ),
                    properties=properties,
                    size=data.size,
                ),
            )
        )
    return items


def _flat_start(shape: torch.Size, offsets: torch.Size) -> int:
    if len(shape) == 0:
        return 0
    return offsets[0] * math.prod(shape[1:])


class StreamingSavePlanner(DefaultSavePlanner):
    """Writes a state dict whose large or compressed tensors are materialised one chunk at a time.

    Plain tensors (and :class:`DeferredState` placeholders, keyed by their flattened DCP key)
    larger than ``chunk_bytes`` are written as several row chunks; each chunk is produced only
    in :meth:`resolve_data` and, with ``release_after_write``, its buffer is released when the
    same writer thread asks for its next item (by then DCP's file writer has written it; it
    keeps a reference of its own until the file is closed). DTensors and objects are planned
    exactly as :class:`DefaultSavePlanner` plans them.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> sd = {"w": torch.arange(6.0).reshape(3, 2)}
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = dcp.save(sd, checkpoint_id=path, no_dist=True,
        ...                  planner=StreamingSavePlanner(chunk_bytes=8))
        ...     out = {"w": torch.zeros(3, 2)}
        ...     dcp.load(out, checkpoint_id=path, no_dist=True)
        >>> torch.equal(out["w"], sd["w"])
        True
    """

    def __init__(
        self,
        deferred: Mapping[str, DeferredState] | None = None,
        *,
        chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
        release_after_write: bool = False,
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True)
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive or None, got {chunk_bytes}")
        self.deferred: dict[str, DeferredState] = dict(deferred or {})
        self.chunk_bytes = chunk_bytes
        self.release_after_write = release_after_write
        self._last = threading.local()
        self._origin: dict[str, torch.Size] = {}  # a DTensor placeholder's shard offsets
        self._owned: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.peak_chunk_bytes = 0

    def create_local_plan(self) -> SavePlan:
        """One write item per chunk of each plain tensor or placeholder; defaults otherwise."""
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            deferred = self.deferred.get(fqn)
            if deferred is not None:
                # A holder without the chunk API expands whole tensors: one item per tensor.
                chunk_bytes = self.chunk_bytes if supports_chunked_state(deferred.holder) else None
                if isinstance(obj, DTensor):  # this rank's shard, in row chunks
                    (shard,) = _create_write_items(fqn, obj)
                    assert shard.tensor_data is not None
                    self._origin[fqn] = shard.tensor_data.chunk.offsets
                    items += _shard_write_items(shard, deferred.dtype, chunk_bytes)
                else:
                    items += _tensor_write_items(fqn, deferred.shape, deferred.dtype, chunk_bytes)
            elif isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and not obj.is_meta:
                items += _tensor_write_items(fqn, obj.shape, obj.dtype, self.chunk_bytes)
            elif isinstance(obj, torch.Tensor) and obj.is_meta and not isinstance(obj, DTensor):
                raise OptimizerCheckpointError(
                    f"state dict entry {fqn!r} is a meta tensor with nothing to expand it from"
                )
            else:
                items += _create_write_items(fqn, obj)
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        """The bytes of ``write_item``: an object, a slice of a tensor, or a fresh expansion."""
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        obj = self.state_dict[fqn]
        deferred = self.deferred.get(fqn)
        if isinstance(obj, DTensor) and deferred is None:
            return super().resolve_data(write_item)
        assert write_item.tensor_data is not None
        chunk = write_item.tensor_data.chunk
        self._release_previous()
        if deferred is not None:
            origin = self._origin.get(fqn)
            if origin is not None:  # rows of this rank's shard: offsets relative to it
                rows = chunk.offsets[0] - origin[0] if len(origin) else 0
                start = rows * math.prod(chunk.sizes[1:])
            else:
                start = _flat_start(deferred.shape, chunk.offsets)
            data = deferred.read(start, math.prod(chunk.sizes)).view(chunk.sizes)
        else:
            source = narrow_tensor_by_index(obj.detach(), chunk.offsets, chunk.sizes)
            data = _owned_cpu_copy(source)
            if data is source:
                return data  # the live tensor itself: nothing of ours to release
        self.peak_chunk_bytes = max(self.peak_chunk_bytes, data.nbytes)
        if self.release_after_write:
            self._last.tensor = data
            with self._lock:
                self._owned.append(data)
        return data

    def _release_previous(self) -> None:
        previous = getattr(self._last, "tensor", None)
        if previous is not None:
            # Written by now; the file writer's own reference stays but holds no memory.
            previous.untyped_storage().resize_(0)
            self._last.tensor = None

    def release_all(self) -> None:
        """Frees every chunk buffer this planner produced (call after the save finished)."""
        with self._lock:
            for t in self._owned:
                t.untyped_storage().resize_(0)
            self._owned.clear()


@contextmanager
def _quiet_no_dist() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        yield


def _raise_ours(exc: CheckpointException) -> None:
    for failure in exc.failures.values():
        error = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(error, OptimizerCheckpointError):
            raise error from None


@contextmanager
def _serial_writer(writer: StorageWriter) -> Iterator[bool]:
    """Makes DCP's file writer resolve items one at a time; yields whether release is safe.

    With one thread and a CUDA device, FileSystemWriter resolves items ahead of writing them
    (up to ``per_thread_copy_ahead`` bytes); a planner that frees the previous item could then
    free one that is not written yet. Only the serial path is known to write each item before
    resolving the next, so the copy-ahead is turned off for the save.
    """
    if (
        not isinstance(writer, FileSystemWriter)
        or getattr(writer, "serialization_format", None) != SerializationFormat.TORCH_SAVE
    ):
        yield False
        return
    with ExitStack() as stack:
        if getattr(writer, "per_thread_copy_ahead", 0):
            stack.enter_context(patch_attribute(writer, "per_thread_copy_ahead", 0))
        yield True


def save_optimizer(
    optimizer: Any,
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_writer: StorageWriter | None = None,
    process_group: Any = None,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
) -> Metadata:
    """Saves ``optimizer``'s state as a DCP checkpoint, expanding one chunk at a time.

    ``optimizer`` is a torch optimizer or any wrapper stack around one (precision-aware
    holders included). The checkpoint has the layout of ``optimizer.state_dict()``; tensors
    larger than ``chunk_bytes`` (expanded) are written as row chunks. With several processes,
    call it on every rank (a collective, like ``dcp.save``); replicated state is written once.

    Args:
        optimizer: the optimizer or wrapper stack.
        checkpoint_id: the checkpoint directory (or the writer's id).
        storage_writer: a DCP writer; default ``FileSystemWriter(checkpoint_id)``.
        process_group: the group to coordinate over (default: the world, if initialised).
        chunk_bytes: the most expanded bytes materialised per write item (None: whole tensors).

    Returns:
        The DCP metadata of the checkpoint.

    Example:
        >>> import tempfile, torch
        >>> p = torch.nn.Parameter(torch.ones(4))
        >>> opt = torch.optim.AdamW([p], lr=0.1)
        >>> p.grad = torch.ones(4); opt.step()
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save_optimizer(opt, path)
        ...     fresh = torch.optim.AdamW([p], lr=0.5)
        ...     load_optimizer(fresh, path)
        >>> torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
        True
        >>> fresh.param_groups[0]["lr"]
        0.1
    """
    if checkpoint_id is None and storage_writer is None:
        raise ValueError("save_optimizer needs a checkpoint_id or a storage_writer")
    leaf = _leaf_of(optimizer)
    state_dict, deferred = _placeholder_state_dict(leaf)
    writer = storage_writer if storage_writer is not None else FileSystemWriter(checkpoint_id)  # type: ignore[arg-type]
    deferred_by_key = {f"state.{index}.{name}": d for (index, name), d in deferred.items()}
    with _serial_writer(writer) as release:
        planner = StreamingSavePlanner(
            deferred_by_key, chunk_bytes=chunk_bytes, release_after_write=release
        )
        try:
            with _quiet_no_dist():
                return dcp.save(
                    state_dict,
                    checkpoint_id=checkpoint_id,
                    storage_writer=writer,
                    planner=planner,
                    process_group=process_group,
                )
        except CheckpointException as exc:
            _raise_ours(exc)
            raise
        finally:
            planner.release_all()


# ------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------
class _ObjectsLoadPlanner(DefaultLoadPlanner):
    """Reads only the checkpoint's non-tensor entries (param_groups, step ints, ...)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        assert metadata is not None
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                state_dict[fqn] = None
        super().set_up_planner(state_dict, metadata, is_coordinator)


def _path_of(metadata: Metadata, fqn: str) -> tuple[Any, ...]:
    planner_data = metadata.planner_data or {}
    path = planner_data.get(fqn) if isinstance(planner_data, Mapping) else None
    return tuple(path) if path is not None else (fqn,)


def _int_key(key: Any) -> Any:
    return int(key) if isinstance(key, str) and key.lstrip("-").isdigit() else key


@attrs.define(eq=False)
class _Target:
    """Where one checkpoint tensor goes: a tensor to read into, or a holder to quantize into."""

    shape: torch.Size
    tensor: torch.Tensor | None = None  # live (or new) state tensor: read in place
    live: torch.Tensor | None = None  # what the optimizer keeps (the local shard of a DTensor)
    chunks: list[ChunkStorageMetadata] | None = None  # the accumulator's chunk (DTensor shard)
    holder: Any = None  # precision-aware holder: accumulate, then quantize
    param: torch.Tensor | None = None
    name: str = ""
    dtype: torch.dtype = torch.float32
    accumulator: torch.Tensor | None = None
    filled: int = 0


def _describe(name: str, index: int, group_of: Mapping[int, int]) -> str:
    return f"state {name!r} of parameter {index} (param group {group_of.get(index, '?')})"


class StreamingLoadPlanner(DefaultLoadPlanner):
    """Reads an optimizer checkpoint straight into an optimizer's state storage.

    Built by :func:`load_optimizer` from the checkpoint's non-tensor entries: during planning
    it checks every state tensor of the checkpoint against the optimizer (parameter, shape,
    dtype) and raises :class:`OptimizerCheckpointError` before anything is read. While reading,
    FP32 state is copied into the live tensor (or a new one where the optimizer has no state
    yet) and a compressed state of a precision-aware holder is gathered in a host FP32
    accumulator and quantized into the holder's storage as soon as its last chunk arrives.

    Example:
        >>> import tempfile, torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(2); opt.step()
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save_optimizer(opt, path)
        ...     buf = opt.state[p]["momentum_buffer"]
        ...     _ = buf.zero_()
        ...     load_optimizer(opt, path)
        >>> opt.state[p]["momentum_buffer"] is buf, buf.tolist()
        (True, [1.0, 1.0])
    """

    def __init__(
        self,
        leaf: torch.optim.Optimizer,
        objects: Mapping[str, Any],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.leaf = leaf
        self.objects = objects
        self.targets: dict[str, _Target] = {}
        self.state: dict[int, dict[str, Any]] = {}
        self.param_groups: list[dict[str, Any]] = []
        self.created = False  # some state tensor is new (the optimizer had none for it)
        self.chunk_bytes = chunk_bytes

    # -- planning ----------------------------------------------------------------------
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Keeps the metadata; the targets are built (and checked) in create_local_plan."""
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        """Validates the checkpoint against the optimizer and plans one read per saved chunk."""
        assert self.metadata is not None
        self._build_targets(self.metadata)
        items: list[ReadItem] = []
        for fqn, target in self.targets.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            if isinstance(target.tensor, DTensor):
                chunks = target.tensor.__create_chunk_list__()
            elif target.chunks is not None:
                chunks = target.chunks
            else:
                chunks = [ChunkStorageMetadata(torch.Size([0] * len(md.size)), md.size)]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def _build_targets(self, metadata: Metadata) -> None:
        leaf: Any = self.leaf
        groups = leaf.param_groups
        saved_groups = self.objects.get("param_groups")
        if not isinstance(saved_groups, list) or not all(isinstance(g, dict) for g in saved_groups):
            top = sorted({str(_path_of(metadata, k)[0]) for k in metadata.state_dict_metadata})
            raise OptimizerCheckpointError(
                "the checkpoint holds no optimizer param_groups: not an optimizer state dict "
                f"(top-level entries: {top})"
            )
        if len(saved_groups) != len(groups):
            raise OptimizerCheckpointError(
                f"the checkpoint has {len(saved_groups)} parameter groups, the optimizer "
                f"{len(groups)}"
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups, strict=True)):
            if len(g["params"]) != len(sg.get("params", ())):
                raise OptimizerCheckpointError(
                    f"parameter group {i}: the checkpoint has {len(sg.get('params', ()))} "
                    f"parameters, the optimizer {len(g['params'])}"
                )
        id_map: dict[int, torch.Tensor] = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in groups),
                strict=True,
            )
        )
        group_of = {index: gi for gi, sg in enumerate(saved_groups) for index in sg["params"]}
        self.param_groups = saved_groups
        state: dict[int, dict[str, Any]] = {}
        for key, entries in (self.objects.get("state") or {}).items():
            if isinstance(entries, dict):
                state.setdefault(_int_key(key), {}).update(entries)

        holder_names = (
            frozenset(leaf.name_to_dtype_map) if is_precision_aware_holder(leaf) else frozenset()
        )
        if holder_names:
            _check_group_steps(saved_groups)
        targets: dict[str, _Target] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue
            path = _path_of(metadata, fqn)
            if path[0] != "state":
                continue  # not optimizer state (e.g. a model saved alongside): not ours
            if len(path) != 3:
                raise OptimizerCheckpointError(
                    f"checkpoint tensor {fqn!r} is not laid out as state.<param>.<name>"
                )
            index, name = _int_key(path[1]), str(path[2])
            if index not in id_map:
                raise OptimizerCheckpointError(
                    f"checkpoint tensor {fqn!r} belongs to parameter {index}, which no "
                    "parameter group of the checkpoint lists"
                )
            param = id_map[index]
            what = _describe(name, index, group_of)
            live = leaf.state.get(param, {})
            if holder_names:
                target = _holder_target(leaf, param, name, md, what, live)
                targets[fqn] = target
                value = target.live if target.live is not None else _COMMITTED
                state.setdefault(index, {})[name] = value
                continue
            current = live.get(name)
            if isinstance(current, torch.Tensor):
                if current.shape != md.size:
                    raise OptimizerCheckpointError(
                        f"{what}: the checkpoint has shape {tuple(md.size)}, the optimizer "
                        f"{tuple(current.shape)}"
                    )
                if current.is_floating_point() != md.properties.dtype.is_floating_point:
                    raise OptimizerCheckpointError(
                        f"{what}: the checkpoint has {md.properties.dtype}, the optimizer "
                        f"{current.dtype}"
                    )
                tensor = current
            else:
                if isinstance(param, DTensor):
                    raise OptimizerCheckpointError(
                        f"{what}: the optimizer has no state for this sharded (DTensor) "
                        "parameter yet; initialise it first (wrapped_optim.init_optimizer_state)"
                    )
                if not _fits_param(md.size, param.shape):
                    raise OptimizerCheckpointError(
                        f"{what}: the checkpoint has shape {tuple(md.size)}, which does not fit "
                        f"the parameter's shape {tuple(param.shape)}"
                    )
                tensor = _new_state_tensor(leaf, param, index, name, md)
                self.created = True
            targets[fqn] = _Target(md.size, tensor=tensor, live=tensor)
            state.setdefault(index, {})[name] = tensor
        if holder_names:
            _check_holder_entries(leaf, state, group_of)
        self.targets = targets
        self.state = state

    # -- reading -----------------------------------------------------------------------
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The region of the live tensor, or of the holder accumulator, to read into."""
        target = self.targets[read_item.dest_index.fqn]
        if target.tensor is not None:
            tensor = target.tensor
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            return narrow_tensor_by_index(local.detach(), read_item.dest_offsets, read_item.lengths)
        if target.accumulator is None:
            target.accumulator = torch.empty(target.shape, dtype=target.dtype)
        return narrow_tensor_by_index(target.accumulator, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Quantizes a holder state into storage once all of its chunks have arrived."""
        target = self.targets[read_item.dest_index.fqn]
        if target.holder is None:
            return
        target.filled += math.prod(read_item.lengths)
        if target.filled < math.prod(target.shape):
            return
        source, target.accumulator = target.accumulator, None
        assert source is not None
        holder = target.holder
        if supports_chunked_state(holder):
            chunk_numel = max(1, self.chunk_bytes // source.element_size())
            holder.write_scaled_state_chunked(target.param, target.name, source, chunk_numel)
        else:
            holder.set_scaled_state(target.param, target.name, source)
        # The reader still holds a view of the accumulator until it reads its next item; free
        # the memory now (nothing reads that view again) unless the holder adopted it.
        pointer = source.untyped_storage().data_ptr()
        stored = holder.state.get(target.param, {}).values()
        if not any(
            isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == pointer
            for t in stored
        ):
            source.untyped_storage().resize_(0)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Never planned: objects were read beforehand."""
        raise AssertionError(f"unexpected object read for {read_item.dest_index.fqn!r}")


class _Committed:
    def __repr__(self) -> str:
        return "<committed to the holder's storage>"


_COMMITTED = _Committed()


def _check_group_steps(saved_groups: list[dict[str, Any]]) -> None:
    for i, group in enumerate(saved_groups):
        step = group.get("step", 0)
        if isinstance(step, torch.Tensor) and step.numel() == 1:
            step = step.item()
        if isinstance(step, bool) or not isinstance(step, int | float) or step < 0:
            raise OptimizerCheckpointError(f"parameter group {i}: invalid step {step!r}")
        if isinstance(step, float) and not step.is_integer():
            raise OptimizerCheckpointError(f"parameter group {i}: invalid step {step!r}")


def _holder_target(
    leaf: Any,
    param: torch.Tensor,
    name: str,
    md: TensorStorageMetadata,
    what: str,
    live: Mapping[str, Any],
) -> _Target:
    """Where a precision-aware holder's state goes: its live FP32 tensor, or its storage."""
    if name not in leaf.name_to_dtype_map:
        raise OptimizerCheckpointError(
            f"{what}: {type(leaf).__name__} keeps no such state "
            f"(it keeps {sorted(leaf.name_to_dtype_map)})"
        )
    if name == "master_param" and not getattr(leaf, "master_weights", True):
        raise OptimizerCheckpointError(f"{what}: the optimizer has master_weights off")
    if md.size != param.shape:
        raise OptimizerCheckpointError(
            f"{what}: the checkpoint has shape {tuple(md.size)}, the parameter {tuple(param.shape)}"
        )
    saved = md.properties.dtype
    remainder = _uses_remainder(leaf, param, name)
    if remainder and saved != torch.int16:
        raise OptimizerCheckpointError(
            f"{what}: the optimizer stores bf16 parameter remainders (int16), the checkpoint "
            f"holds a {saved} master (store_param_remainders mismatch)"
        )
    if not remainder and saved == torch.int16 and name == "master_param":
        raise OptimizerCheckpointError(
            f"{what}: the checkpoint holds an int16 parameter remainder, the optimizer keeps "
            "full master weights (store_param_remainders mismatch)"
        )
    if not remainder and not saved.is_floating_point:
        raise OptimizerCheckpointError(f"{what}: expected a floating-point tensor, got {saved}")
    current = live.get(name)
    local_shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    fp32_storage = leaf.name_to_dtype_map[name] == torch.float32
    if fp32_storage and isinstance(current, torch.Tensor) and current.shape == local_shape:
        # The live tensor is the state: read in place (through a DTensor view for a shard).
        tensor = like_param(param, current) if isinstance(param, DTensor) else current
        return _Target(md.size, tensor=tensor, live=current)
    dtype = torch.int16 if remainder else torch.float32
    chunks = param.__create_chunk_list__() if isinstance(param, DTensor) else None
    return _Target(local_shape, holder=leaf, param=param, name=name, dtype=dtype, chunks=chunks)


def _check_holder_entries(
    leaf: Any, state: Mapping[int, Mapping[str, Any]], group_of: Mapping[int, int]
) -> None:
    required = {"exp_avg", "exp_avg_sq"} & set(leaf.name_to_dtype_map)
    if getattr(leaf, "master_weights", False):
        required.add("master_param")
    for index, entries in state.items():
        for name in sorted(required - set(entries)):
            raise OptimizerCheckpointError(
                f"{_describe(name, index, group_of)}: missing from the checkpoint"
            )


def _fits_param(saved: torch.Size, param_shape: torch.Size) -> bool:
    """Whether a saved state can belong to a parameter that has no state yet.

    Per-parameter optimizer state is a scalar (``step``), shaped like the parameter (moments),
    or factored with some dimensions reduced to 1 (Adafactor's row and column statistics).
    """
    if len(saved) == 0:
        return True
    return len(saved) == len(param_shape) and all(
        s in (p, 1) for s, p in zip(saved, param_shape, strict=True)
    )


def _new_state_tensor(
    leaf: torch.optim.Optimizer,
    param: torch.Tensor,
    index: int,
    name: str,
    md: TensorStorageMetadata,
) -> torch.Tensor:
    """A fresh state tensor with the dtype/device its loader would give it.

    torch's own loader casts floating state to the parameter's dtype (``step`` excepted); an
    optimizer with a loader of its own gets the checkpoint's dtype unchanged.
    """
    if type(leaf).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return torch.empty(md.size, dtype=md.properties.dtype, device=param.device)
    group = next(g for g in leaf.param_groups if any(p is param for p in g["params"]))
    if name == "step":
        if group.get("capturable", False) or group.get("fused", False):
            return torch.empty(md.size, dtype=torch.float32, device=param.device)
        return torch.empty(md.size, dtype=md.properties.dtype)
    dtype = param.dtype if param.is_floating_point() else md.properties.dtype
    return torch.empty(md.size, dtype=dtype, device=param.device)


def _apply(optimizer: Any, leaf: torch.optim.Optimizer, planner: StreamingLoadPlanner) -> None:
    """Installs the loaded state and hyper-parameters."""
    state_dict = {"state": planner.state, "param_groups": planner.param_groups}
    torch_loader = type(leaf).load_state_dict is torch.optim.Optimizer.load_state_dict
    if is_precision_aware_holder(leaf) or (not torch_loader and not planner.created):
        # The tensors are in place already: only hyper-parameters and plain values remain.
        # (A custom loader would rebuild or copy what is already there.)
        _apply_in_place(leaf, planner)
    else:
        # torch's loader adopts tensors that already have the dtype and device it wants (no
        # copies) and runs the optimizer's own hooks. A custom loader that must create state
        # (the optimizer had none) gets the whole payload and may copy it.
        leaf.load_state_dict(state_dict)
    if isinstance(optimizer, OptimizerWrapper):
        optimizer.state_loaded()  # e.g. hybrid masters -> copies, sub-optimizers, weights


def _apply_in_place(leaf: torch.optim.Optimizer, planner: StreamingLoadPlanner) -> None:
    params = list(chain.from_iterable(g["params"] for g in leaf.param_groups))
    saved_ids = list(chain.from_iterable(g["params"] for g in planner.param_groups))
    id_map = dict(zip(saved_ids, params, strict=True))
    for index, entries in planner.state.items():
        live = leaf.state[id_map[index]]
        for name, value in entries.items():
            if value is not _COMMITTED:
                live[name] = value
    for group, saved in zip(leaf.param_groups, planner.param_groups, strict=True):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = value


def load_optimizer(
    optimizer: Any,
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_reader: StorageReader | None = None,
    process_group: Any = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> None:
    """Loads a DCP optimizer checkpoint straight into ``optimizer``'s state storage.

    Reads what :func:`save_optimizer` or plain ``dcp.save(optimizer.state_dict())`` wrote, at
    any world size. The checkpoint is checked against the optimizer (group sizes, every state
    tensor's parameter, shape and dtype) before the first byte of state is read; a mismatch
    raises :class:`OptimizerCheckpointError` and leaves the optimizer untouched.

    Args:
        optimizer: the optimizer or wrapper stack to load into.
        checkpoint_id: the checkpoint directory (or the reader's id).
        storage_reader: a DCP reader; default ``FileSystemReader(checkpoint_id)``.
        process_group: the group to coordinate over (default: the world, if initialised).
        chunk_bytes: how many bytes a precision-aware holder quantizes per device transfer.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> opt = torch.optim.Adam([p], lr=0.01)
        >>> p.grad = torch.ones(3); opt.step()
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = dcp.save(opt.state_dict(), checkpoint_id=path, no_dist=True)
        ...     other = torch.optim.Adam([p], lr=1.0)
        ...     load_optimizer(other, path)
        >>> other.state[p]["exp_avg_sq"].tolist() == opt.state[p]["exp_avg_sq"].tolist()
        True
    """
    if checkpoint_id is None and storage_reader is None:
        raise ValueError("load_optimizer needs a checkpoint_id or a storage_reader")
    leaf = _leaf_of(optimizer)

    def reader() -> StorageReader:
        return storage_reader if storage_reader is not None else FileSystemReader(checkpoint_id)  # type: ignore[arg-type]

    objects_planner = _ObjectsLoadPlanner()
    flat: dict[str, Any] = {}
    try:
        with _quiet_no_dist():
            dcp.load(
                flat,
                checkpoint_id=checkpoint_id,
                storage_reader=reader(),
                planner=objects_planner,
                process_group=process_group,
            )
        metadata = objects_planner.metadata
        assert metadata is not None
        objects: dict[str, Any] = {}
        for fqn, value in objects_planner.state_dict.items():
            _set_path(objects, _path_of(metadata, fqn), value)
        planner = StreamingLoadPlanner(leaf, objects, chunk_bytes=chunk_bytes)
        with _quiet_no_dist():
            dcp.load(
                {},
                checkpoint_id=checkpoint_id,
                storage_reader=reader(),
                planner=planner,
                process_group=process_group,
            )
    except CheckpointException as exc:
        _raise_ours(exc)
        raise
    _apply(optimizer, leaf, planner)


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
