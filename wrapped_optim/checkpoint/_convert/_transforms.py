"""Changes of storage between source and destination, each lossless or lossy.

* moments (``exp_avg``, ``exp_avg_sq``) to fp32, bf16, fp16 or fp8: a cast to the torch
  dtype for the first three; fp8 keeps the values an FP8 E4M3 store with TE's per-tensor
  scale holds, as the FP32 expansion the on-disk formats carry (no format on disk keeps FP8
  codes: TE's and Megatron's checkpoints hold FP32 expansions). The scale is the one the
  destination's optimizer will compute: one per piece of the parameter it holds (a DP
  shard, under Megatron's distributed optimizer), recomputed from the FP32 values, and the
  values are those its load re-quantizes to the same bits;
* the master (``MASTER``) to fp32, fp16, or none (dropped).

Widening is lossless; narrowing, fp8 and dropping a master are lossy and refused unless
asked for, then reported with the largest absolute error per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import attrs
import torch

from wrapped_optim._formats.codecs import FP8_E4M3, decode, encode
from wrapped_optim.checkpoint._convert._canonical import (
    MASTER,
    ParamRecord,
    StateIndex,
    StateReader,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._errors import ConversionError

__all__ = [
    "MASTER_CHOICES",
    "MOMENT_CHOICES",
    "MOMENT_KEYS",
    "Change",
    "Pieces",
    "TransformingReader",
    "fp8_values",
    "plan",
]

Pieces = Mapping[str, Sequence[tuple[int, int]]]
"""Per parameter name, the flat element ranges ``[start, end)`` that each hold one FP8 scale
in the destination's optimizer (absent: the whole tensor)."""

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
MomentChoice = Literal["fp32", "bf16", "fp16", "fp8"]
MasterChoice = Literal["fp32", "fp16", "none"]
MOMENT_CHOICES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float32,  # the FP32 expansion of E4M3 codes
}
MASTER_CHOICES: dict[str, torch.dtype | None] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "none": None,
}
_WIDER = {
    torch.float32: {torch.float32, torch.float64},
    torch.bfloat16: {torch.bfloat16, torch.float32, torch.float64},
    torch.float16: {torch.float16, torch.float32, torch.float64},
}


@attrs.frozen
class Change:
    """What happens to one state tensor: ``to`` None drops it."""

    name: str
    key: str
    source: TensorSpec
    to: torch.dtype | None
    fp8: bool = False

    @property
    def lossless(self) -> bool:
        if self.to is None or self.fp8:
            return False
        return self.to in _WIDER.get(self.source.dtype, {self.source.dtype})


def _change(
    param: ParamRecord, key: str, spec: TensorSpec, moments: str | None, master: str | None
) -> Change | None:
    if key in MOMENT_KEYS and moments is not None:
        to = MOMENT_CHOICES[moments]
        fp8 = moments == "fp8"
        if to == spec.dtype and not fp8:
            return None
        return Change(param.name, key, spec, to, fp8)
    if key == MASTER and master is not None:
        to_master = MASTER_CHOICES[master]
        return None if to_master == spec.dtype else Change(param.name, key, spec, to_master)
    return None


def plan(
    index: StateIndex, *, moments: str | None, master: str | None
) -> tuple[StateIndex, dict[tuple[str, str], Change]]:
    """The destination's index and the change of each tensor that changes."""
    if moments is not None and moments not in MOMENT_CHOICES:
        raise ConversionError(f"moments={moments!r}: choose one of {sorted(MOMENT_CHOICES)}")
    if master is not None and master not in MASTER_CHOICES:
        raise ConversionError(f"master={master!r}: choose one of {sorted(MASTER_CHOICES)}")
    changes: dict[tuple[str, str], Change] = {}
    params = []
    for param in index.params:
        state: dict[str, TensorSpec] = {}
        for key, spec in param.state.items():
            change = _change(param, key, spec, moments, master)
            if change is None:
                state[key] = spec
                continue
            changes[(param.name, key)] = change
            if change.to is not None:
                state[key] = TensorSpec(spec.shape, change.to)
        if master not in (None, "none") and MASTER not in param.state and param.state:
            raise ConversionError(
                f"{index.source}: parameter {param.name!r} has no master to keep as {master}; "
                "the destination optimizer builds its master from the parameter when it loads"
            )
        params.append(ParamRecord(param.name, param.group, param.shape, state, param.step))
    return attrs.evolve(index, params=params), changes


