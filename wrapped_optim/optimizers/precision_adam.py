"""A device-agnostic AdamW with Transformer Engine FusedAdam's precision-aware state.

TE's FusedAdam keeps Adam moments in bf16, fp16 or FP8 and master weights in fp32/fp16 (or as
int16 remainders beside bf16 parameters), and exposes that state through
``get_unscaled_state`` / ``set_scaled_state``, which Megatron drives while checkpointing. TE
needs CUDA. :class:`PrecisionAwareAdamW` keeps the same storage format, API and portable
checkpoint format in plain torch, so it runs on any device, and is the real object the
wrappers of this package are tested against. All format arithmetic lives in
:mod:`wrapped_optim.codecs`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from wrapped_optim import codecs, state_format
from wrapped_optim.adapters.dtensor import like_param, local_tensor
from wrapped_optim.optimizers import cpu_kernel as _cpu_kernel
from wrapped_optim.rollback import OptimizerSnapshot
from wrapped_optim.state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks

__all__ = ["PrecisionAwareAdamW"]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
# Devices with torch's fused (single-pass) Adam/AdamW kernels.
_FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu", "hpu")
_MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
# (param, grad, exp_avg, exp_avg_sq, master or None), flat, as the CPU kernel takes them.
_KernelOperands = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose state may be stored in bf16, fp16 or FP8, compatible with TE's FusedAdam.

    Constructor keywords, their validation and errors follow ``te.optimizers.FusedAdam``:
    ``master_weights`` keeps an FP32 (or fp16) copy of low-precision parameters,
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` pick the moment storage (``torch.uint8`` means
    FP8 E4M3), ``store_param_remainders`` keeps only the low 16 bits of an FP32 master beside
    a bf16 parameter, ``use_decoupled_grad`` reads ``param.decoupled_grad`` instead of
    ``param.grad``. Ours: ``chunk_numel`` is how many elements the step expands to FP32 at
    once; ``fused`` picks the FP32 update: torch's fused AdamW kernel (``None``: where torch
    has one) or TE's elementwise formula (``False``); ``cpu_kernel`` updates CPU parameters
    whose state needs conversion (bf16 moments beside FP32 params, a bf16 param with an FP32
    master or remainder) in one pass with the compiled kernel of
    :mod:`~wrapped_optim.optimizers.cpu_kernel` (TE's formula; ``None``: when it can be built
    and ``fused`` is not ``True``, ``True``: required, ``False``: never); ``atomic_step=True``
    makes a step all or nothing (a copy of what it changes is kept during the step and put
    back if it raises).

    The update is TE's: with ``adam_w_mode`` (default) ``p -= lr * (m_hat / (sqrt(v_hat) +
    eps) + weight_decay * p)``; otherwise L2 mode adds ``weight_decay * p`` to the gradient.
    ``lr`` may be a tensor. The step count lives in each param group (``group["step"]``).
    ``state_dict()`` is FusedAdam's portable format: FP32 expansions of every state (the raw
    int16 remainder for a remainder master), no scales.

    Example:
        >>> import torch
        >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
        >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        >>> opt = PrecisionAwareAdamW([p], lr=0.1, master_weights=True,
        ...                           exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.uint8)
        >>> p.grad = torch.ones(4, dtype=torch.bfloat16)
        >>> opt.step()
        >>> p.data
        tensor([0.8984, 0.8984, 0.8984, 0.8984], dtype=torch.bfloat16)
        >>> opt.state[p]["exp_avg_sq"].dtype, opt.get_unscaled_state(p, "exp_avg_sq").dtype
        (torch.uint8, torch.float32)
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        bias_correction: bool = True,
        adam_w_mode: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        master_weight_dtype: torch.dtype = torch.float32,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        use_decoupled_grad: bool = False,
        store_param_remainders: bool = False,
        chunk_numel: int = 1 << 16,
        fused: bool | None = None,
        cpu_kernel: bool | None = None,
        atomic_step: bool = False,
    ) -> None:
        if amsgrad:
            raise RuntimeError("PrecisionAwareAdamW (like FusedAdam) does not support AMSGrad.")
        if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
            raise RuntimeError(
                f"master_weight_dtype must be torch.float32 or torch.float16, got "
                f"{master_weight_dtype} (bf16 masters are rejected, as in FusedAdam)."
            )
        for name, dtype in (
            ("exp_avg_dtype", exp_avg_dtype),
            ("exp_avg_sq_dtype", exp_avg_sq_dtype),
        ):
            if dtype not in _MOMENT_DTYPES:
                raise RuntimeError(
                    f"{name} must be one of torch.float32, torch.float16, torch.bfloat16 or "
                    f"torch.uint8 (FP8 E4M3), got {dtype}."
                )
        if capturable:
            raise RuntimeError(
                "capturable=True (CUDA graphs) is a FusedAdam CUDA feature; PrecisionAwareAdamW "
                "does not support it."
            )
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("a tensor lr must hold exactly one element")
        # The rule every loader applies to a checkpoint's groups (wrapped_optim.state_format).
        for name, value in (
            ("lr", lr),
            ("betas", betas),
            ("eps", eps),
            ("weight_decay", weight_decay),
        ):
            problem = state_format.hyper_parameter_problem(name, value)
            if problem is not None:
                raise ValueError(problem)
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        if cpu_kernel and fused:
            raise ValueError(
                "cpu_kernel=True and fused=True ask for two different kernels; pick one"
            )
        if cpu_kernel and not _cpu_kernel.available():
            raise RuntimeError(
                f"cpu_kernel=True, but the CPU AdamW kernel is unavailable: "
                f"{_cpu_kernel.status().reason}. Pass cpu_kernel=None to fall back to torch "
                "ops when it cannot be built."
            )
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
        }
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = False
        self.master_weights = master_weights
        self.master_weight_dtype = master_weight_dtype
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        self.name_to_dtype_map: dict[str, torch.dtype] = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self.use_decoupled_grad = use_decoupled_grad
        # Effective only for an FP32 master, as in FusedAdam (and then only for bf16 params).
        self.store_param_remainders = (
            store_param_remainders and master_weights and master_weight_dtype == torch.float32
        )
        self.chunk_numel = chunk_numel
        self.fused = fused
        self.cpu_kernel = cpu_kernel
        self.atomic_step = bool(atomic_step)
        self._scales: dict[Tensor, dict[str, Tensor]] = {}
        self._scratch: dict[torch.device, Tensor] = {}  # step workspace, never saved
        self._pack_small = True  # small parameters share fused calls (tests turn it off)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; our configuration and
        # scales are part of the optimizer too (copy.deepcopy and pickle must keep them).
        state = self.__dict__.copy()
        state["_scratch"] = {}
        return state

    # ------------------------------------------------------------------ format helpers

    def _uses_remainder(self, param: Tensor, state_name: str = "master_param") -> bool:
        return (
            self.store_param_remainders
            and state_name == "master_param"
            and param.dtype == torch.bfloat16
        )

    def _check_name(self, state_name: str) -> None:
        if state_name not in self.name_to_dtype_map:
            raise ValueError(
                f"unknown optimizer state {state_name!r}; expected one of {list(_STATE_NAMES)}"
            )

    def _storage(self, param: Tensor, state_name: str) -> Tensor:
        self._check_name(state_name)
        state = self.state.get(param)
        if not state or state_name not in state:
            raise ValueError(f"parameter has no optimizer state {state_name!r} (not initialized)")
        storage: Tensor = state[state_name]
        return storage

    def _scale(self, param: Tensor, state_name: str) -> Tensor | None:
        if self._uses_remainder(param, state_name):
            return None
        if not codecs.is_scaled(self.name_to_dtype_map[state_name]):
            return None
        return self._scales[param][state_name]

    def _expansion_dtype(self, param: Tensor, state_name: str) -> torch.dtype:
        return torch.int16 if self._uses_remainder(param, state_name) else torch.float32

    def _wrap_like(self, param: Tensor, local: Tensor) -> Tensor:
        return like_param(param, local)

    def _initialize_state(self, param: Tensor, state_name: str, zero_buffer: bool) -> None:
        local = local_tensor(param)
        if self._uses_remainder(param, state_name):
            dtype = torch.int16
        else:
            dtype = self.name_to_dtype_map[state_name]
        make = torch.zeros if zero_buffer or dtype == torch.int16 else torch.empty
        self.state[param][state_name] = make(local.shape, dtype=dtype, device=local.device)
        if dtype != torch.int16 and codecs.is_scaled(dtype):
            self._scales.setdefault(param, {})[state_name] = torch.ones(
                1, dtype=torch.float32, device=local.device
            )

    def initialize_state(self, param: Tensor, store_param_remainders: bool | None = None) -> None:
        """Create zero moments (and the master copy when ``master_weights``) for ``param``.

        ``store_param_remainders`` defaults to what this optimizer uses for the parameter
        (FusedAdam takes it positionally; Megatron calls ``initialize_state(p)``); a value that
        contradicts the configuration is rejected.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
            >>> opt = PrecisionAwareAdamW([p], master_weights=True, store_param_remainders=True)
            >>> opt.initialize_state(p)
            >>> [(k, v.dtype) for k, v in opt.state[p].items()][2]
            ('master_param', torch.int16)
        """
        uses = self._uses_remainder(param)
        if store_param_remainders is not None and bool(store_param_remainders) != uses:
            raise ValueError(
                f"store_param_remainders={store_param_remainders} contradicts this optimizer, "
                f"which {'stores' if uses else 'does not store'} remainders for a "
                f"{param.dtype} parameter"
            )
        self._initialize_state(param, "exp_avg", zero_buffer=True)
        self._initialize_state(param, "exp_avg_sq", zero_buffer=True)
        if self.master_weights:
            self._initialize_state(param, "master_param", zero_buffer=False)
            if not uses:
                self.set_scaled_state(param, "master_param", local_tensor(param).detach().float())

    # ------------------------------------------------------------------ state API

    def get_unscaled_state(self, param: Tensor, state_name: str) -> Tensor:
        """The FP32 value of one state of ``param``.

        A fresh expansion for compressed states; the live tensor itself for FP32 states and
        for a remainder master (raw int16), as in FusedAdam. For a DTensor parameter the
        result is a DTensor over the local shard.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.float16)
            >>> opt.initialize_state(p)
            >>> opt.get_unscaled_state(p, "exp_avg")
            tensor([0., 0.])
        """
        storage = self._storage(param, state_name)
        dtype = self.name_to_dtype_map[state_name]
        if self._uses_remainder(param, state_name) or dtype == torch.float32:
            return self._wrap_like(param, storage)
        return self._wrap_like(param, codecs.decode(storage, dtype, self._scale(param, state_name)))

    def _check_source(self, param: Tensor, state_name: str, value: Any, what: str) -> Tensor:
        self._check_name(state_name)
        if state_name == "master_param" and not self.master_weights:
            raise ValueError("'master_param' state needs master_weights=True")
        if not isinstance(value, Tensor):
            raise TypeError(f"{what} for state {state_name!r} must be a tensor, got {type(value)}")
        local = local_tensor(value)
        expected = self._expansion_dtype(param, state_name)
        if local.dtype != expected:
            raise ValueError(
                f"{what} for state {state_name!r} has dtype {local.dtype}, expected {expected}"
            )
        if local.numel() != local_tensor(param).numel():
            raise ValueError(
                f"{what} for state {state_name!r} has {local.numel()} elements, the parameter "
                f"(local shard) has {local_tensor(param).numel()}"
            )
        return local

    def _chunks_of(self, flat: Tensor, chunk_numel: int) -> Callable[[], Iterator[Tensor]]:
        def gen() -> Iterator[Tensor]:
            for s, e in codecs.chunk_bounds(flat.numel(), chunk_numel):
                yield flat[s:e]

        return gen

    def _encode_from(self, param: Tensor, state_name: str, flat: Tensor, chunk_numel: int) -> None:
        """Quantize the flat FP32 (or int16) source into storage, chunk by chunk."""
        if state_name not in self.state[param]:
            self._initialize_state(param, state_name, zero_buffer=False)
        storage = self.state[param][state_name]
        out = storage.view(-1)
        dtype = self.name_to_dtype_map[state_name]
        scale = None
        if not self._uses_remainder(param, state_name) and codecs.is_scaled(dtype):
            scale = codecs.exact_scale(self._chunks_of(flat, chunk_numel), dtype, storage.device)
        for s, e in codecs.chunk_bounds(flat.numel(), chunk_numel):
            chunk = flat[s:e]
            if scale is None:
                out[s:e].copy_(chunk)
            else:
                moved = chunk.to(storage.device)
                codecs.encode_into(moved, out[s:e], dtype, scale, overwrite_x=moved is not chunk)
        if scale is not None:
            self._scales[param][state_name].copy_(scale)

    def set_scaled_state(self, param: Tensor, state_name: str, unscaled_state: Tensor) -> None:
        """Quantize FP32 values (int16 for a remainder master) into one state of ``param``.

        Allocates the state if absent. The caller's tensor is never modified (FusedAdam's fp16
        path scales it in place). The scale is TE's ``amax / range`` unless the values are
        exactly representable under a neighbouring scale (see :func:`codecs.exact_scale`),
        which makes ``set_scaled_state(get_unscaled_state())`` lossless.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
            >>> opt.set_scaled_state(p, "exp_avg", torch.tensor([1.0, 3.0]))
            >>> opt.state[p]["exp_avg"]
            tensor([1., 3.], dtype=torch.bfloat16)
        """
        local = self._check_source(param, state_name, unscaled_state, "unscaled_state")
        # Slices bound the temporaries; the result does not depend on the slice size.
        self._encode_from(param, state_name, local.reshape(-1), max(self.chunk_numel, 1 << 20))

    def read_unscaled_state_chunk(
        self, param: Tensor, state_name: str, start: int, out: Tensor
    ) -> None:
        """Fill ``out`` with flat elements ``[start, start + out.numel())`` of the expansion.

        ``out`` is a contiguous 1-D float32 tensor (int16 for a remainder master) on the
        state's device; nothing larger than ``out`` is allocated. The values are bitwise those
        of ``get_unscaled_state(param, state_name).flatten()[start:...]``.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(4))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.uint8)
            >>> opt.set_scaled_state(p, "exp_avg", torch.tensor([1.0, 2.0, 4.0, 8.0]))
            >>> out = torch.empty(2)
            >>> opt.read_unscaled_state_chunk(p, "exp_avg", 2, out)
            >>> out
            tensor([4., 8.])
        """
        storage = self._storage(param, state_name)
        expected = self._expansion_dtype(param, state_name)
        if out.dtype != expected or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous 1-D {expected} tensor, got {out.dtype} with shape "
                f"{tuple(out.shape)}"
            )
        if out.device != storage.device:
            raise ValueError(f"out is on {out.device}, the state lives on {storage.device}")
        stop = start + out.numel()
        if start < 0 or stop > storage.numel():
            raise ValueError(
                f"chunk [{start}, {stop}) is outside state {state_name!r} of "
                f"{storage.numel()} elements"
            )
        piece = storage.view(-1)[start:stop]
        dtype = self.name_to_dtype_map[state_name]
        if expected == torch.int16 or dtype == torch.float32:
            out.copy_(piece)
        else:
            codecs.decode_into(piece, out, dtype, self._scale(param, state_name))

    def write_scaled_state_chunked(
        self, param: Tensor, state_name: str, source: Tensor, chunk_numel: int
    ) -> None:
        """Quantize ``source`` into one state, moving ``chunk_numel`` elements at a time.

        ``source`` (float32, or int16 for a remainder master) may live on any device; the
        result is bitwise what :meth:`set_scaled_state` produces, with device temporaries of
        ``O(chunk_numel)`` elements. ``source`` is never modified.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(3))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_sq_dtype=torch.float16)
            >>> opt.write_scaled_state_chunked(p, "exp_avg_sq", torch.tensor([1.0, 2.0, 3.0]), 2)
            >>> opt.state[p]["exp_avg_sq"], opt._scales[p]["exp_avg_sq"] * 32752
            (tensor([10920., 21840., 32752.], dtype=torch.float16), tensor([3.]))
        """
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        local = self._check_source(param, state_name, source, "source")
        self._encode_from(param, state_name, local.reshape(-1), chunk_numel)

    # ------------------------------------------------------------------ step

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients (``decoupled_grad`` too when ``use_decoupled_grad``).

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(1))
            >>> opt = PrecisionAwareAdamW([p], use_decoupled_grad=True)
            >>> p.decoupled_grad = torch.ones(1)
            >>> opt.zero_grad()
            >>> p.decoupled_grad is None
            True
        """
        if not self.use_decoupled_grad:
            super().zero_grad(set_to_none=set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if set_to_none:
                    p.decoupled_grad = None
                elif grad is not None:
                    grad.zero_()

    def _fused_math(
        self,
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
        """
        beta1, beta2 = group["betas"]
        fused = torch._fused_adamw_ if self.adam_w_mode else torch._fused_adam_
        fused(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
            eps=group["eps"], amsgrad=False, maximize=False,
        )  # fmt: skip

    def _use_fused(self, device: torch.device, group: dict[str, Any]) -> bool:
        if self.fused is False or not group["bias_correction"]:
            return False
        supported = device.type in _FUSED_DEVICES
        if self.fused and not supported:
            raise RuntimeError(f"fused=True, but torch has no fused AdamW kernel for {device}")
        return supported

    def _scratch_for(self, device: torch.device, numel: int) -> Tensor:
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.float32, device=device)
            self._scratch[device] = buf
        return buf[:numel]

    def _grad_of(self, param: Tensor) -> Tensor | None:
        if self.use_decoupled_grad:
            grad: Tensor | None = getattr(param, "decoupled_grad", None)
            return grad
        return param.grad

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step over every parameter with a gradient (TE's update form).

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], lr=0.5)
            >>> p.grad = torch.tensor([1.0, -1.0])
            >>> opt.step()
            >>> p.data, opt.param_groups[0]["step"]
            (tensor([-0.5000,  0.5000]), 1)
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.atomic_step:
            self._step_groups()
            return loss
        # What a step may change: group counters, params with a grad, their state and scales.
        stepped = [
            p
            for group in self.param_groups
            for p in group["params"]
            if self._grad_of(p) is not None
        ]
        snapshot = OptimizerSnapshot.take(self, stepped)
        try:
            self._step_groups()
        except BaseException:
            snapshot.restore()
            raise
        return loss

    def _step_groups(self) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            # Parameters whose state needs no conversion go to torch's fused kernel together,
            # one call per (device, dtype), as torch.optim.AdamW(fused=True) does.
            batches: dict[tuple[torch.device, torch.dtype], list[tuple[Tensor, ...]]] = {}
            small: dict[torch.device, list[tuple[Tensor, Tensor]]] = {}
            kernel: list[_KernelOperands] = []  # one call for all of them: threads share it
            for p in group["params"]:
                grad = self._grad_of(p)
                if grad is None:
                    continue  # frozen or unused this step: no state, as torch's optimizers do
                if not self.state[p]:
                    self.initialize_state(p)
                if grad.is_sparse:
                    raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients.")
                if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise RuntimeError(
                        "PrecisionAwareAdamW supports fp32, fp16 and bf16 parameters, "
                        f"got {p.dtype}"
                    )
                views = self._direct_views(p, grad, group)
                operands = None if views is not None else self._kernel_operands(p, grad)
                if views is not None:
                    batches.setdefault((views[0].device, views[0].dtype), []).append(views)
                elif operands is not None:
                    kernel.append(operands)
                elif self._packable(p, grad, group):
                    small.setdefault(local_tensor(p).device, []).append((p, grad))
                else:
                    self._update(p, grad, group)
            for (device, _), items in batches.items():
                step = torch.tensor(float(group["step"]), dtype=torch.float32, device=device)
                ps, gs, ms, vs = (list(column) for column in zip(*items, strict=True))
                self._fused_math(ps, gs, ms, vs, group, [step] * len(ps))
            for device, pairs in small.items():
                self._update_packed(pairs, group, device)
            if kernel:
                self._kernel_update(kernel, group)

    def _kernel_on(self) -> bool:
        if self.cpu_kernel is False or (self.cpu_kernel is None and self.fused is True):
            return False
        return _cpu_kernel.available()

    def _kernel_operands(self, param: Tensor, grad: Tensor) -> _KernelOperands | None:
        """Flat (param, grad, exp_avg, exp_avg_sq, master) for the one-pass CPU kernel, or
        None when its formats or layout are not ones the kernel reads."""
        if not self._kernel_on():
            return None
        p, g = local_tensor(param), local_tensor(grad)
        if p.device.type != "cpu" or g.device != p.device or g.numel() != p.numel():
            return None
        state = self.state[param]
        stored = [state["exp_avg"], state["exp_avg_sq"]]
        if any(t.dtype not in (torch.float32, torch.bfloat16) for t in stored):
            return None
        if g.dtype not in (torch.float32, torch.bfloat16):
            return None
        master: Tensor | None = state.get("master_param")
        if p.dtype == torch.float32:
            if master is not None:  # synced after the update; the general path does that
                return None
        elif p.dtype != torch.bfloat16 or master is None:
            return None  # fp16 params, or bf16 params updated in place without a master
        elif master.dtype != torch.float32 and not self._uses_remainder(param):
            return None  # an fp16 master
        if master is not None:
            stored.append(master)
        if not p.is_contiguous() or not all(t.is_contiguous() for t in stored):
            return None
        flat = [t.view(-1) for t in stored]
        return (
            p.view(-1),
            g.reshape(-1).contiguous(),
            flat[0],
            flat[1],
            flat[2] if master is not None else None,
        )

    def _kernel_update(self, operands: list[_KernelOperands], group: dict[str, Any]) -> None:
        ps, gs, ms, vs, masters = (list(column) for column in zip(*operands, strict=True))
        beta1, beta2 = group["betas"]
        step = group["step"]
        correct = group["bias_correction"]
        _cpu_kernel.adamw_step_(
            ps, gs, ms, vs, masters,
            lr=float(group["lr"]), betas=(beta1, beta2), eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction1=1.0 - beta1**step if correct else 1.0,
            bias_correction2=1.0 - beta2**step if correct else 1.0,
            adam_w_mode=bool(self.adam_w_mode),
        )  # fmt: skip

    def _packable(self, param: Tensor, grad: Tensor, group: dict[str, Any]) -> bool:
        """Small parameters whose state needs only per-element conversion (bf16/fp32 moments,
        an fp32 or remainder master) are updated many at a time (one fused call per pack)."""
        p, g = local_tensor(param), local_tensor(grad)
        if not self._pack_small:
            return False
        if p.numel() > self.chunk_numel // 4 or not p.is_contiguous() or g.device != p.device:
            return False
        if not self._use_fused(p.device, group):
            return False
        state = self.state[param]
        for name, storage in state.items():
            if name == "master_param":
                if param.dtype == torch.float32:  # its master is synced after the update
                    return False
                if not self._uses_remainder(param) and storage.dtype != torch.float32:
                    return False
            elif storage.dtype not in (torch.float32, torch.bfloat16):
                return False
        return True

    def _update_packed(
        self, pairs: list[tuple[Tensor, Tensor]], group: dict[str, Any], device: torch.device
    ) -> None:
        """:meth:`_update` for many small parameters at once: their slices are packed into one
        workspace and updated by one fused call, with the same per-element arithmetic."""
        c = self.chunk_numel
        scratch = self._scratch_for(device, 6 * c)
        g_buf, m_buf, v_buf, p_buf, t1, t2 = scratch.view(6, c).unbind(0)
        step = torch.tensor(float(group["step"]), dtype=torch.float32, device=device)
        start = 0
        pack: list[tuple[Tensor, Tensor]] = []
        for param, grad in [*pairs, (None, None)]:
            n = 0 if param is None else local_tensor(param).numel()
            if pack and (param is None or start + n > c):
                self._flush_pack(pack, group, step, (g_buf, m_buf, v_buf, p_buf, t1, t2))
                pack, start = [], 0
            if param is not None and grad is not None:
                pack.append((param, grad))
                start += n

    def _flush_pack(
        self,
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
            state = self.state[param]
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
            elif self._uses_remainder(param):
                rem = state["master_param"].view(-1)
                ps.append(codecs.join_master(p_flat, rem, out=p_buf[sl], scratch=t2[sl]))
                remainders.append((p_buf[sl], p_flat, rem, t1[sl].view(torch.int32)))
            else:
                master = state["master_param"].view(-1)
                ps.append(master)
                write_param.append((p_flat, master))
        if decode:
            torch._foreach_copy_([d for d, _ in decode], [src for _, src in decode])
        self._fused_math(ps, gs, ms, vs, group, [step] * len(ps))
        if encode:
            torch._foreach_copy_([d for d, _ in encode], [src for _, src in encode])
        if write_param:
            torch._foreach_copy_([d for d, _ in write_param], [src for _, src in write_param])
        for values, p_flat, rem, bits in remainders:
            codecs.split_master_into(values, p_flat, rem, scratch=bits)

    def _direct_views(
        self, param: Tensor, grad: Tensor, group: dict[str, Any]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """(param, grad, exp_avg, exp_avg_sq) when torch's fused kernel can update them as
        stored: FP32 param and moments, or bf16 param, grad and moments (the kernel loads
        bf16 to FP32, updates and stores with round-to-nearest-even: decode -> FP32 update
        -> encode in one pass). None when a master copy or a scaled format is involved."""
        p = local_tensor(param)
        g = local_tensor(grad)
        state = self.state[param]
        if "master_param" in state or not p.is_contiguous() or g.device != p.device:
            return None
        if not self._use_fused(p.device, group):
            return None
        if p.dtype not in (torch.float32, torch.bfloat16) or g.dtype != p.dtype:
            return None
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if m.dtype != p.dtype or v.dtype != p.dtype:
            return None
        return p, g.reshape(p.shape).contiguous(), m, v

    def _update(self, param: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """One parameter, slice by slice: expand each slice of state to FP32, update, store."""
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
        state = self.state[param]
        beta1, beta2 = group["betas"]
        step = group["step"]
        bc1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
        bc2 = 1.0 - beta2**step if group["bias_correction"] else 1.0
        lr = group["lr"]
        wd = group["weight_decay"]
        eps = group["eps"]
        device = p_local.device
        dtypes = self.name_to_dtype_map

        # How each state is seen in FP32 during the step: "live" (fp32 storage, in place),
        # "chunk" (bf16: expanded and re-encoded per slice), "scaled" (fp16/FP8: expanded per
        # slice with the old scale, re-encoded with the new one) or "remainder" (the master is
        # rebuilt per slice from the bf16 param and its int16 remainder).
        mode: dict[str, str] = {}
        for name in _STATE_NAMES:
            if name not in state:
                continue
            dtype = dtypes[name]
            if name == "master_param" and self._uses_remainder(param):
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
        old_scale = {name: self._scales[param][name].clone() for name in scaled}
        decode_mult = {n: codecs.decode_multiplier(old_scale[n], dtypes[n]) for n in scaled}
        fused_step = None
        if self._use_fused(device, group):
            fused_step = torch.tensor(float(step), dtype=torch.float32, device=device)

        # Nothing to convert per slice (all FP32 views, FP32 grad): one pass over the tensor.
        direct = (
            m_mode == v_mode == "live"
            and (master == "live" or (master is None and fp32_param))
            and g_flat.dtype == torch.float32
            and g_flat.device == device
        )
        c = max(n, 1) if direct else min(self.chunk_numel, max(n, 1))
        # Six FP32 slice buffers, kept between steps: allocating them afresh costs page faults.
        b = 0 if direct else c  # slice buffers
        t = c if fused_step is None or master == "remainder" else 0  # temporaries
        scratch = self._scratch_for(device, 4 * b + 2 * t)
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
                p32 = codecs.join_master(
                    p_flat[s:e], flat["master_param"][s:e], out=p_buf[:k], scratch=t2[:k]
                )
            else:
                p32 = fp32_view("master_param", master, s, e, p_buf, trial)

            if fused_step is not None:
                self._fused_math([p32], [g], [m], [v], group, [fused_step])
            else:  # TE's form, elementwise
                if not self.adam_w_mode and wd != 0:
                    g = torch.add(g, p32, alpha=wd, out=t1[:k])  # never into the caller's grad
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = torch.div(v, bc2, out=t1[:k]).sqrt_().add_(eps)
                update = torch.div(m, bc1, out=t2[:k]).div_(denom)
                if self.adam_w_mode and wd != 0:
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
                codecs.split_master_into(
                    values["master_param"], p_flat[s:e], flat["master_param"][s:e],
                    scratch=bits_buf[: e - s],
                )  # fmt: skip
            elif not fp32_param:
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

        for name in scaled:
            self._scales[param][name].copy_(new_scale[name])
        if fp32_param and "master_param" in state:
            # TE leaves an fp32 parameter's master untouched; we keep it equal to the param.
            if mode["master_param"] == "live":
                flat["master_param"].copy_(p_flat)
            else:
                dtype = dtypes["master_param"]
                scale = codecs.scale_from_amax(codecs.amax_of(p_flat), dtype)
                for s, e in codecs.chunk_bounds(n, c):
                    codecs.encode_into(p_flat[s:e], flat["master_param"][s:e], dtype, scale)
                self._scales[param]["master_param"].copy_(scale)
        if not contiguous:
            p_local.copy_(p_work)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """FusedAdam's portable checkpoint: torch's layout with every state expanded to FP32.

        Each per-parameter state is obtained through ``self.get_unscaled_state`` (so an
        instance-level patch of that method, e.g. one staging to host, takes effect). A
        remainder master is saved as its raw int16 remainder. Scales are not saved.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.uint8)
            >>> p.grad = torch.ones(2)
            >>> opt.step()
            >>> sd = opt.state_dict()
            >>> sd["state"][0]["exp_avg"].dtype, sd["param_groups"][0]["step"]
            (torch.float32, 1)
        """
        return state_dict_with_hooks(self, self._portable_state_dict)

    def _portable_state_dict(self) -> dict[str, Any]:
        groups = []
        param_index: dict[int, int] = {}
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            indices = []
            for p in group["params"]:
                param_index.setdefault(id(p), len(param_index))
                indices.append(param_index[id(p)])
            packed["params"] = indices
            groups.append(packed)
        state: dict[int, dict[str, Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                entry = self.state.get(p)
                if not entry:
                    continue
                state[param_index[id(p)]] = {
                    name: self.get_unscaled_state(p, name) for name in list(entry)
                }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FusedAdam's portable format, validating everything before the first write.

        Every problem (group or parameter count, shapes, remainder vs FP32 master, a missing
        master, unknown state names, non-finite values) raises ``ValueError`` naming the
        parameter index and state, and leaves this optimizer exactly as it was. States are
        written through ``self.set_scaled_state``; the caller's tensors are never modified.

        Example:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.bfloat16)
            >>> sd = {"state": {0: {"exp_avg": torch.ones(2), "exp_avg_sq": torch.ones(2)}},
            ...       "param_groups": [{**opt.param_groups[0], "params": [0], "step": 3}]}
            >>> opt.load_state_dict(sd)
            >>> opt.state[p]["exp_avg"].dtype, opt.param_groups[0]["step"]
            (torch.bfloat16, 3)
        """
        load_state_dict_with_hooks(self, state_dict, self._load_portable)

    def _load_portable(self, state_dict: dict[str, Any]) -> None:
        resolved, saved_groups = state_format.check_holder_state_dict(self, state_dict)
        new_groups = []
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups, strict=True)):
            merged = {k: v for k, v in group.items() if k != "params"}
            merged.update(
                {k: _copy_value(v) for k, v in saved.items() if k not in ("params", "param_names")}
            )
            if "step" in saved:  # FusedAdam's group step is an int
                merged["step"] = state_format.check_step(f"param group {i}", saved["step"])
            merged["params"] = group["params"]
            if "param_names" in group:
                merged["param_names"] = group["param_names"]
            new_groups.append(merged)
        old = (self.state, self._scales, self.param_groups)
        try:
            self.state = defaultdict(dict)
            self._scales = {}
            self.param_groups = new_groups
            for key, param in resolved.items():
                for name, value in state_dict["state"][key].items():
                    if not self._uses_remainder(param, name) and value.dtype != torch.float32:
                        value = value.float()
                    self.set_scaled_state(param, name, value)
        except BaseException:
            self.state, self._scales, self.param_groups = old
            raise


def _copy_value(value: Any) -> Any:
    """Group hyper-parameters are copied, so the loaded optimizer never aliases the caller's."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    return value
