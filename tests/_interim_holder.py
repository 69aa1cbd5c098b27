"""INTERIM stand-in for issue3's PrecisionAwareAdamW until that branch lands (to be deleted)."""

from __future__ import annotations

from typing import Any

import torch


class InterimPrecisionAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        master_weights: bool = False,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        master_weight_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.master_weights = master_weights
        self.store_param_remainders = store_param_remainders
        self.name_to_dtype_map = {
            "exp_avg": exp_avg_dtype,
            "exp_avg_sq": exp_avg_sq_dtype,
            "master_param": master_weight_dtype,
        }
        self._scales: dict[Any, dict[str, torch.Tensor]] = {}

    def get_unscaled_state(self, param: torch.Tensor, name: str) -> torch.Tensor:
        stored = self.state[param][name]
        dtype = self.name_to_dtype_map[name]
        if dtype == torch.float32:
            return stored
        if dtype == torch.bfloat16:
            return stored.float()
        return stored.float().mul_(self._scales[param][name])

    def set_scaled_state(self, param: torch.Tensor, name: str, value: torch.Tensor) -> None:
        dtype = self.name_to_dtype_map[name]
        value = value.to(param.device)
        if dtype == torch.float16:
            amax = value.abs().max().float()
            scale = torch.where(amax > 0, amax / 32752, torch.ones_like(amax))
            self._scales.setdefault(param, {})[name] = scale
            self.state[param][name] = (value / scale).half().view(param.shape)
        else:
            self.state[param][name] = value.to(dtype).clone().view(param.shape)

    def read_unscaled_state_chunk(
        self, param: torch.Tensor, name: str, start: int, out: torch.Tensor
    ) -> None:
        stored = self.state[param][name].view(-1)[start : start + out.numel()]
        out.copy_(stored)
        if self.name_to_dtype_map[name] == torch.float16:
            out.mul_(self._scales[param][name])

    def write_scaled_state_chunked(
        self, param: torch.Tensor, name: str, source: torch.Tensor, chunk_numel: int
    ) -> None:
        self.set_scaled_state(param, name, source)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    for name in ("exp_avg", "exp_avg_sq"):
                        self.set_scaled_state(p, name, torch.zeros_like(p, dtype=torch.float32))
                    if self.master_weights:
                        self.set_scaled_state(p, "master_param", p.detach().float())
                m = self.get_unscaled_state(p, "exp_avg").clone()
                v = self.get_unscaled_state(p, "exp_avg_sq").clone()
                g = p.grad.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                master = self.get_unscaled_state(p, "master_param") if self.master_weights else None
                target = master.clone() if master is not None else p.detach().float()
                target.sub_(group["lr"] * m / (v.sqrt() + group["eps"]))
                self.set_scaled_state(p, "exp_avg", m)
                self.set_scaled_state(p, "exp_avg_sq", v)
                if self.master_weights:
                    self.set_scaled_state(p, "master_param", target)
                p.copy_(target)
        return None

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.state:
                    sd["state"][index] = {
                        name: self.get_unscaled_state(p, name) for name in self.state[p]
                    }
                index += 1
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, entry in state_dict["state"].items():
            for name, value in entry.items():
                if value.numel() != params[index].numel():
                    raise ValueError(f"param {index} state {name!r} has the wrong size")
        for index, entry in state_dict["state"].items():
            p = params[index]
            self.state[p] = {}
            for name, value in entry.items():
                self.set_scaled_state(p, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
