"""Megatron-Core's bucket-space optimizer checkpoints, written from the canonical form.

The inverse of :mod:`._megatron_bucketed`: ``dp_reshardable`` (a dist_checkpointing directory,
one flat tensor per bucket and state, written as one DCP chunk per parameter plus the zero
gaps DDP leaves between them) and the legacy ``save_parameter_state`` pair
(``optimizer_common.pt`` and ``param_state.pt``, one flat tensor per grad buffer and state,
buckets concatenated). Where each parameter goes follows from the model alone
(:mod:`._megatron_buckets`); the flat tensors have the same layout at every DP size, so one
written checkpoint resumes at any DP size. Tensors are pulled one at a time: a DCP chunk is
one parameter's state; the legacy file is written by ``torch.save`` with its storage bytes
skipped, then each parameter's bytes are written into place. Everything goes to a staging
directory renamed into place once complete.
"""

from __future__ import annotations

import io
import math
import shutil
import struct
import tempfile
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from wrapped_optim.checkpoint._convert._canonical import MASTER, StateIndex, StateReader
from wrapped_optim.checkpoint._convert._megatron import (
    DP_RESHARDABLE,
    LEGACY,
    check_adam_state,
    check_widening,
    dcp_causes_raised,
    one_step,
    target_groups,
    write_common,
)
from wrapped_optim.checkpoint._convert._megatron_buckets import (
    BucketSlot,
    Buffer,
    ParamList,
    buffers_of,
    lay_out,
)
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError

__all__ = [
    "MegatronDpReshardableWriter",
    "MegatronLegacyWriter",
    "megatron_bucket_writer",
]

# Core's bucket state keys, and the canonical state each holds. HybridDeviceOptimizer's
# ``master_param`` is the FP32 main param again (Core saves and loads both).
_STORED = (("param", MASTER), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))
_OFFLOAD_MASTER = "master_param"
_PREFIX = "optimizer.distributed.dp_group_idx_0"
_BUCKET_PAD = 128  # Core pads each bucket to a multiple of lcm(DP size, 128)


@attrs.frozen
class _Placed:
    """One grad buffer as written: its dtypes, slots and unpadded bucket sizes."""

    buffer: Buffer
    slots: tuple[BucketSlot, ...]
    sizes: tuple[int, ...]

    @property
    def label(self) -> str:
        return f"{self.buffer.param_dtype}, {self.buffer.grad_dtype}"


def _buffers(
    model: Any, dtypes: Sequence[str] | None, grad_reduce_in_fp32: bool, fmt: str
) -> list[Buffer]:
    """The model's grad buffers: from a module (or model chunks) directly; from names and
    shapes (a :class:`ParamList`) with each parameter's dtype."""
    if not isinstance(model, ParamList):
        return buffers_of(model, grad_reduce_in_fp32=grad_reduce_in_fp32)
    if dtypes is None:
        raise MegatronFormatError(
            f"{fmt}: the grad buffers are named by the parameters' dtypes, which names and "
            "shapes do not give; pass the model itself (model= / --model)"
        )
    return model.buffers(dtypes, grad_reduce_in_fp32=grad_reduce_in_fp32)


def _place(
    index: StateIndex,
    model: Any,
    *,
    dtypes: Sequence[str] | None,
    bucket_size: int | None,
    grad_reduce_in_fp32: bool,
    fmt: str,
) -> list[_Placed]:
    """Each grad buffer's layout, checked against the state: every parameter of the model has
    the Adam state a DistributedOptimizer keeps, in its shape, and nothing is left over."""
    placed = []
    for buffer in _buffers(model, dtypes, grad_reduce_in_fp32, fmt):
        slots, sizes = lay_out(buffer, bucket_size=bucket_size)
        placed.append(_Placed(buffer, tuple(slots), tuple(sizes)))
    where = {slot.name: slot for entry in placed for slot in entry.slots}
    in_model = {name: where[name] for entry in placed for name, _ in entry.buffer.params}
    known = {param.name for param in index.params}
    for name, slot in in_model.items():
        if name not in known:
            raise MegatronFormatError(
                f"{fmt}: the model's parameter {name!r} has no optimizer state in the source; "
                "is it the model the state belongs to?"
            )
        param = index.param(name)
        if param.shape != slot.shape:
            raise MegatronFormatError(
                f"{fmt}: parameter {name!r} is {slot.shape} in the model, {param.shape} in "
                "the optimizer state"
            )
        check_adam_state(param, fmt)
    stray = sorted(known - set(in_model))
    if stray:
        raise MegatronFormatError(
            f"{fmt}: the optimizer state holds {stray[:3]}{' ...' if len(stray) > 3 else ''}, "
            "which the model has no trainable parameter for"
        )
    return placed


