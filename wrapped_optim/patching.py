"""The one place in wrapped_optim that changes a foreign object's behaviour.

Some fixes can only be made by changing what a foreign optimizer does *during one call* (e.g.
TE's ``get_unscaled_state`` while a Megatron DistributedOptimizer builds its state dict).
:func:`patch_attribute` does that on the instance only, for the length of a ``with`` block,
and puts the instance back exactly as it was: a previous instance attribute is restored, an
attribute that was only on the class is removed from the instance again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["patch_attribute"]

_MISSING = object()


def _instance_dict(obj: Any, name: str) -> dict[str, Any]:
    try:
        namespace = vars(obj)
    except TypeError:
        raise TypeError(
            f"cannot patch {name!r} on a {type(obj).__name__}: it has no instance __dict__ "
            "(a __slots__ class or a builtin); wrap the object instead"
        ) from None
    descriptor = getattr(type(obj), name, None)
    if descriptor is not None and hasattr(descriptor, "__set__"):
        raise TypeError(
            f"cannot patch {name!r} on a {type(obj).__name__}: it is a property or other data "
            "descriptor on the class, so an instance attribute would be ignored"
        )
    return namespace


@contextmanager
def patch_attribute(obj: Any, name: str, value: Any) -> Iterator[Any]:
    """Sets ``obj.<name> = value`` on the instance for the duration of the ``with`` block.

    The instance ``__dict__`` is written directly (the object's own ``__setattr__`` is
    bypassed) and restored on exit, also when the block raises. Nested and repeated patches
    of the same attribute unwind in order. Yields the value that was visible before the patch
    (handy for delegating to it).

    Example:
        >>> class Holder:
        ...     def read(self):
        ...         return "device"
        >>> holder = Holder()
        >>> with patch_attribute(holder, "read", lambda: "host") as original:
        ...     holder.read(), original()
        ('host', 'device')
        >>> "read" in vars(holder)
        False
    """
    namespace = _instance_dict(obj, name)
    previous_visible = getattr(obj, name, None)
    previous = namespace.get(name, _MISSING)
    namespace[name] = value
    try:
        yield previous_visible
    finally:
        if previous is _MISSING:
            namespace.pop(name, None)
        else:
            namespace[name] = previous
