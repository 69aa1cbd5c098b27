"""The converter's Megatron formats on checkpoints real megatron-core stacks write and resume.

One launch of two gloo ranks trains the real CPU stacks (DistributedOptimizer with FP32
params; HybridDeviceOptimizer offloading half, bf16 params) and saves them the way Bridge
does; each rank also records its slice of every parameter's optimizer state in model space.
The reader's canonical tensors equal that state bit for bit. The writer's ``fully_reshardable``
output, from the reader and from an independent in-memory source, is resumed by real Megatron
at DP 2 (fresh processes) and DP 1: the state after the load equals the source bitwise, and
training continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

# Not importorskip: importing megatron.core binds its FusedAdam before the precision-aware
# launch's TE stand-in (tests/megatron_real/precision_aware.py), in the spawned workers too.
if importlib.util.find_spec("megatron") is None:  # pragma: no cover - Megatron is optional
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.distributed.conftest import Launcher, mismatches, run_in_this_process
from tests.megatron_real.dist_ckpt import (
    assert_resumed_bitwise,
    load_converted,
    load_dcp_into,
    metadata,
    model_space_state,
    route_optimizer,
    save,
    snapshot,
    whole_model_space,
)
from tests.megatron_real.harness import build, megatron_session, train
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
)
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError
from wrapped_optim.checkpoint._convert._megatron_readers import megatron_reader

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("megatron_real")]

SAVE_AT, MORE = 3, 3
CONFIGS = ("distributed", "offload_half")
FORMATS = ("fully_reshardable", "dp_reshardable", "legacy")
KEYS = {"param": MASTER, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


def _model_name(name: str) -> str:
    return name.removeprefix("module.")  # DDP's wrapper; Megatron's sharded keys lack it


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with megatron_session():
        for name in CONFIGS:
            model, optimizer = build(name)
            optimizer = route_optimizer(optimizer, "wrap")
            train(model, optimizer, range(SAVE_AT), rank)
            for fmt in FORMATS:
                save(model, optimizer, Path(root, name, fmt), fmt)
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            out[name] = {"space": space, "snapshot": snapshot(model, optimizer)}
    return out


def _resume(rank: int, world: int, sources: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """A fresh build per entry ``(config, model dir, optimizer dir[, format])``: the model from
    the saved Megatron checkpoint, the optimizer from the converted directory (in ``format``,
    default fully_reshardable), then ``MORE`` steps."""
    from megatron.core import dist_checkpointing

    out: dict[str, Any] = {}
    with megatron_session():
        for label, (name, model_dir, optimizer_dir, *fmt) in sources.items():
            model, optimizer = build(name, seed=1)
            optimizer = route_optimizer(optimizer, "wrap")
            model_sd = model.module.sharded_state_dict()
            # The saved common.pt also holds the offload optimizer's classes.
            with torch.serialization.safe_globals([torch.optim.AdamW]):
                loaded = dist_checkpointing.load({"model": model_sd}, model_dir)
            model.module.load_state_dict(loaded["model"])
            try:
                load_converted(model, optimizer, optimizer_dir, *(fmt or ["fully_reshardable"]))
            except Exception as error:  # reported to the tests, which decide
                out[label] = {"error": f"{type(error).__name__}: {error}"}
                continue
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            out[label] = {"space": space, "snapshot": snapshot(model, optimizer)}
    return out


class _DictReader:
    """An in-memory canonical source, built from the live optimizer's state (not from any
    checkpoint file): what a DCP or torch.save reader hands a writer."""

    def __init__(self, index: StateIndex, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
        self._index, self._tensors = index, tensors

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        return self._tensors[name, key].clone()

    def close(self) -> None:
        pass


def _source_state(saved: list[dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    """``"<param>/<key>"`` -> the whole tensor, put together from both ranks' slices."""
    return whole_model_space([rank[name]["space"] for rank in saved])


