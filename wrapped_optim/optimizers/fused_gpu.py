"""PrecisionAwareAdamW's fused GPU step: one Triton kernel launch per parameter.

The sliced torch path expands each 64K slice of state to FP32, updates it and encodes it
back, 5 to 41 kernel launches per slice: on a GPU the step is launch-bound. Where its formats
allow, a parameter is instead updated by one launch of the kernel in
:mod:`~wrapped_optim.optimizers._fused_gpu_kernel`, which reads every operand once in its
stored format and writes it back once, with no host synchronisation (hyper-parameters are
kernel arguments; a tensor ``lr`` on the device is read by the kernel).

It applies to CUDA parameters (fp32, bf16 or fp16) with an fp32, bf16 or fp16 gradient,
fp32 or bf16 moments, and no master, an FP32 master (bf16/fp16 parameter) or an int16
remainder master (bf16 parameter); contiguous storage; ``fused`` not ``True`` (that asks for
torch's kernel); triton importable. Scaled state (fp16 or FP8 moments, an fp16 master) keeps
the sliced path, whose new scale needs the amax of the whole updated tensor first.

Its arithmetic is the CPU kernel's (:mod:`~wrapped_optim.optimizers.cpu_kernel`), bit for bit:
TE's formula in float32 with single roundings. The test suite runs this very kernel on CPU
through Triton's interpreter (``TRITON_INTERPRET=1``) against the single-rounding reference.

Example:
    >>> import torch
    >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, fused_gpu
    >>> p = torch.nn.Parameter(torch.zeros(4))
    >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
    >>> opt.initialize_state(p)
    >>> fused_gpu.applicable(opt, p, torch.ones(4), opt.param_groups[0])  # a CPU parameter
    False
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from wrapped_optim.adapters.dtensor import local_tensor

if TYPE_CHECKING:
    from wrapped_optim.optimizers.precision_adam import PrecisionAwareAdamW

__all__ = ["BLOCK", "applicable", "available", "update"]

#: Elements per Triton program.
BLOCK = 1024
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MASTER_NONE, _MASTER_FP32, _MASTER_REMAINDER = 0, 1, 2
_KERNEL_MODULE = "wrapped_optim.optimizers._fused_gpu_kernel"
# Devices the kernel is launched on. Tests add "cpu" (with TRITON_INTERPRET=1, Triton's
# interpreter runs the same kernel on host tensors).
_DEVICE_TYPES = {"cuda"}


def available() -> bool:
    """Whether triton can be imported here (the fused step needs it).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _kernel_module() -> ModuleType:
    return importlib.import_module(_KERNEL_MODULE)


def _reset_for_tests() -> None:
    """Forget the imported kernel, so a changed ``TRITON_INTERPRET`` takes effect."""
    sys.modules.pop(_KERNEL_MODULE, None)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as the CPU kernel receives its arguments)."""
    rounded: float = struct.unpack("f", struct.pack("f", x))[0]
    return rounded


def _operands(
    opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor
) -> tuple[tuple[Tensor, ...], tuple[int, ...]] | None:
    """``((param, master, grad, m, v), (master kind, p, g, m, v kinds))`` flat, or None."""
    p, g = local_tensor(param), local_tensor(grad)
    if p.device.type not in _DEVICE_TYPES or g.device != p.device or g.numel() != p.numel():
        return None
    if p.dtype not in _KINDS or g.dtype not in _KINDS or not p.is_contiguous():
        return None
    state = opt.state[param]
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if m is None or v is None:
        return None
    if any(t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous() for t in (m, v)):
        return None
    stored: Tensor | None = state.get("master_param")
    if stored is None:
        master, master_kind = p, _MASTER_NONE
    elif p.dtype == torch.float32 or not stored.is_contiguous():
        return None  # an fp32 parameter's master is synced after the update: the torch path
    elif opt._uses_remainder(param):
        master, master_kind = stored, _MASTER_REMAINDER
    elif stored.dtype == torch.float32:
        master, master_kind = stored, _MASTER_FP32
    else:
        return None  # an fp16 master is scaled
    kinds = (master_kind, _KINDS[p.dtype], _KINDS[g.dtype], _KINDS[m.dtype], _KINDS[v.dtype])
    return (p, master, g.reshape(-1).contiguous(), m, v), kinds


def applicable(
    opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]
) -> bool:
    """Whether :func:`update` updates ``param`` (see the module docstring for when).

    Example:
        >>> applicable.__name__
        'applicable'
    """
    if opt.fused is True or not opt.state.get(param) or not available():
        return False
    return _operands(opt, param, grad) is not None


def _bits_view(t: Tensor) -> Tensor:
    """bf16 tensors go to the kernel as their int16 bits; others as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def update(opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
    """One fused AdamW step of ``param`` in place: one kernel launch, no host wait.

    Example:
        >>> update.__name__
        'update'
    """
    found = _operands(opt, param, grad)
    if found is None:
        raise ValueError("the fused GPU step does not apply to this parameter's formats")
    (p, master, g, m, v), (master_kind, p_kind, g_kind, m_kind, v_kind) = found
    n = p.numel()
    if n == 0:
        return
    beta1, beta2 = (float(b) for b in group["betas"])
    step = group["step"]
    correct = group["bias_correction"]
    bc1 = 1.0 - beta1**step if correct else 1.0
    bc2 = 1.0 - beta2**step if correct else 1.0
    lr = group["lr"]
    # A tensor lr beside the parameter is read by the kernel (no host wait); elsewhere (a
    # CPU tensor for CUDA parameters) it is read on the host, which waits for nothing.
    lr_tensor = isinstance(lr, Tensor) and lr.device == p.device
    lr_ptr = lr.to(torch.float32).reshape(-1) if lr_tensor else p
    kernel = _kernel_module().adamw_kernel
    options: dict[str, Any] = {"BLOCK": BLOCK}
    if p.device.type == "cuda":
        options["enable_fp_fusion"] = False  # no contraction into FMA: the CPU kernel's bits
    grid = ((n + BLOCK - 1) // BLOCK,)
    with torch.cuda.device(p.device) if p.device.type == "cuda" else _nothing():
        kernel[grid](
            _bits_view(p), _bits_view(master), _bits_view(g), _bits_view(m), _bits_view(v),
            lr_ptr, n, 0.0 if lr_tensor else _f32(float(lr)),
            _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2),
            _f32(float(group["eps"])), _f32(float(group["weight_decay"])),
            _f32(1.0 / bc1), _f32(1.0 / bc2),
            ADAM_W=bool(opt.adam_w_mode), MASTER=master_kind, P_KIND=p_kind, G_KIND=g_kind,
            M_KIND=m_kind, V_KIND=v_kind, LR_TENSOR=lr_tensor, **options,
        )  # fmt: skip
    _bump_versions(param, opt.state[param])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


def _bump_versions(param: Tensor, state: dict[str, Tensor]) -> None:
    """Autograd's version counters must see writes made by a kernel, as torch's in-place
    ops do."""
    increment_version([local_tensor(param), *state.values()])
