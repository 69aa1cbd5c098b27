"""Runs the benchmark topics and writes ``benchmarks.md`` with its plots where it is told.

Every module ``wrapped_optim._bench.<topic>`` (except this one and the CUDA-only ``gpu_*``
scripts) is a topic. A topic measures with ``collect(quick)`` (a JSON-able dict of its rows)
and turns those rows into its Markdown section (``render(data)``), its one-sentence result
(``headline(data)``) and its PNG figures (``plots(data, image_dir)``); a simpler topic has only
``run(quick)`` returning Markdown. The report runs each topic in turn, keeps going when one
fails (the page says which and why), and writes one page: a header with the machine, the date
and how to reproduce, a summary of every topic's headline, then every topic's section with its
figures. Each topic's rows are kept beside its page as ``bench/<topic>.json``, so
``--replot`` redraws the figures and rewrites the pages from them without measuring again.
Figures are drawn only when matplotlib is importable (``pip install 'wrapped-optim[plots]'``).

Output goes to ``--out`` (default ``./wrapped-optim-bench``, never the docs of whatever
directory it runs in); the project's docs are regenerated with ``--out docs``. A full run of
some topics (``wrapped-optim bench precision_adam --out docs``) refreshes their pages and keeps
the other topics' sections, remade from their rows (or their pages) of an earlier run, so the
page stays whole.

Run it as ``wrapped-optim bench`` or ``python -m wrapped_optim._bench.report``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import torch

from wrapped_optim._bench import _figures
from wrapped_optim._bench._topics import (
    DEFAULT_OUT,
    PACKAGE,
    add_arguments,
    discover_topics,
    is_topic_name,
)

PAGE = "benchmarks.md"
IMAGE_DIR = "img"
TOPIC_DIR = "bench"
#: A hand-written page of measurements no topic makes, linked from the summary when present.
BY_HAND_PAGE = "by_hand.md"
#: The contributors' page of targets met and missed (the users' pages show results only).
TARGETS_PAGE = "contributing/bench_targets.md"


class UnknownTopicError(LookupError):
    """A requested topic is not a benchmark module.

    Example:
        >>> from wrapped_optim._bench.report import UnknownTopicError, run_benchmarks
        >>> try:
        ...     run_benchmarks(only=["no_such_topic"], out_dir="/tmp/unused")
        ... except UnknownTopicError as error:
        ...     print(str(error).splitlines()[0])
        unknown benchmark topic 'no_such_topic'
    """


@attrs.frozen
class TopicResult:
    """What running one topic produced.

    Attributes:
        topic: the module's short name.
        markdown: its section as returned by ``render`` or ``run`` (empty when it failed).
        seconds: wall time of the measurement (plus the figures).
        error: ``"Type: message"`` when the topic raised, else None.
        plots: the figures it wrote.
        kept: the section was not measured now but kept from the topic's page or rows of
            an earlier run in the same output folder.
        headline: the topic's one-sentence result (None for a topic without rows).
        data: the rows the section, headline and figures were made from (None for a
            topic with only ``run``); saved as ``bench/<topic>.json``.
        quick: the rows were measured in quick mode.

    Example:
        >>> from wrapped_optim._bench.report import TopicResult
        >>> TopicResult("demo", "## Demo", 0.5, None, ()).ok
        True
    """

    topic: str
    markdown: str
    seconds: float
    error: str | None
    plots: tuple[Path, ...]
    kept: bool = False
    headline: str | None = None
    data: Any = attrs.field(default=None, eq=False, repr=False)
    quick: bool = False

    @property
    def ok(self) -> bool:
        """True when the topic ran without raising."""
        return self.error is None


@attrs.frozen
class BenchReport:
    """The written page and what each topic produced.

    Example:
        >>> from pathlib import Path
        >>> from wrapped_optim._bench.report import BenchReport, TopicResult
        >>> failed = TopicResult("x", "", 0.1, "RuntimeError: boom", ())
        >>> BenchReport(Path("docs/benchmarks.md"), (failed,)).ok
        False
    """

    page: Path
    results: tuple[TopicResult, ...]

    @property
    def ok(self) -> bool:
        """True when every topic ran."""
        return all(r.ok for r in self.results)


def machine_summary() -> list[tuple[str, str]]:
    """``(label, value)`` rows describing where the numbers were measured.

    Example:
        >>> from wrapped_optim._bench.report import machine_summary
        >>> [label for label, _ in machine_summary()]
        ['CPU', 'accelerator', 'torch', 'Python', 'OS']
    """
    cpu = _cpu_model() or platform.processor() or platform.machine()
    cores = os.cpu_count() or 0
    if torch.cuda.is_available():
        accelerator = ", ".join(
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        )
    else:
        accelerator = "none (CPU only)"
    return [
        ("CPU", f"{cpu} ({cores} logical cores)"),
        ("accelerator", accelerator),
        ("torch", f"{torch.__version__} ({torch.get_num_threads()} intra-op threads)"),
        ("Python", platform.python_version()),
        ("OS", platform.platform()),
    ]


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^model name\s*:\s*(.+)$", text, flags=re.MULTILINE)
    return match.group(1).strip() if match else None


def _load_topic(package: str, topic: str, known: Sequence[str]) -> ModuleType:
    available = ", ".join(known) or "none"
    if not is_topic_name(topic):
        raise UnknownTopicError(
            f"unknown benchmark topic {topic!r}\n"
            f"'report' and gpu_* modules are not topics; available: {available}"
        )
    name = f"{package}.{topic}"
    if name not in sys.modules and importlib.util.find_spec(name) is None:
        raise UnknownTopicError(f"unknown benchmark topic {topic!r}\navailable: {available}")
    module = importlib.import_module(name)
    if not callable(getattr(module, "run", None)):
        raise UnknownTopicError(f"{name} has no run(quick) function\navailable: {available}")
    return module


#: Seconds between the "still running" lines of a long topic.
HEARTBEAT_SECONDS = 20.0


@contextlib.contextmanager
def _heartbeat(topic: str, echo: Callable[[str], None] | None) -> Iterator[None]:
    """While the body runs, echo a line every :data:`HEARTBEAT_SECONDS`: a topic may measure
    for minutes, and silence reads as a hang."""
    if echo is None:
        yield
        return
    done = threading.Event()
    start = time.perf_counter()

    def beat() -> None:
        while not done.wait(HEARTBEAT_SECONDS):
            echo(f"  {topic}: still running ({time.perf_counter() - start:.0f} s)")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _has_rows(module: ModuleType) -> bool:
    """The topic measures rows (``collect``) and makes its page from them (``render``)."""
    return all(callable(getattr(module, name, None)) for name in ("collect", "render", "headline"))


def _from_rows(
    topic: str, module: ModuleType, data: Any, image_dir: Path | None, *, seconds: float,
    quick: bool, kept: bool = False,
) -> TopicResult:  # fmt: skip
    """The section, headline and figures of ``topic`` made from its measured ``data``."""
    markdown = module.render(data)
    if not isinstance(markdown, str):
        raise TypeError(f"render() returned a {type(markdown).__name__}, not Markdown text")
    headline = str(module.headline(data))
    plots: tuple[Path, ...] = ()
    make_plots: Callable[[Any, Path], Sequence[Path]] | None = getattr(module, "plots", None)
    if image_dir is not None and make_plots is not None:
        image_dir.mkdir(parents=True, exist_ok=True)
        plots = tuple(Path(p) for p in make_plots(data, image_dir))
    return TopicResult(topic, markdown, seconds, None, plots, kept, headline, data, quick)


def _failed(topic: str, exc: Exception, seconds: float) -> TopicResult:
    return TopicResult(topic, "", seconds, f"{type(exc).__name__}: {exc}", ())


def _run_topic(topic: str, module: ModuleType, quick: bool, image_dir: Path | None) -> TopicResult:
    start = time.perf_counter()
    data = None
    try:
        if _has_rows(module):
            data = module.collect(quick)
            return _from_rows(
                topic, module, data, image_dir, seconds=time.perf_counter() - start, quick=quick
            )
        markdown = module.run(quick)
        if not isinstance(markdown, str):
            raise TypeError(f"run() returned a {type(markdown).__name__}, not Markdown text")
        plots: tuple[Path, ...] = ()
        make_plots: Callable[[Path], Sequence[Path]] | None = getattr(module, "plots", None)
        if image_dir is not None and make_plots is not None:
            image_dir.mkdir(parents=True, exist_ok=True)
            plots = tuple(Path(p) for p in make_plots(image_dir))
        return TopicResult(topic, markdown, time.perf_counter() - start, None, plots, quick=quick)
    except Exception as exc:  # a failing topic is reported, the others still run
        # Rows measured before the page failed are kept: --replot can use them.
        failed = _failed(topic, exc, time.perf_counter() - start)
        return attrs.evolve(failed, data=data, quick=quick)
    finally:
        gc.collect()


#: The version of the ``bench/<topic>.json`` layout.
ROWS_FORMAT = 1


def rows_path(out: Path, topic: str) -> Path:
    """Where the rows of ``topic`` are kept: ``<out>/bench/<topic>.json``.

    Example:
        >>> from pathlib import Path
        >>> from wrapped_optim._bench.report import rows_path
        >>> rows_path(Path("docs"), "staged").as_posix()
        'docs/bench/staged.json'
    """
    return out / TOPIC_DIR / f"{topic}.json"


def _write_topic(out: Path, result: TopicResult) -> None:
    """The topic's own page: its section with its figures."""
    folder = out / TOPIC_DIR
    folder.mkdir(parents=True, exist_ok=True)
    page = result.markdown.strip("\n")
    if result.plots:
        page = _with_figures(page, result, folder)
    (folder / f"{result.topic}.md").write_text(page + "\n")


