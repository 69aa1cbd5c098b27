"""An undo journal on local disk: the old bytes of what a load overwrites, piece by piece.

Internal to :func:`wrapped_optim.checkpoint.load_optimizer` (its atomic load). Instead of a
copy of the state in host memory, the bytes a load is about to overwrite are written to a
file, at most ``piece_bytes`` at a time, and copied back if the load fails:

* the file lives in a private directory (``tempfile.mkdtemp``: mode 0700) made for it under
  ``directory`` (default: the system temp dir), is opened with mode 0600 and has no name
  from the moment it exists (``O_TMPFILE``, or created and unlinked at once); the directory
  is removed right after. Closing the journal frees its blocks, and so does the end of the
  process, however it ends: a crashed or killed load leaves nothing behind;
* a worker thread journals the regions in the order they will be read, ahead of the reader;
  the reader waits only for the region it is about to write (:meth:`UndoJournal.keep`), so
  journaling overlaps reading;
* each record carries a header (magic, sequence number, length, where its bytes start) and a
  checksum of its bytes (:func:`_checksum`), checked when it is replayed: a journal that cannot
  be replayed exactly raises :class:`~wrapped_optim._formats.errors.RollbackError` rather than
  restoring wrong values silently;
* where the filesystem takes ``O_DIRECT`` (local disks), the file bypasses the page cache and
  each piece is written from the tensor's own pages (its bytes sit in the record at their
  offset within their first page; only its partial first and last pages are copied), so
  neither the kernel nor this module copies it; replays read through one page-aligned 8 MiB
  buffer per thread. Elsewhere (tmpfs)
  CPU tensors are written from, and replayed into, their own memory. Device tensors go through
  one host piece at a time.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
import tempfile
import threading
import zlib
from collections.abc import Hashable, Iterable
from typing import Any

import attrs
import torch

from wrapped_optim._formats.errors import RollbackError, UndoJournalError

__all__ = ["UndoJournal"]

# magic, sequence number, byte count, skew (where the bytes start in the record's first
# block), the checksum (_checksum: sum of the words, CRC-32 of the block sums)
_HEADER = struct.Struct("<8sQQQQI")
_MAGIC = b"WOUNDO02"
_BLOCK_WORDS = 512  # the checksum's blocks: 4 KiB of 8-byte words
_PENDING, _BUSY, _DONE, _FAILED = range(4)
_CLOSING: list[threading.Thread] = []  # closes of earlier journals (see UndoJournal.close)
_ALIGN = 4096  # O_DIRECT transfers: offsets, lengths and buffers in whole blocks
_BOUNCE = 8 << 20  # bytes of one O_DIRECT transfer (one aligned buffer per thread)


@attrs.define(eq=False)
class _Region:
    """A tensor region to journal before it is written, and how far that has come."""

    tensor: torch.Tensor
    status: int = _PENDING
    error: BaseException | None = None


@attrs.define(eq=False)
class _Record:
    """One journaled piece: where its old bytes are, and where they go back to."""

    target: torch.Tensor  # the piece of the region (a view), replayed in place
    offset: int  # of the header in the file
    nbytes: int
    skew: int  # the bytes start this far into the record's first data block
    checksum: tuple[int, int]
    seq: int

    def header(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.seq, self.nbytes, self.skew, *self.checksum)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    array: Any = flat.view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def _pieces(tensor: torch.Tensor, piece_bytes: int) -> Iterable[torch.Tensor]:
    """``tensor`` as flat views of at most ``piece_bytes`` (itself when not contiguous)."""
    if not tensor.is_contiguous():
        yield tensor
        return
    flat = tensor.detach().reshape(-1)
    step = max(1, piece_bytes // max(1, flat.element_size()))
    for start in range(0, max(1, flat.numel()), step):
        yield flat[start : start + step]


class UndoJournal:
    """The old bytes of tensor regions, on disk until the load commits or rolls back.

    Plan regions in the order they will be written (:meth:`plan`), :meth:`start` the worker,
    call :meth:`keep` before writing each region, and end with :meth:`rollback` (on failure)
    and :meth:`close` (always). :meth:`keep_now` journals a tensor at once.

    Example:
        >>> import torch
        >>> state = torch.arange(6.0)
        >>> journal = UndoJournal(piece_bytes=8)
        >>> journal.plan("state", state); journal.start()
        >>> journal.keep("state"); _ = state.zero_()  # the load writes...
        >>> journal.rollback()  # ...and fails
        >>> journal.close()
        >>> state.tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    """

    def __init__(
        self, directory: str | os.PathLike[str] | None = None, piece_bytes: int = 64 << 20
    ) -> None:
        parent = os.fspath(directory) if directory is not None else tempfile.gettempdir()
        self.directory = parent
        self.piece_bytes = max(1, int(piece_bytes))
        try:
            private = tempfile.mkdtemp(prefix=".wrapped_optim_undo_", dir=parent)
            try:
                self._fd, self._align = _open_nameless(private)
            finally:
                os.rmdir(private)
        except OSError as exc:
            raise UndoJournalError(
                exc.errno or errno.EIO,
                f"cannot create the atomic load's undo journal in {parent!r} ({exc}); pass "
                "journal_dir= a writable local directory, or atomic=False",
            ) from exc
        self._bounce = threading.local()  # per thread: an aligned buffer for O_DIRECT
        self._cond = threading.Condition()
        self._end = 0  # where the next record goes
        self._seq = 0
        self._records: list[_Record] = []
        self._regions: dict[Hashable, _Region] = {}
        self._order: list[Hashable] = []
        self._stop = False
        self._worker: threading.Thread | None = None
        self.written = 0  # bytes journaled (headers excluded)

    # -- journaling ----------------------------------------------------------------------
    def plan(self, key: Hashable, tensor: torch.Tensor) -> None:
        """Adds a region that will be written later (journaled ahead by :meth:`start`)."""
        if key not in self._regions:
            self._regions[key] = _Region(tensor)
            self._order.append(key)

    def planned_bytes(self) -> int:
        """Bytes the planned regions will take (without record headers)."""
        return sum(r.tensor.numel() * r.tensor.element_size() for r in self._regions.values())

    def reserve(self, nbytes: int) -> None:
        """Raises :class:`UndoJournalError` (ENOSPC) unless the journal's filesystem has room
        for ``nbytes`` (plus headers) now, before anything is written."""
        needed = nbytes + _HEADER.size * (len(self._regions) + nbytes // self.piece_bytes + 1)
        free = _free_bytes(self._fd)
        if needed > free and _CLOSING:  # earlier journals may still be freeing their blocks
            while _CLOSING:
                _CLOSING.pop().join()
            free = _free_bytes(self._fd)
        if needed > free:
            raise UndoJournalError(
                errno.ENOSPC,
                f"the atomic load's undo journal needs {needed:,} bytes in {self.directory!r}, "
                f"which has {free:,} free; pass journal_dir= a directory with room, or "
                "atomic=False (no undo: a failure while reading leaves a partial load)",
            )

    def start(self) -> None:
        """Starts journaling the planned regions, in plan order, in a worker thread."""
        if self._worker is None and self._order:
            self._worker = threading.Thread(
                target=self._work, name="wrapped_optim-undo-journal", daemon=True
            )
            self._worker.start()

    def keep(self, key: Hashable) -> None:
        """Returns once the planned region ``key`` is journaled (journals it now if the worker
        has not come to it); raises :class:`UndoJournalError` if it could not be. An unplanned
        key is a region with nothing to undo (a new tensor): nothing to do."""
        region = self._regions.get(key)
        if region is None:
            return
        with self._cond:
            while region.status == _BUSY:
                self._cond.wait()
            mine = region.status == _PENDING
            if mine:
                region.status = _BUSY
        if mine:
            self._journal(region)
        if region.status == _FAILED:
            raise self._failure(region)

    def keep_now(self, tensor: torch.Tensor) -> None:
        """Journals ``tensor`` now, in the calling thread."""
        region = _Region(tensor, status=_BUSY)
        self._journal(region)
        if region.status == _FAILED:
            raise self._failure(region)

    def _failure(self, region: _Region) -> BaseException:
        error = region.error
        if isinstance(error, UndoJournalError) or not isinstance(error, Exception):
            return error or UndoJournalError(errno.EIO, "the undo journal failed")  # Ctrl-C
        code = error.errno if isinstance(error, OSError) and error.errno else errno.EIO
        failure = UndoJournalError(
            code,
            f"writing the atomic load's undo journal in {self.directory!r} failed ({error}); "
            "the optimizer was put back as it was. Pass journal_dir= a directory with room, "
            "or atomic=False",
        )
        failure.__cause__ = error
        return failure

    def _work(self) -> None:
        for key in self._order:
            region = self._regions[key]
            with self._cond:
                if self._stop:
                    return
                if region.status != _PENDING:
                    continue
                region.status = _BUSY
            self._journal(region)
            if region.status == _FAILED:
                return  # the reader meets the error at this region (or journals the rest)

    def _journal(self, region: _Region) -> None:
        """Writes a region's records (called with the region BUSY and owned by the caller)."""
        error: BaseException | None = None
        try:
            records = [self._write(piece) for piece in _pieces(region.tensor, self.piece_bytes)]
        except BaseException as exc:  # handed to the thread that writes it
            status, error = _FAILED, exc
            records = []
        else:
            status = _DONE
        with self._cond:
            self._records.extend(records)  # completion order: replayed last to first
            region.status, region.error = status, error
            self._cond.notify_all()

    def _write(self, piece: torch.Tensor) -> _Record:
        host = piece.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")  # one piece of host memory
        host = host.contiguous()
        data = _host_bytes(host)
        address = host.data_ptr()
        skew = address % self._align if len(data) else 0
        head = self._aligned(_HEADER.size)
        with self._cond:
            offset, seq = self._end, self._seq
            self._end += head + self._aligned(skew + len(data))
            self._seq += 1
            self.written += len(data)
        record = _Record(piece, offset, len(data), skew, _checksum(data), seq)
        if self._align > 1:
            self._put_direct(data, address, offset + head, skew)
        elif len(data):
            self._put(data, offset + head)
        self._put(memoryview(record.header()), offset)
        return record

    def _put_direct(self, data: memoryview, address: int, offset: int, skew: int) -> None:
        """Writes ``data`` (at ``address`` in memory) at ``offset + skew`` under O_DIRECT: the
        pages wholly inside it straight from its memory (no copy); its partial first and last
        pages, whose other bytes the reader may be writing meanwhile, through the bounce
        buffer (under a page each), as is all of it where O_DIRECT refuses the memory."""
        end = skew + len(data)
        lo, hi = self._aligned(skew), end // self._align * self._align
        if hi < lo:  # inside one page
            self._put(data, offset, skew)
            return
        if lo > skew:
            self._put(data[: lo - skew], offset, skew)
        if hi > lo:
            try:
                _pwrite_all(self._fd, _span(address - skew + lo, hi - lo), offset + lo)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EFAULT):
                    raise
                self._put(data[lo - skew : hi - skew], offset + lo)  # memory O_DIRECT refuses
        if end > hi:
            self._put(data[hi - skew :], offset + hi)

    def _aligned(self, n: int) -> int:
        return -(-n // self._align) * self._align

    def _buffer(self) -> mmap.mmap:
        """This thread's bounce buffer (page aligned) for O_DIRECT transfers."""
        found: mmap.mmap | None = getattr(self._bounce, "buffer", None)
        if found is None:
            found = self._bounce.buffer = mmap.mmap(
                -1, min(_BOUNCE, self._aligned(self.piece_bytes))
            )
        return found

    def _put(self, data: memoryview, offset: int, skew: int = 0) -> None:
        """Writes ``data`` at ``offset + skew`` (under O_DIRECT: through the bounce buffer, in
        whole blocks from ``offset``, zeros around it)."""
        if self._align == 1:
            _pwrite_all(self._fd, data, offset + skew)
            return
        view = memoryview(self._buffer())
        end = skew + len(data)
        for start in range(0, max(1, end), len(view)):
            stop = min(start + len(view), end)
            first = max(start, skew)  # the window's first byte of data
            block = self._aligned(stop - start)
            view[: first - start] = bytes(first - start)
            view[first - start : stop - start] = data[first - skew : stop - skew]
            view[stop - start : block] = bytes(block - (stop - start))
            _pwrite_all(self._fd, view[:block], offset + start)

    def _get(self, data: memoryview, offset: int, skew: int = 0) -> int:
        """Reads ``len(data)`` bytes at ``offset + skew`` into ``data``; returns how many
        there were (under O_DIRECT: through the bounce buffer, in whole blocks)."""
        if self._align == 1:
            return os.preadv(self._fd, [data], offset + skew) if len(data) else 0
        view, got = memoryview(self._buffer()), 0
        end = skew + len(data)
        for start in range(0, end, len(view)):
            stop = min(start + len(view), end)
            first = max(start, skew)
            n = os.preadv(self._fd, [view[: self._aligned(stop - start)]], offset + start)
            n = max(0, min(n, stop - start) - (first - start))
            data[first - skew : first - skew + n] = view[first - start : first - start + n]
            got += n
            if first + n < stop:
                break
        return got

    # -- ending --------------------------------------------------------------------------
    def _halt(self) -> None:
        with self._cond:
            self._stop = True
        if self._worker is not None:
            self._worker.join()

    @torch.no_grad()
    def rollback(self) -> None:
        """Copies every journaled region back (last journaled first). Raises
        :class:`RollbackError` after replaying the rest if a record is missing or damaged."""
        self._halt()
        problems: list[str] = []
        for record in reversed(self._records):
            try:
                self._replay(record)
            except (OSError, ValueError) as exc:
                problems.append(f"record {record.seq}: {exc}")
        if problems:
            raise RollbackError(
                f"the load failed and its undo journal (in {self.directory!r}) could not be "
                f"replayed: {'; '.join(problems[:3])}"
                f"{f' (and {len(problems) - 3} more)' if len(problems) > 3 else ''}. The "
                "optimizer is partly loaded: load a good checkpoint into it before training."
            )

    def _replay(self, record: _Record) -> None:
        header = bytearray(self._aligned(_HEADER.size))
        if self._get(memoryview(header), record.offset) < _HEADER.size:
            raise ValueError("missing (the journal is shorter than written)")
        if bytes(header[: _HEADER.size]) != record.header():
            raise ValueError("damaged header")
        target = record.target
        direct = target.device.type == "cpu" and target.is_contiguous()
        host = target if direct else torch.empty(target.shape, dtype=target.dtype)
        data = _host_bytes(host)
        start = record.offset + self._aligned(_HEADER.size)
        if self._get(data, start, record.skew) != record.nbytes:
            raise ValueError("missing bytes (the journal is shorter than written)")
        if _checksum(data) != record.checksum:
            raise ValueError("checksum mismatch")
        if not direct:
            target.copy_(host)

    @property
    def direct(self) -> bool:
        """Whether the file is written with ``O_DIRECT`` (bypassing the page cache)."""
        return self._align > 1

    def fileno(self) -> int:
        """The journal file's descriptor (it has no path)."""
        return self._fd

    def close(self) -> None:
        """Stops the worker and closes the file, which frees its blocks (it has no name).

        The close runs on a thread of its own: freeing a file's blocks takes the filesystem
        about 0.3 s per GiB, which the load need not wait for. A later :meth:`reserve` that
        finds too little room waits for such closes before it refuses."""
        self._halt()
        self._bounce = threading.local()  # this thread's buffer goes (the worker's went)
        if self._fd >= 0:
            closing = threading.Thread(
                target=os.close, args=(self._fd,), name="wrapped_optim-undo-close", daemon=True
            )
            closing.start()
            _CLOSING[:] = [*(t for t in _CLOSING if t.is_alive()), closing]
            self._fd = -1

    def __enter__(self) -> UndoJournal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open_nameless(directory: str) -> tuple[int, int]:
    """A read-write file in ``directory`` that has no name (mode 0600), and the alignment its
    transfers need: ``O_DIRECT`` where the filesystem takes it (no page cache: the kernel
    neither copies the journal nor reclaims pages for it), else 1 (buffered)."""
    flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
    tmpfile, direct = getattr(os, "O_TMPFILE", 0), getattr(os, "O_DIRECT", 0)
    for extra, align in ((direct, _ALIGN), (0, 1)):
        if align > 1 and not direct:
            continue
        try:
            if tmpfile:
                return os.open(directory, flags | tmpfile | extra, 0o600), align
            fd, path = tempfile.mkstemp(dir=directory)
            os.unlink(path)
            if extra:
                os.close(fd)
                raise OSError(errno.EINVAL, "O_DIRECT needs O_TMPFILE here")
            return fd, align
        except OSError as exc:
            if not extra or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.EISDIR):
                raise
    raise OSError(errno.EINVAL, "cannot open a nameless file")  # unreachable


