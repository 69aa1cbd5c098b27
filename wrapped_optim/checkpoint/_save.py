"""Streaming save: DCP writes the optimizer's state one expanded chunk at a time."""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.tensor import DTensor

from wrapped_optim._adapters.precision import supports_chunked_state
from wrapped_optim.checkpoint._commit import CheckpointCommit
from wrapped_optim.checkpoint._common import (
    DEFAULT_CHUNK_BYTES,
    OptimizerCheckpointError,
    _leaf_of,
    _quiet_no_dist,
    _raise_ours,
)
from wrapped_optim.checkpoint._deferred import (
    DeferredState,
    _owned_cpu_copy,
    _placeholder_state_dict,
    _staged_contents,
)
from wrapped_optim.patching import patch_attribute

__all__ = ["StreamingSavePlanner", "save_optimizer"]


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

    Plain tensors (and ``DeferredState`` placeholders, keyed by their flattened DCP key)
    larger than ``chunk_bytes`` are written as several row chunks; each chunk is produced only
    in ``resolve_data`` and, with ``release_after_write``, its buffer is released when the
    same writer thread asks for its next item (by then DCP's file writer has written it; it
    keeps a reference of its own until the file is closed). DTensors and objects are planned
    exactly as ``DefaultSavePlanner`` plans them. ``save_optimizer`` builds it; use it
    directly only to drive ``dcp.save`` yourself.

    Args:
        deferred: Placeholders by flattened DCP key, expanded when their chunk is written.
        chunk_bytes: The most bytes one write item materialises (``None``: whole tensors).
        release_after_write: Release each chunk's buffer once the writer moves on.

    Raises:
        ValueError: ``chunk_bytes`` is not positive.

    Examples:
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
        """Produces the data of one write item, when the storage writer asks for it.

        Args:
            write_item: The item DCP is about to write.

        Returns:
            An object's bytes, a slice of a tensor, or a fresh expansion of a chunk.
        """
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
    async_: bool = False,
    refuse_non_finite: bool = False,
) -> Any:
    """Saves ``optimizer``'s state as a DCP checkpoint, expanding one chunk at a time.

    ``optimizer`` is a torch optimizer or any wrapper stack around one (precision-aware
    holders included). The checkpoint has the layout of ``optimizer.state_dict()``; tensors
    larger than ``chunk_bytes`` (expanded) are written as row chunks. With several processes,
    call it on every rank (a collective, like ``dcp.save``); replicated state is written once.

    Saved into a directory (``checkpoint_id``, or a ``FileSystemWriter``'s path), the save is
    atomic: it is written beside the target and renamed into place only once complete; a save
    that raises leaves what the directory held before. With ``async_=True`` the call takes a
    copy of the state as stored (compressed moments stay compressed) and returns a
    ``concurrent.futures.Future`` at once, as ``torch.distributed.checkpoint.async_save``
    does; a background thread writes that copy while training goes on.

    Args:
        optimizer: the optimizer or wrapper stack.
        checkpoint_id: the checkpoint directory (or the writer's id).
        storage_writer: a DCP writer; default ``FileSystemWriter(checkpoint_id)``.
        process_group: the group to coordinate over (default: the world, if initialised).
            With ``async_`` and several processes, pass a group of its own (e.g. a gloo
            ``dist.new_group``) so that the save's collectives never interleave with training's.
        chunk_bytes: the most expanded bytes materialised per write item (None: whole tensors).
        async_: return a future at once and write in a background thread.
        refuse_non_finite: refuse a state holding inf or NaN (e.g. from one overflowed
            gradient element) before anything is written. By default it is written as it
            is, and ``load_optimizer`` loads it back bitwise, as torch's optimizers keep
            such state (``load_optimizer(..., refuse_non_finite=True)`` refuses it there).
            With several processes every rank refuses when any rank's state (its shard)
            holds such values: the ranks agree through one small collective first.

    Returns:
        The DCP metadata of the checkpoint; with ``async_``, a future of it.

    Raises:
        TypeError: the stack holds Megatron containers (checkpoint those through
            ``sharded_state_dict``).
        ValueError: neither ``checkpoint_id`` nor ``storage_writer`` is given, or a state
            holds inf or NaN under ``refuse_non_finite`` (the parameter and state named).

    Examples:
        >>> import tempfile, torch
        >>> from wrapped_optim.checkpoint import load_optimizer
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
    if refuse_non_finite:
        _refuse_non_finite(leaf, process_group)
    # The directory is resolved here, in the calling thread: a later os.chdir or a changed
    # symlink does not move an asynchronous save.
    writer = storage_writer if storage_writer is not None else FileSystemWriter(checkpoint_id)  # type: ignore[arg-type]
    commit: CheckpointCommit | None = None
    if isinstance(writer, FileSystemWriter):
        commit = CheckpointCommit(checkpoint_id or writer.path, process_group)
        checkpoint_id = commit.staging
    if not async_:
        contents = _placeholder_state_dict(leaf)
        return _save(contents, checkpoint_id, writer, commit, process_group, chunk_bytes)
    contents = _staged_contents(leaf)
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wrapped_optim-save")
    try:
        return executor.submit(
            _save, contents, checkpoint_id, writer, commit, process_group, chunk_bytes
        )
    finally:
        executor.shutdown(wait=False)


def _refuse_non_finite(leaf: torch.optim.Optimizer, process_group: Any) -> None:
    """``ValueError`` naming the first state (in ``state_dict`` order) holding inf or NaN, on
    every rank of the save: a rank whose own shard is finite would otherwise go on into the
    save's first collective and wait there for the ranks that refused, until the group's
    timeout. FP8 storage (uint8 codes) has no such values to look for."""
    problem = _non_finite_state(leaf)
    verdicts = [problem]
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size(process_group)
        if size > 1:  # one small object collective, only when the caller asked for the check
            verdicts = [None] * size
            dist.all_gather_object(verdicts, problem, group=process_group)
    if problem is not None:
        raise ValueError(problem)
    for rank, found in enumerate(verdicts):
        if found is not None:
            raise ValueError(f"rank {rank} of the save's process group refused it: {found}")


def _non_finite_state(leaf: torch.optim.Optimizer) -> str | None:
    """The refusal of this rank's first state holding inf or NaN, or None."""
    params = [p for group in leaf.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for name, value in leaf.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if hasattr(value, "to_local") else value
            if not local.is_floating_point() or local.numel() == 0:
                continue
            # One reduction, no temporary of the state's size (the save's memory bound):
            # min and max are NaN if any value is, +-inf if any value is infinite.
            lo, hi = torch.stack(torch.aminmax(local.reshape(-1))).tolist()
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return (
                    f"param {index}: state {name!r} holds non-finite values (inf or NaN) "
                    "and refuse_non_finite=True; nothing was written. Fix the run (a "
                    "gradient overflowed?), or save without refuse_non_finite to keep them "
                    "as torch's optimizers do"
                )
    return None


def _save(
    contents: tuple[dict[str, Any], dict[tuple[int, str], DeferredState]],
    checkpoint_id: str | os.PathLike[str] | None,
    writer: StorageWriter,
    commit: CheckpointCommit | None,
    process_group: Any,
    chunk_bytes: int | None,
) -> Metadata:
    state_dict, deferred = contents
    deferred_by_key = {f"state.{index}.{name}": d for (index, name), d in deferred.items()}
    with _serial_writer(writer) as release:
        planner = StreamingSavePlanner(
            deferred_by_key, chunk_bytes=chunk_bytes, release_after_write=release
        )
        try:
            if commit is not None:
                commit.prepare()
            with _quiet_no_dist():
                metadata = dcp.save(
                    state_dict,
                    checkpoint_id=checkpoint_id,
                    storage_writer=writer,
                    planner=planner,
                    process_group=process_group,
                )
            if commit is not None:
                commit.commit()
            return metadata
        except BaseException as exc:
            if commit is not None:
                commit.abort()
            if isinstance(exc, CheckpointException):
                _raise_ours(exc)
            raise
        finally:
            planner.release_all()
