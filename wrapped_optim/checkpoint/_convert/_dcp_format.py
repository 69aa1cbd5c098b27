"""The DCP formats' registry entries."""

from __future__ import annotations

from pathlib import Path

from wrapped_optim.checkpoint._convert._dcp import DcpReader, DcpWriter, Layout, looks_like
from wrapped_optim.checkpoint._convert._formats import Format, WriterFactory
from wrapped_optim.checkpoint._convert._options import FormatOptions

__all__ = ["FORMATS"]


def _writer(layout: Layout) -> WriterFactory:
    def make(path: Path, options: FormatOptions) -> DcpWriter:
        return DcpWriter(path, options, layout)

    return make


FORMATS = (
    Format(
        name="dcp",
        summary="a torch.distributed.checkpoint directory of get_optimizer_state_dict's layout "
        "(FSDP2, plain models; parameters by fully qualified name)",
        reader=DcpReader,
        writer=_writer("dcp"),
        detect=looks_like,
        directory=True,
    ),
    Format(
        name="dcp-flat",
        summary="the same, flattened (StateDictOptions(flatten_optimizer_state_dict=True), "
        "torchtitan)",
        reader=DcpReader,
        writer=_writer("dcp-flat"),
        detect=None,
        directory=True,
    ),
    Format(
        name="dcp-streaming",
        summary="wrapped_optim.checkpoint.save_optimizer's DCP layout (optimizer.state_dict(), "
        "parameters by index)",
        reader=DcpReader,
        writer=_writer("dcp-streaming"),
        detect=None,
        directory=True,
    ),
)
