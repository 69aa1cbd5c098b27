"""How the CPU AdamW kernel's shared library is compiled: its sources, flags and build.

Standard library only, so the package build (``setup.py``, without torch) and the run-time
fallback (:mod:`wrapped_optim.optimizers.kernels.cpu_kernel`) compile it the same way. Every
``_adamw_cpu*.c`` in ``csrc/`` beside this file is a translation unit and every
``_adamw_cpu*.h`` a header they include; all of them enter the library's name, so a library built
from other sources is
never taken for this one. The flags are portable: the C code picks its vector loops at run
time (``target_clones`` and ``__builtin_cpu_supports``), never ``-march=native``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# The C sources in csrc/; the package build puts the library beside this module.
LIBRARY_DIR = Path(__file__).resolve().parent
SOURCE_DIR = LIBRARY_DIR / "csrc"
MAIN_SOURCE = SOURCE_DIR / "_adamw_cpu.c"
# -fno-trapping-math lets the fp16/FP8 selects vectorize (values are unchanged: only FP flags,
# which nothing reads, may differ); 512-bit vectors in the AVX-512 clone.
FLAGS = (
    "-O3", "-std=c11", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
    "-ffp-contract=off", "-mprefer-vector-width=512",
)  # fmt: skip
OPENMP_FLAGS = ("-fopenmp",)
NO_VECTOR_LOOPS = "-DWO_NO_VECTOR_LOOPS"
# OpenMP first (threads); a compiler or runtime without it still gets the one-thread build.
# Each without the hand-written vector loops (AVX-512 and AVX2) next, for a compiler that cannot
# build their intrinsics (the portable loops give the same bits).
ATTEMPTS: tuple[tuple[str, ...], ...] = (
    OPENMP_FLAGS,
    (*OPENMP_FLAGS, NO_VECTOR_LOOPS),
    (),
    (NO_VECTOR_LOOPS,),
)
PACKAGED_PREFIX = "_adamw_cpu-"
# What going without the kernel costs (measured at 10M parameters, 2 cores): the install's
# notice and the run-time warning both say it.
MISSING_COST = (
    "PrecisionAwareAdamW and the fused host step then run their pure-torch path on CPU, "
    "several times slower than torch's fused AdamW step (about 3x with bf16 moments, about "
    "9x with bf16 and FP8 ones; GPU steps are unaffected)"
)
# What a build takes on a 2-core machine (the OpenMP build with every vector clone).
TYPICAL_BUILD = "40 s to 2 min on 2 cores"


def sources(directory: Path = SOURCE_DIR) -> list[Path]:
    """Every file the build reads: the ``_adamw_cpu*.c`` and ``_adamw_cpu*.h`` in ``directory``.

    Example:
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> _kernel_build.MAIN_SOURCE in _kernel_build.sources()
        True
    """
    return sorted([*directory.glob("_adamw_cpu*.c"), *directory.glob("_adamw_cpu*.h")])


def source_digest(directory: Path = SOURCE_DIR, extra: Sequence[bytes] = ()) -> str:
    """A 16-digit hash of the sources' names and bytes, the flags and ``extra``.

    Example:
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> len(_kernel_build.source_digest())
        16
    """
    h = hashlib.sha256()
    files = [
        piece for path in sources(directory) for piece in (path.name.encode(), path.read_bytes())
    ]
    for part in (*files, " ".join(FLAGS).encode(), *extra):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:16]


def packaged_name(directory: Path = SOURCE_DIR) -> str:
    """The file name the package build gives the library of the sources in ``directory``.

    Example:
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> _kernel_build.packaged_name().startswith("_adamw_cpu-")
        True
    """
    return f"{PACKAGED_PREFIX}{source_digest(directory)}.so"


def find_compiler() -> str | None:
    """``$CC``, else ``cc``, ``gcc`` or ``clang``, as a path; None when there is none.

    Example:
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> compiler = _kernel_build.find_compiler()
        >>> compiler is None or compiler.startswith("/")
        True
    """
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            found = shutil.which(name)
            if found:
                return os.path.abspath(found)
    return None


def compile_library(
    compiler: str, library: Path, extra_flags: Sequence[str] = (), directory: Path = SOURCE_DIR
) -> None:
    """Compile the sources in ``directory`` into ``library``; raises ``RuntimeError`` with the
    compiler's messages when it fails, leaving no file behind.

    The library is written under a private name beside ``library`` and renamed into place:
    processes starting together (one per rank) may all build, and none ever loads a
    half-written file.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> out = Path(tempfile.mkdtemp()) / "kernel.so"
        >>> try:
        ...     _kernel_build.compile_library("/bin/false", out)
        ... except RuntimeError as exc:
        ...     print(str(exc).splitlines()[0])
        /bin/false failed to build _adamw_cpu.c:
        >>> out.exists()
        False
    """
    units = [str(path) for path in sources(directory) if path.suffix == ".c"]
    fd, tmp = tempfile.mkstemp(prefix=library.stem + ".", suffix=".so.tmp", dir=library.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, *extra_flags, "-o", tmp, *units],
            capture_output=True,
            text=True,
            timeout=900,  # a loaded machine (several ranks building at once) is slow
        )
        if result.returncode != 0:
            names = ", ".join(Path(unit).name for unit in units)
            raise RuntimeError(f"{compiler} failed to build {names}:\n{result.stderr}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_packaged(output_dir: Path, compiler: str | None = None) -> tuple[Path, tuple[str, ...]]:
    """The package build's step: compile the library into ``output_dir`` under
    :func:`packaged_name`, with the first of :data:`ATTEMPTS` that compiles; returns its path
    and the extra flags used. Raises ``RuntimeError`` naming every failure.

    Example:
        >>> from wrapped_optim.optimizers.kernels import _build as _kernel_build
        >>> callable(_kernel_build.build_packaged)  # compiling takes most of a minute
        True
    """
    compiler = compiler or find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (install gcc or clang, or set CC to one)")
    library = output_dir / packaged_name()
    failures = []
    for extra in ATTEMPTS:
        try:
            compile_library(compiler, library, extra)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            failures.append(f"{' '.join(extra) or 'without OpenMP'}: {exc}")
            continue
        return library, extra
    raise RuntimeError("; ".join(failures))
