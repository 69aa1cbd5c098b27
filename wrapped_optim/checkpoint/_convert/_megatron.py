"""Megatron-Core's ``fully_reshardable`` optimizer checkpoints, read and written in the
canonical form.

``fully_reshardable`` (``DistributedOptimizer.sharded_state_dict`` with
``metadata={"distrib_optim_sharding_type": "fully_reshardable"}``) is already model space:
each parameter's FP32 main param and Adam moments are stored whole, under
``optimizer.state.<param|exp_avg|exp_avg_sq>.<the model tensor's sharded key>`` (with a
``chained_<i>.`` prefix per sub-optimizer of a ChainedOptimizer), in float32, whatever the
data-parallel size or offload. ``common.pt`` holds the param groups, each with Megatron's group
``step``. So reading needs no model and no process group, and a written checkpoint loads at any
DP size. What the files do not record is which parameter is in which param group: by default
Megatron's standard rule (no weight decay for biases and 1-D parameters) is applied when the
groups are the two it makes, else ``group_of`` must say.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from wrapped_optim.checkpoint._convert._canonical import (
    MASTER,
    GroupRecord,
    ParamRecord,
    StateIndex,
    StateReader,
    TensorSpec,
)
from wrapped_optim.checkpoint._convert._megatron_files import (
    COMMON_FILE,
    METADATA_FILE,
    DcpTensors,
    MegatronFormatError,
    optimizer_commons,
    read_backends,
    read_common,
)

__all__ = [
    "FULLY_RESHARDABLE",
    "GROUP_IDENTIFIERS",
    "MegatronFullyReshardableReader",
    "MegatronFullyReshardableWriter",
    "detect_megatron",
    "group_options",
    "group_rule",
    "megatron_writer",
    "standard_group_of",
]

FULLY_RESHARDABLE = "megatron-fully-reshardable"
DP_RESHARDABLE = "megatron-dp-reshardable"
DP_ZERO = "megatron-dp-zero-gather-scatter"
LEGACY = "megatron-legacy"
_SHARDING = {
    "fully_reshardable": FULLY_RESHARDABLE,
    "dp_reshardable": DP_RESHARDABLE,
    "dp_zero_gather_scatter": DP_ZERO,
}
# Core's param_group_identifier_keys: how a loading optimizer matches saved groups to its own.
GROUP_IDENTIFIERS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
_STATE_KEYS = {
    "param": MASTER,
    "fp32_param": MASTER,
    "exp_avg": "exp_avg",
    "exp_avg_sq": "exp_avg_sq",
}
_TENSOR_KEY = re.compile(
    r"^(?:chained_(\d+)\.)?optimizer\.state\.(fp32_param|param|exp_avg_sq|exp_avg)\.(.+)$"
)
_LEGACY_COMMON = "optimizer_common.pt"
_LEGACY_PARAM_STATE = "param_state.pt"

GroupOf = Callable[[str, tuple[int, ...]], int] | Mapping[str, int]


def detect_megatron(path: str | Path) -> str | None:
    """The Megatron optimizer format at ``path``, or None.

    A ``dist_checkpointing`` directory names its sharding type in ``common.pt``; a legacy
    checkpoint is a directory with ``optimizer_common.pt`` (and, for a DistributedOptimizer,
    ``param_state.pt``).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     detect_megatron(d) is None
        True
    """
    path = Path(path)
    if (path / _LEGACY_COMMON).is_file():
        return LEGACY
    if read_backends(path) is None:
        return None
    try:
        common = read_common(path)
    except MegatronFormatError:
        return None
    state = common.get("optimizer") if isinstance(common, Mapping) else None
    if isinstance(state, Mapping) and state and all(isinstance(k, int) for k in state):
        state = state[min(state)]  # a ChainedOptimizer's first sub-optimizer
    sharding = state.get("param_state_sharding_type") if isinstance(state, Mapping) else None
    return _SHARDING.get(str(sharding)) if sharding is not None else None


def standard_group_of(groups: Sequence[Mapping[str, Any]]) -> Callable[[str, tuple[int, ...]], int]:
    """Megatron's default grouping (``get_standard_config_overrides``): biases and 1-D
    parameters get no weight decay (``wd_mult`` 0), the rest do.

    Applies only to the groups Megatron then makes: one group, or two that differ in ``wd_mult``
    (1 and 0) alone. A leading size-1 dimension (Megatron stacks layers' tensors along a first
    axis) does not count as a dimension.

    Example:
        >>> rule = standard_group_of([{"wd_mult": 1.0}, {"wd_mult": 0.0}])
        >>> rule("decoder.linear.weight", (8, 8)), rule("decoder.linear.bias", (8,))
        (0, 1)
    """
    if len(groups) == 1:
        return lambda name, shape: 0
    if len(groups) == 2:
        others = [{k: g.get(k) for k in GROUP_IDENTIFIERS if k != "wd_mult"} for g in groups]
        mults = [float(g.get("wd_mult", math.nan)) for g in groups]
        if others[0] == others[1] and sorted(mults) == [0.0, 1.0]:
            decayed, plain = mults.index(1.0), mults.index(0.0)

            def group_of(name: str, shape: tuple[int, ...]) -> int:
                ndim = len(shape)
                return plain if name.endswith(".bias") or ndim <= 1 else decayed

            return group_of
    described = [{k: g.get(k) for k in GROUP_IDENTIFIERS} for g in groups]
    raise MegatronFormatError(
        f"the checkpoint's param groups {described} are not Megatron's standard two (weight "
        "decay on / off); say which group each parameter is in: group_of=<mapping or function "
        "of (name, shape)>"
    )


def group_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's hyper-parameters; a class (HybridDeviceOptimizer's sub-optimizer classes) by
    its qualified name, so that any format can hold it without pickled code."""
    return {
        key: f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) else value
        for key, value in group.items()
        if key not in ("params", "step")
    }


