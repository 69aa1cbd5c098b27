"""A DCP tensor read straight into its destination: one copy, from the file into the tensor.

DCP's own reader reads a stored tensor into a buffer, unpickles a tensor from that buffer and
copies it into the destination (three passes over its bytes). When the tensor is stored whole
(one chunk, no stream transform such as compression) and contiguous in the checkpoint's byte
order, its bytes are one range of one file: the record's pickle is read with its storage
left on the meta device (which gives the record's offset in the file without reading it),
and the range is then read with ``preadv`` into the destination's memory. Anything else
answers ``None`` and the caller takes DCP's general path.
"""

from __future__ import annotations

import ctypes
import io
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch

from wrapped_optim.checkpoint._convert._canonical import TensorSpec
from wrapped_optim.checkpoint._convert._errors import ConversionError

__all__ = ["WholeTensors"]


class _Window(io.RawIOBase):
    """``length`` bytes of ``fd`` from ``start``, as a seekable stream (torch.load's input)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.position, os.SEEK_END: self.length}[whence]
        self.position = min(max(base + offset, 0), self.length)
        return self.position

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.length - self.position)
        if wanted <= 0:
            return 0
        got = os.preadv(self.fd, [view[:wanted]], self.start + self.position)
        self.position += got
        return got


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The contiguous tensor's bytes, writable, whatever its dtype; valid while the tensor
    lives. (Not through ``numpy()``, which would pin the storage's size for good: writers
    free a tensor once written by resizing its storage to nothing.)"""
    nbytes = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _read_fully(fd: int, view: memoryview, offset: int, where: str) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise ConversionError(f"{where}: ends {len(view) - done} bytes short of a tensor")
        done += got


class WholeTensors:
    """Reads the tensors of a DCP directory that are stored whole, one copy each."""

    def __init__(self, path: Path, metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.ranges: dict[str, Any] = {}  # key -> its storage info, for whole tensors only
        storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
        by_fqn: dict[Any, list[Any]] = {}
        for index, info in storage.items():
            by_fqn.setdefault(getattr(index, "fqn", None), []).append(info)
        for key, entry in metadata.state_dict_metadata.items():
            if not isinstance(entry, TensorStorageMetadata) or len(entry.chunks) != 1:
                continue
            chunk, infos = entry.chunks[0], by_fqn.get(key, [])
            whole = not any(chunk.offsets) and tuple(chunk.sizes) == tuple(entry.size)
            if whole and len(infos) == 1 and not getattr(infos[0], "transform_descriptors", None):
                self.ranges[key] = infos[0]

    def read(self, key: str, spec: TensorSpec) -> torch.Tensor | None:
        """``key``'s tensor, or ``None`` when it is not stored in a form read directly."""
        info = self.ranges.get(key)
        if info is None:
            return None
        file = self.path / str(info.relative_path)
        fd = os.open(file, os.O_RDONLY)
        try:
            where = self._record(fd, int(info.offset), int(info.length), spec)
            if where is None:
                return None
            target = torch.empty(spec.shape, dtype=spec.dtype)
            if target.numel():
                view = _byte_view(target)
                if where + len(view) > int(info.offset) + int(info.length):
                    raise ConversionError(f"{file}: tensor {key!r} runs past its stored range")
                _read_fully(fd, view, where, str(file))
            return target
        finally:
            os.close(fd)

    @staticmethod
    def _record(fd: int, start: int, length: int, spec: TensorSpec) -> int | None:
        """The file offset of the stored tensor's first byte, when it is read directly."""
        window = cast(IO[bytes], _Window(fd, start, length))
        reader = torch._C.PyTorchFileReader(window)
        if "byteorder" in reader.get_all_records():
            order = bytes(reader.get_record("byteorder")).decode()
            if order != sys.byteorder:
                return None
        window.seek(0)
        meta = torch.load(window, map_location="meta", weights_only=True)
        if not isinstance(meta, torch.Tensor) or meta.dtype != spec.dtype:
            return None
        if tuple(meta.shape) != tuple(spec.shape) or not meta.is_contiguous():
            return None
        offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if not isinstance(offset, int):
            return None
        nbytes = math.prod(spec.shape) * meta.element_size()
        storage_bytes = meta.untyped_storage().nbytes()
        skip = meta.storage_offset() * meta.element_size()
        if skip + nbytes > storage_bytes:
            return None
        return int(start + offset + skip)
