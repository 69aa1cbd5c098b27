"""The model-space form every converted format is read into and written from.

A checkpoint in any runtime's layout says, per parameter (by its fully qualified name), what
the optimizer keeps: state tensors (``exp_avg``, ``exp_avg_sq``, ...; the FP32 master under
``MASTER`` when the format holds one) and the step count; per group, the hyper-parameters and
which names belong to it. Readers describe that in an ``StateIndex`` first, then hand out one
whole (unsharded, unpadded, CPU) tensor at a time, so a conversion holds at most the largest
tensor plus one chunk, whatever the checkpoint's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import attrs
import torch


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(size) for size in value)


def _params(value: Iterable[ParamRecord]) -> tuple[ParamRecord, ...]:
    return tuple(value)


def _groups(value: Iterable[GroupRecord]) -> tuple[GroupRecord, ...]:
    return tuple(value)


def _strs(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


MASTER = "master"
"""The state key of a parameter's FP32 (or FP16) master copy, where the format keeps one."""


@attrs.frozen
class TensorSpec:
    """What a state tensor is, without its values: shape and the dtype its values come in."""

    shape: tuple[int, ...] = attrs.field(converter=_ints)
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


@attrs.frozen
class ParamRecord:
    """One parameter's optimizer state, by name.

    ``step`` is the parameter's own step count (a group-wide count, as Megatron and TE keep
    it, is given to every member); None where the optimizer keeps none (SGD without
    momentum, a parameter that never stepped).
    """

    name: str
    group: int
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    state: Mapping[str, TensorSpec]
    step: float | None = None

    def __attrs_post_init__(self) -> None:
        for key, spec in self.state.items():
            if spec.shape != self.shape and spec.numel != 0:
                raise ValueError(
                    f"parameter {self.name!r}: state {key!r} has shape {spec.shape}, the "
                    f"parameter {self.shape}"
                )


@attrs.frozen
class GroupRecord:
    """One param group: its hyper-parameters (``params`` excluded) and members, in order."""

    options: Mapping[str, Any]
    names: tuple[str, ...] = attrs.field(converter=_strs)


@attrs.frozen
class StateIndex:
    """Everything about a checkpoint except the tensors' values.

    ``source`` names the format it was read from; ``notes`` carries what a writer may need
    and the canonical form has no field for (e.g. the optimizer class a file was written by).
    """

    params: tuple[ParamRecord, ...] = attrs.field(converter=_params)
    groups: tuple[GroupRecord, ...] = attrs.field(converter=_groups)
    source: str
    notes: Mapping[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        names = [param.name for param in self.params]
        if len(set(names)) != len(names):
            raise ValueError("a parameter name appears twice in the optimizer state")
        members = [name for group in self.groups for name in group.names]
        if sorted(members) != sorted(names):
            raise ValueError("the param groups' members are not the parameters, once each")

    def param(self, name: str) -> ParamRecord:
        for param in self.params:
            if param.name == name:
                return param
        raise KeyError(f"no parameter {name!r} in the optimizer state")


class StateReader(Protocol):
    """A checkpoint opened for reading in the canonical form."""

    def index(self) -> StateIndex:
        """The checkpoint's parameters, groups and state specs, read without any values."""
        ...

    def read(self, name: str, key: str) -> torch.Tensor:
        """Parameter ``name``'s state ``key``: whole, in model space, on the CPU, in the dtype
        ``index()`` gives it.

        The tensor is handed over: a writer may free its storage once written. A reader
        that keeps the values (a cache, a file mapping) returns a view of them
        (``tensor.view(tensor.shape)``), which writers never free."""
        ...

    def close(self) -> None: ...


class StateWriter(Protocol):
    """A destination in some format; ``write`` pulls one tensor at a time from ``reader``."""

    def write(self, index: StateIndex, reader: StateReader) -> None: ...


def iter_tensors(index: StateIndex, reader: StateReader) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Every state tensor of ``index`` in its order, one alive at a time."""
    for param in index.params:
        for key in param.state:
            yield param.name, key, reader.read(param.name, key)
