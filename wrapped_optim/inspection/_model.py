"""The reports inspection returns, and the value model both checkpoint kinds are read into."""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

# Marks a state dict rebuilt from the flattened layout, whose groups are one per parameter.
_FLAT_MARK = "__wrapped_optim_flattened__"

# How deep to look for optimizer state dicts inside a checkpoint's containers
# ({"optim": ...}, {"optimizer": {"optimizer": ...}}, a ChainedOptimizer's list, ...).
_SEARCH_DEPTH = 4


class StateFormat(enum.Enum):
    """The layout an optimizer state dict was written in.

    Attributes:
        TORCH: ``torch.optim``'s: per-parameter ``step`` tensors beside the moments.
        PRECISION_AWARE: TE FusedAdam's portable format (and ``PrecisionAwareAdamW``'s): FP32
            moments and masters, the step counter in ``param_groups``.
        REMAINDER_MASTERS: the same with an int16 ``master_param`` holding the low 16 bits of
            each FP32 master beside bf16 params (``store_param_remainders``).
        EMPTY: no per-parameter state (the optimizer has not stepped yet).

    Examples:
        >>> from wrapped_optim.inspection import StateFormat
        >>> StateFormat.PRECISION_AWARE.value
        'precision-aware FP32-expanded state (TE FusedAdam portable format)'
    """

    TORCH = "torch optimizer state"
    PRECISION_AWARE = "precision-aware FP32-expanded state (TE FusedAdam portable format)"
    REMAINDER_MASTERS = "precision-aware state with remainder masters (int16 master_param)"
    EMPTY = "no per-parameter state (the optimizer has not stepped yet)"


@attrs.frozen
class StateTensor:
    """One tensor of per-parameter optimizer state.

    Attributes:
        param: the parameter's key in ``state`` (an index, or a name in DCP checkpoints).
        name: the state's name (``exp_avg``, ``step``, ``master_param``, ...).
        dtype: its dtype as saved.
        shape: its shape as saved (the global shape for a sharded DCP tensor).
        nbytes: its size in bytes.

    Examples:
        >>> import torch
        >>> from wrapped_optim.inspection._model import StateTensor
        >>> StateTensor("0", "exp_avg", torch.bfloat16, (4, 8), 64).nbytes
        64
    """

    param: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen
class ParamGroupReport:
    """One parameter group: how many params it holds and its options.

    Attributes:
        index: the group's position in ``param_groups``.
        num_params: the length of its ``params`` list.
        options: every other entry as ``(name, repr(value))``, in saved order.

    Examples:
        >>> from wrapped_optim.inspection._model import ParamGroupReport
        >>> group = ParamGroupReport(0, 2, (("lr", "0.001"),))
        >>> group.option("lr")
        '0.001'
    """

    index: int
    num_params: int
    options: tuple[tuple[str, str], ...]

    def option(self, name: str) -> str | None:
        """Looks up one option of the group.

        Args:
            name: The option's name (``"lr"``, ``"betas"``, ...).

        Returns:
            The option's value as its repr, or ``None`` when the group has no such option.

        Examples:
            >>> from wrapped_optim.inspection._model import ParamGroupReport
            >>> print(ParamGroupReport(0, 1, (("lr", "0.1"),)).option("eps"))
            None
        """
        return dict(self.options).get(name)


