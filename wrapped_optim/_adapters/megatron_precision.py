"""Scoped repairs of megatron-core's parameter-state loader for a precision-aware
DistributedOptimizer (``use_precision_aware_optimizer=True``, TE's FusedAdam or
PrecisionAwareAdamW inside), entered by
:func:`wrapped_optim._adapters.megatron_checkpoint.megatron_load_repairs`.

Each repair is installed for one load call, only while a probe (Core's own function run on a
stand-in) shows the defect, and is named with the Core version seen
(docs/guides/megatron_bridge.md lists them):

* ``padding``: dp_reshardable's ``load_parameter_state_from_dp_reshardable`` passes each
  entry's ``padding`` flag (and its bucket offsets) to ``_set_main_param_and_optimizer_states``,
  which forwards every key to ``set_scaled_state`` (Megatron-Bridge #1730);
* ``remainder``: with ``store_param_remainders`` (Core's default), fully_reshardable and the
  legacy format save through ``get_parameter_state_dp_zero``, which copies the int16 remainder
  into a float32 buffer; the load hands that float32 back to
  ``set_scaled_state("master_param")``, which takes int16. The float32 holds the int16
  values exactly; the repair turns it back, and refuses a float32 that is not such a copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

__all__ = ["core_version", "precision_setter_repairs"]

_SETTER = "_set_main_param_and_optimizer_states"
_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")


def core_version() -> str:
    """``"megatron-core <version>"`` of the installed Core (what a repair's name carries).

    Example:
        >>> core_version().startswith("megatron-core ")
        True
    """
    try:
        from megatron.core import __version__
    except ImportError:  # the repairs run only with Core installed
        return "megatron-core (not installed)"
    return f"megatron-core {__version__}"


class _Recorder:
    """The inner optimizer of the probe: records what ``set_scaled_state`` receives."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param_groups = [{"params": [param]}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {param: {}}
        self.received: dict[str, torch.dtype] = {}

    def set_scaled_state(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        self.received[name] = value.dtype


@functools.cache
def _setter_defects(setter: Callable[..., Any]) -> tuple[bool, bool]:
    """(forwards ``padding``, hands a float32 remainder back) for Core's setter, run on a
    precision-aware stand-in with a dp_reshardable entry of a remainder configuration as the
    dp_zero loaders build it (float32)."""
    param = torch.zeros(2, dtype=torch.bfloat16)
    inner = _Recorder(param)
    stand_in = SimpleNamespace(
        model_param_group_index_map={param: (0, 0)},
        config=SimpleNamespace(
            use_precision_aware_optimizer_no_fp8_or_ds_fp8=True,
            store_param_remainders=True,
            bf16=True,
        ),
        optimizer=inner,
    )
    payload = {
        "param": torch.zeros(2),
        "exp_avg": torch.zeros(2),
        "exp_avg_sq": torch.zeros(2),
        "padding": False,
    }
    try:
        setter(stand_in, param, payload)
    except Exception:  # not shown to be fixed: keep both repairs (each checks what it sees)
        return True, True
    return "padding" in inner.received, inner.received.get("master_param") == torch.float32


def _is_precision_aware(container: Any) -> bool:
    config = getattr(container, "config", None)
    inner = getattr(container, "optimizer", None)
    return bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", False)) and (
        callable(getattr(inner, "set_scaled_state", None))
        and not hasattr(inner, "sub_optimizers")  # HybridDeviceOptimizer keeps state as is
    )


def _remainder_from_float32(value: torch.Tensor, where: str) -> torch.Tensor:
    """The int16 remainder Core's dp_zero buffer holds as float32, exactly; a float32 that is
    not such a copy (an FP32 master from another configuration) is refused."""
    as_int = value.to(torch.int16)
    if not torch.equal(as_int.to(torch.float32), value):
        raise ValueError(
            f"{where}: the checkpoint's 'param' is an FP32 master, but this optimizer keeps "
            "its master as a bf16 parameter plus an int16 remainder (store_param_remainders): "
            "load it into an optimizer built with store_param_remainders=False, or resume from "
            "a checkpoint saved with remainders"
        )
    return as_int


def _repaired_setter(
    container: Any, original: Callable[..., Any], *, padding: bool, remainder: bool
) -> Callable[..., Any]:
    """Core's setter given only the states the inner optimizer holds (``padding``), and the
    int16 remainder back from its float32 copy (``remainder``)."""

    def set_main_param_and_optimizer_states(model_param: Any, tensors: Any) -> Any:
        group_index, group_order = container.model_param_group_index_map[model_param]
        inner = container.optimizer
        target = inner.param_groups[group_index]["params"][group_order]
        tensors = dict(tensors)
        if padding:
            tensors = {k: v for k, v in tensors.items() if k == "param" or k in _STATE_NAMES}
        master = inner.state.get(target, {}).get("master_param")
        value = tensors.get("param")
        if (
            remainder
            and isinstance(master, torch.Tensor)
            and master.dtype == torch.int16
            and isinstance(value, torch.Tensor)
            and value.dtype == torch.float32
        ):
            tensors["param"] = _remainder_from_float32(value, f"parameter {group_order}")
        return original(model_param, tensors)

    return set_main_param_and_optimizer_states


def precision_setter_repairs(container: Any) -> tuple[list[str], Callable[..., Any] | None]:
    """The names of the repairs ``container`` (a DistributedOptimizer) needs on this Core, and
    its repaired setter (None when none is needed).

    Example:
        >>> import torch
        >>> precision_setter_repairs(torch.optim.SGD([torch.ones(1)], lr=1))
        ([], None)
    """
    if not _is_precision_aware(container):
        return [], None
    function = getattr(type(container), _SETTER, None)
    if function is None:
        return [], None
    padding, remainder = _setter_defects(function)
    version = core_version()
    names = []
    if padding:
        names.append(f"dp_reshardable 'padding' kept from set_scaled_state ({version})")
    if remainder:
        names.append(f"int16 remainder restored from Core's float32 copy ({version})")
    if not names:
        return [], None
    original = getattr(container, _SETTER)
    return names, _repaired_setter(container, original, padding=padding, remainder=remainder)
