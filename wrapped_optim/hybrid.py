"""HybridSyncOptimizer: every FP32 master copy of a hybrid offload optimizer kept in step
with the model weights across model-only loads and full resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from wrapped_optim._adapters.hybrid import (
    MasterCopies,
    WeightWatch,
    find_hybrid_offload,
    hybrid_master_copies,
    keeps_per_param_step,
    push_state_to_sub_optimizers,
    restore_omitted_state,
)
from wrapped_optim._adapters.megatron_checkpoint import (
    allow_optimizer_classes_in_next_common_read,
    end_common_read,
    megatron_load_repairs,
    megatron_sharded_state_dict,
)
from wrapped_optim._adapters.walk import walk_leaves
from wrapped_optim.wrapper import OptimizerWrapper

__all__ = ["HybridSyncOptimizer", "StaleMasterError"]

OnStale = Literal["refresh", "raise", "ignore"]
_ON_STALE = ("refresh", "raise", "ignore")


class StaleMasterError(RuntimeError):
    """The optimizer's master copies disagree with the model weights it is about to update.

    Raised by ``HybridSyncOptimizer`` (built with ``on_stale="raise"``) before a step whose
    masters disagree with the weights: the first step after construction or a load, and any
    later step after a weight was written behind the optimizer's back (an RL refit, a weight
    swap); and, on the compat route, by a step after
    ``sync_hybrid_device_optimizer_fp32_master_copies`` when a weight changed since.

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p], lr=0.1), on_stale="raise")
        >>> with torch.no_grad():
        ...     _ = p.fill_(2.0)  # a model-only load the optimizer did not see
        >>> p.grad = torch.ones(2, dtype=torch.bfloat16)
        >>> try:
        ...     opt.step()
        ... except StaleMasterError:
        ...     print("stale masters refused")
        stale masters refused
    """


def _stale_master_error(stale: list[MasterCopies], remedy: str) -> StaleMasterError:
    """The error for ``stale`` entries (the first five named), ending with ``remedy``.

    Examples:
        >>> import torch
        >>> entry = MasterCopies("w", torch.ones(1), torch.zeros(1))
        >>> str(_stale_master_error([entry], "Refresh them."))  # doctest: +ELLIPSIS
        '1 master copies disagree with the model weights they update (w); ... Refresh them.'
    """
    names = ", ".join(entry.name for entry in stale[:5])
    more = f" and {len(stale) - 5} more" if len(stale) > 5 else ""
    return StaleMasterError(
        f"{len(stale)} master copies disagree with the model weights they update "
        f"({names}{more}); the model weights were changed without the optimizer "
        f"(a model-only load, an RL refit, a weight swap?). {remedy}"
    )


def _check_something_to_sync(inner: Any) -> None:
    """Refuses a stack of plain optimizers with no hybrid offload optimizer: a silent no-op."""
    if find_hybrid_offload(inner):
        return
    leaves = list(walk_leaves(inner))
    if any(leaf.container is not None for leaf in leaves):
        return  # a Megatron container: the uniform route passes through
    names = ", ".join(sorted({type(leaf.optimizer).__name__ for leaf in leaves})) or "none"
    raise ValueError(
        "HybridSyncOptimizer keeps the FP32 master copies of a hybrid offload optimizer in "
        f"step with the model, and this stack has none (its optimizers: {names}); drop the "
        "layer (wrap()/StackConfig: leave `hybrid` unset or false), or wrap an optimizer that "
        "offloads: wrapped_optim.optimizers.HybridOffloadOptimizer, or Megatron's "
        "HybridDeviceOptimizer (optimizer_cpu_offload=True)"
    )


class HybridSyncOptimizer(OptimizerWrapper):
    """Keeps the master copies of hybrid offload optimizers in step with the model weights.

    ``load_state_dict`` restores what Megatron-style payloads omit and pushes the restored
    masters to every copy level and to the model; ``reload_model_params`` refreshes every
    level from the weights after a model-only load; the first step after construction or a
    load checks every level against the model weights, and every later step checks the
    weights written since the optimizer's own last write (their version counters moved).
    It works on the portable
    ``HybridOffloadOptimizer`` and on Megatron's ``HybridDeviceOptimizer`` anywhere in the
    stack. Inside a Megatron container a stack without one passes through unchanged
    (Megatron-Bridge wraps every optimizer the same way); around plain optimizers it is
    refused, as it would do nothing. See [Hybrid offload](../hybrid.md).

    Args:
        inner: The optimizer to decorate (a stack containing a hybrid offload optimizer).
        on_stale: What a step does when a master copy disagrees with the model weights
            (checked at the first step after construction or a load, and at every step for
            the weights written since the last one): ``"refresh"`` it from the model (default),
            ``"raise"`` ``StaleMasterError``, or ``"ignore"`` it.

    Raises:
        ValueError: ``on_stale`` is not one of the three choices, or the stack has no hybrid
            offload optimizer and no Megatron container (nothing to sync).

    Examples:
        >>> import torch
        >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
        >>> model = torch.nn.Linear(2, 1).to(torch.bfloat16)
        >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer(model.parameters(), lr=0.1))
        >>> with torch.no_grad():  # a model-only load, behind the optimizer's back
        ...     _ = model.weight.fill_(0.5)
        >>> model(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
        >>> opt.step()  # the guard refreshes the stale copies before stepping
        >>> bool((model.weight - 0.5).abs().max() < 0.2)
        True
    """

    _push_pending: bool = False  # a committed load whose masters are not all pushed yet
    # A loading scaffold was built and its load has not ended (see sharded_state_dict).
    _load_begun: bool = False

    def __init__(self, inner: Any, *, on_stale: OnStale = "refresh") -> None:
        super().__init__(inner)
        if on_stale not in _ON_STALE:
            raise ValueError(f"on_stale must be one of {_ON_STALE}, got {on_stale!r}")
        _check_something_to_sync(inner)
        self.on_stale: OnStale = on_stale
        self._guard_armed = True
        # Instance attributes from the start (not the class's False): a load that fails must
        # leave the wrapper's attributes exactly as they were, no new one behind.
        self._push_pending = False
        self._load_begun = False
        self._watch = WeightWatch()  # the weights as the optimizer's own last write left them

    @property
    def hybrid_optimizers(self) -> list[Any]:
        """The hybrid offload optimizers this wrapper keeps in sync.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> inner = HybridOffloadOptimizer([torch.nn.Parameter(torch.ones(2))])
            >>> HybridSyncOptimizer(inner).hybrid_optimizers == [inner]
            True
        """
        return find_hybrid_offload(self.inner)

    @property
    def guard_armed(self) -> bool:
        """Whether the next step first checks the masters against the model weights.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> p = torch.nn.Parameter(torch.ones(2))
            >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p]))
            >>> opt.guard_armed
            True
            >>> p.grad = torch.ones(2)
            >>> opt.step()
            >>> opt.guard_armed
            False
        """
        return self._guard_armed

    def _extra_repr(self) -> str:
        return f"on_stale={self.on_stale!r}"

    # ----------------------------------------------------------------------------------
    # Step and guard
    # ----------------------------------------------------------------------------------
    def _step(self, closure: Callable[[], Any] | None) -> Any:
        if self._load_begun:
            self._end_load()  # a load that was begun and abandoned
        self._before_step()
        result = self._inner_step(closure)
        self._after_step()
        return result

    @torch.compiler.disable
    def _before_step(self) -> None:
        """The masters push and the stale-master guard: eager even inside ``torch.compile``
        (they walk Python objects and compare masters; dynamo cannot trace them)."""
        if self._push_pending:
            self._push_masters()
        if self._guard_armed:
            self.check_masters()
        elif self.on_stale != "ignore":
            moved = self._watch.moved()
            if moved:  # written since the last step: compare those values
                self._handle_stale([entry for entry in moved if entry.stale_levels()])
                self._watch.refresh()

    @torch.compiler.disable
    def _after_step(self) -> None:
        if self.on_stale != "ignore":
            self._watch.refresh()  # the step's own writes of the weights

    def stale_masters(self) -> list[MasterCopies]:
        """Entries with a level that, rounded to the model dtype, differs from the weight.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p], lr=0.1))
            >>> with torch.no_grad():
            ...     _ = p.add_(1)
            >>> len(opt.stale_masters())
            1
        """
        return [entry for entry in hybrid_master_copies(self.inner) if entry.stale_levels()]

    def check_masters(self) -> list[MasterCopies]:
        """Runs the stale-master guard now and disarms it.

        Returns:
            The stale entries found (refreshed already under ``on_stale="refresh"``).

        Raises:
            StaleMasterError: a master copy is stale and ``on_stale`` is ``"raise"``.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p], lr=0.1), on_stale="raise")
            >>> opt.check_masters()
            []
        """
        entries = hybrid_master_copies(self.inner)
        stale = [entry for entry in entries if entry.stale_levels()]
        self._handle_stale(stale)
        self._guard_armed = False
        self._watch.record(entries)
        return stale

    def _handle_stale(self, stale: list[MasterCopies]) -> None:
        if stale and self.on_stale == "raise":
            raise _stale_master_error(
                stale,
                "Call reload_model_params() to refresh them from the model, load the "
                "optimizer state, or use on_stale='refresh'",
            )
        if stale and self.on_stale == "refresh":
            for entry in stale:
                entry.refresh_from_weight()

    # ----------------------------------------------------------------------------------
    # Model-only and full-state sync
    # ----------------------------------------------------------------------------------
    def reload_model_params(self, state_dict: Any = None) -> None:
        """Model-only sync: every master copy at every level takes the model weights' value.

        A Megatron optimizer inside reloads first, then every hybrid level is refreshed.

        Args:
            state_dict: A model checkpoint for the Megatron optimizer inside to reload its
                main params from; ``None`` reloads from the model weights.

        Raises:
            ValueError: ``state_dict`` is given but the stack holds no Megatron optimizer.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p], offload_fraction=1.0))
            >>> with torch.no_grad():
            ...     _ = p.fill_(2.0)
            >>> opt.reload_model_params()
            >>> opt.gpu_params_map_cpu_copy[p].tolist()
            [2.0, 2.0]
        """
        reload = getattr(self.inner, "reload_model_params", None)
        if callable(reload):
            reload() if state_dict is None else reload(state_dict)
        elif state_dict is not None:
            raise ValueError(
                "reload_model_params(state_dict) reloads main params from a model checkpoint "
                "through a Megatron optimizer; this stack has none — load the weights into the "
                "model and call reload_model_params()"
            )
        entries = hybrid_master_copies(self.inner)
        for entry in entries:
            entry.refresh_from_weight()
        self._guard_armed = False
        self._watch.record(entries)

    def sync_from_masters(self) -> None:
        """Full-state sync: the masters go to every copy, sub-optimizer and model weight.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import HybridOffloadOptimizer
            >>> p = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
            >>> opt = HybridSyncOptimizer(HybridOffloadOptimizer([p], offload_fraction=1.0))
            >>> opt.gpu_params_map_cpu_copy[p].fill_(3.0).tolist()
            [3.0, 3.0]
            >>> opt.sync_from_masters()
            >>> p.tolist()
            [3.0, 3.0]
        """
        push_state_to_sub_optimizers(self.inner)
        entries = hybrid_master_copies(self.inner)
        for entry in entries:
            entry.push_master()
        self._watch.record(entries)

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        payload = restore_omitted_state(state_dict, per_param_step=keeps_per_param_step(self.inner))
        try:
            with megatron_load_repairs(self.inner):
                self.inner.load_state_dict(payload)
        finally:
            self._end_load()
        self._on_state_loaded()

    def sharded_state_dict(
        self, model_sharded_state_dict: Any = None, is_loading: bool = False, **kwargs: Any
    ) -> Any:
        """Megatron's ``sharded_state_dict`` of the wrapped stack.

        With ``is_loading=True`` the same repairs as in ``load_state_dict`` apply, and Core's
        next common-state read (the ``dist_checkpointing.load`` of this scaffold) may unpickle
        the optimizer classes its file names, which megatron-core 0.16.1's weights-only read
        refuses: torch's allow-list holds them during that read only. The read, this
        wrapper's ``load_state_dict`` or its next step ends that.

        Args:
            model_sharded_state_dict: The model's sharded state dict, as Megatron passes it.
            is_loading: Whether Megatron builds the scaffold of a load.
            **kwargs: Passed on to the inner optimizer's ``sharded_state_dict``.

        Returns:
            The inner optimizer's sharded state dict.

        Raises:
            AttributeError: the stack holds no Megatron optimizer.
        """
        inner_method = megatron_sharded_state_dict(self.inner)
        self._end_load()
        if not is_loading:
            return inner_method(model_sharded_state_dict, is_loading, **kwargs)
        with megatron_load_repairs(self.inner):
            result = inner_method(model_sharded_state_dict, is_loading, **kwargs)
        allow_optimizer_classes_in_next_common_read(self)
        self._load_begun = True
        return result

    def _end_load(self) -> None:
        self._load_begun = False
        end_common_read(self)

    def load_parameter_state(self, filename: str, **kwargs: Any) -> None:
        """Megatron's legacy parameter-state load, then the masters are pushed to every copy.

        Args:
            filename: The file Megatron's ``save_parameter_state`` wrote.
            **kwargs: Passed on to the inner optimizer's ``load_parameter_state``.
        """
        try:
            with megatron_load_repairs(self.inner):
                self.inner.load_parameter_state(filename, **kwargs)
        finally:
            self._end_load()
        self._on_state_loaded()

    def _on_state_loaded(self) -> None:
        # The load is committed: the masters are the truth now. Pushing them is idempotent:
        # a push that raises is retried at once and, failing again, before the next step. An
        # interrupt (Ctrl-C) first lets the short push finish, so state and weights agree.
        self._push_pending = True
        self._guard_armed = True
        try:
            self._push_masters()
        except Exception:
            self._push_masters()
        except BaseException:
            self._push_masters()
            raise

    def _push_masters(self) -> None:
        self.sync_from_masters()
        self._push_pending = False
