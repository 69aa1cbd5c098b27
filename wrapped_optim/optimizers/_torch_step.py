"""PrecisionAwareAdamW's torch step paths, on any device (moved out of precision_adam.py).

``step()`` sends each parameter down one of these paths: torch's fused AdamW on the stored
tensors themselves (:func:`direct_views`), many small parameters packed into one fused call
(:func:`packable` / :func:`update_packed`), or one parameter at a time (:func:`update`): the
fused GPU kernel of :mod:`~wrapped_optim.optimizers._fused_gpu` where it applies, else slice by
slice with a two-pass scale update for fp16/FP8 state. The CPU kernel's dispatch lives beside
``step`` in precision_adam.py.

Nothing here waits for the device: the step count reaches a kernel as a device tensor filled
by a kernel (:func:`step_tensor`), never through a host copy or ``.item()``. The FP32
workspace is per thread (:class:`StepScratch`), so two threads stepping one optimizer (on
different parameters) never share a buffer.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import local_tensor
from wrapped_optim._formats import codecs
from wrapped_optim._formats.remainders import join_master, split_master_into
from wrapped_optim.optimizers import _fused_gpu

if TYPE_CHECKING:
    from wrapped_optim.optimizers._precision_adam import PrecisionAwareAdamW

__all__ = [
    "StepScratch",
    "direct_views",
    "fused_math",
    "lr_operand",
    "packable",
    "step_tensor",
    "update",
    "update_packed",
]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
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
    opt: PrecisionAwareAdamW,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    group: dict[str, Any],
    steps: list[Tensor],
) -> None:
    """torch's single-pass AdamW (L2 Adam without ``adam_w_mode``) kernel.

    Algebraically TE's update (``p * (1 - lr * wd) - lr * step`` is ``p - lr * (step +
    wd * p)``); the rounding of the FP32 arithmetic differs in the last bits.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, torch_step
        >>> p = torch.zeros(2)
        >>> opt = PrecisionAwareAdamW([torch.nn.Parameter(p)], lr=0.5)
        >>> m, v, step = torch.zeros(2), torch.zeros(2), torch.ones(())
        >>> torch_step.fused_math(opt, [p], [torch.tensor([1.0, -1.0])], [m], [v],
        ...                       opt.param_groups[0], [step])
        >>> p
        tensor([-0.5000,  0.5000])
    """
    beta1, beta2 = group["betas"]
    lr = lr_operand(group["lr"], params[0].device) if params else group["lr"]
    fused = torch._fused_adamw_ if opt.adam_w_mode else torch._fused_adam_
    fused(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
        eps=group["eps"], amsgrad=False, maximize=False,
    )  # fmt: skip


def _use_fused(opt: PrecisionAwareAdamW, device: torch.device, group: dict[str, Any]) -> bool:
    if opt.fused is False or not group["bias_correction"]:
        return False
    supported = device.type in _FUSED_DEVICES
    if opt.fused and not supported:
        raise RuntimeError(f"fused=True, but torch has no fused AdamW kernel for {device}")
    return supported


def _scratch_for(opt: PrecisionAwareAdamW, device: torch.device, numel: int) -> Tensor:
    """This thread's FP32 step workspace of ``opt`` on ``device``, at least ``numel`` long."""
    scratch: StepScratch = opt._scratch
    return scratch.get(device, numel)


def packable(opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]) -> bool:
    """Small parameters whose state needs only per-element conversion (bf16/fp32 moments,
    an fp32 or remainder master) are updated many at a time (one fused call per pack),
    unless the fused GPU kernels update them (with their whole group, no conversion passes).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, torch_step
        >>> p = torch.nn.Parameter(torch.zeros(8))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16, chunk_numel=64)
        >>> opt.initialize_state(p)
        >>> torch_step.packable(opt, p, torch.ones(8), opt.param_groups[0])
        True
    """
    p, g = local_tensor(param), local_tensor(grad)
    if not opt._pack_small or _fused_gpu.applicable(opt, param, grad, group):
        return False
    if p.numel() > opt.chunk_numel // 4 or not p.is_contiguous() or g.device != p.device:
        return False
    if not _use_fused(opt, p.device, group):
        return False
    state = opt.state[param]
    for name, storage in state.items():
        if name == "master_param":
            if param.dtype == torch.float32:  # its master is synced after the update
                return False
            if not opt._uses_remainder(param) and storage.dtype != torch.float32:
                return False
        elif storage.dtype not in (torch.float32, torch.bfloat16):
            return False
    return True


