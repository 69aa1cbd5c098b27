"""HybridOffloadOptimizer with precision-aware sub-optimizers (PrecisionAwareAdamW with bf16,
fp16 or FP8 moments): FusedAdam's portable checkpoint format, bit-identical resumes (bare,
through HybridSyncOptimizer, through the wrap() stack with staging), staging of the
sub-optimizers' compressed state chunk by chunk, model-only loads and rejected checkpoints,
on real training of a small bf16 transformer."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.doubles.distributed import ddp_config, megatron_config
from tests.doubles.te_fused_adam import te_fp16_bug
from wrapped_optim import HybridSyncOptimizer, StagedCheckpointOptimizer
from wrapped_optim._adapters.precision import is_precision_aware_holder
from wrapped_optim._demo_model import TinyGPT, batch_for_step, lm_loss
from wrapped_optim._staging.engine import staging_decisions
from wrapped_optim.hybrid import StaleMasterError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.stack import wrap
from wrapped_optim.testing.probe import DeviceMemoryProbe, count_unstaged_expansions

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.uint8
FRACTIONS = (0.0, 0.5, 1.0)
CHUNK_BYTES = 256  # 64 FP32 elements: most states take several chunks


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(vocab=32, width=16, depth=1, heads=2, context=8).to(BF16)


def batch(step: int) -> torch.Tensor:
    return batch_for_step(step, batch=8, context=8, vocab=32)


def hybrid(
    model: torch.nn.Module,
    fraction: float = 0.5,
    *,
    lr: float = 1e-2,
    exp_avg_dtype: torch.dtype = BF16,
    exp_avg_sq_dtype: torch.dtype = BF16,
    cls: type = PrecisionAwareAdamW,
    atomic_step: bool = False,
) -> HybridOffloadOptimizer:
    return HybridOffloadOptimizer(
        model.parameters(),
        atomic_step=atomic_step,
        offload_fraction=fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        lr=lr,
        weight_decay=0.01,
        exp_avg_dtype=exp_avg_dtype,
        exp_avg_sq_dtype=exp_avg_sq_dtype,
    )


def train(model: torch.nn.Module, opt: Any, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad()
        loss = lm_loss(model, batch(step))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    if x.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return torch.equal(x.contiguous().view(as_int), y.contiguous().view(as_int))
    return torch.equal(x, y)


def assert_same_tensors(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert same_bits(x, y)


def assert_same_state_dict(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys(), index
        for name, value in entry.items():
            assert same_bits(value, b["state"][index][name]), (index, name)


def raw_snapshot(opt: HybridOffloadOptimizer) -> list[Any]:
    """Everything a load could change: groups, copies, every sub-optimizer's raw storage."""
    snap: list[Any] = [copy.deepcopy([{**g, "params": None} for g in opt.param_groups])]
    snap += [inner.detach().clone() for inner in opt.param_to_inner_param.values()]
    for sub in opt.sub_optimizers:
        snap.append(copy.deepcopy([{**g, "params": None} for g in sub.param_groups]))
        for group in sub.param_groups:
            for inner in group["params"]:
                snap += [v.clone() for v in sub.state.get(inner, {}).values()]
                snap += [s.clone() for s in sub._scales.get(inner, {}).values()]
    return snap


def assert_same_snapshot(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor):
            assert same_bits(x, y)
        else:
            assert x == y


# ------------------------------------------------------------------------------------------
# The checkpoint format
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_state_dict_is_what_a_bare_precision_aware_adamw_over_fp32_masters_saves(fraction):
    model = make_model(0)
    opt = hybrid(model, fraction)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    bare = PrecisionAwareAdamW(
        masters, lr=1e-2, weight_decay=0.01, exp_avg_dtype=BF16, exp_avg_sq_dtype=BF16
    )
    for step in range(3):
        opt.zero_grad()
        lm_loss(model, batch(step)).backward()
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad = p.grad.float()  # exactly the gradient the hybrid's copy receives
        bare.step()
        opt.step()
    assert {type(sub) for sub in opt.sub_optimizers} == {PrecisionAwareAdamW}
    saved, reference = opt.state_dict(), bare.state_dict()
    assert saved["param_groups"][0]["step"] == reference["param_groups"][0]["step"] == 3
    assert saved["state"].keys() == reference["state"].keys() == set(range(len(masters)))
    for index, master in enumerate(masters):
        entry, expected = saved["state"][index], reference["state"][index]
        assert (
            set(entry) == {*expected, "master_param"} == {"exp_avg", "exp_avg_sq", "master_param"}
        )
        for name in ("exp_avg", "exp_avg_sq"):
            assert entry[name].dtype == torch.float32
            assert torch.equal(entry[name], expected[name]), (index, name)
        assert entry["master_param"].dtype == torch.float32
        assert torch.equal(entry["master_param"], master.detach())
    # The live storage stays compressed; the exposed state shows it (a view, no master inside).
    for sub in opt.sub_optimizers:
        for inner, stored in sub.state.items():
            assert set(stored) == {"exp_avg", "exp_avg_sq"}
            assert stored["exp_avg"].dtype == BF16
            param = opt.inner_param_to_orig_param[inner]
            assert opt.state[param]["exp_avg"] is stored["exp_avg"]
            assert opt.state[param]["master_param"] is inner