def _write_targets(
    out: Path, results: Sequence[TopicResult], package: str, known: Sequence[str]
) -> None:
    """``<out>/contributing/bench_targets.md``: each topic's ``targets(data)`` section, from
    the rows its page was drawn from; nothing when no topic here has targets."""
    sections = []
    for result in results:
        if result.ok and result.data is not None:
            module = _load_topic(package, result.topic, known)
            if hasattr(module, "targets"):
                sections.append(module.targets(result.data).strip("\n"))
    if not sections:
        return
    page = out / TARGETS_PAGE
    page.parent.mkdir(parents=True, exist_ok=True)
    head = [
        "# Benchmark targets (contributors)",
        "",
        "The performance targets the project holds its code to, met or missed, computed from "
        "the rows the benchmark pages are drawn from (`bench/<topic>.json`). "
        "`wrapped-optim bench --replot --out docs` rewrites this page with them; the users' "
        "pages show the results only ([Benchmarks](../benchmarks.md)).",
    ]
    page.write_text("\n\n".join(["\n".join(head), *sections]) + "\n")


def _write_rows(out: Path, result: TopicResult) -> None:
    """``bench/<topic>.json``: the rows of ``result`` with when and where they were measured."""
    (out / TOPIC_DIR).mkdir(parents=True, exist_ok=True)
    record = {
        "format": ROWS_FORMAT,
        "topic": result.topic,
        "quick": result.quick,
        "seconds": round(result.seconds, 1),
        "measured": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
        "machine": dict(machine_summary()),
        "data": result.data,
    }
    rows_path(out, result.topic).write_text(json.dumps(record, indent=1) + "\n")


