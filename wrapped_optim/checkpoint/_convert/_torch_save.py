"""``torch.save`` files of optimizer state dicts: read memory-mapped, written one tensor at a
time.

Reading: ``torch.load(mmap=True, weights_only=True)``; the optimizer state dict is found at
the top level or inside a container (transformers' ``optimizer.pt`` and Accelerate's
``optimizer.bin`` are bare state dicts; Lightning's checkpoint keeps them in a list under
``optimizer_states``; ``{"optimizer": ...}`` and the like are found too). Tensors stay in the
file's mapping until a writer asks for one.

Writing: the file torch.save would write, built as it builds it (a zip archive: a pickle that
names each tensor's storage by key, then one record per storage), except that the pickle is
written first from the tensors' shapes and each storage record is then filled from the
reader, one tensor alive at a time. ``torch.load`` (mmap or not, weights_only or not) reads
it as any torch.save file. Its records carry no zip CRC32 (as torch.save writes them with
``compute_crc32=False``): the checksum would take most of the conversion's time.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch
from torch._C import PyTorchFileWriter
from torch._utils import _rebuild_tensor_v2

from wrapped_optim._formats.checkpoint_files import read_torch_save
from wrapped_optim.checkpoint._convert._canonical import (
    ParamRecord,
    StateIndex,
    StateReader,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._layout import (
    NOTE_FLAVOUR,
    index_from_state_dict,
    state_dict_from_index,
)
from wrapped_optim.checkpoint._convert._options import FormatOptions
from wrapped_optim.inspection import InspectError

__all__ = ["TorchSaveReader", "TorchSaveWriter", "find_optimizer_state_dict", "looks_like"]

_SEARCH_DEPTH = 4


def _is_osd(node: Any) -> bool:
    return (
        isinstance(node, Mapping)
        and isinstance(node.get("state"), Mapping)
        and isinstance(node.get("param_groups"), (list, tuple))
    )


def _walk(node: Any, location: str, depth: int) -> Iterator[tuple[str, Any]]:
    if _is_osd(node):
        yield location, node
        return
    if depth == 0:
        return
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _walk(value, f"{location}.{key}" if location else str(key), depth - 1)
    elif isinstance(node, (list, tuple)):
        for position, value in enumerate(node):
            yield from _walk(value, f"{location}[{position}]", depth - 1)


def find_optimizer_state_dict(
    tree: Any, where: str, location: str | None
) -> tuple[str, Mapping[str, Any]]:
    """The one optimizer state dict in ``tree`` (or the one at ``location``)."""
    found = list(_walk(tree, "", _SEARCH_DEPTH))
    if location is not None:
        found = [(at, osd) for at, osd in found if at == location]
    if len(found) == 1:
        return found[0]
    if not found:
        at = f" at {location!r}" if location is not None else ""
        raise ConversionError(
            f"{where}: no optimizer state dict (a mapping with 'state' and 'param_groups'){at}"
        )
    places = ", ".join(repr(at or "<top level>") for at, _ in found)
    raise ConversionError(
        f"{where}: holds several optimizer state dicts ({places}); say which with location="
        " (CLI: --location)"
    )


def _spec_of(value: Any) -> TensorSpec | None:
    if isinstance(value, torch.Tensor):
        return TensorSpec(value.shape, value.dtype)
    return None


def looks_like(path: Path) -> bool:
    """A regular file starting as a zip archive (torch.save's format since torch 1.6)."""
    if not path.is_file():
        return False
    with path.open("rb") as stream:
        return stream.read(4) == b"PK\x03\x04"


class TorchSaveReader:
    """An optimizer state dict in a ``torch.save`` file, opened memory-mapped."""

    def __init__(self, path: str | os.PathLike[str], options: FormatOptions) -> None:
        self.path = Path(path)
        try:
            tree = read_torch_save(self.path, options.trusted)
        except InspectError as error:
            raise ConversionError(str(error)) from error
        self.location, osd = find_optimizer_state_dict(tree, str(self.path), options.location)
        self._index, self._stored = index_from_state_dict(
            osd, source=f"{self.path} (torch.save)", options=options, spec_of=_spec_of
        )
        self._tree: Any = tree

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        try:
            value = self._stored[(name, key)]
        except KeyError:
            raise ConversionError(f"{self.path}: no state {key!r} for parameter {name!r}") from None
        return value.detach().view(value.shape)  # a view: the file mapping stays ours

    def close(self) -> None:
        self._stored = {}
        self._tree = None


# ----------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------
_STORAGE_TYPES = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
}


