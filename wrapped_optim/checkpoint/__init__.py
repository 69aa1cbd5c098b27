"""Streaming optimizer checkpoints through torch.distributed.checkpoint (DCP): DCP drives
the copy chunk by chunk, so no full FP32 expansion of the state is ever held.
"""

from wrapped_optim._formats.errors import RollbackError, UndoJournalError
from wrapped_optim.checkpoint._common import DEFAULT_CHUNK_BYTES, OptimizerCheckpointError
from wrapped_optim.checkpoint._deferred import DeferredState
from wrapped_optim.checkpoint._load import StreamingLoadPlanner, load_optimizer
from wrapped_optim.checkpoint._save import StreamingSavePlanner, save_optimizer

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DeferredState",
    "OptimizerCheckpointError",
    "RollbackError",
    "StreamingLoadPlanner",
    "StreamingSavePlanner",
    "UndoJournalError",
    "load_optimizer",
    "save_optimizer",
]
