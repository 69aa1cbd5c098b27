"""The FP32 master copies inside hybrid (CPU/GPU) offload optimizers, seen uniformly
(``MasterCopies``) for the portable ``HybridOffloadOptimizer`` and Megatron's
``HybridDeviceOptimizer``, found by structure in any stack (docs/hybrid.md, "How it works").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder
from wrapped_optim._adapters.walk import LeafContext, walk_leaves

__all__ = [
    "HybridOffloadHolder",
    "MasterCopies",
    "WeightWatch",
    "find_hybrid_offload",
    "hybrid_master_copies",
    "is_hybrid_offload",
    "is_megatron_hdo",
    "keeps_per_param_step",
    "leaf_master_copies",
    "push_state_to_sub_optimizers",
    "restore_omitted_state",
]

_HDO_ATTRIBUTES = (
    "gpu_params_map_cpu_copy",
    "param_to_fp32_param",
    "sub_optimizers",
    "update_fp32_param_by_new_param",
)


@attrs.frozen(eq=False)
class MasterCopies:
    """One model weight and every copy of it that a hybrid offload optimizer keeps.

    Attributes:
        name: where the weight lives, for error messages.
        weight: the model weight (or its slice owned by this rank), in the model dtype.
        master: the authoritative copy: what the optimizer steps and saves as ``master_param``.
        copies: every other copy that must equal ``master`` (host clones, FP32 working copies,
            distributed-optimizer main shards); never ``weight`` or ``master`` themselves.

    Example:
        >>> import torch
        >>> w = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
        >>> entry = MasterCopies("w", w, torch.tensor([1.0, 2.001]), (torch.zeros(2),))
        >>> entry.stale_levels()
        ['copy 0']
        >>> entry.refresh_from_weight()
        >>> entry.stale_levels(), entry.master.tolist()
        ([], [1.0, 2.0])
    """

    name: str
    weight: torch.Tensor
    master: torch.Tensor
    copies: tuple[torch.Tensor, ...] = ()

    def levels(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The master and each copy, with a label.

        Example:
            >>> import torch
            >>> entry = MasterCopies("w", torch.ones(1), torch.ones(1), (torch.ones(1),))
            >>> [label for label, _ in entry.levels()]
            ['master', 'copy 0']
        """
        yield "master", self.master
        for index, copy in enumerate(self.copies):
            yield f"copy {index}", copy

    @torch.no_grad()
    def stale_levels(self) -> list[str]:
        """Labels of the levels that, rounded to the model dtype, differ from the weight.

        One comparison per level, on the level's device (the weight moves, never the copy).

        Example:
            >>> import torch
            >>> w = torch.tensor([1.0], dtype=torch.bfloat16)
            >>> MasterCopies("w", w, torch.tensor([1.0001])).stale_levels()  # rounds to w
            []
        """
        stale = []
        for label, level in self.levels():
            if level.numel() != self.weight.numel():  # resized behind the optimizer's back
                stale.append(label)
                continue
            weight = self.weight.reshape(level.shape).to(level.device)
            rounded = level if level.dtype == weight.dtype else level.to(weight.dtype)
            if not torch.equal(rounded, weight):
                stale.append(label)
        return stale

    @torch.no_grad()
    def refresh_from_weight(self) -> None:
        """Model-only sync: every level takes the value of the model weight.

        Example:
            >>> import torch
            >>> entry = MasterCopies("w", torch.ones(2), torch.zeros(2), (torch.zeros(2),))
            >>> entry.refresh_from_weight()
            >>> entry.master.tolist(), entry.copies[0].tolist()
            ([1.0, 1.0], [1.0, 1.0])
        """
        for label, level in self.levels():
            if level.numel() != self.weight.numel():
                raise RuntimeError(
                    f"{self.name}: the weight has {self.weight.numel()} elements, its {label} "
                    f"{level.numel()}: it was resized after the optimizer was built; build a "
                    "new optimizer for the new shapes"
                )
        for _, level in self.levels():
            level.copy_(self.weight.reshape(level.shape))

    @torch.no_grad()
    def push_master(self) -> None:
        """Full-state sync: every copy and the model weight take the master's value.

        Example:
            >>> import torch
            >>> w = torch.zeros(1, dtype=torch.bfloat16)
            >>> entry = MasterCopies("w", w, torch.tensor([1.00390625]), (torch.zeros(1),))
            >>> entry.push_master()
            >>> w.tolist(), entry.copies[0].tolist()
            ([1.0], [1.00390625])
        """
        for copy in self.copies:
            copy.copy_(self.master.reshape(copy.shape))
        self.weight.copy_(self.master.reshape(self.weight.shape))


