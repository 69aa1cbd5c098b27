"""The benchmark pages: figures drawn from measured rows, one headline per topic, the rows
kept as JSON beside each page and ``wrapped-optim bench --replot`` remaking pages from them."""

from __future__ import annotations

import functools
import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from wrapped_optim._bench import fsdp, hybrid, precision_adam, report, scaling, staged, streaming
from wrapped_optim._bench._figures import Panel, bar_panels
from wrapped_optim._cli import main

MiB = 1 << 20


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk."""
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# --------------------------------------------------------------------------- figures


def test_bar_panels_draws_stacked_and_grouped_panels(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="figures need the optional 'plots' extra")
    phases = Panel(
        "one step by phase",
        ["offload 1.0", "offload 0.5", "bare"],
        {"copy-in": [0.1, 1.8, None], "host": [8.2, 4.4, None], "whole": [None, None, 7.9]},
        "ms",
        stacked=True,
        anchor=("bare fused AdamW", 7.9),
    )
    grouped = Panel(
        "memory", ["10M", "200M"], {"unstaged": [76.0, 1526.0], "chunked": [0.0, 4.0]}, "MiB",
        anchor=("chunk", 4.0), log=False,
    )  # fmt: skip
    one = bar_panels(tmp_path / "one.png", [phases])
    two = bar_panels(tmp_path / "two.png", [phases, grouped], title="t")

    assert one.parent == tmp_path and two.is_file()
    (w1, h1), (w2, h2) = _png_size(one), _png_size(two)
    assert w1 == w2 and h2 > h1  # panels go one under the other


def test_bar_panels_refuses_series_that_do_not_match_the_labels(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="series 'b' has 1 values for 2 labels"):
        Panel("t", ["x", "y"], {"a": [1.0, 2.0], "b": [1.0]}, "s")
    with pytest.raises(ValueError, match="no panels"):
        bar_panels(tmp_path / "x.png", [])


def _staged_row(params: float, unstaged_s: float, chunked_s: float) -> dict[str, Any]:
    rounds = {"unstaged": [[unstaged_s, 1.0]], "whole": [[1.5, 1.0]], "chunked": [[chunked_s, 1.0]]}
    return {
        "params": params,
        "largest": params * 0.4,
        "save_peak": {"unstaged": 8 * params, "whole": 1.6 * params, "chunked": 3 * MiB},
        "load_peak": {"unstaged": 1.6 * params, "chunked": 4 * MiB},
        "save_time": {m: r[0][0] for m, r in rounds.items()},
        "load_time": {"unstaged": 1.0, "chunked": 1.0},
        "save_rounds": rounds,
        "load_rounds": {"unstaged": [[1.0, 1.0]], "chunked": [[0.9, 1.0]]},
    }


def _streaming_data() -> dict[str, Any]:
    def call(seconds: float, growth_mib: int) -> dict[str, Any]:
        return {"seconds": seconds, "cpu": seconds * 0.9, "peak_growth": growth_mib * MiB,
                "digest": 7}  # fmt: skip

    return {
        "n_tensors": 8, "numel": 32 << 20, "rounds": 3, "chunk_bytes": 64 * MiB,
        "checkpoint_bytes": 2048 * MiB,
        "results": {
            "plain_save": call(10.0, 2048), "stream_save": call(12.0, 64),
            "plain_load": call(5.0, 2304), "stream_load_plain_ckpt": call(3.5, 392),
            "stream_load_stream_ckpt": call(4.0, 200), "stream_load_not_atomic": call(3.0, 192),
        },
    }  # fmt: skip


def _hybrid_data() -> dict[str, Any]:
    def variant(host: float, step: float, fused: float) -> dict[str, float]:
        return {"copy_in": 0.001, "host": host, "copy_out": 0.001, "device": 0.0,
                "step": step, "fused": fused}  # fmt: skip

    def case(params: int, dtype: str, bare: float) -> dict[str, Any]:
        return {"params": params, "dtype": dtype, "result": {
            "1.0": variant(bare, bare * 1.1, 10.0), "1.0 unfused": variant(bare, bare * 2, 0.0),
            "0.5": variant(bare / 2, bare * 4, 5.0), "bare": {"step": bare}}}  # fmt: skip

    sync = {"bare": 0.025, "wrapped": 0.024, "atomic": 0.035, "guard": 0.014,
            "guard_refresh": 0.018, "reload": 0.004, "full_sync": 0.005}  # fmt: skip
    return {
        "rounds": 5, "tensors": 10, "wrapper_overhead_us": 1.0, "machine": "x86_64",
        "breakdown": [case(10**7, "bf16", 0.008), case(10**8, "bf16", 0.060),
                      case(10**7, "fp32", 0.009)],
        "sync": [{"params": 10**7, **sync}],
    }  # fmt: skip


def test_plots_of_the_topics_from_given_rows(tmp_path: Path) -> None:
    """Each topic draws its figure from rows alone (no measurement, no module state)."""
    pytest.importorskip("matplotlib", reason="figures need the optional 'plots' extra")
    rows = [_staged_row(1e7, 0.03, 0.031), _staged_row(2e8, 0.5, 0.48)]
    drawn = [
        *staged.plots({"chunk_bytes": 4 * MiB, "rows": rows}, tmp_path),
        *streaming.plots(_streaming_data(), tmp_path),
        *hybrid.plots(_hybrid_data(), tmp_path),
    ]
    assert [p.name for p in drawn] == ["staged_cost.png", "streaming_cost.png", "hybrid_phases.png"]
    for path in drawn:
        assert path.parent == tmp_path and _png_size(path)[1] > 100
    # One panel per breakdown case: three cases are taller than one.
    one = _hybrid_data()
    one["breakdown"] = one["breakdown"][:1]
    (single,) = hybrid.plots(one, tmp_path / "one")
    assert _png_size(single)[1] < _png_size(drawn[2])[1]


# --------------------------------------------------------------------------- headlines


def test_headlines_are_computed_from_the_rows() -> None:
    rows = [_staged_row(1e7, 0.03, 0.03), _staged_row(2e8, 0.50, 0.48)]
    assert staged.headline({"chunk_bytes": 4 * MiB, "rows": rows}) == (
        "Chunked staging at 200M parameters: at most 4.0 MiB of extra device memory (the 4 MiB "
        "chunk) instead of 1,525.9 MiB for an unstaged save, at 0.96x its save time."
    )
    assert streaming.headline(_streaming_data()) == (
        "Streaming checkpoints: save and load grow the memory by 64 and 200 MiB instead of "
        "2,048 and 2,304 MiB for plain DCP, at 1.20x and 0.80x its time."
    )
    # The largest bf16 case speaks, not the FP32 one measured last.
    assert hybrid.headline(_hybrid_data()) == (
        "Hybrid offload at 100M bf16 parameters: a fully offloaded step takes 1.10x a bare "
        "fused AdamW step (2.00x without the fused host step)."
    )
    fsdp_rows = [
        {"inner": inner, "alloc_per_step": mib * MiB}
        for inner, allocs in (("SGD", (0, 64, 0)), ("AdamW", (128, 192, 128)))
        for mib in allocs
    ]
    assert fsdp.headline({"count": 8, "numel": 1 << 21, "rows": fsdp_rows}) == (
        "FSDPAwareOptimizer around AdamW: 0.00 MiB allocated per step beyond the optimizer's "
        "own, where casting the bf16 grads afresh allocates 64.00 MiB (1.00x the FP32 grads)."
    )


def test_scaling_headline_says_superlinear_when_a_call_grows_faster() -> None:
    def row(n: int, save_exponent: float) -> dict[str, Any]:
        return {"params": n, "step": n * 2e-9, "save": 1e-9 * n**save_exponent,
                "load": n * 5e-8, "steady_rss": 300 * MiB + 12 * n,
                "save_growth": 64 * MiB, "load_growth": 193 * MiB}  # fmt: skip

    sizes = (10**7, 10**8, 2 * 10**8, 4 * 10**8)
    linear = scaling.headline({"rows": [row(n, 1.0) for n in sizes]})
    steep = scaling.headline({"rows": [row(n, 1.5) for n in sizes]})
    assert linear.startswith("From 10M to 400M parameters step, save and load grow linearly")
    assert "exponents 1.00, 1.00, 1.00" in linear and "12.00 bytes per parameter" in linear
    assert "grow superlinearly (exponents 1.00, 1.50, 1.00)" in steep
    assert linear.endswith("adds at most 193 MiB at any size.")


# --------------------------------------------------------------------------- runs and replots


def _cheap_topics(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hybrid topic at 0.1M parameters (its --quick is 10M: minutes on a loaded machine)."""
    monkeypatch.setattr(hybrid, "collect", functools.partial(hybrid.collect, sizes=[100_000]))


