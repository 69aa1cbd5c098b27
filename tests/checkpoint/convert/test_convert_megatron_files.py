"""The Megatron formats' files without Megatron: the fully_reshardable writer and reader round
trip any canonical state bit for bit, the bucket layout keeps each parameter where DDP puts it,
and bad input is refused with the tensor or file named and nothing left behind.

(Real Megatron writing and resuming these files: tests/megatron_real/test_convert_megatron.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wrapped_optim.checkpoint._convert._canonical import (
    MASTER,
    GroupRecord,
    ParamRecord,
    StateIndex,
    TensorSpec,
    iter_tensors,
)
from wrapped_optim.checkpoint._convert._megatron import (
    FULLY_RESHARDABLE,
    detect_megatron,
    megatron_writer,
    standard_group_of,
)
from wrapped_optim.checkpoint._convert._megatron_buckets import Buffer, buffers_of, lay_out
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError
from wrapped_optim.checkpoint._convert._megatron_readers import megatron_reader

KEYS = (MASTER, "exp_avg", "exp_avg_sq")
GROUPS = [
    {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False},
    {"wd_mult": 0.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False},
]


class _Memory:
    def __init__(self, index: StateIndex, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
        self._index, self.tensors = index, tensors

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        return self.tensors[name, key].clone()

    def close(self) -> None:
        pass


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def states(draw: Any) -> _Memory:
    count = draw(st.integers(1, 5))
    step = float(draw(st.integers(1, 1000)))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    params, tensors, members = [], {}, [[], []]
    for number in range(count):
        shape = draw(shapes)
        name = f"layers.{number}.{'bias' if len(shape) == 1 else 'weight'}"
        group = standard_group_of(GROUPS)(name, shape)
        members[group].append(name)
        for key in KEYS:
            bits = torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, generator=generator)
            tensors[name, key] = bits.view(torch.float32)  # any bit pattern, NaNs included
        params.append(
            ParamRecord(
                name, group, shape, {k: TensorSpec(shape, torch.float32) for k in KEYS}, step
            )
        )
    params.sort(key=lambda p: (p.group, members[p.group].index(p.name)))
    groups = [GroupRecord(options=dict(GROUPS[g]), names=members[g]) for g in range(2)]
    return _Memory(StateIndex(params=params, groups=groups, source="memory"), tensors)


@given(states())
def test_fully_reshardable_round_trip_is_bit_identical(state: _Memory) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        path = Path(root, "optim")
        megatron_writer(path).write(state.index(), state)
        assert detect_megatron(path) == FULLY_RESHARDABLE
        reader = megatron_reader(path)
        index = reader.index()
        assert index.params == state.index().params
        assert [g.names for g in index.groups] == [g.names for g in state.index().groups]
        for name, key, tensor in iter_tensors(state.index(), state):
            got = reader.read(name, key)
            assert torch.equal(got.view(torch.int32), tensor.view(torch.int32)), (name, key)
        reader.close()


def test_writer_widens_bf16_exactly_and_refuses_float64(tmp_path: Path) -> None:
    tensor = torch.randn(4).bfloat16()
    spec = {k: TensorSpec((4,), torch.bfloat16) for k in KEYS}
    index = StateIndex(
        params=[ParamRecord("w.bias", 0, (4,), spec, 1.0)],
        groups=[GroupRecord(GROUPS[0], ["w.bias"])],
        source="memory",
    )
    megatron_writer(tmp_path / "ok", param_groups=[GROUPS[1]]).write(
        index, _Memory(index, {("w.bias", k): tensor for k in KEYS})
    )
    assert torch.equal(megatron_reader(tmp_path / "ok").read("w.bias", "exp_avg"), tensor.float())
    wide = _Memory(index, {("w.bias", k): tensor.double() for k in KEYS})
    with pytest.raises(MegatronFormatError, match=r"'w\.bias': state 'master' is torch\.float64"):
        megatron_writer(tmp_path / "bad").write(index, wide)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok"]  # no partial output


def test_writer_refuses_parameters_with_different_steps(tmp_path: Path) -> None:
    spec = {k: TensorSpec((2,), torch.float32) for k in KEYS}
    index = StateIndex(
        params=[ParamRecord("a", 0, (2,), spec, 1.0), ParamRecord("b", 0, (2,), spec, 2.0)],
        groups=[GroupRecord(GROUPS[0], ["a", "b"])],
        source="memory",
    )
    with pytest.raises(MegatronFormatError, match="different steps"):
        megatron_writer(tmp_path / "out").write(index, _Memory(index, {}))


def test_reader_names_what_is_not_a_megatron_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(MegatronFormatError, match=r"no metadata\.json"):
        megatron_reader(tmp_path)
    (tmp_path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with pytest.raises(MegatronFormatError, match=r"no common\.pt and no DCP checkpoint"):
        megatron_reader(tmp_path)


def test_standard_groups_need_megatrons_two_groups() -> None:
    with pytest.raises(MegatronFormatError, match="group_of="):
        standard_group_of([{**GROUPS[0], "lr_mult": 2.0}, GROUPS[1]])


def test_layout_follows_ddp_rules() -> None:
    # Reverse order, starts aligned to 64, a new bucket once the bucket size is reached.
    buffer = Buffer(torch.float32, torch.float32, (("a", (100,)), ("b", (3, 10)), ("c", (7,))))
    slots, sizes = lay_out(buffer, bucket_size=90)
    assert [(s.name, s.bucket, s.start, s.end) for s in slots] == [
        ("c", 0, 0, 7),
        ("b", 0, 64, 94),
        ("a", 1, 0, 100),
    ]
    assert sizes == [94, 100]
    assert lay_out(buffer, bucket_numels=[94, 100])[0] == slots
    with pytest.raises(MegatronFormatError, match="do not fit"):
        lay_out(buffer, bucket_numels=[194])


def test_buffers_split_by_dtype_in_order_of_first_appearance() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[1].bfloat16()
    model[0].bias.requires_grad_(False)
    buffers = buffers_of(model)
    assert [(b.param_dtype, [n for n, _ in b.params]) for b in buffers] == [
        (torch.float32, ["0.weight"]),
        (torch.bfloat16, ["1.weight", "1.bias"]),
    ]


@settings(max_examples=5)
@given(states())
def test_inspect_shows_a_megatron_checkpoint_through_the_converter(state: _Memory) -> None:
    import contextlib
    import io
    import tempfile

    from wrapped_optim._cli import run_inspect

    with tempfile.TemporaryDirectory() as root, contextlib.redirect_stdout(io.StringIO()) as text:
        megatron_writer(Path(root, "optim")).write(state.index(), state)
        assert run_inspect(str(Path(root, "optim")), per_param=True) == 0
    out = text.getvalue()
    assert f"format: {FULLY_RESHARDABLE} (read by the converter)" in out
    for param in state.index().params:
        assert f"  {param.name} {tuple(param.shape)} group {param.group} step" in out


def test_classes_of_torch_and_this_package_are_allowed_in_a_fresh_process(
    tmp_path: Path,
) -> None:
    """A Megatron checkpoint of a HybridDeviceOptimizer pickles its sub-optimizer classes; a
    process that has not imported them yet (the CLI) still reads it, and nothing else."""
    import subprocess
    import sys

    from wrapped_optim.optimizers import PrecisionAwareAdamW

    torch.save({"gpu": PrecisionAwareAdamW, "cpu": torch.optim.AdamW}, tmp_path / "common.pt")
    probe = (
        "import sys; from wrapped_optim._formats.pickled_classes import "
        "optimizer_classes_named_in as f; "
        f"print(sorted(c.__name__ for c in f({str(tmp_path / 'common.pt')!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "['AdamW', 'PrecisionAwareAdamW']"