def _dict_reader(state: dict[str, torch.Tensor], like: StateIndex) -> _DictReader:
    shapes = {param.name: param.shape for param in like.params}
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    steps: dict[str, float] = {}
    for path, value in state.items():
        param, _, key = path.rpartition("/")
        param = _model_name(param)
        if key == "step":
            steps[param] = float(value)
        elif key in KEYS:
            tensors[param, KEYS[key]] = value.reshape(shapes[param])
    params = [
        ParamRecord(
            name=p.name,
            group=p.group,
            shape=p.shape,
            state={k: TensorSpec(p.shape, tensors[p.name, k].dtype) for k in KEYS.values()},
            step=steps[p.name],
        )
        for p in like.params
    ]
    groups = [GroupRecord(options=dict(g.options), names=g.names) for g in like.groups]
    index = StateIndex(params=params, groups=groups, source="memory")
    return _DictReader(index, tensors)


def _as_model_space(reader: Any) -> dict[str, torch.Tensor]:
    """A reader's canonical tensors keyed as :func:`whole_model_space` keys the live state;
    closes the reader."""
    index = reader.index()
    stored = {v: k for k, v in KEYS.items()}
    got: dict[str, torch.Tensor] = {}
    for param, key, tensor in iter_tensors(index, reader):
        got[f"module.{param}/{stored[key]}"] = tensor.reshape(-1)
    for param in index.params:
        got[f"module.{param.name}/step"] = torch.tensor(param.step, dtype=torch.float32)
    reader.close()
    return got


def _assert_same_tensors(first: Any, again: Any) -> None:
    """Every state tensor of ``first`` is bit-identical in ``again``; closes both."""
    for param, key, tensor in iter_tensors(first.index(), first):
        assert mismatches({"t": tensor}, {"t": again.read(param, key)}) == [], (param, key)
    first.close()
    again.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("convert_megatron")
    launch = Launcher(root, cuda_shim=False, timeout_s=600)
    ckpt = root / "ckpt"
    saved = launch(_save, 2, str(ckpt))
    saved_dp1 = [run_in_this_process(_save, root, str(root / "ckpt_dp1"))]
    converted: dict[str, tuple[str, str, str]] = {}
    for name in CONFIGS:
        source = ckpt / name / "fully_reshardable" / "dist"
        reader = megatron_reader(source)
        index = reader.index()
        through = root / "out" / name / "from_reader"
        megatron_writer(through).write(index, reader)
        reader.close()
        memory = root / "out" / name / "from_memory"
        megatron_writer(memory).write(index, _dict_reader(_source_state(saved, name), index))
        model_dir = str(ckpt / name / "fully_reshardable" / "dist")
        converted[f"{name}/reader"] = (name, model_dir, str(through))
        converted[f"{name}/memory"] = (name, model_dir, str(memory))
        converted.update(_to_bucket_space(root / "out" / name, name, model_dir))
    return {
        "root": root,
        "ckpt": ckpt,
        "saved": saved,
        "saved_dp1": saved_dp1,
        "ckpt_dp1": root / "ckpt_dp1",
        "converted": converted,
        "dp2": launch(_resume, 2, converted),  # fresh processes
        "dp1": [run_in_this_process(_resume, root, converted)],
    }


BUCKET_TARGETS = {"dp_reshardable@1": 1, "dp_reshardable@2": 2, "legacy": None}


def _to_bucket_space(out: Path, name: str, model_dir: str) -> dict[str, tuple[str, ...]]:
    """Megatron's own fully_reshardable checkpoint of config ``name`` converted to DCP (the
    source: no Megatron in its files), then from DCP to each bucket-space format (a
    dp_reshardable one written for DP 1 and one for DP 2): ``label -> _resume's entry``."""
    from wrapped_optim.checkpoint import convert

    convert(model_dir, out / "dcp", to="dcp")
    entries: dict[str, tuple[str, ...]] = {}
    for target, dp in BUCKET_TARGETS.items():
        fmt = target.partition("@")[0]
        written = out / f"dcp_to_{target}"
        report = convert(
            out / "dcp",
            written,
            to=f"megatron-{fmt.replace('_', '-')}",
            model=_meta_model(name),
            dp=dp,
            verify=True,
        )
        assert report.lossy == {} and report.verified
        entries[f"{name}/dcp>{target}"] = (name, model_dir, str(written), fmt)
    return entries