def group_rule(
    path: Path, group_of: GroupOf | None, saved: Sequence[Mapping[str, Any]]
) -> Callable[[str, tuple[int, ...]], int]:
    """``group_of`` as a function (name, shape) -> group index; Megatron's standard rule
    when None.

    Example:
        >>> group_rule(Path("ckpt"), {"w": 0}, [{}])("w", (2,))
        0
    """
    if group_of is None:
        try:
            return standard_group_of(saved)
        except MegatronFormatError as error:
            raise MegatronFormatError(f"{path}: {error}") from None
    if isinstance(group_of, Mapping):
        mapping = group_of

        def from_mapping(name: str, shape: tuple[int, ...]) -> int:
            if name not in mapping:
                raise MegatronFormatError(f"{path}: group_of has no entry for {name!r}")
            return int(mapping[name])

        return from_mapping
    return group_of


class MegatronFullyReshardableReader:
    """A ``fully_reshardable`` dist checkpoint directory, opened in the canonical form.

    Names are the model tensors' sharded keys (Megatron's names, which the same directory's
    model weights use); ``MASTER`` is the FP32 main param; ``step`` is the param group's.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     try:
        ...         MegatronFullyReshardableReader(d)
        ...     except MegatronFormatError as error:
        ...         print(str(error).split(":")[-1].strip())
        not a Megatron dist_checkpointing directory (no metadata.json)
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key: str = "optimizer",
        group_of: GroupOf | None = None,
        param_remainders: bool = False,
    ) -> None:
        self.path = Path(path)
        self.param_remainders = param_remainders
        if read_backends(self.path) is None:
            raise MegatronFormatError(
                f"{self.path}: not a Megatron dist_checkpointing directory (no {METADATA_FILE})"
            )
        self._commons = optimizer_commons(read_common(self.path), key)
        for common in self._commons:
            sharding = common.get("param_state_sharding_type")
            if sharding != "fully_reshardable":
                raise MegatronFormatError(
                    f"{self.path}: its optimizer state is {sharding!r}, not 'fully_reshardable'"
                    + ("; open it with megatron_reader(..., model=...)" if sharding else "")
                )
        self._tensors = DcpTensors(self.path)
        self._where: dict[tuple[str, str], str] = {}
        self._index = self._build_index(group_of)

    def _build_index(self, group_of: GroupOf | None) -> StateIndex:
        found: dict[str, dict[str, Any]] = {}
        for tensor_key in self._tensors:
            match = _TENSOR_KEY.match(tensor_key)
            if match is None:
                continue
            sub = int(match.group(1) or 0)
            state_key, name = _STATE_KEYS[match.group(2)], match.group(3)
            if sub >= len(self._commons):
                raise MegatronFormatError(
                    f"{self.path}: tensor {tensor_key!r} names sub-optimizer {sub}; common.pt "
                    f"holds {len(self._commons)}"
                )
            entry = found.setdefault(name, {"sub": sub, "state": {}})
            if entry["sub"] != sub:
                raise MegatronFormatError(
                    f"{self.path}: parameter {name!r} is in two sub-optimizers"
                )
            shape, dtype = self._tensors.specs[tensor_key]
            entry["state"][state_key] = TensorSpec(shape, dtype)
            self._where[name, state_key] = tensor_key
        if not found:
            raise MegatronFormatError(
                f"{self.path}: no optimizer state tensors (optimizer.state.*)"
            )
        groups: list[GroupRecord] = []
        params: list[ParamRecord] = []
        offset = 0
        for sub, common in enumerate(self._commons):
            saved = list(common["optimizer"]["param_groups"])
            members: list[list[str]] = [[] for _ in saved]
            rule = group_rule(self.path, group_of, saved)
            for name, entry in found.items():
                if entry["sub"] != sub:
                    continue
                shape = next(iter(entry["state"].values())).shape
                index = rule(name, shape)
                if not 0 <= index < len(saved):
                    raise MegatronFormatError(
                        f"{self.path}: group_of put {name!r} in group {index}; sub-optimizer "
                        f"{sub} has {len(saved)}"
                    )
                members[index].append(name)
                step = saved[index].get("step")
                params.append(
                    ParamRecord(
                        name=name,
                        group=offset + index,
                        shape=shape,
                        state=entry["state"],
                        step=None if step is None else float(step),
                    )
                )
            for group, names in zip(saved, members, strict=True):
                groups.append(GroupRecord(options=group_options(group), names=names))
            offset += len(saved)
        notes = {
            "megatron_sharding_type": "fully_reshardable",
            "megatron_param_groups": [
                list(common["optimizer"]["param_groups"]) for common in self._commons
            ],
            "megatron_grad_scaler": [common.get("grad_scaler") for common in self._commons],
        }
        order = {
            group.names[i]: (g, i)
            for g, group in enumerate(groups)
            for i in range(len(group.names))
        }
        params.sort(key=lambda p: order[p.name])
        return StateIndex(params=params, groups=groups, source=FULLY_RESHARDABLE, notes=notes)

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        tensor_key = self._where.get((name, key))
        if tensor_key is None:
            raise KeyError(f"{self.path}: no state {key!r} for parameter {name!r}")
        tensor = self._tensors.read(tensor_key)
        if key == MASTER and self.param_remainders:
            return self._joined(name, tensor)
        return tensor

    def _joined(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """The FP32 master of a precision-aware run that kept it as bf16 weights plus int16
        remainders: Megatron writes the remainder (as float32) under ``param``, the bf16 high
        half is the model weight saved beside it."""
        from wrapped_optim._formats.remainders import join_master

        if name not in self._tensors.specs or self._tensors.specs[name][1] != torch.bfloat16:
            raise MegatronFormatError(
                f"{self.path}: parameter {name!r}: param_remainders needs its bf16 model weight "
                "in the same checkpoint (saved with the model)"
            )
        remainder = stored.to(torch.int16)
        if not torch.equal(remainder.float(), stored):
            raise MegatronFormatError(
                f"{self.path}: parameter {name!r}: its stored main param is not an int16 "
                "remainder; open it without param_remainders"
            )
        return join_master(self._tensors.read(name).reshape(-1), remainder.reshape(-1)).reshape(
            stored.shape
        )

    def close(self) -> None:
        self._tensors.close()


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------
_WRITTEN = (("param", MASTER), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def _target_groups(
    index: StateIndex, param_groups: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """The param groups the written ``common.pt`` holds, one per canonical group."""
    if param_groups is not None:
        groups = [dict(group) for group in param_groups]
        if len(groups) != len(index.groups):
            raise MegatronFormatError(
                f"param_groups has {len(groups)} groups, the optimizer state {len(index.groups)}"
            )
    else:
        groups = [dict(group.options) for group in index.groups]
    for number, group in enumerate(groups):
        missing = [
            key for key in GROUP_IDENTIFIERS if key not in group and f"pre_{key}" not in group
        ]
        if missing:
            raise MegatronFormatError(
                f"param group {number} has no {', '.join(missing)} (the keys Megatron matches "
                "groups by); pass param_groups= (the target optimizer's "
                "state_dict()['optimizer']['param_groups'])"
            )
        group.pop("params", None)
    return groups


def _one_step(index: StateIndex) -> float | None:
    steps = {param.step for param in index.params}
    if len(steps) > 1:
        raise MegatronFormatError(
            f"the parameters have different steps {sorted(s for s in steps if s is not None)}; "
            "a Megatron DistributedOptimizer keeps one step for all"
        )
    return steps.pop() if steps else None


def _check_widening(name: str, key: str, dtype: torch.dtype) -> None:
    """Megatron stores float32: a float of at most 32 bits widens exactly; anything else is
    refused."""
    if not dtype.is_floating_point or torch.finfo(dtype).bits > 32:
        raise MegatronFormatError(
            f"parameter {name!r}: state {key!r} is {dtype}; Megatron stores float32 and "
            "narrowing it is lossy (cast it first, asking for the loss)"
        )


def check_adam_state(param: ParamRecord, fmt: str = "") -> None:
    """A parameter's state is what a DistributedOptimizer keeps (main param, exp_avg,
    exp_avg_sq), each widening exactly to float32; else the error names what is not."""
    where = f"{fmt}: " if fmt else ""
    extra = sorted(set(param.state) - {key for _, key in _WRITTEN})
    if extra:
        raise MegatronFormatError(
            f"{where}parameter {param.name!r}: state {extra} has no place in a Megatron "
            "DistributedOptimizer checkpoint (Adam: main param, exp_avg, exp_avg_sq)"
        )
    for _, key in _WRITTEN:
        if key not in param.state:
            hint = (
                " (the FP32 main param; a source without masters needs the model's FP32 weights)"
                if key == MASTER
                else ""
            )
            raise MegatronFormatError(f"{where}parameter {param.name!r}: no state {key!r}{hint}")
        _check_widening(param.name, key, param.state[key].dtype)


class _LazyTensors:
    """DCP ``SavePlanner`` source: meta placeholders whose values are read when DCP writes
    them, one at a time."""

    def __init__(self, reader: StateReader, where: Mapping[str, tuple[str, str]]) -> None:
        self.reader = reader
        self.where = where

    def value(self, fqn: str) -> torch.Tensor:
        name, key = self.where[fqn]
        tensor = self.reader.read(name, key)
        if tensor.dtype != torch.float32:
            _check_widening(name, key, tensor.dtype)
            tensor = tensor.float()  # bf16/fp16 into float32: exact
        return tensor.detach().cpu().contiguous()


def _save_lazily(
    tensors: _LazyTensors, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], path: Path
) -> None:
    """``dcp.save`` of ``specs`` into ``path``, each value pulled when written."""

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _Pulling(DefaultSavePlanner):
        previous: torch.Tensor | None = None

        def resolve_data(self, write_item: Any) -> Any:
            fqn = write_item.index.fqn
            if fqn not in tensors.where:
                return super().resolve_data(write_item)
            # DCP's file writer keeps the tensors it wrote referenced until the file ends; its
            # serial loader asks for the next one only once the previous is written, so that
            # one's memory is released here (a whole tensor handed over, never a view).
            previous, self.previous = self.previous, None
            if previous is not None and previous._base is None:
                storage = previous.untyped_storage()
                if storage.resizable():
                    storage.resize_(0)
            self.previous = tensors.value(fqn)
            return self.previous

    placeholders = {
        fqn: torch.empty(shape, dtype=dtype, device="meta") for fqn, (shape, dtype) in specs.items()
    }
    with dcp_causes_raised():
        _save(placeholders, path, _Pulling(flatten_state_dict=False))


@contextlib.contextmanager
def dcp_causes_raised() -> Iterator[None]:
    """A DCP save without a process group: its notices silenced, and what a source's read
    raised inside it (which DCP wraps in a ``CheckpointException``) raised as itself."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        except CheckpointException as error:
            for failure in error.failures.values():
                cause = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(cause, Exception):
                    raise cause from None
            raise


