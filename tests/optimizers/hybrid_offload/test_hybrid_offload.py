"""The portable HybridOffloadOptimizer: layout, stepping, state exposure and checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.param_builders import random_groups
from wrapped_optim.optimizers import HybridOffloadOptimizer

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def clone_groups(groups):
    return [
        {**g, "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]}
        for g in groups
    ]


def all_params(groups):
    return [p for g in groups for p in g["params"]]


def set_grads(params, step, seed=1):
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


layouts = st.lists(
    st.lists(st.sampled_from([(3,), (2, 4), (5,), (1,)]), min_size=1, max_size=3),
    min_size=1,
    max_size=3,
)
fractions = st.sampled_from([0.0, 0.3, 0.5, 1.0])
dtype_lists = st.lists(st.sampled_from(DTYPES), min_size=1, max_size=3)


@given(layout=layouts, fraction=fractions, dtypes=dtype_lists)
def test_offload_walk_and_copies(layout, fraction, dtypes):
    groups = random_groups(layout, dtypes)
    opt = HybridOffloadOptimizer(groups, offload_fraction=fraction, lr=0.1)
    params = all_params(groups)
    offloaded = [p in opt.gpu_params_map_cpu_copy for p in params]
    # A prefix in group order, stopping once offload_fraction of the numel is reached.
    k = sum(offloaded)
    assert offloaded == [True] * k + [False] * (len(params) - k)
    total = sum(p.numel() for p in params)
    numel_before_last = sum(p.numel() for p in params[: max(k - 1, 0)])
    assert k == 0 or numel_before_last < fraction * total
    assert sum(p.numel() for p in params[:k]) >= fraction * total
    for p in params:
        inner = opt.param_to_inner_param[p]
        low = p.dtype in (torch.bfloat16, torch.float16)
        if p in opt.gpu_params_map_cpu_copy or low:
            # a distinct tensor with its own storage, even for a host param
            assert inner is not p and inner.data_ptr() != p.data_ptr()
            assert torch.equal(inner, p.detach().to(inner.dtype))
        else:
            assert inner is p
        assert inner.dtype == (torch.float32 if low else p.dtype)
        assert (p in opt.param_to_fp32_param) == low
    assert len(opt.cpu_optimizers) == (1 if k else 0)
    assert (opt.gpu_optimizer is None) == (k == len(params))
    assert opt.sub_optimizers == [*opt.cpu_optimizers, *([opt.gpu_optimizer] * (k < len(params)))]


def reference_step(params, masters, opts):
    """Plain AdamW on FP32 masters, rounded into the params: what the hybrid must reproduce."""
    for p, m in zip(params, masters, strict=True):
        m.grad = p.grad.to(m.dtype)
    for opt in opts:
        opt.step()
    with torch.no_grad():
        for p, m in zip(params, masters, strict=True):
            p.copy_(m)


def reference_optimizers(opt, params, master_groups, **options):
    """The AdamW the hybrid promises for each param: ``AdamW(fused=True)`` for a host copy
    (its host default), torch's default ``AdamW`` on the device. torch's fused CPU kernel is
    bitwise its single-tensor loop only on some CPUs (AVX-512 here, not an AVX2-only AMD), so
    each side is compared with its own implementation, which holds on every CPU."""
    offloaded = {id(m) for p, m in zip(params, all_params(master_groups), strict=True)
                 if p in opt.gpu_params_map_cpu_copy}  # fmt: skip
    host, device = [], []
    for group in master_groups:
        for side, keep in ((host, True), (device, False)):
            chosen = [m for m in group["params"] if (id(m) in offloaded) == keep]
            if chosen:
                side.append({**group, "params": chosen})
    refs = [torch.optim.AdamW(host, fused=True, **options)] if host else []
    return refs + ([torch.optim.AdamW(device, **options)] if device else [])


@given(layout=layouts, fraction=fractions, dtypes=dtype_lists)
def test_steps_match_plain_adamw_on_fp32_masters(layout, fraction, dtypes):
    groups = random_groups(layout, dtypes)
    ref_groups = clone_groups(groups)
    ref_params = all_params(ref_groups)
    masters = [p.detach().float().clone() for p in ref_params]
    master_groups, i = [], 0
    for g in ref_groups:
        master_groups.append({"params": masters[i : i + len(g["params"])], "lr": g["lr"]})
        i += len(g["params"])
    # torch's own arithmetic, bit for bit: the unfused path (the fused host step, the default
    # where it applies, is within FP32 rounding of it:
    # tests/optimizers/hybrid_offload/test_hybrid_offload_fused.py)
    opt = HybridOffloadOptimizer(
        groups, offload_fraction=fraction, weight_decay=0.1, fused_host_step=False
    )
    params = all_params(groups)
    refs = reference_optimizers(opt, params, master_groups, weight_decay=0.1)
    for step in range(3):
        set_grads(params, step)
        set_grads(ref_params, step)
        opt.step()
        reference_step(ref_params, masters, refs)
    states = {m: s for ref in refs for m, s in ref.state.items()}
    for p, r, m in zip(params, ref_params, masters, strict=True):
        assert torch.equal(p, r)
        assert torch.equal(opt.state[p]["master_param"].float(), m)
        assert torch.equal(opt.state[p]["exp_avg"], states[m]["exp_avg"])


def test_state_exposed_under_original_params():
    groups = random_groups([[(4,), (3,)]], [torch.bfloat16, torch.float32])
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    p0, p1 = all_params(groups)
    set_grads([p0, p1], 0)
    opt.step()
    host = opt.gpu_params_map_cpu_copy[p0]
    assert opt.state[p0]["master_param"] is host
    assert opt.cpu_optimizers[0].state[host] is opt.state[p0].entries  # a view of the live dict
    assert opt.state[p1]["master_param"] is p1  # FP32, not offloaded: the param itself
    assert set(opt.state) == {p0, p1}


def test_group_options_follow_the_outer_groups():
    groups = random_groups([[(4,)], [(4,)]], [torch.float32])
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    set_grads(all_params(groups), 0)
    opt.step()
    scheduler.step()
    set_grads(all_params(groups), 1)
    opt.step()
    sub_lrs = [g["lr"] for sub in opt.sub_optimizers for g in sub.param_groups]
    assert sub_lrs == pytest.approx([0.005, 0.01])


def test_closure_runs_once_and_its_loss_is_returned():
    p = torch.nn.Parameter(torch.ones(3))
    opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert calls == [1]


def test_add_param_group_after_construction_is_refused():
    opt = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2))]})


def test_invalid_fraction_is_refused():
    with pytest.raises(ValueError, match="offload_fraction"):
        HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))], offload_fraction=1.5)


def test_update_fp32_param_by_new_param_refreshes_only_fp32_copies():
    groups = random_groups([[(4,), (4,)]], [torch.float32, torch.bfloat16])
    opt = HybridOffloadOptimizer(groups, offload_fraction=1.0, lr=0.1)
    p32, p16 = all_params(groups)
    with torch.no_grad():
        p32.fill_(7.0)
        p16.fill_(7.0)
    opt.update_fp32_param_by_new_param()
    assert torch.equal(opt.param_to_fp32_param[p16], torch.full((4,), 7.0))
    # Megatron's semantics: the host clone of an FP32 param is not an "FP32 copy".
    assert not torch.equal(opt.gpu_params_map_cpu_copy[p32], torch.full((4,), 7.0))


def test_dummy_step_creates_state_and_changes_nothing():
    groups = random_groups([[(4,), (4,)]], [torch.bfloat16])
    before = [p.detach().clone() for p in all_params(groups)]
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1, weight_decay=0.5)
    opt.dummy_step()
    assert len(opt.state) == 2
    assert all(p.grad is None for p in all_params(groups))
    for p, b in zip(all_params(groups), before, strict=True):
        assert torch.equal(p, b)
        assert torch.equal(opt.state[p]["master_param"], b.float())
    assert [g["lr"] for g in opt.param_groups] == [0.01]


def snapshot(opt, params):
    return (
        copy.deepcopy(opt.state_dict()),
        [p.detach().clone() for p in params],
        [t.detach().clone() for t in opt.param_to_inner_param.values()],
    )


def assert_same_snapshot(a, b):
    sd_a, params_a, inner_a = a
    sd_b, params_b, inner_b = b
    assert sd_a["param_groups"] == sd_b["param_groups"]
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for key, entry in sd_a["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, sd_b["state"][key][name]), (key, name)
    for x, y in zip(params_a + inner_a, params_b + inner_b, strict=True):
        assert torch.equal(x, y)


@given(layout=layouts, fraction=fractions, dtypes=dtype_lists, steps=st.integers(1, 3))
def test_state_dict_round_trip_continues_bit_identically(layout, fraction, dtypes, steps):
    groups = random_groups(layout, dtypes)
    twin_groups = clone_groups(groups)
    opt = HybridOffloadOptimizer(groups, offload_fraction=fraction, lr=0.05)
    params = all_params(groups)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    payload = copy.deepcopy(opt.state_dict())
    pristine = copy.deepcopy(payload)
    # A fresh optimizer over the same weights (as loaded from the model checkpoint).
    twin_params = all_params(twin_groups)
    with torch.no_grad():
        for t, p in zip(twin_params, params, strict=True):
            t.copy_(p)
    twin = HybridOffloadOptimizer(twin_groups, offload_fraction=fraction, lr=0.05)
    twin.load_state_dict(payload)
    for step in range(steps, steps + 2):
        set_grads(params, step)
        set_grads(twin_params, step)
        opt.step()
        twin.step()
    for p, t in zip(params, twin_params, strict=True):
        assert torch.equal(p, t)
        assert torch.equal(opt.state[p]["master_param"], twin.state[t]["master_param"])
    # The payload was copied, never adopted: stepping did not touch it.
    for key, entry in payload["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, pristine["state"][key][name])


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda sd: sd["param_groups"].append({"params": []}), "param groups"),
        (
            lambda sd: sd["param_groups"][0]["params"].pop(),
            "has 1 params, this optimizer has 2",
        ),
        (
            lambda sd: sd["state"].__setitem__(9, {}),
            "param 9: the checkpoint has state",
        ),
        (
            lambda sd: sd["state"][1].__setitem__("master_param", torch.zeros(3)),
            "param 1: state 'master_param' has shape",
        ),
    ],
)
def test_rejected_payload_leaves_everything_as_it_was(corrupt, message):
    groups = random_groups([[(4,), (2, 2)]], [torch.bfloat16, torch.float32])
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    params = all_params(groups)
    set_grads(params, 0)
    opt.step()
    payload = copy.deepcopy(opt.state_dict())
    corrupt(payload)
    before = snapshot(opt, params)
    host_before = dict(opt.gpu_params_map_cpu_copy)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(payload)
    assert_same_snapshot(before, snapshot(opt, params))
    assert all(opt.gpu_params_map_cpu_copy[p] is host_before[p] for p in host_before)


def test_load_restores_masters_with_their_low_bits():
    groups = random_groups([[(64,)]], [torch.bfloat16])
    opt = HybridOffloadOptimizer(groups, offload_fraction=1.0, lr=1e-3)
    (p,) = all_params(groups)
    for step in range(3):
        set_grads([p], step)
        opt.step()
    master = opt.state[p]["master_param"].clone()
    assert not torch.equal(master, p.detach().float())  # the master carries low bits
    payload = copy.deepcopy(opt.state_dict())
    twin = HybridOffloadOptimizer(clone_groups(groups), offload_fraction=1.0, lr=1e-3)
    twin.load_state_dict(payload)
    (t,) = all_params(twin.param_groups)
    assert torch.equal(twin.gpu_params_map_cpu_copy[t], master)
    assert twin.state[t]["master_param"] is twin.gpu_params_map_cpu_copy[t]


def test_load_without_master_rebuilds_copies_from_weights():
    """What a payload without masters gives: copies rebuilt from 16-bit weights."""
    groups = random_groups([[(64,)]], [torch.bfloat16])
    opt = HybridOffloadOptimizer(groups, offload_fraction=1.0, lr=1e-3)
    (p,) = all_params(groups)
    for step in range(3):
        set_grads([p], step)
        opt.step()
    payload = copy.deepcopy(opt.state_dict())
    del payload["state"][0]["master_param"]
    opt.load_state_dict(payload)
    assert torch.equal(opt.gpu_params_map_cpu_copy[p], p.detach().float())


def test_load_state_dict_hooks_fire():
    p = torch.nn.Parameter(torch.ones(2))
    opt = HybridOffloadOptimizer([p], lr=0.1)
    seen = []
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("post"))
    opt.load_state_dict(opt.state_dict())
    assert seen == ["pre", "post"]


def test_deepcopy_keeps_the_copies_and_sub_optimizers_consistent():
    groups = random_groups([[(4,), (3,)]], [torch.bfloat16])
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    params = all_params(groups)
    set_grads(params, 0)
    opt.step()
    twin = copy.deepcopy(opt)
    twin_params = all_params(twin.param_groups)
    assert all(t is not p for t, p in zip(twin_params, params, strict=True))
    assert set(twin.param_to_inner_param) == set(twin_params)
    twin_host = twin.gpu_params_map_cpu_copy[twin_params[0]]
    assert twin.cpu_optimizers[0].param_groups[0]["params"][0] is twin_host
    set_grads(params, 1)
    set_grads(twin_params, 1)
    opt.step()
    twin.step()
    for p, t in zip(params, twin_params, strict=True):
        assert torch.equal(p, t)


# ----------------------------------------------------------------------------------------
# Validation of plain sub-optimizer state, atomic load and step
# ----------------------------------------------------------------------------------------
def _sgd_state(sd):
    sd["state"] = {i: {"momentum_buffer": e["exp_avg"].clone()} for i, e in sd["state"].items()}


def _set(name, value):
    return lambda sd: sd["state"][1].__setitem__(name, value(sd["state"][1]))


BAD_STATES = {
    "wrong shape": (_set("exp_avg", lambda e: torch.zeros(5)), "param 1: state 'exp_avg'"),
    "integer": (
        _set("exp_avg", lambda e: torch.zeros(e["exp_avg"].shape, dtype=torch.int32)),
        "param 1: state 'exp_avg'",
    ),
    "list": (_set("exp_avg", lambda e: e["exp_avg"].tolist()), "param 1: state 'exp_avg'"),
    "missing name": (lambda sd: sd["state"][1].pop("exp_avg_sq"), "param 1: missing.*exp_avg_sq"),
    "extra name": (_set("bogus", lambda e: torch.zeros(1)), "param 1: unknown state 'bogus'"),
    "nan": (
        _set("exp_avg", lambda e: torch.full_like(e["exp_avg"], float("nan"))),
        "param 1: state 'exp_avg' has non-finite",
    ),
    "inf": (
        _set("exp_avg_sq", lambda e: torch.full_like(e["exp_avg_sq"], float("inf"))),
        "param 1: state 'exp_avg_sq' has non-finite",
    ),
    "negative second moment": (
        _set("exp_avg_sq", lambda e: -torch.ones_like(e["exp_avg_sq"])),
        "param 1: state 'exp_avg_sq' has negative",
    ),
    "string step": (_set("step", lambda e: "three"), "param 1: invalid step"),
    "state None": (lambda sd: sd["state"].__setitem__(1, None), "param 1: state must be a dict"),
    "sgd state for adamw": (_sgd_state, "param 0: unknown state 'momentum_buffer'"),
    "no state entry": (lambda sd: sd.pop("state"), "no 'state' entry"),
    "missing lr": (lambda sd: sd["param_groups"][0].pop("lr"), "param group 0: .*'lr'"),
    "string lr": (
        lambda sd: sd["param_groups"][0].__setitem__("lr", "fast"),
        "param group 0: lr must be a finite number",
    ),
}


@pytest.mark.parametrize("fresh", [False, True], ids=["stepped", "fresh"])
@pytest.mark.parametrize("case", list(BAD_STATES), ids=list(BAD_STATES))
def test_bad_plain_state_is_rejected_naming_param_and_state(case, fresh):
    """Into a stepped optimizer (names from its state) and a fresh one (names probed)."""
    corrupt, message = BAD_STATES[case]
    groups = random_groups([[(4,), (2, 2)]], [torch.bfloat16, torch.float32])
    source = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    set_grads(all_params(groups), 0)
    source.step()
    payload = copy.deepcopy(source.state_dict())
    corrupt(payload)
    pristine = copy.deepcopy(payload)
    target_groups = clone_groups(groups) if fresh else groups
    opt = source if not fresh else HybridOffloadOptimizer(target_groups, offload_fraction=0.5)
    params = all_params(target_groups)
    before = snapshot(opt, params)
    subs = list(opt.sub_optimizers)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(payload)
    assert_same_snapshot(before, snapshot(opt, params))
    assert opt.sub_optimizers == subs
    assert payload.keys() == pristine.keys()
    for key, entry in pristine.get("state", {}).items():
        if isinstance(entry, dict):
            for name, value in entry.items():
                got = payload["state"][key][name]
                assert (
                    got == value
                    if not isinstance(value, torch.Tensor)
                    else (torch.equal(got, value) or (got.isnan().any() and value.isnan().any()))
                )


def test_probed_names_follow_the_group_options():
    """A fresh optimizer expects what its sub-optimizer class keeps: amsgrad adds a state."""
    groups = random_groups([[(3,)]], [torch.float32])
    source = HybridOffloadOptimizer(groups, offload_fraction=1.0, lr=0.1, amsgrad=True)
    set_grads(all_params(groups), 0)
    source.step()
    payload = source.state_dict()
    assert "max_exp_avg_sq" in payload["state"][0]
    fresh = HybridOffloadOptimizer(random_groups([[(3,)]], [torch.float32]), amsgrad=True)
    fresh.load_state_dict(payload)
    # (torch wrote amsgrad=True into ``groups``: build the plain one from new groups)
    # The hybrid's groups carry amsgrad (as a torch optimizer's do), and a load adopts the
    # saved options: a payload whose groups say amsgrad=False cannot hold max_exp_avg_sq.
    plain = HybridOffloadOptimizer(random_groups([[(3,)]], [torch.float32]), offload_fraction=1.0)
    payload["param_groups"][0]["amsgrad"] = False
    with pytest.raises(ValueError, match="unknown state 'max_exp_avg_sq'"):
        plain.load_state_dict(payload)


class FlakyAdamW(torch.optim.AdamW):
    """AdamW whose next step raises once when ``fail`` is set (a device fault)."""

    fail = False

    def step(self, closure=None):
        if FlakyAdamW.fail:
            FlakyAdamW.fail = False
            raise RuntimeError("device step failed")
        return super().step(closure)


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failed_device_step_leaves_the_host_step_undone(atomic):
    groups = random_groups([[(4,), (3,)]], [torch.bfloat16])
    params = all_params(groups)
    opt = HybridOffloadOptimizer(
        groups, offload_fraction=0.5, gpu_optimizer_cls=FlakyAdamW, atomic_step=atomic, lr=0.1
    )
    twin_groups = clone_groups(groups)
    twin = HybridOffloadOptimizer(twin_groups, offload_fraction=0.5, lr=0.1)
    for step in range(2):
        set_grads(params, step)
        set_grads(all_params(twin_groups), step)
        opt.step()
        twin.step()
    before = snapshot(opt, params)
    set_grads(params, 2)
    set_grads(all_params(twin_groups), 2)
    FlakyAdamW.fail = True
    with pytest.raises(RuntimeError, match="device step failed"):
        opt.step()
    if not atomic:  # the documented trade: the host half has advanced
        with pytest.raises(AssertionError):
            assert_same_snapshot(before, snapshot(opt, params))
        return
    assert_same_snapshot(before, snapshot(opt, params))
    opt.step()  # the retry is the step the fault interrupted
    twin.step()
    assert_same_snapshot(snapshot(twin, all_params(twin_groups)), snapshot(opt, params))


def test_a_failed_load_into_a_fresh_layout_keeps_the_old_one():
    """The loaded copies and sub-optimizers are built aside: a fault there changes nothing."""
    groups = random_groups([[(4,), (3,)]], [torch.bfloat16])
    params = all_params(groups)
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, gpu_optimizer_cls=FlakyAdamW)
    set_grads(params, 0)
    opt.step()
    payload = copy.deepcopy(opt.state_dict())
    before, subs = snapshot(opt, params), list(opt.sub_optimizers)
    opt.gpu_optimizer_cls = lambda *a, **k: (_ for _ in ()).throw(MemoryError("no memory"))
    with pytest.raises(MemoryError):
        opt.load_state_dict(payload)
    assert_same_snapshot(before, snapshot(opt, params))
    assert opt.sub_optimizers == subs


@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_copy_back_is_completed(monkeypatch, failures):
    """The step is committed once both sub-optimizers stepped: a copy-back that raises is
    retried at once and, failing again, completed by the next state_dict or step."""
    groups = random_groups([[(4,), (3,)]], [torch.bfloat16])
    params = all_params(groups)
    opt = HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=0.1)
    twin_groups = clone_groups(groups)
    twin = HybridOffloadOptimizer(twin_groups, offload_fraction=0.5, lr=0.1)
    set_grads(params, 0)
    set_grads(all_params(twin_groups), 0)
    twin.step()
    original = torch.Tensor.copy_
    left = [failures]

    def copy_(self, src, *args, **kwargs):
        if self is params[-1] and left[0] > 0:
            left[0] -= 1
            raise RuntimeError("copy-back failed")
        return original(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    if failures == 1:
        opt.step()
    else:
        with pytest.raises(RuntimeError, match="copy-back failed"):
            opt.step()
        assert not torch.equal(params[-1], all_params(twin_groups)[-1])  # lags its master
    monkeypatch.undo()
    assert_same_snapshot(snapshot(twin, all_params(twin_groups)), snapshot(opt, params))


def test_a_step_shows_its_phases_as_profiler_ranges() -> None:
    """copy-in, host step, device step and copy-out, once each and in that order (the
    benchmark's breakdown and users' traces read them), and the step itself unchanged."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16)) for _ in range(4)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = HybridOffloadOptimizer(params, offload_fraction=0.5, lr=1e-2)
    plain = HybridOffloadOptimizer(twins, offload_fraction=0.5, lr=1e-2)
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        opt.step()
    plain.step()
    names = [e.name for e in prof.events() if e.name.startswith("HybridOffloadOptimizer.")]
    assert names == [
        "HybridOffloadOptimizer.copy_in",
        "HybridOffloadOptimizer.host_step",
        "HybridOffloadOptimizer.device_step",
        "HybridOffloadOptimizer.copy_out",
    ]
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)
