"""The precision_adam benchmark's pieces that decide what its page says: the quality figure
(a wrong optimizer must show), the optional peers (each a row or a stated skip reason, never
needed by the suite), the rows of loop families this CPU lacks, and the by-class table."""

from __future__ import annotations

import sys
import types
from typing import Any

import attrs
import pytest
import torch

from wrapped_optim._bench import _adam_peers, precision_adam
from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.kernels import cpu_kernel


def test_quality_shows_a_wrong_or_imprecise_optimizer() -> None:
    """FP32 AdamW against itself is 1 (deterministic); our bf16 moments stay close; an AdamW
    that climbs the loss (maximize=True) or never moves (lr 0 in disguise) shows at once."""
    steps = 60
    fp32 = _adam_peers.quality_loss(lambda ps: torch.optim.AdamW(ps), torch.float32, steps)
    again = _adam_peers.quality_loss(lambda ps: torch.optim.AdamW(ps), torch.float32, steps)
    assert fp32 == again
    start = _adam_peers.quality_loss(lambda ps: torch.optim.AdamW(ps), torch.float32, 0)
    assert fp32 < 0.9 * start  # the problem is learned at all in these steps
    ours = _adam_peers.quality_loss(
        lambda ps: PrecisionAwareAdamW(ps, exp_avg_dtype=torch.bfloat16), torch.float32, steps
    )
    assert abs(ours / fp32 - 1) < 0.05
    wrong = _adam_peers.quality_loss(
        lambda ps: torch.optim.AdamW(ps, maximize=True), torch.float32, steps
    )
    assert wrong > 1.1 * start
    frozen = _adam_peers.quality_loss(
        lambda ps: torch.optim.AdamW(ps, betas=(0.9, 0.999), weight_decay=0.0, eps=1e30),
        torch.float32, steps,
    )  # fmt: skip
    assert frozen / fp32 > 1.1


def test_quality_refuses_another_learning_rate() -> None:
    with pytest.raises(ValueError, match=r"runs at lr 0.001; the factory set \[0.5\]"):
        _adam_peers.quality_loss(lambda ps: torch.optim.AdamW(ps, lr=0.5), torch.float32, 1)


_PEER_MODULES = ("torchao.optim", "bitsandbytes.optim", "optimi", "deepspeed.ops.adam")


