"""PrecisionAwareAdamW's torch step paths, on any device.

Three paths (:mod:`~wrapped_optim.optimizers.precision_adamw._step` picks one per parameter):
torch's fused AdamW on the stored tensors themselves (:func:`direct_views`), many small
parameters packed into one fused call (:func:`packable` / :func:`update_packed`), or one
parameter slice by slice with a two-pass scale update for fp16/FP8 state (:func:`update`).
Each takes explicit tensors, the param group's options and the optimizer's
:class:`~wrapped_optim.optimizers.precision_adamw._layout.PrecisionLayout`.

Nothing here waits for the device: the step count reaches a kernel as a device tensor filled
by a kernel (:func:`step_tensor`), never through a host copy or ``.item()``. The FP32
workspace is per thread (:class:`StepScratch`), so two threads stepping one optimizer (on
different parameters) never share a buffer.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import codecs
from wrapped_optim._formats.remainders import join_master, split_master_into
from wrapped_optim.optimizers.precision_adamw import _fused_gpu
from wrapped_optim.optimizers.precision_adamw._layout import STATE_NAMES, PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._operand import Operand

__all__ = [
    "StepLock",
    "StepScratch",
    "direct_views",
    "fused_math",
    "lr_operand",
    "packable",
    "step_tensor",
    "update",
    "update_packed",
    "use_fused",
]

_Group = Mapping[str, Any]
_State = Mapping[str, Tensor]
# Devices with torch's fused (single-pass) Adam/AdamW kernels.
_FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu")


class StepScratch:
    """The step's FP32 workspace, one buffer per (thread, device), kept between steps.

    Allocating the slice buffers afresh each step costs page faults, so they are kept; one
    per thread, because a buffer shared by two threads stepping at once is overwritten under
    each other's feet. Never saved: copies and unpickled optimizers start empty.

    Example:
        >>> import torch
        >>> scratch = StepScratch()
        >>> a = scratch.get(torch.device("cpu"), 4)
        >>> scratch.get(torch.device("cpu"), 2).data_ptr() == a.data_ptr()  # reused
        True
    """

    def __init__(self) -> None:
        self._local = threading.local()
        # The fused GPU step's launch tables, kept between steps (the step lock serialises
        # steps, so one table set serves every thread).
        self.launch_tables: dict[tuple[Any, ...], Any] = {}

    def get(self, device: torch.device, numel: int) -> Tensor:
        """This thread's buffer on ``device``, grown to at least ``numel`` FP32 elements."""
        buffers: dict[torch.device, Tensor] | None = getattr(self._local, "buffers", None)
        if buffers is None:
            buffers = self._local.buffers = {}
        buf = buffers.get(device)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            buffers[device] = buf
        return buf[:numel]

    def __reduce__(self) -> tuple[type[StepScratch], tuple[()]]:
        return (StepScratch, ())  # pickle and copy.deepcopy start with an empty workspace


