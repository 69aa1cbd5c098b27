"""PrecisionAwareAdamW's fused GPU step: one Triton launch per parameter group and format
combination (three where fp16/FP8 state needs a new scale), no host synchronisation.

The sliced torch path expands each 64K slice of state to FP32, updates it and encodes it
back, 5 to 41 kernel launches per slice: on a GPU the step is launch-bound. Here the
parameters of one group are bucketed by device and format combination, and each bucket is
updated by the kernels of :mod:`~wrapped_optim.optimizers.kernels._triton_adamw`, multi-tensor
style: a device table holds each tensor's operand addresses, element count, first program and
scale addresses, a block map names each program's tensor. Both are cached per optimizer,
group and combination, and rebuilt only when an address or size changes (typically the
gradients, when they are reallocated: then one small pinned, non-blocking host-to-device
copy of the table). Per bucket and step:

* FP32/bf16 moments (no scaled state): one launch;
* fp16 or FP8 moments, or an fp16 master: three launches -- pass 1 computes the update and
  only the new amax of each scaled tensor (atomic max on the device), a small kernel turns
  the amaxes into the codecs' new scales and multipliers (written on the device), pass 2
  redoes the same arithmetic and writes everything.

Nothing is read back on the host: hyper-parameters are kernel arguments, a device ``lr``
tensor is read by the kernel, scales never leave the device.

It applies to parameters on a CUDA device (fp32, bf16 or fp16) with an fp32, bf16 or fp16
gradient, fp32, bf16, fp16 or FP8 moments, and no master, an FP32 or fp16 master, or an int16
remainder master (bf16 parameter); an FP32 parameter's master (FP32 or fp16) is written as
a copy of it, as the torch path does; contiguous storage; ``fused`` not ``True`` (that asks
for torch's kernel); triton importable.

Its arithmetic is the CPU kernel's (:mod:`~wrapped_optim.optimizers.kernels.cpu_kernel`), bit for
bit: TE's formula in float32 with single roundings, the codecs' amax, scales, multipliers and
roundings. The test suite runs these very kernels on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``) against the single-rounding reference, and compiles them for sm_90.

Example:
    >>> import torch
    >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
    >>> from wrapped_optim.optimizers.precision_adamw import _fused_gpu
    >>> p = torch.nn.Parameter(torch.zeros(4))
    >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
    >>> opt.initialize_state(p, False)
    >>> from wrapped_optim.optimizers.precision_adamw._operand import Operand
    >>> _fused_gpu.applicable(opt.layout, Operand(p, torch.ones(4), opt.state[p], {}))  # CPU
    False
"""

from __future__ import annotations

import importlib
import importlib.util
import struct
import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import ModuleType
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import codecs
from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._operand import Operand

__all__ = ["BLOCK", "applicable", "available", "launches_per_step", "update_group"]


#: Elements per Triton program.
BLOCK = 4096
#: Warps per program on a GPU (16 elements per thread).
NUM_WARPS = 8
#: Tensors per program of the finalize kernel.
FINALIZE_BLOCK = 128
_VALUE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, codecs.FP8_E4M3: 3}
_PARAM_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MASTER_NONE, _MASTER_FP32, _MASTER_REMAINDER, _MASTER_FP16 = 0, 1, 2, 3
_COLUMNS, _SLOTS = 10, 3
_KERNEL_MODULE = "wrapped_optim.optimizers.kernels._triton_adamw"
# Devices the kernel is launched on. Tests add "cpu" (with TRITON_INTERPRET=1, Triton's
# interpreter runs the same kernel on host tensors).
_DEVICE_TYPES = {"cuda"}
_NOT_APPLICABLE = (
    "the fused GPU step does not apply to this parameter (CUDA, contiguous storage and the "
    "formats listed in this module's docstring only): send only pairs for which "
    "_fused_gpu.applicable(...) is True"
)


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
    """Forget the imported kernel, so a changed ``TRITON_INTERPRET`` takes effect (the launch
    tables live on each optimizer's scratch)."""
    sys.modules.pop(_KERNEL_MODULE, None)