def test_a_peer_that_cannot_be_imported_is_a_skip_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every peer is a row or a skip naming its package and the error; with none importable
    (as in CI) all ten are skipped and nothing fails."""
    for name in _PEER_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    found, skipped = _adam_peers.peers()
    assert found == []
    assert len(skipped) == 10
    assert skipped[0].startswith(
        "torchao AdamWFp8 (FP8 moments) skipped (torchao): ModuleNotFoundError: import of "
        "torchao.optim halted"
    )
    assert {s.split(" skipped (")[1].split(")")[0] for s in skipped} == {
        "torchao", "bitsandbytes", "torch-optimi", "deepspeed",
    }  # fmt: skip


def test_a_peer_that_fails_to_step_is_a_skip_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def __init__(self, params: Any, **kwargs: Any) -> None:
            pass

        def step(self) -> None:
            raise RuntimeError("no CPU backend")

    for name in _PEER_MODULES:
        module = types.ModuleType(name)
        for cls in ("AdamWFp8", "AdamW8bit", "AdamW4bit", "_AdamW", "AdamW", "DeepSpeedCPUAdam"):
            setattr(module, cls, Broken)
        monkeypatch.setitem(sys.modules, name, module)
    found, skipped = _adam_peers.peers()
    assert found == [] and len(skipped) == 10
    assert all(s.endswith("RuntimeError: no CPU backend") for s in skipped)


def test_rows_of_a_loop_family_this_cpu_lacks_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        cpu_kernel, "status",
        lambda: cpu_kernel.KernelStatus(True, loops="portable", loop_families=("portable",)),
    )  # fmt: skip
    monkeypatch.setattr(precision_adam, "peers", lambda: ([], ["a peer skipped: reason"]))
    rows, skipped = precision_adam._rows()
    assert all(c.loops in (None, "portable") for c in rows)
    avx2 = [c.label for c in precision_adam.CONFIGS if c.loops == "avx2"]
    assert len(avx2) == 6  # per-tensor FP8 (FP32 and bf16 params), fp16 m + FP8 v, 3 blocks
    assert skipped == [f"{label} skipped: this CPU runs portable" for label in avx2] + [
        "a peer skipped: reason"
    ]


def test_class_table_takes_the_best_of_each_side_per_cell() -> None:
    """Per cell the best of our rows in the class (the AVX2 column: the AVX2 rows where the
    class has them) and the best peer, then the range over the cells."""
    dummy = precision_adam.CONFIGS[0]
    rows = [
        attrs.evolve(dummy, label="ours a", group="G"),
        attrs.evolve(dummy, label="ours b", group="G"),
        attrs.evolve(dummy, label="ours a2", group="G", loops="avx2"),
        attrs.evolve(dummy, label="peer x", group="G"),
        attrs.evolve(dummy, label="peer y", group="G"),
        attrs.evolve(dummy, label="ours c", group="H"),
    ]
    cells = {
        (1, 1): {"ours a": 1.0, "ours b": 0.9, "ours a2": 1.4, "peer x": 3.0, "peer y": 5.0,
                 "ours c": 2.0},
        (1, 2): {"ours a": 1.2, "ours b": 1.5, "ours a2": 1.6, "peer x": 6.0, "peer y": 4.0,
                 "ours c": 2.0},
    }  # fmt: skip
    table = precision_adam._class_table(rows, cells)
    assert "| G | 0.90-1.20 | 1.40-1.60 | 3.00-4.00 (peer x, peer y) |" in table
    assert "| H | 2.00 | 2.00 | - |" in table


def test_block_classes_race_the_8bit_peers_with_their_losses() -> None:
    """The block-scaled 8-bit class has no peers of its own: it races the 8-bit class's
    (torchao's and bitsandbytes' moments are block-scaled too), and the loss column names
    ours and the peers that were fastest."""
    dummy = precision_adam.CONFIGS[0]
    rows = [
        attrs.evolve(dummy, label="ours fp8", group="8-bit moments"),
        attrs.evolve(dummy, label="ours int8 blocks", group="block-scaled 8-bit moments"),
        attrs.evolve(dummy, label="torchao AdamW8bit", group="8-bit moments"),
        attrs.evolve(dummy, label="bnb", group="8-bit moments"),
        attrs.evolve(dummy, label="torch AdamW foreach", group=None),  # of no class
    ]
    cells = {(1, 1): {"ours fp8": 1.4, "ours int8 blocks": 0.7, "torchao AdamW8bit": 1.8,
                      "bnb": 30.0, "torch AdamW foreach": 0.1}}  # fmt: skip
    quality = {"ours fp8": 0.93, "ours int8 blocks": 0.8, "torchao AdamW8bit": 0.97, "bnb": 0.9}
    table = precision_adam._class_table(rows, cells, quality)
    block = "| block-scaled 8-bit moments | 0.70 | 0.70 | 1.80 (torchao AdamW8bit) | 0.80; 0.97 |"
    assert block in table
    assert "| 8-bit moments | 1.40 | 1.40 | 1.80 (torchao AdamW8bit) | 0.93; 0.97 |" in table


def _timed(best: float, fused: float, ds: float | None, ao: float | None, cpu: Any = None) -> Any:
    return precision_adam._Timed(best, best, fused, ds, 1e10, 2.0, ao, cpu)


def test_ratios_come_from_the_rows_own_rounds_and_fp32_state_races_deepspeed() -> None:
    """x DeepSpeed and x torchao divide by the peer's time in the row's own rounds (not the
    best over the table), and ours with FP32 state misses its target when slower than
    DeepSpeed, with bytes and cycles in the reason."""
    spec = precision_adam._Spec
    results = [
        (spec(precision_adam.FP32_STATE, "float32", 28, ""), _timed(12.0, 11.0, 10.0, None)),
        (spec("ours int8 block moments", "float32", 16.03, "", 0.8, torchao="torchao AdamW8bit"),
         _timed(6.0, 10.0, 20.0, 15.0, {"row": 3.0, "fused": 6.0, "deepspeed": 12.0})),
    ]  # fmt: skip
    quality = {precision_adam.FP32_STATE: 1.0, "ours int8 block moments": 0.8}
    verdicts: list[Any] = []
    lines = precision_adam._size_table(10**7, 1, results, 1e9, quality, verdicts)
    table = "\n".join(lines)
    assert "| ours fp32 state | float32 | 28 | 12.0 / 12.0 | 1.09 | 0.43 | 1.20 |  | 1.2 |" in table
    block = "| ours int8 block moments | float32 | 16.03 | 6.0 / 6.0 | 0.60 | 0.37 | 0.30 | 0.40 |"
    assert block in table
    # CPU-time ratios: fused, DeepSpeed, torchao (not stepped here); none for rows without
    assert "| 0.80 | 0.50 / 0.25 / - |" in table
    assert "| 1.00 |  |" in table
    (fp32_row, (_, _, fp32_reason)), (block_row, (_, _, block_reason)) = verdicts
    assert fp32_row.endswith("| missed |") and block_row.endswith("| met |")
    assert fp32_reason == (
        "1.20x DeepSpeed's time in the same rounds, moving 28 bytes/param against its 28, at "
        "1.2 cycles/param (0.43x its floor)"
    )
    assert block_reason == ""


def test_the_tensors_split_into_whole_blocks_of_every_peer() -> None:
    """torchao keeps FP32 moments for a tensor that does not split into its whole blocks
    (256 values, 128 for 4 bits): the bench's tensors are sized so its 8- and 4-bit states
    are what is timed, within 0.2% of the parameter count asked for."""
    for numel in (1_000_000, 10_000_000, 50_000_000):
        part = precision_adam._part(numel)
        assert part % 256 == 0 and part % 128 == 0 and part % 2048 == 0
        assert 0.998 * numel <= 4 * part <= numel
    assert [p.numel() for p in precision_adam._model(torch.float32, 10_000_000)] == [2_498_560] * 4
