"""The converter's one error type (it imports nothing of the package but the
base error)."""

from __future__ import annotations

from wrapped_optim._formats.errors import OptimizerCheckpointError

__all__ = ["ConversionError"]


class ConversionError(OptimizerCheckpointError):
    """A checkpoint cannot be carried into the asked format as it is; the message names the
    parameter, state and format at fault and what to do. Nothing was written.

    Example:
        >>> error = ConversionError("parameter 'w': state 'exp_avg': no such format")
        >>> isinstance(error, ValueError)
        True
    """
