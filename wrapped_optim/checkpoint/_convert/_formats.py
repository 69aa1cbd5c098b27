"""The formats the converter knows: name -> reader and writer factories, and detection.

Adding a format is one entry: a module that defines ``FORMATS``, a tuple of ``Format``
records, named in ``_FORMAT_MODULES`` below (imported on first use, so this module imports
no format and no optional framework). For example, Megatron's formats live in a module that
defines::

    FORMATS = (
        Format(
            name="megatron-fully-reshardable",
            summary="Megatron-Core dist_checkpointing, fully_reshardable",
            reader=MegatronReader,          # (path, FormatOptions) -> StateReader
            writer=MegatronWriter,          # (path, FormatOptions) -> StateWriter, or None
            detect=is_fully_reshardable,    # (path) -> bool, cheap, never unpickles
            directory=True,
            priority=10,                    # tried before the plain DCP check
            sharded=True,                   # its writer takes FormatOptions.dp_size
        ),
    )

``register_format`` adds one at run time as well (a plug-in, a test). A writer factory
receives ``FormatOptions``: ``dp_size`` is the DP size a sharded destination is written for;
``names``/``shapes`` name index-keyed parameters. A format module imports its optional
framework (megatron-core, deepspeed) inside its readers and writers, never at module level:
every command that lists or detects formats imports every format module.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import attrs

from wrapped_optim.checkpoint._convert._canonical import StateIndex, StateReader, StateWriter
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["Format", "detect_format", "get_format", "known_formats", "register_format"]

ReaderFactory = Callable[[Path, FormatOptions], StateReader]
WriterFactory = Callable[[Path, FormatOptions], StateWriter]
ScalePieces = Callable[[StateIndex, FormatOptions], Mapping[str, Sequence[tuple[int, int]]]]


@attrs.frozen
class Format:
    """One checkpoint format the converter reads and/or writes.

    Attributes:
        name: what ``to=`` / ``--to`` and ``source_format=`` call it.
        summary: one line for ``wrapped-optim convert --list`` and the docs.
        reader: opens a path for reading, or None (write-only).
        writer: builds a writer for a (staging) path, or None (read-only).
        detect: tells whether a path is in this format without unpickling anything.
        directory: the format is a directory (else one file).
        priority: detection order, highest first (a DCP-based format more specific than
            plain DCP sets a higher one).
        sharded: the writer lays state out for a data-parallel size (``dp_size`` /
            ``--dp``); a format of whole tensors loads at any DP size and refuses ``dp``.
        remainders: the reader rebuilds FP32 masters kept as bf16 weights plus int16
            remainders (``FormatOptions.param_remainders``); others refuse the option.
        fp8_scales: where the runtime that loads this format at ``FormatOptions.dp_size``
            keeps one FP8 scale: per parameter, the flat ranges of its elements each rank's
            optimizer holds as one tensor. ``moments="fp8"`` with ``dp`` quantizes by them;
            None: the whole tensor (a runtime that keeps whole parameters), and ``dp``
            refused for a format that is not ``sharded``. A sharded format whose runtime
            keeps a scale per shard sets it.
        bucketed: the format stores state in DDP's grad-buffer buckets, whose boundaries
            follow the run's bucket size (``FormatOptions.bucket_size``); others refuse it.
    """

    name: str
    summary: str
    reader: ReaderFactory | None
    writer: WriterFactory | None
    detect: Callable[[Path], bool] | None
    directory: bool
    priority: int = 0
    sharded: bool = False
    remainders: bool = False
    fp8_scales: ScalePieces | None = None
    bucketed: bool = False


_FORMAT_MODULES = (
    "wrapped_optim.checkpoint._convert._torch_save_format",
    "wrapped_optim.checkpoint._convert._dcp_format",
    "wrapped_optim.checkpoint._convert._megatron_format",
    "wrapped_optim.checkpoint._convert._deepspeed_format",
)
_REGISTRY: dict[str, Format] = {}
_LOADED: list[bool] = []


def _load() -> None:
    if _LOADED:
        return
    for module in _FORMAT_MODULES:
        for fmt in importlib.import_module(module).FORMATS:
            _REGISTRY.setdefault(fmt.name, fmt)
    _LOADED.append(True)


def register_format(fmt: Format, *, replace: bool = False) -> None:
    """Adds ``fmt`` (``replace`` to supersede one of the same name)."""
    _load()
    if fmt.name in _REGISTRY and not replace:
        raise ValueError(f"a format named {fmt.name!r} is already registered")
    _REGISTRY[fmt.name] = fmt


def known_formats() -> tuple[Format, ...]:
    """Every registered format, by name."""
    _load()
    return tuple(_REGISTRY[name] for name in sorted(_REGISTRY))


def get_format(name: str) -> Format:
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConversionError(
            f"unknown format {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The readable format ``path`` is in (most specific first)."""
    _load()
    where = Path(path)
    if not where.exists():
        raise ConversionError(f"{where}: no such file or directory")
    candidates = sorted(
        (f for f in _REGISTRY.values() if f.reader is not None and f.detect is not None),
        key=lambda f: -f.priority,
    )
    for fmt in candidates:
        if fmt.detect is not None and fmt.detect(where):
            return fmt
    raise ConversionError(
        f"{where}: not a checkpoint format the converter knows (tried "
        f"{', '.join(f.name for f in candidates)}); name it with source_format= (CLI: --from)"
    )