@attrs.define(eq=False)
class WeightWatch:
    """Which model weights were written since the optimizer's own last write, by their
    version counters (``Tensor._version`` moves on every in-place write: a
    ``load_state_dict``, a ``copy_``, an optimizer step) and storage (a ``.data`` swap).

    Recorded after the optimizer's own writes; before the next step only the entries whose
    weight :meth:`moved` are compared value by value with their masters, so a step where
    nobody else wrote a weight costs one attribute read per weight.

    Example:
        >>> import torch
        >>> w = torch.ones(2)
        >>> watch = WeightWatch()
        >>> watch.record([MasterCopies("w", w, torch.ones(2))])
        >>> watch.moved()
        []
        >>> _ = w.add_(1)  # written behind the optimizer's back
        >>> [entry.name for entry in watch.moved()]
        ['w']
    """

    _entries: list[MasterCopies] = attrs.field(factory=list)
    # (entry, its weight's version, its weight's storage) after the optimizer's last write.
    _marks: list[tuple[MasterCopies, int, int]] = attrs.field(factory=list)

    def record(self, entries: Iterable[MasterCopies]) -> None:
        """Watches ``entries`` from now on, their weights as they are now."""
        self._entries = list(entries)
        self.refresh()

    def refresh(self) -> None:
        """The watched weights as they are now (after the optimizer's own writes)."""
        self._marks = [
            (entry, entry.weight._version, entry.weight.data_ptr()) for entry in self._entries
        ]

    def moved(self) -> list[MasterCopies]:
        """The entries whose weight was written (or swapped) since the last record."""
        return [
            entry
            for entry, version, storage in self._marks
            if (entry.weight._version, entry.weight.data_ptr()) != (version, storage)
        ]


@runtime_checkable
class HybridOffloadHolder(Protocol):
    """A hybrid offload optimizer that lists its master copies itself.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> isinstance(HybridOffloadOptimizer([p], lr=0.1), HybridOffloadHolder)
        True
    """

    sub_optimizers: Any

    def master_copies(self) -> list[MasterCopies]:
        """One entry per parameter that has a copy distinct from the parameter itself."""
        ...


def is_megatron_hdo(obj: Any) -> bool:
    """Whether ``obj`` looks like megatron-core's HybridDeviceOptimizer (by its attributes).

    Example:
        >>> import torch
        >>> is_megatron_hdo(torch.optim.SGD([torch.ones(1)], lr=1))
        False
    """
    return isinstance(obj, torch.optim.Optimizer) and all(
        hasattr(obj, name) for name in _HDO_ATTRIBUTES
    )


def is_hybrid_offload(obj: Any) -> bool:
    """Whether ``obj`` is a hybrid offload optimizer this package can keep in sync.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> is_hybrid_offload(HybridOffloadOptimizer([p], lr=0.1))
        True
        >>> is_hybrid_offload(torch.optim.AdamW([p]))
        False
    """
    if obj is None:
        return False
    return _lists_own_copies(obj) or is_megatron_hdo(obj)


def _lists_own_copies(obj: Any) -> bool:
    # The protocol check proves the attribute exists; a data attribute of that name is no method.
    return isinstance(obj, HybridOffloadHolder) and callable(obj.master_copies)


def _hybrid_leaves(stack: Any) -> Iterator[LeafContext]:
    for leaf in walk_leaves(stack):
        if not leaf.is_stub and is_hybrid_offload(leaf.optimizer):
            yield leaf


def find_hybrid_offload(stack: Any) -> list[Any]:
    """Every hybrid offload optimizer in ``stack`` (wrappers, Megatron containers), in order.

    Example:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> opt = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> find_hybrid_offload(OptimizerWrapper(opt)) == [opt]
        True
    """
    return [leaf.optimizer for leaf in _hybrid_leaves(stack)]