@pytest.mark.parametrize("ranks", ["dp1", "dp2"])
@pytest.mark.parametrize("target", BUCKET_TARGETS)
@pytest.mark.parametrize("name", CONFIGS)
def test_written_bucket_space_resumes_in_real_megatron_bitwise(
    runs: dict[str, Any], name: str, target: str, ranks: str
) -> None:
    """DCP -> dp_reshardable / legacy, resumed by a real DistributedOptimizer at DP 1 and
    DP 2: its state after the load is the source's, bit for bit (at DP 2 the run then
    continues exactly as the uninterrupted one)."""
    _assert_resumed_bitwise(runs, name, f"{name}/dcp>{target}", ranks)


@pytest.mark.parametrize("fmt", ["dp_reshardable", "legacy"])
@pytest.mark.parametrize("name", CONFIGS)
def test_megatrons_bucket_space_round_trips_through_dcp_bit_identical(
    runs: dict[str, Any], name: str, fmt: str, tmp_path: Path
) -> None:
    """Megatron's own dp_reshardable / legacy checkpoint -> DCP -> the same format: every
    tensor as Megatron wrote it; the legacy parameter-state file's flat tensors are Megatron's
    byte for byte (alignment gaps included)."""
    from wrapped_optim.checkpoint import convert

    target = f"megatron-{fmt.replace('_', '-')}"
    ckpt = runs["ckpt"] / name
    src = ckpt / fmt / "dist" if fmt == "dp_reshardable" else ckpt / fmt
    convert(src, tmp_path / "dcp", to="dcp", model=_meta_model(name))
    convert(tmp_path / "dcp", tmp_path / "back", to=target, model=_meta_model(name), verify=True)
    first = megatron_reader(src, model=_meta_model(name))
    again = megatron_reader(tmp_path / "back", model=_meta_model(name))
    assert again.index().params == first.index().params
    assert [g.names for g in again.index().groups] == [g.names for g in first.index().groups]
    _assert_same_tensors(first, again)
    if fmt == "legacy":
        own = torch.load(src / "param_state.pt", weights_only=True)
        back = torch.load(tmp_path / "back" / "param_state.pt", weights_only=True)
        assert own.keys() == back.keys()
        for dtypes, world in own[0].items():
            assert world["numel_unpadded"] == back[0][dtypes]["numel_unpadded"]
            flat = {k: v for k, v in world.items() if isinstance(v, torch.Tensor)}
            assert mismatches(flat, {k: back[0][dtypes][k] for k in flat}) == []


@pytest.mark.parametrize("name", CONFIGS)
def test_fully_reshardable_reader_equals_the_live_optimizer_bitwise(
    runs: dict[str, Any], name: str
) -> None:
    source = _source_state(runs["saved"], name)
    reader = megatron_reader(runs["ckpt"] / name / "fully_reshardable" / "dist")
    index = reader.index()
    assert index.source == FULLY_RESHARDABLE
    got = _as_model_space(reader)
    assert got.keys() == source.keys()
    assert mismatches(source, got) == []
    # Megatron's standard groups: weight decay on matrices, off on biases.
    assert [sorted(g.names) for g in index.groups] == [
        ["first.weight", "second.weight"],
        ["first.bias", "second.bias"],
    ]


@pytest.mark.parametrize("name", CONFIGS)
def test_fully_reshardable_round_trip_is_bit_identical(runs: dict[str, Any], name: str) -> None:
    first = megatron_reader(runs["ckpt"] / name / "fully_reshardable" / "dist")
    again = megatron_reader(runs["converted"][f"{name}/reader"][2])
    assert again.index().params == first.index().params
    assert [g.names for g in again.index().groups] == [g.names for g in first.index().groups]
    _assert_same_tensors(first, again)


@pytest.mark.parametrize("ranks", ["dp1", "dp2"])
@pytest.mark.parametrize("origin", ["reader", "memory"])
@pytest.mark.parametrize("name", CONFIGS)
def test_written_fully_reshardable_resumes_in_real_megatron_bitwise(
    runs: dict[str, Any], name: str, origin: str, ranks: str
) -> None:
    _assert_resumed_bitwise(runs, name, f"{name}/{origin}", ranks)


def _assert_resumed_bitwise(runs: dict[str, Any], name: str, label: str, ranks: str) -> None:
    """The resume ``label`` at ``ranks`` loaded without error, its optimizer state right after
    the load is the source's bit for bit, and (at DP 2, the saving world) the run continued
    exactly as the uninterrupted one."""
    saved = runs["saved"]
    uninterrupted = [rank[name]["snapshot"] for rank in saved] if ranks == "dp2" else None
    cells = [rank[label] for rank in runs[ranks]]
    assert_resumed_bitwise(_source_state(saved, name), cells, uninterrupted)


