"""Hypothesis strategies for optimizer setups: parameter sets, optimizers and wrapper stacks.

Every strategy draws a small, frozen *spec* (an attrs object with a readable repr, so a
failing example prints as something you can paste into a test) that builds fresh, seeded
tensors and optimizers on demand. ``setups`` combines the three into a ``Setup``
whose ``make`` is exactly what ``assert_resume_equivalent`` wants.

Needs ``hypothesis`` (a test dependency, not a runtime one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from hypothesis import strategies as st

from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.stack import LAYERS, layer_spec

__all__ = [
    "available_optimizer_kinds",
    "group_options",
    "optimizer_configs",
    "param_sets",
    "setups",
    "shapes",
    "stack_configs",
]

Options = tuple[tuple[str, Any], ...]

#: Torch's own optimizers the strategies cover.
TORCH_KINDS: tuple[str, ...] = ("sgd", "adam", "adamw")

#: Wrapper layers, outermost first (the canonical order of ``wrapped_optim.stack.LAYERS``).
LAYER_ORDER: tuple[str, ...] = tuple(spec.section for spec in LAYERS)

_OPTIMIZER_CLASSES: dict[str, Any] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "precision_adamw": PrecisionAwareAdamW,
    "hybrid_offload": HybridOffloadOptimizer,
}

#: The kinds a hybrid sync layer can go over (it refuses a stack without an offloader).
_OFFLOADING_KINDS = frozenset({"hybrid_offload"})

_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def available_optimizer_kinds() -> tuple[str, ...]:
    """Every optimizer kind the strategies draw (all of them import wherever torch does).

    Examples:
        >>> {"sgd", "adam", "adamw", "precision_adamw"} <= set(available_optimizer_kinds())
        True
    """
    return tuple(_OPTIMIZER_CLASSES)


# ----------------------------------------------------------------------------------------------
# Parameter sets
# ----------------------------------------------------------------------------------------------
@attrs.frozen
class ParamSpec:
    """One parameter: its shape, dtype, whether it is frozen and its gradient dtype.

    Attributes:
        shape: The parameter's shape.
        dtype: Its dtype.
        frozen: ``requires_grad=False``.
        grad_dtype: A ``grad_dtype`` other than ``dtype`` (FSDP's bf16 main grads), or ``None``.

    Examples:
        >>> spec = ParamSpec(shape=(2, 0), dtype=torch.bfloat16)
        >>> p = spec.build(torch.Generator().manual_seed(0))
        >>> p.shape, p.dtype, p.requires_grad
        (torch.Size([2, 0]), torch.bfloat16, True)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    frozen: bool = False
    grad_dtype: torch.dtype | None = None

    def build(self, generator: torch.Generator) -> torch.nn.Parameter:
        """Builds a fresh parameter with seeded values (drawn in fp32, then cast).

        Args:
            generator: The random generator the values are drawn from.
        """
        values = torch.randn(self.shape, generator=generator, dtype=torch.float32)
        param = torch.nn.Parameter(values.to(self.dtype), requires_grad=not self.frozen)
        if self.grad_dtype is not None and self.grad_dtype != self.dtype:
            param.grad_dtype = self.grad_dtype
        return param


class ParamSetModel(torch.nn.Module):
    """The model built from a ``ParamSetSpec``: its parameters in ``params``, plus groups.

    Args:
        params: The parameters, in optimizer order.
        groups: The parameter-group dicts to hand to an optimizer.

    Examples:
        >>> spec = ParamSetSpec(groups=(((ParamSpec((2,)),), ()),))
        >>> model = spec.build()
        >>> [name for name, _ in model.named_parameters()]
        ['params.0']
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: list[dict[str, Any]]):
        super().__init__()
        self.params = torch.nn.ParameterList(params)
        self._groups = groups

    def param_groups(self) -> list[dict[str, Any]]:
        """Fresh parameter-group dicts (the same parameters) to hand to an optimizer."""
        return [dict(group, params=list(group["params"])) for group in self._groups]

    def forward(self) -> torch.Tensor:
        """A scalar loss that touches every trainable parameter (for autograd-driven tests)."""
        total = torch.zeros((), dtype=torch.float32)
        for param in self.params:
            if param.requires_grad:
                total = total + (param.float() ** 2).sum()
        return total


@attrs.frozen
class ParamSetSpec:
    """Parameter groups: each a tuple of ``ParamSpec`` and its hyper-parameter overrides.

    Attributes:
        groups: ``((param specs, options), ...)``, options as sorted ``(name, value)`` pairs.
        seed: The seed of the parameters' values.

    Examples:
        >>> spec = ParamSetSpec(groups=(((ParamSpec((2,)),), (("lr", 0.5),)),))
        >>> model = spec.build()
        >>> [g["lr"] for g in model.param_groups()]
        [0.5]
    """

    groups: tuple[tuple[tuple[ParamSpec, ...], Options], ...]
    seed: int = 0

    @property
    def params(self) -> list[ParamSpec]:
        """Every parameter spec, in optimizer (state-dict) order."""
        return [spec for params, _ in self.groups for spec in params]

    def build(self) -> ParamSetModel:
        """A model holding fresh parameters (same values for the same spec)."""
        generator = torch.Generator().manual_seed(self.seed)
        params: list[torch.nn.Parameter] = []
        groups: list[dict[str, Any]] = []
        for specs, options in self.groups:
            built = [spec.build(generator) for spec in specs]
            params += built
            groups.append({"params": built, **dict(options)})
        return ParamSetModel(params, groups)


@st.composite
def shapes(
    draw: Any, *, min_dims: int = 0, max_dims: int = 3, max_side: int = 4
) -> tuple[int, ...]:
    """Draws small tensor shapes, including 0-d ``()`` and empty ones (a zero-length side).

    Args:
        min_dims: The fewest dimensions.
        max_dims: The most dimensions.
        max_side: The longest side.

    Examples:
        >>> from hypothesis import find
        >>> find(shapes(), lambda s: len(s) == 0)
        ()
    """
    dims = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.integers(0, max_side)) for _ in range(dims))


def param_specs(
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    allow_frozen: bool = True,
    grad_dtypes: Sequence[torch.dtype] = (),
    allow_zero_dim: bool = True,
) -> st.SearchStrategy[ParamSpec]:
    """Draws one ``ParamSpec``.

    Args:
        dtypes: The parameter dtypes to draw from.
        allow_frozen: Whether a parameter may be frozen.
        grad_dtypes: Gradient dtypes a parameter may get (e.g. ``[torch.bfloat16]``).
        allow_zero_dim: Whether 0-d shapes are drawn.

    Examples:
        >>> from hypothesis import find
        >>> find(param_specs(), lambda p: p.frozen).frozen
        True
    """
    return st.builds(
        ParamSpec,
        shape=shapes(min_dims=0 if allow_zero_dim else 1),
        dtype=st.sampled_from(list(dtypes)),
        frozen=st.booleans() if allow_frozen else st.just(False),
        grad_dtype=st.sampled_from([None, *grad_dtypes]) if grad_dtypes else st.none(),
    )


_LRS = st.sampled_from([1e-3, 0.01, 0.1])
_WEIGHT_DECAYS = st.sampled_from([0.0, 0.01, 0.1])
_BETAS = st.sampled_from([(0.9, 0.999), (0.8, 0.99), (0.5, 0.9)])


def group_options(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    """Draws per-group hyper-parameter overrides that an optimizer kind accepts (maybe none).

    Args:
        kind: The optimizer kind (``"sgd"``, ``"adam"``, ...).

    Examples:
        >>> from hypothesis import find
        >>> set(find(group_options("sgd"), lambda o: len(o) > 1)) <= {"lr", "weight_decay"}
        True
    """
    if kind == "sgd":
        keys: dict[str, st.SearchStrategy[Any]] = {"lr": _LRS, "weight_decay": _WEIGHT_DECAYS}
    else:
        keys = {"lr": _LRS, "weight_decay": _WEIGHT_DECAYS, "betas": _BETAS}
    return st.fixed_dictionaries({}, optional=keys)


@st.composite
def param_sets(
    draw: Any,
    *,
    dtypes: Sequence[torch.dtype] = (torch.float32,),
    options: st.SearchStrategy[dict[str, Any]] | None = None,
    max_groups: int = 3,
    max_params: int = 3,
    allow_frozen: bool = True,
    grad_dtypes: Sequence[torch.dtype] = (),
    allow_zero_dim: bool = True,
) -> ParamSetSpec:
    """Parameter groups (1..max_groups, each with 1..max_params params) with own options.

    At least one parameter is trainable, so an optimizer always has something to update.

    Args:
        dtypes: The parameter dtypes to draw from.
        options: Draws each group's options (default: none).
        max_groups: The most groups.
        max_params: The most parameters per group.
        allow_frozen: Whether a parameter may be frozen.
        grad_dtypes: Gradient dtypes a parameter may get.
        allow_zero_dim: Whether 0-d shapes are drawn.

    Examples:
        >>> from hypothesis import find
        >>> spec = find(param_sets(), lambda s: len(s.groups) == 2)
        >>> len(spec.build().param_groups())
        2
    """
    options = options if options is not None else st.just({})
    spec_strategy = param_specs(
        dtypes=dtypes,
        allow_frozen=allow_frozen,
        grad_dtypes=grad_dtypes,
        allow_zero_dim=allow_zero_dim,
    )
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        params = tuple(draw(st.lists(spec_strategy, min_size=1, max_size=max_params)))
        groups.append((params, tuple(sorted(draw(options).items()))))
    if all(spec.frozen for params, _ in groups for spec in params):
        (first, *rest), group_opts = groups[0]
        groups[0] = ((attrs.evolve(first, frozen=False), *rest), group_opts)
    return ParamSetSpec(groups=tuple(groups), seed=draw(st.integers(0, 2**16)))


# ----------------------------------------------------------------------------------------------
# Optimizers
# ----------------------------------------------------------------------------------------------
@attrs.frozen
class DrawnOptimizer:
    """An optimizer kind and its constructor options, as ``optimizer_configs`` draws them
    (``build_optimizer``'s configuration is the other thing: ``wrapped_optim.OptimizerSpec``).

    Attributes:
        kind: ``"sgd"``, ``"adam"``, ``"adamw"``, ``"precision_adamw"`` or ``"hybrid_offload"``.
        options: Constructor keywords as sorted ``(name, value)`` pairs.

    Examples:
        >>> spec = DrawnOptimizer("sgd", (("lr", 0.1), ("momentum", 0.9)))
        >>> opt = spec.build([torch.nn.Parameter(torch.ones(2))])
        >>> type(opt).__name__, opt.defaults["momentum"]
        ('SGD', 0.9)
    """

    kind: str
    options: Options = ()

    @property
    def cls(self) -> Any:
        """The optimizer class (``ValueError`` naming the known kinds for an unknown one)."""
        try:
            return _OPTIMIZER_CLASSES[self.kind]
        except KeyError:
            raise ValueError(
                f"unknown optimizer kind {self.kind!r}; known: {', '.join(_OPTIMIZER_CLASSES)}"
            ) from None

    def build(self, params: Any) -> Any:
        """Builds a fresh optimizer.

        Args:
            params: A list of parameters or parameter groups.
        """
        return self.cls(params, **dict(self.options))


def _param_dtypes(kind: str, options: dict[str, Any]) -> tuple[torch.dtype, ...]:
    if kind in TORCH_KINDS:
        return _FLOAT_DTYPES
    if kind == "precision_adamw":
        if options.get("store_param_remainders"):
            return (torch.bfloat16,)
        if options.get("master_weights"):
            return (torch.float32, torch.bfloat16, torch.float16)
        return (torch.float32,)
    return (torch.float32, torch.bfloat16)


def _options(draw: Any, choices: dict[str, st.SearchStrategy[Any]]) -> Options:
    return tuple(sorted(draw(st.fixed_dictionaries(choices)).items()))


@st.composite
def optimizer_configs(draw: Any, *, kinds: Sequence[str] | None = None) -> DrawnOptimizer:
    """Draws a ``DrawnOptimizer`` with options its kind accepts.

    Args:
        kinds: The kinds to draw from (default: every available kind).

    Examples:
        >>> from hypothesis import find
        >>> find(optimizer_configs(kinds=["adam"]), lambda s: True).kind
        'adam'
    """
    kinds = list(kinds) if kinds is not None else list(available_optimizer_kinds())
    kind = draw(st.sampled_from(kinds))
    if kind == "sgd":
        momentum = draw(st.sampled_from([0.0, 0.9]))
        nesterov = momentum > 0 and draw(st.booleans())
        options = _options(
            draw,
            {
                "lr": _LRS,
                "weight_decay": _WEIGHT_DECAYS,
                "maximize": st.booleans(),
                "foreach": st.sampled_from([None, False, True]),
            },
        )
        extra = {"momentum": momentum}
        if nesterov:
            extra["nesterov"] = True
        elif momentum:
            extra["dampening"] = draw(st.sampled_from([0.0, 0.1]))
        return DrawnOptimizer(kind, tuple(sorted((*options, *extra.items()))))
    if kind in ("adam", "adamw"):
        return DrawnOptimizer(
            kind,
            _options(
                draw,
                {
                    "lr": _LRS,
                    "betas": _BETAS,
                    "weight_decay": _WEIGHT_DECAYS,
                    "amsgrad": st.booleans(),
                    "maximize": st.booleans(),
                    "foreach": st.sampled_from([None, False, True]),
                },
            ),
        )
    if kind == "precision_adamw":
        return DrawnOptimizer(kind, draw(precision_adamw_options()))
    if kind == "hybrid_offload":
        return DrawnOptimizer(kind, draw(hybrid_offload_options()))
    raise ValueError(f"unknown optimizer kind {kind!r}")


_STATE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]


@st.composite
def precision_adamw_options(draw: Any) -> Options:
    """Constructor options of PrecisionAwareAdamW: state dtypes, masters, remainders.

    Examples:
        >>> from hypothesis import find
        >>> dict(find(precision_adamw_options(), lambda o: True))["lr"] > 0
        True
    """
    master_weights = draw(st.booleans())
    options: dict[str, Any] = {
        "lr": draw(_LRS),
        "weight_decay": draw(_WEIGHT_DECAYS),
        "exp_avg_dtype": draw(st.sampled_from(_STATE_DTYPES)),
        "exp_avg_sq_dtype": draw(st.sampled_from(_STATE_DTYPES)),
        "master_weights": master_weights,
        "chunk_numel": draw(st.sampled_from([3, 64, 1 << 15])),
    }
    if master_weights:
        options["master_weight_dtype"] = draw(st.sampled_from([torch.float32, torch.float16]))
        if options["master_weight_dtype"] == torch.float32:
            options["store_param_remainders"] = draw(st.booleans())
    return tuple(sorted(options.items()))


@st.composite
def hybrid_offload_options(draw: Any) -> Options:
    """Constructor options of HybridOffloadOptimizer: offload fraction and sub-optimizers.

    Examples:
        >>> from hypothesis import find
        >>> 0 <= dict(find(hybrid_offload_options(), lambda o: True))["offload_fraction"] <= 1
        True
    """
    options = {
        "offload_fraction": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "lr": draw(_LRS),
        "weight_decay": draw(_WEIGHT_DECAYS),
        "param_update_in_fp32": draw(st.booleans()),
    }
    return tuple(sorted(options.items()))


# ----------------------------------------------------------------------------------------------
# Stacks
# ----------------------------------------------------------------------------------------------
@attrs.frozen
class StackSpec:
    """Wrapper layers, outermost first, each with its options; ``()`` is the bare optimizer.

    Attributes:
        layers: ``((layer name, options), ...)``, outermost first.

    Examples:
        >>> sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        >>> StackSpec(()).build(sgd) is sgd
        True
    """

    layers: tuple[tuple[str, Options], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """The layer names, outermost first."""
        return tuple(name for name, _ in self.layers)

    def build(self, optimizer: Any) -> Any:
        """Wraps an optimizer in the layers.

        Args:
            optimizer: The optimizer to wrap.
        """
        stack = optimizer
        for name, options in reversed(self.layers):
            stack = layer_spec(name).wrapper(stack, **dict(options))
        return stack


def _layer_options(name: str) -> st.SearchStrategy[Options]:
    if name == "staged":
        choices: dict[str, st.SearchStrategy[Any]] = {
            "chunk_bytes": st.sampled_from([16, 64, 1024, 64 << 20]),
            "stage_save": st.booleans(),
            "no_copy_load": st.booleans(),
            "chunked_load": st.booleans(),
        }
    elif name == "hybrid":
        choices = {"on_stale": st.sampled_from(["refresh", "raise", "ignore"])}
    else:
        choices = {"precision_aware": st.just(False)}
    return st.fixed_dictionaries(choices).map(lambda d: tuple(sorted(d.items())))


@st.composite
def stack_configs(
    draw: Any, *, layers: Sequence[str] | None = None, require_all: bool = False
) -> StackSpec:
    """Draws a ``StackSpec``: a subset of the layers, in canonical order, with drawn options.

    Args:
        layers: The layers to draw from (default: every available one).
        require_all: Take every layer of ``layers``, not a subset.

    Examples:
        >>> from hypothesis import find
        >>> find(stack_configs(layers=[]), lambda s: True)
        StackSpec(layers=())
    """
    layers = list(layers) if layers is not None else list(LAYER_ORDER)
    chosen = [
        name for name in LAYER_ORDER if name in layers and (require_all or draw(st.booleans()))
    ]
    return StackSpec(tuple((name, draw(_layer_options(name))) for name in chosen))


@attrs.frozen
class Setup:
    """A parameter set, an optimizer and a stack: ``make()`` builds them, fresh each time.

    Attributes:
        params: The parameter groups.
        optimizer: The optimizer.
        stack: The wrapper stack (default: none).

    Examples:
        >>> setup = Setup(
        ...     ParamSetSpec(groups=(((ParamSpec((3,)),), ()),)),
        ...     DrawnOptimizer("adam", (("lr", 0.1),)),
        ... )
        >>> model, opt = setup.make()
        >>> type(opt).__name__
        'Adam'
    """

    params: ParamSetSpec
    optimizer: DrawnOptimizer
    stack: StackSpec = StackSpec()

    def make(self) -> tuple[ParamSetModel, Any]:
        """``(model, stacked optimizer)`` built from the specs."""
        model = self.params.build()
        return model, self.stack.build(self.optimizer.build(model.param_groups()))


@st.composite
def setups(
    draw: Any,
    *,
    kinds: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    optimizers: st.SearchStrategy[DrawnOptimizer] | None = None,
    stacks: st.SearchStrategy[StackSpec] | None = None,
    max_groups: int = 2,
    max_params: int = 3,
    allow_zero_dim: bool = True,
) -> Setup:
    """Draws a ``Setup`` whose parameter dtypes and group options suit the drawn optimizer.

    Args:
        kinds: The optimizer kinds to draw from (default: every available kind).
        layers: The layers to draw from (default: every available one).
        optimizers: Draws the optimizer instead (overrides ``kinds``).
        stacks: Draws the stack instead (overrides ``layers``).
        max_groups: The most parameter groups.
        max_params: The most parameters per group.
        allow_zero_dim: Whether 0-d shapes are drawn.

    Examples:
        >>> from hypothesis import find
        >>> setup = find(setups(kinds=["sgd"], layers=[]), lambda s: True)
        >>> type(setup.make()[1]).__name__
        'SGD'
    """
    optimizer = draw(optimizers if optimizers is not None else optimizer_configs(kinds=kinds))
    if stacks is None:
        # HybridSyncOptimizer refuses a stack with nothing to sync: it goes over offloaders only.
        usable = [
            name
            for name in (layers if layers is not None else LAYER_ORDER)
            if name != "hybrid" or optimizer.kind in _OFFLOADING_KINDS
        ]
        stacks = stack_configs(layers=usable)
    stack = draw(stacks)
    fsdp = "fsdp" in stack.names
    dtypes = _param_dtypes(optimizer.kind, dict(optimizer.options))
    params = draw(
        param_sets(
            dtypes=dtypes,
            options=group_options(optimizer.kind),
            max_groups=max_groups,
            max_params=max_params,
            grad_dtypes=(torch.bfloat16,) if fsdp else (),
            allow_zero_dim=allow_zero_dim,
        )
    )
    return Setup(params, optimizer, stack)
