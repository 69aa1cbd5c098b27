/*
 * Part of _adamw_cpu.c (included there, after the portable conversions and loops it mirrors;
 * not a header of its own).
 */
/*
 * Hand-written AVX-512 loops for the split loop's scaled (fp16/FP8) moment combinations.
 *
 * GCC vectorizes the portable loops above 64 elements a step (the width of the FP8 bytes) at
 * about nine instructions per element, most of them widening, mask shuffles and register
 * moves around the arithmetic. These loops also take 64 elements a step, as four vectors of
 * 16 FP32 lanes (masked for the tail), and use the hardware where it gives the same bits:
 * - fp16 <-> FP32 by F16C's conversions (round to nearest even; a NaN re-encoded as the quiet
 *   NaN 0x7E00 with its sign, as the portable code);
 * - an FP8 code decoded through two 128-byte tables (AVX512-VBMI's two-register byte permute)
 *   holding the fp16 bits of every E4M3 magnitude (all of them, subnormals included, are
 *   normal fp16 numbers), then F16C: exact, and no subnormal FP32 operand (Intel CPUs take a
 *   ~150-cycle microcode assist for each instruction that reads one);
 * - an FP8 code encoded by rounding the saturated magnitude with the FP32 adder against
 *   c = 2^(max(exponent, -6) + 20): the sum keeps 3 mantissa bits (multiples of 2^-9 below
 *   2^-6), ties to even, and its bits minus c's are the rounded mantissa.
 * The Adam arithmetic is the portable loop's, operation for operation, so every result is
 * bitwise the portable loop's; the tests compare the two over every format combination.
 * CPUs with AVX-512 but without VBMI (Skylake-SP, Cascade Lake) run the AVX2 loops of
 * _adamw_cpu_avx2.h instead; a build with -DWO_NO_VECTOR_LOOPS (cpu_kernel's fallback for a
 * compiler that cannot build these intrinsics) has neither and runs the portable loops.
 */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(WO_NO_CLONES) && \
    !defined(WO_NO_VECTOR_LOOPS)
#define WO_AVX512 1
#include <immintrin.h>
#define WO_AVX512_FN \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))
#define WO_AVX512_INLINE static inline __attribute__((always_inline)) WO_AVX512_FN

/* fp16 bits of every E4M3 magnitude code (0x7F: the quiet NaN 0x7E00), split in bytes. */
static uint8_t wo_e4m3_f16_low[128] __attribute__((aligned(64)));
static uint8_t wo_e4m3_f16_high[128] __attribute__((aligned(64)));

/* Byte order in which 64 codes are looked up so that unpacking the two table results into
 * words leaves the four groups of 16 in order (unpack works within 128-bit lanes). */
static const uint8_t wo_unpack_order[64] __attribute__((aligned(64))) = {
    0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
    8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
    16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
    24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
/* And the reverse: the byte order of four groups of 16 codes packed with saturation. */
static const uint8_t wo_pack_order[64] __attribute__((aligned(64))) = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

static void wo_fill_e4m3_tables(void) {
    for (int c = 0; c < 128; ++c) {
        uint16_t h = f32_to_f16(e4m3_to_f32((uint8_t)c));
        wo_e4m3_f16_low[c] = (uint8_t)(h & 0xFFu);
        wo_e4m3_f16_high[c] = (uint8_t)(h >> 8);
    }
}

/* Lanes [0, left) of a step, for 64 bytes or one group of 16. */
static inline __attribute__((always_inline)) __mmask64 v_bytes(int64_t left) {
    return left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
}
static inline __attribute__((always_inline)) __mmask16 v_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1u));
}

