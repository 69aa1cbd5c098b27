"""Megatron-Core's bucket-space optimizer checkpoints, read in the canonical form.

``dp_reshardable`` (a dist_checkpointing directory: one flat tensor per bucket and state) and
the legacy ``save_parameter_state`` file (``param_state.pt``: one flat tensor per buffer and
state, buckets concatenated, next to ``optimizer_common.pt``) store the DistributedOptimizer's
state where DDP put each parameter; :mod:`._megatron_buckets` says where that is, from the
model. Each parameter's state is read as a slice of those flat tensors: ``dp_reshardable``
reads only the stored chunks under the slice, the legacy file is memory-mapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
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
from wrapped_optim.checkpoint._convert._megatron import (
    DP_RESHARDABLE,
    LEGACY,
    GroupOf,
    group_options,
    group_rule,
)
from wrapped_optim.checkpoint._convert._megatron_buckets import (
    BucketSlot,
    Buffer,
    ParamList,
    buffers_of,
    lay_out,
)
from wrapped_optim.checkpoint._convert._megatron_files import (
    DcpTensors,
    MegatronFormatError,
    load_common,
)

__all__ = ["MegatronDpReshardableReader", "MegatronLegacyReader"]

_KEYS = {"param": MASTER, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
# HybridDeviceOptimizer's "master_param" is an alias of "param" (the FP32 main param).
_ALIASES = ("master_param",)
_BUCKET_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\((.+)\)"
    r"\.bucket_idx_(\d+)\.(\w+)$"
)


def _dtypes(label: str) -> tuple[torch.dtype, torch.dtype]:
    """``(param dtype, grad dtype)`` from Core's key part ``torch.bfloat16, torch.float32``."""
    found = [getattr(torch, part.strip().removeprefix("torch."), None) for part in label.split(",")]
    dtypes = [d for d in found if isinstance(d, torch.dtype)]
    if len(found) != 2 or len(dtypes) != 2:
        raise MegatronFormatError(f"unknown grad buffer dtypes ({label})")
    return dtypes[0], dtypes[1]


def _dtype_label(buffer: Buffer) -> str:
    return f"{buffer.param_dtype}, {buffer.grad_dtype}"


def _index(
    path: Path,
    slots: Sequence[tuple[int, BucketSlot]],
    keys: Sequence[str],
    groups: Sequence[Mapping[str, Any]],
    group_of: GroupOf | None,
    source: str,
) -> StateIndex:
    """The canonical index of bucketed state: one record per slot, grouped by ``group_of``."""
    rule = group_rule(path, group_of, groups)
    members: list[list[str]] = [[] for _ in groups]
    records: dict[str, ParamRecord] = {}
    for _, slot in slots:
        index = rule(slot.name, slot.shape)
        if not 0 <= index < len(groups):
            raise MegatronFormatError(
                f"{path}: group_of put {slot.name!r} in group {index}; there are {len(groups)}"
            )
        members[index].append(slot.name)
        step = groups[index].get("step")
        records[slot.name] = ParamRecord(
            name=slot.name,
            group=index,
            shape=slot.shape,
            state={_KEYS[k]: TensorSpec(slot.shape, torch.float32) for k in keys},
            step=None if step is None else float(step),
        )
    params = [records[name] for names in members for name in names]
    records_groups = [
        GroupRecord(options=group_options(group), names=names)
        for group, names in zip(groups, members, strict=True)
    ]
    notes = {"megatron_param_groups": [list(groups)]}
    return StateIndex(params=params, groups=records_groups, source=source, notes=notes)


class _Bucketed:
    """What both bucket-space readers share: an index, and one fetch per state tensor."""

    path: Path
    _index: StateIndex
    _fetch: dict[tuple[str, str], Callable[[], torch.Tensor]]

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        fetch = self._fetch.get((name, key))
        if fetch is None:
            raise KeyError(f"{self.path}: no state {key!r} for parameter {name!r}")
        return fetch().reshape(self._index.param(name).shape)

    def close(self) -> None:
        self._fetch.clear()


