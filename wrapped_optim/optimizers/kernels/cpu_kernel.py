"""A compiled one-pass AdamW for CPU tensors whose operands are stored in different dtypes.

Users call ``status`` and ``use_loops``; how it is built, cached and vectorized is in the
docs' PrecisionAwareAdamW page ("The CPU kernel").
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from wrapped_optim._formats import blocks, codecs
from wrapped_optim.optimizers.kernels import _build as _kernel_build
from wrapped_optim.optimizers.kernels import _threads as _kernel_threads

__all__ = [
    "LOOP_FAMILIES",
    "status",
    "use_loops",
]

_ABI_VERSION = 10
#: The loop families of fp16/FP8 moments, fastest first (the C side's LOOPS_* values are the
#: reverse indices).
LOOP_FAMILIES = ("avx512", "avx2", "portable")
"""The families of fp16/FP8 moment loops, fastest first; all give the same bits."""
_LOOPS_ENV = "WRAPPED_OPTIM_CPU_LOOPS"
_DISABLE_ENV = "WRAPPED_OPTIM_CPU_KERNEL"
_CACHE_ENV = "WRAPPED_OPTIM_KERNEL_CACHE"
# Below this many elements per thread (about 50 us of work), another thread costs more than
# it saves.
_MIN_ELEMENTS_PER_THREAD = 1 << 16
_MAX_THREADS = 256  # the kernel's own limit
# Threads take work in blocks of this many elements (a multiple of 64) from a shared counter.
_BLOCK_ELEMENTS = 1 << 14

#: (param dtype, master dtype or None) -> the kernel's master kind (MASTER_* in _adamw_cpu.c).
_MASTER_KIND = {
    (torch.float32, None): 0,  # the FP32 param is the value updated, in place
    (torch.bfloat16, torch.float32): 1,  # FP32 master; the param gets it rounded to bf16
    (torch.bfloat16, torch.int16): 2,  # the low half of the FP32 value (TE's remainder)
    (torch.float32, torch.float32): 3,  # FP32 master; the FP32 param gets its exact value
}
_MASTERED_PARAM_DTYPES = (torch.bfloat16, torch.float32)
_VALUE_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, codecs.FP8_E4M3: 3}
_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_MOMENT_DTYPES = tuple(_VALUE_KIND)
#: Block-scaled moments (KIND_*_BLOCK in _adamw_cpu.c): both moments of a param in one.
_BLOCK_KIND = {"int8": 5, "fp8": 6, "int4": 7}
_PASS_WRITE, _PASS_AMAX = 0, 1


def _fields(ctype: Any, names: str) -> list[tuple[str, Any]]:
    return [(name, ctype) for name in names.split()]


# Mirrors of the C structs wo_hyper and wo_tensor in _adamw_cpu.c (same order and types).
class _Hyper(ctypes.Structure):
    _fields_ = [
        *_fields(
            ctypes.c_float,
            "lr beta1 one_minus_beta1 beta2 one_minus_beta2 eps weight_decay "
            "inv_bias_correction1 inv_bias_correction2",
        ),
        ("adam_w_mode", ctypes.c_int),
    ]


class _Tensor(ctypes.Structure):
    _fields_ = [
        *_fields(ctypes.c_void_p, "param master grad exp_avg exp_avg_sq"),
        ("numel", ctypes.c_int64),
        *_fields(ctypes.c_int, "master_kind grad_kind m_kind v_kind"),
        *_fields(ctypes.c_float, "m_decode v_decode m_encode v_encode"),
        *_fields(ctypes.c_uint32, "m_amax v_amax"),
        *_fields(ctypes.c_void_p, "m_scales v_scales"),
        ("qblock", ctypes.c_int64),
    ]


@attrs.frozen
class KernelStatus:
    """Whether the compiled kernel is in use, where it came from, or why it is not in use.

    Attributes:
        available: The kernel is loaded and ``PrecisionAwareAdamW`` uses it on CPU.
        library: The loaded shared library's path (``None`` when unavailable).
        reason: Why the kernel is unavailable, and what to do (``None`` when available).
        parallel: Built with OpenMP: a step may use several of torch's threads.
        loops: The family of fp16/FP8 moment loops in use (one of ``LOOP_FAMILIES``).
        loop_families: The families this CPU and build can run, fastest first.
        packaged: The library is the one built with the package (not a run-time build).
        compiler: The C compiler a run-time build uses (``$CC``, else ``cc``, ``gcc`` or
            ``clang``), as a path; ``None`` when there is none.

    Examples:
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> s = cpu_kernel.status()
        >>> s.available == (s.library is not None) == (s.reason is None)
        True
    """

    available: bool
    library: Path | None = None
    reason: str | None = None
    parallel: bool = False  # built with OpenMP: calls may use several threads
    # The loops fp16/FP8 moments run now (one of LOOP_FAMILIES: the hand-written AVX-512 or
    # AVX2 ones, or the portable ones, which give the same bits more slowly) and the families
    # this CPU and build can run, fastest first.
    loops: str = "portable"
    loop_families: tuple[str, ...] = ("portable",)
    packaged: bool = False
    compiler: str | None = None


_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: tuple[KernelStatus, ctypes.CDLL | None] | None = None
_loaded_in_pid = 0  # the process that loaded the library (and may use its OpenMP threads)


def status() -> KernelStatus:
    """Reports whether the CPU kernel is in use, building and loading it on first call.

    The result is cached; it never raises (a failure is its ``reason``).

    Returns:
        The kernel's ``KernelStatus``, with the loop family in use now.

    Examples:
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> isinstance(cpu_kernel.status().available, bool)
        True
        >>> cpu_kernel.status().loops in cpu_kernel.status().loop_families
        True
    """
    loaded, lib = _load()
    found = attrs.evolve(
        loaded,
        packaged=loaded.library is not None and loaded.library.parent == _kernel_build.LIBRARY_DIR,
        compiler=_kernel_build.find_compiler(),
    )
    if lib is None:
        return found
    return attrs.evolve(found, loops=_family_name(lib.wo_get_loops()))


def use_loops(family: str | None = None) -> str:
    """Selects the loops fp16/FP8 and block-scaled moments run with, in this process, from
    the next step on.

    Every family gives the same bits, so this only changes speed (e.g. to measure the AVX2
    loops on an AVX-512 machine). Not while another thread steps. The environment variable
    ``WRAPPED_OPTIM_CPU_LOOPS`` makes the same choice when the library is loaded.

    Args:
        family: One of ``LOOP_FAMILIES`` that ``status().loop_families`` lists; ``None``
            for the fastest this CPU has.

    Returns:
        The family now in use.

    Raises:
        RuntimeError: the kernel is unavailable (``status().reason`` says why).
        ValueError: ``family`` is unknown or this CPU or build cannot run it.

    Examples:
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> if cpu_kernel.status().available:
        ...     assert cpu_kernel.use_loops("portable") == "portable"
        ...     assert cpu_kernel.use_loops() == cpu_kernel.status().loop_families[0]
    """
    loaded, lib = _load()
    if lib is None:
        raise RuntimeError(f"the CPU AdamW kernel is unavailable: {loaded.reason}")
    return _set_family(lib, family, loaded.loop_families)


def _family_name(value: int) -> str:
    return LOOP_FAMILIES[len(LOOP_FAMILIES) - 1 - value]


def _set_family(lib: ctypes.CDLL, family: str | None, supported: tuple[str, ...]) -> str:
    chosen = supported[0] if family is None else family
    if chosen not in LOOP_FAMILIES:
        raise ValueError(f"unknown loop family {chosen!r}; choose one of {LOOP_FAMILIES}")
    if chosen not in supported:
        raise ValueError(
            f"this CPU or build cannot run the {chosen} loops (it runs {', '.join(supported)})"
        )
    value = len(LOOP_FAMILIES) - 1 - LOOP_FAMILIES.index(chosen)
    if lib.wo_set_loops(value) != value:  # the Python and C checks disagree: a stale build
        raise RuntimeError(f"the kernel refused the {chosen} loops that it reports supporting")
    return chosen


def available() -> bool:
    """Whether :func:`adamw_step_` can run here.

    Examples:
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> cpu_kernel.available() == cpu_kernel.status().available
        True
    """
    return _load()[0].available  # not status(): a step asks, and the compiler search is slow


def _reset_for_tests() -> None:
    """Forget the loaded library, so the next call builds (or refuses) again."""
    global _loaded
    with _lock:
        _loaded = None


def _load() -> tuple[KernelStatus, ctypes.CDLL | None]:
    global _loaded, _loaded_in_pid
    with _lock:
        if _loaded is None:
            _loaded_in_pid = os.getpid()
            try:
                status, lib = _build_and_open()
                if lib is not None:  # whichever way it was loaded: packaged, cached or built
                    _apply_loops_setting(lib, status.loop_families)
                    status = attrs.evolve(status, loops=_family_name(lib.wo_get_loops()))
                _loaded = (status, lib)
            except Exception as exc:  # any failure means: use the pure-torch path
                reason = f"{type(exc).__name__}: {exc}"
                _loaded = (KernelStatus(False, reason=reason), None)
                _warn_unavailable(reason)
        return _loaded


def _build_and_open() -> tuple[KernelStatus, ctypes.CDLL | None]:
    setting = os.environ.get(_DISABLE_ENV, "")
    if setting.strip().lower() in ("0", "false", "off", "no"):
        return KernelStatus(False, reason=f"disabled by {_DISABLE_ENV}={setting}"), None
    failures = []
    packaged = _packaged_library()
    if packaged.exists():
        try:
            _check_not_writable_by_others(packaged)
            return _opened(packaged)
        except (OSError, RuntimeError) as exc:
            failures.append(f"the packaged {packaged.name}: {exc}")
    try:
        return _build_into_cache()
    except _Unavailable as exc:
        failures.append(str(exc))
    except Exception as exc:  # any failure means: use the pure-torch path
        failures.append(f"{type(exc).__name__}: {exc}")
    status = KernelStatus(False, reason="; ".join(failures))
    _warn_unavailable(status.reason or "")
    return status, None


def _packaged_library() -> Path:
    """Where the package build put the library of these very sources (it may be absent)."""
    return _kernel_build.LIBRARY_DIR / _kernel_build.packaged_name()


def _opened(library: Path) -> tuple[KernelStatus, ctypes.CDLL]:
    lib = _open(library)
    return KernelStatus(
        True,
        library=library,
        parallel=bool(lib.wo_parallel()),
        loops=_family_name(lib.wo_get_loops()),
        loop_families=tuple(
            name
            for value, name in enumerate(reversed(LOOP_FAMILIES))
            if lib.wo_loops_supported(value) == 1
        )[::-1],
    ), lib


def _build_into_cache() -> tuple[KernelStatus, ctypes.CDLL | None]:
    """The fallback of a source tree without a built library: build (once) into the cache."""
    compiler = _kernel_build.find_compiler()
    if compiler is None:
        raise _Unavailable("no C compiler found (install gcc or clang, or set CC to one)")
    version = _compiler_version(compiler)
    directory = _cache_dir()
    failures = []
    for extra in _kernel_build.ATTEMPTS:
        try:
            library = _cached_build(compiler, version, directory, extra)
            return _opened(library)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            failures.append(f"{' '.join(extra) or 'without OpenMP'}: {exc}")
    raise RuntimeError("; ".join(failures))


def _compiler_version(compiler: str) -> list[str]:
    """The first line of ``compiler --version``; ``_Unavailable`` saying so when it does not
    run (e.g. ``CC`` names a program that is not a compiler)."""
    named = f"{compiler} (from CC)" if os.environ.get("CC") else compiler
    try:
        result = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise _Unavailable(
            f"the C compiler {named} does not run ({exc}); set CC to a working gcc or clang"
        ) from None
    if result.returncode != 0:
        said = (result.stderr.strip().splitlines() or ["no message"])[0][:200]
        raise _Unavailable(
            f"the C compiler {named} does not work: `{compiler} --version` exited with "
            f"status {result.returncode} ({said}); set CC to a working gcc or clang"
        )
    return result.stdout.splitlines()[:1]


class _Unavailable(RuntimeError):
    """A reason the kernel cannot be had, said as it is (no exception type in front)."""


def _warn_unavailable(reason: str) -> None:
    warnings.warn(
        f"wrapped_optim: the compiled CPU AdamW kernel is unavailable ({reason}). "
        f"{_kernel_build.MISSING_COST}. To fix it, install a C compiler (gcc or clang; or set "
        "CC) and reinstall wrapped-optim, or install a wheel that carries the kernel; "
        "`wrapped-optim env` shows its status, WRAPPED_OPTIM_CPU_KERNEL=0 silences this.",
        RuntimeWarning,
        stacklevel=4,
    )


def _apply_loops_setting(lib: ctypes.CDLL, families: tuple[str, ...]) -> None:
    """``WRAPPED_OPTIM_CPU_LOOPS``: a family to run instead of the fastest (``auto`` or unset:
    the fastest). One this CPU cannot run fails the load, with the reason in status()."""
    setting = os.environ.get(_LOOPS_ENV, "").strip().lower()
    try:
        _set_family(lib, None if setting in ("", "auto") else setting, families)
    except ValueError as exc:
        raise RuntimeError(
            f"{_LOOPS_ENV}={setting}: {exc}; unset it or set it to auto or one of "
            f"{', '.join(families)}"
        ) from None


def _cached_build(compiler: str, version: list[str], directory: Path, extra: Sequence[str]) -> Path:
    library = directory / _cache_name(compiler, version, extra)
    if not library.exists():
        _log.warning(
            "wrapped_optim: building the CPU AdamW kernel into %s (once; %s). Installing "
            "the package (pip install) builds it ahead of time.",
            directory,
            _kernel_build.TYPICAL_BUILD,
        )
        started = time.monotonic()
        _compile(compiler, library, extra)
        _log.info("wrapped_optim: built %s in %.0f s", library.name, time.monotonic() - started)
    _check_private(directory)
    _check_private(library)
    return library


def _cache_name(compiler: str, version: list[str], extra: Sequence[str]) -> str:
    """The cached library's name: its sources, flags, compiler and compiler version."""
    key = _kernel_build.source_digest(
        extra=[" ".join(extra).encode(), compiler.encode(), *map(str.encode, version)]
    )
    return f"adamw_cpu-{key}.so"