class StepLock:
    """Serialises one optimizer's steps: a step updates moments together with their shared
    scales (fp16, FP8), which two threads stepping at once would mix into non-finite values.
    Never saved: copies and unpickled optimizers get a lock of their own.

    Example:
        >>> lock = StepLock()
        >>> with lock:
        ...     with lock:  # re-entrant: a closure may step again
        ...         pass
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __reduce__(self) -> tuple[type[StepLock], tuple[()]]:
        return (StepLock, ())


def step_tensor(step: int | float | Tensor, device: torch.device) -> Tensor:
    """The step count as a float32 0-d tensor on ``device``, without a host-to-device copy.

    ``torch.full`` fills on the device (a kernel launch); ``torch.tensor(float(step),
    device=cuda)`` would copy from pageable host memory and wait for it.

    Example:
        >>> step_tensor(3, torch.device("cpu"))
        tensor(3.)
    """
    if isinstance(step, Tensor):
        return step.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())
    return torch.full((), float(step), dtype=torch.float32, device=device)


def lr_operand(lr: float | Tensor, device: torch.device) -> float | Tensor:
    """``lr`` in a form torch ops on ``device`` accept: a number, or a 0-d tensor there.

    A CPU tensor (of shape ``[1]`` too) is read as a number -- a host read, no device wait
    -- since a CUDA op takes a CPU tensor only as a 0-d scalar; a tensor on another
    accelerator is moved without waiting.

    Example:
        >>> lr_operand(torch.tensor([0.5]), torch.device("meta"))
        0.5
        >>> lr_operand(torch.tensor([0.5]), torch.device("cpu"))
        tensor(0.5000)
    """
    if not isinstance(lr, Tensor):
        return lr
    if lr.device == device:
        return lr.reshape(())
    if lr.device.type == "cpu":
        return float(lr)
    return lr.to(device, non_blocking=True).reshape(())


def fused_math(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    group: _Group,
    steps: list[Tensor],
    *,
    adam_w_mode: bool,
) -> None:
    """torch's single-pass AdamW (L2 Adam without ``adam_w_mode``) kernel.

    Algebraically TE's update (``p * (1 - lr * wd) - lr * step`` is ``p - lr * (step +
    wd * p)``); the rounding of the FP32 arithmetic differs in the last bits.

    Example:
        >>> import torch
        >>> p, m, v, step = torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.ones(())
        >>> group = {"lr": 0.5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
        >>> fused_math([p], [torch.tensor([1.0, -1.0])], [m], [v], group, [step],
        ...            adam_w_mode=True)
        >>> p
        tensor([-0.5000,  0.5000])
    """
    beta1, beta2 = group["betas"]
    lr = lr_operand(group["lr"], params[0].device) if params else group["lr"]
    fused = torch._fused_adamw_ if adam_w_mode else torch._fused_adam_
    fused(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
        eps=group["eps"], amsgrad=False, maximize=False,
    )  # fmt: skip


def use_fused(layout: PrecisionLayout, device: torch.device, group: _Group) -> bool:
    """Whether the FP32 update on ``device`` is torch's fused kernel (else TE's formula).

    Example:
        >>> from wrapped_optim.optimizers.precision_adamw._layout import PrecisionLayout
        >>> group = {"bias_correction": True}
        >>> use_fused(PrecisionLayout(), torch.device("cpu"), group)
        True
        >>> use_fused(PrecisionLayout(fused=False), torch.device("cpu"), group)
        False
    """
    if layout.fused is False or not group["bias_correction"]:
        return False
    supported = device.type in _FUSED_DEVICES
    if layout.fused and not supported:
        raise RuntimeError(f"fused=True, but torch has no fused AdamW kernel for {device}")
    return supported


def packable(layout: PrecisionLayout, operand: Operand, group: _Group) -> bool:
    """Small parameters whose state needs only per-element conversion (bf16/fp32 moments,
    an fp32 or remainder master) are updated many at a time (one fused call per pack),
    unless the fused GPU kernels update them (with their whole group, no conversion passes).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(8))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16, chunk_numel=64)
        >>> opt.initialize_state(p, False)
        >>> op = Operand(p, torch.ones(8), opt.state[p], {})
        >>> packable(opt.layout, op, opt.param_groups[0])
        True
    """
    state, param = operand.state, operand.param
    p, g = local_tensor(param), local_tensor(operand.grad)
    if not layout.pack_small or _fused_gpu.applicable(layout, operand):
        return False
    if p.numel() > layout.chunk_numel // 4 or not p.is_contiguous() or g.device != p.device:
        return False
    if not use_fused(layout, p.device, group):
        return False
    for name, storage in state.items():
        if name == "master_param":
            if param.dtype == torch.float32:  # its master is synced after the update
                return False
            if not layout.uses_remainder(param) and storage.dtype != torch.float32:
                return False
        elif storage.dtype not in (torch.float32, torch.bfloat16):
            return False
    return True


def update_packed(
    layout: PrecisionLayout,
    states: Mapping[Tensor, _State],
    pairs: list[tuple[Tensor, Tensor]],
    group: _Group,
    device: torch.device,
    scratch: StepScratch,
) -> None:
    """:func:`update` for many small parameters at once: their slices are packed into one
    workspace and updated by one fused call, with the same per-element arithmetic.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
        >>> opt = PrecisionAwareAdamW(ps, lr=0.5, exp_avg_dtype=torch.bfloat16)
        >>> for p in ps:
        ...     opt.initialize_state(p, False)
        >>> group = {**opt.param_groups[0], "step": 1}
        >>> pairs = [(p, torch.ones(2)) for p in ps]
        >>> update_packed(opt.layout, opt.state, pairs, group, torch.device("cpu"),
        ...               StepScratch())
        >>> ps[2].data
        tensor([-0.5000, -0.5000])
    """
    c = layout.chunk_numel
    buffers = tuple(scratch.get(device, 6 * c).view(6, c).unbind(0))
    step = step_tensor(group["step"], device)
    start = 0
    pack: list[tuple[Tensor, Tensor]] = []
    for param, grad in [*pairs, (None, None)]:
        n = 0 if param is None else local_tensor(param).numel()
        if pack and (param is None or start + n > c):
            _flush_pack(layout, states, pack, group, step, buffers)
            pack, start = [], 0
        if param is not None and grad is not None:
            pack.append((param, grad))
            start += n


class _Pack:
    """The operands of one fused call over packed small parameters, and the copies around it:
    stored values expanded into the workspace before, FP32 results stored back after."""

    def __init__(self, buffers: tuple[Tensor, ...]) -> None:
        self.g_buf, self.m_buf, self.v_buf, self.p_buf, self.t1, self.t2 = buffers
        self.ps: list[Tensor] = []
        self.gs: list[Tensor] = []
        self.ms: list[Tensor] = []
        self.vs: list[Tensor] = []
        self.decode: list[tuple[Tensor, Tensor]] = []  # (fp32 slice, stored)
        self.encode: list[tuple[Tensor, Tensor]] = []  # (stored, fp32 slice)
        self.write_param: list[tuple[Tensor, Tensor]] = []  # (param, fp32 slice)
        self.remainders: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    def add_grad(self, g_flat: Tensor, sl: slice) -> None:
        if g_flat.dtype == torch.float32:
            self.gs.append(g_flat)
        else:
            self.decode.append((self.g_buf[sl], g_flat))
            self.gs.append(self.g_buf[sl])

    def add_moments(self, state: _State, sl: slice) -> None:
        for name, buf, out in (
            ("exp_avg", self.m_buf, self.ms),
            ("exp_avg_sq", self.v_buf, self.vs),
        ):
            stored = state[name].view(-1)
            if stored.dtype == torch.float32:
                out.append(stored)
            else:  # bf16: expanded exactly, re-encoded with round-to-nearest-even
                self.decode.append((buf[sl], stored))
                self.encode.append((stored, buf[sl]))
                out.append(buf[sl])

    def add_param(self, param: Tensor, state: _State, remainder: bool, sl: slice) -> None:
        p_flat = local_tensor(param).view(-1)
        if "master_param" not in state:
            if param.dtype == torch.float32:
                self.ps.append(p_flat)
            else:
                self.decode.append((self.p_buf[sl], p_flat))
                self.write_param.append((p_flat, self.p_buf[sl]))
                self.ps.append(self.p_buf[sl])
        elif remainder:
            rem = state["master_param"].view(-1)
            p_buf = self.p_buf[sl]
            self.ps.append(join_master(p_flat, rem, out=p_buf, scratch=self.t2[sl]))
            self.remainders.append((p_buf, p_flat, rem, self.t1[sl].view(torch.int32)))
        else:
            master = state["master_param"].view(-1)
            self.ps.append(master)
            self.write_param.append((p_flat, master))


def _copy_pairs(pairs: list[tuple[Tensor, Tensor]]) -> None:
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [src for _, src in pairs])


def _flush_pack(
    layout: PrecisionLayout,
    states: Mapping[Tensor, _State],
    pairs: list[tuple[Tensor, Tensor]],
    group: _Group,
    step: Tensor,
    buffers: tuple[Tensor, ...],
) -> None:
    pack = _Pack(buffers)
    offset = 0
    for param, grad in pairs:
        state = states[param]
        k = local_tensor(param).numel()
        sl = slice(offset, offset + k)
        offset += k
        pack.add_grad(local_tensor(grad).reshape(-1), sl)
        pack.add_moments(state, sl)
        pack.add_param(param, state, layout.uses_remainder(param), sl)
    _copy_pairs(pack.decode)
    fused_math(
        pack.ps, pack.gs, pack.ms, pack.vs, group, [step] * len(pack.ps),
        adam_w_mode=layout.adam_w_mode,
    )  # fmt: skip
    _copy_pairs(pack.encode)
    _copy_pairs(pack.write_param)
    for values, p_flat, rem, bits in pack.remainders:
        split_master_into(values, p_flat, rem, scratch=bits)


def direct_views(
    layout: PrecisionLayout, operand: Operand, group: _Group
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(param, grad, exp_avg, exp_avg_sq) when torch's fused kernel can update them as
    stored: FP32 param and moments, or bf16 param, grad and moments (the kernel loads
    bf16 to FP32, updates and stores with round-to-nearest-even: decode -> FP32 update
    -> encode in one pass). None when a master copy or a scaled format is involved.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.uint8)
        >>> opt.initialize_state(p, False)
        >>> direct_views(opt.layout, Operand(p, torch.ones(2), opt.state[p], {}),
        ...              opt.param_groups[0])
    """
    state = operand.state
    p = local_tensor(operand.param)
    g = local_tensor(operand.grad)
    if "master_param" in state or not p.is_contiguous() or g.device != p.device:
        return None
    if not use_fused(layout, p.device, group):
        return None
    if p.dtype not in (torch.float32, torch.bfloat16) or g.dtype != p.dtype:
        return None
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype != p.dtype or v.dtype != p.dtype:
        return None
    return p, g.reshape(p.shape).contiguous(), m, v


