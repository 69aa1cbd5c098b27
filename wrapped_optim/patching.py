"""The one place in wrapped_optim that changes a foreign object's behaviour: scoped,
per-instance, per-thread attribute patches that are always put back.
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
    """Another thread holds a scoped patch of the same attribute of the same object.

    Raised by ``patch_attribute`` before it changes anything: interleaved patches from two
    threads would restore each other's values and leave one behind.

    Examples:
        >>> import threading
        >>> class Holder:
        ...     pass
        >>> holder, errors = Holder(), []
        >>> def patch_from_another_thread():
        ...     try:
        ...         with patch_attribute(holder, "read", None):
        ...             pass
        ...     except ConcurrentPatchError:
        ...         errors.append("refused")
        >>> with patch_attribute(holder, "read", lambda: "host"):
        ...     thread = threading.Thread(target=patch_from_another_thread)
        ...     thread.start(); thread.join()
        >>> errors
        ['refused']
    """


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
    bypassed) and restored on exit, also when the block raises: a previous instance attribute
    comes back, one that was only on the class is removed again. Nested patches of the same
    attribute within a thread unwind in order.

    Args:
        obj: The object to patch (it needs an instance ``__dict__``).
        name: The attribute's name.
        value: The value it has inside the block.

    Yields:
        The value that was visible before the patch (handy for delegating to it).

    Raises:
        ConcurrentPatchError: another thread holds a patch of the same attribute.
        TypeError: ``obj`` has no instance ``__dict__``, or ``name`` is a data descriptor
            (e.g. a property) on its class.

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
