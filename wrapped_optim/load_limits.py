"""How large a loaded value may be for the storage format it ends up in.

A checkpoint holds FP32 (or wider) values; a precision-aware optimizer keeps some states in a
narrower format. A finite value can still overflow on the way: FP32's largest values become
inf in bf16 (whose largest finite value, about 3.3895e38, is below FP32's 3.4028e38), a
float64 value beyond FP32's range becomes inf in FP32, and fp16 storage, whose per-tensor
scale is ``amax / 32752`` (:mod:`wrapped_optim.codecs`), expands FP32's largest value itself
to inf (``32752 * scale`` rounds above it). FP8 E4M3 expands ``448 * (1 / (1 / scale))``,
which stays finite. Every loader rejects such a value before it writes anything (the rule
lives in :func:`wrapped_optim.state_format.check_values`), so a checkpoint never loads as inf.

A leaf module: it imports nothing of the package.
"""

from __future__ import annotations

import torch

__all__ = ["LOADS_AS_INF", "overflow_problem"]

#: Per storage dtype, the smallest magnitude that loads as inf. bf16 and FP32: the midpoint
#: between the largest finite value and the next power of two (round to nearest even sends
#: it up, the largest finite value has an odd significand). fp16 (scaled): FP32's largest
#: value. FP8 E4M3 (``torch.uint8``): values pass through FP32 only.
LOADS_AS_INF: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**128 - 2.0**119,
    torch.float32: 2.0**128 - 2.0**103,
    torch.float16: 2.0**128 - 2.0**104,
    torch.uint8: 2.0**128 - 2.0**103,
}

_NAMES = {
    torch.bfloat16: "bf16",
    torch.float32: "FP32",
    torch.float16: "scaled fp16",
    torch.uint8: "scaled FP8 E4M3",
}
# The largest magnitude that loads finite, for the message.
_LARGEST = {
    torch.bfloat16: 2.0**128 - 2.0**120,
    torch.float32: 2.0**128 - 2.0**104,
    torch.float16: 2.0**128 - 2.0**105,
    torch.uint8: 2.0**128 - 2.0**104,
}


def overflow_problem(amax: float, stored: torch.dtype | None) -> str | None:
    """What is wrong with loading values of largest magnitude ``amax`` into ``stored``
    storage (None: they fit, or the format has no limit, e.g. an int16 remainder).

    Example:
        >>> import torch
        >>> overflow_problem(3.0e38, torch.bfloat16) is None
        True
        >>> print(overflow_problem(3.4e38, torch.bfloat16))  # doctest: +NORMALIZE_WHITESPACE
        has a value of magnitude 3.4e+38, beyond the range of its bf16 storage (it would
        load as inf; magnitudes up to 3.38953139e+38 load)
    """
    limit = LOADS_AS_INF.get(stored) if stored is not None else None
    if stored is None or limit is None or amax < limit:
        return None
    return (
        f"has a value of magnitude {amax:.9g}, beyond the range of its {_NAMES[stored]} "
        f"storage (it would load as inf; magnitudes up to {_LARGEST[stored]:.9g} load)"
    )