def _save(placeholders: dict[str, torch.Tensor], path: Path, planner: Any) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(path), single_file_per_rank=True, thread_count=1)
    dcp.save(placeholders, storage_writer=writer, planner=planner, no_dist=True)


class MegatronFullyReshardableWriter:
    """Writes the canonical form as a Megatron ``fully_reshardable`` dist checkpoint.

    The directory holds the optimizer's state under ``key`` (``common.pt``, ``metadata.json``
    and the DCP files); a Megatron resume at any DP size loads it with
    ``dist_checkpointing.load({key: optimizer.sharded_state_dict(model_sd, True,
    metadata={"distrib_optim_sharding_type": "fully_reshardable"})}, path)``. The parameter
    names must be the model's sharded keys. Written to a staging directory, then renamed:
    a failure leaves no partial output.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key: str = "optimizer",
        param_groups: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = Path(path)
        self.key = key
        self.param_groups = param_groups

    def write(self, index: StateIndex, reader: StateReader) -> None:
        in_place = self.path.is_dir() and not any(self.path.iterdir())  # a caller's staging
        if self.path.exists() and not in_place:
            raise MegatronFormatError(
                f"{self.path}: already exists; the writer makes a new directory"
            )
        groups = _target_groups(index, self.param_groups)
        step = _one_step(index)
        where: dict[str, tuple[str, str]] = {}
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for param in index.params:
            check_adam_state(param)
            for stored, key in _WRITTEN:
                fqn = f"optimizer.state.{stored}.{param.name}"
                where[fqn] = (param.name, key)
                specs[fqn] = (param.shape, torch.float32)
        for group in groups:
            if step is not None:
                group["step"] = step
        common = {
            self.key: {
                "optimizer": {"param_groups": groups},
                "param_state_sharding_type": "fully_reshardable",
            }
        }
        scaler = index.notes.get("megatron_grad_scaler")
        if isinstance(scaler, list) and len(scaler) == 1 and scaler[0] is not None:
            common[self.key]["grad_scaler"] = scaler[0]
        if in_place:
            _write_into(self.path, _LazyTensors(reader, where), specs, common)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        try:
            _write_into(staging, _LazyTensors(reader, where), specs, common)
            staging.rename(self.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def _write_into(
    directory: Path,
    tensors: _LazyTensors,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    common: Mapping[str, Any],
) -> None:
    """A dist_checkpointing directory's three parts: the DCP files, common.pt, metadata.json."""
    _save_lazily(tensors, specs, directory)
    write_common(directory, common)


def write_common(directory: Path, common: Mapping[str, Any]) -> None:
    """What a dist_checkpointing directory holds beside its DCP files: ``common.pt`` and the
    backends' ``metadata.json`` (Core's ``torch_dist`` and ``torch``)."""
    torch.save(dict(common), directory / COMMON_FILE)
    backends = {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    (directory / METADATA_FILE).write_text(json.dumps(backends))


def megatron_writer(
    path: str | Path,
    *,
    key: str = "optimizer",
    param_groups: Sequence[Mapping[str, Any]] | None = None,
) -> MegatronFullyReshardableWriter:
    """A writer of Megatron ``fully_reshardable`` optimizer checkpoints (any DP size loads
    them). ``param_groups``: the target optimizer's groups
    (``optimizer.state_dict()["optimizer"]["param_groups"]``) where the source's groups lack
    Megatron's group keys.

    Example:
        >>> megatron_writer("out/optim").path.name
        'optim'
    """
    return MegatronFullyReshardableWriter(path, key=key, param_groups=param_groups)


# What the bucket-space writers (``_megatron_bucket_writers``) share with this one.
target_groups = _target_groups
one_step = _one_step
check_widening = _check_widening
