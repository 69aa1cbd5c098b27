"""Parameter names for index-keyed checkpoints: from a model (and its optimizer), to and from
a small JSON file, and the ``module:callable`` model specs the command line takes."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from wrapped_optim.checkpoint._convert._errors import ConversionError

__all__ = ["ParameterNames", "load_model_spec", "names_from_model", "read_names", "save_names"]

NAMES_FORMAT = "wrapped-optim-parameter-names/1"


def _names(value: Sequence[str]) -> tuple[str, ...]:
    return tuple(value)


def _shapes(value: Any) -> tuple[tuple[int, ...], ...] | None:
    return None if value is None else tuple(tuple(int(s) for s in shape) for shape in value)


@attrs.frozen
class ParameterNames:
    """The optimizer's parameters in its index order: names, and shapes where known (the
    converter then checks that each state fits its parameter).

    Example:
        >>> from wrapped_optim.checkpoint._convert._names import ParameterNames
        >>> ParameterNames(["0.weight", "0.bias"], [(2, 3), (2,)]).shapes
        ((2, 3), (2,))
    """

    names: tuple[str, ...] = attrs.field(converter=_names)
    shapes: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_shapes)


def names_from_model(model: torch.nn.Module, optimizer: Any = None) -> ParameterNames:
    """Names of ``model``'s parameters in the order an optimizer indexes them.

    Without ``optimizer``, the order of ``model.parameters()`` (what ``AdamW(model.parameters())``
    indexes); with it, the order of its param groups (e.g. transformers' Trainer, which puts
    decayed and undecayed parameters in two groups).

    Example:
        >>> import torch
        >>> from wrapped_optim.checkpoint import names_from_model
        >>> model = torch.nn.Linear(3, 2)
        >>> optimizer = torch.optim.AdamW([{"params": [model.bias]}, {"params": [model.weight]}])
        >>> names_from_model(model, optimizer).names
        ('bias', 'weight')
    """
    named = list(model.named_parameters())
    if optimizer is None:
        params = [param for _, param in named]
    else:
        seen: dict[int, Any] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                seen.setdefault(id(param), param)
        params = list(seen.values())
    name_of = {id(param): name for name, param in named}
    missing = [i for i, param in enumerate(params) if id(param) not in name_of]
    if missing:
        raise ConversionError(
            f"the optimizer's parameter {missing[0]} is not a parameter of the model"
        )
    return ParameterNames(
        names=[name_of[id(p)] for p in params], shapes=[tuple(p.shape) for p in params]
    )


def save_names(names: ParameterNames, path: str | os.PathLike[str]) -> None:
    """Writes ``names`` as JSON (what ``names=`` and ``--names`` read).

    Example:
        >>> import json, tempfile, torch
        >>> from wrapped_optim.checkpoint import names_from_model, save_names
        >>> with tempfile.NamedTemporaryFile(suffix=".json") as file:
        ...     save_names(names_from_model(torch.nn.Linear(3, 2)), file.name)
        ...     json.load(open(file.name))["names"]
        ['weight', 'bias']
    """
    payload = {"format": NAMES_FORMAT, "names": list(names.names), "shapes": names.shapes}
    if names.shapes is None:
        del payload["shapes"]
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def read_names(path: str | os.PathLike[str]) -> ParameterNames:
    """A names file written by ``save_names`` (or a JSON list of names)."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: not a readable names file ({error})") from error
    if isinstance(payload, list) and all(isinstance(n, str) for n in payload):
        return ParameterNames(names=payload)  # names only: shapes are not checked
    if not isinstance(payload, dict) or payload.get("format") != NAMES_FORMAT:
        raise ConversionError(f"{path}: not a names file ({NAMES_FORMAT})")
    names, shapes = payload.get("names"), payload.get("shapes")
    if (
        not isinstance(names, list)
        or not all(isinstance(n, str) for n in names)
        or (shapes is not None and (not isinstance(shapes, list) or len(shapes) != len(names)))
    ):
        raise ConversionError(f"{path}: names and shapes must be two lists of equal length")
    return ParameterNames(names=names, shapes=shapes)


def as_names(value: Any) -> ParameterNames | None:
    """``names=`` in any accepted form: ParameterNames, a names file, or a list of names."""
    if value is None or isinstance(value, ParameterNames):
        return value
    if isinstance(value, (str, os.PathLike)):
        return read_names(value)
    if isinstance(value, Sequence) and all(isinstance(n, str) for n in value):
        return ParameterNames(names=value)
    raise TypeError(f"names: expected ParameterNames, a path or a list of str, got {type(value)}")


def load_model_spec(spec: str) -> tuple[torch.nn.Module, Any]:
    """Builds the model (and optimizer, if returned) that ``module:callable`` names.

    ``module`` is an importable module or a ``.py`` file; ``callable`` takes no argument and
    returns a ``torch.nn.Module`` on the CPU, or a ``(model, optimizer)`` pair.
    """
    module_name, _, attribute = spec.rpartition(":")
    if not module_name or not attribute:
        raise ConversionError(f"--model {spec!r}: expected MODULE:CALLABLE (or FILE.py:CALLABLE)")
    try:
        if module_name.endswith(".py"):
            loader = importlib.util.spec_from_file_location("_wrapped_optim_model", module_name)
            if loader is None or loader.loader is None:
                raise ImportError(f"cannot load {module_name}")
            module = importlib.util.module_from_spec(loader)
            sys.modules.setdefault("_wrapped_optim_model", module)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        built = getattr(module, attribute)()
    except (ImportError, AttributeError) as error:
        raise ConversionError(f"--model {spec!r}: {error}") from error
    model, optimizer = built if isinstance(built, tuple) else (built, None)
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(f"--model {spec!r}: returned a {type(model).__name__}, not a module")
    return model, optimizer