# How each state is seen in FP32 during the sliced update: "live" (fp32 storage, in place),
# "chunk" (bf16: expanded and re-encoded per slice), "scaled" (fp16/FP8: expanded per slice
# with the old scale, re-encoded with the new one) or "remainder" (the master is rebuilt per
# slice from the bf16 param and its int16 remainder).
_LIVE, _CHUNK, _SCALED, _REMAINDER = "live", "chunk", "scaled", "remainder"


def _modes(layout: PrecisionLayout, state: _State, param: Tensor) -> dict[str, str]:
    mode: dict[str, str] = {}
    for name in STATE_NAMES:
        if name not in state:
            continue
        dtype = layout.dtype_of(name)
        if name == "master_param" and layout.uses_remainder(param):
            mode[name] = _REMAINDER
        elif dtype == torch.float32:
            mode[name] = _LIVE
        elif codecs.is_scaled(dtype):
            mode[name] = _SCALED
        else:
            mode[name] = _CHUNK
    return mode


class _SlicedUpdate:
    """One parameter's update slice by slice: its flat operands, how each state is seen in
    FP32 (:func:`_modes`), the slice buffers and the group's options."""

    def __init__(
        self,
        layout: PrecisionLayout,
        state: _State,
        scales: _State,
        param: Tensor,
        grad: Tensor,
        group: _Group,
    ) -> None:
        self.p_local = local_tensor(param)
        self.g_flat = local_tensor(grad).reshape(-1)
        self.n = n = self.p_local.numel()
        if self.g_flat.numel() != n:
            raise RuntimeError(
                f"gradient has {self.g_flat.numel()} elements, the parameter has {n} (local shard)"
            )
        self.contiguous = self.p_local.is_contiguous()
        self.p_work = self.p_local if self.contiguous else self.p_local.contiguous()
        self.p_flat = self.p_work.view(-1)
        self.group = group
        self.adam_w_mode = layout.adam_w_mode
        self.beta1, self.beta2 = group["betas"]
        step = group["step"]
        self.bc1 = 1.0 - self.beta1**step if group["bias_correction"] else 1.0
        self.bc2 = 1.0 - self.beta2**step if group["bias_correction"] else 1.0
        self.device = self.p_local.device
        self.lr = lr_operand(group["lr"], self.device)
        self.wd = group["weight_decay"]
        self.eps = group["eps"]
        self.dtypes = {name: layout.dtype_of(name) for name in STATE_NAMES}
        self.mode = _modes(layout, state, param)
        self.flat = {name: state[name].view(-1) for name in self.mode}
        self.fp32_param = param.dtype == torch.float32
        self.master = None if self.fp32_param else self.mode.get("master_param")
        self.m_mode, self.v_mode = self.mode["exp_avg"], self.mode["exp_avg_sq"]
        # A scaled state's new scale needs the amax of its whole updated tensor (TE keeps a
        # full FP32 copy for that). Instead, a first pass computes the update on copies of
        # each slice only to collect the amaxes; the second pass redoes the identical
        # arithmetic for real and encodes with the new scales: memory stays O(chunk_numel).
        self.scaled = [name for name, kind in self.kinds() if kind == _SCALED]
        old = {name: scales[name].clone() for name in self.scaled}
        self.decode_mult = {
            name: codecs.decode_multiplier(old[name], self.dtypes[name]) for name in self.scaled
        }
        self.encode_mult: dict[str, Tensor] = {}
        self.fused_step = None
        if use_fused(layout, self.device, group):
            self.fused_step = step_tensor(step, self.device)
        # Nothing to convert per slice (all FP32 views, FP32 grad): one pass over the tensor.
        self.direct = (
            self.m_mode == self.v_mode == _LIVE
            and (self.master == _LIVE or (self.master is None and self.fp32_param))
            and self.g_flat.dtype == torch.float32
            and self.g_flat.device == self.device
        )
        self.c = max(n, 1) if self.direct else min(layout.chunk_numel, max(n, 1))

    def kinds(self) -> tuple[tuple[str, str | None], ...]:
        """(state name, mode) of the moments and the master as the update reads it."""
        return (
            ("exp_avg", self.m_mode),
            ("exp_avg_sq", self.v_mode),
            ("master_param", self.master),
        )

    def take_buffers(self, scratch: StepScratch) -> None:
        """Six FP32 slice buffers, kept between steps: allocating them afresh costs page
        faults (four slice buffers unless direct, two temporaries unless fused)."""
        b = 0 if self.direct else self.c
        t = self.c if self.fused_step is None or self.master == _REMAINDER else 0
        buf = scratch.get(self.device, 4 * b + 2 * t)
        self.g_buf, self.m_buf, self.v_buf, self.p_buf = (
            buf[i * b : (i + 1) * b] for i in range(4)
        )
        self.t1, self.t2 = buf[4 * b : 4 * b + t], buf[4 * b + t :]
        self.bits_buf = self.t1.view(torch.int32)  # only the remainder split uses it

    def fp32_view(self, name: str, kind: str, s: int, e: int, buf: Tensor, trial: bool) -> Tensor:
        if kind == _LIVE:
            live = self.flat[name][s:e]
            return buf[: e - s].copy_(live) if trial else live
        out = buf[: e - s]
        codecs.decode_into(
            self.flat[name][s:e], out, self.dtypes[name], None,
            multiplier=self.decode_mult.get(name),
        )  # fmt: skip
        return out

    def master_view(self, s: int, e: int, trial: bool) -> Tensor:
        """The FP32 parameter values of the slice: the param itself, a copy, or the master."""
        k = e - s
        if self.master is None:
            live = self.fp32_param and not trial
            return self.p_flat[s:e] if live else self.p_buf[:k].copy_(self.p_flat[s:e])
        if self.master == _REMAINDER:
            return join_master(
                self.p_flat[s:e], self.flat["master_param"][s:e], out=self.p_buf[:k],
                scratch=self.t2[:k],
            )  # fmt: skip
        return self.fp32_view("master_param", self.master, s, e, self.p_buf, trial)

    def update_slice(self, s: int, e: int, trial: bool) -> dict[str, Tensor]:
        """The FP32 update of one slice; ``trial`` leaves all storage untouched."""
        k = e - s
        g = self.g_flat[s:e]
        if g.dtype != torch.float32 or g.device != self.device:
            g = self.g_buf[:k].copy_(g)
        m = self.fp32_view("exp_avg", self.m_mode, s, e, self.m_buf, trial)
        v = self.fp32_view("exp_avg_sq", self.v_mode, s, e, self.v_buf, trial)
        p32 = self.master_view(s, e, trial)
        if self.fused_step is not None:
            fused_math(
                [p32], [g], [m], [v], self.group, [self.fused_step], adam_w_mode=self.adam_w_mode
            )
        else:
            self.te_formula(p32, g, m, v, k)
        return {"exp_avg": m, "exp_avg_sq": v, "master_param": p32}

    def te_formula(self, p32: Tensor, g: Tensor, m: Tensor, v: Tensor, k: int) -> None:
        """TE's update, elementwise, in place on the FP32 slices."""
        wd = self.wd
        if not self.adam_w_mode and wd != 0:
            g = torch.add(g, p32, alpha=wd, out=self.t1[:k])  # never into the caller's grad
        m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = torch.div(v, self.bc2, out=self.t1[:k]).sqrt_().add_(self.eps)
        update = torch.div(m, self.bc1, out=self.t2[:k]).div_(denom)
        if self.adam_w_mode and wd != 0:
            update.add_(p32, alpha=wd)
        p32.sub_(update.mul_(self.lr))

    def new_scales(self) -> dict[str, Tensor]:
        """Pass 1: the new scale of every scaled state, from the amax of its updated values."""
        if not self.scaled:
            return {}
        amax = {name: torch.zeros(1, device=self.device) for name in self.scaled}
        for s, e in codecs.chunk_bounds(self.n, self.c):
            values = self.update_slice(s, e, trial=True)
            for name in self.scaled:
                amax[name] = codecs.combine_amax(amax[name], codecs.amax_of(values[name]))
        return {name: codecs.scale_from_amax(amax[name], self.dtypes[name]) for name in self.scaled}

    def write_slice(self, s: int, e: int, new_scale: Mapping[str, Tensor]) -> None:
        """Pass 2 over one slice: update, then store the parameter and every state."""
        values = self.update_slice(s, e, trial=False)
        flat = self.flat
        # The parameter first: encoding below may scale the FP32 slices in place.
        if self.master == _REMAINDER:
            split_master_into(
                values["master_param"], self.p_flat[s:e], flat["master_param"][s:e],
                scratch=self.bits_buf[: e - s],
            )  # fmt: skip
        elif not self.fp32_param and self.master != _SCALED:
            self.p_flat[s:e].copy_(values["master_param"])  # round-to-nearest-even
        for name, kind in self.kinds():
            if kind in (_CHUNK, _SCALED):
                codecs.encode_into(
                    values[name], flat[name][s:e], self.dtypes[name], new_scale.get(name),
                    overwrite_x=True, multiplier=self.encode_mult.get(name),
                )  # fmt: skip
        if self.master == _SCALED and not self.fp32_param:
            # The parameter is the rounding of the master *as stored* (fp16 with its new
            # scale), not of the FP32 value before encoding: the next step starts from the
            # stored master, so a step that changes nothing (lr=0) leaves the weights alone.
            stored = values["master_param"]  # its FP32 values were consumed by the encode
            dtype = self.dtypes["master_param"]
            codecs.decode_into(
                flat["master_param"][s:e], stored, dtype, None,
                multiplier=codecs.decode_multiplier(new_scale["master_param"], dtype),
            )  # fmt: skip
            self.p_flat[s:e].copy_(stored)

    def sync_fp32_master(self, scales: _State) -> None:
        """TE leaves an fp32 parameter's master untouched; we keep it equal to the param."""
        if self.mode["master_param"] == _LIVE:
            self.flat["master_param"].copy_(self.p_flat)
            return
        dtype = self.dtypes["master_param"]
        scale = codecs.scale_from_amax(codecs.amax_of(self.p_flat), dtype)
        for s, e in codecs.chunk_bounds(self.n, self.c):
            codecs.encode_into(self.p_flat[s:e], self.flat["master_param"][s:e], dtype, scale)
        scales["master_param"].copy_(scale)


