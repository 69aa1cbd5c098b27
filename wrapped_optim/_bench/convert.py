"""Benchmark: ``wrapped_optim.checkpoint.convert`` throughput against a plain copy of the
same bytes, and its peak host memory against the largest tensor.

An AdamW state of ``--params`` parameters (FP32 moments over transformer-shaped matrices) is
written once as a ``torch.save`` file and once as a DCP directory; then each conversion runs
in a fresh child process: ``torch-save -> dcp``, ``dcp -> torch-save``, ``torch-save ->
torch-save`` and ``dcp -> dcp-streaming``. The baseline is a copy of the source's bytes
(``shutil.copyfile`` / ``copytree``), fsync'd like the converter's output. With ``--cold``
the source's pages are dropped from the page cache (``posix_fadvise(DONTNEED)`` on its
files, nothing else's) before every run, copy and conversion alike, so both read it from
disk. Memory: the growth of the child's peak RSS (``VmHWM``, which counts a memory-mapped
source's pages as they are read) and the peak of its anonymous memory (``RssAnon``, sampled
every 2 ms: what the process holds itself).

Run: ``python -m wrapped_optim._bench.convert [--params N] [--rounds R] [--cold] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from wrapped_optim._bench._memory import proc_status, reset_peak

ROWS, COLS = 2048, 4096  # one matrix: 8 Mi parameters, 32 MiB per FP32 moment
CASES = (
    ("torch-save", "dcp"),
    ("dcp", "torch-save"),
    ("torch-save", "torch-save"),
    ("dcp", "dcp-streaming"),
)


def _shapes(params: int) -> list[tuple[int, ...]]:
    count = max(1, params // (ROWS * COLS))
    return [(ROWS, COLS)] * count + [(COLS,)] * count


class _Synthetic:
    """A random AdamW state handed out one tensor at a time (a canonical-form reader), so
    the sources of any size are written without holding the state in memory."""

    def __init__(self, shapes: list[tuple[int, ...]], master: bool) -> None:
        import torch

        from wrapped_optim.checkpoint._convert._canonical import (
            MASTER,
            GroupRecord,
            ParamRecord,
            StateIndex,
            TensorSpec,
        )

        keys = ("exp_avg", "exp_avg_sq", *((MASTER,) if master else ()))
        self.names = [f"layers.{i}.weight" for i in range(len(shapes))]
        params = [
            ParamRecord(name, 0, shape, {k: TensorSpec(shape, torch.float32) for k in keys}, 10.0)
            for name, shape in zip(self.names, shapes, strict=True)
        ]
        options = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        self._index = StateIndex(params, [GroupRecord(options, self.names)], source="bench")
        self._seed = {(name, key): 3 * i + j for i, name in enumerate(self.names)
                      for j, key in enumerate(keys)}  # fmt: skip

    def index(self) -> Any:
        return self._index

    def read(self, name: str, key: str) -> Any:
        import torch

        generator = torch.Generator().manual_seed(self._seed[name, key])
        shape = self._index.param(name).shape
        if key == "exp_avg_sq":
            return torch.rand(shape, generator=generator)
        return torch.randn(shape, generator=generator)

    def close(self) -> None:
        pass


def _write_sources(root: Path, params: int, master: bool = False) -> tuple[int, int]:
    """The DCP source (streamed, one tensor at a time) and the names file."""
    from wrapped_optim.checkpoint._convert._dcp import DcpWriter
    from wrapped_optim.checkpoint._convert._options import FormatOptions

    shapes = _shapes(params)
    synthetic = _Synthetic(shapes, master)
    DcpWriter(root / "dcp", FormatOptions(), "dcp").write(synthetic.index(), synthetic)
    (root / "names.json").write_text(json.dumps(synthetic.names))
    per_param = 4 * (3 if master else 2)
    return sum(per_param * _numel(s) for s in shapes), sum(_numel(s) for s in shapes)


def _torch_save_source(root: Path) -> None:
    """The ``torch.save`` source, converted from the DCP one (not timed)."""
    from wrapped_optim.checkpoint import convert

    convert(root / "dcp", root / "optimizer.pt", to="torch-save", names=root / "names.json")


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _source(root: Path, fmt: str) -> Path:
    return root / ("optimizer.pt" if fmt == "torch-save" else "dcp")


class _AnonPeak:
    """The peak of ``RssAnon`` while the block runs (sampled)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> _AnonPeak:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, proc_status("RssAnon"))
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, proc_status("RssAnon"))


def _fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb+") as stream:
            os.fsync(stream.fileno())


def _child(root: Path, case: str) -> None:
    import warnings

    import torch

    from wrapped_optim.checkpoint import convert
    from wrapped_optim.checkpoint._convert._formats import known_formats

    warnings.filterwarnings("ignore")
    known_formats()  # imports every format's module before the clock starts
    torch.set_num_threads(1)
    src_fmt, _, dst_fmt = case.partition(":")
    source = _source(root, src_fmt)
    target = root / f"out_{src_fmt}_{dst_fmt}"
    names = root / "names.json"
    base_anon = proc_status("RssAnon")
    reset_peak()
    base = proc_status("VmRSS")
    with _AnonPeak() as anon:
        start = time.perf_counter()
        if dst_fmt == "copy":
            if source.is_dir():
                shutil.copytree(source, target)
            else:
                shutil.copyfile(source, target)
            _fsync_tree(target)
        else:
            convert(source, target, to=dst_fmt, names=names)
        seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "hwm_growth": proc_status("VmHWM") - base,
                      "anon_growth": anon.peak - base_anon}))  # fmt: skip
    kept = root / "optimizer.pt"
    if (src_fmt, dst_fmt) == ("dcp", "torch-save") and not kept.exists():
        target.rename(kept)  # the torch-save source of later cases: no second conversion
    elif target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink()


