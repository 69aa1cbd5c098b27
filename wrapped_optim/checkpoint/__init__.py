"""Streaming optimizer checkpoints through torch.distributed.checkpoint (DCP): DCP drives
the copy chunk by chunk, so no full FP32 expansion of the state is ever held. ``convert``
carries an optimizer checkpoint from one runtime's format to another's.
"""

from wrapped_optim._formats.errors import RollbackError, UndoJournalError
from wrapped_optim.checkpoint._common import DEFAULT_CHUNK_BYTES, OptimizerCheckpointError
from wrapped_optim.checkpoint._convert._api import ConversionReport, convert
from wrapped_optim.checkpoint._convert._errors import ConversionError
from wrapped_optim.checkpoint._convert._names import ParameterNames, names_from_model, save_names
from wrapped_optim.checkpoint._deferred import DeferredState
from wrapped_optim.checkpoint._load import StreamingLoadPlanner, load_optimizer
from wrapped_optim.checkpoint._save import StreamingSavePlanner, save_optimizer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "ConversionError",
    "ConversionReport",
    "DeferredState",
    "OptimizerCheckpointError",
    "ParameterNames",
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
