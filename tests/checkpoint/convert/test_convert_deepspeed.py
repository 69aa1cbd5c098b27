"""The DeepSpeed universal reader on a checkpoint real DeepSpeed wrote.

tests/fixtures/deepspeed_universal/ was made by tests/fixtures/make_deepspeed_universal.py
(DeepSpeed 0.19.8, CPU accelerator, ZeRO stage 2, then DeepSpeed's own ``ds_to_universal``);
``expected.pt`` holds the engine's own per-parameter state at the save. The reader needs no
DeepSpeed, so this runs everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wrapped_optim.checkpoint import convert
from wrapped_optim.checkpoint._convert._canonical import iter_tensors
from wrapped_optim.checkpoint._convert._deepspeed import (
    DEEPSPEED_UNIVERSAL,
    DeepSpeedUniversalReader,
)

FIXTURE = Path(__file__).parents[2] / "fixtures" / "deepspeed_universal"


def _expected() -> dict[tuple[str, str], torch.Tensor]:
    return torch.load(FIXTURE / "expected.pt", weights_only=True)["state"]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.int32), b.view(torch.int32))
    )


def test_reader_equals_the_engines_state_bitwise() -> None:
    reader = DeepSpeedUniversalReader(FIXTURE)
    index = reader.index()
    assert index.source == DEEPSPEED_UNIVERSAL
    assert [g.names for g in index.groups] == [("0.weight", "0.bias", "1.weight", "1.bias")]
    assert {p.step for p in index.params} == {3.0}
    expected = _expected()
    got = {(name, key): tensor for name, key, tensor in iter_tensors(index, reader)}
    assert got.keys() == expected.keys()
    assert [k for k in got if not _same_bits(got[k], expected[k])] == []
    assert index.groups[0].options["lr"] == 0.01
    reader.close()


def test_universal_to_dcp_loads_into_a_real_torch_adamw_bitwise(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    report = convert(FIXTURE, tmp_path / "dcp", to="dcp", verify=True)
    assert report.source_format == DEEPSPEED_UNIVERSAL and report.lossy == {}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    template = get_optimizer_state_dict(model, optimizer)
    dcp.load(template, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    set_optimizer_state_dict(model, optimizer, template)
    expected = _expected()
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            assert _same_bits(state[key], expected[name, key]), (name, key)
        assert float(state["step"]) == 3.0


def test_reader_names_a_directory_that_is_not_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a DeepSpeed universal checkpoint"):
        DeepSpeedUniversalReader(tmp_path)