def update_packed(
    opt: PrecisionAwareAdamW,
    pairs: list[tuple[Tensor, Tensor]],
    group: dict[str, Any],
    device: torch.device,
) -> None:
    """:func:`update` for many small parameters at once: their slices are packed into one
    workspace and updated by one fused call, with the same per-element arithmetic.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, torch_step
        >>> ps = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
        >>> opt = PrecisionAwareAdamW(ps, lr=0.5, exp_avg_dtype=torch.bfloat16)
        >>> for p in ps:
        ...     opt.initialize_state(p)
        >>> opt.param_groups[0]["step"] = 1
        >>> pairs = [(p, torch.ones(2)) for p in ps]
        >>> torch_step.update_packed(opt, pairs, opt.param_groups[0], torch.device("cpu"))
        >>> ps[2].data
        tensor([-0.5000, -0.5000])
    """
    c = opt.chunk_numel
    scratch = _scratch_for(opt, device, 6 * c)
    g_buf, m_buf, v_buf, p_buf, t1, t2 = scratch.view(6, c).unbind(0)
    step = step_tensor(group["step"], device)
    start = 0
    pack: list[tuple[Tensor, Tensor]] = []
    for param, grad in [*pairs, (None, None)]:
        n = 0 if param is None else local_tensor(param).numel()
        if pack and (param is None or start + n > c):
            _flush_pack(opt, pack, group, step, (g_buf, m_buf, v_buf, p_buf, t1, t2))
            pack, start = [], 0
        if param is not None and grad is not None:
            pack.append((param, grad))
            start += n


def _flush_pack(
    opt: PrecisionAwareAdamW,
    pack: list[tuple[Tensor, Tensor]],
    group: dict[str, Any],
    step: Tensor,
    buffers: tuple[Tensor, ...],
) -> None:
    g_buf, m_buf, v_buf, p_buf, t1, t2 = buffers
    ps: list[Tensor] = []
    gs: list[Tensor] = []
    ms: list[Tensor] = []
    vs: list[Tensor] = []
    decode: list[tuple[Tensor, Tensor]] = []  # (fp32 slice, stored)
    encode: list[tuple[Tensor, Tensor]] = []  # (stored, fp32 slice)
    write_param: list[tuple[Tensor, Tensor]] = []  # (param, fp32 slice)
    remainders: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
    offset = 0
    for param, grad in pack:
        state = opt.state[param]
        p_flat = local_tensor(param).view(-1)
        g_flat = local_tensor(grad).reshape(-1)
        k = p_flat.numel()
        sl = slice(offset, offset + k)
        offset += k
        if g_flat.dtype == torch.float32:
            gs.append(g_flat)
        else:
            decode.append((g_buf[sl], g_flat))
            gs.append(g_buf[sl])
        for name, buf, out in (("exp_avg", m_buf, ms), ("exp_avg_sq", v_buf, vs)):
            stored = state[name].view(-1)
            if stored.dtype == torch.float32:
                out.append(stored)
            else:  # bf16: expanded exactly, re-encoded with round-to-nearest-even
                decode.append((buf[sl], stored))
                encode.append((stored, buf[sl]))
                out.append(buf[sl])
        if "master_param" not in state:
            if param.dtype == torch.float32:
                ps.append(p_flat)
            else:
                decode.append((p_buf[sl], p_flat))
                write_param.append((p_flat, p_buf[sl]))
                ps.append(p_buf[sl])
        elif opt._uses_remainder(param):
            rem = state["master_param"].view(-1)
            ps.append(join_master(p_flat, rem, out=p_buf[sl], scratch=t2[sl]))
            remainders.append((p_buf[sl], p_flat, rem, t1[sl].view(torch.int32)))
        else:
            master = state["master_param"].view(-1)
            ps.append(master)
            write_param.append((p_flat, master))
    if decode:
        torch._foreach_copy_([d for d, _ in decode], [src for _, src in decode])
    fused_math(opt, ps, gs, ms, vs, group, [step] * len(ps))
    if encode:
        torch._foreach_copy_([d for d, _ in encode], [src for _, src in encode])
    if write_param:
        torch._foreach_copy_([d for d, _ in write_param], [src for _, src in write_param])
    for values, p_flat, rem, bits in remainders:
        split_master_into(values, p_flat, rem, scratch=bits)


