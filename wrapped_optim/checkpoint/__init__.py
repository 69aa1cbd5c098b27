"""Streaming optimizer checkpoints through torch.distributed.checkpoint (DCP): DCP drives
the copy chunk by chunk, so no full FP32 expansion of the state is ever held. ``convert``
carries an optimizer checkpoint from one runtime's format to another's.
"""

from wrapped_optim._formats.errors import RollbackError, UndoJournalError
from wrapped_optim.checkpoint._common import OptimizerCheckpointError
from wrapped_optim.checkpoint._convert._api import convert
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._names import names_from_model, save_names
from wrapped_optim.checkpoint._load import StreamingLoadPlanner, load_optimizer
from wrapped_optim.checkpoint._save import StreamingSavePlanner, save_optimizer

__all__ = [
    "ConversionError",
    "OptimizerCheckpointError",
    "RollbackError",
    "StreamingLoadPlanner",
    "StreamingSavePlanner",
    "UndoJournalError",
    "convert",
    "load_optimizer",
    "names_from_model",
    "save_names",
    "save_optimizer",
]
