"""The converter's bucket-space Megatron formats with several DDP buckets and grad buffers.

Real megatron-core DistributedOptimizers on CPU (2 gloo ranks) with ``overlap_grad_reduce``
and a small ``bucket_size``: an FP32 model whose one grad buffer is cut into two buckets, and
a model of bf16 weights and FP32 biases (two grad buffers, the bf16 one in two buckets; each
of Megatron's param groups keeps one dtype). Megatron's own ``dp_reshardable`` and legacy
saves at DP 2 convert to DCP and torch.save, which real torch AdamWs load bit for bit; DCP
written back as ``dp_reshardable`` (for DP 1 and 2) and legacy with the run's bucket size is
resumed by real Megatron at DP 1 and DP 2 (fresh processes): the state after the load is the
source's bit for bit, and at DP 2 training continues exactly as the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

if importlib.util.find_spec("megatron") is None:  # pragma: no cover - Megatron is optional
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.distributed.conftest import Launcher, mismatches, run_in_this_process
from tests.megatron_real.dist_ckpt import (
    assert_resumed_bitwise,
    load_converted,
    load_dcp_into,
    model_space_state,
    route_optimizer,
    save,
    snapshot,
    whole_model_space,
)
from tests.megatron_real.harness import build, megatron_session, train
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError
from wrapped_optim.checkpoint._convert._megatron_readers import megatron_reader

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.xdist_group("megatron_real")]

SAVE_AT, MORE = 3, 2
HIDDEN = 33  # buckets end off the 64-element grid (the layout then depends on them) and
# reach past the first DP-2 rank's half (Core refuses empty buckets)
BUCKET_SIZE = 100
# label -> (harness config, bias dtype)
CONFIGS: dict[str, tuple[str, torch.dtype | None]] = {
    "fp32": ("distributed", None),  # one grad buffer, two buckets
    "mixed": ("bf16_distributed", torch.float32),  # bf16 weights (two buckets), FP32 biases
}
# Each grad buffer's bucket sizes (unpadded), as Megatron's DDP laid them out.
BUCKETS = {"fp32": [[196, 1153]], "mixed": [[132, 1089], [97]]}
FORMATS = ("dp_reshardable", "legacy")
TARGETS = {"dp_reshardable@1": 1, "dp_reshardable@2": 2, "legacy": None}


def _build(label: str, seed: int = 0) -> tuple[Any, Any]:
    name, bias_dtype = CONFIGS[label]
    ddp = {"overlap_grad_reduce": True, "bucket_size": BUCKET_SIZE}
    model, optimizer = build(name, seed, hidden=HIDDEN, ddp_options=ddp, bias_dtype=bias_dtype)
    return model, route_optimizer(optimizer, "wrap")


def _meta_model(label: str) -> torch.nn.Module:
    """The run's model on the meta device: names, shapes, dtypes."""
    name, bias_dtype = CONFIGS[label]
    with torch.device("meta"):
        model = torch.nn.Sequential()
        model.add_module("first", torch.nn.Linear(HIDDEN, HIDDEN))
        model.add_module("second", torch.nn.Linear(HIDDEN, 4))
    model.to(torch.float32 if name == "distributed" else torch.bfloat16)
    if bias_dtype is not None:
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.data = param.data.to(bias_dtype)
    return model


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with megatron_session():
        for label in CONFIGS:
            model, optimizer = _build(label)
            train(model, optimizer, range(SAVE_AT), rank)
            for fmt in FORMATS:
                save(model, optimizer, Path(root, label, fmt), fmt)
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            buckets = [[b.numel_unpadded for b in buffer.buckets] for buffer in model.buffers]
            out[label] = {
                "space": space,
                "snapshot": snapshot(model, optimizer),
                "buckets": buckets,
            }
    return out