def _evict(path: Path) -> None:
    """Drops ``path``'s clean pages from the page cache (after writing back any dirty ones)."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _run_child(root: Path, case: str, cold: bool = False) -> dict[str, Any]:
    if cold:
        _evict(_source(root, case.partition(":")[0]))
    load_before = os.getloadavg()[0]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(128 << 10))
    cmd = [sys.executable, "-m", "wrapped_optim._bench.convert", "--child", str(root), case]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["load"] = (load_before, os.getloadavg()[0])
    return result


def _collect(
    params: int,
    rounds: int,
    cold: bool = False,
    master: bool = False,
    cases: tuple[tuple[str, str], ...] = CASES,
) -> dict[str, Any]:
    """Runs ``cases``, those reading DCP first; the ``torch.save`` source is made (from the
    DCP one, untimed) when a case first needs it, and the DCP source is deleted once no case
    reads it, so the disk holds at most two copies of the state at a time."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("WRAPPED_OPTIM_BENCH_DIR")) as tmp:
        root = Path(tmp)
        state_bytes, params = _write_sources(root, params, master)
        largest = 4 * ROWS * COLS
        ordered = sorted(cases, key=lambda case: case[0] != "dcp")
        rows = []
        for number, (src, dst) in enumerate(ordered):
            if src == "torch-save" and not (root / "optimizer.pt").exists():
                _torch_save_source(root)
            if all(later != "dcp" for later, _ in ordered[number:]) and (root / "dcp").exists():
                shutil.rmtree(root / "dcp")
            best: dict[str, dict[str, Any]] = {}
            for _ in range(rounds):
                for kind in ("copy", dst):
                    result = _run_child(root, f"{src}:{kind}", cold)
                    if kind not in best or result["seconds"] < best[kind]["seconds"]:
                        best[kind] = result
            rows.append({"source": src, "target": dst, "convert": best[dst], "copy": best["copy"]})
    return {"params": params, "state_bytes": state_bytes, "largest": largest, "rows": rows,
            "cold": cold, "master": master, "load": os.getloadavg()[0]}  # fmt: skip


def _render(data: dict[str, Any]) -> str:
    mib = 2**20
    lines = [
        "## Converting optimizer checkpoints",
        "",
        f"AdamW state of {data['params'] / 1e6:,.0f}M parameters: "
        f"{data['state_bytes'] / mib:,.0f} MiB of moments"
        f"{' and FP32 masters' if data.get('master') else ''}, largest tensor "
        f"{data['largest'] / mib:,.0f} MiB. Best of the rounds, each in a fresh process, the "
        f"source {'cold (evicted from the page cache)' if data.get('cold') else 'warm'}; "
        f"load average {data.get('load', 0.0):.1f} at the end.",
        "",
        "| conversion | convert s | copy s | ratio | peak RSS growth | peak anonymous growth "
        "| load average (convert; copy) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in data["rows"]:
        conv, copy = row["convert"], row["copy"]
        lines.append(
            f"| `{row['source']}` -> `{row['target']}` | {conv['seconds']:.2f} | "
            f"{copy['seconds']:.2f} | {conv['seconds'] / copy['seconds']:.2f}x | "
            f"{conv['hwm_growth'] / mib:,.0f} MiB | {conv['anon_growth'] / mib:,.0f} MiB | "
            f"{_load(conv)}; {_load(copy)} |"
        )
    return "\n".join(lines)


def _load(result: dict[str, Any]) -> str:
    before, after = result.get("load", (0.0, 0.0))
    return f"{before:.1f} -> {after:.1f}"


def run(quick: bool = False, rounds: int | None = None, cold: bool = False) -> str:
    """The section's Markdown: 100M parameters (16M with ``quick``)."""
    params = 16 << 20 if quick else 100_000_000
    return _render(_collect(params, rounds or (1 if quick else 2), cold))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("ROOT", "CASE"), help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold", action="store_true", help="read every source from disk")
    parser.add_argument("--master", action="store_true", help="an FP32 master per parameter too")
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="SRC:DST",
        help="the conversions to run (default: " + " ".join(f"{a}:{b}" for a, b in CASES) + ")",
    )
    args = parser.parse_args(argv)
    if args.child:
        _child(Path(args.child[0]), args.child[1])
        return
    cases = tuple(tuple(c.split(":", 1)) for c in args.cases) if args.cases else CASES
    if args.params:
        data = _collect(args.params, args.rounds or 2, args.cold, args.master, cases)
        print(_render(data))
    else:
        print(run(args.quick, args.rounds, args.cold))


if __name__ == "__main__":
    main()
