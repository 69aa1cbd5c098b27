"""Streaming optimizer checkpoints through torch.distributed.checkpoint (DCP).

``dcp.save(optimizer.state_dict())`` needs the whole state dict first. For a precision-aware
optimizer that is the FP32 expansion of every compressed moment at once (four bytes per element
and state, on top of the optimizer itself), and ``dcp.load`` into a full scaffold needs the same
again before ``load_state_dict`` quantizes it. Here DCP drives the copy instead:

* save: the state dict handed to DCP holds *placeholders* for compressed states; the save
  planner expands one tensor chunk when the storage writer asks for it (``resolve_data``) and
  releases it once written. FP32 state is read where it lives.
* load: the load planner hands the reader either the live state tensor itself (FP32, bf16
  and remainder states are read straight into place) or a host accumulator for a scaled
  (fp16, FP8) state, which is quantized into the holder's storage as soon as its last chunk
  arrives (``commit_tensor``).

The files are ordinary DCP checkpoints with the optimizer's own ``state_dict`` layout
(``state.<param index>.<name>`` tensors, ``param_groups`` as DCP objects): plain ``dcp.load``
reads them and ``load_optimizer`` reads what plain ``dcp.save(optimizer.state_dict())``
wrote. Large tensors are written as several DCP chunks (rows of ``chunk_bytes``), which any DCP
reader reassembles.

The package's modules: ``_deferred`` (compressed state as
placeholders), ``_save``, ``_load`` and
its undo journal, ``_journal`` (the atomic load's rollback on disk).
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
