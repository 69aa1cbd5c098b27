"""Which optimizer classes a ``torch.save`` file pickles (it imports nothing of the package).

Megatron's HybridDeviceOptimizer keeps its sub-optimizer classes in its param groups, so its
checkpoints pickle classes that torch's weights-only unpickler refuses. Readers allow exactly
the optimizer classes a file names that this process has imported, or that live in torch's
or this package's optimizer modules (imported here when needed: code of torch and of this
package, never of the file's choosing); every other global stays refused.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

__all__ = ["optimizer_classes_named_in"]

_IMPORTABLE = ("torch.optim.", "wrapped_optim.optimizers.")
"""Module prefixes whose optimizer classes may be imported to read a file that names them."""


def _module(name: str) -> object:
    if name not in sys.modules and name.startswith(_IMPORTABLE):
        try:
            importlib.import_module(name)
        except ImportError:
            return None
    return sys.modules.get(name)


def optimizer_classes_named_in(path: str | os.PathLike[str]) -> list[type]:
    """The imported ``torch.optim.Optimizer`` subclasses the file at ``path`` pickles; empty
    when the file is missing or unreadable (its own load then reports that).

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.save({"cls": torch.optim.SGD}, f"{d}/state.pt")
        ...     optimizer_classes_named_in(f"{d}/state.pt")
        [<class 'torch.optim.sgd.SGD'>]
    """
    if not os.path.isfile(path):
        return []
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception:  # unreadable: the caller's load reports it
        return []
    classes: list[type] = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        value = getattr(_module(module), attribute, None)
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            classes.append(value)
    return classes