def test_quick_runs_write_page_figure_and_rows_and_replot_remakes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib", reason="figures need the optional 'plots' extra")
    _cheap_topics(monkeypatch)
    assert main(["bench", "fsdp", "hybrid", "--quick", "--out", str(tmp_path)]) == 0

    page = (tmp_path / "benchmarks.md").read_text()
    for topic, figure in (("fsdp", "fsdp_allocations.png"), ("hybrid", "hybrid_phases.png")):
        record = report.read_rows(tmp_path, topic)
        assert record is not None and record["quick"] is True and record["topic"] == topic
        module = {"fsdp": fsdp, "hybrid": hybrid}[topic]
        headline = module.headline(record["data"])
        topic_page = (tmp_path / "bench" / f"{topic}.md").read_text()
        # The headline opens the section (right under its heading), then the figure.
        assert topic_page.split("\n")[2] == f"**{headline}**"
        assert f"![{topic}: {figure[:-4]}](../img/{figure})" in topic_page
        assert headline in page.split("## Summary")[1].split("\n## ")[0]  # in the summary
        assert f"](img/{figure})" in page
        assert _png_size(tmp_path / "img" / figure)[0] > 100

    # Targets, met or missed, are the contributors' business: their page, not the users'.
    targets = (tmp_path / report.TARGETS_PAGE).read_text()
    assert "## Hybrid offload" in targets and "| verdict |" in targets
    for topic in ("fsdp", "hybrid"):
        user_page = (tmp_path / "bench" / f"{topic}.md").read_text()
        assert not re.search(r"\b(target|missed|NOT met)\b", user_page, re.IGNORECASE)

    # --replot measures nothing: it remakes pages, headlines and figures from the JSON.
    rows_before = {t: report.rows_path(tmp_path, t).read_text() for t in ("fsdp", "hybrid")}
    for topic in ("fsdp", "hybrid"):
        (tmp_path / "bench" / f"{topic}.md").unlink()
    for figure in (tmp_path / "img").iterdir():
        figure.unlink()

    def no_measuring(quick: bool = False) -> dict[str, Any]:
        raise AssertionError("--replot measured")

    monkeypatch.setattr(fsdp, "collect", no_measuring)
    monkeypatch.setattr(hybrid, "collect", no_measuring)
    assert main(["bench", "--replot", "--out", str(tmp_path)]) == 0

    for topic in ("fsdp", "hybrid"):
        assert report.rows_path(tmp_path, topic).read_text() == rows_before[topic]
        assert (tmp_path / "bench" / f"{topic}.md").is_file()
    assert sorted(p.name for p in (tmp_path / "img").iterdir()) == [
        "fsdp_allocations.png", "hybrid_phases.png"
    ]  # fmt: skip
    replotted = (tmp_path / "benchmarks.md").read_text()
    assert "quick mode" in replotted  # the rows were measured in quick mode
    # Topics without rows are not on the page of a replot (here: none measured yet).
    assert "## Staged" not in replotted


