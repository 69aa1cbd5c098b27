"""``convert``: one checkpoint read in one format, written in another, tensor by tensor, into
a staging path beside the destination that is renamed into place only once complete."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import torch

from wrapped_optim.checkpoint._commit import CheckpointCommit, resolve_checkpoint_path
from wrapped_optim.checkpoint._convert._canonical import StateIndex, StateReader
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._formats import (
    Format,
    detect_format,
    get_format,
    known_formats,
)
from wrapped_optim.checkpoint._convert._names import ParameterNames, as_names, names_from_model
from wrapped_optim.checkpoint._convert._options import FormatOptions
from wrapped_optim.checkpoint._convert._transforms import (
    TransformingReader,
    plan,
    refuse_lossy,
)

__all__ = ["ConversionReport", "convert"]

Progress = Callable[[int, int], None]


@attrs.frozen
class ConversionReport:
    """What ``convert`` did.

    Attributes:
        source_format: the format read (detected or given).
        target_format: the format written.
        tensors: state tensors written.
        bytes: their bytes as written.
        lossy: the largest absolute error of each lossy change, by ``"name:key"`` (empty for
            a lossless conversion).
        seconds: wall time of the conversion (the verification included).
        verified: the result was read back and compared, tensor by tensor.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from wrapped_optim.checkpoint import convert
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save(opt.state_dict(), Path(tmp, "sgd.pt"))
        ...     report = convert(Path(tmp, "sgd.pt"), Path(tmp, "dcp"), to="dcp", model=model)
        >>> report.source_format, report.target_format, report.tensors
        ('torch-save', 'dcp', 2)
    """

    source_format: str
    target_format: str
    tensors: int
    bytes: int
    lossy: Mapping[str, float]
    seconds: float
    verified: bool


class _Counting:
    """Counts the tensors and bytes a writer pulls; reports progress."""

    def __init__(self, reader: StateReader, index: StateIndex, progress: Progress | None):
        self.reader, self._index, self.progress = reader, index, progress
        self.tensors = self.bytes = 0
        self.total = sum(
            math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            for param in index.params
            for spec in param.state.values()
        )

    def index(self) -> StateIndex:
        return self._index

    def read(self, name: str, key: str) -> torch.Tensor:
        tensor = self.reader.read(name, key)
        self.tensors += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if self.progress is not None:
            self.progress(self.bytes, self.total)
        return tensor

    def close(self) -> None:
        self.reader.close()


def _stderr_progress() -> Progress:
    stream = sys.stderr
    drawn = [-1]

    def show(done: int, total: int) -> None:
        percent = 100 * done // max(total, 1)
        if percent == drawn[0]:
            return
        drawn[0] = percent
        end = "\n" if done >= total else ""
        if stream.isatty() or end:
            stream.write(f"\rconverting: {percent:3d}% ({done / 2**20:,.1f} MiB){end}")
            stream.flush()

    return show


def _options(
    names: Any,
    model: Any,
    dp: int | None,
    trusted: bool,
    location: str | None,
    layout: Any,
    param_remainders: bool = False,
) -> FormatOptions:
    if model is not None and names is not None:
        raise TypeError("pass model= or names=, not both")
    resolved: ParameterNames | None
    dtypes: list[str] | None = None
    model_order: list[str] | None = None
    if model is not None:
        model, optimizer = model if isinstance(model, tuple) else (model, None)
        resolved = names_from_model(model, optimizer)
        dtype_of = {name: str(param.dtype) for name, param in model.named_parameters()}
        dtypes = [dtype_of[name] for name in resolved.names]
        if optimizer is not None:
            held = set(resolved.names)
            model_order = [name for name in dtype_of if name in held]
    else:
        resolved = as_names(names)
    return FormatOptions(
        names=None if resolved is None else resolved.names,
        shapes=None if resolved is None else resolved.shapes,
        dp_size=dp,
        trusted=trusted,
        location=location,
        flavour=layout,
        dtypes=dtypes,
        param_remainders=param_remainders,
        model_order=model_order,
    )


@contextlib.contextmanager
def _staged(target: Path, directory: bool) -> Iterator[Path]:
    """A staging path beside ``target``, renamed onto it when the block succeeds and removed
    when it raises: no partial destination, ever."""
    if os.path.lexists(target):
        raise FileExistsError(f"{target}: exists; convert writes a new checkpoint, never over one")
    if directory:
        commit = CheckpointCommit(target, process_group=None)
        commit.prepare()
        try:
            yield commit.staging
        except BaseException:
            commit.abort()
            raise
        commit.commit()
        return
    staging = target.parent / f".{target.name}.converting"
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield staging
        with open(staging, "rb+") as stream:
            os.fsync(stream.fileno())
        os.rename(staging, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str,
    model: Any = None,
    names: Any = None,
    dp: int | None = None,
    bucket_size: int | None = None,
    moments: Literal["fp32", "bf16", "fp16", "fp8"] | None = None,
    master: Literal["fp32", "fp16", "none"] | None = None,
    layout: Literal["torch", "precision-aware"] | None = None,
    param_remainders: bool = False,
    source_format: str | None = None,
    location: str | None = None,
    under: str | None = None,
    allow_lossy: bool = False,
    verify: bool = False,
    trusted: bool = False,
    progress: bool | Progress | None = None,
) -> ConversionReport:
    """Converts the optimizer checkpoint ``src`` into format ``to`` at ``dst``.

    The source format is detected (or ``source_format``); tensors are read and written one
    at a time, so host memory stays near the largest tensor whatever the checkpoint's size.
    ``dst`` must not exist: it is written beside itself and renamed into place once
    complete, so a failure leaves nothing at ``dst``.

    Args:
        src: a checkpoint file or directory.
        dst: the new checkpoint's path.
        to: the destination format (``torch-save``, ``dcp``, ``dcp-flat``,
            ``dcp-streaming``, or another that ``wrapped-optim convert --list`` shows).
        model: a model (or ``(model, optimizer)``) naming the parameters of index-keyed
            checkpoints (``torch.save`` state dicts, ``dcp-streaming``).
        names: the same from ``names_from_model``, a names file, or a list of names.
        dp: the data-parallel size a sharded destination is written for; with
            ``moments="fp8"``, the DP size of the run that loads the destination, where its
            optimizer keeps a scale per DP shard (Megatron's distributed optimizer: name the
            model too).
        bucket_size: the DDP bucket size of the Megatron run that wrote a bucket-space
            source (``megatron-legacy``; ``megatron-dp-reshardable`` records its buckets)
            or that loads a bucket-space destination (``megatron-dp-reshardable``,
            ``megatron-legacy``): where DDP cuts its grad buffers into buckets, which moves
            each parameter. Megatron's is ``DistributedDataParallelConfig.bucket_size``
            with ``overlap_grad_reduce`` (default max(40M, 1M x DP size) elements); None:
            one bucket per grad buffer, its layout without ``overlap_grad_reduce``.
        moments: store ``exp_avg``/``exp_avg_sq`` as fp32, bf16, fp16, or fp8 (values of
            an FP8 E4M3 store with TE's per-tensor scale, recomputed from the FP32 values
            for each piece the destination's optimizer holds, kept as their FP32
            expansion; an FP8 source moving to another DP size is re-scaled this way).
        master: keep the master as fp32 or fp16, or drop it (``none``).
        layout: the destination's state-dict layout: torch.optim's (a ``step`` per
            parameter) or ``precision-aware`` (TE FusedAdam's portable format,
            ``PrecisionAwareAdamW``'s); default: the source's.
        param_remainders: the source (a ``megatron-fully-reshardable`` checkpoint of a
            precision-aware run with ``store_param_remainders``) holds int16 remainders
            where the FP32 main param would be: rebuild each master, exactly, from its
            remainder and the bf16 model weight saved beside it.
        source_format: the source's format, when detection should not decide.
        location: which optimizer, in a checkpoint holding several (as ``inspect`` names
            them).
        under: for a DCP destination, the key to put the state under (e.g. ``"optim"``
            for a ``{"model": ..., "optim": ...}`` checkpoint); default: the top level.
        allow_lossy: convert even when a change loses information (narrower moments, fp8,
            a dropped master); the report gives each lossy tensor's largest error.
        verify: read the result back and compare it with the source, tensor by tensor.
        trusted: unpickle objects other than tensors and plain containers in ``src``.
        progress: True for a progress line on stderr, or ``fn(done_bytes, total_bytes)``.

    Returns:
        A ``ConversionReport``.

    Raises:
        ConversionError: the source cannot be read as ``source_format``, a tensor does not
            map to the destination (the parameter, state and format named), or a lossy
            change without ``allow_lossy``. Nothing is written.
        FileExistsError: ``dst`` exists.

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from wrapped_optim.checkpoint import convert
        >>> model = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.ones(1, 3)).sum().backward(); opt.step()
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     torch.save(opt.state_dict(), Path(tmp, "optimizer.pt"))
        ...     report = convert(Path(tmp, "optimizer.pt"), Path(tmp, "dcp"), to="dcp",
        ...                      model=model, verify=True)
        >>> report.tensors, report.verified, dict(report.lossy)
        (4, True, {})
    """
    started = time.perf_counter()
    source = get_format(source_format) if source_format else detect_format(src)
    target = get_format(to)
    if source.reader is None or target.writer is None:
        which = source.name if source.reader is None else target.name
        raise ConversionError(
            f"the converter cannot {'read' if which == source.name else 'write'} {which}"
        )
    scaled_by_shard = moments == "fp8" and target.fp8_scales is not None
    if dp is not None and moments == "fp8" and not scaled_by_shard:
        raise ConversionError(
            f"dp={dp} with fp8 moments: {target.name} holds the portable FP32 form, no FP8 "
            "scales (PrecisionAwareAdamW's state_dict() expands FP8 moments, under FSDP2 "
            "too); an FSDP2 run quantizes each shard with its own scale when it loads, so "
            "convert FP32 moments (the default): fp8 here would round twice. Per-shard "
            "scales: " + ", ".join(f.name for f in known_formats() if f.fp8_scales is not None)
        )
    if dp is not None and not target.sharded and not scaled_by_shard:
        raise ConversionError(
            f"dp={dp}: {target.name} holds whole tensors, which load at any data-parallel "
            "size; dp applies to formats sharded by DP rank, and to fp8 moments for a "
            "runtime that keeps a scale per DP shard ("
            + ", ".join(f.name for f in known_formats() if f.fp8_scales is not None)
            + ")"
        )
    by_buckets = source.bucketed or target.bucketed or (scaled_by_shard and dp is not None)
    if bucket_size is not None and not by_buckets:
        raise ConversionError(
            f"bucket_size={bucket_size}: neither {source.name} nor {target.name} stores state "
            "in DDP's buckets; it applies to "
            + ", ".join(f.name for f in known_formats() if f.bucketed)
            + ", and to fp8 moments with dp (the shards holding one scale follow the buckets)"
        )
    if bucket_size is not None and bucket_size < 1:
        raise ConversionError(f"bucket_size={bucket_size}: must be a positive element count")
    if param_remainders and not source.remainders:
        raise ConversionError(
            f"param_remainders: a {source.name} source keeps no int16 remainders to rebuild "
            "masters from; the option applies to "
            + ", ".join(f.name for f in known_formats() if f.remainders)
        )
    options = attrs.evolve(
        _options(names, model, dp, trusted, location, layout, param_remainders),
        bucket_size=bucket_size,
    )
    reader = source.reader(Path(src), attrs.evolve(options, location=location))
    try:
        index, changes = plan(reader.index(), moments=moments, master=master)
        if not allow_lossy:
            refuse_lossy(changes, target.name)
        write_options = attrs.evolve(options, location=under)
        pieces = None
        if scaled_by_shard and dp is not None and target.fp8_scales is not None:
            pieces = target.fp8_scales(index, write_options)
        transformed = TransformingReader(reader, index, changes, pieces)
        shown = _stderr_progress() if progress is True else (progress or None)
        counting = _Counting(transformed, index, shown)
        destination = resolve_checkpoint_path(dst)
        with _staged(destination, target.directory) as staging:
            target.writer(staging, write_options).write(index, counting)
        transformed.dropped_errors()
        if verify:
            _verify(destination, target, write_options, index, transformed)
    finally:
        reader.close()
    return ConversionReport(
        source_format=source.name,
        target_format=target.name,
        tensors=counting.tensors,
        bytes=counting.bytes,
        lossy=dict(transformed.errors),
        seconds=time.perf_counter() - started,
        verified=verify,
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.numel() == 0 or torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _verify(
    path: Path, fmt: Format, options: FormatOptions, expected: StateIndex, source: StateReader
) -> None:
    assert fmt.reader is not None
    if options.names is None:
        # An index-keyed destination was written in the groups' member order: read it back
        # under the same names (a name-keyed one ignores them).
        order = [name for group in expected.groups for name in group.names]
        options = attrs.evolve(options, names=order)
    written = fmt.reader(path, options)
    try:
        got = written.index()
        for param in expected.params:
            other = got.param(param.name)
            if other.step != param.step or dict(other.state) != dict(param.state):
                raise ConversionError(
                    f"verify: parameter {param.name!r} was written as {other}, expected {param}"
                )
            for key in param.state:
                if not _same_bits(written.read(param.name, key), source.read(param.name, key)):
                    raise ConversionError(
                        f"verify: parameter {param.name!r}: state {key!r} differs in {path} "
                        f"({fmt.name}) from the source"
                    )
        for param in expected.params:
            want = dict(expected.groups[param.group].options)
            if dict(got.groups[got.param(param.name).group].options) != want:
                raise ConversionError(
                    f"verify: parameter {param.name!r}: its group's options differ in {path}"
                )
    finally:
        written.close()
