"""How large a loaded value may be for the format it ends up in.

A checkpoint holds FP32 (or wider) values; the optimizer may keep a state in a narrower
format. A finite value can still overflow on the way: FP32's largest values become inf in
bf16 (whose largest finite value, about 3.3895e38, is below FP32's 3.4028e38), a float64
value beyond FP32's range becomes inf in FP32, and so on for any plain cast. A precision-aware
holder's *scaled* formats (:mod:`wrapped_optim._formats.codecs`) take values through FP32 and a
per-tensor scale: fp16, scaled by ``amax / 32752``, expands FP32's largest value itself to inf
(``32752 * scale`` rounds above it); FP8 E4M3 expands ``448 * (1 / (1 / scale))``, which stays
finite. Every loader rejects such a value before it writes it (the rule is applied by
:func:`wrapped_optim._formats.state_format.check_values`), so a checkpoint never loads as inf.

It imports nothing of the package.
"""

from __future__ import annotations

import math

import torch

__all__ = ["loads_as_inf", "overflow_problem"]

_FP32_MAX = torch.finfo(torch.float32).max
_NAMES = {torch.bfloat16: "bf16", torch.float32: "FP32", torch.float16: "fp16"}
_SCALED_NAMES = {torch.float16: "scaled fp16", torch.uint8: "scaled FP8 E4M3"}


def _largest_and_limit(dtype: torch.dtype) -> tuple[float, float]:
    """A float dtype's largest finite value and the smallest magnitude that rounds to inf in
    a cast to it: half an ulp above the largest (a tie rounds to even, which is up, as the
    largest finite value has an odd significand)."""
    largest = torch.finfo(dtype).max
    ulp = torch.finfo(dtype).eps * 2.0 ** (math.frexp(largest)[1] - 1)
    return largest, largest + ulp / 2


def _rule(stored: torch.dtype, scaled: bool) -> tuple[float, float, str] | None:
    """(largest magnitude that loads, smallest that loads as inf, the format's name)."""
    if scaled and stored in _SCALED_NAMES:
        if stored == torch.float16:  # FP32's largest value expands to inf, the one below not
            return 2.0**128 - 2.0**105, _FP32_MAX, _SCALED_NAMES[stored]
        return (*_largest_and_limit(torch.float32), _SCALED_NAMES[stored])
    if not stored.is_floating_point or stored == torch.float64:
        return None
    return (*_largest_and_limit(stored), _NAMES.get(stored, str(stored)))


def loads_as_inf(stored: torch.dtype, *, scaled: bool = False) -> float | None:
    """The smallest magnitude that loads as inf into ``stored`` (a plain cast; with
    ``scaled``, a precision-aware holder's storage, whose fp16 and FP8 are scaled), or None
    where nothing overflows (float64, integers such as an int16 remainder).

    Example:
        >>> import torch
        >>> loads_as_inf(torch.bfloat16) == 2.0**128 - 2.0**119, loads_as_inf(torch.float16)
        (True, 65520.0)
        >>> loads_as_inf(torch.float16, scaled=True) == torch.finfo(torch.float32).max
        True
    """
    rule = _rule(stored, scaled)
    return None if rule is None else rule[1]


def overflow_problem(
    amax: float, stored: torch.dtype | None, *, scaled: bool = False
) -> str | None:
    """What is wrong with loading values of largest magnitude ``amax`` into ``stored``
    (see :func:`loads_as_inf`); None when they fit.

    Example:
        >>> import torch
        >>> overflow_problem(3.0e38, torch.bfloat16) is None
        True
        >>> print(overflow_problem(3.4e38, torch.bfloat16))  # doctest: +NORMALIZE_WHITESPACE
        has a value of magnitude 3.4e+38, beyond the range of its bf16 storage (it would
        load as inf; magnitudes up to 3.38953139e+38 load)
    """
    rule = None if stored is None else _rule(stored, scaled)
    if rule is None or amax < rule[1]:
        return None
    largest, _, name = rule
    return (
        f"has a value of magnitude {amax:.9g}, beyond the range of its {name} storage (it "
        f"would load as inf; magnitudes up to {largest:.9g} load)"
    )
