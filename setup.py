"""The package build compiles the CPU AdamW kernel (everything else is in pyproject.toml).

The library is plain C loaded with ctypes (no Python C API), so the wheel is tagged
``py3-none-<platform>``. Without a working C compiler the package still installs; the kernel
is then built at first use, or its absence is reported (see ``wrapped-optim env``); the
install says so on the terminal, where pip shows it even without ``-v``.
``WRAPPED_OPTIM_REQUIRE_KERNEL=1`` makes a failed build fail the install (for wheel builds).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1 (pyproject asks for newer; --no-build-isolation may not)
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

_HERE = Path(__file__).resolve().parent
_KERNEL = "wrapped_optim.optimizers.kernels._adamw_cpu_kernel"


def _kernel_build() -> ModuleType:
    """wrapped_optim/optimizers/kernels/_build.py, loaded alone (the package imports torch)."""
    path = _HERE / "wrapped_optim" / "optimizers" / "kernels" / "_build.py"
    spec = importlib.util.spec_from_file_location("_wrapped_optim_kernel_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildKernel(build_ext):
    """Compiles the kernel with the flags the run-time fallback uses, into the package."""

    def get_ext_filename(self, fullname: str) -> str:
        if fullname.split(".")[-1] == _KERNEL.split(".")[-1]:
            return os.path.join(*fullname.split(".")[:-1], _kernel_build().packaged_name())
        return super().get_ext_filename(fullname)

    def build_extension(self, ext: Extension) -> None:
        if ext.name != _KERNEL:
            super().build_extension(ext)
            return
        build = _kernel_build()
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        print(f"building the CPU AdamW kernel ({build.TYPICAL_BUILD})", file=sys.stderr)
        started = time.monotonic()
        try:
            built, extra = build.build_packaged(output.parent)
        except RuntimeError as exc:
            if os.environ.get("WRAPPED_OPTIM_REQUIRE_KERNEL") == "1":
                raise
            _notify(
                f"wrapped-optim installs WITHOUT its compiled CPU AdamW kernel: {exc}.\n"
                f"{build.MISSING_COST}.\nTo have it: install gcc or clang (or set CC) and "
                "reinstall, or install the manylinux wheel; without reinstalling, the kernel "
                "is built at first use once a compiler is there. `wrapped-optim env` shows "
                "its status."
            )
            return
        assert built == output, (built, output)
        flags = " ".join(extra) or "no extra flags"
        print(
            f"built {built.name} ({flags}) in {time.monotonic() - started:.0f} s",
            file=sys.stderr,
        )


def _notify(message: str) -> None:
    """``message`` on stderr and on the terminal: pip and uv show a build's output only with
    -v, and a missing kernel must not go unseen (a build without a terminal, as in CI, has
    its stderr and the run-time warning)."""
    text = "\n".join(f"WARNING: {line}" for line in message.splitlines()) + "\n"
    sys.stderr.write(text)
    try:
        with open("/dev/tty", "w") as terminal:
            terminal.write(text)
    except OSError:
        pass  # no controlling terminal


class PlatformWheel(bdist_wheel):
    """A ctypes library, not a Python extension: any Python 3, this platform."""

    def get_tag(self) -> tuple[str, str, str]:
        _, _, platform = super().get_tag()
        return "py3", "none", platform


kernel_sources = sorted(
    str(path.relative_to(_HERE))
    for path in (_HERE / "wrapped_optim" / "optimizers" / "kernels" / "csrc").glob(
        "_adamw_cpu*.[ch]"
    )
)
setup(
    ext_modules=[Extension(_KERNEL, sources=kernel_sources, optional=True)],
    cmdclass={"build_ext": BuildKernel, "bdist_wheel": PlatformWheel},
)
