"""HybridSyncOptimizer: model-only loads, full resumes and the stale-master guard, on real
training of a small bf16 model; the portable hybrid optimizer inside the DistributedOptimizer
double and megatron-core's real ChainedOptimizer; Megatron's real HybridDeviceOptimizer class
where it runs on CPU (the real stacks: tests/megatron_real)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import wrapped_optim.hybrid as hybrid_module
from tests.doubles.distributed import DistributedOptimizerDouble
from tests.param_builders import random_groups
from wrapped_optim import OptimizerWrapper
from wrapped_optim._adapters.hybrid import (
    find_hybrid_offload,
    hybrid_master_copies,
    is_hybrid_offload,
    restore_omitted_state,
)
from wrapped_optim.hybrid import HybridSyncOptimizer, StaleMasterError
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW

BF16 = torch.bfloat16
_gen = torch.Generator().manual_seed(1234)
X = torch.randn(64, 8, generator=_gen)
Y = torch.sin(X @ torch.randn(8, 1, generator=_gen))
X, Y = X.to(BF16), Y.to(BF16)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(
        BF16
    )


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return ((model(X).float() - Y.float()) ** 2).mean()


def train(model, opt, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def hybrid(model, fraction=0.5, lr=3e-3):
    return HybridOffloadOptimizer(model.parameters(), offload_fraction=fraction, lr=lr)


@pytest.fixture(scope="module")
def pretrained() -> dict[str, torch.Tensor]:
    model = make_model(0)
    train(model, hybrid(model, lr=2e-2), 150)
    return copy.deepcopy(model.state_dict())


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert torch.equal(x, y)


# ------------------------------------------------------------------------------------------
# Model-only load (fine-tuning from weights)
# ------------------------------------------------------------------------------------------
def reference_finetune(pretrained, steps, fraction=0.5):
    """The optimizer built after the weights were loaded: training as if in place."""
    model = make_model(1)
    model.load_state_dict(pretrained)
    return train(model, hybrid(model, fraction), steps), weights(model)


def test_unwrapped_collapses_after_model_only_load(pretrained):
    model = make_model(1)
    opt = hybrid(model)
    initial_loss = loss_of(model).item()
    model.load_state_dict(pretrained)  # behind the optimizer's back
    losses = train(model, opt, 2)
    assert losses[0] < initial_loss / 5  # step 1 looks fine: the loaded weights are good
    assert losses[1] > 5 * losses[0]  # step 2: the stale host/FP32 copies came back
    assert losses[1] > initial_loss / 2


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_wrapped_continues_as_if_trained_in_place(pretrained, fraction):
    model = make_model(1)
    opt = HybridSyncOptimizer(hybrid(model, fraction))
    model.load_state_dict(pretrained)
    losses = train(model, opt, 4)
    ref_losses, ref_weights = reference_finetune(pretrained, 4, fraction)
    assert losses == ref_losses
    assert_same(weights(model), ref_weights)


def test_reload_model_params_is_the_explicit_model_only_sync(pretrained):
    model = make_model(1)
    opt = HybridSyncOptimizer(hybrid(model), on_stale="raise")
    model.load_state_dict(pretrained)
    opt.reload_model_params()
    assert not opt.guard_armed
    assert opt.stale_masters() == []
    ref_losses, ref_weights = reference_finetune(pretrained, 3)
    assert train(model, opt, 3) == ref_losses
    assert_same(weights(model), ref_weights)
    with pytest.raises(ValueError, match="Megatron optimizer"):
        opt.reload_model_params(pretrained)


def test_on_stale_raise_really_raises_and_steps_nothing(pretrained):
    model = make_model(1)
    inner = hybrid(model)
    opt = HybridSyncOptimizer(inner, on_stale="raise")
    model.load_state_dict(pretrained)
    before = weights(model)
    copies_before = [t.clone() for t in inner.param_to_inner_param.values()]
    opt.zero_grad()
    loss_of(model).backward()
    with pytest.raises(StaleMasterError, match="4 master copies disagree"):
        opt.step()
    assert_same(weights(model), before)
    assert_same(list(inner.param_to_inner_param.values()), copies_before)
    assert len(inner.state) == 0
    assert opt.guard_armed  # still armed: the next step checks again
    with pytest.raises(StaleMasterError):
        opt.step()


def test_on_stale_ignore_behaves_like_the_bare_optimizer(pretrained):
    runs = []
    for wrap in (False, True):
        model = make_model(1)
        opt = hybrid(model)
        if wrap:
            opt = HybridSyncOptimizer(opt, on_stale="ignore")
        model.load_state_dict(pretrained)
        runs.append(train(model, opt, 2))
    assert runs[0] == runs[1]


def test_guard_runs_once_after_construction_and_after_each_load(monkeypatch, pretrained):
    calls = []
    original = hybrid_module.hybrid_master_copies

    def counting(stack):
        calls.append(1)
        return original(stack)

    monkeypatch.setattr(hybrid_module, "hybrid_master_copies", counting)
    model = make_model(1)
    opt = HybridSyncOptimizer(hybrid(model))
    train(model, opt, 5)
    assert len(calls) == 1
    opt.load_state_dict(opt.state_dict())
    calls.clear()
    train(model, opt, 3)
    assert len(calls) == 1  # the guard ran once after the load


def test_guard_refreshes_only_stale_entries():
    model = make_model(2)
    inner = hybrid(model, fraction=1.0)
    opt = HybridSyncOptimizer(inner)
    train(model, opt, 3)
    fc2 = model[2].weight
    kept = {p: inner.param_to_inner_param[p].clone() for p in model.parameters() if p is not fc2}
    with torch.no_grad():
        fc2.add_(1.0)
    opt._guard_armed = True  # as after a load
    stale = opt.check_masters()
    assert [entry.weight is fc2 for entry in stale] == [True]
    assert torch.equal(inner.param_to_inner_param[fc2], fc2.detach().float())
    for p, master in kept.items():  # untouched masters keep their low bits
        assert torch.equal(inner.param_to_inner_param[p], master)


# ------------------------------------------------------------------------------------------
# Full resume
# ------------------------------------------------------------------------------------------
def megatron_style(payload):
    """What Megatron-style payloads carry: the step per group, the FP32 param as fp32_param."""
    payload = copy.deepcopy(payload)
    steps = set()
    for entry in payload["state"].values():
        steps.add(entry.pop("step").item())
        entry["fp32_param"] = entry.pop("master_param")
    (step,) = steps
    for group in payload["param_groups"]:
        group["step"] = int(step)
    return payload


def interrupted_run(fraction, to_payload, wrap=True, first=3, second=3):
    model = make_model(0)
    opt = HybridSyncOptimizer(hybrid(model, fraction)) if wrap else hybrid(model, fraction)
    train(model, opt, first)
    model_sd = copy.deepcopy(model.state_dict())
    payload = to_payload(opt.state_dict())
    resumed = make_model(7)  # different initial weights and copies
    opt2 = hybrid(resumed, fraction)
    if wrap:
        opt2 = HybridSyncOptimizer(opt2, on_stale="raise")
    resumed.load_state_dict(model_sd)
    opt2.load_state_dict(payload)
    return resumed, opt2, train(resumed, opt2, second)


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("style", ["torch", "megatron"])
def test_full_resume_is_bit_identical_and_keeps_low_bits(fraction, style):
    model = make_model(0)
    opt = hybrid(model, fraction)
    uninterrupted = train(model, opt, 6)
    to_payload = megatron_style if style == "megatron" else copy.deepcopy
    resumed, opt2, losses = interrupted_run(fraction, to_payload)
    assert losses == uninterrupted[3:]
    assert_same(weights(resumed), weights(model))
    inner = opt2.unwrap()
    masters = [inner.state[p]["master_param"] for p in resumed.parameters()]
    assert_same(masters, [opt.state[p]["master_param"] for p in model.parameters()])
    # the masters carry bits the bf16 weights cannot hold
    assert any(
        not torch.equal(m, p.detach().float())
        for m, p in zip(masters, resumed.parameters(), strict=True)
    )


def test_unwrapped_megatron_style_payload_fails_without_restoration():
    # Rejected by the load itself (no per-param step, an fp32_param it does not know).
    with pytest.raises(ValueError, match="step"):
        interrupted_run(0.5, megatron_style, wrap=False)


def test_payload_without_masters_loses_low_bits_and_diverges():
    """The failure a rebuild from bf16 weights causes: why masters must come from the payload."""

    def drop_masters(sd):
        sd = copy.deepcopy(sd)
        for entry in sd["state"].values():
            del entry["master_param"]
        return sd

    model = make_model(0)
    uninterrupted = train(model, hybrid(model), 6)
    resumed, _, losses = interrupted_run(0.5, drop_masters)
    assert losses[0] == uninterrupted[3]
    assert not all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(model), strict=True))


def test_rejected_checkpoint_leaves_everything_as_it_was():
    model = make_model(0)
    inner = hybrid(model)
    opt = HybridSyncOptimizer(inner)
    train(model, opt, 2)
    payload = megatron_style(opt.state_dict())
    payload["state"][3]["fp32_param"] = torch.zeros(5)
    pristine = copy.deepcopy(payload)
    state_before = copy.deepcopy(opt.state_dict())
    weights_before = weights(model)
    copies_before = [t.clone() for t in inner.param_to_inner_param.values()]
    with pytest.raises(ValueError, match="param 3: state 'master_param' has shape"):
        opt.load_state_dict(payload)
    assert_same(weights(model), weights_before)
    assert_same(list(inner.param_to_inner_param.values()), copies_before)
    after = opt.state_dict()
    for key, entry in state_before["state"].items():
        for name, value in entry.items():
            assert torch.equal(after["state"][key][name], value)
    for key, entry in payload["state"].items():  # the caller's tensors are untouched
        for name, value in entry.items():
            assert torch.equal(value, pristine["state"][key][name])
    assert not opt.guard_armed


def test_restore_omitted_state_never_modifies_the_callers_dict():
    entry = {"exp_avg": torch.zeros(2), "fp32_param": torch.ones(2)}
    sd = {"state": {0: entry}, "param_groups": [{"params": [0], "step": 4}]}
    fixed = restore_omitted_state(sd)
    assert fixed["state"][0]["master_param"] is entry["fp32_param"]
    assert fixed["state"][0]["step"].item() == 4.0
    assert sorted(entry) == ["exp_avg", "fp32_param"]
    assert restore_omitted_state([sd]) == [sd]


def test_group_step_optimizers_get_no_per_param_step():
    from wrapped_optim._adapters.hybrid import keeps_per_param_step

    sd = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0], "step": 4}]}
    assert "step" not in restore_omitted_state(sd, per_param_step=False)["state"][0]
    param = torch.nn.Parameter(torch.ones(2))
    adamw = torch.optim.AdamW([param])
    holder = PrecisionAwareAdamW([param])
    assert keeps_per_param_step(adamw) and keeps_per_param_step(hybrid(make_model(0)))
    assert not keeps_per_param_step(OptimizerWrapper(holder))
    param.grad = torch.ones(2)
    holder.step()
    assert not keeps_per_param_step(holder)  # its state has no per-param step either


def test_wrapper_is_transparent_and_findable():
    model = make_model(0)
    inner = hybrid(model)
    opt = HybridSyncOptimizer(OptimizerWrapper(inner))
    train(model, opt, 2)
    ours, bare = opt.state_dict(), inner.state_dict()
    assert ours["param_groups"] == bare["param_groups"]
    for key, entry in bare["state"].items():
        assert entry.keys() == ours["state"][key].keys()
        assert all(torch.equal(v, ours["state"][key][k]) for k, v in entry.items())
    assert find_hybrid_offload(opt) == [inner] == opt.hybrid_optimizers
    assert is_hybrid_offload(inner) and not is_hybrid_offload(
        torch.optim.SGD([torch.ones(1)], lr=1)
    )
    for plain in (
        torch.optim.SGD(model.parameters(), lr=0.1),
        OptimizerWrapper(PrecisionAwareAdamW(model.parameters())),
    ):
        with pytest.raises(ValueError, match=r"this stack has none .* drop the layer"):
            HybridSyncOptimizer(plain)
    with pytest.raises(ValueError, match="on_stale"):
        HybridSyncOptimizer(inner, on_stale="sometimes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# Property: offload fractions, param dtypes and group layouts
# ------------------------------------------------------------------------------------------
DTYPES = (torch.float32, BF16, torch.float16)


def params_of(groups):
    return [p for g in groups for p in g["params"]]


def run_steps(opt, params, steps, offset=0):
    for step in range(offset, offset + steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


@given(
    layout=st.lists(
        st.lists(st.sampled_from([(3,), (2, 4), (5,)]), min_size=1, max_size=3),
        min_size=1,
        max_size=3,
    ),
    fraction=st.sampled_from([0.0, 0.4, 1.0]),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3),
)
def test_property_model_only_and_full_resume(layout, fraction, dtypes):
    # Model-only: weights replaced behind the optimizer; the guard makes it equal to an
    # optimizer built on the new weights.
    groups = random_groups(layout, dtypes, seed=0)
    opt = HybridSyncOptimizer(HybridOffloadOptimizer(groups, offload_fraction=fraction))
    new_values = [p.detach().clone() for p in params_of(random_groups(layout, dtypes, seed=1))]
    with torch.no_grad():
        for p, v in zip(params_of(groups), new_values, strict=True):
            p.copy_(v)
    ref_groups = random_groups(layout, dtypes, seed=1)
    ref = HybridOffloadOptimizer(ref_groups, offload_fraction=fraction)
    run_steps(opt, params_of(groups), 2)
    run_steps(ref, params_of(ref_groups), 2)
    assert_same(params_of(groups), params_of(ref_groups))

    # Full resume from a Megatron-style payload into fresh weights: bit-identical.
    payload = megatron_style(opt.state_dict())
    twin_groups = random_groups(layout, dtypes, seed=2)
    twin = HybridSyncOptimizer(
        HybridOffloadOptimizer(twin_groups, offload_fraction=fraction), on_stale="raise"
    )
    twin.load_state_dict(payload)
    run_steps(opt, params_of(groups), 2, offset=2)
    run_steps(twin, params_of(twin_groups), 2, offset=2)
    assert_same(params_of(groups), params_of(twin_groups))
    inner, twin_inner = opt.unwrap(), twin.unwrap()
    assert_same(
        [inner.state[p]["master_param"] for p in params_of(groups)],
        [twin_inner.state[p]["master_param"] for p in params_of(twin_groups)],
    )


# ------------------------------------------------------------------------------------------
# The DistributedOptimizer double (portable hybrid optimizer inside), the real
# ChainedOptimizer and the real HybridDeviceOptimizer class
# ------------------------------------------------------------------------------------------
def distributed(model, precision_aware, fraction=0.5):
    return DistributedOptimizerDouble.of_model(
        model,
        lambda groups: HybridOffloadOptimizer(groups, offload_fraction=fraction, lr=3e-3),
        precision_aware,
    )


@pytest.mark.parametrize("precision_aware", [True, False])
def test_double_trains_like_the_plain_hybrid_optimizer(precision_aware):
    model, ref = make_model(0), make_model(0)
    losses = train(model, HybridSyncOptimizer(distributed(model, precision_aware)), 4)
    assert losses == train(ref, hybrid(ref), 4)
    assert_same(weights(model), weights(ref))


@pytest.mark.parametrize("precision_aware", [True, False])
def test_model_only_sync_reaches_every_level(pretrained, precision_aware):
    model = make_model(1)
    dist = distributed(model, precision_aware)
    opt = HybridSyncOptimizer(dist, on_stale="raise")
    model.load_state_dict(pretrained)
    dist.reload_model_params()  # Megatron's own: only the FP32 copies of the hybrid optimizer
    stale = opt.stale_masters()
    if precision_aware:
        assert stale == []  # bf16 shard views: every copy is an FP32 copy
    else:  # main shards (level 1) and host clones (level 2) stay stale
        assert len(stale) == 4
        assert any(entry.copies for entry in stale)
    opt.reload_model_params()
    assert opt.stale_masters() == []
    ref_losses, ref_weights = reference_finetune(pretrained, 3)
    assert train(model, opt, 3) == ref_losses
    assert_same(weights(model), ref_weights)


@pytest.mark.parametrize("precision_aware", [True, False])
def test_megatron_full_resume_through_the_double(precision_aware):
    model = make_model(0)
    uninterrupted = train(model, HybridSyncOptimizer(distributed(model, precision_aware)), 6)

    first = make_model(0)
    first_opt = HybridSyncOptimizer(distributed(first, precision_aware))
    train(first, first_opt, 3)
    model_sd = copy.deepcopy(first.state_dict())
    payload = copy.deepcopy(first_opt.state_dict())
    assert "step" not in payload["param_state"][0] and "master_param" not in str(payload)

    resumed = make_model(7)
    opt = HybridSyncOptimizer(distributed(resumed, precision_aware), on_stale="raise")
    resumed.load_state_dict(model_sd)
    opt.load_state_dict(payload)
    assert train(resumed, opt, 3) == uninterrupted[3:]
    assert_same(weights(resumed), weights(model))


def test_unwrapped_megatron_resume_fails_or_diverges():
    first = make_model(0)
    first_dist = distributed(first, precision_aware=False)
    train(first, first_dist, 3)
    payload = copy.deepcopy(first_dist.state_dict())
    model_sd = copy.deepcopy(first.state_dict())
    resumed = make_model(7)
    dist = distributed(resumed, precision_aware=False)
    resumed.load_state_dict(model_sd)
    with pytest.raises(KeyError, match="step"):
        dist.load_state_dict(payload)

    resumed = make_model(7)
    dist = distributed(resumed, precision_aware=True)
    resumed.load_state_dict(model_sd)
    dist.load_state_dict(copy.deepcopy(first_dist.state_dict()))
    # dummy_step wrote the stale copies into the weights and the copies were rebuilt from
    # them: the restored masters never reach the weights. A device-side param's master
    # replaced its state entry and never reaches the copy that steps either; the host-side
    # param's state takes writes in place, so its host copy holds the restored master.
    # The guard sees all four.
    stale = HybridSyncOptimizer(dist).stale_masters()
    host_copies = list(dist.optimizer.gpu_params_map_cpu_copy.values())
    assert len(stale) == 4 and len(host_copies) == 1
    for entry in stale:
        on_host = any(entry.master is copy for copy in host_copies)
        assert bool(entry.copies) != on_host, entry.name
    assert not torch.equal(resumed[0].weight, first[0].weight)


def test_chained_model_only_and_resume(pretrained):
    def build(model):
        halves = [list(model[0].parameters()), list(model[2].parameters())]
        parts = []
        for params in halves:
            sub = torch.nn.ParameterList(params)
            parts.append(distributed(sub, precision_aware=False))
        return pytest.importorskip("megatron.core.optimizer").ChainedOptimizer(parts)

    model = make_model(1)
    opt = HybridSyncOptimizer(build(model))
    model.load_state_dict(pretrained)
    ref_losses, ref_weights = reference_finetune(pretrained, 3)
    assert train(model, opt, 3) == ref_losses
    assert_same(weights(model), ref_weights)
    assert len(find_hybrid_offload(opt)) == 2

    payload = copy.deepcopy(opt.state_dict())
    model_sd = copy.deepcopy(model.state_dict())
    resumed = make_model(9)
    opt2 = HybridSyncOptimizer(build(resumed), on_stale="raise")
    resumed.load_state_dict(model_sd)
    opt2.load_state_dict(payload)
    assert train(resumed, opt2, 2) == train(model, opt, 2)
    assert_same(weights(resumed), weights(model))


class _FakeStream:
    def wait_stream(self, *args):
        pass


@pytest.fixture
def real_hdo_class(monkeypatch):
    optimizer_module = pytest.importorskip("megatron.core.optimizer.cpu_offloading")
    # The constructor asks CUDA for its current stream; nothing else on this path needs CUDA.
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    return optimizer_module.HybridDeviceOptimizer


def test_real_hybrid_device_optimizer_levels(real_hdo_class, pretrained):
    model = make_model(1)
    hdo = real_hdo_class(
        model.parameters(),
        offload_fraction=0.5,
        cpu_optimizer_cls=torch.optim.AdamW,
        gpu_optimizer_cls=torch.optim.AdamW,
        param_update_in_fp32=True,
        overlap_cpu_optimizer_d2h_h2d=False,
        lr=1e-3,
    )
    assert is_hybrid_offload(hdo)
    opt = HybridSyncOptimizer(hdo, on_stale="raise")
    entries = hybrid_master_copies(opt)
    params = list(model.parameters())
    assert all(e.master is hdo.param_to_fp32_param[p] for e, p in zip(entries, params, strict=True))
    model.load_state_dict(pretrained)
    assert len(opt.stale_masters()) == 4
    opt.reload_model_params()
    assert opt.stale_masters() == []
    fc = model[0].weight
    hdo.param_to_fp32_param[fc].add_(0.5)  # a restored master that differs from the weight
    opt.sync_from_masters()
    assert torch.equal(fc.detach(), hdo.param_to_fp32_param[fc].to(BF16))
    assert opt.stale_masters() == []


def test_real_hdo_inside_the_distributed_double(real_hdo_class, pretrained):
    model = make_model(1)

    def make(groups):
        return real_hdo_class(
            groups,
            cpu_optimizer_cls=torch.optim.AdamW,
            gpu_optimizer_cls=torch.optim.AdamW,
            param_update_in_fp32=True,
            overlap_cpu_optimizer_d2h_h2d=False,
            lr=1e-3,
        )

    dist = DistributedOptimizerDouble.of_model(model, make, precision_aware=True)
    opt = HybridSyncOptimizer(dist)
    model.load_state_dict(pretrained)
    stale = opt.stale_masters()
    assert len(stale) == 4 and all(e.master.dtype == torch.float32 for e in stale)
    opt.check_masters()
    assert opt.stale_masters() == []
    for p in model.parameters():
        assert torch.equal(
            dist.optimizer.param_to_fp32_param[dist._optimizer_param(p)],
            p.detach().view(-1).float(),
        )


def test_wrapped_stack_deepcopies_with_its_guard_state():
    model = make_model(0)
    opt = HybridSyncOptimizer(hybrid(model), on_stale="raise")
    train(model, opt, 2)
    twin = copy.deepcopy(opt)
    assert twin.on_stale == "raise" and not twin.guard_armed
    twin_inner = twin.unwrap()
    twin_params = [p for g in twin_inner.param_groups for p in g["params"]]
    assert len(twin_params) == 4
    assert all(twin_inner.param_to_inner_param[p] is not None for p in twin_params)
    assert hybrid_master_copies(twin)[0].weight is twin_params[0]


def test_full_sync_relinks_sub_optimizer_state():
    """A loader that replaced the exposed state dicts (as Megatron's do) is re-linked."""
    model = make_model(0)
    inner = hybrid(model)
    opt = HybridSyncOptimizer(inner)
    train(model, opt, 2)
    p = model[0].weight
    copy_of_p = inner.param_to_inner_param[p]
    sub = next(s for s in inner.sub_optimizers if copy_of_p in s.state)
    inner.state[p] = {k: v.clone() for k, v in inner.state[p].items()}
    assert sub.state[copy_of_p] is not inner.state[p]
    opt.sync_from_masters()
    assert sub.state[copy_of_p] is inner.state[p]
