"""The atomic streaming load's undo journal (issue 29): bounded host memory, undo on disk.

The journal itself (every dtype, shape and layout, pieces of any size) round-trips exactly;
a load that fails at any point — the reader after k chunks, the journal's own writes (no
space, I/O errors), too little room before the first read — leaves the optimizer bitwise
as it was; a journal that is damaged or cut short is reported, never replayed silently; and
no journal file outlives a load, not even a killed one.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader

from wrapped_optim._formats.errors import RollbackError, UndoJournalError
from wrapped_optim.checkpoint import _journal as journal_module
from wrapped_optim.checkpoint import _load as load_module
from wrapped_optim.checkpoint import load_optimizer, save_optimizer
from wrapped_optim.checkpoint._journal import UndoJournal
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.testing import assert_state_dict_equal, checkpoint_roundtrip

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

CHUNK = 256  # bytes: many read items (and journal records) per tensor


# ------------------------------------------------------------------------------------------
# The journal on its own
# ------------------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int16, torch.uint8, torch.bool]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # not contiguous: journaled through one host copy
    return t


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


@given(
    tensors=st.lists(_tensors(), min_size=1, max_size=6),
    piece_bytes=st.integers(1, 64),
    keep_order=st.permutations(range(6)),
)
def test_the_journal_puts_back_every_dtype_shape_and_layout(
    tensors: list[torch.Tensor], piece_bytes: int, keep_order: list[int]
) -> None:
    """Plan, start, keep (in any order) and overwrite, roll back: the same bits, in the same
    tensor objects; regions journaled twice (a later write over a kept one) end as the first."""
    before = [_bits(t) for t in tensors]
    with UndoJournal(piece_bytes=piece_bytes) as journal:
        for i, t in enumerate(tensors):
            journal.plan(i, t)
        journal.start()
        for i in (k for k in keep_order if k < len(tensors)):
            journal.keep(i)
            tensors[i].fill_(1)
        journal.keep_now(tensors[0])  # the new value of a region journaled before
        tensors[0].fill_(0)
        journal.rollback()
        assert journal.written == sum(b.numel() for b in before) + before[0].numel()
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(_bits(t), old)


def test_the_journal_file_has_no_name_and_a_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made in a mode-0700 directory that is gone once the file is open; the file (0600) has
    no name, so nothing is left behind whatever happens to the process."""
    made: list[tuple[str, int]] = []
    original = journal_module.tempfile.mkdtemp

    def spying(*args: Any, **kwargs: Any) -> str:
        path = original(*args, **kwargs)
        made.append((path, stat.S_IMODE(os.stat(path).st_mode)))
        return path

    monkeypatch.setattr(journal_module.tempfile, "mkdtemp", spying)
    with UndoJournal(tmp_path) as journal:
        journal.keep_now(torch.arange(10.0))
        assert [mode for _, mode in made] == [0o700]
        assert Path(made[0][0]).name.startswith(".wrapped_optim_undo_")  # hidden, named
        assert list(tmp_path.iterdir()) == []
        assert stat.S_IMODE(os.fstat(journal.fileno()).st_mode) == 0o600
        assert os.fstat(journal.fileno()).st_nlink == 0
        assert os.fstat(journal.fileno()).st_size > 40


def test_the_journal_refuses_a_directory_without_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "_free_bytes", lambda fd: 1000)
    with UndoJournal(tmp_path) as journal:
        journal.plan("a", torch.zeros(1000))
        with pytest.raises(UndoJournalError, match=r"needs 4,\d+ bytes .* has 1,000 free") as e:
            journal.reserve(journal.planned_bytes())
        assert e.value.errno == errno.ENOSPC


def test_a_missing_journal_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UndoJournalError) as raised:
        UndoJournal(tmp_path / "absent")
    assert raised.value.errno == errno.ENOENT  # the cause's own errno
    assert str(raised.value).startswith(
        f"[Errno {errno.ENOENT}] cannot create the atomic load's undo journal in "
        f"{str(tmp_path / 'absent')!r} ("
    )
    assert str(raised.value).endswith(
        "pass journal_dir= a writable local directory, or atomic=False"
    )


# ------------------------------------------------------------------------------------------
# Atomic loads through the journal (real files, real optimizers)
# ------------------------------------------------------------------------------------------
def _params(seed: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(24, 8), (8,)]]


def _adamw(seed: int) -> Any:
    return torch.optim.AdamW(_params(seed, torch.float32), lr=1e-2)


def _holder(moments: torch.dtype) -> Callable[[int], Any]:
    def build(seed: int) -> Any:
        return PrecisionAwareAdamW(
            _params(seed, torch.bfloat16),
            lr=1e-2,
            exp_avg_dtype=moments,
            exp_avg_sq_dtype=torch.float16 if moments == torch.uint8 else moments,
            master_weights=True,
            store_param_remainders=True,
        )

    return build


