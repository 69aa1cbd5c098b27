"""Round-trip assertions for optimizer state: bitwise comparison, resume and transparency.

Checkpoint bugs are rarely loud: a state that loads into the wrong parameter, a moment stored
in the wrong dtype, a step counter that became a float. These assertions compare bit for bit
and, when something differs, say exactly where: which parameter index (the integer key of the
optimizer's ``state``) and which state name.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "Difference",
    "StateMismatchError",
    "assert_resume_equivalent",
    "assert_state_dict_equal",
    "assert_transparent",
    "checkpoint_roundtrip",
    "optimizer_params",
    "state_dict_differences",
    "synthetic_gradients",
]

#: How many differences a failure message lists before it summarises the rest.
MAX_LISTED = 8

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@attrs.frozen
class Difference:
    """One place where two state dicts differ.

    Attributes:
        path: keys from the root to the differing value, e.g. ``("state", 3, "exp_avg")``.
        detail: what differs there (dtype, shape, which element, a missing key, ...).

    Examples:
        >>> d = Difference(("state", 3, "exp_avg"), "dtype torch.float32 != torch.bfloat16")
        >>> d.param_index, d.state_name
        (3, 'exp_avg')
        >>> str(d)
        "param 3, state 'exp_avg': dtype torch.float32 != torch.bfloat16"
    """

    path: tuple[Any, ...]
    detail: str

    @property
    def param_index(self) -> int | None:
        """The parameter index (key of the optimizer's ``state``) the path goes through."""
        for position, key in enumerate(self.path[:-1]):
            if key == "state" and isinstance(self.path[position + 1], int):
                return int(self.path[position + 1])
        return None

    @property
    def state_name(self) -> str | None:
        """The per-parameter state name (``"exp_avg"``, ``"step"``, ...) the path goes through."""
        for position, key in enumerate(self.path[:-2]):
            if key == "state" and isinstance(self.path[position + 1], int):
                name = self.path[position + 2]
                return name if isinstance(name, str) else repr(name)
        return None

    @property
    def location(self) -> str:
        """The path in words: ``param 3, state 'exp_avg'`` or ``param_groups[0]['lr']``."""
        path = self.path
        prefix: list[str] = []
        for position, key in enumerate(path[:-1]):
            if key == "state" and isinstance(path[position + 1], int):
                prefix = [_format_keys(path[:position])] if position else []
                words = f"param {path[position + 1]}"
                rest = path[position + 2 :]
                if rest:
                    words += f", state {rest[0]!r}" + _format_keys(rest[1:])
                return ": ".join(p for p in [*prefix, words] if p)
        if path and path[0] == "param_groups" and len(path) > 1:
            return "param_groups" + _format_keys(path[1:])
        return _format_keys(path) or "the root"

    def __str__(self) -> str:
        return f"{self.location}: {self.detail}"


def _format_keys(keys: Sequence[Any]) -> str:
    if not keys:
        return ""
    head, *rest = keys
    text = str(head) if isinstance(head, str) else f"[{head!r}]"
    return text + "".join(f"[{key!r}]" for key in rest)


class StateMismatchError(AssertionError):
    """Raised by the assertions of this module; lists every ``Difference`` found.

    Args:
        headline: What was compared (the message's first line).
        differences: Every difference found, in traversal order.

    Attributes:
        differences: Every difference found, in traversal order.
        param_index: The first difference's parameter index (``None`` outside ``state``).
        state_name: The first difference's state name (``None`` outside ``state``).

    Examples:
        >>> import torch
        >>> a = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": []}
        >>> b = {"state": {0: {"step": torch.tensor(2.0)}}, "param_groups": []}
        >>> try:
        ...     assert_state_dict_equal(a, b)
        ... except StateMismatchError as error:
        ...     (error.param_index, error.state_name)
        (0, 'step')
    """

    def __init__(self, headline: str, differences: Sequence[Difference]) -> None:
        self.headline = headline
        self.differences = list(differences)
        first = self.differences[0] if self.differences else None
        self.param_index = first.param_index if first else None
        self.state_name = first.state_name if first else None
        lines = [f"{headline}: {len(self.differences)} difference(s)"]
        lines += [f"  - {difference}" for difference in self.differences[:MAX_LISTED]]
        if len(self.differences) > MAX_LISTED:
            lines.append(f"  ... and {len(self.differences) - MAX_LISTED} more")
        super().__init__("\n".join(lines))


# ----------------------------------------------------------------------------------------------
# Bitwise comparison
# ----------------------------------------------------------------------------------------------
def _as_plain_tensor(value: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(value, "full_tensor", None)  # DTensor: compare the whole tensor
    if callable(full_tensor):
        value = full_tensor()
    if value.layout != torch.strided:
        value = value.to_dense()
    return value.detach()


def _tensor_difference(a: torch.Tensor, b: torch.Tensor, *, ignore_device: bool) -> str | None:
    a, b = _as_plain_tensor(a), _as_plain_tensor(b)
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} != {b.dtype}"
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    if not ignore_device and a.device != b.device:
        return f"device {a.device} != {b.device}"
    if a.numel() == 0:
        return None
    bits_type = _SAME_SIZE_INT[a.element_size()]
    a_bits = a.cpu().contiguous().reshape(-1).view(bits_type)
    b_bits = b.cpu().contiguous().reshape(-1).view(bits_type)
    unequal = a_bits != b_bits
    count = int(unequal.sum())
    if count == 0:
        return None
    first = int(unequal.nonzero()[0, 0])
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), a.shape))
    a_value = a.cpu().reshape(-1)[first].item()
    b_value = b.cpu().reshape(-1)[first].item()
    where = f"at index {index}" if a.dim() else "(0-d)"
    return (
        f"{count} of {a.numel()} elements differ bitwise; first {where}: "
        f"{a_value!r} (bits {int(a_bits[first]):#x}) != {b_value!r} (bits {int(b_bits[first]):#x})"
    )


