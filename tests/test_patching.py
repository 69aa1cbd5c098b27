from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wrapped_optim.patching import patch_attribute


class Foreign:
    def read(self) -> str:
        return "class"

    @property
    def prop(self) -> int:
        return 1


class Slotted:
    __slots__ = ("x",)


def snapshot(obj: Any) -> dict[str, Any]:
    return dict(vars(obj))


def test_patch_replaces_and_removes_class_attribute() -> None:
    obj = Foreign()
    with patch_attribute(obj, "read", lambda: "patched") as original:
        assert obj.read() == "patched"
        assert original() == "class"
    assert "read" not in vars(obj)
    assert obj.read() == "class"


def test_patch_restores_previous_instance_attribute() -> None:
    obj = Foreign()
    sentinel = object()
    obj.read = sentinel  # type: ignore[method-assign]
    with patch_attribute(obj, "read", "patched"):
        assert obj.read == "patched"
    assert vars(obj)["read"] is sentinel


def test_patch_restores_on_exception() -> None:
    obj = Foreign()
    with pytest.raises(KeyError), patch_attribute(obj, "read", "patched"):
        raise KeyError("boom")
    assert vars(obj) == {}


def test_patch_rejects_data_descriptor_and_slots() -> None:
    with pytest.raises(TypeError, match="property"), patch_attribute(Foreign(), "prop", 2):
        pass
    with pytest.raises(TypeError, match="no instance __dict__"), patch_attribute(Slotted(), "x", 2):
        pass


def test_patch_bypasses_custom_setattr() -> None:
    class Guarded:
        def __setattr__(self, name: str, value: Any) -> None:
            raise AssertionError("must not be called")

    obj = Guarded()
    with patch_attribute(obj, "read", 1):
        assert obj.read == 1  # type: ignore[attr-defined]
    assert vars(obj) == {}


# A nesting plan: each entry patches one of a few names, and some levels raise.
plans = st.lists(
    st.tuples(st.sampled_from(["read", "other", "extra"]), st.booleans()), min_size=1, max_size=6
)


@given(plans, st.booleans())
def test_nested_patches_leave_no_trace(plan: list[tuple[str, bool]], preset: bool) -> None:
    obj = Foreign()
    if preset:
        obj.other = "preset"  # type: ignore[attr-defined]
    before = snapshot(obj)

    def nest(depth: int) -> None:
        if depth == len(plan):
            return
        name, raises = plan[depth]
        with patch_attribute(obj, name, ("patched", depth)):
            assert getattr(obj, name) == ("patched", depth)
            nest(depth + 1)
            if raises:
                raise RuntimeError(depth)
        # After exiting this level, the enclosing level's value is visible again.
        outer = [i for i in range(depth) if plan[i][0] == name]
        if outer:
            assert getattr(obj, name) == ("patched", outer[-1])

    with contextlib.suppress(RuntimeError):
        nest(0)
    assert snapshot(obj) == before


@given(st.integers(min_value=1, max_value=5))
def test_repeated_patches_leave_no_trace(times: int) -> None:
    obj = Foreign()
    for i in range(times):
        with patch_attribute(obj, "read", i):
            assert obj.read == i
    assert vars(obj) == {}


def test_a_second_thread_patching_the_same_attribute_fails_at_once() -> None:
    """Issue 27: interleaved patches from two threads restored each other's values and left
    one on the instance for good. Now the second thread is refused before it changes
    anything; the first one's patch unwinds normally."""
    import threading

    from wrapped_optim.patching import ConcurrentPatchError

    obj = Foreign()
    inside, release = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def first() -> None:
        with patch_attribute(obj, "read", lambda: "first"):
            inside.set()
            assert release.wait(30)

    holder = threading.Thread(target=first)
    holder.start()
    assert inside.wait(30)
    try:
        with patch_attribute(obj, "read", lambda: "second"):
            outcome.append(None)
    except ConcurrentPatchError as error:
        outcome.append(error)
    assert obj.read() == "first"  # the first patch is untouched
    release.set()
    holder.join(30)
    assert isinstance(outcome[0], ConcurrentPatchError) and "inside a scoped patch" in str(
        outcome[0]
    )
    assert "read" not in vars(obj)
    with patch_attribute(obj, "read", lambda: "again"):  # free again once released
        with patch_attribute(obj, "read", lambda: "nested"):  # nesting in one thread
            assert obj.read() == "nested"
        assert obj.read() == "again"
    assert "read" not in vars(obj)
