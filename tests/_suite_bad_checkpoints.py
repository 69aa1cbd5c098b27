"""A catalogue of bad optimizer checkpoints, each made from a good one by one mutation.

Used by tests/test_bad_inputs.py. Every mutation works on its own copy of the good checkpoint
and returns the bad one; ``applies`` says whether the mutation makes sense for a checkpoint
(e.g. a remainder/master mismatch needs a ``master_param``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch

from wrapped_optim.testing import checkpoint_roundtrip

StateDict = dict[str, Any]


@attrs.frozen
class BadCase:
    """One kind of bad checkpoint.

    ``mentions``: a regex the error message must match (it names what is wrong).
    ``torch_rejects``: torch's own Optimizer.load_state_dict already rejects it, so every
    layer (bare torch optimizers included) must raise; otherwise only our validating
    optimizers are held to it (torch accepts it silently).
    """

    name: str
    mutate: Callable[[StateDict], Any]
    mentions: str
    torch_rejects: bool = False
    applies: Callable[[StateDict], bool] = lambda sd: True
    replaces: bool = False  # mutate returns the whole bad checkpoint


def _target(sd: StateDict, *, needs: str | None = None) -> int:
    """The last parameter index whose state has a tensor (named ``needs``, when given)."""
    candidates = [
        index
        for index, entry in sd["state"].items()
        if isinstance(entry, dict)
        and any(
            isinstance(v, torch.Tensor) and v.dim() > 0 and (needs is None or k == needs)
            for k, v in entry.items()
        )
    ]
    return max(candidates)


def _moment(sd: StateDict) -> str:
    entry = sd["state"][_target(sd)]
    for name in ("exp_avg", "momentum_buffer", "exp_avg_sq"):
        if isinstance(entry.get(name), torch.Tensor):
            return name
    raise LookupError("no moment state in this checkpoint")


def _has_state(sd: StateDict) -> bool:
    try:
        _target(sd)
        _moment(sd)
    except (ValueError, LookupError):
        return False
    return True


def _has_master(sd: StateDict) -> bool:
    return any(isinstance(e, dict) and "master_param" in e for e in sd["state"].values())


def _has(name: str) -> Callable[[StateDict], bool]:
    return lambda sd: any(isinstance(e, dict) and name in e for e in sd["state"].values())


def _set_state(name_of: Callable[[StateDict], str], value_of: Callable[[torch.Tensor], Any]):
    def mutate(sd: StateDict) -> None:
        index = _target(sd)
        name = name_of(sd)
        sd["state"][index][name] = value_of(sd["state"][index][name])

    return mutate


def _poison(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def poison(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return poison


def _drop_state_name(sd: StateDict) -> None:
    index = _target(sd)
    entry = sd["state"][index]
    name = "exp_avg_sq" if "exp_avg_sq" in entry else _moment(sd)
    del entry[name]


def _other_class(sd: StateDict) -> None:
    # What torch.optim.SGD(momentum=0.9) writes for the same parameters.
    sd["state"] = {
        index: {"momentum_buffer": entry[_moment(sd)].float().clone()}
        for index, entry in sd["state"].items()
        if isinstance(entry, dict) and _moment(sd) in entry
    }
    for group in sd["param_groups"]:
        for key in ("betas", "eps", "amsgrad", "step", "bias_correction"):
            group.pop(key, None)
        group.update(momentum=0.9, dampening=0, nesterov=False)


def _step_location(sd: StateDict) -> tuple[dict[str, Any], str]:
    for entry in sd["state"].values():
        if isinstance(entry, dict) and "step" in entry:
            return entry, "step"
    for group in sd["param_groups"]:
        if "step" in group:
            return group, "step"
    raise LookupError("no step")


def _has_step(sd: StateDict) -> bool:
    try:
        _step_location(sd)
    except LookupError:
        return False
    return True


def _set_step(value: Any) -> Callable[[StateDict], None]:
    def mutate(sd: StateDict) -> None:
        for entry in [*sd["state"].values(), *sd["param_groups"]]:
            if isinstance(entry, dict) and "step" in entry:
                entry["step"] = value

    return mutate


def _swap_master_kind(sd: StateDict) -> None:
    index = _target(sd, needs="master_param")
    master = sd["state"][index]["master_param"]
    if master.dtype == torch.int16:  # remainder expected: give a full FP32 master instead
        sd["state"][index]["master_param"] = torch.zeros(master.shape, dtype=torch.float32)
    else:  # full master expected: give an int16 remainder instead
        sd["state"][index]["master_param"] = torch.zeros(master.shape, dtype=torch.int16)


def _wrong_master_numel(sd: StateDict) -> None:
    index = _target(sd, needs="master_param")
    master = sd["state"][index]["master_param"]
    sd["state"][index]["master_param"] = torch.zeros(master.numel() + 1, dtype=master.dtype)


def _rename_key(sd: StateDict) -> None:
    index = _target(sd)
    sd["state"][str(index)] = sd["state"].pop(index)


def _drop_hyper_parameter(sd: StateDict) -> None:
    group = sd["param_groups"][0]
    del group["lr"]


def _duplicate_param_id(sd: StateDict) -> None:
    params = sd["param_groups"][-1]["params"]
    params[-1] = params[0] if len(params) > 1 else sd["param_groups"][0]["params"][0]


CATALOGUE: tuple[BadCase, ...] = (
    # --- structure (torch's own loader rejects these) ---
    BadCase(
        "not_a_mapping",
        lambda sd: [sd["state"], sd["param_groups"]],
        r"state|dict|list",
        torch_rejects=True,
        replaces=True,
    ),
    BadCase(
        "missing_param_groups",
        lambda sd: sd.pop("param_groups"),
        r"param_groups|parameter groups",
        torch_rejects=True,
    ),
    BadCase(
        "truncated_param_groups", lambda sd: sd["param_groups"].pop(), r"group", torch_rejects=True
    ),
    BadCase(
        "empty_param_groups", lambda sd: sd["param_groups"].clear(), r"group", torch_rejects=True
    ),
    BadCase(
        "extra_param_group",
        lambda sd: sd["param_groups"].append(dict(sd["param_groups"][-1], params=[1000])),
        r"group",
        torch_rejects=True,
    ),
    BadCase(
        "param_missing_from_group",
        lambda sd: sd["param_groups"][0]["params"].pop(),
        r"group|param",
        torch_rejects=True,
        applies=lambda sd: len(sd["param_groups"][0]["params"]) > 0,
    ),
    BadCase(
        "param_added_to_group",
        lambda sd: sd["param_groups"][0]["params"].append(1000),
        r"group|param",
        torch_rejects=True,
    ),
    # --- structure torch accepts silently ---
    BadCase("missing_state", lambda sd: sd.pop("state"), r"state"),
    BadCase("duplicate_param_id", _duplicate_param_id, r"param|duplicate|twice|unique"),
    BadCase("unknown_param_index", lambda sd: sd["state"].update({1000: {}}), r"1000"),
    BadCase("string_param_index", _rename_key, r"param|index|'\d+'"),
    BadCase("missing_hyper_parameter", _drop_hyper_parameter, r"lr"),
    BadCase(
        "wrong_hyper_parameter_type", lambda sd: sd["param_groups"][0].update(lr="fast"), r"lr"
    ),
    # --- per-parameter state ---
    BadCase(
        "wrong_shape",
        _set_state(_moment, lambda t: torch.zeros(t.numel() + 1, dtype=t.dtype)),
        r"shape|numel|elements|size",
        applies=_has_state,
    ),
    BadCase(
        "wrong_dtype_integer",
        _set_state(_moment, lambda t: torch.zeros(t.shape, dtype=torch.int32)),
        r"dtype|int32|float",
        applies=_has_state,
    ),
    BadCase(
        "state_not_a_tensor",
        _set_state(_moment, lambda t: t.tolist()),
        r"tensor|Tensor|list",
        applies=_has_state,
    ),
    BadCase(
        "missing_state_name",
        _drop_state_name,
        r"exp_avg_sq|missing|momentum_buffer",
        applies=_has_state,
    ),
    BadCase(
        "extra_state_name",
        lambda sd: sd["state"][_target(sd)].update(bogus=torch.zeros(1)),
        r"bogus",
        applies=_has_state,
    ),
    BadCase(
        "per_param_state_not_a_dict",
        lambda sd: sd["state"].update({_target(sd): None}),
        r"state|dict|None",
        applies=_has_state,
    ),
    BadCase(
        "nan_state", _set_state(_moment, _poison(math.nan)), r"nan|NaN|finite", applies=_has_state
    ),
    BadCase("inf_state", _set_state(_moment, _poison(math.inf)), r"inf|finite", applies=_has_state),
    BadCase(
        "negative_second_moment",
        _set_state(lambda sd: "exp_avg_sq", _poison(-1.0)),
        r"exp_avg_sq|negative",
        applies=_has("exp_avg_sq"),
    ),
    BadCase("wrong_step_type", _set_step("three"), r"step", applies=_has_step),
    BadCase("negative_step", _set_step(-1), r"step", applies=_has_step),
    BadCase(
        "other_optimizer_class",
        _other_class,
        r"momentum_buffer|exp_avg|SGD|state",
        applies=lambda sd: _has_state(sd) and _moment(sd) != "momentum_buffer",
    ),
    # --- masters and remainders ---
    BadCase(
        "remainder_master_mismatch",
        _swap_master_kind,
        r"master|remainder|int16|float32",
        applies=_has_master,
    ),
    BadCase("wrong_master_numel", _wrong_master_numel, r"master", applies=_has_master),
)


def bad_copy(case: BadCase, good: StateDict) -> Any:
    """The bad checkpoint of ``case``, made from a fresh copy of ``good``."""
    sd = checkpoint_roundtrip(good)
    result = case.mutate(sd)
    return result if case.replaces else sd
