"""Fault injection: an exception at any internal call leaves every stack consistent.

For each stack and each operation (``init_optimizer_state``, ``step``, ``state_dict``,
``load_state_dict``; the streaming ``save_optimizer`` / ``load_optimizer`` on four stacks), a
dry run counts the calls made to every injection site — tensor copies, the leaf's and
sub-optimizers' ``step``/``load_state_dict``, precision-aware accessors, codec functions.
Then the operation is repeated on a fresh stack with one call raising: ``KeyboardInterrupt``
at every call of every site (up to ``WRAPPED_OPTIM_FAULT_CALLS`` calls per site, default 6,
spread evenly over the site's calls and always including the first and the last; ``all`` for
every call), and a ``RuntimeError`` at the first and the last call. Afterwards:

* no patch is left behind: every foreign object's instance attributes and every patched
  class are exactly as before;
* grads are restored: the same grad objects with the same bits and the same ``grad_dtype``;
* the state is either unchanged or consistently advanced (exactly what the operation produces
  without a fault) — never half-updated — for optimizer state *and* parameters together;
* the stack still works: retrying the operation gives the fault-free result, and the next
  training step equals the one after a fault-free operation.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from _suite_targets import TARGETS, Target

from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim.testing import (
    StateMismatchError,
    assert_state_dict_equal,
    checkpoint_roundtrip,
    optimizer_params,
    state_dict_differences,
    synthetic_gradients,
)


class InjectedFault(RuntimeError):
    """The exception planted at an injection site."""


class InjectedInterrupt(KeyboardInterrupt):
    """Ctrl-C planted at a site (not an ``Exception``: ``except Exception`` misses it)."""


_PLANTED = (InjectedFault, InjectedInterrupt)


@attrs.define
class Site:
    """``owner.name`` (a class or a module attribute) made to raise on its ``fail_at``-th call."""

    label: str
    owner: Any
    name: str
    calls: int = 0
    fail_at: int | None = None
    interrupt: bool = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[Site]:
        missing = self.name not in vars(self.owner)  # e.g. Tensor.copy_ lives on TensorBase
        original = getattr(self.owner, self.name) if missing else vars(self.owner)[self.name]
        function = original.__func__ if isinstance(original, staticmethod) else original

        def injected(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.fail_at is not None and self.calls == self.fail_at:
                kind = InjectedInterrupt if self.interrupt else InjectedFault
                raise kind(f"injected at call {self.calls} of {self.label}")
            return function(*args, **kwargs)

        replacement: Any = (
            staticmethod(injected) if isinstance(original, staticmethod) else injected
        )
        setattr(self.owner, self.name, replacement)
        try:
            yield self
        finally:
            if missing:
                delattr(self.owner, self.name)
            else:
                setattr(self.owner, self.name, original)


_ACCESSORS = (
    "get_unscaled_state",
    "set_scaled_state",
    "read_unscaled_state_chunk",
    "write_scaled_state_chunked",
    "step",
    "load_state_dict",
    "state_dict",
)
_CODECS = ("encode", "decode", "encode_into", "decode_into", "split_master", "join_master")


def _foreign_objects(stack: Any) -> list[Any]:
    """Every object of the stack a wrapper might patch: layers, leaves, sub-optimizers."""
    objects: list[Any] = []
    layers = stack.layers() if hasattr(stack, "layers") else [stack]
    objects += layers
    for leaf in walk_leaves(stack):
        if leaf.optimizer is not None:
            objects.append(leaf.optimizer)
            objects += list(getattr(leaf.optimizer, "sub_optimizers", []) or [])
    unique: dict[int, Any] = {}
    for obj in objects:
        unique.setdefault(id(obj), obj)
    return list(unique.values())


def _sites(stack: Any) -> list[Site]:
    sites = [Site("Tensor.copy_", torch.Tensor, "copy_")]
    classes: dict[type, None] = {}
    for obj in _foreign_objects(stack):
        if not hasattr(obj, "layers"):  # a leaf or sub-optimizer, not one of our wrappers
            classes.setdefault(type(obj), None)
    for cls in classes:
        for name in _ACCESSORS:
            for klass in cls.__mro__:
                if name in klass.__dict__ and klass is not object:
                    sites.append(Site(f"{klass.__name__}.{name}", klass, name))
                    break
    with contextlib.suppress(ImportError):
        from wrapped_optim._formats import codecs

        for name in _CODECS:
            if name in vars(codecs):
                sites.append(Site(f"codecs.{name}", codecs, name))
    unique: dict[tuple[int, str], Site] = {}
    for site in sites:
        unique.setdefault((id(site.owner), site.name), site)
    return list(unique.values())


def _patch_snapshot(objects: list[Any]) -> list[dict[str, int]]:
    # Callables in instance dicts (where patches live), plus every instance key.
    return [
        {key: id(value) if callable(value) else 0 for key, value in vars(obj).items()}
        for obj in objects
    ]


def _class_snapshot(objects: list[Any]) -> dict[type, dict[str, int]]:
    return {
        klass: {key: id(value) for key, value in vars(klass).items()}
        for obj in objects
        for klass in type(obj).__mro__
        if klass is not object
    }


def _grads(stack: Any) -> list[tuple[Any, torch.Tensor | None, torch.Tensor | None, Any]]:
    return [
        (p, p.grad, None if p.grad is None else p.grad.clone(), getattr(p, "grad_dtype", None))
        for p in optimizer_params(stack)
    ]


def _bundle(stack: Any) -> dict[str, Any]:
    return {
        "optimizer": checkpoint_roundtrip(stack.state_dict()),
        "params": [p.detach().clone() for p in optimizer_params(stack)],
    }


@attrs.frozen
class Operation:
    name: str
    prepare: Callable[[Target], tuple[Any, Any]]  # -> (stack, argument)
    run: Callable[[Any, Any], Any]


def _prepare_step(target: Target) -> tuple[Any, Any]:
    _, stack = target.stepped(1)
    synthetic_gradients(stack, step=1)
    return stack, None


def _run_step(stack: Any, _: Any) -> Any:
    return stack.step()


def _prepare_state_dict(target: Target) -> tuple[Any, Any]:
    return target.stepped(2)[1], None


def _run_state_dict(stack: Any, _: Any) -> Any:
    return checkpoint_roundtrip(stack.state_dict())


def _prepare_load(target: Target) -> tuple[Any, Any]:
    _, other = target.stepped(3)
    checkpoint = checkpoint_roundtrip(other.state_dict())
    return target.stepped(2)[1], checkpoint


def _run_load(stack: Any, checkpoint: Any) -> Any:
    stack.load_state_dict(checkpoint_roundtrip(checkpoint))


def _prepare_init(target: Target) -> tuple[Any, Any]:
    return target.make()[1], None


def _run_init(stack: Any, _: Any) -> Any:
    from wrapped_optim.fsdp import init_optimizer_state

    return init_optimizer_state(stack)


_CHECKPOINTS = Path(tempfile.mkdtemp(prefix="wrapped-optim-faults-"))
atexit.register(shutil.rmtree, _CHECKPOINTS, ignore_errors=True)


def _new_checkpoint_dir() -> Path:
    return Path(tempfile.mkdtemp(dir=_CHECKPOINTS))


def _prepare_save_optimizer(target: Target) -> tuple[Any, Any]:
    return target.stepped(2)[1], _new_checkpoint_dir() / "ckpt"


def _run_save_optimizer(stack: Any, path: Any) -> Any:
    from wrapped_optim.checkpoint import save_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_optimizer(stack, path, chunk_bytes=256)


def _prepare_load_optimizer(target: Target) -> tuple[Any, Any]:
    _, other = target.stepped(3)
    path = _new_checkpoint_dir() / "ckpt"
    _run_save_optimizer(other, path)
    return target.stepped(2)[1], path


def _run_load_optimizer(stack: Any, path: Any) -> Any:
    from wrapped_optim.checkpoint import load_optimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_optimizer(stack, path, chunk_bytes=256)


OPERATIONS = {
    "init_optimizer_state": Operation("init_optimizer_state", _prepare_init, _run_init),
    "step": Operation("step", _prepare_step, _run_step),
    "state_dict": Operation("state_dict", _prepare_state_dict, _run_state_dict),
    "load_state_dict": Operation("load_state_dict", _prepare_load, _run_load),
    "save_optimizer": Operation("save_optimizer", _prepare_save_optimizer, _run_save_optimizer),
    "load_optimizer": Operation("load_optimizer", _prepare_load_optimizer, _run_load_optimizer),
}
# The streaming checkpoint (wrapped_optim.checkpoint) on the stacks that reach each of its
# paths: a torch optimizer, a precision-aware holder (both codec paths, one behind staging),
# a hybrid behind HybridSyncOptimizer.
_STREAMING = ("save_optimizer", "load_optimizer")
_STREAMING_TARGETS = (
    "adamw",
    "precision_adamw[remainders]",
    "staged(precision_adamw[fp8/fp16 moments, fp16 master])",
    "hybrid_sync(hybrid_offload[bf16])",
)

# Real bugs found here, reported to the lead: (target-name fragment, operation) -> why.
KNOWN_BUG_RULES: dict[tuple[str, str], str] = {}


# Found by the KeyboardInterrupt injection, reported to the lead (the code is not this
# suite's to fix): (target-name fragment, operation) -> why. Faults of other kinds are still
# checked for these cases; if the interrupt problems disappear, the test fails so that the
# rule is removed.
KNOWN_INTERRUPT_BUGS: dict[tuple[str, str], str] = {}


def _known_bug(
    target: Target, operation: str, rules: dict[tuple[str, str], str] = KNOWN_BUG_RULES
) -> str | None:
    for (fragment, op), reason in rules.items():
        if fragment in target.name and op == operation:
            return reason
    return None


def _fault_free(
    target: Target, operation: Operation
) -> tuple[dict[str, Any], dict[str, Any], list[int]]:
    """The outcome without faults, that after one more step, and each site's call count."""
    stack, argument = operation.prepare(target)
    sites = _sites(stack)
    with contextlib.ExitStack() as armed:
        for site in sites:
            armed.enter_context(site.armed())
        operation.run(stack, argument)
    clean = _bundle(stack)
    _continue(stack)
    return clean, _bundle(stack), [site.calls for site in sites]