def _checksum(data: memoryview) -> tuple[int, int]:
    """The checksum of a record's bytes: the 64-bit wrapping sum of their little-endian 8-byte
    words (the last one zero-padded), and the CRC-32 of the sums of each 4 KiB block in order.

    The sum changes with any change confined to one word (every single-bit flip); the CRC of
    the block sums with a block that is missing, stale or out of place. Both come from one
    pass at memory speed (about 3x faster than a CRC-32 of the bytes, which was most of the
    journal's CPU time).

    Example:
        >>> data = memoryview(bytes(range(256)) * 40)
        >>> _checksum(data) == _checksum(memoryview(bytes(data)))
        True
        >>> flipped = bytearray(data); flipped[5000] ^= 0x10
        >>> _checksum(data) == _checksum(memoryview(flipped))
        False
    """
    import numpy as np  # here, not at import: the package (and its CLI) imports without it

    whole = len(data) - len(data) % 8
    words = np.frombuffer(data, dtype="<u8", count=whole // 8) if whole else np.zeros(0, "<u8")
    full = len(words) - len(words) % _BLOCK_WORDS
    sums = words[:full].reshape(-1, _BLOCK_WORDS).sum(axis=1, dtype=np.uint64)
    if full < len(words) or whole < len(data):
        tail = int.from_bytes(bytes(data[whole:]), "little")  # the zero-padded last word
        last = (int(words[full:].sum(dtype=np.uint64)) + tail) % 2**64
        sums = np.append(sums, np.uint64(last))
    return int(sums.sum(dtype=np.uint64)), zlib.crc32(sums.astype("<u8").tobytes())


def _span(address: int, nbytes: int) -> memoryview:
    """``nbytes`` of this process's memory from ``address``, as a writable byte view."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _free_bytes(fd: int) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``fd``."""
    stat = os.fstatvfs(fd)
    return stat.f_bavail * stat.f_frsize


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, "short write to the undo journal")
        view, offset = view[written:], offset + written
