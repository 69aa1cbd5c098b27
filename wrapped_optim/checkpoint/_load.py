"""Streaming load: DCP reads a checkpoint straight into the optimizer's state storage."""

from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Mapping
from itertools import chain
from typing import Any

import attrs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor

from wrapped_optim._adapters.dtensor import like_param
from wrapped_optim._adapters.precision import is_precision_aware_holder, supports_chunked_state
from wrapped_optim._formats import holder_format, state_format
from wrapped_optim._formats.errors import UndoJournalError
from wrapped_optim.checkpoint._common import (
    DEFAULT_CHUNK_BYTES,
    OptimizerCheckpointError,
    _int_key,
    _leaf_of,
    _path_of,
    _quiet_no_dist,
    _raise_ours,
    unreadable_checkpoint,
)
from wrapped_optim.checkpoint._deferred import _uses_remainder
from wrapped_optim.checkpoint._pinned import pinned_reader
from wrapped_optim.checkpoint._undo import _Undo
from wrapped_optim.wrapper import OptimizerWrapper

__all__ = ["StreamingLoadPlanner", "load_optimizer"]


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
    stored: torch.dtype | None = None  # the format the values end in (their range is checked)
    scaled: bool = False  # ... a holder's storage, whose fp16 and FP8 are scaled
    staged: torch.dtype | None = None  # the checkpoint's dtype, when reading would narrow it