def _f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (as the CPU kernel receives its arguments)."""
    rounded: float = struct.unpack("f", struct.pack("f", x))[0]
    return rounded


class _Operands:
    """One parameter's flat operands, their kinds and the scales of its scaled slots."""

    __slots__ = ("grad", "kinds", "master", "moments", "param", "scales")

    def __init__(
        self,
        param: Tensor,
        master: Tensor | None,
        grad: Tensor,
        moments: tuple[Tensor, Tensor],
        scales: tuple[Tensor | None, Tensor | None, Tensor | None],
        kinds: tuple[int, int, int, int, int],
    ) -> None:
        self.param, self.master, self.grad, self.moments = param, master, grad, moments
        self.scales, self.kinds = scales, kinds

    def addresses(self) -> tuple[int, ...]:
        """Every operand's address (0 for an absent one), in table order."""
        m, v = self.moments
        return (
            self.param.data_ptr(),
            0 if self.master is None else self.master.data_ptr(),
            self.grad.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            *(0 if s is None else s.data_ptr() for s in self.scales),
        )


def _scale_of(scales: Mapping[str, Tensor], name: str, device: torch.device) -> Tensor:
    scale = scales.get(name)
    if scale is None or scale.dtype != torch.float32 or scale.numel() != 1:
        raise LookupError(name)
    if scale.device != device:
        raise LookupError(name)
    return scale


def _operands(layout: PrecisionLayout, operand: Operand) -> _Operands | None:
    """The flat operands of ``operand`` for the kernels, or None where they do not apply."""
    state, scales, param, grad = operand.state, operand.scales, operand.param, operand.grad
    p, g = local_tensor(param), local_tensor(grad)
    device = p.device
    if device.type not in _DEVICE_TYPES or g.device != device or g.numel() != p.numel():
        return None
    if p.dtype not in _PARAM_KINDS or g.dtype not in _PARAM_KINDS or not p.is_contiguous():
        return None
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    if m is None or v is None:
        return None
    stored: Tensor | None = state.get("master_param")
    operands = [t for t in (m, v, stored) if t is not None]
    if any(t.device != device or not t.is_contiguous() or t.numel() != p.numel() for t in operands):
        return None
    if m.dtype not in _VALUE_KINDS or v.dtype not in _VALUE_KINDS:
        return None
    try:
        m_scale = _scale_of(scales, "exp_avg", device) if m.dtype in _SCALED else None
        v_scale = _scale_of(scales, "exp_avg_sq", device) if v.dtype in _SCALED else None
        master_kind, master_scale = _master_kind(layout, scales, param, stored, device)
    except LookupError:
        return None
    kinds = (master_kind, _PARAM_KINDS[p.dtype], _PARAM_KINDS[g.dtype], _VALUE_KINDS[m.dtype],
             _VALUE_KINDS[v.dtype])  # fmt: skip
    return _Operands(
        p.view(-1),
        None if stored is None else stored.view(-1),
        g.reshape(-1).contiguous(),
        (m.view(-1), v.view(-1)),
        (m_scale, v_scale, master_scale),
        kinds,
    )


_SCALED = (torch.float16, codecs.FP8_E4M3)


def _master_kind(
    layout: PrecisionLayout,
    scales: Mapping[str, Tensor],
    param: Tensor,
    stored: Tensor | None,
    device: torch.device,
) -> tuple[int, Tensor | None]:
    if stored is None:
        return _MASTER_NONE, None
    if layout.uses_remainder(param):
        if stored.dtype != torch.int16:
            raise LookupError("master_param")
        return _MASTER_REMAINDER, None
    if stored.dtype == torch.float32:
        return _MASTER_FP32, None
    if stored.dtype == torch.float16:
        return _MASTER_FP16, _scale_of(scales, "master_param", device)
    raise LookupError("master_param")


def applicable(layout: PrecisionLayout, operand: Operand) -> bool:
    """Whether :func:`update_group` updates ``operand`` (see the module docstring for when).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> applicable(PrecisionLayout(), Operand(p, torch.ones(4), {}, {}))  # no state yet
        False
    """
    if layout.fused is True or not operand.state or layout.block_format is not None:
        return False  # block-scaled moments: the torch step (_block_step)
    if local_tensor(operand.param).device.type not in _DEVICE_TYPES:
        return False  # first: the CPU step asks about every parameter it cannot fuse
    return available() and _operands(layout, operand) is not None