def test_detects_each_megatron_format(runs: dict[str, Any]) -> None:
    ckpt = runs["ckpt"] / "distributed"
    assert detect_megatron(ckpt / "fully_reshardable" / "dist") == FULLY_RESHARDABLE
    assert detect_megatron(ckpt / "dp_reshardable" / "dist") == "megatron-dp-reshardable"
    assert detect_megatron(ckpt / "legacy") == "megatron-legacy"
    assert detect_megatron(ckpt / "legacy" / "model") is None  # model only


def test_writer_refuses_state_megatron_cannot_hold(runs: dict[str, Any], tmp_path: Path) -> None:
    reader = megatron_reader(runs["ckpt"] / "distributed" / "fully_reshardable" / "dist")
    index = reader.index()
    without_master = StateIndex(
        params=[
            ParamRecord(
                p.name, p.group, p.shape, {k: v for k, v in p.state.items() if k != MASTER}, p.step
            )
            for p in index.params
        ],
        groups=index.groups,
        source="test",
    )
    with pytest.raises(MegatronFormatError, match="no state 'master'"):
        megatron_writer(tmp_path / "out").write(without_master, reader)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []  # no staging directory left behind
    plain_groups = StateIndex(
        params=index.params,
        groups=[GroupRecord(options={"lr": 0.1}, names=g.names) for g in index.groups],
        source="test",
    )
    with pytest.raises(MegatronFormatError, match="wd_mult, lr_mult"):
        megatron_writer(tmp_path / "out").write(plain_groups, reader)
    reader.close()


