"""DCP tensors stored whole, read from their file's memory map without a copy.

DCP's own reader reads a stored tensor into a buffer, unpickles a tensor from that buffer and
copies it into the destination (three passes over its bytes, two of the tensor in memory).
When the tensor is stored whole (one chunk, no stream transform such as compression) and
contiguous in the checkpoint's byte order, its bytes are one range of one file: the record's
pickle is read with its storage left on the meta device (which gives the record's offset in
the file without reading it), and the tensor handed on is a view of that range of the file,
mapped copy-on-write (as ``torch.load(mmap=True)`` maps a ``torch.save`` file; so the
process allocates nothing for it). The writer
then reads it once, straight from the page cache. Anything else answers ``None`` and the
caller takes DCP's general path.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch._C import PyTorchFileReader

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


class WholeTensors:
    """Reads the tensors of a DCP directory that are stored whole, one copy each."""

    def __init__(self, path: Path, metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._mappings: dict[Path, mmap.mmap] = {}  # data file -> its mapping
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
        """``key``'s tensor (a view of the file's mapping), or ``None`` when it is not stored
        in a form read directly."""
        info = self.ranges.get(key)
        if info is None:
            return None
        file = self.path / str(info.relative_path)
        fd = os.open(file, os.O_RDONLY)
        try:
            where = self._record(fd, int(info.offset), int(info.length), spec)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if where is None:
            return None
        nbytes = spec.numel * torch.empty((), dtype=spec.dtype).element_size()
        if nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.dtype)
        if where + nbytes > min(int(info.offset) + int(info.length), size):
            raise ConversionError(f"{file}: tensor {key!r} runs past its stored range")
        if file not in self._mappings:  # copy-on-write: the file is never written
            with file.open("rb") as stream:
                self._mappings[file] = mmap.mmap(stream.fileno(), size, access=mmap.ACCESS_COPY)
        mapped = self._mappings[file]
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=where)
        return raw.view(spec.dtype).view(spec.shape)  # a view: the mapping stays ours

    def close(self) -> None:
        self._mappings = {}  # unmapped once no tensor views them

    @staticmethod
    def _record(fd: int, start: int, length: int, spec: TensorSpec) -> int | None:
        """The file offset of the stored tensor's first byte, when it is read directly."""
        window = cast(IO[bytes], _Window(fd, start, length))
        reader = PyTorchFileReader(window)
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