def _continue(stack: Any) -> None:
    """One more training step (hidden damage — scales, copies, sub-optimizers — shows here)."""
    stack.zero_grad()
    synthetic_gradients(stack, step=20)
    stack.step()


def _check_one(
    target: Target,
    operation: Operation,
    site_index: int,
    fail_at: int,
    clean: dict[str, Any],
    clean_next: dict[str, Any],
    interrupt: bool = False,
) -> list[str]:
    stack, argument = operation.prepare(target)
    objects = _foreign_objects(stack)
    before = _bundle(stack)
    patches, classes, grads = _patch_snapshot(objects), _class_snapshot(objects), _grads(stack)
    site = _sites(stack)[site_index]
    site.fail_at = fail_at
    site.interrupt = interrupt
    raised: BaseException | None = None
    with site.armed():
        try:
            operation.run(stack, argument)
        except BaseException as error:
            raised = error
    kind = "KeyboardInterrupt" if interrupt else "fault"
    where = f"{target.name} {operation.name}, {kind} at call {fail_at} of {site.label}"
    problems = []
    if raised is not None and not _caused_by_fault(raised):
        problems.append(f"{where}: the fault surfaced as {type(raised).__name__}: {raised}")
    if _patch_snapshot(objects) != patches:
        problems.append(f"{where}: an instance attribute patch was left behind")
    if _class_snapshot(objects) != classes:
        problems.append(f"{where}: a class attribute was left patched")
    for index, (param, grad, bits, grad_dtype) in enumerate(grads):
        if param.grad is not grad or getattr(param, "grad_dtype", None) != grad_dtype:
            problems.append(f"{where}: param {index}'s grad object / grad_dtype not restored")
        elif bits is not None and not torch.equal(param.grad, bits):
            problems.append(f"{where}: param {index}'s grad values changed")
    after = _bundle(stack)
    unchanged = not state_dict_differences(before, after)
    advanced = not state_dict_differences(clean, after)
    if raised is None and not advanced:
        problems.append(f"{where}: swallowed the fault and produced a different result")
    elif not (unchanged or advanced):
        diff = state_dict_differences(before, after)[:3]
        problems.append(f"{where}: half-updated state: {[str(d) for d in diff]}")
    elif unchanged and operation.name != "state_dict":
        # Recovers: a retry gives the fault-free result.
        try:
            operation.run(stack, argument)
            assert_state_dict_equal(clean, _bundle(stack), names=("fault-free", "retried"))
        except (StateMismatchError, Exception) as error:
            problems.append(f"{where}: retry after the fault failed: {error}")
            return problems
    if problems:
        return problems
    # Training goes on exactly as after a fault-free operation.
    try:
        _continue(stack)
        assert_state_dict_equal(clean_next, _bundle(stack), names=("fault-free", "faulted"))
    except (StateMismatchError, Exception) as error:
        problems.append(f"{where}: the next step differs from the fault-free run: {error}")
    return problems