# The build (a name of this module, so tests can replace it).
_compile = _kernel_build.compile_library


def _open(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    lib.wo_abi_version.restype = ctypes.c_int
    lib.wo_parallel.restype = ctypes.c_int
    if lib.wo_abi_version() != _ABI_VERSION:
        raise RuntimeError(f"{library} has ABI {lib.wo_abi_version()}, expected {_ABI_VERSION}")
    for name in ("wo_loops_supported", "wo_set_loops"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [ctypes.c_int]
    lib.wo_get_loops.restype = ctypes.c_int
    fn = lib.wo_adamw_step
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.POINTER(_Tensor), ctypes.c_int64,  # tensors, count
        ctypes.c_int64, ctypes.c_int, ctypes.c_int64,  # elements of all tensors, threads, block
        ctypes.POINTER(_Hyper), ctypes.c_int,  # hyper-parameters, pass
    ]  # fmt: skip
    return lib


def cache_dir_candidates() -> list[Path]:
    """Where the run-time build may put the library, in order of preference: the one
    directory ``$WRAPPED_OPTIM_KERNEL_CACHE`` names, else the user's cache and a per-user
    directory in the temporary directory (never one shared by all users).

    Examples:
        >>> from pathlib import Path
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> all(isinstance(d, Path) for d in cpu_kernel.cache_dir_candidates())
        True
    """
    explicit = os.environ.get(_CACHE_ENV)
    if explicit:
        return [Path(explicit)]
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return [base / "wrapped_optim", Path(tempfile.gettempdir()) / f"wrapped_optim-{_uid()}"]


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _check_not_writable_by_others(path: Path) -> os.stat_result:
    info = os.stat(path)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _Unavailable(
            f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); "
            "it is not loaded from"
        )
    return info


