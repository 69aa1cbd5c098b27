"""What ``wrapped-optim env`` prints: the versions and the CPU kernel's state a bug report needs.

Versions are read from the installed distributions' metadata, so an optional framework that
is installed but broken (or slow to import) is still listed and never imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys

import torch

import wrapped_optim
from wrapped_optim.optimizers.kernels import cpu_kernel

__all__ = ["collect", "format_rows"]

#: (label, distribution names tried in turn): the frameworks the stacks wrap or run under.
_DISTRIBUTIONS = (
    ("megatron-core", ("megatron-core", "megatron_core")),
    ("megatron-fsdp", ("megatron-fsdp", "megatron_fsdp")),
    ("transformer-engine", ("transformer-engine", "transformer_engine",
                            "transformer-engine-torch", "transformer_engine_torch")),
    ("triton", ("triton",)),
    ("numpy", ("numpy",)),
    ("accelerate", ("accelerate",)),
    ("lightning", ("lightning",)),
    ("transformers", ("transformers",)),
    ("deepspeed", ("deepspeed",)),
)  # fmt: skip


def _version(names: tuple[str, ...]) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cuda() -> str:
    if torch.version.cuda is None:
        return "none (a CPU build of torch)"
    if not torch.cuda.is_available():
        return f"{torch.version.cuda} (no GPU visible)"
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    return f"{torch.version.cuda}, {torch.cuda.device_count()} GPU(s): {', '.join(names)}"


def _kernel_rows() -> list[tuple[str, str]]:
    status = cpu_kernel.status()
    if status.available:
        state = "available" + (", OpenMP threads" if status.parallel else ", one thread")
        origin = "built with the package" if status.packaged else "built at run time into the cache"
        rows = [
            ("CPU kernel", state),
            ("kernel loops", f"{status.loops} (fp16/FP8 moments)"),
            ("kernel loop families", ", ".join(status.loop_families)),
            ("kernel library", f"{status.library} ({origin})"),
        ]
    else:
        rows = [("CPU kernel", f"unavailable: {status.reason}")]
    compiler = status.compiler
    rows += [
        ("kernel cache", " or ".join(map(str, cpu_kernel.cache_dir_candidates()))),
        ("C compiler", compiler or "none found (install gcc or clang, or set CC)"),
    ]
    return rows


def collect() -> list[tuple[str, str]]:
    """``(label, value)`` rows: wrapped-optim, Python, platform, torch and CUDA, the optional
    frameworks' versions, the CPU kernel's status, loop families, library and cache. Builds
    (or loads) the kernel as its first use would.

    Example:
        >>> from wrapped_optim._env_report import collect
        >>> labels = [label for label, _ in collect()]
        >>> {"torch", "CUDA", "megatron-core", "CPU kernel", "kernel cache"} <= set(labels)
        True
    """
    rows = [
        (
            "wrapped-optim",
            f"{wrapped_optim.__version__} ({os.path.dirname(wrapped_optim.__file__)})",
        ),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.platform()}, {os.cpu_count()} CPUs"),
        ("torch", f"{torch.__version__}, {torch.get_num_threads()} intra-op threads"),
        ("CUDA", _cuda()),
    ]
    rows += [(label, _version(names)) for label, names in _DISTRIBUTIONS]
    return rows + _kernel_rows()


def format_rows(rows: list[tuple[str, str]]) -> str:
    """The rows as aligned ``label: value`` lines.

    Example:
        >>> from wrapped_optim._env_report import format_rows
        >>> print(format_rows([("torch", "2.13.0"), ("CPU kernel", "available")]))
        torch      : 2.13.0
        CPU kernel : available
    """
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)} : {value}" for label, value in rows)