def _caused_by_fault(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, _PLANTED):
            return True
        failures = getattr(error, "failures", None)  # DCP's CheckpointException, per rank
        if isinstance(failures, dict) and failures:
            failure = next(iter(failures.values()))
            error = failure[0] if isinstance(failure, tuple) else failure
            seen += 1
            continue
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _calls_to_interrupt(count: int) -> list[int]:
    """Which calls of a site get a KeyboardInterrupt: all, or an even spread with both ends."""
    limit = os.environ.get("WRAPPED_OPTIM_FAULT_CALLS", "6")
    if limit == "all" or count <= int(limit):
        return list(range(1, count + 1))
    n = max(2, int(limit))
    return sorted({1 + round(i * (count - 1) / (n - 1)) for i in range(n)})


# Torch's own optimizers are not ours to fix: one of them is the baseline; the budget goes to
# our wrappers and optimizers (two PrecisionAwareAdamW configurations cover both codec paths).
FAULT_TARGETS = [
    target
    for name, target in TARGETS.items()
    if name in ("adamw", "staged(adam)")
    or name.startswith(("fsdp", "hybrid"))
    or (("precision_adamw" in name) and ("remainders" in name or "fp8" in name))
]


def _cases() -> list[Any]:
    params = []
    for target in FAULT_TARGETS:
        for name in OPERATIONS:
            if name in _STREAMING and target.name not in _STREAMING_TARGETS:
                continue
            reason = _known_bug(target, name)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(target, name, id=f"{target.name}-{name}", marks=marks))
    return params