@pytest.mark.parametrize("name", CONFIGS)
def test_megatron_to_dcp_loads_into_a_real_torch_adamw_bitwise(
    runs: dict[str, Any], name: str, tmp_path: Path
) -> None:
    from wrapped_optim.checkpoint import convert

    source = _source_state(runs["saved"], name)
    src = runs["ckpt"] / name / "fully_reshardable" / "dist"
    report = convert(src, tmp_path / "dcp", to="dcp", verify=True)
    assert report.lossy == {} and report.verified
    model = torch.nn.Sequential()
    model.add_module("first", torch.nn.Linear(8, 8))
    model.add_module("second", torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # The offload optimizer's groups lack some of torch AdamW's keys (amsgrad, ...): those
    # keep torch's values.
    load_dcp_into(model, optimizer, tmp_path / "dcp")
    names = dict(model.named_parameters())
    got = {}
    for param_name, param in names.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got[f"module.{param_name}/{key}"] = optimizer.state[param][key].reshape(-1)
    want = {k: v.reshape(-1) for k, v in source.items() if not k.endswith("/param")}
    assert mismatches(want, got) == []
    # Megatron's A -> DCP -> A: every tensor bit-identical to the saved checkpoint.
    convert(tmp_path / "dcp", tmp_path / "back", to=FULLY_RESHARDABLE, verify=True)
    first, again = megatron_reader(src), megatron_reader(tmp_path / "back")
    assert again.index().params == first.index().params
    _assert_same_tensors(first, again)


def _meta_model(name: str) -> torch.nn.Module:
    """The harness's model on the meta device: names, shapes and dtypes, no memory."""
    dtype = torch.bfloat16 if name == "offload_half" else torch.float32
    with torch.device("meta"):
        model = torch.nn.Sequential()
        model.add_module("first", torch.nn.Linear(8, 8))
        model.add_module("second", torch.nn.Linear(8, 4))
    return model.to(dtype)


@pytest.mark.parametrize("fmt", ["dp_reshardable", "legacy"])
@pytest.mark.parametrize("saved", ["saved", "saved_dp1"])
@pytest.mark.parametrize("name", CONFIGS)
def test_bucket_space_readers_equal_the_live_optimizer_bitwise(
    runs: dict[str, Any], name: str, saved: str, fmt: str
) -> None:
    source = _source_state(runs[saved], name)
    ckpt = runs["ckpt" if saved == "saved" else "ckpt_dp1"] / name / fmt
    path = ckpt / "dist" if fmt == "dp_reshardable" else ckpt
    assert detect_megatron(path) == f"megatron-{fmt.replace('_', '-')}"
    with pytest.raises(MegatronFormatError, match="pass model="):
        megatron_reader(path)
    got = _as_model_space(megatron_reader(path, model=_meta_model(name)))
    assert mismatches(source, got) == []


def test_bucket_space_reader_refuses_another_model(runs: dict[str, Any]) -> None:
    path = runs["ckpt"] / "distributed" / "dp_reshardable" / "dist"
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    with pytest.raises(MegatronFormatError, match="do not fit the checkpoint's buckets"):
        megatron_reader(path, model=other)
    with pytest.raises(MegatronFormatError, match="dtypes"):
        megatron_reader(path, model=_meta_model("offload_half"))  # bf16 against FP32


@pytest.mark.parametrize("fmt", ["dp_reshardable", "legacy"])
@pytest.mark.parametrize("name", CONFIGS)
def test_convert_from_bucket_space_equals_megatrons_own_fully_reshardable(
    runs: dict[str, Any], name: str, fmt: str, tmp_path: Path
) -> None:
    # convert(model=...) takes only names and shapes; the checkpoint gives the dtypes.
    from wrapped_optim.checkpoint import convert

    ckpt = runs["ckpt"] / name
    src = ckpt / fmt / "dist" if fmt == "dp_reshardable" else ckpt / fmt
    report = convert(src, tmp_path / "out", to=FULLY_RESHARDABLE, model=_meta_model(name))
    assert report.source_format == f"megatron-{fmt.replace('_', '-')}" and report.lossy == {}
    own = megatron_reader(ckpt / "fully_reshardable" / "dist")
    converted = megatron_reader(tmp_path / "out")
    assert converted.index().params == own.index().params
    _assert_same_tensors(own, converted)


# --------------------------------------------------------------------------------------
# Megatron's precision-aware DistributedOptimizer (bf16 moments, FP32 master kept as bf16
# weights plus int16 remainders): its own launch, since the TE stand-in must come first.
# --------------------------------------------------------------------------------------
def _save_precision(rank: int, world: int, root: str) -> dict[str, Any]:
    from tests.megatron_real.precision_aware import build_precision_aware, install_te_stand_in

    install_te_stand_in()
    with megatron_session():
        model, optimizer = build_precision_aware("bf16_remainders")
        optimizer = route_optimizer(optimizer, "wrap")
        train(model, optimizer, range(SAVE_AT), rank)
        save(model, optimizer, Path(root), "fully_reshardable")
        return {
            "space": model_space_state(model, optimizer),
            "weights": {_model_name(n): p.detach().clone() for n, p in model.named_parameters()},
        }


@pytest.fixture(scope="module")
def precision(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("convert_precision")
    launch = Launcher(root, cuda_shim=False, timeout_s=600)
    return {"saved": launch(_save_precision, 2, str(root / "ckpt")), "ckpt": root / "ckpt"}


def test_precision_aware_remainders_rebuild_the_fp32_master_bitwise(
    precision: dict[str, Any],
) -> None:
    from wrapped_optim._formats.remainders import join_master

    saved = precision["saved"]
    live = whole_model_space([rank["space"] for rank in saved])
    weights = saved[0]["weights"]  # the same on every rank
    reader = megatron_reader(precision["ckpt"] / "dist", param_remainders=True)
    for param in reader.index().params:
        remainder = live[f"module.{param.name}/param"]
        assert remainder.dtype == torch.int16  # what the live optimizer keeps
        master = join_master(weights[param.name].reshape(-1), remainder)
        got = reader.read(param.name, MASTER)
        assert got.dtype == torch.float32
        assert mismatches({"m": master}, {"m": got.reshape(-1)}) == [], param.name
        for key in ("exp_avg", "exp_avg_sq"):  # bf16 moments, stored as their FP32 expansion
            want = live[f"module.{param.name}/{key}"]
            assert mismatches({"t": want}, {"t": reader.read(param.name, key).reshape(-1)}) == []
    # Without the flag the remainder is handed on as stored (float32 integers), not a master.
    plain = megatron_reader(precision["ckpt"] / "dist")
    name = plain.index().params[0].name
    assert torch.equal(plain.read(name, MASTER).reshape(-1), live[f"module.{name}/param"].float())
    plain.close()
    reader.close()


def test_cli_param_remainders_carries_the_rebuilt_master_to_dcp(
    precision: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from wrapped_optim._cli import main
    from wrapped_optim._formats.remainders import join_master
    from wrapped_optim.checkpoint._convert._formats import get_format
    from wrapped_optim.checkpoint._convert._options import FormatOptions

    src, out = precision["ckpt"] / "dist", tmp_path / "dcp"
    argv = ["convert", str(src), str(out), "--to", "dcp", "--no-progress", "--verify"]
    assert main([*argv, "--param-remainders"]) == 0
    assert "megatron-fully-reshardable -> dcp" in capsys.readouterr().out
    saved = precision["saved"]
    live = whole_model_space([rank["space"] for rank in saved])
    weights = saved[0]["weights"]
    dcp_format = get_format("dcp")
    assert dcp_format.reader is not None
    written = dcp_format.reader(out, FormatOptions())
    try:
        params = written.index().params
        assert params
        for param in params:
            remainder = live[f"module.{param.name}/param"]
            master = join_master(weights[param.name].reshape(-1), remainder)
            got = written.read(param.name, MASTER)
            assert got.dtype == torch.float32
            assert mismatches({"m": master}, {"m": got.reshape(-1)}) == [], param.name
    finally:
        written.close()
    # Without the flag the destination would hold the remainders as masters: the CLI's
    # output differs, which is what the flag is for.
    plain = tmp_path / "plain"
    assert main([*argv[:2], str(plain), *argv[3:]]) == 0
    other = dcp_format.reader(plain, FormatOptions())
    try:
        name = other.index().params[0].name
        stored = live[f"module.{name}/param"].float()
        assert torch.equal(other.read(name, MASTER).reshape(-1), stored)
    finally:
        other.close()


# --------------------------------------------------------------------------------------
# FP8 moments across a DP change: each rank's shard of a parameter has its own scale under
# Megatron's precision-aware optimizer, so the converter quantizes for the destination's
# shards; the resumed run then holds exactly the values written.
# --------------------------------------------------------------------------------------
FP8_HIDDEN = 16  # first.weight straddles the two DP ranks' shares of the bucket


def _fp8_run(rank: int, root: Path) -> dict[str, Any]:
    from tests.megatron_real.precision_aware import build_precision_aware

    with megatron_session():
        model, optimizer = build_precision_aware("fp8_remainders", hidden=FP8_HIDDEN)
        optimizer = route_optimizer(optimizer, "wrap")
        train(model, optimizer, range(SAVE_AT), rank)
        save(model, optimizer, root, "fully_reshardable")
        params = [(n, tuple(p.shape)) for n, p in model.module.named_parameters()]
        return {"params": params, "space": model_space_state(model, optimizer)}


def _save_fp8(rank: int, world: int, root: str) -> dict[str, Any]:
    """FP8-moment runs saved at DP 2, then (rank 0 alone) at DP 1."""
    from tests.distributed.conftest import become_solo
    from tests.megatron_real.precision_aware import install_te_stand_in

    install_te_stand_in()
    out = {"dp2": _fp8_run(rank, Path(root, "dp2"))}
    become_solo(rank)
    if rank == 0:
        out["dp1"] = _fp8_run(0, Path(root, "dp1"))
    return out


def _resume_fp8_one(rank: int, model_dir: Path, optimizer_dir: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    from tests.megatron_real.precision_aware import build_precision_aware

    with megatron_session():
        model, optimizer = build_precision_aware("fp8_remainders", 1, hidden=FP8_HIDDEN)
        optimizer = route_optimizer(optimizer, "wrap")
        model_sd = model.module.sharded_state_dict()
        loaded = dist_checkpointing.load({"model": model_sd}, str(model_dir))
        model.module.load_state_dict(loaded["model"])
        model_sd = model.module.sharded_state_dict()
        request = optimizer.sharded_state_dict(
            model_sd, True, metadata=metadata("fully_reshardable")
        )
        state = dist_checkpointing.load({"optimizer": request}, str(optimizer_dir))
        with torch.no_grad():
            optimizer.load_state_dict(state["optimizer"])
        return model_space_state(model, optimizer)


def _resume_fp8(rank: int, world: int, root: str) -> dict[str, Any]:
    """The DP 1 save converted for DP 2, resumed on 2 ranks; then (rank 0 alone) the DP 2
    save converted for DP 1."""
    from tests.distributed.conftest import become_solo
    from tests.megatron_real.precision_aware import install_te_stand_in

    install_te_stand_in()
    base = Path(root)
    out = {"to2": _resume_fp8_one(rank, base / "dp1" / "dist", base / "to2")}
    become_solo(rank)
    if rank == 0:
        out["to1"] = _resume_fp8_one(0, base / "dp2" / "dist", base / "to1")
    return out


@pytest.fixture(scope="module")
def fp8_moves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from wrapped_optim.checkpoint import convert
    from wrapped_optim.checkpoint._convert._names import ParameterNames

    root = tmp_path_factory.mktemp("convert_fp8")
    launch = Launcher(root, cuda_shim=False, timeout_s=900)
    saved = launch(_save_fp8, 2, str(root))
    params = saved[0]["dp2"]["params"]
    names = ParameterNames([n for n, _ in params], [s for _, s in params])
    reports = {}
    for label, source, dp in (("to2", "dp1", 2), ("to1", "dp2", 1)):
        reports[label] = convert(
            root / source / "dist",
            root / label,
            to=FULLY_RESHARDABLE,
            moments="fp8",
            dp=dp,
            names=names,
            allow_lossy=True,
        )
    resumed = launch(_resume_fp8, 2, str(root))
    return {"root": root, "saved": saved, "names": names, "reports": reports, "resumed": resumed}


@pytest.mark.parametrize("move", ["to2", "to1"])
def test_fp8_moments_rescaled_for_the_destination_dp_resume_as_written(
    fp8_moves: dict[str, Any], move: str
) -> None:
    root, report = fp8_moves["root"], fp8_moves["reports"][move]
    spaces = [rank[move] for rank in fp8_moves["resumed"] if move in rank]
    assert len(spaces) == (2 if move == "to2" else 1)
    loaded = whole_model_space(spaces)
    source = megatron_reader(root / ("dp1" if move == "to2" else "dp2") / "dist")
    written = megatron_reader(root / move)
    try:
        params = written.index().params
        assert params
        for param in params:
            for key in ("exp_avg", "exp_avg_sq"):
                values = written.read(param.name, key).reshape(-1)
                got = loaded[f"module.{param.name}/{key}"]
                assert mismatches({"v": values}, {"v": got}) == [], (param.name, key)
                before = source.read(param.name, key).reshape(-1).double()
                error = float((values.double() - before).abs().max())
                assert report.lossy[f"{param.name}:{key}"] == error
    finally:
        source.close()
        written.close()


def test_fp8_scales_follow_megatrons_dp_shards(fp8_moves: dict[str, Any]) -> None:
    """The pieces are Megatron's own shards (each DP-2 rank's range of every parameter),
    and one parameter at least straddles the ranks, so the layout decides its values."""
    from wrapped_optim.checkpoint._convert._megatron_scales import megatron_fp8_pieces
    from wrapped_optim.checkpoint._convert._options import FormatOptions
    from wrapped_optim.checkpoint._convert._transforms import fp8_values

    names = fp8_moves["names"]
    written = megatron_reader(fp8_moves["root"] / "to2")
    try:
        index = written.index()
        options = FormatOptions(names=names.names, shapes=names.shapes, dp_size=2)
        pieces = megatron_fp8_pieces(index, options)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for rank in fp8_moves["saved"]:  # the DP 2 run's own ranges, rank by rank
            for key, (start, end, _) in rank["dp2"]["space"].items():
                name, _, state = key.partition("/")
                if state == "exp_avg" and end > start:
                    ranges.setdefault(name.removeprefix("module."), []).append((start, end))
        assert {n: tuple(sorted(r)) for n, r in ranges.items()} == pieces
        split = [n for n, p in pieces.items() if len(p) > 1]
        assert split, pieces
        whole = fp8_values(written.read(split[0], "exp_avg"))
        assert not torch.equal(whole, written.read(split[0], "exp_avg"))
    finally:
        written.close()
