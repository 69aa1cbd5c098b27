"""torch's state-dict hooks for optimizers that write their own ``state_dict``.

``torch.optim.Optimizer.state_dict`` and ``load_state_dict`` run the hooks registered with
``register_state_dict_pre_hook`` and friends. An optimizer that replaces those methods (to
change the checkpoint format, or to validate before loading) must run them itself, in
torch's order, or its users' hooks silently stop firing. These two functions are that order,
written once for every optimizer and wrapper of this package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["load_state_dict_with_hooks", "state_dict_with_hooks"]


def state_dict_with_hooks(
    optimizer: torch.optim.Optimizer, build: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Pre-hooks, then ``build()``, then post-hooks (a post-hook may return a replacement).

    Example:
        >>> import torch
        >>> from wrapped_optim._state_dict_hooks import state_dict_with_hooks
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> _ = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "tag": 1})
        >>> state_dict_with_hooks(opt, lambda: {"state": {}, "param_groups": []})["tag"]
        1
    """
    for pre_hook in optimizer._optimizer_state_dict_pre_hooks.values():
        pre_hook(optimizer)
    state_dict = build()
    for post_hook in optimizer._optimizer_state_dict_post_hooks.values():
        replaced = post_hook(optimizer, state_dict)
        if replaced is not None:
            state_dict = replaced
    return state_dict


def load_state_dict_with_hooks(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Pre-hooks (each may return a replacement state dict), then ``load``, then post-hooks.

    Example:
        >>> import torch
        >>> from wrapped_optim._state_dict_hooks import load_state_dict_with_hooks
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        >>> seen = []
        >>> _ = opt.register_load_state_dict_pre_hook(lambda o, sd: {**sd, "seen": True})
        >>> load_state_dict_with_hooks(opt, {}, seen.append)
        >>> seen
        [{'seen': True}]
    """
    for pre_hook in optimizer._optimizer_load_state_dict_pre_hooks.values():
        replaced = pre_hook(optimizer, state_dict)
        if replaced is not None:
            state_dict = replaced
    load(state_dict)
    for post_hook in optimizer._optimizer_load_state_dict_post_hooks.values():
        post_hook(optimizer)