class MegatronDpReshardableReader(_Bucketed):
    """A ``dp_reshardable`` dist checkpoint directory, opened in the canonical form.

    ``model``: the model the checkpoint was saved from (a module or Megatron's list of model
    chunks; the meta device will do), whose parameters say where each one sits in the buckets.
    Names are the model's parameter names. Tensors are float32, as Megatron keeps them.
    A :class:`ParamList` (names and shapes) places one grad buffer alone, unless ``dtypes``
    gives each parameter's dtype (``str(torch.dtype)``), which places several.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     try:
        ...         MegatronDpReshardableReader(d, model=torch.nn.Linear(2, 2))
        ...     except MegatronFormatError as error:
        ...         "not a dist_checkpointing" in str(error)
        True
    """

    def __init__(
        self,
        path: str | Path,
        *,
        model: Any,
        group_of: GroupOf | None = None,
        grad_reduce_in_fp32: bool = True,
        dtypes: Sequence[str] | None = None,
    ) -> None:
        self.path = Path(path)
        if not (self.path / ".metadata").is_file():
            raise MegatronFormatError(f"{self.path}: not a dist_checkpointing directory")
        self._tensors = DcpTensors(self.path)
        buckets: dict[tuple[int, int], dict[str, str]] = {}  # (gbuf, bucket) -> key -> fqn
        labels: dict[int, str] = {}
        groups_seen: set[int] = set()
        for fqn in self._tensors:
            match = _BUCKET_KEY.match(fqn)
            if match is None:
                continue
            group, gbuf, label, bucket, key = match.groups()
            groups_seen.add(int(group))
            labels[int(gbuf)] = label
            buckets.setdefault((int(gbuf), int(bucket)), {})[key] = fqn
        if not buckets:
            raise MegatronFormatError(f"{self.path}: no dp_reshardable bucket tensors")
        if groups_seen != {0}:
            raise MegatronFormatError(
                f"{self.path}: holds data-parallel domains {sorted(groups_seen)} (tensor or "
                "pipeline parallelism); one domain (TP = PP = 1) is supported"
            )
        prefix = "optimizer.distributed.dp_group_idx_0"
        saved_groups = self._object(f"{prefix}.optimizer")["param_groups"]
        per_bucket = self._object(f"{prefix}.per_bucket_numel_unpadded")
        if isinstance(model, ParamList) and dtypes is None:
            if len(labels) != 1:
                raise MegatronFormatError(
                    f"{self.path}: {len(labels)} grad buffers (parameters of several dtypes): "
                    "names and shapes alone do not place them; pass the model itself"
                )
            buffers = [model.buffer(*_dtypes(labels[min(labels)]))]
        else:
            buffers = _buffers(model, dtypes, grad_reduce_in_fp32)
        if len(buffers) != len(labels):
            raise MegatronFormatError(
                f"{self.path}: {len(labels)} grad buffers in the checkpoint, {len(buffers)} by "
                "the model (its parameters' dtypes; grad_reduce_in_fp32?)"
            )
        self._fetch = {}
        slots: list[tuple[int, BucketSlot]] = []
        keys: list[str] = []
        for gbuf, buffer in enumerate(buffers):
            if labels.get(gbuf) != _dtype_label(buffer):
                raise MegatronFormatError(
                    f"{self.path}: grad buffer {gbuf} holds dtypes ({labels.get(gbuf)}), the "
                    f"model's ({_dtype_label(buffer)})"
                )
            numels = _bucket_numels(per_bucket, gbuf)
            for _, slot in [(gbuf, s) for s in lay_out(buffer, bucket_numels=numels)[0]]:
                stored = buckets[gbuf, slot.bucket]
                keys = [k for k in stored if k in _KEYS]
                unknown = sorted(set(stored) - set(_KEYS) - set(_ALIASES))
                if unknown:
                    raise MegatronFormatError(f"{self.path}: unknown state {unknown} in bucket")
                for key in keys:
                    self._fetch[slot.name, _KEYS[key]] = self._slice(stored[key], slot)
                slots.append((gbuf, slot))
        self._index = _index(self.path, slots, keys, saved_groups, group_of, DP_RESHARDABLE)

    def _object(self, name: str) -> Any:
        candidates = [fqn for fqn in self._tensors.objects if fqn.startswith(f"{name}/shard_")]
        if len(candidates) != 1:
            raise MegatronFormatError(f"{self.path}: no single object {name!r} ({candidates})")
        value = self._tensors.read_object(candidates[0])
        return value[0] if isinstance(value, list) and len(value) == 1 else value

    def _slice(self, fqn: str, slot: BucketSlot) -> Callable[[], torch.Tensor]:
        return lambda: self._tensors.read_slice(fqn, slot.start, slot.end)

    def close(self) -> None:
        super().close()
        self._tensors.close()


def _bucket_numels(per_bucket: Any, gbuf: int) -> list[int]:
    """Bucket sizes of grad buffer ``gbuf`` from Core's ``per_bucket_numel_unpadded``."""
    try:
        entry = per_bucket[gbuf]
        (numels,) = entry.values()
        return [int(n) for n in numels]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        raise MegatronFormatError(
            f"per_bucket_numel_unpadded has no bucket sizes for grad buffer {gbuf}"
        ) from None


