"""What is inside an optimizer checkpoint (format, dtypes, steps), read without an optimizer
to load it into and without executing anything it pickles.
"""

from wrapped_optim._formats.errors import InspectError
from wrapped_optim.inspection._analysis import inspect_checkpoint
from wrapped_optim.inspection._formatting import format_report
from wrapped_optim.inspection._model import StateFormat

__all__ = [
    "InspectError",
    "StateFormat",
    "format_report",
    "inspect_checkpoint",
]