def direct_views(
    opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(param, grad, exp_avg, exp_avg_sq) when torch's fused kernel can update them as
    stored: FP32 param and moments, or bf16 param, grad and moments (the kernel loads
    bf16 to FP32, updates and stores with round-to-nearest-even: decode -> FP32 update
    -> encode in one pass). None when a master copy or a scaled format is involved.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, torch_step
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.uint8)
        >>> opt.initialize_state(p)
        >>> torch_step.direct_views(opt, p, torch.ones(2), opt.param_groups[0]) is None
        True
    """
    p = local_tensor(param)
    g = local_tensor(grad)
    state = opt.state[param]
    if "master_param" in state or not p.is_contiguous() or g.device != p.device:
        return None
    if not _use_fused(opt, p.device, group):
        return None
    if p.dtype not in (torch.float32, torch.bfloat16) or g.dtype != p.dtype:
        return None
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype != p.dtype or v.dtype != p.dtype:
        return None
    return p, g.reshape(p.shape).contiguous(), m, v


def update(opt: PrecisionAwareAdamW, param: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
    """One parameter: the fused GPU kernel where it applies, else slice by slice (expand each
    slice of state to FP32, update, store).

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW, torch_step
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> opt = PrecisionAwareAdamW([p], lr=0.5, exp_avg_dtype=torch.float16)
        >>> opt.initialize_state(p)
        >>> opt.param_groups[0]["step"] = 1
        >>> torch_step.update(opt, p, torch.tensor([1.0, -1.0]), opt.param_groups[0])
        >>> p.data
        tensor([-0.5000,  0.5000])
    """
    if _fused_gpu.applicable(opt, param, grad, group):
        _fused_gpu.update(opt, param, grad, group)
        return
    p_local = local_tensor(param)
    g_flat = local_tensor(grad).reshape(-1)
    n = p_local.numel()
    if g_flat.numel() != n:
        raise RuntimeError(
            f"gradient has {g_flat.numel()} elements, the parameter has {n} (local shard)"
        )
    contiguous = p_local.is_contiguous()
    p_work = p_local if contiguous else p_local.contiguous()
    p_flat = p_work.view(-1)
    state = opt.state[param]
    beta1, beta2 = group["betas"]
    step = group["step"]
    bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
    device = p_local.device
    lr = lr_operand(group["lr"], device)
    wd = group["weight_decay"]
    eps = group["eps"]
    dtypes = opt.name_to_dtype_map

    # How each state is seen in FP32 during the step: "live" (fp32 storage, in place),
    # "chunk" (bf16: expanded and re-encoded per slice), "scaled" (fp16/FP8: expanded per
    # slice with the old scale, re-encoded with the new one) or "remainder" (the master is
    # rebuilt per slice from the bf16 param and its int16 remainder).
    mode: dict[str, str] = {}
    for name in _STATE_NAMES:
        if name not in state:
            continue
        dtype = dtypes[name]
        if name == "master_param" and opt._uses_remainder(param):
            mode[name] = "remainder"
        elif dtype == torch.float32:
            mode[name] = "live"
        elif codecs.is_scaled(dtype):
            mode[name] = "scaled"
        else:
            mode[name] = "chunk"
    flat = {name: state[name].view(-1) for name in mode}
    fp32_param = param.dtype == torch.float32
    master = None if fp32_param else mode.get("master_param")
    m_mode, v_mode = mode["exp_avg"], mode["exp_avg_sq"]
    # A scaled state's new scale needs the amax of its whole updated tensor (TE keeps a
    # full FP32 copy for that). Instead, a first pass computes the update on copies of
    # each slice only to collect the amaxes; the second pass redoes the identical
    # arithmetic for real and encodes with the new scales: memory stays O(chunk_numel).
    scaled = [
        name
        for name, kind in (
            ("exp_avg", m_mode),
            ("exp_avg_sq", v_mode),
            ("master_param", master),
        )
        if kind == "scaled"
    ]
    old_scale = {name: opt._scales[param][name].clone() for name in scaled}
    decode_mult = {n: codecs.decode_multiplier(old_scale[n], dtypes[n]) for n in scaled}
    fused_step = None
    if _use_fused(opt, device, group):
        fused_step = step_tensor(step, device)

    # Nothing to convert per slice (all FP32 views, FP32 grad): one pass over the tensor.
    direct = (
        m_mode == v_mode == "live"
        and (master == "live" or (master is None and fp32_param))
        and g_flat.dtype == torch.float32
        and g_flat.device == device
    )
    c = max(n, 1) if direct else min(opt.chunk_numel, max(n, 1))
    # Six FP32 slice buffers, kept between steps: allocating them afresh costs page faults.
    b = 0 if direct else c  # slice buffers
    t = c if fused_step is None or master == "remainder" else 0  # temporaries
    scratch = _scratch_for(opt, device, 4 * b + 2 * t)
    g_buf, m_buf, v_buf, p_buf = (scratch[i * b : (i + 1) * b] for i in range(4))
    t1, t2 = scratch[4 * b : 4 * b + t], scratch[4 * b + t :]
    bits_buf = t1.view(torch.int32)  # only the remainder split uses it, t1 is free then

    def fp32_view(name: str, kind: str, s: int, e: int, buf: Tensor, trial: bool) -> Tensor:
        if kind == "live":
            live = flat[name][s:e]
            return buf[: e - s].copy_(live) if trial else live
        out = buf[: e - s]
        codecs.decode_into(
            flat[name][s:e], out, dtypes[name], None, multiplier=decode_mult.get(name)
        )
        return out

    def update_slice(s: int, e: int, trial: bool) -> dict[str, Tensor]:
        """The FP32 update of one slice; ``trial`` leaves all storage untouched."""
        k = e - s
        g = g_flat[s:e]
        if g.dtype != torch.float32 or g.device != device:
            g = g_buf[:k].copy_(g)
        m = fp32_view("exp_avg", m_mode, s, e, m_buf, trial)
        v = fp32_view("exp_avg_sq", v_mode, s, e, v_buf, trial)
        if master is None:
            live = fp32_param and not trial
            p32 = p_flat[s:e] if live else p_buf[:k].copy_(p_flat[s:e])
        elif master == "remainder":
            p32 = join_master(p_flat[s:e], flat["master_param"][s:e], out=p_buf[:k], scratch=t2[:k])
        else:
            p32 = fp32_view("master_param", master, s, e, p_buf, trial)

        if fused_step is not None:
            fused_math(opt, [p32], [g], [m], [v], group, [fused_step])
        else:  # TE's form, elementwise
            if not opt.adam_w_mode and wd != 0:
                g = torch.add(g, p32, alpha=wd, out=t1[:k])  # never into the caller's grad
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = torch.div(v, bc2, out=t1[:k]).sqrt_().add_(eps)
            update = torch.div(m, bc1, out=t2[:k]).div_(denom)
            if opt.adam_w_mode and wd != 0:
                update.add_(p32, alpha=wd)
            p32.sub_(update.mul_(lr))
        return {"exp_avg": m, "exp_avg_sq": v, "master_param": p32}

    new_scale: dict[str, Tensor] = {}
    if scaled:
        amax = {name: torch.zeros(1, device=device) for name in scaled}
        for s, e in codecs.chunk_bounds(n, c):
            values = update_slice(s, e, trial=True)
            for name in scaled:
                amax[name] = codecs.combine_amax(amax[name], codecs.amax_of(values[name]))
        new_scale = {name: codecs.scale_from_amax(amax[name], dtypes[name]) for name in scaled}
    encode_mult = {n: codecs.encode_multiplier(new_scale[n], dtypes[n]) for n in scaled}

    for s, e in codecs.chunk_bounds(n, c):
        values = update_slice(s, e, trial=False)
        # The parameter first: encoding below may scale the FP32 slices in place.
        if master == "remainder":
            split_master_into(
                values["master_param"], p_flat[s:e], flat["master_param"][s:e],
                scratch=bits_buf[: e - s],
            )  # fmt: skip
        elif not fp32_param and master != "scaled":
            p_flat[s:e].copy_(values["master_param"])  # round-to-nearest-even
        for name, kind in (
            ("exp_avg", m_mode),
            ("exp_avg_sq", v_mode),
            ("master_param", master),
        ):
            if kind in ("chunk", "scaled"):
                codecs.encode_into(
                    values[name], flat[name][s:e], dtypes[name], new_scale.get(name),
                    overwrite_x=True, multiplier=encode_mult.get(name),
                )  # fmt: skip
        if master == "scaled" and not fp32_param:
            # The parameter is the rounding of the master *as stored* (fp16 with its new
            # scale), not of the FP32 value before encoding: the next step starts from the
            # stored master, so a step that changes nothing (lr=0) leaves the weights alone.
            stored = values["master_param"]  # its FP32 values were consumed by the encode
            dtype = dtypes["master_param"]
            codecs.decode_into(
                flat["master_param"][s:e], stored, dtype, None,
                multiplier=codecs.decode_multiplier(new_scale["master_param"], dtype),
            )  # fmt: skip
            p_flat[s:e].copy_(stored)

    for name in scaled:
        opt._scales[param][name].copy_(new_scale[name])
    if fp32_param and "master_param" in state:
        # TE leaves an fp32 parameter's master untouched; we keep it equal to the param.
        if mode["master_param"] == "live":
            flat["master_param"].copy_(p_flat)
        else:
            dtype = dtypes["master_param"]
            scale = codecs.scale_from_amax(codecs.amax_of(p_flat), dtype)
            for s, e in codecs.chunk_bounds(n, c):
                codecs.encode_into(p_flat[s:e], flat["master_param"][s:e], dtype, scale)
            opt._scales[param]["master_param"].copy_(scale)
    if not contiguous:
        p_local.copy_(p_work)