@attrs.frozen
class OptimizerReport:
    """One optimizer state dict found in a checkpoint.

    Attributes:
        location: where it sits in the checkpoint (``""`` for the top level, else a path such
            as ``optim`` or ``[1]``).
        format: the detected ``StateFormat``.
        tensors: every per-parameter state tensor, in saved order.
        steps: the distinct step counters found (per-parameter ``step`` states, else the
            ``step`` option of the param groups), ascending.
        step_source: ``"per-parameter"``, ``"param_groups"`` or ``"none"``.
        param_groups: one report per group.
        notes: anything unusual worth a reader's attention.

    Examples:
        >>> import torch
        >>> from wrapped_optim.inspection._model import (OptimizerReport, StateFormat,
        ...     StateTensor)
        >>> report = OptimizerReport(
        ...     location="", format=StateFormat.TORCH,
        ...     tensors=(StateTensor("0", "exp_avg", torch.float32, (2,), 8),),
        ...     steps=(1,), step_source="per-parameter", param_groups=(), notes=())
        >>> report.total_bytes, report.num_params
        (8, 1)
    """

    location: str
    format: StateFormat
    tensors: tuple[StateTensor, ...]
    steps: tuple[int | float, ...]
    step_source: Literal["per-parameter", "param_groups", "none"]
    param_groups: tuple[ParamGroupReport, ...]
    notes: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all per-parameter state tensors together, as saved (not FP32-expanded).

        Examples:
            >>> import torch
            >>> from wrapped_optim.inspection._model import (OptimizerReport, StateFormat,
            ...     StateTensor)
            >>> OptimizerReport("", StateFormat.TORCH, (
            ...     StateTensor("0", "exp_avg", torch.bfloat16, (4,), 8),
            ...     StateTensor("0", "exp_avg_sq", torch.float32, (4,), 16),
            ... ), (), "none", (), ()).total_bytes
            24
        """
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        """How many parameters have state; a parameter never stepped has none and is not counted.

        Examples:
            >>> import torch
            >>> from wrapped_optim.inspection._model import (OptimizerReport, StateFormat,
            ...     StateTensor)
            >>> OptimizerReport("", StateFormat.TORCH, (
            ...     StateTensor("0", "exp_avg", torch.float32, (2,), 8),
            ...     StateTensor("0", "exp_avg_sq", torch.float32, (2,), 8),
            ...     StateTensor("1", "exp_avg", torch.float32, (3,), 12),
            ... ), (), "none", (), ()).num_params
            2
        """
        return len({t.param for t in self.tensors})

    @property
    def description(self) -> str:
        """The format with the floating dtypes of its state (steps excluded).

        Examples:
            >>> import torch
            >>> from wrapped_optim.inspection._model import (OptimizerReport, StateFormat,
            ...     StateTensor)
            >>> OptimizerReport("", StateFormat.TORCH,
            ...     (StateTensor("0", "exp_avg", torch.float32, (2,), 8),),
            ...     (), "none", (), ()).description
            'torch optimizer state; floating state FP32'
        """
        floating = {t.dtype for t in self.tensors if t.dtype.is_floating_point and t.name != "step"}
        if not floating:
            return self.format.value
        if floating == {torch.float32}:
            return f"{self.format.value}; floating state FP32"
        kinds = ", ".join(sorted(map(_dtype_name, floating)))
        return f"{self.format.value}; floating state {kinds}"


@attrs.frozen
class CheckpointReport:
    """Everything ``inspect_checkpoint`` found in one checkpoint.

    Attributes:
        path: the inspected file or directory.
        kind: ``"torch.save"`` or ``"dcp"``.
        file_bytes: its size on disk (all files, for a DCP directory).
        optimizers: one report per optimizer state dict found (at least one).

    Examples:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from wrapped_optim.inspection import inspect_checkpoint
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(3)
        >>> opt.step()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save({"optim": opt.state_dict()}, Path(tmp) / "ckpt.pt")
        ...     report = inspect_checkpoint(Path(tmp) / "ckpt.pt")
        >>> report.kind, report.formats
        ('torch.save', ('torch optimizer state',))
        >>> [(t.name, t.dtype, t.shape) for t in report.optimizers[0].tensors]
        [('momentum_buffer', torch.float32, (3,))]
    """

    path: Path
    kind: Literal["torch.save", "dcp"]
    file_bytes: int
    optimizers: tuple[OptimizerReport, ...]

    @property
    def formats(self) -> tuple[str, ...]:
        """The detected format of each optimizer state dict, as text (for printing or matching).

        Examples:
            >>> from pathlib import Path
            >>> from wrapped_optim.inspection._model import (CheckpointReport, OptimizerReport,
            ...     StateFormat)
            >>> empty = OptimizerReport("optim", StateFormat.EMPTY, (), (), "none", (), ())
            >>> CheckpointReport(Path("ckpt.pt"), "torch.save", 0, (empty,)).formats
            ('no per-parameter state (the optimizer has not stepped yet)',)
        """
        return tuple(o.format.value for o in self.optimizers)


# --------------------------------------------------------------------------- value model
# Both sources are turned into one nested structure of dicts and lists whose leaves are
# _TensorInfo (a tensor's dtype and shape) or values. DCP leaves that a report needs are read
# through `fetch`; a torch.save file provides every value directly.


@attrs.frozen
class _TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    key: str | None = None  # the DCP key, to read its value when needed

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@attrs.frozen
class _Pending:
    """A non-tensor DCP entry whose value has not been read yet."""

    key: str


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


Fetch = Callable[[Sequence[str]], dict[str, Any]]


def _no_fetch(keys: Sequence[str]) -> dict[str, Any]:
    raise AssertionError(f"nothing to fetch from a loaded file (asked for {list(keys)})")


def _by_name(tensors: Sequence[StateTensor]) -> dict[str, list[StateTensor]]:
    grouped: dict[str, list[StateTensor]] = {}
    for t in tensors:
        grouped.setdefault(t.name, []).append(t)
    return grouped


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape_text(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _option_text(value: Any) -> str:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return f"tensor({value.item()!r})"
    if isinstance(value, _TensorInfo):
        return f"tensor({_dtype_name(value.dtype)}, {_shape_text(value.shape)})"
    if isinstance(value, _Pending):
        return "<not read>"
    return repr(value)