def _check_private(path: Path) -> None:
    """``path`` must be owned by the current user and writable by nobody else."""
    info = _check_not_writable_by_others(path)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise _Unavailable(
            f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
            "it is not loaded from"
        )


def _cache_dir() -> Path:
    errors = []
    for directory in cache_dir_candidates():
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_private(directory)
            if not os.access(directory, os.W_OK):
                raise _Unavailable(f"{directory} is not writable")
            return directory
        except OSError as exc:
            errors.append(str(exc))
        except _Unavailable as exc:
            errors.append(str(exc))
    raise _Unavailable(
        "no private writable kernel cache directory (set WRAPPED_OPTIM_KERNEL_CACHE to a "
        "directory you own that no one else can write): " + "; ".join(errors)
    )


def _check_operand(name: str, t: Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, its parameter has {numel}")
    if t.dtype not in dtypes:
        raise ValueError(
            f"{name} has dtype {t.dtype}; the kernel takes {', '.join(map(str, dtypes))}"
        )


def _check_scale(name: str, storage: Tensor, scale: Tensor | None) -> None:
    """A scaled moment needs its scale (a one-element float32 CPU tensor), another none."""
    if not codecs.is_scaled(storage.dtype):
        if scale is not None:
            raise ValueError(f"{name} is {storage.dtype}, which has no scale; pass None")
        return
    if scale is None:
        raise ValueError(f"{name} is {storage.dtype} (scaled): its per-tensor scale is missing")
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device.type != "cpu":
        raise ValueError(
            f"the scale of {name} must be a one-element float32 CPU tensor, got a "
            f"{scale.dtype} tensor of shape {tuple(scale.shape)} on {scale.device}"
        )


# One scaled moment of the call: (its struct, "m" or "v", storage dtype, scale tensor).
_Scaled = tuple[Any, str, torch.dtype, Tensor]


def _by_dtype(moments: Sequence[_Scaled]) -> dict[torch.dtype, list[_Scaled]]:
    groups: dict[torch.dtype, list[_Scaled]] = {}
    for moment in moments:
        groups.setdefault(moment[2], []).append(moment)
    return groups


def _set_decode_multipliers(moments: Sequence[_Scaled]) -> None:
    """Each scaled moment's decode multiplier, by the codecs' own function, in one call per
    storage dtype (the functions are elementwise: the bits are those of one call each)."""
    for dtype, group in _by_dtype(moments).items():
        scales = torch.cat([scale.reshape(1) for *_, scale in group])
        for (t, prefix, _, _), value in zip(
            group, codecs.decode_multiplier(scales, dtype).tolist(), strict=True
        ):
            setattr(t, f"{prefix}_decode", value)


def _new_scales(moments: Sequence[_Scaled]) -> list[tuple[list[Tensor], Tensor]]:
    """The codecs' new scale of each scaled moment from the amax pass 1 left in its struct,
    and the encode multipliers pass 2 uses (set in the structs): the very functions the
    torch path calls, so the bits agree; one call each per storage dtype. Returns (scale
    tensors, new values) to copy in once pass 2 has run."""
    updates = []
    for dtype, group in _by_dtype(moments).items():
        bits = [getattr(t, f"{prefix}_amax") for t, prefix, _, _ in group]
        amax = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
        new = codecs.scale_from_amax(amax, dtype)
        multipliers = codecs.encode_multiplier(new, dtype).tolist()
        for (t, prefix, _, _), value in zip(group, multipliers, strict=True):
            setattr(t, f"{prefix}_encode", value)
        updates.append(([scale for *_, scale in group], new))
    return updates


def _check_blocks(
    index: int, n: int, fmt: blocks.BlockFormat, moments: tuple[Tensor, Tensor],
    scales: tuple[Tensor | None, Tensor | None],
) -> None:  # fmt: skip
    """Block-scaled moments: uint8 codes and one float32 scale per block, each on the CPU."""
    for name, codes, scale in zip(("exp_avgs", "exp_avg_sqs"), moments, scales, strict=True):
        _check_operand(f"{name}[{index}]", codes, fmt.code_bytes(n), (torch.uint8,))
        if scale is None:
            raise ValueError(f"{name}[{index}] is block-scaled ({fmt.name}): no scales given")
        _check_operand(f"the scales of {name}[{index}]", scale, fmt.blocks(n), (torch.float32,))


def _describe(
    index: int, param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
    master: Tensor | None, m_scale: Tensor | None, v_scale: Tensor | None, *,
    block_format: blocks.BlockFormat | None = None,
) -> _Tensor:  # fmt: skip
    n = param.numel()
    if master is None:
        _check_operand(f"params[{index}]", param, n, (torch.float32,))
    else:
        _check_operand(f"params[{index}]", param, n, _MASTERED_PARAM_DTYPES)
        masters = tuple(m for (p, m) in _MASTER_KIND if p == param.dtype and m is not None)
        _check_operand(f"masters[{index}]", master, n, masters)
        if master.data_ptr() == param.data_ptr() and n:
            raise ValueError(
                f"masters[{index}] is the storage of params[{index}]: pass None as the master "
                "of an FP32 param updated in place"
            )
    _check_operand(f"grads[{index}]", grad, n, _GRAD_DTYPES)
    if block_format is not None:
        _check_blocks(index, n, block_format, (exp_avg, exp_avg_sq), (m_scale, v_scale))
        kind = _BLOCK_KIND[block_format.name]
        assert m_scale is not None and v_scale is not None  # checked above
        return _Tensor(
            param.data_ptr(), None if master is None else master.data_ptr(), grad.data_ptr(),
            exp_avg.data_ptr(), exp_avg_sq.data_ptr(), n,
            _MASTER_KIND[param.dtype, None if master is None else master.dtype],
            _VALUE_KIND[grad.dtype], kind, kind, 1.0, 1.0, 1.0, 1.0, 0, 0,
            m_scale.data_ptr(), v_scale.data_ptr(), block_format.block_size,
        )  # fmt: skip
    _check_operand(f"exp_avgs[{index}]", exp_avg, n, _MOMENT_DTYPES)
    _check_operand(f"exp_avg_sqs[{index}]", exp_avg_sq, n, _MOMENT_DTYPES)
    _check_scale(f"exp_avgs[{index}]", exp_avg, m_scale)
    _check_scale(f"exp_avg_sqs[{index}]", exp_avg_sq, v_scale)
    return _Tensor(
        param.data_ptr(),
        None if master is None else master.data_ptr(),
        grad.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        _MASTER_KIND[param.dtype, None if master is None else master.dtype],
        _VALUE_KIND[grad.dtype],
        _VALUE_KIND[exp_avg.dtype],
        _VALUE_KIND[exp_avg_sq.dtype],
        1.0,  # decode multipliers: set by _set_decode_multipliers for scaled moments
        1.0,
        1.0,
        1.0,
        0,
        0,
        None,
        None,
        0,
    )


def adamw_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None = None,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction1: float = 1.0,
    bias_correction2: float = 1.0,
    adam_w_mode: bool = True,
    num_threads: int | None = None,
    exp_avg_scales: Sequence[Tensor | None] | None = None,
    exp_avg_sq_scales: Sequence[Tensor | None] | None = None,
    block_format: blocks.BlockFormat | None = None,
) -> None:
    """One AdamW update of CPU tensors in place, each read and written in its stored dtype.

    Lists as in torch's ``_fused_adamw_``: one entry per parameter. A parameter is FP32,
    updated in place (its ``masters`` entry None) or written with the exact value of its FP32
    master (a host copy and the param it stands for, in one pass), or bf16 with an FP32
    master (written rounded to nearest even) or the int16 remainder of one; grads are FP32
    or bf16; moments FP32, bf16, fp16 or FP8 E4M3 (``torch.uint8``, TE's marker).
    An fp16/FP8 moment is stored relative to its per-tensor scale (``exp_avg_scales`` /
    ``exp_avg_sq_scales``: a one-element float32 tensor each, None for the other formats),
    exactly as :mod:`wrapped_optim._formats.codecs` encodes it: it is decoded with the old scale and
    re-encoded with the scale of its new amax, which is written into the scale tensor. Such
    tensors take two passes over memory (the first only measures the amax). The update is
    TE's FusedAdam formula in FP32 (``adam_w_mode``: ``p -= lr * (m_hat / (sqrt(v_hat) + eps)
    + wd * p)``, otherwise ``wd * p`` is added to the gradient); ``bias_correction1/2`` are
    ``1 - beta**t`` and are applied as multiplications by their (FP32-rounded) reciprocals.
    The elements of all tensors are shared by up to ``num_threads`` (default: torch's thread
    count, capped by the cores this process may use and reduced by those other processes
    keep busy, so threads never spin on oversubscribed cores; see
    :mod:`wrapped_optim.optimizers.kernels._threads`) OpenMP threads when the build has OpenMP
    (``status().parallel``), else one thread; in a process forked after the library was
    loaded always one (GNU OpenMP's workers do not survive ``fork()``: a parallel region
    there never returns, torch's own included). Every operand is checked before anything is
    written. Raises ``RuntimeError`` when the kernel is unavailable (see :func:`status`).

    With ``block_format`` every parameter's moments are block-scaled in that format
    (:mod:`wrapped_optim._formats.blocks`): uint8 codes, and ``exp_avg_scales`` /
    ``exp_avg_sq_scales`` one float32 scale per block, all updated in one pass over memory.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers.kernels import cpu_kernel
        >>> p, g = torch.ones(3), torch.full((3,), 0.5)
        >>> m = torch.zeros(3, dtype=torch.bfloat16)
        >>> v = torch.zeros(3, dtype=torch.uint8)  # FP8 E4M3, with a per-tensor scale
        >>> v_scale = torch.ones(1)
        >>> if cpu_kernel.available():
        ...     cpu_kernel.adamw_step_([p], [g], [m], [v], lr=0.1, betas=(0.9, 0.999),
        ...                            eps=1e-8, weight_decay=0.0, bias_correction1=0.1,
        ...                            bias_correction2=0.001, exp_avg_sq_scales=[v_scale])
        ... else:  # the same update in torch
        ...     _ = p.sub_(0.1)
        ...     _ = v_scale.fill_(0.25 * 0.001 / 448)
        >>> p, v_scale * 448
        (tensor([0.9000, 0.9000, 0.9000]), tensor([0.0003]))
    """
    loaded_status, lib = _load()
    if lib is None:
        raise RuntimeError(
            f"the CPU AdamW kernel is unavailable: {loaded_status.reason}; check "
            "wrapped_optim.optimizers.kernels.cpu_kernel.status() before calling adamw_step_"
        )
    masters, m_scales, v_scales = _per_param_lists(
        params, grads, exp_avgs, exp_avg_sqs, masters, exp_avg_scales, exp_avg_sq_scales
    )
    own = torch.get_num_threads()
    threads = _kernel_threads.default_threads(own, own) if num_threads is None else num_threads
    if threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {threads}")
    count = len(params)
    operands = zip(params, grads, exp_avgs, exp_avg_sqs, masters, m_scales, v_scales, strict=True)
    described = [_describe(i, *ops, block_format=block_format) for i, ops in enumerate(operands)]
    tensors = (_Tensor * max(count, 1))(*described)
    scaled: list[_Scaled] = [
        (tensors[i], prefix, storage.dtype, scale)
        for i in range(count)
        for storage, scale, prefix in ((exp_avgs[i], m_scales[i], "m"),
                                       (exp_avg_sqs[i], v_scales[i], "v"))
        if scale is not None and block_format is None
    ]  # fmt: skip
    _set_decode_multipliers(scaled)
    beta1, beta2 = float(betas[0]), float(betas[1])
    hyper = _Hyper(
        float(lr), beta1, 1.0 - beta1, beta2, 1.0 - beta2, float(eps), float(weight_decay),
        1.0 / float(bias_correction1), 1.0 / float(bias_correction2), 1 if adam_w_mode else 0,
    )  # fmt: skip
    total = sum(t.numel for t in described)
    threads = max(1, min(threads, total // _MIN_ELEMENTS_PER_THREAD, _MAX_THREADS))
    if os.getpid() != _loaded_in_pid:
        threads = 1
    _run_passes(lib, loaded_status, (tensors, count, total, threads, hyper), scaled)
    # Written through raw pointers, so torch did not see it: tell autograd (and anything else
    # that watches version counters) as torch's own in-place ops would.
    written = [*params, *exp_avgs, *exp_avg_sqs, *(m for m in masters if m is not None)]
    if block_format is not None:
        written += [s for s in (*m_scales, *v_scales) if s is not None]
    increment_version(written)


def _run_passes(
    lib: Any, loaded_status: KernelStatus, args: tuple[Any, ...], scaled: Sequence[_Scaled]
) -> None:
    """The kernel's passes over ``args`` (tensors, count, total, threads, hyper): first the
    amaxes of the scaled moments (then their new scales and multipliers), then the update;
    the new scales are written last."""
    tensors, count, total, threads, hyper = args

    def run(pass_: int) -> None:
        # ctypes drops the GIL for the call; the threads are OpenMP's (torch's own runtime).
        code = lib.wo_adamw_step(
            tensors, count, total, threads, _BLOCK_ELEMENTS, ctypes.byref(hyper), pass_
        )
        if code != 0:
            raise RuntimeError(
                f"the CPU AdamW kernel rejected its operands (code {code}): the compiled "
                f"library does not match this Python module; delete {loaded_status.library} "
                "to rebuild it"
            )

    new_scales: list[tuple[list[Tensor], Tensor]] = []
    if scaled:
        run(_PASS_AMAX)
        new_scales = _new_scales(scaled)
    run(_PASS_WRITE)
    for scales, values in new_scales:
        for scale, value in zip(scales, values.unbind(), strict=True):
            scale.copy_(value)


def _per_param_lists(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    exp_avgs: Sequence[Tensor],
    exp_avg_sqs: Sequence[Tensor],
    masters: Sequence[Tensor | None] | None,
    exp_avg_scales: Sequence[Tensor | None] | None,
    exp_avg_sq_scales: Sequence[Tensor | None] | None,
) -> tuple[Sequence[Tensor | None], Sequence[Tensor | None], Sequence[Tensor | None]]:
    """(masters, exp_avg scales, exp_avg_sq scales), None entries for lists not given;
    every list must have one entry per parameter."""
    count = len(params)
    masters = [None] * count if masters is None else masters
    m_scales = [None] * count if exp_avg_scales is None else exp_avg_scales
    v_scales = [None] * count if exp_avg_sq_scales is None else exp_avg_sq_scales
    lengths = [len(grads), len(exp_avgs), len(exp_avg_sqs), len(masters), len(m_scales),
               len(v_scales)]  # fmt: skip
    if set(lengths) != {count}:
        raise ValueError(
            "params, grads, exp_avgs, exp_avg_sqs, masters, exp_avg_scales and "
            f"exp_avg_sq_scales must have one entry per parameter; got {count}, "
            + ", ".join(map(str, lengths[:-1]))
            + f" and {lengths[-1]}"
        )
    return masters, m_scales, v_scales