def _scalar_difference(a: Any, b: Any) -> str | None:
    if type(a) is not type(b):
        return f"type {type(a).__name__} ({a!r}) != {type(b).__name__} ({b!r})"
    if isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            return f"{a!r} != {b!r}" + (" (bitwise)" if a == b or math.isnan(a) else "")
        return None
    try:
        equal = bool(a == b)
    except Exception as error:  # an object whose == is not a boolean
        return f"cannot compare {type(a).__name__} values: {error}"
    return None if equal else f"{a!r} != {b!r}"


def _differences(
    a: Any, b: Any, path: tuple[Any, ...], *, ignore_device: bool, names: tuple[str, str]
) -> Iterator[Difference]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            yield Difference(path, f"type {type(a).__name__} ({a!r}) != {type(b).__name__} ({b!r})")
            return
        detail = _tensor_difference(a, b, ignore_device=ignore_device)
        if detail is not None:
            yield Difference(path, detail)
        return
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        if not (isinstance(a, Mapping) and isinstance(b, Mapping)):
            yield Difference(path, f"type {type(a).__name__} != {type(b).__name__}")
            return
        yield from _mapping_differences(a, b, path, ignore_device=ignore_device, names=names)
        return
    if isinstance(a, list | tuple) or isinstance(b, list | tuple):
        yield from _sequence_differences(a, b, path, ignore_device=ignore_device, names=names)
        return
    detail = _scalar_difference(a, b)
    if detail is not None:
        yield Difference(path, detail)


def _mapping_differences(
    a: Mapping[Any, Any],
    b: Mapping[Any, Any],
    path: tuple[Any, ...],
    *,
    ignore_device: bool,
    names: tuple[str, str],
) -> Iterator[Difference]:
    for key in a:
        if key not in b:
            yield Difference((*path, key), f"present in {names[0]}, missing in {names[1]}")
    for key in b:
        if key not in a:
            yield Difference((*path, key), f"missing in {names[0]}, present in {names[1]}")
    for key in a:
        if key in b:
            yield from _differences(
                a[key], b[key], (*path, key), ignore_device=ignore_device, names=names
            )


def _sequence_differences(
    a: Any, b: Any, path: tuple[Any, ...], *, ignore_device: bool, names: tuple[str, str]
) -> Iterator[Difference]:
    if type(a) is not type(b):
        yield Difference(path, f"type {type(a).__name__} != {type(b).__name__}")
        return
    if len(a) != len(b):
        yield Difference(path, f"length {len(a)} != {len(b)}")
        return
    for index, (item_a, item_b) in enumerate(zip(a, b, strict=True)):
        yield from _differences(
            item_a, item_b, (*path, index), ignore_device=ignore_device, names=names
        )


