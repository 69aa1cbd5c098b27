"""DCP tensors read from their file's mapping: the same bits as DCP's own reader, the
general path kept for what is not stored whole and contiguous, and a clear error for a
truncated data file."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import FileSystemReader

from wrapped_optim.checkpoint import ConversionError, convert
from wrapped_optim.checkpoint._convert._canonical import TensorSpec
from wrapped_optim.checkpoint._convert._dcp_direct import WholeTensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


def _save(tree: dict[str, object], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tree, checkpoint_id=path, no_dist=True)


def _dcp_load(path: Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {key: torch.empty_like(value) for key, value in like.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=path, no_dist=True)
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def _random(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Any bit pattern (NaN payloads included); bools only 0 or 1, their only valid bytes."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape, size), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


@settings(max_examples=12, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 7), max_size=3).map(tuple), min_size=1, max_size=4),
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=4, max_size=4),
    seed=st.integers(0, 2**31 - 1),
)
def test_whole_tensors_read_the_bits_dcp_reads(
    shapes: list[tuple[int, ...]], dtypes: list[torch.dtype], seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    tree = {
        f"t{i}": _random(shape, dtype, generator)
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=False))
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        _save(tree, path)
        whole = WholeTensors(path, FileSystemReader(path).read_metadata())
        expected = _dcp_load(path, tree)
        for key, value in tree.items():
            got = whole.read(key, TensorSpec(value.shape, value.dtype))
            assert got is not None, key
            assert _same_bits(got, expected[key]), key
            assert got.numel() == 0 or got._base is not None  # a view: writers never free it


def test_a_tensor_not_stored_contiguously_takes_dcps_path(tmp_path: Path) -> None:
    transposed = torch.arange(12.0).reshape(3, 4).t()
    _save({"a": transposed, "b": torch.ones(3)}, tmp_path / "ckpt")
    whole = WholeTensors(tmp_path / "ckpt", FileSystemReader(tmp_path / "ckpt").read_metadata())
    assert whole.read("a", TensorSpec((4, 3), torch.float32)) is None
    b = whole.read("b", TensorSpec((3,), torch.float32))
    assert b is not None and b.equal(torch.ones(3))


def test_state_stored_transposed_converts_bit_identically(tmp_path: Path) -> None:
    """An optimizer state whose moments DCP stored non-contiguous (general path) beside
    contiguous ones (direct path): the torch.save result holds the same values."""
    exp_avg = torch.randn(6, 4).t()
    state = {
        "state": {"w": {"step": torch.tensor(3.0), "exp_avg": exp_avg,
                        "exp_avg_sq": torch.rand(4, 6)}},
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.0,
                          "amsgrad": False, "params": ["w"]}],
    }  # fmt: skip
    _save(state, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out.pt", to="torch-save", names=["w"], verify=True)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert loaded["state"][0]["exp_avg"].equal(exp_avg)
    assert loaded["state"][0]["exp_avg_sq"].equal(state["state"]["w"]["exp_avg_sq"])


def test_a_truncated_data_file_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    state = {
        "state": {"w": {"step": torch.tensor(1.0), "momentum_buffer": torch.randn(256, 64)}},
        "param_groups": [{"lr": 0.1, "params": ["w"]}],
    }
    _save(state, tmp_path / "src")
    (data,) = (tmp_path / "src").glob("*.distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"cannot read 'state\.w\.momentum_buffer'"):
        convert(tmp_path / "src", tmp_path / "out.pt", to="torch-save", names=["w"])
    assert not (tmp_path / "out.pt").exists()