class _Slot:
    """A tensor the pickle names before its values exist: storage ``key``, of ``spec``; its
    values are the reader's ``(name, state)``, or ``value`` for a small tensor at hand (a
    step)."""

    def __init__(
        self, key: str, name: str, state: str, spec: TensorSpec, value: torch.Tensor | None
    ) -> None:
        storage_type = _STORAGE_TYPES.get(spec.dtype)
        if storage_type is None:
            raise ConversionError(
                f"parameter {name!r}: state {state!r} is {spec.dtype}, which the "
                "torch.save writer does not write"
            )
        self.key, self.name, self.state, self.spec, self.value = key, name, state, spec, value
        self.storage_type = getattr(torch, storage_type)


class _StorageRef:
    def __init__(self, slot: _Slot) -> None:
        self.slot = slot


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


class _Pickler(pickle.Pickler):
    """Pickles slots as torch.save pickles tensors: ``_rebuild_tensor_v2`` over a storage
    named by a persistent id (``('storage', type, key, location, numel)``)."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            slot = obj.slot
            return ("storage", slot.storage_type, slot.key, "cpu", slot.spec.numel)
        return None

    def __init__(self, file: IO[bytes], slots: list[_Slot]) -> None:
        super().__init__(file, protocol=2)
        self.slots = slots

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):  # a tensor at hand (a step): stored like the rest
            value = obj.detach().cpu().contiguous()
            spec = TensorSpec(value.shape, value.dtype)
            self.slots.append(_Slot(str(len(self.slots)), "", "step", spec, value))
            obj = self.slots[-1]
        if isinstance(obj, _Slot):
            shape = torch.Size(obj.spec.shape)
            stride = _contiguous_stride(obj.spec.shape)
            args: tuple[Any, ...] = (_StorageRef(obj), 0, shape, stride, False, OrderedDict())
            return (_rebuild_tensor_v2, args)
        return NotImplemented


class TorchSaveWriter:
    """Writes an optimizer state dict file, keyed by index in ``options.names`` order, in
    ``options.flavour``'s layout (the source's by default)."""

    def __init__(self, path: str | os.PathLike[str], options: FormatOptions) -> None:
        self.path = Path(path)
        self.options = options

    def write(self, index: StateIndex, reader: StateReader) -> None:
        slots: list[_Slot] = []

        def slot(param: ParamRecord, key: str, spec: TensorSpec) -> _Slot:
            slots.append(_Slot(str(len(slots)), param.name, key, spec, None))
            return slots[-1]

        osd = state_dict_from_index(
            index,
            flavour=self.options.flavour or index.notes.get(NOTE_FLAVOUR, "torch"),
            keyed_by_name=False,
            value_of=slot,
            names=self.options.names,
        )
        buffer = io.BytesIO()
        _Pickler(buffer, slots).dump(osd)
        if str(self.path).isascii():  # torch's own file writer: no Python call per block
            _write_archive(str(self.path), buffer.getvalue(), slots, reader)
        else:
            with self.path.open("wb") as stream:
                _write_archive(stream, buffer.getvalue(), slots, reader)


def _write_archive(
    stream: IO[bytes] | str, data: bytes, slots: list[_Slot], reader: StateReader
) -> None:
    # No zip CRC32s (torch.save's compute_crc32=False): torch's checksum runs at a fifth of
    # the disk's speed here, torch.load does not check it, and verify= compares every tensor.
    archive = PyTorchFileWriter(stream, False, 64)
    try:
        _write_records(archive, data, slots, reader)
    except BaseException:
        # The archive must be ended while its stream is open (its destructor would write
        # into a closed stream and abort the process); the caller removes the file.
        with contextlib.suppress(Exception):
            archive.write_end_of_file()
        raise
    finally:
        del archive


def _write_records(
    archive: PyTorchFileWriter, data: bytes, slots: list[_Slot], reader: StateReader
) -> None:
    archive.write_record("data.pkl", data, len(data))
    archive.write_record(".format_version", b"1", 1)
    archive.write_record(".storage_alignment", b"64", 2)
    archive.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
    for slot in slots:
        tensor = slot.value if slot.value is not None else reader.read(slot.name, slot.state)
        if tensor.dtype != slot.spec.dtype or tuple(tensor.shape) != slot.spec.shape:
            raise ConversionError(
                f"parameter {slot.name!r}: state {slot.state!r} came as {tensor.dtype} "
                f"{tuple(tensor.shape)}, its index says {slot.spec.dtype} {slot.spec.shape}"
            )
        tensor = tensor.contiguous()  # a view of a mapping or a fresh tensor: no copy
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.storage_offset() or tensor.untyped_storage().nbytes() != nbytes:
            tensor = tensor.clone()  # a view into a larger storage: its own bytes only
        storage = tensor.untyped_storage()
        archive.write_record(f"data/{slot.key}", storage, nbytes)  # type: ignore[arg-type]
        del tensor, storage
    archive.write_end_of_file()