def state_dict_differences(
    a: Any, b: Any, *, ignore_device: bool = False, names: tuple[str, str] = ("a", "b")
) -> list[Difference]:
    """Lists every difference between two state dicts, compared as ``assert_state_dict_equal`` does.

    Args:
        a: The first state dict (or any nest of dicts, lists and tensors).
        b: The second.
        ignore_device: Let tensors on different devices compare equal.
        names: What to call ``a`` and ``b`` in the details.

    Returns:
        The differences in traversal order; empty when the two are bitwise equal.

    Examples:
        >>> import torch
        >>> a = {"state": {0: {"exp_avg": torch.zeros(2)}}}
        >>> b = {"state": {0: {"exp_avg": torch.zeros(2, dtype=torch.bfloat16)}}}
        >>> [str(d) for d in state_dict_differences(a, b)]
        ["param 0, state 'exp_avg': dtype torch.float32 != torch.bfloat16"]
    """
    return list(_differences(a, b, (), ignore_device=ignore_device, names=names))


def assert_state_dict_equal(
    a: Any,
    b: Any,
    *,
    ignore_device: bool = False,
    names: tuple[str, str] = ("a", "b"),
    headline: str | None = None,
) -> None:
    """Asserts two (optimizer) state dicts are equal: structure, types, dtypes, values bitwise.

    Tensors must match in dtype, shape, device (unless ``ignore_device``) and every bit (so
    ``-0.0 != 0.0`` and NaNs with equal payloads are equal). Python scalars must match in type
    (a ``step`` that became a float is a difference) and value; lists and tuples are distinct.

    Args:
        a: The first state dict (or any nest of dicts, lists and tensors).
        b: The second.
        ignore_device: Let tensors on different devices compare equal.
        names: What to call ``a`` and ``b`` in the message.
        headline: The message's first line (default ``"state dicts differ"``).

    Raises:
        StateMismatchError: they differ; it names each parameter index and state name.

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adam([p])
        >>> p.grad = torch.ones(2)
        >>> opt.step()
        >>> assert_state_dict_equal(opt.state_dict(), opt.state_dict())
        >>> tampered = opt.state_dict()
        >>> tampered["state"][0] = dict(tampered["state"][0], exp_avg=torch.zeros(2))
        >>> assert_state_dict_equal(opt.state_dict(), tampered)
        Traceback (most recent call last):
        ...
        wrapped_optim.testing._assertions.StateMismatchError: state dicts differ: 1 difference(s)
          - param 0, state 'exp_avg': 2 of 2 elements differ bitwise; first at index (0,): ...
    """
    differences = state_dict_differences(a, b, ignore_device=ignore_device, names=names)
    if differences:
        raise StateMismatchError(headline or "state dicts differ", differences)


# ----------------------------------------------------------------------------------------------
# Driving an optimizer
# ----------------------------------------------------------------------------------------------
def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    """Lists an optimizer's parameters in state-dict order.

    Args:
        optimizer: Any optimizer or wrapper stack.

    Returns:
        The parameters of every group in order: position ``i`` is the ``state`` key ``i``.

    Examples:
        >>> import torch
        >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
        >>> [p.numel() for p in optimizer_params(opt)]
        [1, 2]
    """
    return [param for group in optimizer.param_groups for param in group["params"]]


def _grad_dtype(param: torch.Tensor) -> torch.dtype:
    grad_dtype = getattr(param, "grad_dtype", None)
    return grad_dtype if isinstance(grad_dtype, torch.dtype) else param.dtype


def synthetic_gradients(optimizer: Any, step: int, *, seed: int = 0) -> None:
    """Gives every trainable parameter a seeded random gradient for ``step``.

    The gradient of parameter ``i`` depends only on ``(seed, step, i)``, so two runs that
    take the same steps see the same gradients, in each parameter's gradient dtype
    (``param.grad_dtype`` where set, e.g. bf16 main grads of fp32 FSDP shards). Parameters with
    ``requires_grad=False`` (frozen) get no gradient.

    Args:
        optimizer: Any optimizer or wrapper stack.
        step: The training step the gradients are for.
        seed: Another seed gives other gradients.

    Examples:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> synthetic_gradients(opt, step=0)
        >>> first = p.grad.clone()
        >>> synthetic_gradients(opt, step=0)
        >>> torch.equal(first, p.grad), p.grad.dtype
        (True, torch.float32)
    """
    for index, param in enumerate(optimizer_params(optimizer)):
        if not param.requires_grad:
            param.grad = None
            continue
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 10_007 + index)
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        param.grad = values.to(dtype=_grad_dtype(param), device=param.device)