@pytest.mark.parametrize(("target", "operation_name"), _cases())
def test_fault_at_every_internal_call(target: Target, operation_name: str) -> None:
    operation = OPERATIONS[operation_name]
    clean, clean_next, calls = _fault_free(target, operation)
    problems: list[str] = []
    interrupted: list[str] = []
    injected = 0
    for site_index, count in enumerate(calls):
        for fail_at in sorted({1, count} - {0}):
            injected += 1
            problems += _check_one(target, operation, site_index, fail_at, clean, clean_next)
        for fail_at in _calls_to_interrupt(count):
            injected += 1
            interrupted += _check_one(
                target, operation, site_index, fail_at, clean, clean_next, interrupt=True
            )
    known = _known_bug(target, operation_name, KNOWN_INTERRUPT_BUGS)
    if known is None:
        problems += interrupted
    assert injected > 0, f"no injection site is reached by {target.name} {operation_name}"
    assert not problems, "\n".join(problems[:12]) + (
        f"\n... {len(problems) - 12} more" if len(problems) > 12 else ""
    )
    if known is not None:
        assert interrupted, f"fixed? remove the KNOWN_INTERRUPT_BUGS rule: {known}"
        pytest.xfail(f"{len(interrupted)} interrupt problems, known: {known}")


def test_sites_cover_sub_optimizer_steps_and_codecs_where_present() -> None:
    """Guards against vacuous injection: the interesting sites are actually reached."""
    reached: set[str] = set()
    for target in FAULT_TARGETS:
        for operation in OPERATIONS.values():
            stack, argument = operation.prepare(target)
            sites = _sites(stack)
            with contextlib.ExitStack() as armed:
                for site in sites:
                    armed.enter_context(site.armed())
                operation.run(stack, argument)
            reached |= {site.label for site in sites if site.calls}
    assert "Tensor.copy_" in reached
    assert any(label.endswith(".step") for label in reached)
    if any(name.startswith("hybrid") for name in TARGETS):
        assert any(label.startswith(("AdamW.", "Adam.")) for label in reached)
    if any(name.startswith("precision") for name in TARGETS):
        assert any(label.startswith("codecs.") for label in reached), sorted(reached)
        assert any("scaled_state" in label for label in reached), sorted(reached)