def read_rows(out: Path, topic: str) -> dict[str, Any] | None:
    """The record :func:`run_benchmarks` kept for ``topic`` in ``out`` (None if there is none).

    Raises:
        ValueError: the file is not such a record (it names the file and what to do).

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from wrapped_optim._bench.report import read_rows
        >>> read_rows(Path(tempfile.mkdtemp()), "staged") is None
        True
    """
    path = rows_path(out, topic)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); measure again without --replot") from None
    if not isinstance(record, dict) or record.get("format") != ROWS_FORMAT or "data" not in record:
        raise ValueError(
            f"{path} is not a format-{ROWS_FORMAT} record of measured rows; measure the topic "
            "again without --replot"
        )
    return record


def _replayed(
    topic: str, module: ModuleType, out: Path, image_dir: Path | None, *, kept: bool
) -> TopicResult | None:
    """The topic's section, headline and figures remade from its kept rows (None: no rows;
    the topic's page without rows is kept as it is)."""
    page = out / TOPIC_DIR / f"{topic}.md"
    try:
        record = read_rows(out, topic) if _has_rows(module) else None
        if record is None:
            if not page.is_file():
                return None
            # Its figures are the files plots() wrote, named after the topic.
            figures = tuple(sorted((out / IMAGE_DIR).glob(f"{topic}_*.png")))
            return TopicResult(topic, page.read_text(), 0.0, None, figures, kept=True)
        return _from_rows(
            topic, module, record["data"], image_dir, seconds=float(record.get("seconds", 0.0)),
            quick=bool(record.get("quick")), kept=kept,
        )  # fmt: skip
    except Exception as exc:  # a broken record fails its topic, not the page
        return _failed(topic, exc, 0.0)


