"""DeepSpeed universal checkpoints (``ds_to_universal.py``'s output), read in the canonical
form without DeepSpeed.

A universal checkpoint is model space already: ``zero/<parameter name>/<state>.pt`` holds
each parameter's whole FP32 master (``fp32``), moments (``exp_avg``, ``exp_avg_sq``) and
``step``; ``zero/optimizer_state.pt`` the param groups' hyper-parameters; the
``mp_rank_*_model_states.pt`` file beside ``zero/`` the groups' members, in order
(``param_shapes``). Files are memory-mapped, so a read holds one tensor. DeepSpeed's own
objects that ``optimizer_state.pt`` pickles (its loss scaler, an enum) are read as inert
stand-ins: nothing of DeepSpeed is imported or run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from wrapped_optim.checkpoint._convert._canonical import (
    MASTER,
    GroupRecord,
    ParamRecord,
    StateIndex,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._megatron_files import MegatronFormatError

__all__ = ["DEEPSPEED_UNIVERSAL", "DeepSpeedUniversalReader", "is_deepspeed_universal"]

DEEPSPEED_UNIVERSAL = "deepspeed-universal"
_ZERO = "zero"
_COMMON = "optimizer_state.pt"
_KEYS = {"fp32": MASTER}  # every other file name is the state's own name
_STEP = "step"


class DeepSpeedFormatError(MegatronFormatError):
    """A DeepSpeed universal checkpoint that cannot be read as asked."""


def is_deepspeed_universal(path: Path) -> bool:
    """Whether ``path`` is a universal checkpoint directory (``zero/optimizer_state.pt``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     is_deepspeed_universal(Path(d))
        False
    """
    return (path / _ZERO / _COMMON).is_file()


class _Inert:
    """What a DeepSpeed class pickled in ``optimizer_state.pt`` is read as: its state, unrun."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _load(file: Path, *, mmap: bool = False) -> Any:
    """A DeepSpeed ``torch.save`` file, weights-only; the foreign classes it names as inert
    stand-ins."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(file))
        stand_ins = [(type(name.rpartition(".")[2], (_Inert,), {}), name) for name in names]
        with torch.serialization.safe_globals(list[Any](stand_ins)):
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:
        raise DeepSpeedFormatError(
            f"{file}: not readable as a DeepSpeed universal checkpoint ({type(error).__name__})"
        ) from error


def _tensor_of(value: Any, file: Path) -> torch.Tensor:
    tensor = value.get("param") if isinstance(value, Mapping) else value
    if not isinstance(tensor, torch.Tensor):
        raise DeepSpeedFormatError(f"{file}: holds no tensor")
    return tensor


class DeepSpeedUniversalReader:
    """A DeepSpeed universal checkpoint directory, opened in the canonical form.

    Names are DeepSpeed's (the model's parameter names); ``MASTER`` is the FP32 master
    (``fp32.pt``). ``group_of`` places parameters in groups where the checkpoint's model
    states file does not list them (a mapping name -> group index).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     try:
        ...         DeepSpeedUniversalReader(d)
        ...     except ValueError as error:
        ...         "not a DeepSpeed universal checkpoint" in str(error)
        True
    """

    def __init__(self, path: str | Path, *, group_of: Mapping[str, int] | None = None) -> None:
        self.path = Path(path)
        if not is_deepspeed_universal(self.path):
            raise DeepSpeedFormatError(
                f"{self.path}: not a DeepSpeed universal checkpoint (no zero/{_COMMON})"
            )
        common = _load(self.path / _ZERO / _COMMON)
        saved_groups = common.get("param_groups") if isinstance(common, Mapping) else None
        if not isinstance(saved_groups, list) or not saved_groups:
            raise DeepSpeedFormatError(f"{self.path / _ZERO / _COMMON}: no param groups")
        self._files: dict[tuple[str, str], Path] = {}
        records: dict[str, ParamRecord] = {}
        members = self._members(len(saved_groups), group_of)
        for number, names in enumerate(members):
            for name in names:
                records[name] = self._record(name, number)
        groups = [
            GroupRecord(options={k: v for k, v in group.items() if k != "params"}, names=members[g])
            for g, group in enumerate(saved_groups)
        ]
        params = [records[name] for names in members for name in names]
        notes = {"deepspeed_common": {k: v for k, v in common.items() if k != "param_groups"}}
        self._index = StateIndex(params, groups, source=DEEPSPEED_UNIVERSAL, notes=notes)

    def _members(self, count: int, group_of: Mapping[str, int] | None) -> list[list[str]]:
        on_disk = sorted(p.name for p in (self.path / _ZERO).iterdir() if p.is_dir())
        members: list[list[str]] = [[] for _ in range(count)]
        if group_of is not None:
            for name in on_disk:
                if name not in group_of:
                    raise DeepSpeedFormatError(f"{self.path}: group_of has no entry for {name!r}")
                members[int(group_of[name])].append(name)
            return members
        states = sorted(self.path.glob("mp_rank_*_model_states.pt"))
        shapes = _load(states[0]).get("param_shapes") if states else None
        if isinstance(shapes, list) and len(shapes) == count:
            listed = [list(group) for group in shapes]
            if sorted(n for g in listed for n in g) == on_disk:
                return listed
        if count == 1:
            return [on_disk]
        raise DeepSpeedFormatError(
            f"{self.path}: {count} param groups and no model states file listing their "
            "members; pass group_of= (parameter name -> group index)"
        )

    def _record(self, name: str, group: int) -> ParamRecord:
        folder = self.path / _ZERO / name
        state: dict[str, TensorSpec] = {}
        step: float | None = None
        for file in sorted(folder.glob("*.pt")):
            tensor = _tensor_of(_load(file, mmap=True), file)
            if file.stem == _STEP:
                step = float(tensor.reshape(-1)[0]) if tensor.numel() else None
                continue
            key = _KEYS.get(file.stem, file.stem)
            state[key] = TensorSpec(tuple(tensor.shape), tensor.dtype)
            self._files[name, key] = file
        shapes = {spec.shape for spec in state.values()}
        if len(shapes) != 1:
            raise DeepSpeedFormatError(f"{folder}: its states have shapes {sorted(shapes)}")
        return ParamRecord(name, group, shapes.pop(), state, step)

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        file = self._files.get((name, key))
        if file is None:
            raise KeyError(f"{self.path}: no state {key!r} for parameter {name!r}")
        return _tensor_of(_load(file, mmap=True), file).detach().clone()

    def close(self) -> None:
        self._files.clear()