def _float32(reader: StateReader, name: str, key: str) -> tuple[torch.Tensor, bool]:
    """The state flattened to float32, and whether its memory is this writer's to free (a
    tensor handed over, or a copy made here; not a view of a reader's cache)."""
    tensor = reader.read(name, key)
    if tensor.dtype != torch.float32:
        check_widening(name, key, tensor.dtype)
        tensor = tensor.float()  # bf16/fp16 into float32: exact
    tensor = tensor.detach().cpu().contiguous()
    return tensor.reshape(-1), tensor._base is None


def _release(tensor: torch.Tensor) -> None:
    """Frees a tensor's memory now, whoever still references it."""
    storage = tensor.untyped_storage()
    if storage.resizable():
        storage.resize_(0)


def _pieces(entry: _Placed, bucket: int) -> Iterator[tuple[int, int, BucketSlot | None]]:
    """Bucket ``bucket``'s extent in order: ``(start, end, slot)`` per parameter and
    ``(start, end, None)`` per alignment gap."""
    cursor = 0
    for slot in sorted((s for s in entry.slots if s.bucket == bucket), key=lambda s: s.start):
        if slot.start > cursor:
            yield cursor, slot.start, None
        yield slot.start, slot.end, slot
        cursor = slot.end
    if cursor < entry.sizes[bucket]:
        yield cursor, entry.sizes[bucket], None