def update(layout: PrecisionLayout, operand: Operand, group: _Group, scratch: StepScratch) -> None:
    """One parameter, slice by slice: expand each slice of state to FP32, update, store.

    Args:
        layout: the optimizer's storage layout.
        operand: the parameter (updated in place), its gradient (never modified), its state
            (updated in place) and the scales of its fp16/FP8 states (new values written in).
        group: the param group's options and step count.
        scratch: the step's FP32 workspace.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, exp_avg_dtype=torch.float16)
        >>> opt.initialize_state(p, False)
        >>> group = {**opt.param_groups[0], "step": 1}
        >>> op = Operand(p, torch.tensor([1.0, -1.0]), opt.state[p], opt.scales[p])
        >>> update(opt.layout, op, group, StepScratch())
        >>> p.data
        tensor([-0.5000,  0.5000])
    """
    state, scales = operand.state, operand.scales
    sliced = _SlicedUpdate(layout, state, scales, operand.param, operand.grad, group)
    sliced.take_buffers(scratch)
    new_scale = sliced.new_scales()
    sliced.encode_mult = {
        name: codecs.encode_multiplier(new_scale[name], sliced.dtypes[name])
        for name in sliced.scaled
    }
    for s, e in codecs.chunk_bounds(sliced.n, sliced.c):
        sliced.write_slice(s, e, new_scale)
    for name in sliced.scaled:
        scales[name].copy_(new_scale[name])
    if sliced.fp32_param and "master_param" in state:
        sliced.sync_fp32_master(scales)
    if not sliced.contiguous:
        sliced.p_local.copy_(sliced.p_work)