def test_replot_of_a_topic_without_rows_fails_it_with_what_to_do(tmp_path: Path) -> None:
    assert main(["bench", "staged", "--replot", "--out", str(tmp_path), "--no-plots"]) == 1
    page = (tmp_path / "benchmarks.md").read_text()
    assert "no rows in" in page and "wrapped-optim bench staged --out" in page


def test_replot_refuses_a_file_that_is_not_a_rows_record(tmp_path: Path) -> None:
    report.rows_path(tmp_path, "fsdp").parent.mkdir(parents=True)
    report.rows_path(tmp_path, "fsdp").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="is not a format-1 record"):
        report.read_rows(tmp_path, "fsdp")
    assert main(["bench", "fsdp", "--replot", "--out", str(tmp_path), "--no-plots"]) == 1


def test_rows_are_kept_when_only_the_page_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page bug after minutes of measuring costs no measurement: fix it, then --replot."""
    monkeypatch.setattr(fsdp, "render", lambda data: 1 / 0)
    assert main(["bench", "fsdp", "--quick", "--out", str(tmp_path), "--no-plots"]) == 1
    record = report.read_rows(tmp_path, "fsdp")
    assert record is not None and len(record["data"]["rows"]) == 6
    monkeypatch.undo()
    assert main(["bench", "fsdp", "--replot", "--out", str(tmp_path), "--no-plots"]) == 0
    assert (tmp_path / "bench" / "fsdp.md").read_text().startswith("## FSDPAwareOptimizer")


def test_precision_adam_and_scaling_replot_from_their_quick_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two topics measured on a quiet machine: their --quick rows (shrunk further here:
    two configurations, a constant quality, 1M-2M-parameter scaling children) make pages,
    headlines and figures, and --replot remakes them from the JSON."""
    pytest.importorskip("matplotlib", reason="figures need the optional 'plots' extra")
    target = next(c for c in precision_adam.CONFIGS if c.label == precision_adam.TARGET_CONFIG)
    fp8 = next(c for c in precision_adam.CONFIGS if c.label == "ours FP8 moments")
    monkeypatch.setattr(precision_adam, "_rows", lambda: ([target, fp8], ["x skipped: test"]))
    monkeypatch.setattr(precision_adam, "quality_loss", lambda factory, dtype: 1.0)
    monkeypatch.setattr(
        precision_adam, "collect", functools.partial(precision_adam.collect, sizes=[40_000])
    )
    monkeypatch.setattr(scaling, "SIZES", (1, 2))
    out = tmp_path / "site"
    assert main(["bench", "precision_adam", "scaling", "--quick", "--out", str(out)]) == 0

    pages = {t: (out / "bench" / f"{t}.md").read_text() for t in ("precision_adam", "scaling")}
    record = report.read_rows(out, "precision_adam")
    assert record is not None
    headline = precision_adam.headline(record["data"])
    assert headline.startswith("At 0.04M parameters, ")
    assert "bf16 moments step in" in headline and "; FP8 moments " in headline
    assert f"**{headline}**" in pages["precision_adam"]
    assert "- x skipped: test" in pages["precision_adam"]
    assert "From 1M to 2M parameters" in pages["scaling"]
    # The page leads with the comparison against the peers; the verdicts are elsewhere.
    opening = pages["precision_adam"].split("### ")[1]
    assert opening.startswith("Against the peers: step time x torch's fused AdamW")
    assert not re.search(r"\b(targets?|missed|NOT met)\b", pages["precision_adam"])
    assert "## PrecisionAwareAdamW" in (out / report.TARGETS_PAGE).read_text()
    figures = sorted(p.name for p in (out / "img").iterdir())
    assert figures == ["precision_adam_step.png", "scaling_per_param.png"]

    # The same pages again from the JSON alone, into a folder holding only the rows.
    copy = tmp_path / "copy"
    (copy / "bench").mkdir(parents=True)
    for topic in ("precision_adam", "scaling"):
        report.rows_path(copy, topic).write_text(report.rows_path(out, topic).read_text())
    monkeypatch.setattr(precision_adam, "collect", lambda quick=False: 1 / 0)
    monkeypatch.setattr(scaling, "collect", lambda quick=False: 1 / 0)
    assert main(["bench", "precision_adam", "scaling", "--replot", "--out", str(copy)]) == 0
    for topic, page in pages.items():
        assert (copy / "bench" / f"{topic}.md").read_text() == page.replace(str(out), str(copy))
    assert sorted(p.name for p in (copy / "img").iterdir()) == figures