def _megatron_hdo_master_copies(hdo: Any) -> list[MasterCopies]:
    """Levels 2 and 3 of a Megatron HybridDeviceOptimizer: host clones, FP32 working copies."""
    inner_of = getattr(hdo, "param_to_inner_param", {})
    entries = []
    for group_index, group in enumerate(hdo.param_groups):
        for index, param in enumerate(group["params"]):
            candidates = (
                hdo.gpu_params_map_cpu_copy.get(param),
                hdo.param_to_fp32_param.get(param),
                inner_of.get(param),
            )
            levels: list[torch.Tensor] = []
            for tensor in candidates:
                if (
                    tensor is not None
                    and tensor is not param
                    and all(tensor is not seen for seen in levels)
                ):
                    levels.append(tensor)
            if not levels:
                continue
            state = hdo.state.get(param)  # a torch optimizer's state: always a dict
            saved = state.get("master_param") if state else None
            master = saved if isinstance(saved, torch.Tensor) and saved is not param else levels[-1]
            copies = tuple(level for level in levels if level is not master)
            entries.append(
                MasterCopies(f"group {group_index} param {index}", param, master, copies)
            )
    return entries


def _with_distributed_level(leaf: LeafContext, entries: list[MasterCopies]) -> list[MasterCopies]:
    """Adds level 1: a DistributedOptimizer's FP32 main shards of its 16-bit model params."""
    container = leaf.container
    shard_groups = getattr(container, "shard_fp32_from_float16_groups", None)
    model_groups = getattr(container, "model_float16_groups", None)
    range_map = getattr(container, "_get_model_param_range_map", None)
    if shard_groups is None or model_groups is None or range_map is None:
        return entries
    model_slice_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for model_group, shard_group in zip(model_groups, shard_groups, strict=True):
        for model_param, shard_main in zip(model_group, shard_group, strict=True):
            if shard_main is None:  # precision-aware: the optimizer holds the masters itself
                continue
            param_range = range_map(model_param)["param"]
            weight = model_param.detach().view(-1)[param_range.start : param_range.end]
            model_slice_of[id(shard_main)] = (shard_main, weight)
    if not model_slice_of:
        return entries
    result = []
    for entry in entries:
        found = model_slice_of.pop(id(entry.weight), None)
        if found is None:
            result.append(entry)
            continue
        shard_main, weight = found
        result.append(MasterCopies(entry.name, weight, entry.master, (shard_main, *entry.copies)))
    for position, (shard_main, weight) in enumerate(model_slice_of.values()):
        result.append(MasterCopies(f"main shard {position}", weight, shard_main))
    return result


def hybrid_master_copies(stack: Any) -> list[MasterCopies]:
    """Every master copy of every hybrid offload optimizer in ``stack``, at every level.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> [entry.master.dtype for entry in hybrid_master_copies(
        ...     HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1))]
        [torch.float32]
    """
    return [entry for _, entries in leaf_master_copies(stack) for entry in entries]


def leaf_master_copies(stack: Any) -> list[tuple[Any, list[MasterCopies]]]:
    """Each hybrid offload optimizer in ``stack`` with its master copies, at every level.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = HybridOffloadOptimizer([p], offload_fraction=1.0, lr=0.1)
        >>> [(hybrid is opt, len(entries)) for hybrid, entries in leaf_master_copies(opt)]
        [(True, 1)]
    """
    result: list[tuple[Any, list[MasterCopies]]] = []
    for leaf in _hybrid_leaves(stack):
        optimizer = leaf.optimizer
        if _lists_own_copies(optimizer):
            own = list(optimizer.master_copies())
        else:
            own = _megatron_hdo_master_copies(optimizer)
        result.append(
            (
                optimizer,
                [
                    attrs.evolve(entry, name=f"optimizer {leaf.index}: {entry.name}")
                    for entry in _with_distributed_level(leaf, own)
                ],
            )
        )
    return result


def push_state_to_sub_optimizers(stack: Any) -> None:
    """Makes each hybrid optimizer's sub-optimizers step the state it exposes.

    Megatron's loaders write restored state into the hybrid optimizer's ``state`` (keyed by
    its params, possibly on the wrong device: some of its loaders skip the device fix-up); the
    sub-optimizers step their own ``state`` (keyed by the copies). This moves every state
    tensor but ``step`` to its copy's device and re-links each sub-optimizer entry to the
    exposed dict. Precision-aware sub-optimizers are left alone: their state is loaded
    through ``set_scaled_state``, and the exposed dict is only a view of their storage.

    Example:
        >>> import torch
        >>> push_state_to_sub_optimizers(torch.optim.SGD([torch.ones(1)], lr=1))  # no HDO: no-op
    """
    for leaf in _hybrid_leaves(stack):
        hdo = leaf.optimizer
        if not is_megatron_hdo(hdo):
            continue
        orig_of = getattr(hdo, "inner_param_to_orig_param", {})
        for sub in hdo.sub_optimizers:
            if is_precision_aware_holder(sub):
                # Its storage is written through set_scaled_state; what the hybrid optimizer
                # exposes is a view of it, never a dict the holder could step.
                continue
            for group in sub.param_groups:
                for copy in group["params"]:
                    orig = orig_of.get(copy, copy)
                    state = hdo.state.get(orig)
                    if not state:
                        continue
                    for key, value in list(state.items()):
                        if (
                            isinstance(value, torch.Tensor)
                            and key != "step"
                            and value.device != copy.device
                        ):
                            state[key] = value.to(copy.device)
                    # An in-place view (our HybridOffloadOptimizer's host entries) wraps the
                    # sub-optimizer's own dict: that dict is what the sub-optimizer steps.
                    live = getattr(state, "entries", state)
                    sub.state[copy] = live


