"""The bucket-space Megatron writers (``dp_reshardable``, the legacy ``save_parameter_state``
files) without Megatron: any canonical state goes A -> B -> A bit for bit through both, one
tensor alive at a time, and what does not map is refused with the tensor and format named and
nothing left behind.

(Real Megatron resuming what they write: tests/megatron_real/test_convert_megatron.py.)
"""

from __future__ import annotations

import tempfile
import weakref
import zipfile
from pathlib import Path
from typing import Any

import attrs
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
from wrapped_optim.checkpoint._convert._megatron import DP_RESHARDABLE, LEGACY, detect_megatron
from wrapped_optim.checkpoint._convert._megatron_bucket_writers import (
    MegatronDpReshardableWriter,
    MegatronLegacyWriter,
    megatron_bucket_writer,
)
from wrapped_optim.checkpoint._convert._megatron_buckets import ParamList
from wrapped_optim.checkpoint._convert._megatron_files import DcpTensors, MegatronFormatError
from wrapped_optim.checkpoint._convert._megatron_readers import megatron_reader

KEYS = (MASTER, "exp_avg", "exp_avg_sq")
GROUP = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


class _Memory:
    """An in-memory canonical source that counts how many of the tensors it handed out still
    hold their memory (a storage alive, through any view of it, and not released) whenever it
    hands out another."""

    def __init__(self, index: StateIndex, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
        self._index, self.tensors = index, tensors
        self._out: list[weakref.ref[torch.UntypedStorage]] = []
        self.most_alive = 0

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        alive = [ref() for ref in self._out]
        held = [s for s in alive if s is not None and s.nbytes() > 0]
        self.most_alive = max(self.most_alive, len(held) + 1)
        tensor = self.tensors[name, key].clone()
        self._out.append(weakref.ref(tensor.untyped_storage()))
        return tensor

    def close(self) -> None:
        pass


def _model(shapes: list[tuple[int, ...]]) -> tuple[ParamList, list[str]]:
    names = [f"layers.{i}.{'bias' if len(s) == 1 else 'weight'}" for i, s in enumerate(shapes)]
    return ParamList(names, shapes), names


@st.composite
def cases(draw: Any) -> tuple[_Memory, ParamList, str, int | None]:
    shapes = draw(
        st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=2).map(tuple), max_size=5).filter(
            bool
        )
    )
    model, names = _model(shapes)
    dtype = draw(st.sampled_from(["torch.float32", "torch.bfloat16"]))
    bucket_size = draw(st.sampled_from([None, 40, 100]))
    step = float(draw(st.integers(1, 1000)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tensors, params = {}, []
    for name, shape in zip(names, shapes, strict=True):
        for key in KEYS:
            bits = torch.randint(-(2**31), 2**31, shape, dtype=torch.int32, generator=generator)
            tensors[name, key] = bits.view(torch.float32)  # any bit pattern, NaNs included
        specs = {k: TensorSpec(shape, torch.float32) for k in KEYS}
        params.append(ParamRecord(name, 0, shape, specs, step))
    index = StateIndex(params=params, groups=[GroupRecord(GROUP, names)], source="memory")
    return _Memory(index, tensors), model, dtype, bucket_size


def _same(first: Any, second: Any) -> None:
    # Bucket-space readers list parameters in bucket order (the model's, reversed).
    assert sorted(second.index().params, key=lambda p: p.name) == sorted(
        first.index().params, key=lambda p: p.name
    )
    for name, key, tensor in iter_tensors(first.index(), first):
        got = second.read(name, key)
        assert torch.equal(got.view(torch.int32), tensor.view(torch.int32)), (name, key)


@settings(max_examples=10, deadline=None)
@given(cases())
def test_memory_to_bucket_space_and_back_is_bit_identical(
    case: tuple[_Memory, ParamList, str, int | None],
) -> None:
    """memory -> dp_reshardable -> legacy -> dp_reshardable: every tensor as it started, the
    two dp_reshardable checkpoints' flat tensors identical, and one source tensor alive at a
    time (each released before the next is read)."""
    source, model, dtype, bucket_size = case
    dtypes = [dtype] * len(model.names)
    with tempfile.TemporaryDirectory() as root:
        first, legacy, again = Path(root, "dp"), Path(root, "legacy"), Path(root, "dp_again")
        MegatronDpReshardableWriter(
            first, model=model, dtypes=dtypes, bucket_size=bucket_size, dp_size=2
        ).write(source.index(), source)
        assert source.most_alive == 1
        assert detect_megatron(first) == DP_RESHARDABLE
        read_first = megatron_reader(first, model=model)
        _same(source, read_first)
        MegatronLegacyWriter(legacy, model=model, dtypes=dtypes, bucket_size=bucket_size).write(
            read_first.index(), read_first
        )
        assert detect_megatron(legacy) == LEGACY
        with zipfile.ZipFile(legacy / "param_state.pt") as archive:
            assert archive.testzip() is None  # every record's CRC is right
        read_legacy = megatron_reader(legacy, model=model, bucket_size=bucket_size)
        _same(source, read_legacy)
        MegatronDpReshardableWriter(
            again, model=model, dtypes=dtypes, bucket_size=bucket_size, dp_size=2
        ).write(read_legacy.index(), read_legacy)
        _same(source, megatron_reader(again, model=model))
        one, two = DcpTensors(first), DcpTensors(again)
        assert list(one) == list(two)
        for fqn in one:
            assert torch.equal(one.read(fqn).view(torch.int32), two.read(fqn).view(torch.int32))
        one.close()
        two.close()


def test_legacy_writer_holds_one_source_tensor_at_a_time(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    state = _linear_state(model)
    MegatronLegacyWriter(tmp_path / "legacy", model=model).write(state.index(), state)
    assert state.most_alive == 1
    _same(state, megatron_reader(tmp_path / "legacy", model=model))


def _linear_state(model: torch.nn.Module, step: float = 3.0) -> _Memory:
    names = [name for name, _ in model.named_parameters()]
    params, tensors = [], {}
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        params.append(
            ParamRecord(name, 0, shape, {k: TensorSpec(shape, torch.float32) for k in KEYS}, step)
        )
        for number, key in enumerate(KEYS):
            tensors[name, key] = torch.full(shape, float(number + 1))
    index = StateIndex(params=params, groups=[GroupRecord(GROUP, names)], source="memory")
    return _Memory(index, tensors)


@pytest.mark.parametrize("fmt", [DP_RESHARDABLE, LEGACY])
def test_a_model_that_does_not_match_is_refused_naming_the_parameter(
    tmp_path: Path, fmt: str
) -> None:
    state = _linear_state(torch.nn.Linear(3, 2))
    with torch.device("meta"):
        wider = torch.nn.Linear(4, 2)
        more = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with pytest.raises(MegatronFormatError, match=rf"{fmt}: parameter 'weight' is \(2, 4\)"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=wider).write(state.index(), state)
    with pytest.raises(MegatronFormatError, match=rf"{fmt}: the model's parameter '0.weight'"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=more).write(state.index(), state)
    with torch.device("meta"):
        fewer = torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(MegatronFormatError, match=r"holds \['bias'\], which the model has no"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=fewer).write(state.index(), state)
    assert list(tmp_path.iterdir()) == []  # nothing written, no staging left behind


@pytest.mark.parametrize("fmt", [DP_RESHARDABLE, LEGACY])
def test_state_megatron_cannot_hold_is_refused(tmp_path: Path, fmt: str) -> None:
    model = torch.nn.Linear(3, 2)
    state = _linear_state(model)
    index = state.index()
    extra = StateIndex(
        params=[
            ParamRecord(p.name, 0, p.shape, {**p.state, "momentum_buffer": p.state[MASTER]}, p.step)
            for p in index.params
        ],
        groups=index.groups,
        source="memory",
    )
    with pytest.raises(MegatronFormatError, match=r"'weight': state \['momentum_buffer'\]"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=model).write(extra, state)
    no_master = StateIndex(
        params=[
            ParamRecord(p.name, 0, p.shape, {"exp_avg": p.state["exp_avg"]}, p.step)
            for p in index.params
        ],
        groups=index.groups,
        source="memory",
    )
    with pytest.raises(MegatronFormatError, match=r"'weight': no state 'master'"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=model).write(no_master, state)
    assert list(tmp_path.iterdir()) == []


class _Failing(_Memory):
    def read(self, name: str, key: str) -> torch.Tensor:
        if key == "exp_avg_sq":
            raise OSError(f"disk gone while reading {name}")
        return super().read(name, key)


@pytest.mark.parametrize("fmt", [DP_RESHARDABLE, LEGACY])
def test_a_failure_midway_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    model = torch.nn.Linear(3, 2)
    state = _linear_state(model)
    failing = _Failing(state.index(), state.tensors)
    with pytest.raises(OSError, match="disk gone"):
        megatron_bucket_writer(tmp_path / "out", fmt, model=model).write(state.index(), failing)
    assert list(tmp_path.iterdir()) == []


def test_offload_master_param_follows_the_groups_or_the_flag(tmp_path: Path) -> None:
    """HybridDeviceOptimizer's checkpoints hold ``master_param`` beside ``param``: written
    when the groups are an offload optimizer's, or when asked."""
    model = torch.nn.Linear(3, 2)
    state = _linear_state(model)
    plain = tmp_path / "plain"
    megatron_bucket_writer(plain, DP_RESHARDABLE, model=model).write(state.index(), state)
    offload = tmp_path / "offload"
    groups = [{**GROUP, "offload_fraction": 0.5}]
    megatron_bucket_writer(offload, DP_RESHARDABLE, model=model, param_groups=groups).write(
        state.index(), state
    )
    forced = tmp_path / "forced"
    megatron_bucket_writer(forced, DP_RESHARDABLE, model=model, master_param=True).write(
        state.index(), state
    )
    for path, expected in ((plain, False), (offload, True), (forced, True)):
        tensors = DcpTensors(path)
        masters = [fqn for fqn in tensors if fqn.endswith(".master_param")]
        params = [fqn for fqn in tensors if fqn.endswith(".param")]
        assert len(masters) == (len(params) if expected else 0), path
        for master, param in zip(masters, params if expected else [], strict=True):
            assert torch.equal(tensors.read(master), tensors.read(param))
        tensors.close()
        _same(state, megatron_reader(path, model=model))  # the reader takes it as an alias


def test_convert_writes_bucket_space_given_the_model_and_refuses_names_alone(
    tmp_path: Path,
) -> None:
    from wrapped_optim.checkpoint import convert, names_from_model

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    with pytest.raises(MegatronFormatError, match="names and shapes do not give"):
        convert(
            tmp_path / "optimizer.pt",
            tmp_path / "by_names",
            to=LEGACY,
            names=names_from_model(model),
        )
    assert not (tmp_path / "by_names").exists()
    # torch's AdamW has no master: Megatron's needs one, and says so.
    with pytest.raises(Exception, match="no state 'master'"):
        convert(tmp_path / "optimizer.pt", tmp_path / "dp", to=DP_RESHARDABLE, model=model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["optimizer.pt"]


@pytest.mark.parametrize(("dp", "padded"), [(1, 128), (2, 128), (3, 384)])
def test_dp_size_sets_only_the_recorded_padded_bucket_sizes(
    tmp_path: Path, dp: int, padded: int
) -> None:
    """Core pads each bucket to a multiple of lcm(DP, 128) and records it; the flat tensors
    (the unpadded bucket) are the same at every DP size."""
    model = torch.nn.Linear(3, 2)  # bias at 0..2, weight at 64..70: 70 elements unpadded
    state = _linear_state(model)
    megatron_bucket_writer(tmp_path / "out", DP_RESHARDABLE, model=model, dp_size=dp).write(
        state.index(), state
    )
    tensors = DcpTensors(tmp_path / "out")
    prefix = "optimizer.distributed.dp_group_idx_0"
    label = (torch.float32, torch.float32)
    assert tensors.read_object(f"{prefix}.per_bucket_numel/shard_0_1") == [[{label: [padded]}]]
    assert tensors.read_object(f"{prefix}.per_bucket_numel_unpadded/shard_0_1") == [[{label: [70]}]]
    assert {fqn: spec[0] for fqn, spec in tensors.specs.items()} == {
        f"{prefix}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0.{key}": (70,)
        for key in ("param", "exp_avg", "exp_avg_sq")
    }
    tensors.close()
    with pytest.raises(MegatronFormatError, match="dp_size=0"):
        megatron_bucket_writer(tmp_path / "zero", DP_RESHARDABLE, model=model, dp_size=0)


def test_command_line_writes_bucket_space_with_model_and_says_why_not_with_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wrapped_optim._cli import main
    from wrapped_optim.checkpoint._convert._megatron import megatron_writer

    (tmp_path / "mymodel.py").write_text(
        "import torch\n\ndef build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))\n"
    )
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = _linear_state(model)
    megatron_writer(tmp_path / "src").write(state.index(), state)
    spec = f"{tmp_path / 'mymodel.py'}:build"
    for fmt in (DP_RESHARDABLE, LEGACY):
        out = tmp_path / fmt
        args = ["convert", str(tmp_path / "src"), str(out), "--to", fmt, "--no-progress"]
        assert main([*args, "--model", spec, "--verify"]) == 0
        _same(state, megatron_reader(out, model=model))
    assert main(["names", spec, str(tmp_path / "names.json")]) == 0
    capsys.readouterr()
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "x"), "--to", LEGACY]
    assert main([*args, "--names", str(tmp_path / "names.json"), "--no-progress"]) == 2
    assert "pass the model itself" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("zip64", [False, True])
def test_legacy_file_crcs_are_fixed_in_both_zip_forms(tmp_path: Path, zip64: bool) -> None:
    """``param_state.pt`` is filled after ``torch.save`` wrote it: each record's CRC-32 is put
    into its local header and its central directory entry, also where the end record points
    to the zip64 directory (a file over 4 GiB)."""
    import struct

    from wrapped_optim.checkpoint._convert._megatron_bucket_writers import _fix_crcs

    model = torch.nn.Linear(3, 2)
    state = _linear_state(model)
    MegatronLegacyWriter(tmp_path / "legacy", model=model).write(state.index(), state)
    file = tmp_path / "legacy" / "param_state.pt"
    with zipfile.ZipFile(file) as archive:
        right = {i.filename: i.CRC for i in archive.infolist() if "/data/" in i.filename}
    assert len(right) == 3
    with open(file, "r+b") as stream:
        _fix_crcs(stream, {name: 0 for name in right})
    with zipfile.ZipFile(file) as archive:
        assert archive.testzip() is not None  # broken on purpose
    if zip64:  # what a big file's end record says: look in the zip64 directory
        data = bytearray(file.read_bytes())
        end = data.rfind(b"PK\x05\x06")
        data[end + 8 : end + 12] = struct.pack("<HH", 0xFFFF, 0xFFFF)
        data[end + 16 : end + 20] = struct.pack("<I", 0xFFFFFFFF)
        file.write_bytes(bytes(data))
    with open(file, "r+b") as stream:
        _fix_crcs(stream, right)
    with zipfile.ZipFile(file) as archive:
        assert archive.testzip() is None
    _same(state, megatron_reader(tmp_path / "legacy", model=model))


_MIXED = """import torch

def build():
    model = torch.nn.Sequential(torch.nn.Linear(33, 33), torch.nn.Linear(33, 4)).bfloat16()
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.data = param.data.float()
    return model
"""


def test_convert_places_several_buckets_and_grad_buffers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bf16 weights beside FP32 biases (two grad buffers) in buckets of 100 elements: convert
    and the command line place them given the model and the bucket size, the legacy reader
    refuses the file without it, the FP8 shard scales follow the buckets, and a
    (model, optimizer) pair numbers a torch.save destination by the optimizer's groups."""
    from wrapped_optim._cli import main
    from wrapped_optim.checkpoint import ConversionError, convert
    from wrapped_optim.checkpoint._convert._megatron import megatron_writer
    from wrapped_optim.checkpoint._convert._megatron_scales import megatron_fp8_pieces
    from wrapped_optim.checkpoint._convert._options import FormatOptions

    (tmp_path / "mymodel.py").write_text(_MIXED)
    spec = f"{tmp_path / 'mymodel.py'}:build"
    namespace: dict[str, Any] = {}
    exec(_MIXED, namespace)
    model = namespace["build"]()
    state = _linear_state(model)
    generator = torch.Generator().manual_seed(0)
    for where, tensor in state.tensors.items():
        state.tensors[where] = torch.randn(tensor.shape, generator=generator)
    megatron_writer(tmp_path / "src").write(state.index(), state)
    legacy, dp = tmp_path / "legacy", tmp_path / "dp"
    convert(tmp_path / "src", legacy, to=LEGACY, model=model, bucket_size=100, verify=True)
    _same(state, megatron_reader(legacy, model=model, bucket_size=100))
    with pytest.raises(MegatronFormatError, match="bucket_size=None"):
        convert(legacy, tmp_path / "no_size", to="dcp", model=model)
    args = ["convert", str(tmp_path / "src"), str(dp), "--to", DP_RESHARDABLE, "--no-progress"]
    assert main([*args, "--model", spec, "--bucket-size", "100", "--verify"]) == 0
    capsys.readouterr()
    tensors = DcpTensors(dp)
    recorded = tensors.read_object(
        "optimizer.distributed.dp_group_idx_0.per_bucket_numel_unpadded/shard_0_1"
    )
    tensors.close()
    # weights: second.weight alone fills bucket 0 (132 >= 100), first.weight bucket 1;
    # biases: second.bias at 0, first.bias at 64..97
    bf16, fp32 = (torch.bfloat16, torch.float32), (torch.float32, torch.float32)
    assert recorded == [[{bf16: [132, 1089]}, {fp32: [97]}]]
    _same(state, megatron_reader(dp, model=model))
    # The legacy file's buckets read through convert, into an optimizer-ordered torch.save.
    groups = [[model[0].weight, model[1].weight], [model[0].bias, model[1].bias]]
    optimizer = torch.optim.AdamW([{"params": members} for members in groups])
    out = tmp_path / "optimizer.pt"
    convert(legacy, out, to="torch-save", model=(model, optimizer), bucket_size=100, verify=True)
    saved = torch.load(out, weights_only=True)
    names = ["0.weight", "1.weight", "0.bias", "1.bias"]
    for number, name in enumerate(names):
        assert torch.equal(saved["state"][number]["exp_avg"], state.tensors[name, "exp_avg"])
    with pytest.raises(ConversionError, match="neither torch-save nor dcp"):
        convert(out, tmp_path / "x", to="dcp", model=model, bucket_size=100)
    assert not (tmp_path / "x").exists() and not (tmp_path / "no_size").exists()
    # Each DP-2 rank's share of a bucket is half of it padded to 128: first.weight's bucket
    # (1089 -> 1152) splits at 576; laid out in one bucket (1281 -> 1408, first.weight from
    # 192) it would split at 704 - 192 = 512.
    dtypes = [str(p.dtype) for p in model.parameters()]
    shapes = [tuple(p.shape) for p in model.parameters()]
    index = megatron_reader(dp, model=model).index()
    in_model = [name for name, _ in model.named_parameters()]
    options = FormatOptions(names=in_model, shapes=shapes, dtypes=dtypes, dp_size=2)
    pieces = megatron_fp8_pieces(index, attrs.evolve(options, bucket_size=100))
    assert pieces["0.weight"] == ((0, 576), (576, 1089))
    assert megatron_fp8_pieces(index, options)["0.weight"] == ((0, 512), (512, 1089))