def _resume(rank: int, world: int, entries: dict[str, tuple[str, str, str, str]]) -> dict[str, Any]:
    """Per entry ``(config, model dir, optimizer dir, format)``: a fresh build, the model
    from Megatron's save, the optimizer from the converted directory, then ``MORE`` steps."""
    from megatron.core import dist_checkpointing

    out: dict[str, Any] = {}
    with megatron_session():
        for key, (label, model_dir, optimizer_dir, fmt) in entries.items():
            model, optimizer = _build(label, seed=1)
            model_sd = model.module.sharded_state_dict()
            loaded = dist_checkpointing.load({"model": model_sd}, model_dir)
            model.module.load_state_dict(loaded["model"])
            try:
                load_converted(model, optimizer, optimizer_dir, fmt)
            except Exception as error:  # reported to the tests, which decide
                out[key] = {"error": f"{type(error).__name__}: {error}"}
                continue
            space = model_space_state(model, optimizer)
            train(model, optimizer, range(SAVE_AT, SAVE_AT + MORE), rank)
            out[key] = {"space": space, "snapshot": snapshot(model, optimizer)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from wrapped_optim.checkpoint import convert

    root = tmp_path_factory.mktemp("convert_buckets")
    launch = Launcher(root, cuda_shim=False, timeout_s=600)
    ckpt = root / "ckpt"
    saved = launch(_save, 2, str(ckpt))
    entries: dict[str, tuple[str, str, str, str]] = {}
    for label in CONFIGS:
        model_dir = str(ckpt / label / "dp_reshardable" / "dist")
        dcp = root / label / "dcp"
        convert(model_dir, dcp, to="dcp", model=_meta_model(label), verify=True)
        for target, dp in TARGETS.items():
            fmt = target.partition("@")[0]
            written = root / label / target
            report = convert(
                dcp,
                written,
                to=f"megatron-{fmt.replace('_', '-')}",
                model=_meta_model(label),
                dp=dp,
                bucket_size=BUCKET_SIZE,
                verify=True,
            )
            assert report.lossy == {} and report.verified
            entries[f"{label}>{target}"] = (label, model_dir, str(written), fmt)
    return {
        "root": root,
        "ckpt": ckpt,
        "saved": saved,
        "dp2": launch(_resume, 2, entries),
        "dp1": [run_in_this_process(_resume, root, entries)],
    }


def _source(runs: dict[str, Any], label: str) -> dict[str, torch.Tensor]:
    return whole_model_space([rank[label]["space"] for rank in runs["saved"]])


def _src(runs: dict[str, Any], label: str, fmt: str) -> Path:
    path = runs["ckpt"] / label / fmt
    return path / "dist" if fmt == "dp_reshardable" else path


@pytest.mark.parametrize("label", CONFIGS)
def test_the_runs_have_several_buckets_and_buffers(runs: dict[str, Any], label: str) -> None:
    for rank in runs["saved"]:
        assert rank[label]["buckets"] == BUCKETS[label]


def _fp32_model() -> torch.nn.Module:
    """The consumer of the portable form: the same names and shapes, FP32."""
    model = torch.nn.Sequential()
    model.add_module("first", torch.nn.Linear(HIDDEN, HIDDEN))
    model.add_module("second", torch.nn.Linear(HIDDEN, 4))
    return model


def _grouped(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Megatron's standard groups: weight decay on matrices, off on biases."""
    named = dict(model.named_parameters())
    weights = [named["first.weight"], named["second.weight"]]
    return [{"params": weights}, {"params": [named["first.bias"], named["second.bias"]]}]


def _adamw_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    got = {}
    for name, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            got[f"module.{name}/{key}"] = optimizer.state[param][key].reshape(-1)
    return got


@pytest.mark.parametrize("to", ["dcp", "torch-save"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("label", CONFIGS)
def test_megatrons_bucket_space_loads_into_torch_adamw_bitwise(
    runs: dict[str, Any], label: str, fmt: str, to: str, tmp_path: Path
) -> None:
    """Megatron's dp_reshardable / legacy save (several buckets, several buffers) -> DCP or
    torch.save -> a real torch AdamW: every moment and step is the live optimizer's."""
    from wrapped_optim.checkpoint import ConversionError, convert

    src, out = _src(runs, label, fmt), tmp_path / "out"
    # An index-keyed destination numbers the parameters in the optimizer's order (group by
    # group); the buckets place them in the model's: a (model, optimizer) pair gives both.
    meta = _meta_model(label)
    named: Any = meta if to == "dcp" else (meta, torch.optim.AdamW(_grouped(meta)))
    if fmt == "legacy":  # the file records only each buffer's total: the layout needs the size
        with pytest.raises(ConversionError, match="bucket_size=None"):
            convert(src, tmp_path / "no_size", to=to, model=named)
        assert not (tmp_path / "no_size").exists()
    report = convert(src, out, to=to, model=named, bucket_size=BUCKET_SIZE, verify=True)
    assert report.lossy == {} and report.verified
    model = _fp32_model()
    if to == "dcp":
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        load_dcp_into(model, optimizer, out)
    else:
        optimizer = torch.optim.AdamW(_grouped(model), lr=0.01)
        optimizer.load_state_dict(torch.load(out, weights_only=True))
    source = _source(runs, label)
    want = {k: v.reshape(-1) for k, v in source.items() if not k.endswith("/param")}
    assert mismatches(want, _adamw_state(model, optimizer)) == []


@pytest.mark.parametrize("ranks", ["dp1", "dp2"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("label", CONFIGS)
def test_written_bucket_space_resumes_in_real_megatron_bitwise(
    runs: dict[str, Any], label: str, target: str, ranks: str
) -> None:
    """DCP -> dp_reshardable / legacy laid out for the run's buckets, resumed by a real
    DistributedOptimizer at DP 1 and 2: the state after the load is the source's bit for bit;
    at DP 2 the run continues exactly as the uninterrupted one."""
    saved = runs["saved"]
    uninterrupted = [rank[label]["snapshot"] for rank in saved] if ranks == "dp2" else None
    cells = [rank[f"{label}>{target}"] for rank in runs[ranks]]
    assert_resumed_bitwise(_source(runs, label), cells, uninterrupted)


def test_a_wrong_bucket_size_is_refused(runs: dict[str, Any], tmp_path: Path) -> None:
    """The legacy reader checks the size against each buffer's recorded total; a
    dp_reshardable checkpoint records its buckets, and a model laid out otherwise fails."""
    from wrapped_optim.checkpoint import ConversionError, convert

    legacy = _src(runs, "mixed", "legacy")
    with pytest.raises(MegatronFormatError, match="bucket_size=2000"):
        megatron_reader(legacy, model=_meta_model("mixed"), bucket_size=2000)
    with pytest.raises(ConversionError, match="neither dcp nor torch-save"):
        convert(runs["root"] / "mixed" / "dcp", tmp_path / "x", to="torch-save", bucket_size=100)
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------
# FP8 moments (Megatron's precision-aware optimizer, one scale per DP rank's shard) for a run
# with several buckets: the shards are each bucket's DP shares, so the scales follow the
# buckets. A DP 1 save converted for DP 2 with the run's bucket size resumes holding exactly
# the values written; laid out as one bucket, they would split elsewhere.
# --------------------------------------------------------------------------------------
def _fp8_build(seed: int = 0) -> tuple[Any, Any]:
    from tests.megatron_real.precision_aware import build_precision_aware

    ddp = {"overlap_grad_reduce": True, "bucket_size": BUCKET_SIZE}
    model, optimizer = build_precision_aware("fp8_remainders", seed, hidden=HIDDEN, ddp_options=ddp)
    return model, route_optimizer(optimizer, "wrap")


def _fp8_save(rank: int, world: int, root: str) -> list[tuple[str, tuple[int, ...]]]:
    from tests.megatron_real.precision_aware import install_te_stand_in

    install_te_stand_in()
    with megatron_session():
        model, optimizer = _fp8_build()
        train(model, optimizer, range(SAVE_AT), rank)
        save(model, optimizer, Path(root), "fully_reshardable")
        return [(n, tuple(p.shape)) for n, p in model.module.named_parameters()]


def _fp8_resume(rank: int, world: int, model_dir: str, optimizer_dir: str) -> dict[str, Any]:
    from tests.megatron_real.precision_aware import install_te_stand_in

    install_te_stand_in()  # before anything imports megatron.core.optimizer
    from megatron.core import dist_checkpointing

    with megatron_session():
        model, optimizer = _fp8_build(seed=1)
        loaded = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, model_dir)
        model.module.load_state_dict(loaded["model"])
        load_converted(model, optimizer, optimizer_dir, "fully_reshardable")
        buckets = [[b.numel_unpadded for b in buffer.buckets] for buffer in model.buffers]
        return {"space": model_space_state(model, optimizer), "buckets": buckets}


def test_fp8_moments_for_dp2_follow_the_runs_buckets(tmp_path: Path) -> None:
    from wrapped_optim.checkpoint import convert
    from wrapped_optim.checkpoint._convert._megatron import FULLY_RESHARDABLE
    from wrapped_optim.checkpoint._convert._megatron_scales import megatron_fp8_pieces
    from wrapped_optim.checkpoint._convert._names import ParameterNames
    from wrapped_optim.checkpoint._convert._options import FormatOptions

    launch = Launcher(tmp_path, cuda_shim=False, timeout_s=600)
    params = launch(_fp8_save, 1, str(tmp_path / "dp1"))[0]
    names = ParameterNames([n for n, _ in params], [s for _, s in params])
    written = tmp_path / "to2"
    report = convert(
        tmp_path / "dp1" / "dist",
        written,
        to=FULLY_RESHARDABLE,
        moments="fp8",
        dp=2,
        bucket_size=BUCKET_SIZE,
        names=names,
        allow_lossy=True,
    )
    resumed = launch(_fp8_resume, 2, str(tmp_path / "dp1" / "dist"), str(written))
    assert [rank["buckets"] for rank in resumed] == [[[196, 1153]]] * 2  # bf16: one buffer
    loaded = whole_model_space([rank["space"] for rank in resumed])
    reader = megatron_reader(written)
    try:
        index = reader.index()
        for param in index.params:
            for key in ("exp_avg", "exp_avg_sq"):
                values = reader.read(param.name, key).reshape(-1)
                got = loaded[f"module.{param.name}/{key}"]
                assert mismatches({"v": values}, {"v": got}) == [], (param.name, key)
                assert f"{param.name}:{key}" in report.lossy
        options = FormatOptions(names=names.names, shapes=names.shapes, dp_size=2)
        by_buckets = megatron_fp8_pieces(index, attrs.evolve(options, bucket_size=BUCKET_SIZE))
        assert by_buckets["first.weight"] == ((0, 576), (576, 1089))
        assert megatron_fp8_pieces(index, options)["first.weight"] != by_buckets["first.weight"]
    finally:
        reader.close()