class MegatronLegacyReader(_Bucketed):
    """Megatron-LM's legacy optimizer files, opened in the canonical form: the directory
    holding ``optimizer_common.pt`` (param groups) and ``param_state.pt``
    (``DistributedOptimizer.save_parameter_state``).

    ``model``, ``dtypes`` as for :class:`MegatronDpReshardableReader`; ``bucket_size`` is
    DDP's bucket size of the run (the file records only each buffer's total; None: one
    bucket per buffer, Megatron's layout without ``overlap_grad_reduce``), checked against
    that total.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     try:
        ...         MegatronLegacyReader(d, model=torch.nn.Linear(2, 2))
        ...     except MegatronFormatError as error:
        ...         "no such file" in str(error)
        True
    """

    def __init__(
        self,
        path: str | Path,
        *,
        model: Any,
        bucket_size: int | None = None,
        group_of: GroupOf | None = None,
        grad_reduce_in_fp32: bool = True,
        dtypes: Sequence[str] | None = None,
    ) -> None:
        self.path = Path(path)
        common = load_common(self.path / "optimizer_common.pt")
        file = self.path / "param_state.pt"
        if not file.is_file():
            raise MegatronFormatError(f"{file}: no such file")
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:
            raise MegatronFormatError(f"{file}: unreadable ({type(error).__name__})") from error
        if not isinstance(state, Mapping) or not state.get("buckets_coalesced"):
            raise MegatronFormatError(
                f"{file}: not a coalesced save_parameter_state file (Megatron-LM before "
                "February 2024 wrote per-bucket files, which are not supported)"
            )
        try:
            saved_groups = common["optimizer"]["param_groups"]
        except (KeyError, TypeError):
            raise MegatronFormatError(
                f"{self.path / 'optimizer_common.pt'}: no optimizer param groups"
            ) from None
        self._fetch = {}
        slots: list[tuple[int, BucketSlot]] = []
        keys: list[str] = []
        if isinstance(model, ParamList) and dtypes is None:
            stored = [key for key in state.get(0, {}) if isinstance(key, tuple)]
            if len([k for k in state if isinstance(k, int)]) != 1 or len(stored) != 1:
                raise MegatronFormatError(
                    f"{file}: several grad buffers (parameters of several dtypes): names and "
                    "shapes alone do not place them; pass the model itself"
                )
            buffers = [model.buffer(*stored[0])]
        else:
            buffers = _buffers(model, dtypes, grad_reduce_in_fp32)
        for gbuf, buffer in enumerate(buffers):
            per_dtype = state.get(gbuf)
            world = per_dtype.get((buffer.param_dtype, buffer.grad_dtype)) if per_dtype else None
            if world is None:
                raise MegatronFormatError(
                    f"{file}: no grad buffer {gbuf} of dtypes ({_dtype_label(buffer)})"
                )
            buffer_slots, sizes = lay_out(buffer, bucket_size=bucket_size)
            if sum(sizes) != int(world["numel_unpadded"]):
                raise MegatronFormatError(
                    f"{file}: grad buffer {gbuf} holds {int(world['numel_unpadded'])} elements, "
                    f"the model's layout {sum(sizes)} (bucket_size={bucket_size}; pass the "
                    "run's DDP bucket size)"
                )
            offsets = [sum(sizes[:b]) for b in range(len(sizes))]
            keys = [k for k in world if k in _KEYS]
            for slot in buffer_slots:
                base = offsets[slot.bucket]
                for key in keys:
                    self._fetch[slot.name, _KEYS[key]] = _slicer(
                        world[key], base + slot.start, base + slot.end
                    )
                slots.append((gbuf, slot))
        self._index = _index(self.path, slots, keys, saved_groups, group_of, LEGACY)


def _buffers(model: Any, dtypes: Sequence[str] | None, grad_reduce_in_fp32: bool) -> list[Buffer]:
    """The grad buffers of a module (or model chunks), or of names and shapes with dtypes."""
    if isinstance(model, ParamList):
        assert dtypes is not None
        return model.buffers(dtypes, grad_reduce_in_fp32=grad_reduce_in_fp32)
    return buffers_of(model, grad_reduce_in_fp32=grad_reduce_in_fp32)


def _slicer(flat: torch.Tensor, start: int, end: int) -> Callable[[], torch.Tensor]:
    return lambda: flat[start:end].clone()