def test_state_dict_reads_through_instance_level_patches_and_runs_hooks():
    model = make_model(0)
    opt = hybrid(model, 0.5)
    train(model, opt, 1)
    seen: list[str] = []
    for sub in opt.sub_optimizers:
        original = sub.get_unscaled_state

        def reading(param, name, _original=original):
            seen.append(name)
            return _original(param, name)

        sub.get_unscaled_state = reading
    opt.register_state_dict_pre_hook(lambda o: seen.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tagged": True})
    saved = opt.state_dict()
    assert saved["tagged"] is True
    n_params = len(list(model.parameters()))
    assert seen[0] == "pre" and seen[1:].count("exp_avg") == n_params


# ------------------------------------------------------------------------------------------
# Save -> load -> continue, bit-identical
# ------------------------------------------------------------------------------------------
def build(model: torch.nn.Module, fraction: float, kind: str, **options: Any) -> Any:
    inner = hybrid(model, fraction, **options)
    if kind == "plain":
        return inner
    if kind == "sync":
        return HybridSyncOptimizer(inner)
    if kind == "staged_outer":  # the literal order, outside wrap()'s canonical one
        return StagedCheckpointOptimizer(HybridSyncOptimizer(inner), chunk_bytes=CHUNK_BYTES)
    stack = wrap(inner, {"staged": {"chunk_bytes": CHUNK_BYTES}})
    assert [type(layer) for layer in stack.layers()] == [
        HybridSyncOptimizer,
        StagedCheckpointOptimizer,
        HybridOffloadOptimizer,
    ]
    return stack


@pytest.mark.parametrize("kind", ["plain", "sync", "wrap", "staged_outer"])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_resume_is_bit_identical_to_uninterrupted_training(fraction, kind):
    model = make_model(0)
    opt = build(model, fraction, kind)
    train(model, opt, 3)
    payload = copy.deepcopy(opt.state_dict())
    pristine = copy.deepcopy(payload)
    model_payload = copy.deepcopy(model.state_dict())
    losses = train(model, opt, 3, start=3)

    resumed_model = make_model(1)  # other weights and state until the checkpoint arrives
    resumed = build(resumed_model, fraction, kind)
    train(resumed_model, resumed, 1, start=50)
    resumed_model.load_state_dict(model_payload)
    resumed.load_state_dict(payload)
    if kind in ("wrap", "staged_outer"):
        stats = resumed.find_layer(StagedCheckpointOptimizer).last_stats
        assert stats.staged_holders == len(resumed.sub_optimizers)
        assert stats.chunked_writes == 2 * len(payload["state"])  # both moments, chunked
    assert train(resumed_model, resumed, 3, start=3) == losses
    assert_same_tensors(weights(resumed_model), weights(model))
    assert_same_state_dict(resumed.state_dict(), opt.state_dict())
    assert_same_state_dict(payload, pristine)  # the caller's tensors were never modified


def test_full_resume_keeps_the_masters_low_bits():
    model = make_model(0)
    opt = HybridSyncOptimizer(hybrid(model, 0.5))
    train(model, opt, 3)
    payload = copy.deepcopy(opt.state_dict())
    masters = [payload["state"][i]["master_param"] for i in range(len(payload["state"]))]
    assert any(not torch.equal(m, m.to(BF16).float()) for m in masters)
    resumed_model = make_model(1)
    resumed = HybridSyncOptimizer(hybrid(resumed_model, 0.5))
    resumed.load_state_dict(payload)  # full-state sync writes the model from the masters
    inner = resumed.inner
    for master, param in zip(masters, resumed_model.parameters(), strict=True):
        assert torch.equal(inner.param_to_inner_param[param], master)
        assert torch.equal(param.detach(), master.to(BF16))
    assert resumed.stale_masters() == []
    for sub in inner.sub_optimizers:  # the full-state sync did not re-link a view into them
        assert all(set(stored) == {"exp_avg", "exp_avg_sq"} for stored in sub.state.values())


def test_step_counter_survives_the_round_trip():
    model = make_model(0)
    opt = hybrid(model, 0.5)
    train(model, opt, 4)
    assert opt.param_groups[0]["step"] == 4
    assert [g["step"] for sub in opt.sub_optimizers for g in sub.param_groups] == [4, 4]
    twin_model = make_model(0)
    twin = hybrid(twin_model, 0.5)
    twin.load_state_dict(opt.state_dict())
    assert [g["step"] for sub in twin.sub_optimizers for g in sub.param_groups] == [4, 4]
    # a checkpoint taken before any step restarts the count, as a fresh holder would
    fresh = hybrid(make_model(0), 0.5).state_dict()
    twin.load_state_dict(fresh)
    assert "step" not in twin.param_groups[0]
    assert all("step" not in g for sub in twin.sub_optimizers for g in sub.param_groups)
    assert all(not sub.state for sub in twin.sub_optimizers)


def test_torch_layout_step_per_param_becomes_the_group_step():
    """restore_omitted_state (HybridSyncOptimizer) adds a per-param step; older payloads may
    carry only per-param steps: both end up as the holder's group step."""
    model = make_model(0)
    opt = hybrid(model, 0.5)
    train(model, opt, 2)
    payload = copy.deepcopy(opt.state_dict())
    del payload["param_groups"][0]["step"]
    for entry in payload["state"].values():
        entry["step"] = torch.tensor(2.0)
    twin = hybrid(make_model(0), 0.5)
    twin.load_state_dict(payload)
    assert twin.param_groups[0]["step"] == 2
    assert [g["step"] for sub in twin.sub_optimizers for g in sub.param_groups] == [2, 2]


def test_non_chunked_holders_never_modify_the_callers_tensors():
    """A TE-style holder (no chunk API, scales its fp16 input in place) gets private copies."""
    te_like = te_fp16_bug(PrecisionAwareAdamW)
    model = make_model(0)
    opt = hybrid(model, 0.5, exp_avg_sq_dtype=FP16, cls=te_like)
    train(model, opt, 2)
    payload = copy.deepcopy(opt.state_dict())
    pristine = copy.deepcopy(payload)
    twin_model = make_model(0)
    twin_model.load_state_dict(model.state_dict())
    twin = hybrid(twin_model, 0.5, exp_avg_sq_dtype=FP16, cls=te_like)
    twin.load_state_dict(payload)
    assert_same_state_dict(payload, pristine)
    assert train(twin_model, twin, 2, start=2) == train(model, opt, 2, start=2)


def plain_adamw(groups: list[dict[str, Any]], **options: Any) -> torch.optim.AdamW:
    """torch's AdamW, ignoring the constructor-only options meant for the other side."""
    return torch.optim.AdamW(groups, lr=options["lr"], weight_decay=options["weight_decay"])


def test_mixed_plain_host_and_precision_aware_device_round_trip():
    def build_mixed(model: torch.nn.Module) -> HybridOffloadOptimizer:
        return HybridOffloadOptimizer(
            model.parameters(),
            offload_fraction=0.5,
            cpu_optimizer_cls=plain_adamw,
            gpu_optimizer_cls=PrecisionAwareAdamW,
            lr=1e-2,
            weight_decay=0.01,
            exp_avg_dtype=FP8,
            exp_avg_sq_dtype=BF16,
        )

    model = make_model(0)
    opt = build_mixed(model)
    train(model, opt, 2)
    payload = copy.deepcopy(opt.state_dict())
    host_params = set(opt.gpu_params_map_cpu_copy)
    for index, param in enumerate(model.parameters()):
        entry = payload["state"][index]
        if param in host_params:  # torch's layout: raw FP32 moments and a per-param step
            assert set(entry) == {"exp_avg", "exp_avg_sq", "master_param", "step"}
        else:  # FusedAdam's: FP32 expansions of FP8/bf16 storage, the step in the group
            assert set(entry) == {"exp_avg", "exp_avg_sq", "master_param"}
            assert entry["exp_avg"].dtype == torch.float32
    assert payload["param_groups"][0]["step"] == 2
    twin_model = make_model(1)
    twin_model.load_state_dict(model.state_dict())
    twin = build_mixed(twin_model)
    twin.load_state_dict(payload)
    assert train(twin_model, twin, 2, start=2) == train(model, opt, 2, start=2)
    assert_same_tensors(weights(twin_model), weights(model))
    assert_same_state_dict(twin.state_dict(), opt.state_dict())


# ------------------------------------------------------------------------------------------
# Staging the sub-optimizers' state
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_staged_state_dict_equals_the_unstaged_one_and_reads_chunk_by_chunk(fraction):
    model = make_model(0)
    opt = hybrid(model, fraction)
    train(model, opt, 2)
    subs = opt.sub_optimizers
    decisions = staging_decisions(opt)
    assert [(d.optimizer, d.eligible, d.chunked) for d in decisions] == [
        (opt, False, False),
        *[(sub, True, True) for sub in subs],
    ]
    with DeviceMemoryProbe() as baseline, count_unstaged_expansions(opt):
        unstaged = opt.state_dict()
    staged_opt = StagedCheckpointOptimizer(opt, chunk_bytes=CHUNK_BYTES)
    with DeviceMemoryProbe() as probe:
        staged = staged_opt.state_dict()
    assert_same_state_dict(staged, unstaged)
    stats = staged_opt.last_stats
    n_states = 2 * len(unstaged["state"])
    assert stats.staged_holders == len(subs)
    assert stats.chunked_reads == n_states and stats.whole_tensor_reads == 0
    expansion_bytes = sum(
        entry[name].numel() * 4
        for entry in unstaged["state"].values()
        for name in ("exp_avg", "exp_avg_sq")
    )
    assert baseline.peak_extra_bytes >= expansion_bytes  # the bare call keeps all of them
    # staged: at most one chunk (host-resident state needs no scratch at all)
    assert 0 <= probe.peak_extra_bytes <= CHUNK_BYTES
    for sub in subs:
        assert "get_unscaled_state" not in vars(sub)  # every patch removed


def test_megatron_cpu_offload_config_still_disables_staging():
    model = make_model(0)
    opt = hybrid(model, 0.5)
    container = SimpleNamespace(
        optimizer=opt, config=megatron_config(cpu_offload=True), ddp_config=ddp_config()
    )
    decisions = staging_decisions(container)
    assert len(decisions) == 1 + len(opt.sub_optimizers)
    assert all(not d.eligible for d in decisions)
    assert [d.reason for d in decisions[1:]] == ["config.optimizer_cpu_offload is on"] * 2


def test_wrap_derives_staging_for_precision_aware_sub_optimizers():
    precise = wrap(hybrid(make_model(0), 0.5))
    assert [type(layer) for layer in precise.layers()][:2] == [
        HybridSyncOptimizer,
        StagedCheckpointOptimizer,
    ]
    plain_model = make_model(0)
    plain = wrap(HybridOffloadOptimizer(plain_model.parameters(), lr=1e-2))
    assert [type(layer) for layer in plain.layers()] == [
        HybridSyncOptimizer,
        HybridOffloadOptimizer,
    ]


# ------------------------------------------------------------------------------------------
# Model-only load (fine-tuning from weights)
# ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained() -> dict[str, torch.Tensor]:
    model = make_model(0)
    train(model, hybrid(model, lr=3e-2), 120)
    return copy.deepcopy(model.state_dict())


def test_model_only_load_collapses_unwrapped_and_not_wrapped(pretrained):
    model = make_model(1)
    opt = hybrid(model)
    initial = lm_loss(model, batch(1000)).item()
    model.load_state_dict(pretrained)  # behind the optimizer's back
    collapsed = train(model, opt, 2, start=1000)
    assert collapsed[0] < 0.6 * initial  # step 1 looks fine: the loaded weights are good
    assert collapsed[1] > 0.9 * initial  # step 2: the stale copies came back

    reference_model = make_model(2)
    reference_model.load_state_dict(pretrained)
    reference = train(reference_model, hybrid(reference_model), 4, start=1000)

    wrapped_model = make_model(1)
    wrapped = wrap(hybrid(wrapped_model))
    wrapped_model.load_state_dict(pretrained)
    assert train(wrapped_model, wrapped, 4, start=1000) == reference
    assert_same_tensors(weights(wrapped_model), weights(reference_model))


def test_stale_guard_raises_and_reload_model_params_syncs(pretrained):
    model = make_model(1)
    opt = HybridSyncOptimizer(hybrid(model, 0.5), on_stale="raise")
    train(model, opt, 1, start=1000)  # the guard passes on consistent copies (and disarms)
    opt.load_state_dict(opt.state_dict())  # any load re-arms it
    model.load_state_dict(pretrained)  # behind the optimizer's back
    before = raw_snapshot(opt.inner)
    loaded = weights(model)
    opt.zero_grad()
    lm_loss(model, batch(1001)).backward()
    with pytest.raises(StaleMasterError, match="master copies disagree"):
        opt.step()
    assert_same_snapshot(raw_snapshot(opt.inner), before)  # nothing was stepped
    assert_same_tensors(weights(model), loaded)
    opt.reload_model_params()  # model-only sync: every copy takes the weights
    assert opt.stale_masters() == []
    for param, inner in opt.inner.param_to_inner_param.items():
        assert torch.equal(inner, param.detach().float())
    opt.step()
    assert lm_loss(model, batch(1002)).item() < 0.6 * lm_loss(make_model(1), batch(1002)).item()


# ------------------------------------------------------------------------------------------
# Every offload fraction, moment dtypes and step count: the whole grid (108 cases)
# ------------------------------------------------------------------------------------------
MOMENT_DTYPES = [BF16, FP16, FP8]


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("exp_avg_sq_dtype", MOMENT_DTYPES, ids=str)
@pytest.mark.parametrize("exp_avg_dtype", MOMENT_DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.5, 1.0])
def test_property_round_trip_continues_bit_identically(
    fraction, exp_avg_dtype, exp_avg_sq_dtype, steps
):
    options = {"exp_avg_dtype": exp_avg_dtype, "exp_avg_sq_dtype": exp_avg_sq_dtype}
    model = make_model(0)
    opt = hybrid(model, fraction, **options)
    train(model, opt, steps)
    payload = copy.deepcopy(opt.state_dict())
    pristine = copy.deepcopy(payload)
    assert all(
        value.dtype == torch.float32
        for entry in payload["state"].values()
        for value in entry.values()
    )
    assert payload["param_groups"][0]["step"] == steps

    twin_model = make_model(1)
    twin_model.load_state_dict(model.state_dict())
    twin = hybrid(twin_model, fraction, **options)
    twin.load_state_dict(payload)
    assert_same_state_dict(twin.state_dict(), payload)
    assert train(twin_model, twin, 2, start=steps) == train(model, opt, 2, start=steps)
    assert_same_tensors(weights(twin_model), weights(model))
    assert_same_state_dict(twin.state_dict(), opt.state_dict())
    assert_same_state_dict(payload, pristine)