def _common(index: StateIndex, param_groups: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """``DistributedOptimizer.state_dict()``: the param groups with the one step; the grad
    scaler where the source had one."""
    groups = target_groups(index, param_groups)
    step = one_step(index)
    for group in groups:
        if step is not None:
            group["step"] = step
    common: dict[str, Any] = {"optimizer": {"param_groups": groups}}
    scaler = index.notes.get("megatron_grad_scaler")
    if isinstance(scaler, list) and len(scaler) == 1 and scaler[0] is not None:
        common["grad_scaler"] = scaler[0]
    return common


def _staged(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` into a fresh directory beside ``path`` (or into ``path`` itself when it is a
    caller's empty staging directory), renamed onto ``path`` once complete."""
    if path.is_dir() and not any(path.iterdir()):
        write(path)
        return
    if path.exists():
        raise MegatronFormatError(f"{path}: already exists; the writer makes a new directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(staging)
        staging.rename(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# --------------------------------------------------------------------------------------
# dp_reshardable
# --------------------------------------------------------------------------------------
def _object_bytes(value: Any) -> io.BytesIO:
    """A Megatron ``ShardedObject``'s stored form: its data in a list of one, torch-saved."""
    data = io.BytesIO()
    torch.save([value], data)
    data.seek(0)
    return data


class _Chunk:
    """One DCP chunk of a bucket tensor: a parameter's state (pulled when written) or a gap
    of zeros."""

    def __init__(self, reader: StateReader, name: str | None, key: str, numel: int) -> None:
        self.reader, self.name, self.key, self.numel = reader, name, key, numel

    def value(self) -> tuple[torch.Tensor, bool]:
        if self.name is None:
            return torch.zeros(self.numel, dtype=torch.float32), True
        return _float32(self.reader, self.name, self.key)


def _save_chunks(
    directory: Path,
    tensors: Mapping[str, tuple[int, Mapping[int, _Chunk]]],
    objects: Mapping[str, io.BytesIO],
) -> None:
    """``dcp.save`` of flat float32 tensors given as chunks (``fqn -> (numel, {offset:
    chunk})``) and of pre-serialised objects, without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    items = [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in objects]
    for fqn, (numel, chunks) in tensors.items():
        for offset, chunk in chunks.items():
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size([offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size([offset]), sizes=torch.Size([chunk.numel])
                        ),
                        properties=TensorProperties(dtype=torch.float32),
                        size=torch.Size([numel]),
                    ),
                )
            )

    class _Chunked(DefaultSavePlanner):
        last: torch.Tensor | None = None

        def create_local_plan(self) -> SavePlan:
            self.plan = SavePlan(items)
            return self.plan

        def resolve_data(self, write_item: WriteItem) -> Any:
            fqn = write_item.index.fqn
            if fqn in objects:
                return objects[fqn]
            # The file writer keeps what it wrote referenced until the file is closed: the
            # previous chunk (a tensor handed over by the reader) is released here.
            if self.last is not None:
                _release(self.last)
                self.last = None
            offset = write_item.index.offset
            assert offset is not None
            value, owned = tensors[fqn][1][int(offset[0])].value()
            self.last = value if owned else None
            return value

    writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1)
    planner = _Chunked(flatten_state_dict=False)
    with dcp_causes_raised():
        dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)


class _BucketWriter:
    """What both bucket-space writers are told: the model (and how DDP laid it out), the
    target's param groups."""

    def __init__(
        self,
        path: str | Path,
        model: Any,
        param_groups: Sequence[Mapping[str, Any]] | None,
        bucket_size: int | None,
        grad_reduce_in_fp32: bool,
        dtypes: Sequence[str] | None,
    ) -> None:
        self.path, self.model, self.param_groups = Path(path), model, param_groups
        self.bucket_size, self.grad_reduce_in_fp32 = bucket_size, grad_reduce_in_fp32
        self.dtypes = dtypes

    def _placed(self, index: StateIndex, fmt: str) -> list[_Placed]:
        return _place(
            index,
            self.model,
            dtypes=self.dtypes,
            bucket_size=self.bucket_size,
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
            fmt=fmt,
        )


class MegatronDpReshardableWriter(_BucketWriter):
    """Writes the canonical form as a Megatron ``dp_reshardable`` dist checkpoint.

    ``model``: the model the state is for (a module or Megatron's list of model chunks; the
    meta device will do; or a :class:`ParamList` with ``dtypes``): its parameters say where
    each one sits in DDP's buckets. ``bucket_size``: DDP's (None: one bucket per grad
    buffer, Megatron's layout without ``overlap_grad_reduce``). ``master_param``: also write
    HybridDeviceOptimizer's ``master_param`` (CPU offload; a copy of the main param); None
    writes it when the param groups are an offload optimizer's (``offload_fraction``).
    ``dp_size`` only sets the recorded padded bucket sizes: the stored tensors are the same
    at every DP size and load at any. A Megatron resume loads it with
    ``dist_checkpointing.load({key: optimizer.sharded_state_dict(model_sd, True,
    metadata={"distrib_optim_sharding_type": "dp_reshardable"})}, path)``.

    Example:
        >>> writer = MegatronDpReshardableWriter("out/optim", model=torch.nn.Linear(2, 2))
        >>> writer.path.name, writer.dp_size
        ('optim', 1)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        model: Any,
        dp_size: int = 1,
        key: str = "optimizer",
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        master_param: bool | None = None,
        bucket_size: int | None = None,
        grad_reduce_in_fp32: bool = True,
        dtypes: Sequence[str] | None = None,
    ) -> None:
        if dp_size < 1:
            raise MegatronFormatError(f"dp_size={dp_size}: a data-parallel size is at least 1")
        super().__init__(path, model, param_groups, bucket_size, grad_reduce_in_fp32, dtypes)
        self.dp_size, self.key, self.master_param = dp_size, key, master_param

    def write(self, index: StateIndex, reader: StateReader) -> None:
        placed = self._placed(index, DP_RESHARDABLE)
        common = _common(index, self.param_groups)
        offload = self.master_param
        if offload is None:
            offload = any("offload_fraction" in g for g in common["optimizer"]["param_groups"])
        stored = [*_STORED, (_OFFLOAD_MASTER, MASTER)] if offload else list(_STORED)
        pad = math.lcm(_BUCKET_PAD, self.dp_size)
        tensors: dict[str, tuple[int, dict[int, _Chunk]]] = {}
        unpadded: list[dict[tuple[torch.dtype, torch.dtype], list[int]]] = []
        padded: list[dict[tuple[torch.dtype, torch.dtype], list[int]]] = []
        for gbuf, entry in enumerate(placed):
            dtypes = (entry.buffer.param_dtype, entry.buffer.grad_dtype)
            unpadded.append({dtypes: list(entry.sizes)})
            padded.append({dtypes: [-(-size // pad) * pad for size in entry.sizes]})
            for bucket, size in enumerate(entry.sizes):
                base = f"{_PREFIX}.gbuf_idx_{gbuf}.dtype_({entry.label}).bucket_idx_{bucket}"
                for name, key in stored:
                    chunks = {
                        start: _Chunk(reader, None if slot is None else slot.name, key, end - start)
                        for start, end, slot in _pieces(entry, bucket)
                    }
                    tensors[f"{base}.{name}"] = (size, chunks)
        objects = {
            f"{_PREFIX}.{name}/shard_0_1": _object_bytes(value)
            for name, value in {
                **common,
                "per_bucket_numel": padded,
                "per_bucket_numel_unpadded": unpadded,
            }.items()
        }
        top = {self.key: {"param_state_sharding_type": "dp_reshardable"}}

        def write(directory: Path) -> None:
            _save_chunks(directory, tensors, objects)
            write_common(directory, top)

        _staged(self.path, write)


# --------------------------------------------------------------------------------------
# Legacy save_parameter_state
# --------------------------------------------------------------------------------------
_LEGACY_COMMON = "optimizer_common.pt"
_LEGACY_PARAM_STATE = "param_state.pt"


def _skeleton(placed: Sequence[_Placed]) -> tuple[dict[Any, Any], list[torch.Tensor]]:
    """``save_parameter_state``'s object with storage-less stand-ins for the flat tensors, and
    those stand-ins in the order ``torch.save`` numbers their storages."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    state: dict[Any, Any] = {"buckets_coalesced": True}
    order: list[torch.Tensor] = []
    with FakeTensorMode():
        for gbuf, entry in enumerate(placed):
            total = sum(entry.sizes)
            world: dict[str, Any] = {}
            for name, _ in _STORED:
                world[name] = torch.empty(total, dtype=torch.float32)
                order.append(world[name])
            world["numel_unpadded"] = total
            state[gbuf] = {(entry.buffer.param_dtype, entry.buffer.grad_dtype): world}
    return state, order


def _write_param_state(file: Path, placed: Sequence[_Placed], reader: StateReader) -> None:
    """``param_state.pt``: ``torch.save`` writes the structure with the storages' bytes
    skipped, then each parameter's state is written into place (and the zip CRCs fixed)."""
    import zipfile

    skeleton, order = _skeleton(placed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.serialization.skip_data(materialize_fake_tensors=True):
            torch.save(skeleton, file)
    with zipfile.ZipFile(file) as archive:
        records = {
            info.filename.rsplit("/data/", 1)[1]: info
            for info in archive.infolist()
            if "/data/" in info.filename and not info.filename.startswith(".")
        }
    infos = [records.get(str(number)) for number in range(len(order))]
    sizes = [None if info is None else info.file_size for info in infos]
    if sizes != [4 * tensor.numel() for tensor in order]:
        raise MegatronFormatError(f"{file}: torch.save numbered the storages unexpectedly")
    offsets = {}
    with open(file, "rb") as stream:
        for info in infos:
            assert info is not None
            stream.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", stream.read(4))
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    crcs: dict[str, int] = {}
    with open(file, "r+b") as stream:
        number = 0
        for entry in placed:
            for _, key in _STORED:
                info = infos[number]
                assert info is not None
                crc = 0
                base = 0
                stream.seek(offsets[info.filename])
                for bucket, size in enumerate(entry.sizes):
                    for start, end, slot in _pieces(entry, bucket):
                        at = offsets[info.filename] + 4 * (base + start)
                        if slot is None:
                            crc = _put(stream, at, torch.zeros(end - start), crc)
                        else:  # the tensor is dropped before the next is read
                            crc = _put(stream, at, _float32(reader, slot.name, key)[0], crc)
                    base += size
                crcs[info.filename] = crc
                number += 1
        _fix_crcs(stream, crcs)


def _put(stream: Any, at: int, value: torch.Tensor, crc: int) -> int:
    """Writes ``value``'s bytes (its own memory, no copy) at ``at``; the CRC-32 carried on."""
    data = value.numpy().data.cast("B")
    stream.seek(at)
    stream.write(data)
    return zlib.crc32(data, crc)


def _fix_crcs(stream: Any, crcs: Mapping[str, int]) -> None:
    """Puts each record's CRC-32 into its local header and its central directory entry."""
    import zipfile

    stream.seek(0)
    with zipfile.ZipFile(stream) as archive:
        infos = {info.filename: info for info in archive.infolist()}
    for name, crc in crcs.items():
        stream.seek(infos[name].header_offset)
        header = stream.read(30)
        (name_len,) = struct.unpack("<H", header[26:28])
        if header[:4] != b"PK\x03\x04" or stream.read(name_len).decode() != name:
            raise MegatronFormatError(f"param_state.pt: no local zip header for {name!r}")
        stream.seek(infos[name].header_offset + 14)
        stream.write(struct.pack("<I", crc))
    # The central directory: entries of 46 bytes plus name, extra and comment.
    stream.seek(0, 2)
    size = stream.tell()
    stream.seek(max(0, size - 65_557))
    tail = stream.read()
    end = tail.rfind(b"PK\x05\x06")
    count, start = _directory(stream, tail, end)
    position = start
    for _ in range(count):
        stream.seek(position)
        header = stream.read(46)
        if header[:4] != b"PK\x01\x02":
            raise MegatronFormatError("param_state.pt: unexpected zip central directory")
        name_len, extra_len, comment_len = struct.unpack("<HHH", header[28:34])
        name = stream.read(name_len).decode()
        if name in crcs:
            stream.seek(position + 16)
            stream.write(struct.pack("<I", crcs[name]))
        position += 46 + name_len + extra_len + comment_len


def _directory(stream: Any, tail: bytes, end: int) -> tuple[int, int]:
    """(entries, offset) of the zip central directory, zip64 or not."""
    count, _, start = struct.unpack("<HII", tail[end + 10 : end + 20])
    if count == 0xFFFF or start == 0xFFFFFFFF:
        locator = tail.rfind(b"PK\x06\x07", 0, end)
        (record,) = struct.unpack("<Q", tail[locator + 8 : locator + 16])
        stream.seek(record)
        zip64 = stream.read(56)
        if locator < 0 or zip64[:4] != b"PK\x06\x06":
            raise MegatronFormatError("param_state.pt: no zip64 end of central directory")
        count, _, start = struct.unpack("<QQQ", zip64[32:56])
    return count, start


class MegatronLegacyWriter(_BucketWriter):
    """Writes the canonical form as Megatron-LM's legacy optimizer files: a directory with
    ``optimizer_common.pt`` (``optimizer.state_dict()``) and ``param_state.pt``
    (``DistributedOptimizer.save_parameter_state``'s coalesced file), which
    ``optimizer.load_state_dict(torch.load(common))`` then
    ``optimizer.load_parameter_state(param_state)`` resume at any DP size.

    ``model``, ``bucket_size``, ``param_groups``, ``dtypes`` as for
    :class:`MegatronDpReshardableWriter`.

    Example:
        >>> MegatronLegacyWriter("out/legacy", model=torch.nn.Linear(2, 2)).path.name
        'legacy'
    """

    def __init__(
        self,
        path: str | Path,
        *,
        model: Any,
        param_groups: Sequence[Mapping[str, Any]] | None = None,
        bucket_size: int | None = None,
        grad_reduce_in_fp32: bool = True,
        dtypes: Sequence[str] | None = None,
    ) -> None:
        super().__init__(path, model, param_groups, bucket_size, grad_reduce_in_fp32, dtypes)

    def write(self, index: StateIndex, reader: StateReader) -> None:
        placed = self._placed(index, LEGACY)
        common = _common(index, self.param_groups)

        def write(directory: Path) -> None:
            _write_param_state(directory / _LEGACY_PARAM_STATE, placed, reader)
            torch.save(common, directory / _LEGACY_COMMON)

        _staged(self.path, write)


def megatron_bucket_writer(
    path: str | Path,
    fmt: str,
    *,
    model: Any,
    dp_size: int = 1,
    param_groups: Sequence[Mapping[str, Any]] | None = None,
    master_param: bool | None = None,
    bucket_size: int | None = None,
) -> MegatronDpReshardableWriter | MegatronLegacyWriter:
    """A writer of Megatron's bucket-space optimizer checkpoints: ``fmt`` is
    ``"megatron-dp-reshardable"`` or ``"megatron-legacy"``; ``model`` the model the state is
    for (a module or list of model chunks; the meta device will do).

    Example:
        >>> writer = megatron_bucket_writer("out/dp", "megatron-dp-reshardable",
        ...                                 model=torch.nn.Linear(2, 2), dp_size=2)
        >>> type(writer).__name__, writer.dp_size
        ('MegatronDpReshardableWriter', 2)
    """
    if fmt == DP_RESHARDABLE:
        return MegatronDpReshardableWriter(
            path,
            model=model,
            dp_size=dp_size,
            param_groups=param_groups,
            master_param=master_param,
            bucket_size=bucket_size,
        )
    if fmt == LEGACY:
        return MegatronLegacyWriter(
            path, model=model, param_groups=param_groups, bucket_size=bucket_size
        )
    raise MegatronFormatError(f"{fmt!r} is not a bucket-space Megatron format")