def checkpoint_roundtrip(obj: Any) -> Any:
    """Round-trips an object through ``torch.save`` and ``torch.load(weights_only=True)``.

    Args:
        obj: A state dict or any object ``weights_only`` loading accepts.

    Returns:
        A fresh, unaliased copy of ``obj``, as a checkpoint would give it back.

    Examples:
        >>> import torch
        >>> sd = {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": []}
        >>> copy = checkpoint_roundtrip(sd)
        >>> copy["state"][0]["step"] is sd["state"][0]["step"]
        False
        >>> assert_state_dict_equal(copy, sd)
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


LossFn = Callable[[Any, int], torch.Tensor]


def _train(model: Any, optimizer: Any, steps: range, loss_fn: LossFn | None, seed: int) -> None:
    for step in steps:
        optimizer.zero_grad()
        if loss_fn is None:
            synthetic_gradients(optimizer, step, seed=seed)
        else:
            loss_fn(model, step).backward()
        optimizer.step()


def _model_names(model: Any, optimizer: Any) -> dict[int, str]:
    index_of = {id(p): i for i, p in enumerate(optimizer_params(optimizer))}
    return {index_of[id(p)]: name for name, p in model.named_parameters() if id(p) in index_of}


def _model_state(model: Any) -> dict[str, Any]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _run_differences(
    expected: tuple[Any, Any], actual: tuple[Any, Any], names: tuple[str, str], ignore_device: bool
) -> list[Difference]:
    # Optimizer state first: it says which param and state went wrong; the model follows.
    (expected_model, expected_opt), (actual_model, actual_opt) = expected, actual
    optimizer = state_dict_differences(
        expected_opt.state_dict(), actual_opt.state_dict(), ignore_device=ignore_device, names=names
    )
    model = state_dict_differences(
        _model_state(expected_model), _model_state(actual_model), names=names
    )
    return optimizer + [attrs.evolve(d, path=("model", *d.path)) for d in model]


def assert_resume_equivalent(
    make: Callable[[], tuple[Any, Any]],
    steps_before: int,
    steps_after: int,
    *,
    loss_fn: LossFn | None = None,
    seed: int = 0,
    ignore_device: bool = False,
) -> None:
    """Asserts that save -> rebuild -> load -> continue is bit-identical to never stopping.

    ``make()`` must build a fresh, deterministic ``(model, optimizer)`` pair (the optimizer
    may be any stack). Three runs, each from ``make()``:

    * the *reference* takes ``steps_before + steps_after`` steps;
    * the *saver* takes ``steps_before`` steps, checkpoints model and optimizer (through
      ``torch.save``/``torch.load(weights_only=True)``), then continues: taking a checkpoint
      must not change training;
    * the *resumed* run loads that checkpoint into a fresh ``make()`` and takes the remaining
      ``steps_after`` steps. Before the load, every non-zero float hyper-parameter of its
      param groups (``lr``, ``betas``, ``weight_decay``, ``eps``, ...; ``step`` aside) is
      halved, as if it had been built with other options: a load that forgets to restore
      one is a difference, not an invisible no-op.

    Each step uses ``synthetic_gradients`` (seeded, in each param's grad dtype) or, with
    ``loss_fn(model, step) -> loss``, autograd. Model parameters and optimizer state dicts of
    all three must agree bitwise.

    Args:
        make: Builds a fresh, deterministic ``(model, optimizer)`` pair.
        steps_before: Steps before the checkpoint.
        steps_after: Steps after it.
        loss_fn: ``loss_fn(model, step) -> loss`` for autograd gradients; ``None`` for
            ``synthetic_gradients``.
        seed: The seed of the synthetic gradients.
        ignore_device: Let tensors on different devices compare equal.

    Raises:
        StateMismatchError: a run differs; it names the run, the parameter index and state.
        ValueError: a step count is negative.

    Examples:
        >>> import torch
        >>> def make():
        ...     torch.manual_seed(0)
        ...     model = torch.nn.Linear(3, 2)
        ...     return model, torch.optim.AdamW(model.parameters(), lr=0.1)
        >>> assert_resume_equivalent(make, steps_before=2, steps_after=2)
    """
    if steps_before < 0 or steps_after < 0:
        raise ValueError("steps_before and steps_after must be >= 0")

    reference_model, reference = make()
    saver_model, saver = make()
    initial = state_dict_differences(_model_state(reference_model), _model_state(saver_model))
    if initial:
        raise StateMismatchError(
            "make() is not deterministic: two calls built different models",
            [attrs.evolve(d, path=("model", *d.path)) for d in initial],
        )
    total = steps_before + steps_after
    _train(reference_model, reference, range(total), loss_fn, seed)

    _train(saver_model, saver, range(steps_before), loss_fn, seed)
    checkpoint = checkpoint_roundtrip(
        {"model": saver_model.state_dict(), "optimizer": saver.state_dict()}
    )
    _train(saver_model, saver, range(steps_before, total), loss_fn, seed)

    resumed_model, resumed = make()
    _perturb_hyper_parameters(resumed.param_groups)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    _train(resumed_model, resumed, range(steps_before, total), loss_fn, seed)

    where = f"after {steps_before} + {steps_after} steps"
    reference_run = (reference_model, reference)
    differences = _run_differences(
        reference_run, (saver_model, saver), ("uninterrupted", "checkpointed"), ignore_device
    )
    if differences:
        raise StateMismatchError(f"taking a checkpoint changed training {where}", differences)
    differences = _run_differences(
        reference_run, (resumed_model, resumed), ("uninterrupted", "resumed"), ignore_device
    )
    if differences:
        raise StateMismatchError(
            f"the resumed run differs from the uninterrupted one {where}", differences
        )


def _perturbed(value: Any) -> Any:
    """``value`` halved if it is a non-zero float (a float tensor: in place), else itself."""
    if isinstance(value, float) and value != 0.0:
        return value * 0.5
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() == 1:
        with torch.no_grad():
            value.mul_(0.5)
        return value
    if isinstance(value, tuple):
        return tuple(_perturbed(item) for item in value)
    return value


def _perturb_hyper_parameters(groups: list[dict[str, Any]]) -> None:
    """Halves each group's float options, so a resume must restore them to match."""
    for group in groups:
        for key, value in list(group.items()):
            if key not in ("params", "param_names", "step"):
                group[key] = _perturbed(value)


def assert_transparent(stack: Any, *, ignore_device: bool = True) -> None:
    """Asserts a wrapped stack's checkpoints and its bare optimizer's are interchangeable.

    Checks that ``stack.state_dict()`` equals ``stack.unwrap().state_dict()`` (values, dtypes,
    structure; devices may differ unless ``ignore_device=False``), that loading the bare
    checkpoint into the stack and the wrapped one into the bare optimizer both succeed and
    leave the state as it was. Step the stack first so that there is state to compare.

    Args:
        stack: A wrapper stack (anything with ``unwrap()``).
        ignore_device: Let tensors on different devices compare equal.

    Raises:
        StateMismatchError: a state dict differs; it says which comparison and where.
        TypeError: ``stack`` has no ``unwrap()``.

    Examples:
        >>> import torch
        >>> from wrapped_optim import OptimizerWrapper
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> stack = OptimizerWrapper(torch.optim.Adam([p], lr=0.1))
        >>> p.grad = torch.ones(2)
        >>> stack.step()
        >>> assert_transparent(stack)
    """
    unwrap = getattr(stack, "unwrap", None)
    if not callable(unwrap):
        raise TypeError(
            f"assert_transparent needs a wrapped stack (with unwrap()); got {type(stack).__name__}"
        )
    bare = unwrap()
    wrapped_sd = checkpoint_roundtrip(stack.state_dict())
    bare_sd = checkpoint_roundtrip(bare.state_dict())
    assert_state_dict_equal(
        wrapped_sd,
        bare_sd,
        ignore_device=ignore_device,
        names=("wrapped", "bare"),
        headline="the wrapped stack's state_dict differs from its bare optimizer's",
    )
    stack.load_state_dict(checkpoint_roundtrip(bare_sd))
    assert_state_dict_equal(
        bare_sd,
        checkpoint_roundtrip(stack.state_dict()),
        ignore_device=ignore_device,
        names=("bare checkpoint", "stack after loading it"),
        headline="loading the bare checkpoint into the stack changed the state",
    )
    bare.load_state_dict(checkpoint_roundtrip(wrapped_sd))
    assert_state_dict_equal(
        wrapped_sd,
        checkpoint_roundtrip(bare.state_dict()),
        ignore_device=ignore_device,
        names=("wrapped checkpoint", "bare after loading it"),
        headline="loading the wrapped checkpoint into the bare optimizer changed the state",
    )
    assert_state_dict_equal(
        wrapped_sd,
        checkpoint_roundtrip(stack.state_dict()),
        ignore_device=ignore_device,
        names=("wrapped before", "wrapped after"),
        headline="the stack's state_dict changed after the round trips",
    )