def launches_per_step(layout: PrecisionLayout, operands: Sequence[Operand]) -> int:
    """Kernel launches :func:`update_group` makes for ``operands`` (one group's), once its
    tables are cached: one per device and format combination, three where one is scaled
    (only the scale kernel when all its tensors are empty; none for an empty unscaled one).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> launches_per_step(opt.layout, [])
        0
        >>> launches_per_step(opt.layout, [Operand(p, torch.ones(4), opt.state[p], {})])  # CPU
        Traceback (most recent call last):
        ValueError: the fused GPU step does not apply to this parameter (CUDA, ...
    """
    combos: dict[tuple[Any, ...], int] = {}
    for operand in operands:
        found = _operands(layout, operand)
        if found is None:
            raise ValueError(_NOT_APPLICABLE)
        key = (found.param.device, found.kinds)
        combos[key] = combos.get(key, 0) + found.param.numel()
    return sum(
        (1 + 2 * bool(numel)) if _is_scaled(kinds) else int(bool(numel))
        for (_, kinds), numel in combos.items()
    )


def _is_scaled(kinds: tuple[int, ...]) -> bool:
    master, _, _, m_kind, v_kind = kinds
    return master == _MASTER_FP16 or m_kind >= 2 or v_kind >= 2


class _Entry:
    """The device tables of one bucket, valid while its operands' addresses and sizes are."""

    __slots__ = ("addresses", "aligned", "amax", "block_map", "blocks", "mults", "numels",
                 "table")  # fmt: skip

    def __init__(self) -> None:
        self.addresses: tuple[int, ...] = ()
        self.numels: tuple[int, ...] = ()
        self.blocks = 0
        self.aligned = False
        self.table = self.block_map = self.mults = self.amax = torch.empty(0)