class StreamingLoadPlanner(DefaultLoadPlanner):
    """Reads an optimizer checkpoint straight into an optimizer's state storage.

    ``load_optimizer`` builds it; use it directly only to drive ``dcp.load`` yourself.
    Planning checks every state tensor of the checkpoint against the optimizer before
    anything is read. FP32, bf16 and remainder states are read into the live tensors; a
    scaled (fp16, FP8) state is gathered on the host and quantized into storage as soon as
    its last chunk arrives.

    Args:
        leaf: The torch optimizer whose state is loaded.
        objects: The checkpoint's non-tensor entries (``param_groups`` and the like).
        chunk_bytes: How many bytes a precision-aware holder quantizes per device transfer.

    Raises:
        OptimizerCheckpointError: a checkpoint tensor does not fit the optimizer.

    Examples:
        >>> import tempfile, torch
        >>> from wrapped_optim.checkpoint import load_optimizer, save_optimizer
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
        # An optimizer of sub-optimizers (a hybrid) keeps its state in them, in their own
        # storage formats: everything is read into new tensors and handed to its own loader.
        self.fresh = any(
            is_precision_aware_holder(sub) for sub in getattr(leaf, "sub_optimizers", None) or ()
        )
        self.undo: _Undo | None = None  # what reading in place overwrites, to put it back
        self.wrapped = False  # a wrapper's sync_after_load() runs after the load (writes weights)
        self.atomic = True  # journal what reading overwrites, to undo a failed load
        self.journal_dir: str | os.PathLike[str] | None = None  # where (default: temp dir)
        self.refuse_non_finite = False  # inf/NaN state refused (load_optimizer's option)
        self.saved_as: dict[str, tuple[Any, str]] = {}  # fqn -> (param index, state name)
        self.group_tensors: dict[str, tuple[int, str]] = {}  # fqn -> (group, hyper-parameter)
        self.chunk_bytes = chunk_bytes
        self._buffers = threading.local()  # staged reads (see _buffer)

    # -- planning ----------------------------------------------------------------------
    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """Keeps the metadata; the targets are built (and checked) in ``create_local_plan``.

        Args:
            state_dict: The state dict DCP loads into.
            metadata: The checkpoint's metadata.
            is_coordinator: Whether this rank coordinates the load.
        """
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
        if self.atomic:
            writes = _overwrites(self.leaf, self.targets, items)
            self.undo = _Undo.take(
                self.leaf, writes, self.wrapped, self.journal_dir, self.chunk_bytes
            )
        return LoadPlan(items)

    def _build_targets(self, metadata: Metadata) -> None:
        """Checks the checkpoint against the optimizer, then decides where each of its
        tensors goes (``targets``) and what the loaded state and groups will be."""
        leaf: Any = self.leaf
        holder = is_precision_aware_holder(leaf)
        saved = _check_checkpoint(self.objects, metadata, leaf, holder)
        targets: dict[str, _Target] = {}
        # A tensor hyper-parameter (torch's tensor ``lr``) is read into a new tensor that the
        # group adopts at the end, as torch's own loader adopts the saved one.
        self.param_groups = [dict(g) for g in saved.groups]
        for fqn, (i, key, md) in saved.group_fqns.items():
            hyper = _hyper_parameter_tensor(leaf.param_groups[i].get(key), md)
            targets[fqn] = _Target(md.size, tensor=hyper, live=hyper)
            self.param_groups[i][key] = hyper
            self.group_tensors[fqn] = (i, key)
        self.saved_as = {fqn: (index, name) for fqn, (index, name, _) in saved.tensors.items()}
        state = {index: dict(entry) for index, entry in saved.objects.items()}
        for fqn, (index, name, md) in saved.tensors.items():
            param = saved.id_map[index][0]
            live = {} if self.fresh else leaf.state.get(param, {})
            if holder:
                target = _holder_target(leaf, param, name, md, live)
                value = target.live if target.live is not None else _COMMITTED
            else:
                meta = saved.entries[index][name]
                tensor, created = _state_tensor(leaf, param, index, name, md, meta, live.get(name))
                self.created |= created
                target, value = _Target(md.size, tensor=tensor, live=tensor), tensor
            targets[fqn] = target
            state.setdefault(index, {})[name] = value
            _plan_range_check(target, leaf if holder else None, param, name, md.properties.dtype)
        self.targets = targets
        self.state = state

    # -- reading -----------------------------------------------------------------------
    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """Returns the tensor one read item is read into.

        Args:
            read_item: The chunk DCP is about to read.

        Returns:
            The region of the live state tensor, or of a host buffer for a scaled state.
        """
        target = self.targets[read_item.dest_index.fqn]
        if target.staged is not None:  # its own dtype first: the range check needs the values
            return self._buffer(target.staged, read_item.lengths)
        if self.undo is not None:  # the reader writes the region: journal it first
            self.undo.keep(_write_key(read_item))
        return _region(target, read_item)

    def _buffer(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A buffer for one staged read, reused (per reader thread) so that its pages are
        touched once (a fresh allocation per read item paid its page faults every time)."""
        buffers: dict[torch.dtype, torch.Tensor] | None = getattr(self._buffers, "by", None)
        if buffers is None:
            buffers = self._buffers.by = {}
        numel = math.prod(shape)
        found = buffers.get(dtype)
        if found is None or found.numel() < numel:
            found = buffers[dtype] = torch.empty(numel, dtype=dtype)
        return found[:numel].view(shape)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Checks the values that arrived; quantizes a scaled state into storage once complete.

        Args:
            read_item: The chunk DCP has read.
            tensor: What ``resolve_tensor`` returned for it, now filled.

        Raises:
            OptimizerCheckpointError: a value does not fit the optimizer (non-finite, out of
                range for its storage format, ...).
        """
        fqn = read_item.dest_index.fqn
        if fqn in self.group_tensors:
            group_index, key = self.group_tensors[fqn]
            problem = state_format.hyper_parameter_problem(key, tensor)
            if problem is not None:
                raise OptimizerCheckpointError(f"param group {group_index}: {problem}")
            return
        index, name = self.saved_as[fqn]
        target = self.targets[fqn]
        if name == "step":
            state_format.check_step(f"param {index!r}", tensor)
        else:
            state_format.check_values(
                index, name, tensor, target.stored, scaled=target.scaled,
                # a holder's storage cannot hold inf: a scale would poison the whole tensor
                allow_non_finite=not (self.refuse_non_finite or target.scaled),
            )  # fmt: skip
        if target.staged is not None:
            if self.undo is not None:
                self.undo.keep(_write_key(read_item))
            _region(target, read_item).copy_(tensor)
        if target.holder is None:
            return
        target.filled += math.prod(read_item.lengths)
        if target.filled < math.prod(target.shape):
            return
        source, target.accumulator = target.accumulator, None
        assert source is not None
        holder = target.holder
        if self.undo is not None:
            self.undo.keep(fqn)  # the holder's storage for this state
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
        """Never called: ``load_optimizer`` reads the objects beforehand.

        Args:
            read_item: The object DCP would read.
            value: Its bytes.

        Raises:
            AssertionError: always (an object read was planned by mistake).
        """
        raise AssertionError(f"unexpected object read for {read_item.dest_index.fqn!r}")


def _write_key(read_item: ReadItem) -> tuple[str, tuple[int, ...]]:
    """The journal's key for the region of the live tensor that a read item writes."""
    return read_item.dest_index.fqn, tuple(read_item.dest_offsets)


