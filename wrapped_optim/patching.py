"""The one place in wrapped_optim that changes a foreign object's behaviour.

Some fixes can only be made by changing what a foreign optimizer does *during one call* (e.g.
TE's ``get_unscaled_state`` while a Megatron DistributedOptimizer builds its state dict).
``patch_attribute`` does that on the instance only, for the length of a ``with`` block,
and puts the instance back exactly as it was: a previous instance attribute is restored, an
attribute that was only on the class is removed from the instance again.

A scoped patch belongs to the thread that made it. Patches of one attribute nest within a
thread; another thread that tries to patch the same attribute of the same object while one is
active gets ``ConcurrentPatchError`` at once (two threads checkpointing one optimizer, for
example), since interleaved patches would restore each other's values and leave one behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ConcurrentPatchError", "patch_attribute"]

_MISSING = object()

_lock = threading.Lock()
# (id(obj), name) -> [obj, owning thread, depth]; obj is held so that its id is not reused.
_active: dict[tuple[int, str], list[Any]] = {}


class ConcurrentPatchError(RuntimeError):
    """Another thread holds a scoped patch of the same attribute of the same object."""


def _claim(obj: Any, name: str) -> tuple[int, str]:
    key = (id(obj), name)
    me = threading.get_ident()
    with _lock:
        entry = _active.get(key)
        if entry is None:
            _active[key] = [obj, me, 1]
        elif entry[1] == me:
            entry[2] += 1
        else:
            owner = next((t.name for t in threading.enumerate() if t.ident == entry[1]), "?")
            raise ConcurrentPatchError(
                f"cannot patch {name!r} on a {type(obj).__name__}: thread {owner!r} is inside a "
                "scoped patch of it (e.g. two threads checkpointing or staging one optimizer at "
                "once); run those calls one after the other"
            )
    return key


def _release(key: tuple[int, str]) -> None:
    with _lock:
        entry = _active[key]
        entry[2] -= 1
        if entry[2] == 0:
            del _active[key]


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
    of the same attribute unwind in order; a patch of an attribute that another thread holds
    patched raises ``ConcurrentPatchError`` before changing anything. Yields the value
    that was visible before the patch (handy for delegating to it).

    Examples:
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
    key = _claim(obj, name)
    try:
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
    finally:
        _release(key)
