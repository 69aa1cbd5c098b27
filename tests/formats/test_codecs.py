"""wrapped_optim._formats.codecs against an independent reference built from the format definitions.

The reference uses numpy and integer bit arithmetic only (no torch casts): bf16 by integer
round-to-nearest-even, fp16 by numpy's IEEE half cast, FP8 E4M3 from a table of its 256 code
points, remainders by explicit 16-bit arithmetic.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.cpu_peak import SLACK, peak_cpu_bytes
from wrapped_optim._formats import codecs, remainders

F32 = np.float32

# ----------------------------------------------------------------------------- reference


def ref_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 bits to their high 16 bits."""
    bits = x.astype(F32).view(np.uint32).astype(np.uint64)
    bias = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + bias) >> 16).astype(np.uint16)


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * (man / 8.0) * 2.0 ** (1 - 7)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


E4M3_POS = np.array([_e4m3_value(c) for c in range(0x7F)], dtype=np.float64)  # 0 .. 448
E4M3_MID = (E4M3_POS[:-1] + E4M3_POS[1:]) / 2.0


def ref_e4m3_codes(y: np.ndarray) -> np.ndarray:
    """Saturating round-to-nearest-even into E4M3 codes (y already scaled, float32)."""
    y = y.astype(np.float64)
    mag = np.minimum(np.abs(y), 448.0)
    idx = np.searchsorted(E4M3_MID, mag, side="left")  # number of midpoints < mag
    tie = (idx < len(E4M3_MID)) & (E4M3_MID[np.minimum(idx, len(E4M3_MID) - 1)] == mag)
    idx = np.where(tie & (idx % 2 == 1), idx + 1, idx)  # ties go to the even code
    codes = idx.astype(np.uint8) | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return codes


def ref_scale(x: np.ndarray, rng: float) -> np.float32:
    amax = F32(np.max(np.abs(x))) if x.size else F32(0)
    return F32(amax / F32(rng))


def ref_multiplier(scale: np.float32) -> np.float32:
    """1/scale, or 0 for a zero scale or one whose reciprocal overflows (documented guard)."""
    if scale == 0 or not np.isfinite(scale):
        return F32(0) if scale == 0 or np.isnan(scale) else F32(1) / scale
    with np.errstate(over="ignore"):
        r = F32(1) / scale
    return r if np.isfinite(r) else F32(0)