def _overwrites(
    leaf: torch.optim.Optimizer, targets: Mapping[str, _Target], items: list[ReadItem]
) -> list[tuple[Any, torch.Tensor]]:
    """What reading ``items`` overwrites in place, in read order: the region of a live state
    tensor each item is read into, and a holder's storage that a scaled state is quantized
    into (key: its fqn). New tensors (no state yet) and accumulators are not the optimizer's."""
    live = {id(t) for entry in leaf.state.values() for t in entry.values()}
    writes: list[tuple[Any, torch.Tensor]] = []
    for item in items:
        target = targets[item.dest_index.fqn]
        if target.holder is not None:
            entry = leaf.state.get(target.param, {}) if target.param is not None else {}
            stored = entry.get(target.name)
            if isinstance(stored, torch.Tensor):
                writes.append((item.dest_index.fqn, stored))
        elif target.live is not None and id(target.live) in live:
            writes.append((_write_key(item), _region(target, item)))
    return writes


class _Committed:
    def __repr__(self) -> str:
        return "<committed to the holder's storage>"


_COMMITTED = _Committed()


@attrs.frozen
class _Saved:
    """What a checkpoint holds, as DCP shows it before reading, checked against the
    optimizer (see :func:`_check_checkpoint`)."""

    groups: list[dict[str, Any]]  # the saved param groups (a holder's steps as ints)
    id_map: dict[Any, tuple[torch.Tensor, int]]  # saved param index -> (param, group)
    objects: dict[Any, dict[str, Any]]  # index -> the non-tensor entries of its state
    entries: dict[Any, dict[str, Any]]  # index -> name -> object or TensorMeta
    tensors: dict[str, tuple[Any, str, TensorStorageMetadata]]  # fqn -> (index, name, md)
    group_fqns: dict[str, tuple[int, str, TensorStorageMetadata]]  # fqn -> (group, key, md)


def _check_checkpoint(
    objects: Mapping[str, Any], metadata: Metadata, leaf: Any, holder: bool
) -> _Saved:
    """The checks of every loader (wrapped_optim._formats.state_format), on what DCP shows
    before reading: objects, and each tensor's shape and dtype. DCP drops empty dicts, so a
    checkpoint of an optimizer without state has no "state" entry."""
    _, groups = state_format.check_structure({"state": {}, **objects})
    id_map = state_format.check_groups(groups, leaf.param_groups)
    if holder:
        groups = [
            {**g, "step": state_format.check_step(f"param group {i}", g["step"])}
            if "step" in g
            else g
            for i, g in enumerate(groups)
        ]
    saved: dict[Any, dict[str, Any]] = {}
    for key, entry in (objects.get("state") or {}).items():
        index = _int_key(key)
        state_format.check_index(index, id_map)
        saved[index] = dict(state_format.check_entry(index, entry))
    entries = {index: dict(entry) for index, entry in saved.items()}
    tensors, group_metas, group_fqns = _saved_tensors(metadata, id_map, len(groups))
    for index, name, md in tensors.values():
        entries.setdefault(index, {})[name] = _meta(md)
    for index, entry in entries.items():
        param = id_map[index][0]
        if holder:
            rule = holder_format.holder_rule(leaf, param)
            holder_format.check_holder_entry(index, entry, rule, tuple(param.shape))
        elif "step" in entry:
            state_format.check_step(f"param {index!r}", entry["step"])
    for i, (group, mine) in enumerate(zip(groups, leaf.param_groups, strict=True)):
        state_format.check_hyper_parameters(i, {**group_metas[i], **group}, mine)
    return _Saved(list(groups), id_map, saved, entries, tensors, group_fqns)


def _meta(md: TensorStorageMetadata) -> state_format.TensorMeta:
    return state_format.TensorMeta(tuple(md.size), md.properties.dtype)