#: (group index, device, kinds, block) -> that bucket's device tables: the optimizer's
#: scratch holds one (copies start empty).
LaunchTables = dict[tuple[Any, ...], _Entry]


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on ``device`` without waiting: through pinned memory on CUDA (a
    pageable copy would synchronise the stream first)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _entry(
    tables: LaunchTables, key: tuple[Any, ...], items: list[_Operands], device: torch.device
) -> _Entry:
    entry = tables.get(key)
    if entry is None:
        entry = tables[key] = _Entry()
    numels = tuple(item.param.numel() for item in items)
    addresses = tuple(a for item in items for a in item.addresses())
    if numels != entry.numels:
        blocks = [-(-n // BLOCK) for n in numels]
        tensors = torch.arange(len(items), dtype=torch.int32)
        counts = torch.tensor(blocks, dtype=torch.int64)
        entry.block_map = _to_device(torch.repeat_interleave(tensors, counts), device)
        entry.blocks = sum(blocks)
        entry.mults = torch.empty(2 * _SLOTS * len(items), dtype=torch.float32, device=device)
        entry.amax = torch.zeros(_SLOTS * len(items), dtype=torch.int32, device=device)
        entry.numels = numels
        entry.addresses = ()
    if addresses != entry.addresses:
        rows = []
        first = 0
        for item, n in zip(items, numels, strict=True):
            a = item.addresses()
            rows.append([*a[:5], n, first, *a[5:]])
            first += -(-n // BLOCK)
        entry.table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
        entry.aligned = all(x % 16 == 0 for row in rows for x in row[:5])
        entry.addresses = addresses
    return entry


def _launch(kernel: Any, grid: tuple[int], *args: Any, **constexprs: Any) -> None:
    """Every launch goes through here (tests count them)."""
    kernel[grid](*args, **constexprs)


def update_group(
    layout: PrecisionLayout,
    operands: Sequence[Operand],
    group: Mapping[str, Any],
    *,
    tables: LaunchTables,
    group_index: int = -1,
) -> None:
    """One fused AdamW step of every operand of ``group`` in place: a launch per
    device and format combination (three where scaled), no host wait.

    Args:
        layout: the optimizer's storage layout.
        operands: the parameters to update, their gradients, states and scales (scales
            written for scaled states).
        group: the param group's options and step count.
        tables: the launch tables kept between steps (the optimizer's scratch holds them).
        group_index: the group's index among the optimizer's groups (part of the tables' key).

    Raises:
        ValueError: an operand :func:`applicable` rejects.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(4))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
        >>> opt.initialize_state(p, False)
        >>> op = Operand(p, torch.ones(4), opt.state[p], {})
        >>> update_group(opt.layout, [op], opt.param_groups[0], tables={})  # a CPU parameter
        Traceback (most recent call last):
        ValueError: the fused GPU step does not apply to this parameter (CUDA, ...
    """
    buckets: dict[tuple[Any, ...], list[_Operands]] = {}
    for operand in operands:
        found = _operands(layout, operand)
        if found is None:
            raise ValueError(_NOT_APPLICABLE)
        buckets.setdefault((found.param.device, found.kinds), []).append(found)
    if not buckets:
        return
    hyper = _hyper(group)
    for (device, kinds), items in buckets.items():
        key = (group_index, device, kinds, BLOCK)
        try:
            entry = _entry(tables, key, items, device)
            _run_bucket(entry, len(items), device, kinds, group, hyper, layout.adam_w_mode)
        except BaseException:
            tables.pop(key, None)  # an amax may be left uncleared
            raise
    written: list[Tensor] = []
    for operand in operands:
        written.append(local_tensor(operand.param))
        written.extend(operand.state.values())
        written.extend(operand.scales.values())
    increment_version(written)  # written by kernels: tell autograd, as in-place ops would


def _hyper(group: Mapping[str, Any]) -> list[float]:
    beta1, beta2 = (float(b) for b in group["betas"])
    step = group["step"]
    correct = group["bias_correction"]
    bc1 = 1.0 - beta1**step if correct else 1.0
    bc2 = 1.0 - beta2**step if correct else 1.0
    return [
        _f32(beta1), _f32(1.0 - beta1), _f32(beta2), _f32(1.0 - beta2),
        _f32(float(group["eps"])), _f32(float(group["weight_decay"])),
        _f32(1.0 / bc1), _f32(1.0 / bc2),
    ]  # fmt: skip


def _lr_operand(lr: float | Tensor, device: torch.device) -> tuple[Tensor | None, float]:
    """(device tensor the kernel reads, or None; the number otherwise). A CPU tensor beside
    device parameters is read on the host (no device involved); any other tensor is moved to
    the parameters' device without waiting."""
    if not isinstance(lr, Tensor):
        return None, _f32(float(lr))
    if lr.device.type == "cpu" and device.type != "cpu":
        return None, _f32(float(lr))
    return lr.to(device=device, dtype=torch.float32, non_blocking=True).reshape(-1), 0.0


def _device_context(device: torch.device) -> AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _run_bucket(
    entry: _Entry,
    count: int,
    device: torch.device,
    kinds: tuple[int, int, int, int, int],
    group: Mapping[str, Any],
    hyper: list[float],
    adam_w_mode: bool,
) -> None:
    master, p_kind, g_kind, m_kind, v_kind = kinds
    scaled = _is_scaled(kinds)
    if entry.blocks == 0 and not scaled:
        return
    kernels = _kernel_module()
    lr_tensor, lr_value = _lr_operand(group["lr"], device)
    options: dict[str, Any] = {}
    if device.type == "cuda":
        # No contraction into FMA and no flush-to-zero: the CPU kernel's bits.
        options = {"num_warps": NUM_WARPS, "enable_fp_fusion": False, "enable_reflect_ftz": False}
    constexprs = {
        "ADAM_W": adam_w_mode, "MASTER": master, "P_KIND": p_kind, "G_KIND": g_kind,
        "M_KIND": m_kind, "V_KIND": v_kind, "LR_TENSOR": lr_tensor is not None,
        "ALIGNED": entry.aligned, "BLOCK": BLOCK, **options,
    }  # fmt: skip
    args = (entry.table, entry.block_map, entry.mults, entry.amax,
            entry.table if lr_tensor is None else lr_tensor, lr_value, *hyper)  # fmt: skip
    grid = (entry.blocks,)
    with _device_context(device):
        if scaled:
            if entry.blocks:
                _launch(kernels.adamw_group_kernel, grid, *args, PASS=1, **constexprs)
            finalize_options = {"num_warps": 4} if device.type == "cuda" else {}
            _launch(
                kernels.finalize_kernel, (-(-count // FINALIZE_BLOCK),),
                entry.table, entry.mults, entry.amax, count,
                M_KIND=m_kind, V_KIND=v_kind, MASTER=master, BLOCK=FINALIZE_BLOCK,
                **finalize_options,
            )  # fmt: skip
        if entry.blocks:
            _launch(kernels.adamw_group_kernel, grid, *args, PASS=0, **constexprs)