/* 64 moment values in FP32, four groups of 16 (stored value times the decode multiplier). */
WO_AVX512_INLINE void v_decode64(const void *base, int64_t i, int kind, int64_t left,
                                 __m512 mult, __m512 out[4]) {
    if (kind == KIND_FP8) {
        const __m512i low0 = _mm512_load_si512(wo_e4m3_f16_low);
        const __m512i low1 = _mm512_load_si512(wo_e4m3_f16_low + 64);
        const __m512i high0 = _mm512_load_si512(wo_e4m3_f16_high);
        const __m512i high1 = _mm512_load_si512(wo_e4m3_f16_high + 64);
        __m512i c = _mm512_maskz_loadu_epi8(v_bytes(left), (const uint8_t *)base + i);
        c = _mm512_permutexvar_epi8(_mm512_load_si512(wo_unpack_order), c);
        __m512i low = _mm512_permutex2var_epi8(low0, c, low1);  /* low 7 bits index */
        __m512i high = _mm512_permutex2var_epi8(high0, c, high1);
        /* high | (c & 0x80): the sign */
        high = _mm512_ternarylogic_epi32(high, c, _mm512_set1_epi8((char)0x80), 0xF8);
        __m512i words0 = _mm512_unpacklo_epi8(low, high), words1 = _mm512_unpackhi_epi8(low, high);
        out[0] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(words0)), mult);
        out[1] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(words0, 1)), mult);
        out[2] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(words1)), mult);
        out[3] = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(words1, 1)), mult);
        return;
    }
    for (int j = 0; j < 4; ++j) {
        const __mmask16 k = v_lanes(left - 16 * j);
        const int64_t at = i + 16 * j;
        if (kind == KIND_FP32) {
            out[j] = _mm512_maskz_loadu_ps(k, (const float *)base + at);
        } else if (kind == KIND_BF16) {
            __m512i w = _mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + at));
            out[j] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
        } else {
            __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)base + at);
            out[j] = _mm512_mul_ps(_mm512_cvtph_ps(h), mult);
        }
    }
}

/* The E4M3 code (sign in bit 7) of x * mult saturated to +-448, in 32-bit lanes; nan: 0
 * where no lane can be NaN (the block loops), else NaN lanes take 0x7F with their sign. */
WO_AVX512_INLINE __m512i v_e4m3_code(__m512 x, __m512 mult, const int nan) {
    __m512 y = _mm512_mul_ps(x, mult);
    __m512i bits = _mm512_castps_si512(y);
    /* min(|y|, 448) (the smaller magnitude, sign cleared); a NaN lane's code is replaced
     * below (the range instruction returns the other operand for a quiet NaN) */
    __m512 a = _mm512_range_ps(y, _mm512_set1_ps(448.0f), 0x0A);
    __m512i e = _mm512_max_epu32(
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(0x7F800000)),
        _mm512_set1_epi32(121 << 23));
    __m512i c = _mm512_add_epi32(e, _mm512_set1_epi32(20 << 23));
    __m512i sum = _mm512_castps_si512(_mm512_add_ps(a, _mm512_castsi512_ps(c)));
    /* mantissa (8 + m for a normal code, m below 2^-6) plus 8 * (exponent + 6) */
    __m512i code = _mm512_add_epi32(
        _mm512_sub_epi32(sum, c),
        _mm512_sub_epi32(_mm512_srli_epi32(e, 20), _mm512_set1_epi32(968)));
    if (nan)
        code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q),
                                     _mm512_set1_epi32(0x7F));
    /* code | (bits >> 24 & 0x80) */
    return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80),
                                     0xF8);
}

/* Stores 64 new moment values (four groups of 16) in their format. */
WO_AVX512_INLINE void v_encode64(void *base, int64_t i, int kind, int64_t left,
                                 const __m512 x[4], __m512 mult) {
    if (kind == KIND_FP8) {
        __m512i c0 = v_e4m3_code(x[0], mult, 1), c1 = v_e4m3_code(x[1], mult, 1);
        __m512i c2 = v_e4m3_code(x[2], mult, 1), c3 = v_e4m3_code(x[3], mult, 1);
        /* codes are 0..255: the saturating packs keep them; then one permute to order */
        __m512i packed = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1),
                                             _mm512_packus_epi32(c2, c3));
        packed = _mm512_permutexvar_epi8(_mm512_load_si512(wo_pack_order), packed);
        _mm512_mask_storeu_epi8((uint8_t *)base + i, v_bytes(left), packed);
        return;
    }
    for (int j = 0; j < 4; ++j) {
        const __mmask16 k = v_lanes(left - 16 * j);
        const int64_t at = i + 16 * j;
        if (kind == KIND_FP32) {
            _mm512_mask_storeu_ps((float *)base + at, k, x[j]);
        } else if (kind == KIND_BF16) {
            __m512i u = _mm512_castps_si512(x[j]);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
            __mmask16 nan = _mm512_cmp_ps_mask(x[j], x[j], _CMP_UNORD_Q);
            r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
            _mm512_mask_cvtepi32_storeu_epi16((uint16_t *)base + at, k, r);
        } else {
            __m512 y = _mm512_mul_ps(x[j], mult);
            __m256i h = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
            /* a NaN keeps its sign and the quiet bit, drops the payload: 0x7E00 | sign */
            h = _mm256_mask_blend_epi16(nan, h,
                                        _mm256_and_si256(h, _mm256_set1_epi16((short)0xFE00)));
            _mm256_mask_storeu_epi16((uint16_t *)base + at, k, h);
        }
    }
}