def matplotlib_available() -> bool:
    """True when matplotlib can be imported (figures are drawn only then).

    Example:
        >>> from wrapped_optim._bench.report import matplotlib_available
        >>> isinstance(matplotlib_available(), bool)
        True
    """
    return _figures.available()


def _shift_headings(markdown: str, topic: str) -> str:
    """Makes the section's top heading level 2 (the page owns level 1); adds one if missing."""
    lines = markdown.strip("\n").splitlines()
    levels: list[int] = []
    fenced = False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced and (match := re.match(r"^(#{1,6}) ", line)):
            levels.append(len(match.group(1)))
    if not levels:
        return f"## {topic}\n\n" + "\n".join(lines)
    shift = max(0, 2 - min(levels))
    out, fenced = [], False
    for line in lines:
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif shift and not fenced and re.match(r"^#{1,6} ", line):
            line = "#" * shift + line
        out.append(line)
    return "\n".join(out)


def _with_figures(markdown: str, result: TopicResult, page_dir: Path) -> str:
    """``markdown`` with links to the result's figures (relative to ``page_dir``) under the
    first paragraph after its top heading (the headline), or at the end when it has none."""
    links = [
        f"![{result.topic}: {plot.stem}]({_relative(plot, page_dir)})" for plot in result.plots
    ]
    links = [link for link in links if link.split("](")[1] not in markdown]
    if not links:
        return markdown
    lines = markdown.split("\n")
    heading = next((i for i, line in enumerate(lines) if line.startswith("#")), None)
    if heading is None or result.headline is None:
        return "\n".join([*lines, "", *links])
    start = heading + 1
    while start < len(lines) and not lines[start].strip():
        start += 1
    end = start
    while end < len(lines) and lines[end].strip():
        end += 1
    return "\n".join([*lines[:end], "", *links, *lines[end:]])


