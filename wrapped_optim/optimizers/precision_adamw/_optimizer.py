"""A device-agnostic AdamW with Transformer Engine FusedAdam's precision-aware state.

The class gathers operands: its options become a
``wrapped_optim.optimizers.precision_adamw._layout.PrecisionLayout``, and the step, loading
and format functions (``wrapped_optim.optimizers.precision_adamw._step``,
``wrapped_optim.optimizers.precision_adamw._loading``, ``wrapped_optim._formats.codecs``)
take that layout with explicit tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from wrapped_optim._adapters.dtensor import like_param, local_tensor
from wrapped_optim._formats import blocks as _blocks
from wrapped_optim._formats import state_format
from wrapped_optim._rollback import OptimizerSnapshot
from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks, state_dict_with_hooks
from wrapped_optim.optimizers import _torch_adam_format as _torch_format
from wrapped_optim.optimizers._step_checks import StepOperandError, check_operands, describe_param
from wrapped_optim.optimizers.kernels import cpu_kernel as _cpu_kernel
from wrapped_optim.optimizers.precision_adamw import _loading, _state
from wrapped_optim.optimizers.precision_adamw import _step as _paths
from wrapped_optim.optimizers.precision_adamw._layout import STATE_NAMES, PrecisionLayout
from wrapped_optim.optimizers.precision_adamw._torch_step import StepLock, StepScratch

__all__ = ["PrecisionAwareAdamW"]

_MOMENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
_FP8_ALIASES = {torch.float8_e4m3fn: torch.uint8}


class PrecisionAwareAdamW(torch.optim.Optimizer):
    """AdamW whose state may be stored in bf16, fp16 or FP8, compatible with TE's FusedAdam.

    The update, state API and portable checkpoint format are TE FusedAdam's, in plain torch
    on any device; the defaults of ``lr``, ``betas``, ``eps`` and ``weight_decay`` are
    ``torch.optim.AdamW``'s. See docs/precision_adam.md for the formats and step paths.

    Args:
        params: parameters, or dicts defining parameter groups.
        lr: learning rate (a number or a one-element tensor).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (L2 penalty without ``adam_w_mode``).
        amsgrad: must be False (FusedAdam has no AMSGrad).
        bias_correction: apply Adam's bias correction.
        adam_w_mode: decoupled weight decay (AdamW); False adds it to the gradient (L2).
        capturable: must be False (a CUDA-graph feature of FusedAdam).
        master_weights: keep a master copy of low-precision parameters.
        master_weight_dtype: the master copy's dtype, ``torch.float32`` or ``torch.float16``.
        exp_avg_dtype: storage of the first moment: fp32, fp16, bf16 or FP8 E4M3
            (``torch.uint8``, TE's marker, or ``torch.float8_e4m3fn``, stored as uint8).
        exp_avg_sq_dtype: storage of the second moment, as ``exp_avg_dtype``.
        use_decoupled_grad: read ``param.decoupled_grad`` instead of ``param.grad``.
        store_param_remainders: keep only the low 16 bits of an FP32 master beside a bf16
            parameter (effective with ``master_weights`` and an FP32 master).
        chunk_numel: elements the step expands to FP32 at once.
        fused: torch's fused AdamW kernel for the FP32 update: None where torch has one,
            True required, False TE's elementwise formula.
        cpu_kernel: the compiled CPU kernel for CPU state that needs conversion: None when
            it builds and ``fused`` is not True, True required, False never.
        atomic_step: a step that raises leaves parameters and state as they were.
        maximize: maximize the objective (as ``torch.optim.AdamW``): the step uses the
            negated gradient (a temporary copy of each gradient, one group at a time).
        foreach: accepted for ``torch.optim.AdamW``'s signature and ignored: ``fused`` and
            ``cpu_kernel`` choose how the step runs (every path gives the same update).
        differentiable: must be False (autograd through the step is not supported).
        block_moments: store both moments block-scaled instead of in ``exp_avg_dtype`` /
            ``exp_avg_sq_dtype`` (which then stay FP32): ``"int8"``, ``"fp8"`` (E4M3) or
            ``"int4"`` (16-value tables) codes with one scale per block (see
            docs/precision_adam.md). A step stores each block as it computes it (one pass
            over memory); ``state_dict()`` is the same portable FP32 form.
        block_size: values per block (a power of two from 32 to 2048); default 256 for the
            8-bit formats, 128 for int4.

    Raises:
        RuntimeError: ``amsgrad``, ``capturable`` or ``differentiable``; a master or moment
            dtype FusedAdam rejects; ``cpu_kernel=True`` where the kernel cannot be built.
        ValueError: a negative or non-finite ``lr``, ``eps`` or ``weight_decay``, ``betas``
            outside ``[0, 1)``, a tensor ``lr`` of several elements, ``chunk_numel <= 0``,
            both ``fused`` and ``cpu_kernel`` True; an unknown ``block_moments``, a
            ``block_size`` without it or out of range, ``block_moments`` with a moment
            dtype other than FP32 or with an fp16 master.

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

        Block-scaled 8-bit moments (1 byte per value and a scale per 256 values):

        >>> opt = PrecisionAwareAdamW([p], lr=0.1, block_moments="int8")
        >>> opt.step()
        >>> opt.state[p]["exp_avg"].dtype, opt.get_unscaled_state(p, "exp_avg").tolist()
        (torch.uint8, [0.099609375, 0.099609375, 0.099609375, 0.099609375])
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
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        block_moments: str | None = None,
        block_size: int | None = None,
    ) -> None:
        if differentiable:
            raise RuntimeError(
                "PrecisionAwareAdamW does not support differentiable=True (autograd through "
                "the step); use torch.optim.AdamW(differentiable=True) for that"
            )
        exp_avg_dtype, exp_avg_sq_dtype = _check_options(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            capturable=capturable, master_weights=master_weights,
            master_weight_dtype=master_weight_dtype, exp_avg_dtype=exp_avg_dtype,
            exp_avg_sq_dtype=exp_avg_sq_dtype, chunk_numel=chunk_numel, fused=fused,
            cpu_kernel=cpu_kernel,
        )  # fmt: skip
        block_size = _check_block_options(
            block_moments, block_size, (exp_avg_dtype, exp_avg_sq_dtype),
            master_weight_dtype if master_weights else None,
        )  # fmt: skip
        if block_moments is not None:  # the storage of the codes (TE's dtype vocabulary)
            exp_avg_dtype = exp_avg_sq_dtype = torch.uint8
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
        self.maximize = bool(maximize)
        self.foreach = foreach  # kept for introspection; the step's path ignores it
        self.block_moments = block_moments
        self.block_size = block_size
        self._scales: dict[Tensor, dict[str, Tensor]] = {}
        self._scratch = StepScratch()  # per-thread step workspace, never saved
        self._step_lock = StepLock()  # one step at a time, never saved
        self._pack_small = True  # small parameters share fused calls (tests turn it off)
        self._warned_skipped = False  # the per-group step count warning, once
        # The group index lists of the last state_dict(): a state dict holding these very
        # lists was built from our own in this process (Megatron's loading scaffold).
        self._issued: list[list[int]] = []

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults/state/param_groups; our configuration and
        # scales are part of the optimizer too (copy.deepcopy and pickle must keep them).
        state = self.__dict__.copy()
        state["_scratch"] = StepScratch()
        state["_step_lock"] = StepLock()
        state["_issued"] = []
        return state

    @property
    def layout(self) -> PrecisionLayout:
        """The storage layout the options describe (state dtypes, remainders, kernels).

        Examples:
            >>> import torch
            >>> opt = PrecisionAwareAdamW([torch.zeros(1)], exp_avg_dtype=torch.bfloat16)
            >>> opt.layout.exp_avg_dtype, opt.layout.master_weights
            (torch.bfloat16, False)
        """
        dtypes = self.name_to_dtype_map
        return PrecisionLayout(
            exp_avg_dtype=dtypes["exp_avg"],
            exp_avg_sq_dtype=dtypes["exp_avg_sq"],
            master_weights=self.master_weights,
            master_weight_dtype=dtypes["master_param"],
            store_param_remainders=self.store_param_remainders,
            adam_w_mode=bool(self.adam_w_mode),
            chunk_numel=self.chunk_numel,
            fused=self.fused,
            cpu_kernel=self.cpu_kernel,
            pack_small=self._pack_small,
            block_format=self.block_moments,
            block_size=self.block_size,
        )

    @property
    def scales(self) -> dict[Tensor, dict[str, Tensor]]:
        """Each parameter's per-tensor scales of its fp16/FP8 states (one-element float32
        tensors, live: a step writes new values into them). Never saved: the checkpoint holds
        the unscaled values.

        Examples:
            >>> import torch
            >>> p = torch.nn.Parameter(torch.zeros(2))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_dtype=torch.uint8)
            >>> opt.initialize_state(p, False)
            >>> list(opt.scales[p])
            ['exp_avg']
        """
        return self._scales

    # ------------------------------------------------------------------ state API

    def initialize_state(self, param: Tensor, store_param_remainders: bool) -> None:
        """Create zero moments (and the master copy when ``master_weights``) for ``param``.

        ``store_param_remainders`` is required, as in TE >= 2.1's FusedAdam (so code that
        calls ``initialize_state(p)``, as Megatron-Core's ``init_state_fn`` does, fails here as
        it fails under TE); it must say what this optimizer does for the parameter
        (``opt.layout.uses_remainder(param)``): a contradicting value is rejected.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
            >>> opt = PrecisionAwareAdamW([p], master_weights=True, store_param_remainders=True)
            >>> opt.initialize_state(p, True)
            >>> [(k, v.dtype) for k, v in opt.state[p].items()][2]
            ('master_param', torch.int16)
        """
        uses = self.layout.uses_remainder(param)
        if bool(store_param_remainders) != uses:
            raise ValueError(
                f"store_param_remainders={store_param_remainders} contradicts this optimizer, "
                f"which {'stores' if uses else 'does not store'} remainders for a "
                f"{param.dtype} parameter"
            )
        layout, state = self.layout, self.state[param]
        _state.create(layout, state, self._scales, param, "exp_avg", zero=True)
        _state.create(layout, state, self._scales, param, "exp_avg_sq", zero=True)
        if self.master_weights:
            _state.create(layout, state, self._scales, param, "master_param", zero=False)
            if not uses:
                self.set_scaled_state(param, "master_param", local_tensor(param).detach().float())

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
            >>> opt.initialize_state(p, False)
            >>> opt.get_unscaled_state(p, "exp_avg")
            tensor([0., 0.])
        """
        storage = _state.stored(self.state.get(param), state_name)
        layout = self.layout
        scale = _state.scale_of(layout, self._scales, param, state_name)
        return like_param(param, _state.unscaled(layout, storage, scale, param, state_name))

    def set_scaled_state(self, param: Tensor, state_name: str, unscaled_state: Tensor) -> None:
        """Quantize FP32 values (int16 for a remainder master) into one state of ``param``.

        Allocates the state if absent. The caller's tensor is never modified (FusedAdam's fp16
        path scales it in place). The scale is TE's ``amax / range`` unless the values are
        exactly representable under a neighbouring scale (see ``codecs.exact_scale``),
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
        layout = self.layout
        local = _state.check_source(layout, param, state_name, unscaled_state, "unscaled_state")
        # Slices bound the temporaries; the result does not depend on the slice size.
        _state.encode_into_state(
            layout, self.state[param], self._scales, param, state_name, local.reshape(-1),
            max(self.chunk_numel, 1 << 20),
        )  # fmt: skip

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
        storage = _state.stored(self.state.get(param), state_name)
        layout = self.layout
        scale = _state.scale_of(layout, self._scales, param, state_name)
        _state.read_chunk(layout, storage, scale, param, state_name, start, out)

    def write_scaled_state_chunked(
        self, param: Tensor, state_name: str, source: Tensor, chunk_numel: int
    ) -> None:
        """Quantize ``source`` into one state, moving ``chunk_numel`` elements at a time.

        ``source`` (float32, or int16 for a remainder master) may live on any device; the
        result is bitwise what ``set_scaled_state`` produces, with device temporaries of
        ``O(chunk_numel)`` elements. ``source`` is never modified.

        Examples:
            >>> import torch
            >>> from wrapped_optim.optimizers import PrecisionAwareAdamW
            >>> p = torch.nn.Parameter(torch.zeros(3))
            >>> opt = PrecisionAwareAdamW([p], exp_avg_sq_dtype=torch.float16)
            >>> opt.write_scaled_state_chunked(p, "exp_avg_sq", torch.tensor([1.0, 2.0, 3.0]), 2)
            >>> opt.state[p]["exp_avg_sq"], opt.scales[p]["exp_avg_sq"] * 32752
            (tensor([10920., 21840., 32752.], dtype=torch.float16), tensor([3.]))
        """
        if chunk_numel <= 0:
            raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
        layout = self.layout
        local = _state.check_source(layout, param, state_name, source, "source")
        _state.encode_into_state(
            layout, self.state[param], self._scales, param, state_name, local.reshape(-1),
            chunk_numel,
        )  # fmt: skip

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
        layout = self.layout
        # Every operand is checked before anything is written (state created, counters
        # advanced, parameters updated): a mismatch leaves the optimizer as it was.
        pending = [(group, self._pairs_of(index, group)) for index, group in
                   enumerate(self.param_groups)]  # fmt: skip
        for index, (group, pairs) in enumerate(pending):
            # Every group counts, an empty one too (TE #3318): a group can be empty on some
            # data-parallel ranks only, and the ranks sharing a state shard must agree.
            group["step"] = group.get("step", 0) + 1
            if not group["params"]:
                continue
            if len(pairs) < len(group["params"]):
                self._warn_skipped_once(index, len(group["params"]) - len(pairs), group)
            for p in group["params"]:
                if not self.state.get(p) and (self._grad_of(p) is not None or p.grad is not None):
                    # FusedAdam creates state before it reads the grad: Megatron's dummy step
                    # sets .grad even under use_decoupled_grad and expects state from it.
                    self.initialize_state(p, layout.uses_remainder(p))
            _paths.step_group(
                layout, group, pairs, states=self.state, scales=self._scales,
                scratch=self._scratch, group_index=index,
            )  # fmt: skip

    def _warn_skipped_once(self, index: int, skipped: int, group: dict[str, Any]) -> None:
        """The first time a group steps with params skipped (FP32 state, whose step is
        documented as torch's): their bias correction will differ from torch's."""
        layout = self.layout
        fp32 = layout.exp_avg_dtype == layout.exp_avg_sq_dtype == torch.float32
        if self._warned_skipped or not fp32 or layout.master_weights:
            return
        self._warned_skipped = True
        warnings.warn(
            f"PrecisionAwareAdamW: param group {index} steps with {skipped} of its "
            f"{len(group['params'])} params without a gradient. Steps are counted per group "
            "(FusedAdam's layout), not per parameter as torch.optim.AdamW does: once those "
            "params get a gradient again, their bias correction uses the group's count and "
            "their values differ from torch's (docs/precision_adam.md). Shown once per "
            "optimizer.",
            UserWarning,
            stacklevel=4,
        )

    def _pairs_of(self, group_index: int, group: dict[str, Any]) -> list[tuple[Tensor, Tensor]]:
        """The group's (param, grad) pairs to step, each checked against its state."""
        pairs = []
        layout = self.layout
        for index, p in enumerate(group["params"]):
            grad = self._grad_of(p)
            if grad is None:
                continue  # frozen or unused this step: no state, as torch's optimizers do
            if grad.is_sparse:
                raise RuntimeError("PrecisionAwareAdamW does not support sparse gradients.")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(
                    f"PrecisionAwareAdamW supports fp32, fp16 and bf16 parameters, got {p.dtype}"
                )
            state = {k: v for k, v in self.state.get(p, {}).items() if k in STATE_NAMES}
            if layout.block_format is not None and state:
                problem = _state.check_blocked(layout, state, self._scales.get(p, {}), p)
                if problem is not None:
                    raise StepOperandError(f"{describe_param(group_index, index, p)}: {problem}")
                state = {k: v for k, v in state.items() if not layout.is_blocked(k)}
            check_operands(
                describe_param(group_index, index, p), p, grad,
                {f"state {name!r}": value for name, value in state.items()},
                {f"state {name!r}": layout.storage_dtype(p, name) for name in state},
            )  # fmt: skip
            for name in state:
                if layout.is_scaled(p, name) and name not in self._scales.get(p, {}):
                    raise StepOperandError(
                        f"{describe_param(group_index, index, p)}: state {name!r} is scaled "
                        "but has no scale; load the state through load_state_dict or "
                        "set_scaled_state"
                    )
            pairs.append((p, grad.neg() if self.maximize else grad))
        return pairs

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
        return state_dict_with_hooks(self, self._portable_state_dict)

    def _portable_state_dict(self) -> dict[str, Any]:
        state_dict = _loading.portable_state_dict(
            self.param_groups, self.state, self.get_unscaled_state
        )
        self._issued = [group["params"] for group in state_dict["param_groups"]]
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load FusedAdam's portable format (or torch's Adam/AdamW layout, converted by
        ``wrapped_optim.optimizers.from_torch_adam``), validating everything before the
        first write.

        Every problem (group or parameter count, shapes, remainder vs FP32 master, a missing
        master, unknown state names, non-finite values) raises ``ValueError`` naming the
        parameter index and state, and leaves this optimizer exactly as it was. States are
        then written through ``self.set_scaled_state`` into the existing storage, in slices
        (see ``wrapped_optim.optimizers.precision_adamw._loading``: the extra memory is one
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
        issued, self._issued = self._issued, []  # one load per state_dict() call
        if _loading.issued_by(state_dict, issued):
            holder = (self.layout, self._scales, self.set_scaled_state)
            _loading.load_own_scaffold(self, state_dict, holder)
            return
        if _torch_format.is_torch_adam_layout(state_dict):
            state_dict = _torch_format.from_torch_adam(
                state_dict, adam_w_mode=bool(self.adam_w_mode)
            )
        _loading.load_portable(
            self, state_dict, layout=self.layout, scales=self._scales, write=self.set_scaled_state
        )


def _check_options(
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    capturable: bool,
    master_weights: bool,
    master_weight_dtype: torch.dtype,
    exp_avg_dtype: torch.dtype,
    exp_avg_sq_dtype: torch.dtype,
    chunk_numel: int,
    fused: bool | None,
    cpu_kernel: bool | None,
) -> tuple[torch.dtype, torch.dtype]:
    """FusedAdam's checks of the options (and ours); returns the moment dtypes, with FP8
    E4M3 named ``torch.uint8`` as TE names it."""
    if amsgrad:
        raise RuntimeError("PrecisionAwareAdamW (like FusedAdam) does not support AMSGrad.")
    if master_weights and master_weight_dtype not in (torch.float32, torch.float16):
        raise RuntimeError(
            f"master_weight_dtype must be torch.float32 or torch.float16, got "
            f"{master_weight_dtype} (bf16 masters are rejected, as in FusedAdam)."
        )
    moments = (
        _FP8_ALIASES.get(exp_avg_dtype, exp_avg_dtype),
        _FP8_ALIASES.get(exp_avg_sq_dtype, exp_avg_sq_dtype),
    )
    for name, dtype in zip(("exp_avg_dtype", "exp_avg_sq_dtype"), moments, strict=True):
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
    _check_hyper_parameters(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if chunk_numel <= 0:
        raise ValueError(f"chunk_numel must be positive, got {chunk_numel}")
    _check_kernels(fused, cpu_kernel)
    return moments


def _check_block_options(
    block_moments: str | None,
    block_size: int | None,
    moment_dtypes: tuple[torch.dtype, torch.dtype],
    master_dtype: torch.dtype | None,
) -> int:
    """The block size to use (256 for 8-bit, 128 for int4 unless given), once the block
    options are valid and agree with the others."""
    if block_moments is None:
        if block_size is not None:
            raise ValueError("block_size needs block_moments ('int8', 'fp8' or 'int4')")
        return 256
    if block_moments not in _blocks.BLOCK_FORMATS:
        raise ValueError(
            f"block_moments must be one of {', '.join(map(repr, _blocks.BLOCK_FORMATS))}, got "
            f"{block_moments!r}"
        )
    if any(dtype != torch.float32 for dtype in moment_dtypes):
        raise ValueError(
            f"block_moments={block_moments!r} chooses the storage of both moments; leave "
            f"exp_avg_dtype and exp_avg_sq_dtype at torch.float32 (got {moment_dtypes[0]} and "
            f"{moment_dtypes[1]})"
        )
    if master_dtype is not None and master_dtype != torch.float32:
        raise ValueError(f"block_moments needs an FP32 master copy, got {master_dtype}")
    size = block_size if block_size is not None else (128 if block_moments == "int4" else 256)
    _blocks.BlockFormat(block_moments, size)  # raises for a bad size
    return size


def _check_hyper_parameters(
    *, lr: float | Tensor, betas: tuple[float, float], eps: float, weight_decay: float
) -> None:
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


def _check_kernels(fused: bool | None, cpu_kernel: bool | None) -> None:
    if cpu_kernel and fused:
        raise ValueError("cpu_kernel=True and fused=True ask for two different kernels; pick one")
    if cpu_kernel and not _cpu_kernel.available():
        raise RuntimeError(
            f"cpu_kernel=True, but the CPU AdamW kernel is unavailable: "
            f"{_cpu_kernel.status().reason}. Pass cpu_kernel=None to fall back to torch "
            "ops when it cannot be built."
        )
