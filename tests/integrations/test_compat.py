"""wrapped_optim.compat: the reference entry points' documented behaviour, on our machinery."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.doubles.distributed import DistributedOptimizerDouble, ddp_config, megatron_config
from wrapped_optim import compat
from wrapped_optim._adapters.hybrid import hybrid_master_copies
from wrapped_optim.fsdp import FSDPAwareOptimizer
from wrapped_optim.optimizers import HybridOffloadOptimizer
from wrapped_optim.wrapper import OptimizerWrapper, find_layer


def distributed(
    optimizer: Any, *, precision_aware: bool = False, offload: bool = False, fsdp: bool = False
) -> DistributedOptimizerDouble:
    """A Megatron DistributedOptimizer around ``optimizer``: the one pinned double
    (tests/doubles/distributed.py says why; tests/adapters/test_doubles_match_core.py checks it)."""
    config = megatron_config(precision_aware=precision_aware, cpu_offload=offload)
    return DistributedOptimizerDouble(optimizer, config, ddp_config(megatron_fsdp=fsdp))


def chained(*optimizers: Any) -> Any:
    """megatron-core's real ChainedOptimizer (which asserts one config across its members)."""
    return pytest.importorskip("megatron.core.optimizer").ChainedOptimizer(list(optimizers))


def fp32_optimizer(optimizer: Any) -> Any:
    """megatron-core's real FP32Optimizer (not a distributed optimizer) around ``optimizer``."""
    from tests.doubles.megatron_cpu import cpu_fp32_optimizer

    return cpu_fp32_optimizer(optimizer)


def precision_adam(**dtypes: Any) -> Any:
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.randn(5, 3))]
    optimizer = PrecisionAwareAdamW(params, lr=0.01, **dtypes)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer


COMPRESSED = {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.uint8}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys()
        for key, value in entry.items():
            other = b["state"][index][key]
            assert torch.equal(value, other) and value.dtype == other.dtype


# ----------------------------------------------------------------------------------------
# memory_efficient_precision_aware_optimizer_state_checkpointing
# ----------------------------------------------------------------------------------------
staging = compat.memory_efficient_precision_aware_optimizer_state_checkpointing


def test_staging_yields_the_count_of_eligible_holders_and_keeps_values() -> None:
    eligible = precision_adam(**COMPRESSED)
    fsdp = precision_adam(**COMPRESSED)
    all_fp32 = precision_adam()
    # One config across the chain, as the real ChainedOptimizer asserts; Megatron-FSDP is
    # the DDP config's, and a stub has no leaf.
    chain = chained(
        distributed(eligible, precision_aware=True),
        distributed(fsdp, precision_aware=True, fsdp=True),
        distributed(all_fp32, precision_aware=True),
        distributed(None, precision_aware=True),
    )
    expected = eligible.state_dict()
    with staging(chain, enabled=True) as count:
        assert count == 1
        assert "get_unscaled_state" in vars(eligible)
        for other in (fsdp, all_fp32):
            assert "get_unscaled_state" not in vars(other)
        assert_same_state(eligible.state_dict(), expected)
    assert "get_unscaled_state" not in vars(eligible)
    # Configs that make a chain ineligible as a whole: offloaded, not precision-aware.
    offloaded = precision_adam(**COMPRESSED)
    not_aware = precision_adam(**COMPRESSED)
    for holder, options in ((offloaded, {"offload": True}), (not_aware, {})):
        aware = "offload" in options
        with staging(
            chained(distributed(holder, precision_aware=aware, **options)), enabled=True
        ) as count:
            assert count == 0
            assert "get_unscaled_state" not in vars(holder)


def test_staging_disabled_or_none_is_a_no_op() -> None:
    holder = precision_adam(**COMPRESSED)
    container = distributed(holder, precision_aware=True)
    with staging(container, enabled=False) as count:
        assert count == 0
        assert "get_unscaled_state" not in vars(holder)
    with staging(None, enabled=True) as count:
        assert count == 0


def test_staging_restores_instance_attributes_exactly_even_on_error() -> None:
    holder = precision_adam(**COMPRESSED)
    own = holder.get_unscaled_state  # a bound method stored on the instance
    holder.get_unscaled_state = own
    with pytest.raises(KeyError), staging(distributed(holder, precision_aware=True), enabled=True):
        assert vars(holder)["get_unscaled_state"] is not own
        raise KeyError("boom")
    assert vars(holder)["get_unscaled_state"] is own
    plain = precision_adam(**COMPRESSED)
    with pytest.raises(KeyError), staging(plain, enabled=True):
        raise KeyError("boom")
    assert "get_unscaled_state" not in vars(plain)


