"""Where the CPU AdamW kernel's library comes from: built with the package (and loaded from
it), else built once into a private per-user cache, never loaded from a directory another
user owns or can write; and what the user is told when it is built or missing."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel_support import needs_kernel
from wrapped_optim.optimizers.kernels import _build as _kernel_build
from wrapped_optim.optimizers.kernels import cpu_kernel

ROOT = Path(__file__).resolve().parents[3]
OTHER_UID = 65534  # "nobody": a real owner that is not this user


@pytest.fixture(scope="module")
def session_library() -> Path:
    """The library this test run uses (built once, as every kernel test's)."""
    library = cpu_kernel.status().library
    if library is None:
        pytest.skip(f"no CPU kernel here: {cpu_kernel.status().reason}")
    return library


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, session_library: Path) -> Iterator[Path]:
    """A source tree without a packaged library, whose run-time build copies the session's
    library into place (the compiler's real work is tested in test_cpu_kernel)."""

    def copy_build(compiler: str, library: Path, extra: Any = ()) -> None:
        shutil.copy(session_library, library)

    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_packaged_library", lambda: tmp_path / "not-built.so")
    monkeypatch.setattr(cpu_kernel, "_compile", copy_build)
    cpu_kernel._reset_for_tests()
    yield tmp_path
    monkeypatch.undo()
    cpu_kernel._reset_for_tests()


def cache_names() -> list[str]:
    """The names the run-time build gives the library, one per set of flags it tries."""
    compiler = _kernel_build.find_compiler()
    assert compiler is not None
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[:1]
    return [cpu_kernel._cache_name(compiler, version, extra) for extra in _kernel_build.ATTEMPTS]


@needs_kernel
def test_the_packaged_library_is_loaded_without_building(
    tmp_path: Path, session_library: Path
) -> None:
    """An installed package whose build made the library loads it, with no compiler and an
    empty cache, and says nothing about building."""
    tree = tmp_path / "site"
    shutil.copytree(ROOT / "wrapped_optim", tree / "wrapped_optim",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))  # fmt: skip
    packaged = tree / "wrapped_optim" / "optimizers" / "kernels" / _kernel_build.packaged_name()
    shutil.copy(session_library, packaged)
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(tree), "WRAPPED_OPTIM_KERNEL_CACHE": str(cache),
           "CC": "/bin/false", "PATH": str(tmp_path)}  # fmt: skip
    code = "from wrapped_optim.optimizers import cpu_kernel; print(cpu_kernel.status().library)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(packaged)
    assert "building" not in result.stderr
    assert not cache.exists()


@needs_kernel
def test_a_stale_packaged_library_is_not_loaded(tmp_path: Path, session_library: Path) -> None:
    """A library built from other sources (an editable install whose C files changed since)
    has another name, so the current sources are built instead."""
    tree = tmp_path / "site"
    shutil.copytree(ROOT / "wrapped_optim", tree / "wrapped_optim",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))  # fmt: skip
    kernels = tree / "wrapped_optim" / "optimizers" / "kernels"
    shutil.copy(session_library, kernels / _kernel_build.packaged_name(kernels / "csrc"))
    main = kernels / "csrc" / "_adamw_cpu.c"
    main.write_text(main.read_text() + "\n/* changed */\n")
    assert _kernel_build.packaged_name(kernels / "csrc") != _kernel_build.packaged_name()
    env = {**os.environ, "PYTHONPATH": str(tree), "CC": "/bin/false", "PATH": str(tmp_path),
           "WRAPPED_OPTIM_KERNEL_CACHE": str(tmp_path / "cache")}  # fmt: skip
    code = "from wrapped_optim.optimizers import cpu_kernel; print(cpu_kernel.status().library)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, cwd=tmp_path, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"  # the stale file was skipped; no compiler here


def test_the_fallback_build_says_so_once(fresh: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="wrapped_optim.optimizers.kernels.cpu_kernel"):
        assert cpu_kernel.status().available
        cpu_kernel._reset_for_tests()
        assert cpu_kernel.status().available  # cached now: no second message
    building = [r for r in caplog.records if "building the CPU AdamW kernel" in r.message]
    assert len(building) == 1
    assert building[0].levelno == logging.WARNING
    assert _kernel_build.TYPICAL_BUILD in building[0].message
    assert any(r.message.startswith("wrapped_optim: built adamw_cpu-") for r in caplog.records)


