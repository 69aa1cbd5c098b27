"""The ``bench`` and ``inspect`` subcommands of ``wrapped-optim``."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from wrapped_optim._bench import report
from wrapped_optim._cli import main

# --------------------------------------------------------------------------- bench

TOY_SECTION = """# {title} topic

How to reproduce: `python -m wrapped_optim._bench.{name}`

```bash
# a shell comment, not a heading
python -m wrapped_optim._bench.{name}
```

## Results

| size | time (ms) |
|---|---:|
| 1M | 4.2 |
"""


def _topic(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    run: types.FunctionType | None = None,
    plots: types.FunctionType | None = None,
) -> list[bool]:
    """Registers a fake ``wrapped_optim._bench.<name>`` module; returns the quick flags seen."""
    seen: list[bool] = []

    def default_run(quick: bool) -> str:
        seen.append(quick)
        return TOY_SECTION.format(title=name.capitalize(), name=name)

    module = types.ModuleType(f"wrapped_optim._bench.{name}")
    module.run = run or default_run  # type: ignore[attr-defined]
    if plots is not None:
        module.plots = plots  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return seen


def test_bench_only_runs_the_topic_and_writes_the_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _topic(monkeypatch, "toy")

    code = main(["bench", "--quick", "--only", "toy", "--out", str(tmp_path), "--no-plots"])

    assert code == 0
    assert seen == [True]
    page = (tmp_path / "benchmarks.md").read_text()
    assert page.startswith("# Benchmarks\n")
    assert "wrapped-optim bench --quick" in page
    assert "## Machine" in page and torch.__version__ in page
    assert "## How to reproduce" in page
    assert "| [toy](#toy-topic) | see its section |" in page
    # The section's headings move one level down; the fenced comment stays as it was.
    assert "\n## Toy topic\n" in page and "\n### Results\n" in page
    assert "\n# a shell comment, not a heading\n" in page
    assert "| 1M | 4.2 |" in page
    assert "plots turned off" in page
    assert "running toy" in capsys.readouterr().out
    # Quick runs write the topic's page too (into a folder of their own unless told);
    # a topic without rows has no JSON.
    assert (tmp_path / "bench" / "toy.md").read_text().startswith("# Toy topic\n")
    assert not (tmp_path / "bench" / "toy.json").exists()


def test_bench_runs_every_discovered_topic_and_survives_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(quick: bool) -> str:
        raise RuntimeError("out of bananas")

    _topic(monkeypatch, "alpha", run=broken)
    seen = _topic(monkeypatch, "beta")
    monkeypatch.setattr(report, "discover_topics", lambda package=report.PACKAGE: ["alpha", "beta"])

    code = main(["bench", "--out", str(tmp_path), "--no-plots"])

    assert code == 1
    assert seen == [False]
    page = (tmp_path / "benchmarks.md").read_text()
    assert "| [alpha](#alpha) | **failed**: RuntimeError: out of bananas |" in page
    assert "This topic failed: `RuntimeError: out of bananas`" in page
    assert "## Toy topic" not in page and "## Beta topic" in page
    assert page.index("## alpha") < page.index("## Beta topic")
    # A full run refreshes the pages of the topics that ran, verbatim.
    assert (tmp_path / "bench" / "beta.md").read_text().startswith("# Beta topic\n")
    assert not (tmp_path / "bench" / "alpha.md").exists()


def test_bench_rejects_unknown_topics_before_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _topic(monkeypatch, "toy")

    code = main(["bench", "--only", "toy", "--only", "nonexistent", "--out", str(tmp_path)])

    assert code == 2
    assert seen == []
    assert not (tmp_path / "benchmarks.md").exists()
    assert "unknown benchmark topic 'nonexistent'" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["report", "gpu_memory"])
def test_report_and_gpu_scripts_are_not_topics(name: str, tmp_path: Path) -> None:
    assert name not in report.discover_topics()
    assert main(["bench", "--only", name, "--out", str(tmp_path)]) == 2


def test_discovery_finds_topic_modules_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("report", "gpu_memory", "_private", "staged", "codecs"):
        (package / f"{name}.py").write_text("def run(quick=False):\n    return '## x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert report.discover_topics("fakebench") == ["codecs", "staged"]


def test_plots_are_embedded_when_matplotlib_is_available(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def plots(out_dir: Path) -> list[Path]:
        path = out_dir / "toy_memory.png"
        path.write_bytes(b"\x89PNG fake")
        return [path]

    _topic(monkeypatch, "toy", plots=plots)
    monkeypatch.setattr(report, "matplotlib_available", lambda: True)

    assert main(["bench", "--only", "toy", "--out", str(tmp_path)]) == 0

    page = (tmp_path / "benchmarks.md").read_text()
    assert "![toy: toy_memory](img/toy_memory.png)" in page
    assert (tmp_path / "img" / "toy_memory.png").is_file()
    # The topic's own page links the figure from its folder.
    assert (
        "![toy: toy_memory](../img/toy_memory.png)" in (tmp_path / "bench" / "toy.md").read_text()
    )
    assert "Run time per topic" not in page  # the old one-bar summary chart is gone


def test_without_matplotlib_the_page_says_how_to_get_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    _topic(monkeypatch, "toy", plots=lambda out_dir: calls.append(out_dir) or [])
    monkeypatch.setattr(report, "matplotlib_available", lambda: False)

    assert main(["bench", "--only", "toy", "--out", str(tmp_path)]) == 0

    assert calls == []
    assert "pip install 'wrapped-optim[plots]'" in (tmp_path / "benchmarks.md").read_text()


def test_no_summary_chart_is_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib", reason="figures need the optional 'plots' extra")
    _topic(monkeypatch, "toy")

    assert main(["bench", "--only", "toy", "--out", str(tmp_path)]) == 0

    assert not (tmp_path / "img").exists()  # the topic draws nothing, the report neither
    assert "![" not in (tmp_path / "benchmarks.md").read_text()


# --------------------------------------------------------------------------- inspect


def _trained_adamw() -> torch.optim.AdamW:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return opt


def test_inspect_torch_save_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.save({"optim": _trained_adamw().state_dict()}, tmp_path / "c.pt")

    assert main(["inspect", str(tmp_path / "c.pt")]) == 0

    out = capsys.readouterr().out
    assert "torch.save file" in out
    assert "format: torch optimizer state; floating state FP32" in out
    assert "0      exp_avg     float32  (2, 3)  24" in out
    assert "steps: 1 (per-parameter)" in out


def test_inspect_precision_aware_dict_with_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    portable = {
        "state": {
            0: {
                "exp_avg": torch.zeros(5, 2),
                "exp_avg_sq": torch.zeros(5, 2),
                "master_param": torch.zeros(5, 2, dtype=torch.int16),
            }
        },
        "param_groups": [{"lr": 1e-4, "step": 250, "params": [0]}],
    }
    torch.save(portable, tmp_path / "te.pt")

    assert main(["inspect", "--summary", str(tmp_path / "te.pt")]) == 0

    out = capsys.readouterr().out
    assert "format: precision-aware state with remainder masters (int16 master_param)" in out
    assert "steps: 250 (param_groups)" in out
    assert "master_param  1      int16    20 B" in out
    assert "per parameter:" not in out


def test_inspect_dcp_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_trained_adamw().state_dict(), checkpoint_id=tmp_path / "dcp", no_dist=True)

    assert main(["inspect", str(tmp_path / "dcp")]) == 0

    out = capsys.readouterr().out
    assert "DCP checkpoint directory" in out
    assert "[0] 2 params; lr=0.001" in out


class RunArguments:
    """Stands for what Megatron pickles beside its state (its args namespace, RNG states).

    (argparse.Namespace itself would not do: importing megatron-core allowlists it.)
    """

    def __init__(self) -> None:
        self.lr = 0.1


def test_inspect_trust_flag_reads_pickled_objects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = {"args": RunArguments(), "optimizer": _trained_adamw().state_dict()}
    torch.save(checkpoint, tmp_path / "megatron.pt")

    assert main(["inspect", str(tmp_path / "megatron.pt")]) == 2
    assert "RunArguments object" in capsys.readouterr().err
    assert main(["inspect", "--trust", str(tmp_path / "megatron.pt")]) == 0
    assert "optimizer state at optimizer" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("absent.pt", "no such file or directory"),
        ("notes.txt", "not a torch.save file"),
        ("folder", "no .metadata file"),
        ("model.pt", "no optimizer state dict found"),
    ],
)
def test_inspect_bad_paths_exit_2_with_a_clear_message(
    name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "folder").mkdir()
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "model.pt")

    assert main(["inspect", str(tmp_path / name)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("wrapped-optim inspect: error: ")
    assert message in captured.err and name in captured.err


def test_fsdp_topic_leaves_the_thread_count_as_it_found_it() -> None:
    """The fsdp topic measures with one thread; topics after it in the same report (the
    precision_adam one measures at torch's default) must not inherit that."""
    from wrapped_optim._bench import fsdp

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fsdp.run(quick=True).startswith("## FSDPAwareOptimizer")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_bench_writes_where_asked_and_keeps_other_topics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --out nothing lands in ./docs but in the folder the command names; a full run
    of one topic into a folder that holds another topic's page keeps that topic's section."""
    toys = {}
    for name, text in (("toy_a", "## Toy A\n\nmeasured: 1 ms"), ("toy_b", "## Toy B\n\n2 ms")):
        module = types.ModuleType(f"wrapped_optim._bench.{name}")
        module.run = lambda quick, text=text: text  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, module.__name__, module)
        toys[name] = module
    monkeypatch.setattr(report, "discover_topics", lambda package=report.PACKAGE: sorted(toys))
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "toy_a", "--no-plots"]) == 0
    assert not (tmp_path / "docs").exists()
    default = tmp_path / report.DEFAULT_OUT
    assert (default / "benchmarks.md").is_file()
    assert f"wrote {default.resolve() / 'benchmarks.md'}" in capsys.readouterr().out
    out = tmp_path / "site"
    assert main(["bench", "--out", str(out), "--no-plots"]) == 0
    toys["toy_a"].run = lambda quick: "## Toy A\n\nmeasured: 3 ms"  # type: ignore[attr-defined]
    toys["toy_b"].run = lambda quick: "## Toy B\n\nnot run"  # type: ignore[attr-defined]
    assert main(["bench", "toy_a", "--out", str(out), "--no-plots"]) == 0
    page = (out / "benchmarks.md").read_text()
    assert "measured: 3 ms" in page and "2 ms" in page and "not run" not in page
    kept = "see its section (kept from an earlier run that kept no rows)"
    assert f"| [toy_b](#toy-b) | {kept} | - |" in page
    assert (out / "bench" / "toy_a.md").read_text() == "## Toy A\n\nmeasured: 3 ms\n"
