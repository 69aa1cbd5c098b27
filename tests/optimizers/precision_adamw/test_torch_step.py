"""PrecisionAwareAdamW's torch step paths (optimizers/_torch_step.py): a per-thread workspace
(two threads stepping one optimizer never share a buffer), no host copy of the step count,
and a CPU ``lr`` tensor handed to device parameters as a number."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import pytest
import torch

from wrapped_optim.optimizers import PrecisionAwareAdamW
from wrapped_optim.optimizers.precision_adamw import _torch_step as torch_step
from wrapped_optim.optimizers.precision_adamw._operand import Operand

FP16 = torch.float16


def _update(
    opt: PrecisionAwareAdamW, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]
) -> None:
    """The sliced path of one parameter, with ``opt``'s operands and its own workspace."""
    operand = Operand(param, grad, opt.state[param], opt.scales[param])
    torch_step.update(opt.layout, operand, group, opt._scratch)


def _two_params_opt() -> tuple[PrecisionAwareAdamW, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(40_000)) for _ in range(2)]
    # fp16 moments on the torch path (the GPU path; on a CPU the compiled kernel would take
    # them): two sliced passes, which decode every slice into the workspace.
    opt = PrecisionAwareAdamW(
        params,
        lr=1e-2,
        exp_avg_dtype=FP16,
        exp_avg_sq_dtype=FP16,
        chunk_numel=512,
        cpu_kernel=False,
    )
    for p in params:
        opt.initialize_state(p, opt.layout.uses_remainder(p))
    return opt, params


def _grads(i: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + i)
    return [torch.randn(40_000, generator=gen) for _ in range(2)]


def _state(opt: PrecisionAwareAdamW, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [t.clone() for p in params for t in (p.detach(), *opt.state[p].values())]


def _run_threads(opt: PrecisionAwareAdamW, params: list[torch.nn.Parameter], steps: int) -> None:
    group = opt.param_groups[0]
    group["step"] = 1
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(steps):
                barrier.wait()  # both threads inside the same step at once
                _update(opt, params[k], _grads(i)[k], group)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_two_threads_stepping_one_optimizer_give_the_sequential_result() -> None:
    """Each thread updates its own parameter of one optimizer (fp16 moments, many slices),
    at the same time; the result is bitwise the one-thread result."""
    steps = 6
    want_opt, want_params = _two_params_opt()
    want_opt.param_groups[0]["step"] = 1
    for i in range(steps):
        for k in range(2):
            _update(want_opt, want_params[k], _grads(i)[k], want_opt.param_groups[0])
    opt, params = _two_params_opt()
    _run_threads(opt, params, steps)
    for got, want in zip(_state(opt, params), _state(want_opt, want_params), strict=True):
        assert torch.equal(got, want)


def test_each_thread_gets_its_own_workspace_buffer() -> None:
    """What the threaded test relies on, deterministically: two threads alive at once get
    different buffers from one optimizer's workspace; one thread gets the same one again."""
    opt, _ = _two_params_opt()
    cpu = torch.device("cpu")
    pointers: list[int] = []
    barrier = threading.Barrier(2)

    def worker() -> None:
        buf = opt._scratch.get(cpu, 1024)
        pointers.append(buf.data_ptr())
        assert opt._scratch.get(cpu, 512).data_ptr() == buf.data_ptr()  # kept and reused
        barrier.wait()  # both buffers alive at once

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(pointers) == 2 and pointers[0] != pointers[1]


def test_the_workspace_is_never_copied_or_pickled() -> None:
    opt, params = _two_params_opt()
    params[0].grad = torch.ones(40_000)
    opt.step()
    scratch = opt._scratch
    assert scratch.get(torch.device("cpu"), 1).numel() == 1
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert isinstance(other._scratch, torch_step.StepScratch)
        assert other._scratch is not scratch
        assert getattr(other._scratch._local, "buffers", None) is None


def test_the_step_count_reaches_kernels_without_a_host_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``torch.tensor(float(step), device=...)`` (a blocking host copy on CUDA): every
    step tensor is filled on the device by ``torch.full``."""
    made: list[Any] = []
    real_tensor = torch.tensor

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        made.append(args)
        return real_tensor(*args, **kw)

    opt, params = _two_params_opt()
    small = torch.nn.Parameter(torch.ones(8))
    opt.add_param_group({"params": [small]})
    for p in (*params, small):
        p.grad = torch.ones_like(p)
    monkeypatch.setattr(torch, "tensor", spy)
    opt.step()
    assert made == []
    assert torch_step.step_tensor(3, torch.device("cpu")).dtype == torch.float32


def test_a_cpu_lr_tensor_of_shape_1_reaches_device_ops_as_a_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA op takes a CPU tensor only as a 0-d scalar; ``update.mul_(lr)`` with a CPU
    ``lr`` of shape [1] crashed. Checked on 'meta' parameters: every lr a step path uses
    is a number or a 0-d tensor on the parameter's device."""
    seen: list[tuple[Any, torch.device]] = []
    real = torch_step.lr_operand

    def spy(lr: Any, device: torch.device) -> Any:
        out = real(lr, device)
        seen.append((out, device))
        return out

    monkeypatch.setattr(torch_step, "lr_operand", spy)
    for kw in ({"exp_avg_dtype": FP16}, {"exp_avg_dtype": FP16, "fused": False}, {}):
        p = torch.nn.Parameter(torch.zeros(10, device="meta"))
        opt = PrecisionAwareAdamW([p], lr=torch.tensor([0.1]), cpu_kernel=False, **kw)
        p.grad = torch.zeros(10, device="meta")
        opt.step()
    assert len(seen) >= 3
    for out, device in seen:
        assert isinstance(out, float) or (out.device == device and out.dim() == 0), out