def test_a_missing_kernel_warns_once_with_reason_cost_and_fix(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(fresh))
    monkeypatch.delenv("CC", raising=False)
    with pytest.warns(RuntimeWarning) as record:
        assert not cpu_kernel.status().available
        assert not cpu_kernel.status().available
    assert len(record) == 1
    message = str(record[0].message)
    assert "no C compiler found" in message  # the reason
    assert "slower than torch's fused AdamW step" in message  # the cost
    assert "install a C compiler" in message and "wrapped-optim env" in message  # the fix


def test_a_compiler_that_does_not_run_is_named_in_a_sentence(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CC naming a program that is no compiler: a plain reason, not a CalledProcessError."""
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.warns(RuntimeWarning) as record:
        assert not cpu_kernel.status().available
    reason = cpu_kernel.status().reason
    assert reason is not None and "CalledProcessError" not in reason
    assert reason.startswith("the C compiler /bin/false (from CC) does not work: `/bin/false "
                             "--version` exited with status 1")  # fmt: skip
    assert reason.endswith("set CC to a working gcc or clang")
    assert reason in str(record[0].message)


def test_turning_the_kernel_off_does_not_warn(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.setenv("WRAPPED_OPTIM_CPU_KERNEL", "0")
    assert not cpu_kernel.status().available
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_the_cache_is_created_private(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = fresh / "new" / "cache"
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(cache))
    library = cpu_kernel.status().library
    assert library is not None and library.parent == cache
    assert cache.stat().st_mode & 0o777 == 0o700
    assert cache.stat().st_uid == os.getuid()


def test_without_a_user_cache_the_fallback_is_per_user_and_private(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ~/.cache unusable the cache moves to <tempdir>/wrapped_optim-<uid>, never a path
    every user shares."""
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("WRAPPED_OPTIM_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file: no cache under it
    monkeypatch.setenv("TMPDIR", str(fresh / "tmp"))
    (fresh / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)
    library = cpu_kernel.status().library
    assert library is not None
    assert library.parent == fresh / "tmp" / f"wrapped_optim-{os.getuid()}"
    assert library.parent.stat().st_mode & 0o777 == 0o700


@pytest.fixture
def foreign_dir(tmp_path: Path) -> Path:
    """A directory another user owns (mode 0755): one made here and given to another uid
    when this is root, else a system directory root owns."""
    if os.getuid() == 0:
        directory = tmp_path / "theirs"
        directory.mkdir(mode=0o755)
        os.chown(directory, OTHER_UID, OTHER_UID)
        return directory
    directory = Path("/usr")
    if directory.stat().st_uid == os.getuid():
        pytest.skip("no directory of another user here")
    return directory


def test_a_cache_of_another_user_is_never_loaded_from(
    fresh: Path, foreign_dir: Path, monkeypatch: pytest.MonkeyPatch, session_library: Path
) -> None:
    if os.getuid() == 0:  # a working library planted under every name the build would use
        for name in cache_names():
            shutil.copy(session_library, foreign_dir / name)
            os.chown(foreign_dir / name, OTHER_UID, OTHER_UID)
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(foreign_dir))
    with pytest.warns(RuntimeWarning, match="unavailable"):
        s = cpu_kernel.status()
    assert not s.available and s.library is None
    assert s.reason is not None
    assert f"{foreign_dir} belongs to uid {foreign_dir.stat().st_uid}, not to this user" in s.reason


def test_a_cache_others_can_write_is_never_loaded_from(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, session_library: Path
) -> None:
    shared = fresh / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    for name in cache_names():
        shutil.copy(session_library, shared / name)
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(shared))
    with pytest.warns(RuntimeWarning, match="unavailable"):
        s = cpu_kernel.status()
    assert not s.available
    assert s.reason is not None and "is writable by other users (mode 777)" in s.reason


def test_a_library_others_can_write_is_never_loaded(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, session_library: Path
) -> None:
    """The cache directory is private, but a library file in it is group-writable."""
    for name in cache_names():
        shutil.copy(session_library, fresh / name)
        (fresh / name).chmod(0o775)
    monkeypatch.setenv("WRAPPED_OPTIM_KERNEL_CACHE", str(fresh))
    with pytest.warns(RuntimeWarning, match="unavailable"):
        s = cpu_kernel.status()
    assert not s.available
    assert s.reason is not None and "is writable by other users (mode 775)" in s.reason