def render_report(
    results: Sequence[TopicResult],
    *,
    page_dir: Path,
    quick: bool,
    machine: Sequence[tuple[str, str]],
    date: datetime.datetime,
    plots_note: str | None = None,
) -> str:
    """The Markdown of ``benchmarks.md`` for ``results`` (figure links relative to ``page_dir``).

    Example:
        >>> import datetime
        >>> from pathlib import Path
        >>> from wrapped_optim._bench.report import TopicResult, render_report
        >>> toy = TopicResult("toy", "# Toy\\n\\n| n | s |\\n|---|---|\\n| 1 | 2 |", 0.25, None, (),
        ...                   headline="Toy: 2 s for one n.")
        >>> page = render_report(
        ...     [toy],
        ...     page_dir=Path("docs"), quick=True, machine=[("CPU", "test")],
        ...     date=datetime.datetime(2026, 1, 2, 3, 4, tzinfo=datetime.timezone.utc))
        >>> print(page.splitlines()[0])
        # Benchmarks
        >>> "## Toy" in page and "2026-01-02 03:04 UTC" in page
        True
        >>> "| [toy](#toy) | Toy: 2 s for one n. | 0.2 |" in page
        True
    """
    mode = "quick mode (`--quick`, smaller sizes)" if quick else "full mode"
    stamp = date.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = "wrapped-optim bench" + (" --quick" if quick else "") + f" --out {page_dir.name}"
    parts = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` on {stamp}, {mode}. Running the command again overwrites "
        f"this page and its figures in `{IMAGE_DIR}/`; speed and memory claims in these docs "
        "are backed by the numbers below, not by timed tests. Each topic's measured rows are "
        f"kept in `{TOPIC_DIR}/<topic>.json`: `wrapped-optim bench --replot --out "
        f"{page_dir.name}` remakes the pages, headlines and figures from them without "
        "measuring.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *(f"| {label} | {_cell(value)} |" for label, value in machine),
        "",
        "## How to reproduce",
        "",
        "```bash",
        "pip install -e '.[plots]'              # matplotlib, for the figures",
        "wrapped-optim bench --out docs         # every topic, full sizes, into docs/",
        "wrapped-optim bench --quick            # every topic, small sizes (./wrapped-optim-bench)",
        "wrapped-optim bench TOPIC --out docs   # some topics; the others' sections are kept",
        "wrapped-optim bench --replot --out docs  # pages and figures from the kept rows",
        "```",
        "",
        "## Summary",
        "",
        "| topic | result | time (s) |",
        "|---|---|---:|",
    ]
    for r in results:
        if not r.ok:
            status = f"**failed**: {_cell(r.error or '')}"
        else:
            status = _cell(r.headline or "see its section")
            if r.quick and not quick:
                status += " (quick run)"
        seconds = f"{r.seconds:.0f}" if r.seconds >= 10 else f"{r.seconds:.1f}"
        if r.kept and r.data is None:
            status, seconds = status + " (kept from an earlier run that kept no rows)", "-"
        parts.append(f"| [{r.topic}](#{_anchor(r)}) | {status} | {seconds} |")
    if not results:
        parts.append("| (no topics) | | |")
    parts.append("")
    if (page_dir / TOPIC_DIR / BY_HAND_PAGE).is_file():
        parts += [
            f"Measured by hand, outside these topics: [{BY_HAND_PAGE}]({TOPIC_DIR}/{BY_HAND_PAGE})"
            " (the every-step stale-master watch, the CPU kernel and the demo on a busy machine,"
            " the staged save on Megatron's precision-aware DistributedOptimizer, the checkpoint"
            " converter at 92M, 747M and 1.5B parameters, and the block-scaled"
            " moments' loops step by step, by thread CPU time, and the int4 and per-tensor FP8"
            " loops against their cycle floors, in and out of cache; the precision_adam and hybrid"
            " sections above measure the block formats beside the peers in one run).",
            "",
        ]
    if plots_note:
        parts += [plots_note, ""]
    for r in results:
        if r.ok:
            parts.append(_with_figures(_shift_headings(r.markdown, r.topic), r, page_dir))
        else:
            parts += [f"## {r.topic}", "", f"This topic failed: `{r.error}`"]
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def _anchor(result: TopicResult) -> str:
    """The anchor mkdocs gives the section's first heading (its slug)."""
    heading = result.topic
    if result.ok:
        for line in _shift_headings(result.markdown, result.topic).splitlines():
            if line.startswith("## "):
                heading = line[3:]
                break
    slug = re.sub(r"[^\w\s-]", "", heading.lower()).strip()
    return re.sub(r"[\s]+", "-", slug)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _relative(path: Path, start: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def run_benchmarks(
    quick: bool = False,
    only: Sequence[str] | None = None,
    out_dir: str | os.PathLike[str] = DEFAULT_OUT,
    *,
    package: str = PACKAGE,
    plots: bool = True,
    echo: Callable[[str], None] | None = None,
    replot: bool = False,
) -> BenchReport:
    """Runs the topics and writes ``<out_dir>/benchmarks.md`` and ``<out_dir>/img/*.png``.

    ``only`` picks topics by name (all discovered ones by default); every name is checked
    before anything runs. ``echo`` receives one progress line per topic. Every topic that
    ran also gets its own page, ``<out_dir>/bench/<topic>.md``, and its rows,
    ``<out_dir>/bench/<topic>.json``. A full (not quick) run keeps the sections of topics not
    run now from their rows (or their pages) there; a quick run shows only what it ran.
    ``replot`` measures nothing: the pages, headlines and figures of the topics are remade
    from their rows in ``out_dir`` (a topic without rows keeps its page; a topic named in
    ``only`` that has neither fails, one not named is left out).

    Raises:
        UnknownTopicError: a name in ``only`` is not a topic module.

    Example:
        >>> import sys, tempfile, types
        >>> from pathlib import Path
        >>> from wrapped_optim._bench.report import run_benchmarks
        >>> toy = types.ModuleType("wrapped_optim._bench.toy_example")
        >>> toy.run = lambda quick: "## Toy\\n\\nmeasured: 42 ms"
        >>> sys.modules[toy.__name__] = toy
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     report = run_benchmarks(quick=True, only=["toy_example"], out_dir=tmp, plots=False)
        ...     text = Path(tmp, "benchmarks.md").read_text()
        >>> report.ok, "measured: 42 ms" in text
        (True, True)
        >>> del sys.modules[toy.__name__]
    """
    known = discover_topics(package)
    topics = list(dict.fromkeys(only)) if only else known
    modules = [(topic, _load_topic(package, topic, known)) for topic in topics]

    out = Path(out_dir)
    draw = plots and matplotlib_available()
    image_dir = out / IMAGE_DIR if draw else None
    results = []
    for topic, module in modules:
        if replot:
            result = _replayed(topic, module, out, image_dir, kept=False)
            if result is None and not only:
                continue  # every topic with rows or a page: this one has neither
            if result is None:
                result = _failed(
                    topic,
                    FileNotFoundError(
                        f"no rows in {rows_path(out, topic)}: measure it first "
                        f"(wrapped-optim bench {topic} --out {out})"
                    ),
                    0.0,
                )
        else:
            if echo is not None:
                echo(f"running {topic} ...")
            with _heartbeat(topic, echo):
                result = _run_topic(topic, module, quick, image_dir)
        if echo is not None:
            status = "ok" if result.ok else f"FAILED ({result.error})"
            verb = "replotted" if replot else f"in {result.seconds:.1f} s"
            echo(f"  {topic}: {status} {verb}")
        if result.ok and not (replot and result.data is None):
            _write_topic(out, result)
        if result.data is not None and not replot:  # even when only its page failed
            _write_rows(out, result)
        results.append(result)
    if not quick:
        for topic in known:
            if topic not in topics:
                module = _load_topic(package, topic, known)
                if (kept := _replayed(topic, module, out, image_dir, kept=True)) is not None:
                    results.append(kept)
        order = {topic: i for i, topic in enumerate(known)}  # the page's usual order
        results.sort(key=lambda r: order.get(r.topic, len(order)))

    _write_targets(out, results, package, known)
    if draw:
        note = None
    elif plots:
        note = (
            "Figures were not drawn: matplotlib is not installed "
            "(`pip install 'wrapped-optim[plots]'`)."
        )
    else:
        note = "Figures were not drawn (plots turned off)."
    page = out / PAGE
    out.mkdir(parents=True, exist_ok=True)
    page.write_text(
        render_report(
            results,
            page_dir=out,
            quick=quick or (replot and any(r.quick for r in results)),
            machine=machine_summary(),
            date=datetime.datetime.now(datetime.UTC),
            plots_note=note,
        )
    )
    return BenchReport(page, tuple(results))


def run_from_args(args: argparse.Namespace) -> int:
    """Runs :func:`run_benchmarks` for parsed :func:`add_arguments` options; the exit code.

    0 when every topic ran, 1 when one failed (the page says which), 2 for an unknown topic.

    Example:
        >>> import argparse
        >>> from wrapped_optim._bench.report import run_from_args
        >>> run_from_args(argparse.Namespace(quick=True, only=["nope"], out="/tmp/unused",
        ...                                  no_plots=True))
        2
    """
    only = [*getattr(args, "topics", []), *(args.only or [])] or None
    try:
        report = run_benchmarks(
            quick=args.quick,
            only=only,
            out_dir=args.out,
            plots=not args.no_plots,
            echo=lambda line: print(line, flush=True),
            replot=getattr(args, "replot", False),
        )
    except UnknownTopicError as error:
        print(f"wrapped-optim bench: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {report.page.resolve()}")
    failed = [r.topic for r in report.results if not r.ok]
    if failed:
        print(f"failed topics: {', '.join(failed)}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m wrapped_optim._bench.report``: the same as ``wrapped-optim bench``.

    Example:
        >>> from wrapped_optim._bench.report import main
        >>> main(["--only", "no_such_topic", "--out", "/tmp/unused"])
        2
    """
    parser = argparse.ArgumentParser(
        prog="python -m wrapped_optim._bench.report", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