def refuse_lossy(changes: Mapping[tuple[str, str], Change], to: str) -> None:
    lossy = [c for c in changes.values() if not c.lossless]
    if lossy:
        first = lossy[0]
        what = "dropped" if first.to is None else f"{first.source.dtype} -> {first.to}"
        what += " (fp8 E4M3 values)" if first.fp8 else ""
        raise ConversionError(
            f"parameter {first.name!r}: state {first.key!r} would be {what} on the way to "
            f"{to}, which loses information ({len(lossy)} tensor(s) in all); pass "
            "allow_lossy=True (CLI: --allow-lossy) to convert and get the largest error per "
            "tensor in the report"
        )


def _max_error(before: torch.Tensor, after: torch.Tensor | None) -> float:
    if after is None or before.numel() == 0:
        return float(before.abs().max()) if before.numel() else 0.0
    return float((after.double() - before.double()).abs().max())


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    stored, scale = encode(x, FP8_E4M3)
    return decode(stored, FP8_E4M3, scale)


def _e4m3_stable(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an E4M3 store under its own scale (amax / 448) holds it, quantized again
    until that changes nothing: the loading optimizer quantizes what it reads once more, and
    the decoded amax can land one ulp off the first scale (about 1 tensor in 100), which
    moves every value by an ulp. The fixed point, reached in one more pass, loads as itself."""
    value = _e4m3(x)
    for _ in range(3):
        again = _e4m3(value)
        if torch.equal(again, value):
            break
        value = again
    return value


def fp8_values(
    tensor: torch.Tensor, pieces: Sequence[tuple[int, int]] | None = None
) -> torch.Tensor:
    """The FP32 values an FP8 E4M3 store keeps of ``tensor``, one per-tensor scale for each
    flat range of ``pieces`` (None: the whole tensor), as the destination computes them.

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0, 100.0, 1.0, 2.0])
        >>> [round(v, 3) for v in fp8_values(x).tolist()]  # one scale: 100 / 448
        [1.004, 100.0, 1.004, 2.009]
        >>> [round(v, 3) for v in fp8_values(x, [(0, 2), (2, 4)]).tolist()]  # two
        [1.004, 100.0, 1.0, 2.0]
    """
    flat = tensor.float().reshape(-1)
    if pieces is None:
        return _e4m3_stable(flat).reshape(tensor.shape)
    out = torch.empty_like(flat)
    covered = 0
    for start, end in pieces:
        if start != covered or end <= start:
            raise ConversionError(
                f"fp8 scale pieces {list(pieces)} do not cover the {flat.numel()} elements in order"
            )
        out[start:end] = _e4m3_stable(flat[start:end])
        covered = end
    if covered != flat.numel():
        raise ConversionError(
            f"fp8 scale pieces {list(pieces)} cover {covered} of {flat.numel()} elements"
        )
    return out.reshape(tensor.shape)


class TransformingReader:
    """``reader`` with ``changes`` applied as tensors are read; lossy changes' largest
    absolute errors collect in ``errors`` (by ``"name:key"``). ``pieces``: where FP8 values
    get one scale each (the destination's layout; absent names: the whole tensor)."""

    def __init__(
        self,
        reader: StateReader,
        index: StateIndex,
        changes: Mapping[tuple[str, str], Change],
        pieces: Pieces | None = None,
    ) -> None:
        self.reader, self._index, self.changes = reader, index, changes
        self.pieces: Pieces = pieces or {}
        self.errors: dict[str, float] = {}

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        tensor = self.reader.read(name, key)
        change = self.changes.get((name, key))
        if change is None:
            return tensor
        if change.to is None:
            raise ConversionError(f"parameter {name!r}: state {key!r} was dropped")
        out = fp8_values(tensor, self.pieces.get(name)) if change.fp8 else tensor.to(change.to)
        if not change.lossless:
            self.errors[f"{name}:{key}"] = _max_error(tensor, out)
        return out

    def dropped_errors(self) -> None:
        """Records the error of each dropped tensor (its largest magnitude)."""
        for (name, key), change in self.changes.items():
            if change.to is None:
                self.errors[f"{name}:{key}"] = _max_error(self.reader.read(name, key), None)

    def close(self) -> None:
        self.reader.close()
