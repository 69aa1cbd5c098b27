"""Transformer Engine's FusedAdam surface on the portable precision-aware holder.

TE does not install here; :class:`~wrapped_optim.PrecisionAwareAdamW` carries FusedAdam's
``get_unscaled_state`` / ``set_scaled_state`` API plus a chunk API TE lacks. These helpers make
a holder class look like TE's: no chunk API (:func:`te_style`) and, in :func:`te_fp16_bug`,
TE's ``set_scaled_state`` that scales the caller's fp16 tensor in place.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["te_fp16_bug", "te_style"]


def te_style(holder_cls: type) -> type:
    """A subclass of ``holder_cls`` with TE FusedAdam's surface: no chunk API.

    The chunk methods are set to ``None`` on the class, the protocol convention for "not
    offered", so ``supports_chunked_state`` and the staging engine see a whole-tensor holder.
    """
    return type(
        f"TEStyle{holder_cls.__name__}",
        (holder_cls,),
        {"read_unscaled_state_chunk": None, "write_scaled_state_chunked": None},
    )


def te_fp16_bug(holder_cls: type) -> type:
    """Like :func:`te_style`, and like TE its set_scaled_state scales the caller's fp16 input."""
    base = te_style(holder_cls)

    def set_scaled_state(self: Any, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        base.set_scaled_state(self, param, name, value)  # type: ignore[attr-defined]
        if self.name_to_dtype_map[name] == torch.float16:
            value.div_(2.0)  # the caller's tensor is changed, as TE does

    return type(f"TEFp16{holder_cls.__name__}", (base,), {"set_scaled_state": set_scaled_state})
