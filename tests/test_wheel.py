"""The release wheel: `.ci/build_wheel OUTDIR` makes a manylinux wheel that carries the CPU
kernel, and the wheel alone, in a clean venv beside torch, runs the demo with the packaged
kernel (no compiler at run time).

Several minutes on 2 cores (the kernel's compile, a clean venv with torch): marked slow.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from wrapped_optim.optimizers.kernels import _build as _kernel_build

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = f"manylinux_2_17_{platform.machine()}"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="manylinux wheels are Linux wheels"),
]


def glibc_versions_needed(library: bytes) -> set[tuple[int, ...]]:
    """The GLIBC_x.y symbol versions an ELF shared library asks for."""
    import io

    from elftools.elf.elffile import ELFFile  # pyelftools, which auditwheel installs

    needed = set()
    elf = ELFFile(io.BytesIO(library))
    section = elf.get_section_by_name(".gnu.version_r")
    assert section is not None
    for _, auxiliaries in section.iter_versions():
        for aux in auxiliaries:
            match = re.fullmatch(r"GLIBC_(\d+(?:\.\d+)*)", aux.name)
            if match:
                needed.add(tuple(int(part) for part in match.group(1).split(".")))
    return needed


def test_the_release_wheel_is_manylinux_and_runs_the_demo_alone(tmp_path: Path) -> None:
    if _kernel_build.find_compiler() is None:
        pytest.skip("no C compiler here (the release wheel needs one to build)")
    built = subprocess.run(
        [str(ROOT / ".ci" / "build_wheel"), str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=1800,
        env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert built.stdout.strip().splitlines()[-1] == str(wheel)
    assert wheel.name.endswith(f"-py3-none-manylinux2014_{platform.machine()}.{PLATFORM}.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("wrapped_optim-0.1.0.dist-info/WHEEL").decode()
        library = archive.read(f"wrapped_optim/optimizers/kernels/{_kernel_build.packaged_name()}")
        assert not [n for n in archive.namelist() if ".libs/" in n]  # nothing grafted
    assert f"Tag: py3-none-{PLATFORM}" in metadata
    assert max(glibc_versions_needed(library)) <= (2, 17)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel), "torch==2.13.0"],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr[-4000:]
    # From outside the checkout, with no compiler and an empty kernel cache: only the
    # packaged library can give the kernel.
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    env = {**os.environ, "CC": "/bin/false", "WRAPPED_OPTIM_KERNEL_CACHE": str(tmp_path / "c")}
    env.pop("PYTHONPATH", None)
    demo = subprocess.run(
        [str(venv / "bin" / "wrapped-optim"), "demo", "--steps", "8", "--no-progress"],
        capture_output=True, text=True, timeout=1800, cwd=run_dir, env=env,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "kernel is unavailable" not in demo.stderr
    report = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "wrapped_optim", "env"],
        capture_output=True, text=True, timeout=600, cwd=run_dir, env=env,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr
    rows = {k.strip(): v for k, v in (line.split(" : ", 1) for line in report.stdout.splitlines())}
    assert rows["CPU kernel"].startswith("available")
    assert rows["kernel library"].startswith(str(venv)), rows["kernel library"]


def test_an_sdist_install_without_a_compiler_says_so_on_the_terminal(tmp_path: Path) -> None:
    """pip shows a build's output only with -v: the notice goes to the terminal too, so a
    plain `pip install` of the sdist on a machine without a compiler shows what it lacks and
    what that costs (pip runs here under a pseudo-terminal, as in a user's shell)."""
    import pty

    code = (
        "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    )
    sdist = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
    archive = tmp_path / sdist.stdout.strip().splitlines()[-1]
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
               "--target", str(tmp_path / "target"), str(archive)]  # fmt: skip
    env = {**os.environ, "CC": "/bin/false"}
    env.pop("WRAPPED_OPTIM_REQUIRE_KERNEL", None)
    pid, terminal = pty.fork()
    if pid == 0:  # the child: pip, with the pseudo-terminal as its controlling terminal
        os.execve(sys.executable, command, env)
    seen = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    text = " ".join(seen.decode(errors="replace").split())
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    assert "installs WITHOUT its compiled CPU AdamW kernel" in text, text[-3000:]
    assert "/bin/false failed to build" in text  # what it lacks
    assert "about 3x with bf16 moments" in text  # what it costs
    assert "install gcc or clang" in text  # what to do
    assert not list((tmp_path / "target").rglob("_adamw_cpu-*.so"))
