"""What a streaming load overwrites in place, kept until the load has finished.

Internal to :func:`wrapped_optim.checkpoint.load_optimizer` (see its docs for the disk this
costs, ``journal_dir`` to choose where, and ``atomic=False`` to go without it).
"""

from __future__ import annotations

import os
from collections.abc import Hashable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from wrapped_optim._adapters.precision import is_precision_aware_holder
from wrapped_optim._rollback import GroupOptions, OptimizerSnapshot
from wrapped_optim.checkpoint._journal import UndoJournal

__all__: list[str] = []


@runtime_checkable
class _OwnLoadUndo(Protocol):
    """An optimizer whose own loader changes more than its exposed state and groups (a
    HybridOffloadOptimizer: its sub-optimizers' storage, copies, layout), and says what."""

    def load_undo(self) -> Any:
        """An object with ``overwrites`` (tensors written in place) and ``restore()``."""
        ...


class _Undo:
    """What a streaming load overwrites, kept until it has finished, in bounded host memory.

    The bytes of every region the load will overwrite in place (``writes``: live state
    tensors read into, a holder's storage that a scaled state is quantized into) go to an
    undo journal on disk (:class:`~wrapped_optim.checkpoint._journal.UndoJournal`), each just
    before it is written (:meth:`keep`); under a wrapper, whose ``sync_after_load()`` may write
    the weights, the params are journaled too. In memory stay only references: the state
    entries and group options as they were, and a precision-aware holder's param-keyed tables
    (its scales, cloned: one value per tensor). An optimizer with a ``load_undo()`` (a
    hybrid, whose own loader writes into its sub-optimizers) names what that loader writes in
    place, journaled too, and puts back the rest itself. :meth:`restore` copies the journal
    back into the same tensors (which sub-optimizers or wrappers may alias) and puts the rest
    back.
    """

    def __init__(
        self,
        leaf: torch.optim.Optimizer,
        writes: Iterable[tuple[Hashable, torch.Tensor]],
        with_params: bool,
        journal_dir: str | os.PathLike[str] | None,
        piece_bytes: int,
    ) -> None:
        self.leaf = leaf
        self.entries = {param: dict(entry) for param, entry in leaf.state.items()}
        self.options = GroupOptions.take(leaf.param_groups)
        # A holder also keeps per-param tables (its scales): the rollback utility's snapshot
        # of them, without the state (journaled) or the params (below).
        self.tables = (
            OptimizerSnapshot.take(leaf, clone_state=False, keep_values=False)
            if is_precision_aware_holder(leaf)
            else None
        )
        self.own = leaf.load_undo() if isinstance(leaf, _OwnLoadUndo) else None
        self.installs = [(("install", i), t) for i, t in enumerate(self._own_overwrites())]
        self.journal = UndoJournal(journal_dir, piece_bytes)
        try:
            for key, tensor in [*writes, *self.installs]:
                self.journal.plan(key, tensor)
            params = (
                list({id(p): p for g in leaf.param_groups for p in g["params"]}.values())
                if with_params  # a wrapper's sync_after_load() writes weights (HybridSyncOptimizer)
                else []
            )
            extra = sum(p.numel() * p.element_size() for p in params)
            self.journal.reserve(self.journal.planned_bytes() + extra)
            for param in params:
                self.journal.keep_now(param)
            self.journal.start()
        except BaseException:
            self.journal.close()
            raise

    @classmethod
    def take(
        cls,
        leaf: torch.optim.Optimizer,
        writes: Iterable[tuple[Hashable, torch.Tensor]],
        with_params: bool,
        journal_dir: str | os.PathLike[str] | None = None,
        piece_bytes: int = 64 << 20,
    ) -> _Undo:
        """Starts keeping what loading into ``leaf`` overwrites (``writes``, in read order)."""
        return cls(leaf, writes, with_params, journal_dir, piece_bytes)

    def _own_overwrites(self) -> list[torch.Tensor]:
        return list(self.own.overwrites) if self.own is not None else []

    def before_install(self) -> None:
        """Returns once what the leaf's own loader overwrites in place is journaled."""
        for key, _ in self.installs:
            self.journal.keep(key)

    def keep(self, key: Hashable) -> None:
        """Returns once the region ``key`` (planned in ``writes``) is safe to overwrite."""
        self.journal.keep(key)

    @torch.no_grad()
    def restore(self) -> None:
        """Puts it all back (raises ``RollbackError`` if the journal cannot be replayed)."""
        try:
            self.journal.rollback()
        finally:
            self._restore_references()

    def _restore_references(self) -> None:
        if self.own is not None:
            self.own.restore()  # its layout, sub-optimizers and exposed state
        else:
            state = self.leaf.state
            for param in [p for p in state if p not in self.entries]:
                del state[param]
            for param, entry in self.entries.items():
                if param in state:
                    state[param].clear()
                    state[param].update(entry)
                else:
                    state[param] = entry
        if self.tables is not None:
            self.tables.restore()
        self.options.restore(self.leaf.param_groups)

    def close(self) -> None:
        """Ends the journal (its file is freed)."""
        self.journal.close()