def ref_encode_fp16(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    scale = ref_scale(x, 32752.0)
    r = ref_multiplier(scale)
    return (x.astype(F32) * r).astype(np.float16), scale


def ref_decode_fp16(stored: np.ndarray, scale: np.float32) -> np.ndarray:
    return stored.astype(F32) * scale


def ref_encode_fp8(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    scale = ref_scale(x, 448.0)
    q = ref_multiplier(scale)
    return ref_e4m3_codes(x.astype(F32) * q), scale


def ref_decode_fp8(codes: np.ndarray, scale: np.float32) -> np.ndarray:
    q = ref_multiplier(scale)
    dm = F32(1) / q if q > 0 else F32(0)
    vals = np.array([_e4m3_value(int(c) & 0x7F) for c in codes], dtype=np.float64)
    vals = np.where(codes & 0x80, -vals, vals).astype(F32)
    return vals * dm


def ref_split(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    b = bits.astype(np.uint32).astype(np.int64)
    hi = b >> 16
    lo = b & 0xFFFF
    hi = np.where(lo >= 0x8000, (hi + 1) & 0xFFFF, hi)
    nan = (b & 0x7FFFFFFF) > 0x7F800000  # the bf16 quiet NaN, remainder 0
    return np.where(nan, 0x7FC0, hi).astype(np.uint16), np.where(nan, 0, lo).astype(np.uint16)


def ref_join(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    h = hi.astype(np.int64)
    low = lo.astype(np.int64)
    h = np.where(low >= 0x8000, (h - 1) & 0xFFFF, h)
    return ((h << 16) | low).astype(np.uint32)


# ----------------------------------------------------------------------------- strategies

special = st.sampled_from(
    [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4e38, -3.4e38, 1.0, -1.0, 65504.0, 448.0]
)
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
values = st.lists(st.one_of(finite32, special), min_size=1, max_size=64)


def t(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def bits32(x: torch.Tensor) -> np.ndarray:
    return x.numpy().view(np.uint32)


# ----------------------------------------------------------------------------- tests


@given(values)
def test_bf16_matches_integer_rne(xs: list[float]) -> None:
    x = t(xs)
    stored, scale = codecs.encode(x, torch.bfloat16)
    assert scale is None
    assert np.array_equal(
        stored.view(torch.int16).numpy().view(np.uint16), ref_bf16_bits(x.numpy())
    )
    back = codecs.decode(stored, torch.bfloat16)
    expected = (ref_bf16_bits(x.numpy()).astype(np.uint32) << 16).view(F32)
    assert np.array_equal(bits32(back), expected.view(np.uint32))


@given(values)
def test_fp16_matches_reference(xs: list[float]) -> None:
    x = t(xs)
    stored, scale = codecs.encode(x, torch.float16)
    ref_stored, ref_sc = ref_encode_fp16(x.numpy())
    assert scale is not None
    assert scale.view(torch.int32).item() == np.array([ref_sc]).view(np.int32)[0]
    assert np.array_equal(stored.numpy().view(np.uint16), ref_stored.view(np.uint16))
    back = codecs.decode(stored, torch.float16, scale)
    with np.errstate(over="ignore"):
        expected = ref_decode_fp16(ref_stored, ref_sc)
    assert np.array_equal(bits32(back), expected.view(np.uint32))
    assert not back.isnan().any()  # finite inputs never decode to NaN


@given(values)
def test_fp8_matches_reference(xs: list[float]) -> None:
    x = t(xs)
    stored, scale = codecs.encode(x, torch.uint8)
    ref_codes, ref_sc = ref_encode_fp8(x.numpy())
    assert stored.dtype == torch.uint8 and scale is not None
    assert scale.item() == ref_sc or (scale.item() == 0 and ref_sc == 0)
    # Zero and negative zero codes: compare magnitudes and signs of nonzero values only.
    got = stored.numpy()
    assert np.array_equal(got, ref_codes), (got, ref_codes)
    back = codecs.decode(stored, torch.uint8, scale)
    with np.errstate(over="ignore"):
        expected = ref_decode_fp8(ref_codes, ref_sc)
    assert np.array_equal(bits32(back), expected.view(np.uint32))
    assert not back.isnan().any()  # finite inputs never decode to NaN


@given(values, st.integers(1, 17), st.sampled_from(codecs.STORAGE_DTYPES))
def test_chunked_equals_whole(xs: list[float], chunk: int, dtype: torch.dtype) -> None:
    x = t(xs)
    whole, scale = codecs.encode(x, dtype)
    amax = torch.zeros(1)
    for s, e in codecs.chunk_bounds(x.numel(), chunk):
        amax = codecs.combine_amax(amax, codecs.amax_of(x[s:e]))
    assert torch.equal(amax.view(torch.int32), codecs.amax_of(x).view(torch.int32))
    out = torch.empty(x.numel(), dtype=dtype)
    for s, e in codecs.chunk_bounds(x.numel(), chunk):
        codecs.encode_into(x[s:e].clone(), out[s:e], dtype, scale, overwrite_x=True)
    assert torch.equal(out.view(torch.uint8), whole.view(torch.uint8))
    dec = torch.full((x.numel(),), float("nan"))
    for s, e in codecs.chunk_bounds(x.numel(), chunk):
        codecs.decode_into(out[s:e], dec[s:e], dtype, scale)
    assert torch.equal(dec.view(torch.int32), codecs.decode(whole, dtype, scale).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_all_zero_gives_zeros_never_nan(dtype: torch.dtype, zero: float) -> None:
    x = torch.full((7,), zero)
    stored, scale = codecs.encode(x, dtype)
    assert scale is not None and scale.item() == 0.0
    back = codecs.decode(stored, dtype, scale)
    assert torch.equal(back, torch.zeros(7)) and not back.isnan().any()
    assert torch.equal(torch.signbit(back), torch.signbit(x))  # the sign of zero survives


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_poisons_scaled_tensor(dtype: torch.dtype, bad: float) -> None:
    """Documented: one inf/NaN makes the per-tensor scale non-finite; all decode to NaN."""
    x = torch.tensor([1.0, bad, -2.0])
    stored, scale = codecs.encode(x, dtype)
    back = codecs.decode(stored, dtype, scale)
    assert back.isnan().all()


def test_bf16_keeps_non_finite_per_element() -> None:
    x = torch.tensor([1.0, float("inf"), float("-inf"), float("nan")])
    back = codecs.decode(codecs.encode(x, torch.bfloat16)[0], torch.bfloat16)
    assert back[0] == 1.0 and back[1] == float("inf") and back[2] == float("-inf")
    assert back[3].isnan()


def test_fp8_saturates_under_a_precomputed_scale() -> None:
    x = torch.tensor([1000.0, -1000.0, 1.0])
    out = torch.empty(3, dtype=torch.uint8)
    codecs.encode_into(x, out, torch.uint8, torch.tensor([1.0]))
    back = codecs.decode(out, torch.uint8, torch.tensor([1.0]))
    assert back.tolist() == [448.0, -448.0, 1.0]


def test_torch_cpu_fp8_cast_saturates_like_te() -> None:
    """What the codec's clamp relies on nowhere but states: on torch 2.13's CPU, the E4M3 cast
    itself saturates finite out-of-range values and +-inf to +-448 and keeps NaN (no NaN for
    out-of-range values, as the codec's comment once said)."""
    x = torch.tensor([449.0, 1e4, float("inf"), -1e4, float("-inf"), float("nan"), 448.0])
    back = x.to(torch.float8_e4m3fn).float()
    assert back[:5].tolist() == [448.0, 448.0, 448.0, -448.0, -448.0]
    assert back[5].isnan() and back[6] == 448.0


@given(
    st.lists(
        st.floats(-9.999999933815813e36, 9.999999933815813e36, width=32)
        | special.filter(lambda v: abs(v) < 1e37),
        min_size=1,
    ),
    st.sampled_from([torch.float16, torch.uint8]),
)
def test_exact_scale_makes_reload_lossless(xs: list[float], dtype: torch.dtype) -> None:
    """Expanded state re-encodes to the same bits (values within 1e37: a stored value next to
    FLT_MAX can expand to inf, which no format round-trips)."""
    x = t(xs)
    stored, scale = codecs.encode(x, dtype)
    expanded = codecs.decode(stored, dtype, scale)
    again, scale2 = codecs.encode(expanded, dtype, exact=True)
    assert scale2 is not None
    redecoded = codecs.decode(again, dtype, scale2)
    assert torch.equal(redecoded.view(torch.int32), expanded.view(torch.int32))
    assert torch.equal(again.view(torch.uint8), stored.view(torch.uint8))


@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64))
def test_remainder_split_join_bit_arithmetic(ints: list[int]) -> None:
    bits = np.array(ints, dtype=np.int64).astype(np.uint32)
    master = torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    hi, rem = remainders.split_master(master)
    ref_hi, ref_lo = ref_split(bits)
    assert np.array_equal(hi.view(torch.int16).numpy().view(np.uint16), ref_hi)
    assert np.array_equal(rem.numpy().view(np.uint16), ref_lo)
    # every value comes back bit for bit; a NaN as the quiet NaN (its payload is dropped)
    nan = master.isnan()
    want = torch.where(nan, torch.tensor(0x7FC00000, dtype=torch.int32), master.view(torch.int32))
    joined = remainders.join_master(hi, rem)
    assert torch.equal(joined.view(torch.int32), want)
    into = torch.full_like(master, 7.0)
    remainders.join_master(hi, rem, out=into)  # the allocation-free forms used by the step
    assert torch.equal(into.view(torch.int32), want)
    into.fill_(7.0)
    remainders.join_master(hi, rem, out=into, scratch=torch.empty(len(ints), dtype=torch.int32))
    assert torch.equal(into.view(torch.int32), want)
    hi2, rem2 = torch.empty_like(hi), torch.empty_like(rem)
    remainders.split_master_into(
        master, hi2, rem2, scratch=torch.empty(len(ints), dtype=torch.int32)
    )
    assert torch.equal(hi2.view(torch.int16), hi.view(torch.int16)) and torch.equal(rem2, rem)
    assert np.array_equal(ref_join(ref_hi, ref_lo), want.numpy().view(np.uint32))


def test_a_nan_master_shows_as_nan_in_its_bf16_parameter() -> None:
    """The quiet NaN CUDA arithmetic produces (0x7FFFFFFF) would round to the bf16 -0.0: the
    model would see a zero where its master is NaN. Every NaN splits into the bf16 quiet NaN
    and remainder 0, and joins back to a NaN."""
    bits = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000, 0x7F800001, 0xFFFF8000],
                        dtype=torch.int64).to(torch.int32)  # fmt: skip
    master = bits.view(torch.float32)
    hi, rem = remainders.split_master(master)
    assert hi.isnan().all() and hi.view(torch.int16).eq(0x7FC0).all() and rem.eq(0).all()
    assert remainders.join_master(hi, rem).isnan().all()
    param = torch.full((5,), 1.0, dtype=torch.bfloat16)
    rem2 = torch.full((5,), 3, dtype=torch.int16)
    remainders.split_master_into(master, param, rem2, scratch=torch.empty(5, dtype=torch.int32))
    assert torch.equal(param.view(torch.int16), hi.view(torch.int16)) and torch.equal(rem2, rem)
    # finite neighbours are untouched: the largest finite and inf keep their exact split
    edge = torch.tensor([3.4028234663852886e38, float("inf"), -float("inf")])
    assert torch.equal(remainders.join_master(*remainders.split_master(edge)), edge)


@given(st.lists(finite32, min_size=1, max_size=32))
def test_remainder_param_is_nearest_bf16_by_magnitude(xs: list[float]) -> None:
    x = t(xs)
    hi, _ = remainders.split_master(x)
    # Candidates: truncation toward zero and one bf16 step away from zero.
    trunc = (x.view(torch.int32) >> 16).to(torch.int16)
    down = trunc.view(torch.bfloat16).double()
    up = (trunc + 1).view(torch.bfloat16).double()
    ok = torch.isfinite(up)
    got = hi.double()
    assert torch.equal(got[ok] == down[ok], (got[ok] != up[ok]) | (down[ok] == up[ok]))
    err = (got - x.double()).abs()
    other = torch.where(got == down, up, down)
    assert (err[ok] <= (other - x.double()).abs()[ok]).all()


def test_encode_leaves_input_untouched_and_checks_arguments() -> None:
    x = torch.tensor([3.0, -1.5])
    before = x.clone()
    for dtype in codecs.STORAGE_DTYPES:
        codecs.encode(x, dtype)
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="unsupported storage dtype"):
        codecs.encode(x, torch.int8)
    with pytest.raises(ValueError, match="needs the tensor's scale"):
        codecs.encode_into(x, torch.empty(2, dtype=torch.float16), torch.float16)
    with pytest.raises(ValueError, match="float32"):
        codecs.encode(x.double(), torch.float16)
    with pytest.raises(ValueError, match="chunk_numel"):
        list(codecs.chunk_bounds(3, 0))


# ----------------------------------------------------------------------------- bounds


@given(
    n=st.integers(0, 3000),
    chunk=st.integers(1, 700),
    dtype=st.sampled_from([torch.float16, torch.uint8]),
    seed=st.integers(0, 2**16),
    exact=st.booleans(),
)
def test_chunked_encode_gives_encodes_bits(
    n: int, chunk: int, dtype: torch.dtype, seed: int, exact: bool
) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 7
    if exact:  # values that are an expansion of stored state: the lossless scale applies
        stored, stored_scale = codecs.encode(x, dtype)
        x = codecs.decode(stored, dtype, stored_scale)
    want, want_scale = codecs.encode(x, dtype, exact=True)
    out = torch.empty(n, dtype=dtype)
    before = x.clone()
    scale = codecs.encode_chunked(x, out, dtype, chunk)
    assert torch.equal(out, want) and torch.equal(scale, want_scale)
    assert torch.equal(x, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
def test_chunked_encode_and_write_stay_within_one_chunk(dtype: torch.dtype) -> None:
    """Every temporary of a chunked write together fits in ``4 * chunk_numel`` bytes (plus,
    on a CPU, FP8 decoding's fixed gather index); it used to be 2.5-3.3 chunks."""
    from wrapped_optim.optimizers import PrecisionAwareAdamW

    n, chunk = 200_000, 8192
    stored, stored_scale = codecs.encode(torch.randn(n), dtype)
    source = codecs.decode(stored, dtype, stored_scale)
    out = torch.empty(n, dtype=dtype)
    block = 4 * chunk // codecs.ENCODE_BYTES_PER_ELEMENT
    index = 4 * min(block, codecs.GATHER_BLOCK) if dtype == torch.uint8 else 0
    bound = 4 * chunk + index + SLACK
    assert peak_cpu_bytes(lambda: codecs.encode_chunked(source, out, dtype, chunk)) <= bound
    p = torch.nn.Parameter(torch.zeros(n))
    opt = PrecisionAwareAdamW([p], exp_avg_dtype=dtype)
    opt.initialize_state(p, opt.layout.uses_remainder(p))
    write = lambda: opt.write_scaled_state_chunked(p, "exp_avg", source, chunk)  # noqa: E731
    assert peak_cpu_bytes(write) <= bound
    assert torch.equal(opt.get_unscaled_state(p, "exp_avg"), source)  # and it is lossless


def test_fp8_decode_holds_no_index_of_the_tensors_size() -> None:
    n = 200_000
    stored, scale = codecs.encode(torch.randn(n), torch.uint8)
    out = torch.empty(n)
    peak = peak_cpu_bytes(lambda: codecs.decode_into(stored, out, torch.uint8, scale))
    assert peak <= 4 * codecs.GATHER_BLOCK + SLACK  # was 4 * n (an int32 index of it all)
    stored_view = stored.view(torch.float8_e4m3fn)
    assert torch.equal(out, stored_view.float() * codecs.decode_multiplier(scale, torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
def test_decode_into_across_devices(dtype: torch.dtype) -> None:
    """Storage on one device, ``out`` on another: the storage is moved first (the FP8 table
    gather used to mix devices). 'meta' stands in for the second device here."""
    stored, scale = codecs.encode(torch.randn(64), dtype)
    out = torch.empty(64, device="meta")
    codecs.decode_into(stored, out, dtype, scale)
    assert out.device.type == "meta"
    back = torch.empty(64)
    codecs.decode_into(stored.to("meta"), back.to("meta"), dtype, scale)


def test_the_scale_is_a_division_by_a_device_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Divided by a Python number, CUDA multiplies by the reciprocal (one ulp off TE's
    division for some amaxes); the divisor must be a tensor on amax's device."""
    divisors: list[object] = []
    real_div = torch.div

    def spy(a: torch.Tensor, b: object, **kw: object) -> torch.Tensor:
        divisors.append(b)
        return real_div(a, b, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "div", spy)
    amax = torch.tensor([3.0e-3])
    for dtype in (torch.float16, torch.uint8):
        scale = codecs.scale_from_amax(amax, dtype)
        want = np.float32(np.float64(3.0e-3).astype(F32) / codecs.storage_range(dtype))
        assert scale.item() == float(want)
    assert divisors and all(
        isinstance(b, torch.Tensor) and b.device == amax.device for b in divisors
    )