/* The hyper-parameters and multipliers, broadcast once per call. */
typedef struct {
    __m512 lr, b1, omb1, b2, omb2, eps, wd, inv_bc1, inv_bc2, m_dec, v_dec, m_enc, v_enc;
} v_consts;

WO_AVX512_INLINE v_consts v_broadcast(const wo_tensor *t, const wo_hyper *h) {
    v_consts c = {_mm512_set1_ps(h->lr),          _mm512_set1_ps(h->beta1),
                  _mm512_set1_ps(h->one_minus_beta1), _mm512_set1_ps(h->beta2),
                  _mm512_set1_ps(h->one_minus_beta2), _mm512_set1_ps(h->eps),
                  _mm512_set1_ps(h->weight_decay), _mm512_set1_ps(h->inv_bias_correction1),
                  _mm512_set1_ps(h->inv_bias_correction2), _mm512_set1_ps(t->m_decode),
                  _mm512_set1_ps(t->v_decode),    _mm512_set1_ps(t->m_encode),
                  _mm512_set1_ps(t->v_encode)};
    return c;
}

/* Software prefetch, about 1024 elements ahead, of a 64-element step's FP32 stream x (four
 * lines) or moment of kind k (one line a byte per element): the hardware prefetchers alone
 * left these loops waiting on memory between their compute (about a quarter of the FP8 step
 * at 10M parameters on AMD Zen 4). Bits are unchanged: a prefetch only moves cache lines. */
WO_AVX512_INLINE void v_prefetch64(const void *x, int64_t i, int k) {
    const int bytes = k == KIND_FP32 ? 4 : (k == KIND_FP8 ? 1 : 2);
    const char *at = (const char *)x + i * bytes + 1024 * bytes;
    for (int line = 0; line < bytes; ++line) _mm_prefetch(at + 64 * line, _MM_HINT_T0);
}

/* 64 elements from i of moments_write (fewer when left < 64): the same operations in the
 * same order. Called with left = 64 for every whole step, so its masks are constants. */
WO_AVX512_INLINE void v_write_step(int64_t i, int64_t left, float *restrict p,
                                   const float *restrict g, void *restrict m, void *restrict v,
                                   const v_consts *c, const int adam_w_mode, const int mk,
                                   const int vk) {
    __m512 mo[4], vo[4];
    v_prefetch64(p, i, KIND_FP32);
    v_prefetch64(g, i, KIND_FP32);
    v_prefetch64(m, i, mk);
    v_prefetch64(v, i, vk);
    v_decode64(m, i, mk, left, c->m_dec, mo);
    v_decode64(v, i, vk, left, c->v_dec, vo);
    for (int j = 0; j < 4; ++j) {
        const __mmask16 lanes = v_lanes(left - 16 * j);
        float *pj = p + i + 16 * j;
        __m512 pi = _mm512_maskz_loadu_ps(lanes, pj);
        __m512 gi = _mm512_maskz_loadu_ps(lanes, g + i + 16 * j);
        if (!adam_w_mode) gi = _mm512_add_ps(gi, _mm512_mul_ps(c->wd, pi));
        __m512 mi = _mm512_add_ps(_mm512_mul_ps(c->b1, mo[j]), _mm512_mul_ps(c->omb1, gi));
        __m512 vi = _mm512_add_ps(_mm512_mul_ps(c->b2, vo[j]),
                                  _mm512_mul_ps(_mm512_mul_ps(c->omb2, gi), gi));
        __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, c->inv_bc2)), c->eps);
        __m512 update = _mm512_div_ps(_mm512_mul_ps(mi, c->inv_bc1), denom);
        if (adam_w_mode) update = _mm512_add_ps(update, _mm512_mul_ps(c->wd, pi));
        _mm512_mask_storeu_ps(pj, lanes, _mm512_sub_ps(pi, _mm512_mul_ps(c->lr, update)));
        mo[j] = mi;
        vo[j] = vi;
    }
    v_encode64(m, i, mk, left, mo, c->m_enc);
    v_encode64(v, i, vk, left, vo, c->v_enc);
}