def test_kept_topics_of_a_full_run_come_from_their_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full run of one topic keeps the others' sections, remade from their JSON (with their
    headline in the summary), not frozen Markdown."""
    assert main(["bench", "fsdp", "--quick", "--out", str(tmp_path), "--no-plots"]) == 0
    record = report.read_rows(tmp_path, "fsdp")
    assert record is not None and record["quick"] is True
    (tmp_path / "bench" / "fsdp.md").write_text("## stale page\n")
    monkeypatch.setattr(
        streaming, "collect", lambda quick=False: _streaming_data()
    )  # a stand-in measurement: this test is about the page, not the numbers
    assert main(["bench", "streaming", "--out", str(tmp_path), "--no-plots"]) == 0
    page = (tmp_path / "benchmarks.md").read_text()
    assert "stale page" not in page
    assert f"{fsdp.headline(record['data'])} (quick run)" in page  # kept, and says so
    assert streaming.headline(_streaming_data()) in page


# --------------------------------------------------------------------------- what a user compares


def test_the_precision_adam_figure_shows_what_a_user_compares() -> None:
    """FP32-parameter rows a user picks between, and the peers; not the loop-family or
    no-kernel variants (those stay in the tables)."""
    record = report.read_rows(Path(__file__).resolve().parents[2] / "docs", "precision_adam")
    assert record is not None
    specs = [precision_adam._Spec(**c) for c in record["data"]["configs"]]
    shown = [spec.label for spec in specs if precision_adam._compared(spec)]
    assert 5 <= len(shown) <= 14 < len(specs)  # the block formats and their peers too
    assert "ours bf16 moments" in shown and "DeepSpeedCPUAdam (FP32)" in shown
    assert not [label for label in shown if "AVX2" in label or "bf16 params" in label]


def test_state_bytes_count_a_subclass_state_by_its_inner_tensors() -> None:
    """torchao keeps 8-bit state in wrapper subclasses whose outer dtype is not what they
    store; the measure reads what is inside."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = torch.optim.SGD([param], lr=0.1)
    inner = torch.zeros(8, dtype=torch.uint8)
    optimizer.state[param]["exp_avg"] = two_tensor.TwoTensor(inner, inner.clone())
    optimizer.state[param]["exp_avg_sq"] = torch.zeros(8)
    assert precision_adam.state_bytes_per_param(optimizer) == 2.0 + 4.0


def test_the_report_links_the_hand_measured_page_only_where_it_exists(tmp_path: Path) -> None:
    import datetime

    toy = report.TopicResult("toy", "# Toy\n\nrows", 1.0, None, (), headline="Toy.")

    def page() -> str:
        return report.render_report(
            [toy],
            page_dir=tmp_path,
            quick=True,
            machine=[("CPU", "test")],
            date=datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
        )

    assert "by_hand.md" not in page()  # a user's own --out folder has no such page
    (tmp_path / report.TOPIC_DIR).mkdir()
    (tmp_path / report.TOPIC_DIR / report.BY_HAND_PAGE).write_text("# Measured by hand\n")
    assert f"]({report.TOPIC_DIR}/{report.BY_HAND_PAGE})" in page()
    # The project's own pages carry it, and it is what the report would write there.
    docs = Path(__file__).resolve().parents[2] / "docs"
    assert (docs / report.TOPIC_DIR / report.BY_HAND_PAGE).is_file()
    assert f"]({report.TOPIC_DIR}/{report.BY_HAND_PAGE})" in (docs / report.PAGE).read_text()