class WholeTensorHolder(torch.optim.SGD):
    """A precision-aware holder without the chunk API (TE FusedAdam's shape; TE does not
    install here), whose accessor returns what a test gives it, tensor or not."""

    name_to_dtype_map = {"exp_avg": torch.bfloat16}

    def __init__(self, result: Any) -> None:
        self.param = torch.nn.Parameter(torch.ones(4))
        super().__init__([self.param], lr=0.1)
        self.state[self.param]["exp_avg"] = torch.ones(4, dtype=torch.bfloat16)
        self.result = result

    def get_unscaled_state(self, param: Any, name: str) -> Any:
        return self.result

    def set_scaled_state(self, param: Any, name: str, value: Any) -> None:
        self.state[param][name] = value.to(torch.bfloat16)


def test_staging_rejects_non_tensor_state_and_missing_accessor() -> None:
    holder = WholeTensorHolder(result=[1.0, 2.0])
    with staging(holder, enabled=True) as count:
        assert count == 1
        with pytest.raises(TypeError, match=r"must return a torch\.Tensor"):
            holder.get_unscaled_state(holder.param, "exp_avg")
    good = WholeTensorHolder(result=torch.full((4,), 3.0))
    with staging(good, enabled=True):
        assert torch.equal(good.get_unscaled_state(good.param, "exp_avg"), torch.full((4,), 3.0))
    broken = WholeTensorHolder(result=None)
    broken.get_unscaled_state = None  # type: ignore[assignment, method-assign]
    with pytest.raises(RuntimeError, match="get_unscaled_state"), staging(broken, enabled=True):
        pass
    assert vars(broken)["get_unscaled_state"] is None


# ----------------------------------------------------------------------------------------
# memory_efficient_fp32_optimizer_state_loading
# ----------------------------------------------------------------------------------------
no_copy = compat.memory_efficient_fp32_optimizer_state_loading


def fp32_moments_only(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        "param_groups": state_dict["param_groups"],
        "state": {
            index: {key: entry[key].clone() for key in ("exp_avg", "exp_avg_sq")}
            for index, entry in state_dict["state"].items()
        },
    }


def test_fp32_loading_adopts_the_loaders_tensors_only_inside() -> None:
    holder = precision_adam()  # FP32 moments, no master weights
    container = distributed(holder)
    payload = fp32_moments_only(holder.state_dict())
    params = [p for group in holder.param_groups for p in group["params"]]
    with no_copy(chained(container)) as count:
        assert count == 1
        holder.load_state_dict(payload)
    assert all(
        holder.state[param]["exp_avg"] is payload["state"][index]["exp_avg"]
        for index, param in enumerate(params)
    )
    assert "load_state_dict" not in vars(holder)
    copy_payload = fp32_moments_only(holder.state_dict())
    holder.load_state_dict(copy_payload)  # outside: the holder's own (copying) loader
    assert holder.state[params[0]]["exp_avg"] is not copy_payload["state"][0]["exp_avg"]


@pytest.mark.parametrize(
    "container",
    [
        lambda h: distributed(h, precision_aware=True),
        lambda h: distributed(h, offload=True),
        lambda h: distributed(h, fsdp=True),
        fp32_optimizer,  # not a distributed optimizer
        lambda h: chained(distributed(None)),
        lambda h: h,
    ],
)
def test_fp32_loading_skips_ineligible_optimizers(container: Any) -> None:
    holder = precision_adam()
    with no_copy(container(holder)) as count:
        assert count == 0
        assert "load_state_dict" not in vars(holder)
    compressed = precision_adam(**COMPRESSED)
    with no_copy(distributed(compressed)) as count:
        assert count == 0
    with no_copy(None) as count:
        assert count == 0


def test_fp32_loading_falls_back_for_other_payloads_and_restores_on_error() -> None:
    holder = precision_adam()
    params = [p for group in holder.param_groups for p in group["params"]]
    payload = fp32_moments_only(holder.state_dict())
    payload["state"][0]["exp_avg"] = payload["state"][0]["exp_avg"].double()  # not plain FP32
    with no_copy(distributed(holder)) as count:
        assert count == 1
        holder.load_state_dict(payload)  # the holder's own loader: converts, copies
    assert holder.state[params[0]]["exp_avg"].dtype == torch.float32
    assert holder.state[params[1]]["exp_avg"] is not payload["state"][1]["exp_avg"]
    with pytest.raises(ValueError, match="boom"), no_copy(distributed(holder)):
        raise ValueError("boom")
    assert "load_state_dict" not in vars(holder)