/* moments_write, 64 elements a step. */
WO_AVX512_INLINE void v_moments_write(int64_t k, float *restrict p, const float *restrict g,
                                      void *restrict m, void *restrict v, const wo_tensor *t,
                                      const wo_hyper *h, const int adam_w_mode, const int mk,
                                      const int vk) {
    const v_consts c = v_broadcast(t, h);
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) v_write_step(i, 64, p, g, m, v, &c, adam_w_mode, mk, vk);
    if (i < k) v_write_step(i, k - i, p, g, m, v, &c, adam_w_mode, mk, vk);
}

/* 64 elements from i of moments_amax (a lane past the end reads zeros: its moments are 0). */
WO_AVX512_INLINE void v_amax_step(int64_t i, int64_t left, const float *restrict p,
                                  const float *restrict g, const void *restrict m,
                                  const void *restrict v, const v_consts *c,
                                  const int adam_w_mode, const int mk, const int vk,
                                  __m512i *ma, __m512i *va) {
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 mo[4], vo[4];
    v_prefetch64(g, i, KIND_FP32);
    if (!adam_w_mode) v_prefetch64(p, i, KIND_FP32);
    if (mk != KIND_SKIP) v_prefetch64(m, i, mk);
    if (vk != KIND_SKIP) v_prefetch64(v, i, vk);
    if (mk != KIND_SKIP) v_decode64(m, i, mk, left, c->m_dec, mo);
    if (vk != KIND_SKIP) v_decode64(v, i, vk, left, c->v_dec, vo);
    for (int j = 0; j < 4; ++j) {
        const __mmask16 lanes = v_lanes(left - 16 * j);
        __m512 gi = _mm512_maskz_loadu_ps(lanes, g + i + 16 * j);
        if (!adam_w_mode)
            gi = _mm512_add_ps(gi,
                               _mm512_mul_ps(c->wd, _mm512_maskz_loadu_ps(lanes, p + i + 16 * j)));
        if (mk != KIND_SKIP) {
            __m512 mi = _mm512_add_ps(_mm512_mul_ps(c->b1, mo[j]), _mm512_mul_ps(c->omb1, gi));
            *ma = _mm512_max_epu32(*ma, _mm512_and_si512(_mm512_castps_si512(mi), magnitude));
        }
        if (vk != KIND_SKIP) {
            __m512 vi = _mm512_add_ps(_mm512_mul_ps(c->b2, vo[j]),
                                      _mm512_mul_ps(_mm512_mul_ps(c->omb2, gi), gi));
            *va = _mm512_max_epu32(*va, _mm512_and_si512(_mm512_castps_si512(vi), magnitude));
        }
    }
}

/* moments_amax, 64 elements a step. */
WO_AVX512_INLINE void v_moments_amax(int64_t k, const float *restrict p,
                                     const float *restrict g, const void *restrict m,
                                     const void *restrict v, const wo_tensor *t,
                                     const wo_hyper *h, const int adam_w_mode, const int mk,
                                     const int vk, uint32_t *m_amax, uint32_t *v_amax) {
    const v_consts c = v_broadcast(t, h);
    __m512i ma = _mm512_setzero_si512(), va = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64)
        v_amax_step(i, 64, p, g, m, v, &c, adam_w_mode, mk, vk, &ma, &va);
    if (i < k) v_amax_step(i, k - i, p, g, m, v, &c, adam_w_mode, mk, vk, &ma, &va);
    uint32_t ms = _mm512_reduce_max_epu32(ma), vs = _mm512_reduce_max_epu32(va);
    *m_amax = ms > *m_amax ? ms : *m_amax;
    *v_amax = vs > *v_amax ? vs : *v_amax;
}

/* split_moments for a tensor with a scaled moment (the only ones sent here). */
WO_AVX512_FN __attribute__((noinline)) static void v_split_moments(
    int64_t k, float *p, const float *g, void *m, void *v, const wo_tensor *t,
    const wo_hyper *h, int pass, uint32_t *m_amax, uint32_t *v_amax) {
    WO_SCALED_SPLIT(v_moments_write, v_moments_amax)
}

static int wo_detect_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("f16c");
}

#endif
