"""DTensor helpers for every module that meets sharded tensors (FSDP2, Megatron-FSDP).

Optimizer state of a sharded parameter lives on the rank-local shard; checkpoints see it as a
DTensor with the parameter's mesh and placements. These three functions are the only places
that translate between the two views.
"""

from __future__ import annotations

from typing import Any, cast

import torch

__all__ = ["is_dtensor", "like_param", "local_tensor"]

_DTENSOR_TYPES: tuple[type, ...]
try:  # torch.distributed may be missing on exotic builds
    from torch.distributed.tensor import DTensor

    _DTENSOR_TYPES = (DTensor,)
except ImportError:  # pragma: no cover
    _DTENSOR_TYPES = ()


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``.

    Example:
        >>> import torch
        >>> is_dtensor(torch.ones(2))
        False
    """
    return isinstance(tensor, _DTENSOR_TYPES)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor, or the tensor itself.

    Example:
        >>> import torch
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        local: torch.Tensor = cast(Any, tensor).to_local()
    return local


def like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor with ``param``'s mesh, placements and global shape (or ``local``
    itself when ``param`` is a plain tensor).

    Example:
        >>> import torch
        >>> state = torch.zeros(2)
        >>> like_param(torch.ones(2), state) is state
        True
    """
    if not is_dtensor(param):
        return local
    dparam = cast(Any, param)
    return cast(
        torch.Tensor,
        DTensor.from_local(
            local,
            dparam.device_mesh,
            dparam.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        ),
    )