# ------------------------------------------------------------------------------------------
# Rejected checkpoints
# ------------------------------------------------------------------------------------------
def _entry(sd: dict[str, Any], index: int = 1) -> dict[str, Any]:
    return sd["state"][index]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda sd: _entry(sd).__setitem__("exp_avg", torch.zeros(3)), "has shape \\(3,\\)"),
        (lambda sd: _entry(sd).pop("exp_avg_sq"), "missing state 'exp_avg_sq'"),
        (lambda sd: _entry(sd).__setitem__("momentum", torch.zeros(1)), "unknown state"),
        (
            lambda sd: _entry(sd).__setitem__(
                "exp_avg", torch.full_like(_entry(sd)["exp_avg"], float("nan"))
            ),
            "non-finite",
        ),
        (
            lambda sd: _entry(sd).__setitem__(
                "exp_avg", torch.zeros_like(_entry(sd)["exp_avg"], dtype=torch.int32)
            ),
            "not floating",
        ),
        (lambda sd: _entry(sd).__setitem__("step", torch.tensor(7.0)), "disagrees"),
        (lambda sd: sd["param_groups"][0].__setitem__("step", -1), "invalid step"),
        (
            lambda sd: sd["state"].__setitem__(99, {}),
            "param 99: the checkpoint has state",
        ),
    ],
)
@pytest.mark.parametrize("kind", ["plain", "sync"])
def test_rejected_checkpoint_leaves_everything_unchanged(corrupt, message, kind):
    model = make_model(0)
    opt = build(model, 0.5, kind)
    train(model, opt, 2)
    payload = copy.deepcopy(opt.state_dict())
    corrupt(payload)
    pristine = copy.deepcopy(payload)
    inner = opt if kind == "plain" else opt.inner
    before = raw_snapshot(inner)
    model_before = weights(model)
    subs_before = list(inner.sub_optimizers)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(payload)
    assert_same_snapshot(raw_snapshot(inner), before)
    assert_same_tensors(weights(model), model_before)
    assert inner.sub_optimizers == subs_before
    assert all(is_precision_aware_holder(sub) for sub in subs_before)
    assert_same_state_dict(payload, pristine)
    # and the optimizer still trains exactly like one that never saw the bad checkpoint
    twin_model = make_model(0)
    twin = build(twin_model, 0.5, kind)
    train(twin_model, twin, 2)
    assert train(model, opt, 2, start=2) == train(twin_model, twin, 2, start=2)