# ----------------------------------------------------------------------------------------
# hybrid_optimizer_state_loading / sync_hybrid_device_optimizer_fp32_master_copies
# ----------------------------------------------------------------------------------------
def trained_hybrid(fraction: float = 0.5) -> tuple[torch.nn.Module, HybridOffloadOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optimizer = HybridOffloadOptimizer(model.parameters(), offload_fraction=fraction, lr=0.1)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    return model, optimizer


def megatron_style_payload(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Step counters in the group metadata only, FP32 params under the checkpoint's name."""
    steps = {entry["step"].item() for entry in state_dict["state"].values()}
    (step,) = steps
    groups = [{**group, "step": int(step)} for group in state_dict["param_groups"]]
    state = {}
    for index, entry in state_dict["state"].items():
        fixed = {k: v.clone() for k, v in entry.items() if k not in ("step", "master_param")}
        fixed["fp32_param"] = entry["master_param"].clone()
        state[index] = fixed
    return {"param_groups": groups, "state": state}


def test_hybrid_state_loading_supplies_omitted_entries() -> None:
    _, optimizer = trained_hybrid()
    expected = optimizer.state_dict()
    payload = megatron_style_payload(expected)
    snapshot = {i: dict(entry) for i, entry in payload["state"].items()}
    _, fresh = trained_hybrid()
    with compat.hybrid_optimizer_state_loading(fresh) as prepared:
        assert prepared == 1
        fresh.load_state_dict(payload)
    assert "load_state_dict" not in vars(fresh)
    got = fresh.state_dict()["state"]
    for index, entry in expected["state"].items():
        assert got[index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(got[index][key], value)
    # The caller's payload is untouched.
    assert {i: dict(entry) for i, entry in payload["state"].items()}.keys() == snapshot.keys()
    assert all(payload["state"][i][k] is v for i, e in snapshot.items() for k, v in e.items())


def test_hybrid_state_loading_counts_megatron_containers_and_restores() -> None:
    hybrids = [trained_hybrid()[1] for _ in range(2)]
    containers = [distributed(hybrid, offload=True) for hybrid in hybrids]
    setter = "_set_main_param_and_optimizer_states"
    with compat.hybrid_optimizer_state_loading(chained(*containers)) as n:
        assert n == 2
        for container, hybrid in zip(containers, hybrids, strict=True):
            assert setter in vars(container)  # a DistributedOptimizer is prepared through it
            assert "load_state_dict" not in vars(hybrid)
    assert not any(setter in vars(container) for container in containers)
    # A Megatron optimizer without the distributed optimizer's setter: the leaf's loader.
    other = trained_hybrid()[1]
    with compat.hybrid_optimizer_state_loading(fp32_optimizer(other)) as n:
        assert n == 1
        assert "load_state_dict" in vars(other)
    assert "load_state_dict" not in vars(other)
    with compat.hybrid_optimizer_state_loading(torch.optim.SGD([torch.ones(1)], lr=1)) as n:
        assert n == 0
    with compat.hybrid_optimizer_state_loading(None) as n:
        assert n == 0


def test_sync_after_model_only_load_refreshes_every_level() -> None:
    model, optimizer = trained_hybrid(fraction=1.0)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)  # a model-only load behind the optimizer's back
    assert any(entry.stale_levels() for entry in hybrid_master_copies(optimizer))
    assert compat.sync_hybrid_device_optimizer_fp32_master_copies(
        chained(distributed(optimizer, offload=True))
    )
    entries = hybrid_master_copies(optimizer)
    assert entries and not any(entry.stale_levels() for entry in entries)
    assert all(torch.all(entry.master == 0.5) for entry in entries)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    assert compat.sync_hybrid_device_optimizer_fp32_master_copies(sgd) is False
    assert compat.sync_hybrid_device_optimizer_fp32_master_copies(None) is False


# ----------------------------------------------------------------------------------------
# Megatron-FSDP: fully_shard_optimizer / init_optimizer_state
# ----------------------------------------------------------------------------------------
def bf16_grad_param() -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.ones(4))
    param.grad_dtype = torch.bfloat16
    return param


def test_fully_shard_optimizer_steps_mixed_grad_dtypes() -> None:
    param = bf16_grad_param()
    bare = torch.optim.AdamW([param], lr=0.1)
    (param * 2).sum().backward()
    with pytest.raises(RuntimeError):
        bare.step()  # what Megatron-FSDP's adapter exists for
    optimizer = compat.fully_shard_optimizer(bare)
    assert optimizer is bare and find_layer(bare, FSDPAwareOptimizer) is None
    grad = param.grad
    optimizer.step()
    assert param.grad is grad and grad.dtype == torch.bfloat16
    assert torch.all(param < 1.0)
    layer = FSDPAwareOptimizer(torch.optim.SGD([bf16_grad_param()], lr=0.1))
    foreign = OptimizerWrapper(layer)
    assert compat.fully_shard_optimizer(foreign, precision_aware=True) is foreign
    assert layer.precision_aware and find_layer(foreign, FSDPAwareOptimizer) is layer


def test_fully_shard_optimizer_refuses_closures_and_restores_grads_after_an_error() -> None:
    param = bf16_grad_param()
    (param * 2).sum().backward()
    grad = param.grad
    failing = True

    class Failing(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            assert param.grad.dtype == torch.float32  # cast for the step
            if failing:
                raise RuntimeError("step failed")
            return super().step(closure)

    optimizer = compat.fully_shard_optimizer(Failing([param], lr=0.1))
    # As upstream: a closure makes grads inside the step, where a hook cannot cast them.
    with pytest.raises(NotImplementedError, match=r"closures.*FSDPAwareOptimizer"):
        optimizer.step(lambda: 0.0)
    assert param.grad is grad
    with pytest.raises(RuntimeError, match="step failed"):
        optimizer.step()
    failing = False
    optimizer.step()  # the raised step's cast grads are put back before this one casts
    assert param.grad is grad and grad.dtype == torch.bfloat16
    assert torch.all(param < 1.0)
    # A wrapper takes closures.
    wrapped = FSDPAwareOptimizer(torch.optim.SGD([param], lr=0.1))
    wrapped.step(lambda: 0.0)
    assert param.grad is grad


def test_init_optimizer_state_creates_state_without_side_effects() -> None:
    param = bf16_grad_param()
    optimizer = compat.fully_shard_optimizer(torch.optim.AdamW([param], lr=0.1, weight_decay=0.5))
    before = param.detach().clone()
    assert compat.init_optimizer_state(optimizer) is True
    assert sorted(optimizer.state[param]) == ["exp_avg", "exp_avg_sq", "step"]
    assert torch.equal(param, before) and param.grad is None
    assert optimizer.param_groups[0]["lr"] == 0.1
    assert compat.init_optimizer_state(optimizer) is False


# ----------------------------------------------------------------------------------------
# Bridge's checkpoint flow: the real ChainedOptimizer around the DistributedOptimizer double
# ----------------------------------------------------------------------------------------
def _megatron_hybrid(seed: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2)).to(torch.bfloat16)
    megatron_optimizer = DistributedOptimizerDouble.of_model(
        model,
        lambda groups: HybridOffloadOptimizer(groups, offload_fraction=0.5, lr=1e-2),
        precision_aware=False,
    )
    return model, chained(megatron_optimizer)


def _steps(model: torch.nn.Module, optimizer: Any, count: int) -> None:
    for step in range(count):
        optimizer.zero_grad()
        model(torch.full((3, 4), 0.1 * (step + 1), dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()


def test_bridge_resume_and_finetune_flow_on_megatron_containers() -> None:
    import copy

    model, chained = _megatron_hybrid(0)
    from wrapped_optim.hybrid import HybridSyncOptimizer
    from wrapped_optim.stack import wrap

    derived = wrap(chained)  # derivation sees the hybrid optimizer inside the containers
    assert type(derived) is HybridSyncOptimizer and derived.inner is chained
    _steps(model, chained, 2)
    weights = copy.deepcopy(model.state_dict())
    payload = copy.deepcopy(chained.state_dict())

    # Resume: Megatron's loader wants per-parameter step/master_param the payload omits.
    resumed_model, resumed = _megatron_hybrid(1)
    resumed_model.load_state_dict(weights)
    with pytest.raises(KeyError):
        resumed.load_state_dict(copy.deepcopy(payload))
    resumed_model, resumed = _megatron_hybrid(1)
    resumed_model.load_state_dict(weights)
    with compat.hybrid_optimizer_state_loading(resumed) as prepared:
        assert prepared == 1
        resumed.load_state_dict(copy.deepcopy(payload))
    (distributed,) = resumed.chained_optimizers
    assert "_set_main_param_and_optimizer_states" not in vars(distributed)
    _steps(model, chained, 2)
    _steps(resumed_model, resumed, 2)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True)
    )

    # Fine-tune from weights only: every master level, including the distributed optimizer's
    # FP32 main shards (level 1), takes the loaded weights.
    tuned_model, tuned = _megatron_hybrid(2)
    tuned_model.load_state_dict(weights)
    (tuned_distributed,) = tuned.chained_optimizers
    mains = tuned_distributed.shard_fp32_from_float16_groups[0]
    halves = tuned_distributed.model_float16_groups[0]
    assert not all(torch.equal(m, p.float().view(-1)) for m, p in zip(mains, halves, strict=True))
    assert compat.sync_hybrid_device_optimizer_fp32_master_copies(tuned) is True
    assert all(torch.equal(m, p.float().view(-1)) for m, p in zip(mains, halves, strict=True))
    assert not any(entry.stale_levels() for entry in hybrid_master_copies(tuned))
