"""The staged save decodes host-resident compressed state in several chunks, each at its offset.

Host-resident state is decoded straight into the host buffer in calls of up to
``_HOST_SCRATCH_NUMEL`` elements (16M), whatever ``chunk_bytes`` is, so no other test ever
decodes a host tensor in more than one call. Here the constant is shrunk to a few elements
(a prime, so chunks end mid-row and the last one is short) and the staged state dict must
still equal the bare one bitwise, for a holder and for a hybrid optimizer's holders.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.param_builders import train_on_random_grads
from wrapped_optim._staging import engine
from wrapped_optim.optimizers import HybridOffloadOptimizer, PrecisionAwareAdamW
from wrapped_optim.staged import StagedCheckpointOptimizer
from wrapped_optim.testing import assert_state_dict_equal

HOST_CHUNK = 7  # elements per host decode call in these tests
SHAPES = [(5, 9), (13,), (3,)]  # 45, 13 and 3 elements: 7, 2 and 1 calls


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16)) for s in SHAPES]


def _holder(moments: torch.dtype) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params()
    opt = PrecisionAwareAdamW(
        params,
        lr=1e-2,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=torch.float16 if moments == torch.uint8 else moments,
        master_weights=True,
        store_param_remainders=True,
    )
    return opt, params


def _hybrid(moments: torch.dtype) -> tuple[Any, list[torch.nn.Parameter]]:
    params = _params()
    opt = HybridOffloadOptimizer(
        params,
        offload_fraction=1.0,
        cpu_optimizer_cls=PrecisionAwareAdamW,
        lr=1e-2,
        exp_avg_dtype=moments,
        exp_avg_sq_dtype=moments,
    )
    return opt, params


STACKS: dict[str, Callable[[torch.dtype], tuple[Any, list[torch.nn.Parameter]]]] = {
    "holder": _holder,
    "hybrid": _hybrid,
}


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.float16, torch.uint8], ids=str)
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_host_state_decoded_in_many_chunks_equals_the_bare_state_dict(
    stack: str, moments: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    opt, params = STACKS[stack](moments)
    train_on_random_grads(opt, params, 3, seed=2)
    bare = opt.state_dict()

    calls: list[tuple[str, int, int]] = []
    original = PrecisionAwareAdamW.read_unscaled_state_chunk

    def spying(self: Any, param: torch.Tensor, name: str, start: int, out: torch.Tensor) -> None:
        calls.append((name, start, out.numel()))
        original(self, param, name, start, out)

    monkeypatch.setattr(engine, "_HOST_SCRATCH_NUMEL", HOST_CHUNK)
    monkeypatch.setattr(PrecisionAwareAdamW, "read_unscaled_state_chunk", spying)
    staged = StagedCheckpointOptimizer(opt, chunk_bytes=1 << 20)  # the device bound: unused
    result = staged.state_dict()

    assert_state_dict_equal(bare, result, names=("bare", "staged in 7-element chunks"))
    assert staged.last_stats.chunked_reads > 0 and staged.last_stats.whole_tensor_reads == 0
    # Every compressed state of the 45-element param took 7 calls, at 0, 7, ..., 42.
    starts = sorted({start for _, start, _ in calls})
    assert starts == list(range(0, 45, HOST_CHUNK))
    assert max(count for _, _, count in calls) == HOST_CHUNK
    assert (42, 3) in {(start, count) for _, start, count in calls}