# ------------------------------------------------------------------------------------------
# Faults inside precision-aware sub-optimizers: loads and steps are undone exactly
# ------------------------------------------------------------------------------------------
class FlakyHolder(PrecisionAwareAdamW):
    """Raises at the n-th ``step`` or ``set_scaled_state`` call from now (a foreign fault)."""

    steps_left: int | None = None
    writes_left: int | None = None

    def step(self, closure: Any = None) -> Any:
        if FlakyHolder.steps_left is not None:
            FlakyHolder.steps_left -= 1
            if FlakyHolder.steps_left < 0:
                FlakyHolder.steps_left = None
                raise RuntimeError("holder step failed")
        return super().step(closure)

    def set_scaled_state(self, param: torch.Tensor, state_name: str, unscaled: Any) -> None:
        if FlakyHolder.writes_left is not None:
            FlakyHolder.writes_left -= 1
            if FlakyHolder.writes_left < 0:
                FlakyHolder.writes_left = None
                raise RuntimeError("holder write failed")
        super().set_scaled_state(param, state_name, unscaled)


def test_a_load_that_fails_inside_a_holder_is_undone():
    source_model = make_model(0)
    source = hybrid(source_model, 0.5, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16)
    train(source_model, source, 3)
    payload = copy.deepcopy(source.state_dict())
    model = make_model(0)
    opt = hybrid(model, 0.5, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16, cls=FlakyHolder)
    train(model, opt, 2)
    before, weights_before = raw_snapshot(opt), weights(model)
    FlakyHolder.writes_left = 5
    with pytest.raises(RuntimeError, match="holder write failed"):
        opt.load_state_dict(payload)
    assert_same_snapshot(before, raw_snapshot(opt))
    assert_same_tensors(weights_before, weights(model))
    opt.load_state_dict(payload)  # the retry loads what a fault-free load does
    twin_model = make_model(0)
    twin = hybrid(twin_model, 0.5, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16)
    train(twin_model, twin, 2)
    twin.load_state_dict(payload)
    assert_same_snapshot(raw_snapshot(twin), raw_snapshot(opt))


def test_a_step_that_fails_in_the_device_holder_undoes_the_host_one():
    model = make_model(0)
    opt = hybrid(
        model, 0.5, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16, cls=FlakyHolder, atomic_step=True
    )
    twin_model = make_model(0)
    twin = hybrid(twin_model, 0.5, exp_avg_dtype=FP8, exp_avg_sq_dtype=FP16)
    assert train(model, opt, 2) == train(twin_model, twin, 2)
    before, weights_before = raw_snapshot(opt), weights(model)
    opt.zero_grad()
    lm_loss(model, batch(2)).backward()
    FlakyHolder.steps_left = 1  # the host holder steps, the device one raises
    with pytest.raises(RuntimeError, match="holder step failed"):
        opt.step()
    assert_same_snapshot(before, raw_snapshot(opt))
    assert_same_tensors(weights_before, weights(model))
    opt.step()  # the retry is the interrupted step
    twin.zero_grad()
    lm_loss(twin_model, batch(2)).backward()
    twin.step()
    assert_same_snapshot(raw_snapshot(twin), raw_snapshot(opt))
    assert_same_tensors(weights(twin_model), weights(model))
