"""What is inside an optimizer checkpoint, without an optimizer to load it into.

Questions like "did this run save bf16 or FP32 moments?", "is this TE's portable format or
torch's?", "which step was it saved at?" come up whenever a checkpoint moves between stacks.
``inspect_checkpoint`` answers them for ``torch.save`` files and for
``torch.distributed.checkpoint`` (DCP) directories; ``format_report`` renders the answer.

A DCP directory is described from its metadata alone (dtypes and shapes are recorded there);
only the few small values a report shows — scalar step counters and param-group options — are
read from its data files. A ``torch.save`` file is opened memory-mapped with
``weights_only=True``: nothing in it is executed and tensor data is paged in only when read.
Checkpoints that pickle other objects (Megatron's ``args`` namespace, RNG states) need
``trusted=True`` (``--trust`` on the command line), which lets torch unpickle them.

Detected formats (see ``StateFormat``):

- torch optimizer state: per-parameter ``step`` tensors beside the moments (``torch.optim``);
- precision-aware FP32-expanded state: TE FusedAdam's portable format (and
  ``PrecisionAwareAdamW``'s): FP32 ``exp_avg`` / ``exp_avg_sq`` (and FP32 ``master_param``
  with master weights), the step counter in ``param_groups``;
- remainder masters: the same with an int16 ``master_param`` holding the low 16 bits of each
  FP32 master beside bf16 params (``store_param_remainders``).
"""

from wrapped_optim.inspection._analysis import inspect_checkpoint
from wrapped_optim.inspection._formatting import format_report
from wrapped_optim.inspection._model import (
    CheckpointReport,
    InspectError,
    OptimizerReport,
    ParamGroupReport,
    StateFormat,
    StateTensor,
)

__all__ = [
    "CheckpointReport",
    "InspectError",
    "OptimizerReport",
    "ParamGroupReport",
    "StateFormat",
    "StateTensor",
    "format_report",
    "inspect_checkpoint",
]