def keeps_per_param_step(stack: Any) -> bool:
    """Whether the optimizers of ``stack`` keep a per-parameter ``"step"`` (torch's Adam family)
    rather than one step per group (TE FusedAdam and other precision-aware holders).

    True when any leaf's state already has a per-parameter step, False when every leaf is a
    precision-aware holder, True otherwise (torch's layout; a hybrid optimizer over
    precision-aware sub-optimizers accepts a per-parameter step that matches its group's).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> keeps_per_param_step(torch.optim.AdamW([p])), keeps_per_param_step(
        ...     PrecisionAwareAdamW([p]))
        (True, False)
    """
    leaves = [
        leaf.optimizer
        for leaf in walk_leaves(stack)
        if not leaf.is_stub and leaf.optimizer is not None
    ]
    for optimizer in leaves:  # torch optimizers (walk_leaves): their state is a dict
        if any(isinstance(e, Mapping) and "step" in e for e in optimizer.state.values()):
            return True
    return not (leaves and all(is_precision_aware_holder(o) for o in leaves))


def restore_omitted_state(state_dict: Any, *, per_param_step: bool = True) -> Any:
    """A torch-format optimizer state dict with what Megatron-style payloads omit put back.

    - a per-parameter ``"step"`` missing while the parameter's group has a ``"step"``: the
      group's step, as the float32 tensor torch's Adam family keeps — only with
      ``per_param_step`` (see :func:`keeps_per_param_step`): an optimizer that keeps one
      step per group (FusedAdam's layout) would reject it;
    - a ``"master_param"`` missing while the entry has the checkpoint's FP32 param
      (``"fp32_param"``): that tensor, under the name the hybrid optimizer loads.

    Returns a new dict (shallow copies where something changed); the caller's dict and tensors
    are never modified. Other formats (Megatron's nested dicts, ChainedOptimizer lists) are
    returned as they are: Megatron's own loaders are repaired by
    :func:`wrapped_optim._adapters.megatron_checkpoint.megatron_load_repairs`.

    Example:
        >>> import torch
        >>> sd = {"state": {0: {"exp_avg": torch.zeros(2), "fp32_param": torch.ones(2)}},
        ...       "param_groups": [{"params": [0], "step": 3}]}
        >>> fixed = restore_omitted_state(sd)
        >>> sorted(fixed["state"][0]), fixed["state"][0]["step"].item()
        (['exp_avg', 'master_param', 'step'], 3.0)
        >>> sorted(sd["state"][0])
        ['exp_avg', 'fp32_param']
    """
    if not isinstance(state_dict, Mapping):
        return state_dict
    states = state_dict.get("state")
    groups = state_dict.get("param_groups")
    if not isinstance(states, Mapping) or not isinstance(groups, list):
        return state_dict
    result = dict(state_dict)
    group_step: dict[Any, Any] = {}
    for group in groups:
        if isinstance(group, Mapping) and "step" in group:
            for index in group.get("params", ()):
                group_step[index] = group["step"]
    restored: dict[Any, Any] = {}
    for index, entry in states.items():
        if not isinstance(entry, Mapping):
            restored[index] = entry
            continue
        fixed = dict(entry)
        if (
            per_param_step
            and "step" not in fixed
            and index in group_step
            and group_step[index] is not None
        ):
            # float() reads a number and a one-element tensor alike.
            fixed["step"] = torch.tensor(float(group_step[index]), dtype=torch.float32)
        if "master_param" not in fixed and isinstance(fixed.get("fp32_param"), torch.Tensor):
            fixed["master_param"] = fixed.pop("fp32_param")
        restored[index] = fixed
    result["state"] = restored
    return result