BUILDERS: dict[str, Callable[[int], Any]] = {
    "adamw": _adamw,
    "holder(bf16)": _holder(torch.bfloat16),
    "holder(fp8,fp16)": _holder(torch.uint8),
}


def _train(opt: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _snapshot(opt: Any) -> Any:
    return checkpoint_roundtrip(opt.state_dict())


def _saved(name: str, path: Path, seed: int = 0) -> Any:
    opt = BUILDERS[name](seed)
    _train(opt, 3, seed=seed + 1)
    save_optimizer(opt, path, chunk_bytes=CHUNK)
    return _snapshot(opt)


def _victim(name: str) -> tuple[Any, Any]:
    opt = BUILDERS[name](7)
    _train(opt, 1, seed=4)
    return opt, _snapshot(opt)


def _failing_after(original: Callable[..., Any], calls: int, error: BaseException) -> Any:
    count = [0]

    def failing(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] > calls:
            raise error
        return original(*args, **kwargs)

    return failing


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_an_atomic_load_journals_the_state_as_stored_and_nothing_else(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal holds exactly the bytes the load overwrites (the state as stored), none
    of it is kept in memory, and the load's result equals ``atomic=False``'s."""
    good = _saved(name, tmp_path / "ckpt")
    journals: list[UndoJournal] = []
    original = UndoJournal.start

    def spying(self: UndoJournal) -> None:
        journals.append(self)
        original(self)

    opt, _ = _victim(name)
    stored = sum(t.numel() * t.element_size() for e in opt.state.values() for t in e.values())
    monkeypatch.setattr(UndoJournal, "start", spying)
    load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
    assert [j.written for j in journals] == [stored]
    assert_state_dict_equal(good, _snapshot(opt), names=("saved", "loaded"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("fault", ["enospc", "eio", "keyboard-interrupt"])
def test_a_journal_write_failing_after_k_records_leaves_the_optimizer_unchanged(
    name: str, fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills (or fails) while the journal is written, after k of its records: the
    load raises UndoJournalError (Ctrl-C stays itself), the optimizer is bitwise as it was,
    no journal is left, and a retry loads exactly."""
    good = _saved(name, tmp_path / "ckpt")
    errors: dict[str, Callable[[], BaseException]] = {
        "enospc": lambda: OSError(errno.ENOSPC, "No space left on device"),
        "eio": lambda: OSError(errno.EIO, "Input/output error"),
        "keyboard-interrupt": KeyboardInterrupt,
    }
    original = journal_module._pwrite_all
    for k in (0, 1, 4):  # record k (of about 10): its header and data are two writes
        opt, before = _victim(name)
        with monkeypatch.context() as patch:
            patch.setattr(
                journal_module, "_pwrite_all", _failing_after(original, 2 * k, errors[fault]())
            )
            expected = KeyboardInterrupt if fault == "keyboard-interrupt" else UndoJournalError
            with pytest.raises(expected) as raised:
                load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
        if fault == "enospc":
            assert raised.value.errno == errno.ENOSPC  # type: ignore[union-attr]
            assert "journal_dir=" in str(raised.value)
        assert_state_dict_equal(before, _snapshot(opt), names=(f"before ({k})", "after"))
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
        load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
        assert_state_dict_equal(good, _snapshot(opt), names=("saved", f"retried ({k})"))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_too_little_room_for_the_journal_refuses_before_the_first_read(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _saved(name, tmp_path / "ckpt")
    opt, before = _victim(name)
    reads = [0]
    original = load_module.StreamingLoadPlanner.resolve_tensor

    def counting(self: Any, *args: Any) -> Any:
        reads[0] += 1
        return original(self, *args)

    monkeypatch.setattr(load_module.StreamingLoadPlanner, "resolve_tensor", counting)
    monkeypatch.setattr(journal_module, "_free_bytes", lambda fd: 100)
    with pytest.raises(UndoJournalError, match="has 100 free; pass journal_dir="):
        load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
    assert reads[0] == 0
    assert_state_dict_equal(before, _snapshot(opt), names=("before", "after"))
    load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, atomic=False)  # needs no room


def _damage_then_fail(
    monkeypatch: pytest.MonkeyPatch, damage: Callable[[int], None], after_reads: int
) -> None:
    """The reader fails after ``after_reads`` reads; the journal is damaged just before the
    rollback replays it."""
    original_read = load_module.StreamingLoadPlanner.resolve_tensor
    monkeypatch.setattr(
        load_module.StreamingLoadPlanner,
        "resolve_tensor",
        _failing_after(original_read, after_reads, OSError(errno.EIO, "planted read error")),
    )
    original_rollback = UndoJournal.rollback

    def damaged(self: UndoJournal) -> None:
        damage(self.fileno())
        original_rollback(self)

    monkeypatch.setattr(UndoJournal, "rollback", damaged)


def _flip_data_bytes(fd: int) -> None:
    size = os.fstat(fd).st_size
    plain = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the journal may use O_DIRECT
    try:
        for offset in range(40, size, 97):  # headers and record data everywhere
            byte = os.pread(plain, 1, offset)
            os.pwrite(plain, bytes([byte[0] ^ 0xFF]), offset)
        os.fsync(plain)
    finally:
        os.close(plain)


DAMAGE = {
    "corrupt": _flip_data_bytes,
    "missing": lambda fd: os.ftruncate(fd, 0),
    "cut short": lambda fd: os.ftruncate(fd, os.fstat(fd).st_size // 2),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_damaged_journal_is_reported_not_replayed_silently(
    name: str, damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load fails after 6 reads and its journal has been cut short, truncated or corrupted:
    RollbackError (the load's own failure as its context) says the optimizer is partly
    loaded; a load from a good checkpoint then recovers exactly; no journal is left."""
    good = _saved(name, tmp_path / "ckpt")
    opt, _ = _victim(name)
    with monkeypatch.context() as patch:
        _damage_then_fail(patch, DAMAGE[damage], after_reads=6)
        with pytest.raises(RollbackError, match="partly loaded") as raised:
            load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
    assert raised.value.__context__ is not None
    assert any(w in str(raised.value) for w in ("checksum mismatch", "missing", "damaged"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
    assert_state_dict_equal(good, _snapshot(opt), names=("saved", "recovered"))


@given(
    name=st.sampled_from(sorted(BUILDERS)),
    seed=st.integers(0, 50),
    chunk=st.sampled_from([64, 256, 4096]),
    fail_after=st.one_of(st.none(), st.integers(0, 40)),
)
def test_atomic_load_round_trips_or_leaves_the_optimizer_unchanged(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    seed: int,
    chunk: int,
    fail_after: int | None,
) -> None:
    """Property: for any optimizer, state, chunk size and read at which the load fails (or
    none), the atomic load gives the saved state or leaves the optimizer bitwise as it was,
    and never leaves a journal behind."""
    root = tmp_path_factory.mktemp("roundtrip")
    opt = BUILDERS[name](seed)
    _train(opt, 1 + seed % 3, seed=seed)
    save_optimizer(opt, root / "ckpt", chunk_bytes=chunk)
    good = _snapshot(opt)
    victim, before = _victim(name)
    journal_dir = root / "journal"
    journal_dir.mkdir()
    original = FileSystemReader._slice_file
    reader = (
        original
        if fail_after is None
        else _failing_after(original, fail_after, OSError(errno.EIO, "planted"))
    )
    FileSystemReader._slice_file = reader  # type: ignore[method-assign]
    try:
        load_optimizer(victim, root / "ckpt", chunk_bytes=chunk, journal_dir=journal_dir)
        loaded = True
    except BaseException:  # DCP's CheckpointException (a BaseException)
        loaded = False
    finally:
        FileSystemReader._slice_file = original  # type: ignore[method-assign]
    assert loaded or fail_after is not None
    expected = good if loaded else before
    assert_state_dict_equal(expected, _snapshot(victim), names=("expected", "after"))
    assert list(journal_dir.iterdir()) == []


def test_a_killed_load_leaves_no_journal(tmp_path: Path) -> None:
    """SIGKILL in the middle of an atomic load (its journal half written): nothing of the
    journal remains in ``journal_dir``."""
    _saved("holder(bf16)", tmp_path / "ckpt")
    journal_dir = tmp_path / "journal"
    journal_dir.mkdir()
    script = textwrap.dedent(
        f"""
        import os, signal, torch
        from wrapped_optim.checkpoint import _journal as journal, load_optimizer
        from wrapped_optim.optimizers import PrecisionAwareAdamW
        original = journal._pwrite_all
        calls = [0]
        def dying(*args):
            calls[0] += 1
            if calls[0] == 9:
                os.kill(os.getpid(), signal.SIGKILL)
            original(*args)
        journal._pwrite_all = dying
        params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in [(24, 8), (8,)]]
        opt = PrecisionAwareAdamW(params, exp_avg_dtype=torch.bfloat16,
                                  exp_avg_sq_dtype=torch.bfloat16, master_weights=True,
                                  store_param_remainders=True)
        for p in params:
            opt.initialize_state(p, opt.layout.uses_remainder(p))  # state to overwrite, no kernel
        load_optimizer(opt, {str(tmp_path / "ckpt")!r}, chunk_bytes={CHUNK},
                       journal_dir={str(journal_dir)!r})
        """
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, check=False)
    assert done.returncode == -signal.SIGKILL
    assert list(journal_dir.iterdir()) == []


def test_the_default_atomic_load_keeps_no_copy_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No state tensor is cloned for the undo (it used to be a whole copy of the state)."""
    _saved("holder(fp8,fp16)", tmp_path / "ckpt")
    opt, _ = _victim("holder(fp8,fp16)")
    state = {t.untyped_storage().data_ptr() for e in opt.state.values() for t in e.values()}
    cloned: list[int] = []
    original = torch.Tensor.clone

    def spying(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.untyped_storage().data_ptr() in state:
            cloned.append(self.numel())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", spying)
    load_module.load_optimizer(opt, tmp_path / "ckpt", chunk_bytes=CHUNK, journal_dir=tmp_path)
    assert cloned == []


@pytest.mark.parametrize("direct", [True, False])
def test_the_journal_works_with_and_without_o_direct(
    direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT (bounce buffers, whole blocks) where the filesystem takes it, buffered
    writes elsewhere (tmpfs, other systems): both put back the same bits, over pieces larger
    than one bounce buffer and records that are not a whole number of blocks."""
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(journal_module, "_BOUNCE", 8192)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(5000, generator=g), torch.randn(7, 3, generator=g).t()]
    before = [_bits(t) for t in tensors]
    with UndoJournal(tmp_path, piece_bytes=12_000) as journal:
        assert journal.direct == (direct and hasattr(os, "O_DIRECT"))
        for t in tensors:
            journal.keep_now(t)
            t.zero_()
        journal.rollback()
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(_bits(t), old)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------
# Records: written from the tensor's own pages, checked by a word-sum checksum
# ------------------------------------------------------------------------------------------
@given(data=st.binary(min_size=1, max_size=20_000), bit=st.integers(0, 2**31))
def test_the_checksum_sees_every_single_bit_flip(data: bytes, bit: int) -> None:
    flipped = bytearray(data)
    flipped[(bit // 8) % len(data)] ^= 1 << (bit % 8)
    assert journal_module._checksum(memoryview(data)) != journal_module._checksum(
        memoryview(bytes(flipped))
    )


@given(
    seeds=st.lists(st.integers(0, 2**32), min_size=2, max_size=5, unique=True),
    swap=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    tail=st.binary(max_size=100),
)
def test_the_checksum_sees_a_block_out_of_place_or_missing(
    seeds: list[int], swap: tuple[int, int], tail: bytes
) -> None:
    """Two different 4 KiB blocks trade places (same bytes, same word sum), or one reads as
    zeros (a lost write): the block sums' CRC differs."""
    blocks = [random.Random(seed).randbytes(4096) for seed in seeds]
    i, j = swap[0] % len(blocks), swap[1] % len(blocks)
    moved = list(blocks)
    moved[i], moved[j] = moved[j], moved[i]
    lost = list(blocks)
    lost[i] = bytes(4096)
    whole = journal_module._checksum(memoryview(b"".join(blocks) + tail))
    if i != j:
        assert journal_module._checksum(memoryview(b"".join(moved) + tail)) != whole
    if blocks[i] != bytes(4096):
        assert journal_module._checksum(memoryview(b"".join(lost) + tail)) != whole


@given(
    start=st.integers(0, 5000),
    size=st.integers(0, 20_000),
    piece_bytes=st.sampled_from([1000, 4096, 12_000, 1 << 20]),
    refused=st.booleans(),
)
def test_pieces_at_any_address_are_written_from_their_own_pages(
    start: int, size: int, piece_bytes: int, refused: bool
) -> None:
    """A region at any byte offset in its storage (so at any place in a page) round-trips
    bitwise, its neighbours untouched by the replay. Under O_DIRECT only the record headers and
    the piece's partial first and last pages (under a page each) go through the journal's own
    buffer: the pages wholly inside a piece are written from its memory; where O_DIRECT
    refuses that memory, all of the piece goes through the buffer."""
    g = torch.Generator().manual_seed(start + size)
    storage = torch.randint(0, 256, (start + size + 5000,), generator=g, dtype=torch.uint8)
    region = storage[start : start + size]
    before = storage.clone()
    buffered: list[int] = []  # bytes of data (not headers) written through the buffer
    with pytest.MonkeyPatch.context() as patch:
        original_put = UndoJournal._put

        def spying(self: UndoJournal, data: memoryview, offset: int, skew: int = 0) -> None:
            if bytes(data[:8]) != journal_module._MAGIC:
                buffered.append(len(data))
            original_put(self, data, offset, skew)

        patch.setattr(UndoJournal, "_put", spying)
        if refused:

            def refusing(address: int, nbytes: int) -> memoryview:
                raise OSError(errno.EINVAL, "not for O_DIRECT")

            patch.setattr(journal_module, "_span", refusing)
        with UndoJournal(piece_bytes=piece_bytes) as journal:
            journal.keep_now(region)
            region.fill_(7)
            storage[: start + 1].fill_(9)  # the neighbours change too: the replay keeps them
            expected = storage.clone()
            expected[start : start + size] = before[start : start + size]
            journal.rollback()
            direct = journal.direct
    assert torch.equal(storage, expected)
    if direct:
        assert sum(buffered) == size if refused else all(n < 4096 for n in buffered)
        pieces = -(-size // piece_bytes)
        if not refused and size > 3 * 4096 * pieces:
            assert sum(buffered) <= 2 * 4096 * pieces < size  # most bytes went straight


def test_the_file_is_closed_in_the_background_and_room_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() hands the file's close (freeing its blocks) to a thread of its own; a journal
    that finds too little room waits for such closes before it refuses."""
    with UndoJournal(tmp_path) as journal:
        journal.keep_now(torch.arange(10.0))
        fd = journal.fileno()
    for closing in list(journal_module._CLOSING):
        closing.join()
    with pytest.raises(OSError) as closed:
        os.fstat(fd)
    assert closed.value.errno == errno.EBADF
    freed = threading.Event()
    slow = threading.Thread(target=lambda: (time.sleep(0.2), freed.set()))
    slow.start()
    monkeypatch.setattr(journal_module, "_CLOSING", [slow])
    monkeypatch.setattr(journal_module, "_free_bytes", lambda fd: 10**9 if freed.is_set() else 100)
    with UndoJournal(tmp_path) as journal:
        journal.plan("a", torch.zeros(1000))
        journal.reserve(journal.planned_bytes())  # waits for the earlier close, then has room
    assert freed.is_set()


# ------------------------------------------------------------------------------------------
# The journal's edges (what its mutation run found unchecked)
# ------------------------------------------------------------------------------------------
def _needed(journal: UndoJournal, nbytes: int) -> int:
    """The room reserve() asks for: the bytes plus one header per region, per piece and one."""
    regions = len(journal._regions)
    return nbytes + journal_module._HEADER.size * (regions + nbytes // journal.piece_bytes + 1)


def test_reserve_asks_for_the_bytes_and_a_header_per_region_and_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exactly the room needed is enough; a byte less is refused, naming both figures and
    what to do; the free room is read from the journal's own file."""
    monkeypatch.setattr(journal_module, "_CLOSING", [])  # no earlier close to wait for
    with UndoJournal(tmp_path, piece_bytes=1000) as journal:
        journal.plan("a", torch.zeros(1000))
        journal.plan("b", torch.zeros(10))
        nbytes = journal.planned_bytes()
        assert nbytes == 4040
        needed = _needed(journal, nbytes)
        assert needed == 4040 + journal_module._HEADER.size * (2 + 4 + 1)
        asked: list[int] = []

        def free(room: int) -> Callable[[int], int]:
            def reading(fd: int) -> int:
                asked.append(fd)
                return room

            return reading

        monkeypatch.setattr(journal_module, "_free_bytes", free(needed))
        journal.reserve(nbytes)
        monkeypatch.setattr(journal_module, "_free_bytes", free(needed - 1))
        with pytest.raises(UndoJournalError) as refused:
            journal.reserve(nbytes)
        assert refused.value.errno == errno.ENOSPC
        assert f"needs {needed:,} bytes in {str(tmp_path)!r}, which has {needed - 1:,} free" in (
            str(refused.value)
        )
        assert str(refused.value).endswith(
            "pass journal_dir= a directory with room, or atomic=False (no undo: a failure "
            "while reading leaves a partial load)"
        )
        assert asked == [journal.fileno()] * 2


def test_reserve_waits_for_earlier_closes_only_without_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With room, an earlier journal's close still running is not waited for; without, it
    is, and the room is read again from this journal's file."""
    release = threading.Event()
    closing = threading.Thread(target=release.wait, args=(5,), daemon=True)
    closing.start()
    monkeypatch.setattr(journal_module, "_CLOSING", [closing])
    asked: list[int] = []

    def free(fd: int) -> int:
        asked.append(fd)
        return 10**9 if release.is_set() else 100

    monkeypatch.setattr(journal_module, "_free_bytes", free)
    try:
        with UndoJournal(tmp_path) as journal:
            journal.plan("a", torch.zeros(10))
            journal.reserve(100 - journal_module._HEADER.size * 2)  # needs exactly 100
            assert [closing] == journal_module._CLOSING and closing.is_alive()  # not waited for
            threading.Timer(0.05, release.set).start()
            journal.reserve(journal.planned_bytes())  # too little room: waits, then has it
            assert journal_module._CLOSING == [] and not closing.is_alive()
            assert asked == [journal.fileno()] * 3
    finally:
        release.set()


def _failing_write(error: BaseException) -> Callable[..., None]:
    def failing(fd: int, data: Any, offset: int) -> None:
        raise error

    return failing


@pytest.mark.parametrize("planned", [False, True])
def test_a_failed_journal_write_is_an_undo_journal_error_naming_the_cause(
    planned: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep_now and keep raise UndoJournalError with the write's errno (EIO when it has none
    or is no OSError), the directory, what to do and the write's error as the cause; a
    Ctrl-C is raised as it is."""
    cases: list[tuple[BaseException, int | None]] = [
        (OSError(errno.ENOSPC, "no room"), errno.ENOSPC),
        (OSError("no errno"), errno.EIO),
        (RuntimeError("broken"), errno.EIO),
        (KeyboardInterrupt(), None),
    ]
    for error, code in cases:
        monkeypatch.setattr(journal_module, "_pwrite_all", _failing_write(error))
        tensor = torch.arange(10.0)
        with UndoJournal(tmp_path) as journal:
            raised: pytest.ExceptionInfo[BaseException]
            with pytest.raises(BaseException) as raised:
                if planned:
                    journal.plan("t", tensor)
                    journal.keep("t")
                else:
                    journal.keep_now(tensor)
        if code is None:
            assert raised.value is error
            continue
        assert isinstance(raised.value, UndoJournalError)
        assert raised.value.errno == code
        assert raised.value.__cause__ is error
        assert str(raised.value) == (
            f"[Errno {code}] writing the atomic load's undo journal in {str(tmp_path)!r} failed "
            f"({error}); the optimizer was put back as it was. Pass journal_dir= a directory "
            "with room, or atomic=False"
        )


def test_a_buffered_journal_puts_back_empty_and_whole_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without O_DIRECT (tmpfs), an empty tensor's record (no bytes) replays beside others."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    tensors = [torch.empty(0), torch.arange(5.0), torch.empty(0, 3)]
    before = [_bits(t) for t in tensors]
    with UndoJournal(tmp_path, piece_bytes=8) as journal:
        assert not journal.direct
        for t in tensors:
            journal.keep_now(t)
            t.fill_(-1)
        journal.rollback()
    for t, old in zip(tensors, before, strict=True):
        assert torch.equal(_bits(t), old)


@pytest.mark.parametrize("direct", [True, False])
def test_a_record_whose_bytes_are_gone_is_reported_missing(
    direct: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal cut right after a one-byte record's header: its bytes are missing (not a
    checksum of whatever the read buffer held), and the byte is left as the load wrote it."""
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    byte = torch.tensor([0x5A], dtype=torch.uint8)
    with UndoJournal(tmp_path) as journal:
        assert journal.direct == (direct and hasattr(os, "O_DIRECT"))
        journal.keep_now(byte)
        byte.fill_(1)
        os.ftruncate(journal.fileno(), journal._aligned(journal_module._HEADER.size))
        with pytest.raises(
            RollbackError,
            match=r"record 0: missing bytes \(the journal is shorter than written\)\. The",
        ):
            journal.rollback()
    assert byte.item() == 1


def _file_size(journal: UndoJournal) -> int:
    return os.fstat(journal.fileno()).st_size


@pytest.mark.parametrize(
    ("dtype", "numel", "piece_bytes", "records"),
    [
        (torch.float32, 4, 4, 4),  # one element a record
        (torch.uint8, 8, 2, 4),  # a one-byte element: piece_bytes elements a record
        (torch.float32, 4, 3, 4),  # a piece smaller than an element still holds one
        (torch.float32, 1, 4, 1),  # one element: one record, no empty one after it
        (torch.uint8, 3, 1, 3),  # one byte a record
    ],
)
def test_pieces_hold_at_most_piece_bytes(
    dtype: torch.dtype,
    numel: int,
    piece_bytes: int,
    records: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A region is journaled in records of at most ``piece_bytes`` (at least one element):
    the (buffered) file holds exactly that many headers and the bytes."""
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    tensor = torch.arange(numel).to(dtype)
    with UndoJournal(tmp_path, piece_bytes=piece_bytes) as journal:
        journal.keep_now(tensor)
        nbytes = numel * tensor.element_size()
        assert journal.written == nbytes
        assert _file_size(journal) == records * journal_module._HEADER.size + nbytes


def _blocked_writes(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    go = threading.Event()
    original = journal_module._pwrite_all

    def waiting(*args: Any) -> None:
        go.wait(10)
        original(*args)

    monkeypatch.setattr(journal_module, "_pwrite_all", waiting)
    return go


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "wrapped_optim-undo-journal"]


def test_the_worker_journals_every_planned_region_ahead_in_one_daemon_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """start() runs one daemon worker (a second start() adds none) that journals the planned
    regions without waiting for keep(), passing over a region the reader already kept; with
    nothing planned there is no worker."""
    with UndoJournal(tmp_path) as idle:
        idle.start()
        assert _workers() == []
    tensors = [torch.arange(float(n)) for n in (3, 5, 7)]
    with UndoJournal(tmp_path) as journal:
        for i, t in enumerate(tensors):
            journal.plan(i, t)
        journal.keep(0)  # before the worker starts: it passes over region 0
        go = _blocked_writes(monkeypatch)
        journal.start()
        journal.start()
        workers = _workers()
        assert len(workers) == 1 and workers[0].daemon
        go.set()
        deadline = time.monotonic() + 10
        while journal.written < journal.planned_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert journal.written == journal.planned_bytes()  # each region once, none kept twice
        for t in tensors:
            t.fill_(-1)
        journal.rollback()
    assert [t.tolist() for t in tensors] == [[float(i) for i in range(n)] for n in (3, 5, 7)]


def _at_page_offset(page_offset: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 region starting ``page_offset`` bytes into a memory page, in a larger storage."""
    storage = torch.randint(0, 256, (nbytes + 3 * 4096,), dtype=torch.uint8)
    start = (page_offset - storage.data_ptr()) % 4096
    return storage, storage[start : start + nbytes]


@pytest.mark.parametrize(
    ("page_offset", "nbytes"),
    [
        (0, 3 * 4096),  # whole pages: nothing through the buffer
        (1, 8190),  # two partial pages and no whole one
        (2048, 3 * 4096),  # half a page in, half a page out
        (100, 4096 - 100),  # ends on a page boundary
    ],
)
def test_o_direct_writes_whole_pages_from_memory_and_the_record_exactly(
    page_offset: int, nbytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under O_DIRECT a record takes one header block and the blocks its bytes span (the
    file is no longer); only partial pages (under a page each) go through the buffer; the
    replay puts back the region and leaves its neighbours as they are."""
    storage, region = _at_page_offset(page_offset, nbytes)
    buffered: list[int] = []
    original_put = UndoJournal._put

    def spying(self: UndoJournal, data: memoryview, offset: int, skew: int = 0) -> None:
        if bytes(data[:8]) != journal_module._MAGIC:
            buffered.append(len(data))
        original_put(self, data, offset, skew)

    monkeypatch.setattr(UndoJournal, "_put", spying)
    before = storage.clone()
    with UndoJournal(tmp_path, piece_bytes=1 << 20) as journal:
        assert journal.direct
        journal.keep_now(region)
        assert _file_size(journal) == 4096 + journal._aligned(page_offset + nbytes)
        region.fill_(7)
        journal.rollback()
    assert torch.equal(storage, before)
    assert all(0 < n < 4096 for n in buffered)
    assert sum(buffered) == (
        nbytes
        if page_offset + nbytes <= 4096
        else (-page_offset % 4096) + (page_offset + nbytes) % 4096
    )


def test_each_thread_keeps_one_bounce_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under O_DIRECT the headers and partial pages of many records go through one buffer
    per thread, not one per write."""
    made: list[int] = []
    original = journal_module.mmap.mmap

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(journal_module.mmap, "mmap", counting)
    tensor = torch.arange(100.0)
    with UndoJournal(tmp_path, piece_bytes=40) as journal:
        assert journal.direct
        journal.keep_now(tensor)
        tensor.zero_()
        journal.rollback()
    assert tensor.tolist() == [float(i) for i in range(100)]
    assert made == [4096]


def test_a_contiguous_cpu_target_is_replayed_into_its_own_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No host copy for a contiguous CPU tensor; one for a strided one (then copied in)."""
    flat, strided = torch.arange(6.0), torch.arange(6.0).reshape(2, 3).t()
    with UndoJournal(tmp_path) as journal:
        journal.keep_now(flat)
        journal.keep_now(strided)
        flat.zero_()
        strided.zero_()
        made: list[tuple[int, ...]] = []
        original = torch.empty

        def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
            made.append(tuple(args[0]))
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", counting)
        journal.rollback()
        monkeypatch.undo()
    assert made == [(3, 2)]
    assert flat.tolist() == [float(i) for i in range(6)]
    assert torch.equal(strided, torch.arange(6.0).reshape(2, 3).t())


def _flip(fd: int, offset: int) -> None:
    plain = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the journal may use O_DIRECT
    try:
        os.pwrite(plain, bytes([os.pread(plain, 1, offset)[0] ^ 0xFF]), offset)
        os.fsync(plain)
    finally:
        os.close(plain)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("empty", "missing (the journal is shorter than written)"),
        ("header", "damaged header"),
        ("bytes", "checksum mismatch"),
    ],
)
def test_each_damage_is_named_per_record(damage: str, problem: str, tmp_path: Path) -> None:
    """The RollbackError names each damaged record and what is wrong with it: the first three,
    and how many more; the records that are whole are put back."""
    tensors = [torch.arange(4.0) + 10 * i for i in range(5)]
    with UndoJournal(tmp_path) as journal:
        for t in tensors:
            journal.keep_now(t)
            t.zero_()
        records = sorted(journal._records, key=lambda r: r.seq)
        if damage == "empty":
            os.ftruncate(journal.fileno(), 0)
        for record in records:
            if damage == "header":
                _flip(journal.fileno(), record.offset + 8)  # the sequence number
            elif damage == "bytes":
                _flip(journal.fileno(), record.offset + journal._aligned(44) + record.skew)
        with pytest.raises(RollbackError) as raised:
            journal.rollback()
    assert str(raised.value) == (
        f"the load failed and its undo journal (in {str(tmp_path)!r}) could not be replayed: "
        f"record 4: {problem}; record 3: {problem}; record 2: {problem} (and 2 more). The "
        "optimizer is partly loaded: load a good checkpoint into it before training."
    )


def _reference_checksum(data: bytes) -> tuple[int, int]:
    """The checksum as documented, word by word in plain Python."""
    padded = data + bytes(-len(data) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    sums = [sum(words[i : i + 512]) % 2**64 for i in range(0, len(words), 512)]
    packed = b"".join(s.to_bytes(8, "little") for s in sums)
    return sum(sums) % 2**64, zlib.crc32(packed)


@given(data=st.binary(max_size=9000), whole_blocks=st.integers(0, 2))
def test_the_checksum_is_the_documented_word_sum_and_block_crc(
    data: bytes, whole_blocks: int
) -> None:
    """Any length (none, whole words, whole 4 KiB blocks, a ragged tail) and sums that wrap."""
    data = bytes([0xFF]) * 4096 * whole_blocks + data
    assert journal_module._checksum(memoryview(data)) == _reference_checksum(data)
    ragged = bytes([0xFF]) * 20  # a last block whose words and tail sum past 2**64
    assert journal_module._checksum(memoryview(ragged)) == _reference_checksum(ragged)


def test_short_writes_continue_where_they_stopped_and_none_is_enospc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pwrite may write less than asked: the rest follows at the right offset; a write of
    nothing is ENOSPC, named."""
    original = os.pwrite
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        monkeypatch.setattr(os, "pwrite", lambda f, data, offset: original(f, data[:3], offset))
        journal_module._pwrite_all(fd, b"0123456789", 5)
        assert os.pread(fd, 20, 0) == bytes(5) + b"0123456789"
        monkeypatch.setattr(os, "pwrite", lambda f, data, offset: 0)
        with pytest.raises(OSError, match=r"^\[Errno 28\] short write to the undo journal$"):
            journal_module._pwrite_all(fd, b"x", 0)
    finally:
        os.close(fd)


@pytest.mark.parametrize("page_offset", [100, 2048])
def test_o_direct_puts_larger_than_the_buffer_go_window_by_window(
    page_offset: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where O_DIRECT refuses a piece's memory, all of it goes through the bounce buffer, a
    window at a time, each in place; an empty region at any address adds no data block."""
    monkeypatch.setattr(journal_module, "_BOUNCE", 8192)

    def refusing(address: int, nbytes: int) -> memoryview:
        raise OSError(errno.EINVAL, "not for O_DIRECT")

    monkeypatch.setattr(journal_module, "_span", refusing)
    # 34,000 bytes: 7 whole pages after the partial first one, so 3.5 windows of 8 KiB (the
    # last one shorter than the buffer)
    storage, region = _at_page_offset(page_offset, 34_000)
    before = storage.clone()
    with UndoJournal(tmp_path, piece_bytes=1 << 20) as journal:
        assert journal.direct
        journal.keep_now(storage[page_offset + 1 : page_offset + 1])  # empty, off a page
        assert _file_size(journal) == 4096
        journal.keep_now(region)
        assert _file_size(journal) == 2 * 4096 + journal._aligned(page_offset + 34_000)
        region.fill_(3)
        journal.rollback()
    assert torch.equal(storage, before)


def test_close_hands_the_file_to_one_daemon_closer_once(tmp_path: Path) -> None:
    """close() gives the descriptor to a named daemon thread and forgets it (fileno() is -1);
    closing again closes nothing more."""
    journal = UndoJournal(tmp_path)
    fd = journal.fileno()
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # not inherited by a child
    journal.close()
    closer = journal_module._CLOSING[-1]
    assert closer.name == "wrapped_optim-undo-close" and closer.daemon
    assert journal.fileno() == -1
    before = list(journal_module._CLOSING)
    journal.close()
    assert before == journal_module._CLOSING  # no second closer
    closer.join()


def test_a_rollback_stops_the_worker_after_its_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rolling back while the worker journals ahead: it finishes the region it is writing and
    journals no further one (nothing after it was overwritten)."""
    tensors = [torch.arange(float(n)) for n in (4, 5, 6)]
    go = _blocked_writes(monkeypatch)
    with UndoJournal(tmp_path) as journal:
        for i, t in enumerate(tensors):
            journal.plan(i, t)
        journal.start()
        deadline = time.monotonic() + 10
        while journal._regions[0].status != journal_module._BUSY:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        threading.Timer(0.1, go.set).start()
        journal.rollback()
        assert journal.written == tensors[0].numel() * 4
    assert [t.tolist() for t in tensors] == [[float(i) for i in range(n)] for n in (4, 5, 6)]


def test_without_o_tmpfile_the_file_is_made_and_unlinked_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where O_TMPFILE is missing, O_DIRECT is not tried (it needs it) and the buffered file
    is created, unlinked and closed on exec; the journal works the same."""
    monkeypatch.delattr(os, "O_TMPFILE", raising=False)
    tensor = torch.arange(10.0)
    with UndoJournal(tmp_path) as journal:
        assert not journal.direct
        fd = journal.fileno()
        assert os.fstat(fd).st_nlink == 0
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert list(tmp_path.iterdir()) == []
        journal.keep_now(tensor)
        tensor.zero_()
        journal.rollback()
    assert tensor.tolist() == [float(i) for i in range(10)]
