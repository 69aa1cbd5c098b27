"""Errors shared by every checkpoint loader (it imports nothing of the package)."""

from __future__ import annotations

__all__ = ["InspectError", "OptimizerCheckpointError", "RollbackError", "UndoJournalError"]


class OptimizerCheckpointError(ValueError):
    """A checkpoint does not fit the optimizer (names the parameter and state at fault).

    Every loader of the package raises it (the optimizers' ``load_state_dict`` and
    ``wrapped_optim.checkpoint.load_optimizer``), with one wording per fault, before anything
    is written into the optimizer: a caller can catch it and go on with the optimizer as it
    was. A ``ValueError``, like torch's own ``load_state_dict`` errors.

    Examples:
        >>> import tempfile, torch
        >>> from wrapped_optim.checkpoint import load_optimizer, save_optimizer
        >>> p = torch.nn.Parameter(torch.ones(4))
        >>> opt = torch.optim.Adam([p], lr=0.1)
        >>> p.grad = torch.ones(4); opt.step()
        >>> other = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        >>> with tempfile.TemporaryDirectory() as path:
        ...     _ = save_optimizer(opt, path)
        ...     try:
        ...         load_optimizer(other, path)
        ...     except OptimizerCheckpointError as error:
        ...         print(error)  # doctest: +ELLIPSIS
        param 0: state 'exp_avg' has shape (4,), the param has (3,)
        >>> len(other.state)  # untouched
        0
    """


class UndoJournalError(OSError):
    """The atomic streaming load could not write its undo journal (no space, an I/O error).

    Raised by ``wrapped_optim.checkpoint.load_optimizer`` before the first read when the
    journal's filesystem has too little room, or when a journal write fails while reading; in
    both cases the optimizer is left exactly as it was. Pass ``journal_dir=`` a local
    directory with room, or ``atomic=False``.

    Examples:
        >>> import errno
        >>> error = UndoJournalError(errno.ENOSPC, "the undo journal needs 4,096 bytes")
        >>> isinstance(error, OSError), error.errno == errno.ENOSPC
        (True, True)
    """


class RollbackError(RuntimeError):
    """A failed load could not be undone: its undo journal was missing or damaged.

    The optimizer is then partly loaded; load a good checkpoint into it before training. The
    load's own failure is the error's ``__context__``.

    Examples:
        >>> str(RollbackError("record 3: checksum mismatch"))
        'record 3: checksum mismatch'
    """


class InspectError(ValueError):
    """The path is not something ``inspect_checkpoint`` can describe.

    Raised for a path that does not exist, a file that is not a ``torch.save`` file, a
    directory that is not a DCP checkpoint, and a checkpoint without an optimizer state dict.

    Examples:
        >>> from wrapped_optim.inspection import InspectError, inspect_checkpoint
        >>> try:
        ...     inspect_checkpoint("/no/such/checkpoint.pt")
        ... except InspectError as error:
        ...     print(error)
        /no/such/checkpoint.pt: no such file or directory
    """
