"""StagedCheckpointOptimizer: optimizer checkpoints in bounded device memory.

How it works (staging to the host, chunked and no-copy loads) is in the docs' page
"Staged checkpoints".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from wrapped_optim._adapters.megatron_checkpoint import (
    allow_optimizer_classes_in_next_common_read,
    end_common_read,
    megatron_load_repairs,
    megatron_sharded_state_dict,
)
from wrapped_optim._staging.engine import StagingStats, fp32_no_copy_load, staged_load, staged_save
from wrapped_optim.wrapper import OptimizerWrapper

__all__ = ["StagedCheckpointOptimizer"]


class StagedCheckpointOptimizer(OptimizerWrapper):
    """Checkpoints the wrapped stack with at most one chunk of expanded state on the device.

    The checkpoint format does not change; ``last_stats`` records what the latest checkpoint
    call did. See [Staged checkpoints](../staged.md).

    Args:
        inner: The optimizer to decorate: a torch optimizer (e.g. ``PrecisionAwareAdamW``),
            a Megatron optimizer or ``ChainedOptimizer``, or another wrapper.
        chunk_bytes: Device bytes one chunk of FP32 expansion may take (default 64 MiB).
        stage_save: Stage precision-aware state to the host in ``state_dict``,
            ``sharded_state_dict`` and ``load_state_dict``.
        no_copy_load: Let standard FP32 distributed Adams adopt loaded tensors without a copy.
        chunked_load: Quantize FP32 checkpoint state into compressed storage chunk by chunk.

    Raises:
        TypeError: ``chunk_bytes`` is not an int.
        ValueError: ``chunk_bytes`` is below 4 (one FP32 element).

    Examples:
        >>> import torch
        >>> from wrapped_optim.staged import StagedCheckpointOptimizer
        >>> p = torch.nn.Parameter(torch.ones(3))
        >>> opt = StagedCheckpointOptimizer(torch.optim.AdamW([p], lr=0.1), chunk_bytes=1 << 20)
        >>> p.grad = torch.ones(3)
        >>> opt.step()
        >>> sorted(opt.state_dict()["state"][0])
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> print(repr(opt).replace(", ", ",\\n"))
        StagedCheckpointOptimizer(chunk_bytes=1048576,
        stage_save=True,
        no_copy_load=True,
        chunked_load=True)
        └─ AdamW(param_groups=1)
    """

    def __init__(
        self,
        inner: Any,
        *,
        chunk_bytes: int = 64 << 20,
        stage_save: bool = True,
        no_copy_load: bool = True,
        chunked_load: bool = True,
    ) -> None:
        super().__init__(inner)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
            raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
        if chunk_bytes < 4:
            raise ValueError(
                f"chunk_bytes must be at least 4 (one FP32 element), got {chunk_bytes}"
            )
        self.__dict__["chunk_bytes"] = chunk_bytes
        self.__dict__["stage_save"] = bool(stage_save)
        self.__dict__["no_copy_load"] = bool(no_copy_load)
        self.__dict__["chunked_load"] = bool(chunked_load)
        self.__dict__["last_stats"] = StagingStats()

    chunk_bytes: int
    stage_save: bool
    no_copy_load: bool
    chunked_load: bool
    last_stats: StagingStats

    @contextlib.contextmanager
    def _saving(self, stats: StagingStats) -> Iterator[None]:
        if self.stage_save:
            with staged_save(self.inner, chunk_bytes=self.chunk_bytes, stats=stats):
                yield
        else:
            yield

    @contextlib.contextmanager
    def _loading(self, stats: StagingStats) -> Iterator[None]:
        with contextlib.ExitStack() as scopes:
            scopes.enter_context(megatron_load_repairs(self.inner))
            scopes.enter_context(self._saving(stats))
            if self.chunked_load:
                scopes.enter_context(
                    staged_load(self.inner, chunk_bytes=self.chunk_bytes, stats=stats)
                )
            if self.no_copy_load:
                scopes.enter_context(fp32_no_copy_load(self.inner, stats=stats))
            yield

    def _new_stats(self) -> StagingStats:
        stats = StagingStats()
        self.__dict__["last_stats"] = stats
        return stats

    def _state_dict(self) -> dict[str, Any]:
        with self._saving(self._new_stats()):
            return super()._state_dict()

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        end_common_read(self)
        with self._loading(self._new_stats()):
            super()._load_state_dict(state_dict)

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        end_common_read(self)  # a load whose scaffold was built and that was abandoned
        return self._inner_step(closure)

    def sharded_state_dict(
        self, model_sharded_state_dict: Any = None, is_loading: bool = False, **kwargs: Any
    ) -> Any:
        """Megatron's ``sharded_state_dict`` of the wrapped stack, staged.

        With ``is_loading=True`` Megatron also loads its scaffold into the inner optimizer,
        so the loading scopes (and the repairs of megatron-core's loaders) apply as well, and
        Core's next common-state read may unpickle the optimizer classes its file names
        (megatron-core 0.16.1's weights-only read refuses them): torch's allow-list holds
        them during that read only; the read, ``load_state_dict`` or the next step ends that.

        Args:
            model_sharded_state_dict: The model's sharded state dict, as Megatron passes it.
            is_loading: Whether Megatron builds the scaffold of a load.
            **kwargs: Passed on to the inner optimizer's ``sharded_state_dict``.

        Returns:
            The inner optimizer's sharded state dict.

        Raises:
            AttributeError: the stack holds no Megatron optimizer.
        """
        inner_method = megatron_sharded_state_dict(self.inner)
        stats = self._new_stats()
        scope = self._loading(stats) if is_loading else self._saving(stats)
        with scope:
            result = inner_method(model_sharded_state_dict, is_loading, **kwargs)
        if is_loading:
            allow_optimizer_classes_in_next_common_read(self)
        return result

    def load_parameter_state(self, filename: str, **kwargs: Any) -> None:
        """Megatron's legacy parameter-state load, inside the loading scopes of ``load_state_dict``.

        Args:
            filename: The file Megatron's ``save_parameter_state`` wrote.
            **kwargs: Passed on to the inner optimizer's ``load_parameter_state``.
        """
        end_common_read(self)
        with self._loading(self._new_stats()):
            self.inner.load_parameter_state(filename, **kwargs)

    def _extra_repr(self) -> str:
        return (
            f"chunk_bytes={self.chunk_bytes}, stage_save={self.stage_save}, "
            f"no_copy_load={self.no_copy_load}, chunked_load={self.chunked_load}"
        )
