"""A device-agnostic AdamW with Transformer Engine FusedAdam's precision-aware state.

TE's FusedAdam keeps Adam moments in bf16, fp16 or FP8 and master weights in fp32/fp16 (or as
int16 remainders beside bf16 parameters), and exposes that state through
``get_unscaled_state`` / ``set_scaled_state``, which Megatron drives while checkpointing. TE
needs CUDA. :class:`PrecisionAwareAdamW` keeps the same storage format, API and portable
checkpoint format in plain torch, so it runs on any device, and is the real object the
wrappers of this package are tested against. All format arithmetic lives in
:mod:`wrapped_optim._formats.codecs`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import like_param, local_tensor
from wrapped_optim._formats import codecs, state_format
from wrapped_optim._rollback import OptimizerSnapshot
from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks
from wrapped_optim.optimizers import _precision_loading as _loading
from wrapped_optim.optimizers import _precision_paths as _paths
from wrapped_optim.optimizers import _torch_adam_format as _torch_format
from wrapped_optim.optimizers import _torch_step
from wrapped_optim.optimizers import cpu_kernel as _cpu_kernel

__all__ = ["PrecisionAwareAdamW"]

_STATE_NAMES = ("exp_avg", "exp_avg_sq", "master_param")
_MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_FP8_ALIASES = {torch.float8_e4m3fn: torch.uint8}


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose state may be stored in bf16, fp16 or FP8, compatible with TE's FusedAdam.

    ``lr``, ``betas``, ``eps`` and ``weight_decay`` default to ``torch.optim.AdamW``'s values
    (``weight_decay=0.01``; TE's FusedAdam defaults to 0), so swapping torch's class for this
    one keeps the training recipe. The other constructor keywords, their validation and errors
    follow ``te.optimizers.FusedAdam``: ``master_weights`` keeps an FP32 (or fp16) copy of low-
    precision parameters, ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` pick the moment storage (FP8
    E4M3 is ``torch.uint8``, TE's marker, or ``torch.float8_e4m3fn``: both mean the same and are
    stored as ``torch.uint8``), ``store_param_remainders`` keeps only the low 16 bits of an FP32
    master beside a bf16 parameter, ``use_decoupled_grad`` reads ``param.decoupled_grad``
    instead of ``param.grad``. Ours: ``chunk_numel`` is how many elements the step expands to
    FP32 at once; ``fused`` picks the FP32 update: torch's fused AdamW kernel (``None``: where
    torch has one) or TE's elementwise formula (``False``); ``cpu_kernel`` updates CPU
    parameters whose state needs conversion (bf16, fp16 or FP8 moments beside FP32 params, or
    beside a bf16 param with an FP32 master or remainder) in one pass (two with fp16/FP8
    moments) with the compiled kernel of :mod:`~wrapped_optim.optimizers.cpu_kernel`, dispatched
    by :mod:`~wrapped_optim.optimizers._kernel_step` (TE's formula; ``None``: when it can be
    built and ``fused`` is not ``True``, ``True``: required, ``False``: never);
    ``atomic_step=True`` makes a step all or nothing (a copy of what it changes is kept during
    the step and put back if it raises).

    The update is TE's: with ``adam_w_mode`` (default) ``p -= lr * (m_hat / (sqrt(v_hat) +
    eps) + weight_decay * p)``; otherwise L2 mode adds ``weight_decay * p`` to the gradient.
    ``lr`` may be a tensor. The step count lives in each param group (``group["step"]``).
    ``state_dict()`` is FusedAdam's portable format: FP32 expansions of every state (the raw
    int16 remainder for a remainder master), no scales. ``load_state_dict`` also takes a
    ``torch.optim.AdamW`` / ``Adam`` checkpoint; :func:`~wrapped_optim.optimizers.to_torch_adam`
    turns this optimizer's checkpoint into one torch's AdamW loads.

    Examples:
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
        weight_decay: float = 1e-2,
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
        # torch.float8_e4m3fn names FP8 E4M3 as torch.uint8 (TE's marker) does.
        exp_avg_dtype = _FP8_ALIASES.get(exp_avg_dtype, exp_avg_dtype)
        exp_avg_sq_dtype = _FP8_ALIASES.get(exp_avg_sq_dtype, exp_avg_sq_dtype)
        for name, dtype in (
            ("exp_avg_dtype", exp_avg_dtype),
            ("exp_avg_sq_dtype", exp_avg_sq_dtype),
        ):
            if dtype not in _MOMENT_DTYPES:
                raise RuntimeError(
                    f"{name} must be one of torch.float32, torch.float16, torch.bfloat16 or "
                    f"FP8 E4M3 (torch.uint8 or torch.float8_e4m3fn), got {dtype}."
                )
        if capturable:
            raise RuntimeError(
                "capturable=True (CUDA graphs) is a FusedAdam CUDA feature; PrecisionAwareAdamW "
                "does not support it."
            )
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("a tensor lr must hold exactly one element")
        # The rule every loader applies to a checkpoint's groups (_formats.state_format).
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
        self._scratch = _torch_step.StepScratch()  # per-thread step workspace, never saved
        self._step_lock = _torch_step.StepLock()  # one step at a time, never saved
        self._pack_small = True  # small parameters share fused calls (tests turn it off)

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; our configuration and
        # scales are part of the optimizer too (copy.deepcopy and pickle must keep them).
        state = self.__dict__.copy()
        state["_scratch"] = _torch_step.StepScratch()
        state["_step_lock"] = _torch_step.StepLock()
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

        Examples:
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

        Examples:
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

    def _encode_from(self, param: Tensor, state_name: str, flat: Tensor, chunk_numel: int) -> None:
        """Quantize the flat FP32 (or int16) source into storage, chunk by chunk: into the
        existing storage, unless it is missing or no longer fits (then the old is freed first)."""
        if not self._storage_fits(param, state_name):
            entry = self.state[param]
            if state_name in entry:  # free the old first; the state keeps its place
                entry[state_name] = torch.empty(0)
            self._scales.get(param, {}).pop(state_name, None)
            self._initialize_state(param, state_name, zero_buffer=False)
        storage = self.state[param][state_name]
        out = storage.view(-1)
        dtype = self.name_to_dtype_map[state_name]
        if not self._uses_remainder(param, state_name) and codecs.is_scaled(dtype):
            # Every device temporary within chunk_numel FP32 elements (the staging bound).
            scale = codecs.encode_chunked(flat, out, dtype, chunk_numel)
            self._scales[param][state_name].copy_(scale)
            return
        for s, e in codecs.chunk_bounds(flat.numel(), chunk_numel):
            out[s:e].copy_(flat[s:e])

    def _storage_fits(self, param: Tensor, state_name: str) -> bool:
        """Whether ``param``'s storage of the state exists with the format and shape it needs."""
        storage = self.state[param].get(state_name)
        local = local_tensor(param)
        if self._uses_remainder(param, state_name):
            dtype = torch.int16
        else:
            dtype = self.name_to_dtype_map[state_name]
        if not (
            isinstance(storage, Tensor)
            and storage.dtype == dtype
            and storage.shape == local.shape
            and storage.device == local.device
            and storage.is_contiguous()
        ):
            return False
        return (
            dtype == torch.int16
            or not codecs.is_scaled(dtype)
            or (state_name in self._scales.get(param, {}))
        )

    def set_scaled_state(self, param: Tensor, state_name: str, unscaled_state: Tensor) -> None:
        """Quantize FP32 values (int16 for a remainder master) into one state of ``param``.

        Allocates the state if absent. The caller's tensor is never modified (FusedAdam's fp16
        path scales it in place). The scale is TE's ``amax / range`` unless the values are
        exactly representable under a neighbouring scale (see :func:`codecs.exact_scale`),
        which makes ``set_scaled_state(get_unscaled_state())`` lossless.

        Examples:
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

        Examples:
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

        Examples:
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

        Examples:
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

    # The torch (any device) step paths live in optimizers/torch_step.py; these are the seams
    # step() dispatches through (tests may replace _update on an instance).

    def _fused_math(
        self,
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        group: dict[str, Any],
        steps: list[Tensor],
    ) -> None:
        _torch_step.fused_math(self, params, grads, exp_avgs, exp_avg_sqs, group, steps)

    def _grad_of(self, param: Tensor) -> Tensor | None:
        if self.use_decoupled_grad:
            grad: Tensor | None = getattr(param, "decoupled_grad", None)
            return grad
        return param.grad

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step over every parameter with a gradient (TE's update form).

        Examples:
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
        with self._step_lock:  # a second thread's step waits: scales and moments go together
            self._locked_step()
        return loss

    def _locked_step(self) -> None:
        if not self.atomic_step:
            self._step_groups()
            return
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

    def _step_groups(self) -> None:
        _paths.step_groups(self)  # the path of each parameter: optimizers/precision_paths.py

    def _packable(self, param: Tensor, grad: Tensor, group: dict[str, Any]) -> bool:
        return _torch_step.packable(self, param, grad, group)

    def _update_packed(
        self, pairs: list[tuple[Tensor, Tensor]], group: dict[str, Any], device: torch.device
    ) -> None:
        _torch_step.update_packed(self, pairs, group, device)

    def _direct_views(
        self, param: Tensor, grad: Tensor, group: dict[str, Any]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        return _torch_step.direct_views(self, param, grad, group)

    def _update(self, param: Tensor, grad: Tensor, group: dict[str, Any]) -> None:
        """One parameter whose state needs conversion (see :func:`torch_step.update`)."""
        _torch_step.update(self, param, grad, group)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """FusedAdam's portable checkpoint: torch's layout with every state expanded to FP32.

        Each per-parameter state is obtained through ``self.get_unscaled_state`` (so an
        instance-level patch of that method, e.g. one staging to host, takes effect). A
        remainder master is saved as its raw int16 remainder. Scales are not saved.

        Examples:
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
        return state_dict_with_hooks(self, lambda: _loading.portable_state_dict(self))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FusedAdam's portable format (or torch's Adam/AdamW layout, converted by
        :func:`~wrapped_optim.optimizers.from_torch_adam`), validating everything before the
        first write.

        Every problem (group or parameter count, shapes, remainder vs FP32 master, a missing
        master, unknown state names, non-finite values) raises ``ValueError`` naming the
        parameter index and state, and leaves this optimizer exactly as it was. States are
        then written through ``self.set_scaled_state`` into the existing storage, in slices
        (see :mod:`~wrapped_optim.optimizers._precision_loading`: the extra memory is one
        slice; a load interrupted half-way is completed before the exception propagates);
        the caller's tensors are never modified.

        Examples:
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
        load_state_dict_with_hooks(self, state_dict, self._load_either_layout)

    def _load_either_layout(self, state_dict: dict[str, Any]) -> None:
        if _torch_format.is_torch_adam_layout(state_dict):
            state_dict = _torch_format.from_torch_adam(
                state_dict, adam_w_mode=bool(self.adam_w_mode)
            )
        _loading.load_portable(self, state_dict)