def _saved_tensors(
    metadata: Metadata, id_map: Mapping[Any, Any], n_groups: int
) -> tuple[
    dict[str, tuple[Any, str, TensorStorageMetadata]],
    list[dict[str, Any]],
    dict[str, tuple[int, str, TensorStorageMetadata]],
]:
    """The checkpoint's state tensors (fqn -> (param index, name, md)), in metadata order,
    and its tensor hyper-parameters (per group: key -> TensorMeta; fqn -> (group, key, md))."""
    tensors: dict[str, tuple[Any, str, TensorStorageMetadata]] = {}
    group_metas: list[dict[str, Any]] = [{} for _ in range(n_groups)]
    group_fqns: dict[str, tuple[int, str, TensorStorageMetadata]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        path = _path_of(metadata, fqn)
        if path[0] == "param_groups" and len(path) == 3 and path[1] in range(n_groups):
            group_metas[path[1]][str(path[2])] = _meta(md)  # a tensor hyper-parameter
            group_fqns[fqn] = (path[1], str(path[2]), md)
        if path[0] != "state":
            continue  # not optimizer state (e.g. a model saved alongside): not ours
        if len(path) != 3:
            raise OptimizerCheckpointError(
                f"checkpoint tensor {fqn!r} is not laid out as state.<param>.<name>"
            )
        index = _int_key(path[1])
        state_format.check_index(index, id_map)
        tensors[fqn] = (index, str(path[2]), md)
    return tensors, group_metas, group_fqns


def _hyper_parameter_tensor(mine: Any, md: TensorStorageMetadata) -> torch.Tensor:
    """A new tensor for a saved tensor hyper-parameter, on the device of the group's value."""
    device = mine.device if isinstance(mine, torch.Tensor) else torch.device("cpu")
    return torch.empty(md.size, dtype=md.properties.dtype, device=device)


def _state_tensor(
    leaf: torch.optim.Optimizer,
    param: torch.Tensor,
    index: Any,
    name: str,
    md: TensorStorageMetadata,
    meta: state_format.TensorMeta,
    current: Any,
) -> tuple[torch.Tensor, bool]:
    """The tensor a saved state is read into: the live one (checked against it), or a new
    one where the optimizer has none yet; and whether it is new."""
    if isinstance(current, torch.Tensor):
        state_format.check_shape(index, name, meta, current.shape, "the optimizer keeps")
        if current.is_floating_point() != md.properties.dtype.is_floating_point:
            raise OptimizerCheckpointError(
                f"param {index!r}: state {name!r} is {md.properties.dtype}, the "
                f"optimizer keeps {current.dtype}"
            )
        return current, False
    if isinstance(param, DTensor):
        raise OptimizerCheckpointError(
            f"param {index!r}: state {name!r}: the optimizer has no state for this "
            "sharded (DTensor) parameter yet; initialise it first "
            "(wrapped_optim.init_optimizer_state)"
        )
    if not _fits_param(md.size, param.shape):
        state_format.check_shape(index, name, meta, param.shape)
    return _new_state_tensor(leaf, param, index, name, md), True


def _holder_target(
    leaf: Any,
    param: torch.Tensor,
    name: str,
    md: TensorStorageMetadata,
    live: Mapping[str, Any],
) -> _Target:
    """Where a precision-aware holder's state goes: its live storage, or an accumulator that
    is quantized into it (checked beforehand by holder_format.check_holder_entry)."""
    remainder = _uses_remainder(leaf, param, name)
    current = live.get(name)
    local_shape = param.to_local().shape if isinstance(param, DTensor) else param.shape
    stored = torch.int16 if remainder else leaf.name_to_dtype_map[name]
    # Storage without a scale takes the values one element at a time: FP32 and remainders
    # as they are, bf16 by the round-to-nearest-even cast that set_scaled_state applies (from
    # FP32 values only; others would be rounded twice on the holder's path). Those are read
    # straight into the live storage; fp16 and FP8 need the whole tensor's amax first.
    elementwise = stored in (torch.float32, torch.int16) or (
        stored == torch.bfloat16 and md.properties.dtype == torch.float32
    )
    if (
        elementwise
        and isinstance(current, torch.Tensor)
        and current.dtype == stored
        and current.shape == local_shape
        and current.is_contiguous()
    ):
        # The live tensor is the state: read in place (through a DTensor view for a shard).
        tensor = like_param(param, current) if isinstance(param, DTensor) else current
        return _Target(md.size, tensor=tensor, live=current)
    dtype = torch.int16 if remainder else torch.float32
    chunks = param.__create_chunk_list__() if isinstance(param, DTensor) else None
    return _Target(local_shape, holder=leaf, param=param, name=name, dtype=dtype, chunks=chunks)


def _region(target: _Target, read_item: ReadItem) -> torch.Tensor:
    """The region of the live tensor, or of the holder accumulator, a read item fills."""
    if target.tensor is not None:
        tensor = target.tensor
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return narrow_tensor_by_index(local.detach(), read_item.dest_offsets, read_item.lengths)
    if target.accumulator is None:
        target.accumulator = torch.empty(target.shape, dtype=target.dtype)
    return narrow_tensor_by_index(target.accumulator, read_item.dest_offsets, read_item.lengths)


def _plan_range_check(
    target: _Target, holder: Any, param: torch.Tensor, name: str, saved: torch.dtype
) -> None:
    """Which format a state's values end in, so that they are checked against its range
    before they are written (state_format.check_values): a holder's storage format, or the
    live tensor's dtype. A read that would narrow them (FP32 into bf16 storage, float64
    into FP32) goes through a buffer of the checkpoint's dtype, one read item at a time, as
    an overflow would otherwise arrive as an inf whose magnitude is lost."""
    if holder is not None:
        target.stored = holder_format.holder_rule(holder, param).formats.get(name)
        target.scaled = True
    elif target.tensor is not None and target.tensor.is_floating_point():
        target.stored = target.tensor.dtype
    into = target.tensor.dtype if target.tensor is not None else target.dtype
    if (
        saved.is_floating_point
        and into.is_floating_point
        and torch.finfo(saved).max > torch.finfo(into).max
    ):
        target.staged = saved


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
        return torch.empty(md.size, dtype=md.properties.dtype, device="cpu")
    dtype = param.dtype if param.is_floating_point() else md.properties.dtype
    return torch.empty(md.size, dtype=dtype, device=param.device)


def _apply(optimizer: Any, leaf: torch.optim.Optimizer, planner: StreamingLoadPlanner) -> None:
    """Installs the loaded state and hyper-parameters."""
    if planner.undo is not None:
        planner.undo.before_install()
    state_dict = {"state": planner.state, "param_groups": planner.param_groups}
    _write_empty_holder_states(planner)
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
        optimizer.sync_after_load()  # e.g. hybrid masters -> copies, sub-optimizers, weights


def _write_empty_holder_states(planner: StreamingLoadPlanner) -> None:
    """A zero-element state of a precision-aware holder gets no read (DCP has no chunk of
    it), so it never reaches ``commit_tensor``: it is written here, empty, as the holder's
    own ``load_state_dict`` would write it."""
    for target in planner.targets.values():
        if target.holder is None or target.param is None or math.prod(target.shape) != 0:
            continue
        local = target.param.to_local() if isinstance(target.param, DTensor) else target.param
        empty = torch.empty(target.shape, dtype=target.dtype, device=local.device)
        target.holder.set_scaled_state(target.param, target.name, empty)


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
    atomic: bool = True,
    journal_dir: str | os.PathLike[str] | None = None,
    refuse_non_finite: bool = False,
) -> None:
    """Loads a DCP optimizer checkpoint straight into ``optimizer``'s state storage.

    Reads what ``save_optimizer`` or plain ``dcp.save(optimizer.state_dict())`` wrote, at any
    world size. The checkpoint is checked against the optimizer before the first byte of state
    is read, and any failure while reading puts the optimizer back exactly as it was, from an
    undo journal on local disk (as large as the leaf optimizer's stored state). Host memory
    stays at the streaming bound. See [Streaming DCP checkpoints](../checkpoint.md).

    Args:
        optimizer: the optimizer or wrapper stack to load into.
        checkpoint_id: the checkpoint directory (or the reader's id).
        storage_reader: a DCP reader; default ``FileSystemReader(checkpoint_id)``.
        process_group: the group to coordinate over (default: the world, if initialised).
        chunk_bytes: how many bytes a precision-aware holder quantizes per device transfer.
        atomic: undo everything if reading fails (default), at the cost of an undo journal
            of the stored state on disk; ``False`` for no journal when a retry is acceptable.
        journal_dir: where the undo journal goes (default: the system temp dir, ``TMPDIR``);
            a local disk with room for the stored state (a tmpfs would hold it in memory).
        refuse_non_finite: refuse a state holding inf or NaN (the parameter and state
            named, nothing changed). By default such values load as they were saved, as
            torch's ``load_state_dict`` takes them, except into a precision-aware
            optimizer's state, which cannot hold them (refused even then).

    Raises:
        OptimizerCheckpointError: the checkpoint does not fit the optimizer, or cannot be read
            (a missing, truncated or damaged file: the file and the cause are named, DCP's
            exception is chained); nothing changed.
        UndoJournalError: ``journal_dir`` has too little room (raised before the first read).
        TypeError: the stack holds Megatron containers (checkpoint those through
            ``sharded_state_dict``).
        ValueError: neither ``checkpoint_id`` nor ``storage_reader`` is given, or
            ``chunk_bytes`` is not a positive integer (as ``save_optimizer`` refuses it).

    Examples:
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
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be a positive number of bytes, got {chunk_bytes!r}")
    leaf = _leaf_of(optimizer)
    where = os.fspath(checkpoint_id) if checkpoint_id is not None else repr(storage_reader)
    progress = _Progress()
    try:
        # One pinned metadata for both reads, over a pinned directory (checkpoint/_pinned.py).
        with pinned_reader(checkpoint_id, storage_reader) as reader:
            _load(
                optimizer, leaf, reader, process_group, chunk_bytes, atomic, journal_dir,
                refuse_non_finite, progress,
            )  # fmt: skip
    except CheckpointException as exc:
        _raise_ours(exc)
        raise unreadable_checkpoint(where, exc) from exc
    except OSError as exc:
        if isinstance(exc, UndoJournalError) or progress.read:
            raise  # not the checkpoint's: the journal's, or the optimizer's own after reading
        raise unreadable_checkpoint(where, exc) from exc


class _Progress:
    """How far a load got. A failure once the state is read (in the optimizer's loader or its
    hooks, in a wrapper's ``sync_after_load``) is the optimizer's, not the checkpoint's: it
    propagates unchanged (after the undo), never as "cannot read the checkpoint"."""

    def __init__(self) -> None:
        self.read = False


def _load(
    optimizer: Any,
    leaf: torch.optim.Optimizer,
    reader: StorageReader,
    process_group: Any,
    chunk_bytes: int,
    atomic: bool,
    journal_dir: str | os.PathLike[str] | None,
    refuse_non_finite: bool,
    progress: _Progress,
) -> None:
    objects_planner = _ObjectsLoadPlanner()
    flat: dict[str, Any] = {}
    try:
        with _quiet_no_dist():
            dcp.load(
                flat,
                storage_reader=reader,
                planner=objects_planner,
                process_group=process_group,
            )
        metadata = objects_planner.metadata
        assert metadata is not None
        objects: dict[str, Any] = {}
        for fqn, value in objects_planner.state_dict.items():
            _set_path(objects, _path_of(metadata, fqn), value)
        planner = StreamingLoadPlanner(leaf, objects, chunk_bytes=chunk_bytes)
        planner.wrapped = isinstance(optimizer, OptimizerWrapper)
        planner.atomic = atomic
        planner.journal_dir = journal_dir
        planner.refuse_non_finite = refuse_non_finite

        def read() -> None:
            with _quiet_no_dist():
                dcp.load(
                    {},
                    storage_reader=reader,
                    planner=planner,
                    process_group=process_group,
                )

        _read_and_apply(optimizer, leaf, planner, read, progress)
    except CheckpointException as exc:
        _raise_ours(exc)
        raise


def _read_and_apply(
    optimizer: Any,
    leaf: torch.optim.Optimizer,
    planner: StreamingLoadPlanner,
    read: Any,
    progress: _Progress,
) -> None:
    """Reads the state (``read()``) and installs it, all or nothing.

    Reading writes in place (FP32 state into the live tensors, compressed state quantized into
    the holder's storage), so each region is journaled to disk just before it is written
    (``planner.undo``, taken while planning) and the journal is replayed if anything raises;
    it is closed (its file freed) either way. A hybrid's state is read into new tensors and
    installed by its own loader, which is all or nothing itself.
    """
    try:
        read()
        progress.read = True
        _apply(optimizer, leaf, planner)
    except BaseException:
        if planner.undo is not None:
            planner.undo.restore()
        raise
    finally:
        if planner.undo is not None:
            planner.undo.close()  # the journal is freed after the commit or the rollback


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)
