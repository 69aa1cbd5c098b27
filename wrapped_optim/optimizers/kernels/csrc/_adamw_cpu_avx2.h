/*
 * Part of _adamw_cpu.c (included there, after the portable conversions and loops it mirrors;
 * not a header of its own).
 */
/*
 * Hand-written AVX2 loops for the split loop's scaled (fp16/FP8) moment combinations, for
 * CPUs without AVX-512 VBMI (AMD Zen 2/3, Intel before Ice Lake) or where they are selected
 * (WRAPPED_OPTIM_CPU_LOOPS=avx2, cpu_kernel.use_loops).
 *
 * GCC vectorizes the portable loops in the AVX2 clone 32 elements a step (the width of the
 * FP8 bytes), most of the instructions widening, lane shuffles and blends around the
 * arithmetic. These loops take 16 elements a step, as two vectors of 8 FP32 lanes, and use
 * the hardware where it gives the same bits:
 * - fp16 <-> FP32 by F16C's conversions (round to nearest even; a NaN re-encoded as the quiet
 *   NaN 0x7E00 with its sign, as the portable code);
 * - an FP8 code decoded in 16-bit lanes, then F16C: its sign-extended byte shifted left by 7
 *   holds the magnitude bits in the fp16 bits 7..13 and the sign in bit 15, the fp16 of the
 *   value times 2^-8 (the E4M3 subnormals land on fp16 subnormals: same spacing); the
 *   multiplier carries the 2^8 (exact, wo_fp8_fold_ok); 0x7F is the quiet NaN 0x7E00 (FP32
 *   0x7FC00000 after the conversion, the portable decode's NaN). No subnormal FP32 operand
 *   (Intel CPUs take a microcode assist for an instruction that reads one; F16C's reading
 *   of a subnormal fp16 costs nothing extra on AMD Zen 4, measured);
 * - an FP8 code encoded as in the AVX-512 loops: the saturated magnitude rounded by the FP32
 *   adder against c = 2^(max(exponent, -6) + 20), whose sum keeps 3 mantissa bits (ties to
 *   even); the codes packed to bytes with the saturating packs (they are 0..255).
 * The Adam arithmetic is the portable loop's, operation for operation (no fused
 * multiply-add: each product and sum rounded on its own), so every result is bitwise the
 * portable loop's; the tests compare the two over every format combination. A tail shorter
 * than a step runs the same step on zero-padded copies (the padded lanes are left out of the
 * amax), so no step reads or writes past a tensor's end.
 */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(WO_NO_CLONES) && \
    !defined(WO_NO_VECTOR_LOOPS)
#define WO_AVX2 1
#include <immintrin.h>
#define WO_AVX2_FN __attribute__((target("avx2,f16c")))
#define WO_AVX2_INLINE static inline __attribute__((always_inline)) WO_AVX2_FN

/* Elements a step: two vectors of 8 FP32 lanes. */
#define WO_W 16

/* 16 moment values in FP32 (stored value times the decode multiplier), two groups of 8,
 * from the step's first element at base. */
WO_AVX2_INLINE void w_decode16(const void *base, int kind, __m256 mult, __m256 out[2]) {
    if (kind == KIND_FP32) {
        out[0] = _mm256_loadu_ps((const float *)base);
        out[1] = _mm256_loadu_ps((const float *)base + 8);
    } else if (kind == KIND_BF16) {
        for (int j = 0; j < 2; ++j) {
            __m256i w = _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)((const uint16_t *)base + 8 * j)));
            out[j] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        }
    } else if (kind == KIND_FP16) {
        for (int j = 0; j < 2; ++j)
            out[j] = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + 8 * j))),
                mult);
    } else {
        /* the sign-extended byte shifted left by 7: the magnitude bits in the fp16 bits 7..13,
         * the sign in bit 15 */
        __m256i h = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)base)), 7),
            _mm256_set1_epi16((short)0xBF80));
        /* 0x7F (0x3F80 here): the quiet NaN 0x7E00 with its sign, as the portable decode (the
         * same NaN bits reach the amax, and so the scale) */
        __m256i nan = _mm256_cmpeq_epi16(_mm256_or_si256(h, _mm256_set1_epi16((short)0x8000)),
                                         _mm256_set1_epi16((short)0xBF80));
        h = _mm256_add_epi16(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x3E80)));
        out[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), mult);
        out[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), mult);
    }
}

/* The E4M3 code (sign in bit 7) of x * mult saturated to +-448, in 32-bit lanes; nan: 0
 * where no lane can be NaN (the block loops), else NaN lanes take 0x7F with their sign. */
WO_AVX2_INLINE __m256i w_e4m3_code(__m256 x, __m256 mult, const int nan) {
    __m256 y = _mm256_mul_ps(x, mult);
    __m256i bits = _mm256_castps_si256(y);
    __m256 a = _mm256_min_ps(
        _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF))),
        _mm256_set1_ps(448.0f)); /* a NaN lane becomes 448 here; it is replaced below */
    __m256i e = _mm256_max_epu32(
        _mm256_and_si256(_mm256_castps_si256(a), _mm256_set1_epi32(0x7F800000)),
        _mm256_set1_epi32(121 << 23));
    __m256i c = _mm256_add_epi32(e, _mm256_set1_epi32(20 << 23));
    __m256i sum = _mm256_castps_si256(_mm256_add_ps(a, _mm256_castsi256_ps(c)));
    /* mantissa (8 + m for a normal code, m below 2^-6) plus 8 * (exponent + 6) */
    __m256i code = _mm256_add_epi32(
        _mm256_sub_epi32(sum, c),
        _mm256_sub_epi32(_mm256_srli_epi32(e, 20), _mm256_set1_epi32(968)));
    if (nan)
        code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F),
                                  _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
    return _mm256_or_si256(
        code, _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80)));
}

/* Eight 32-bit lanes holding 0..0xFFFF as eight words, in order. */
WO_AVX2_INLINE __m128i w_words(__m256i x) {
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

/* Stores 16 new moment values (two groups of 8) in their format at base. */
WO_AVX2_INLINE void w_encode16(void *base, int kind, const __m256 x[2], __m256 mult) {
    if (kind == KIND_FP32) {
        _mm256_storeu_ps((float *)base, x[0]);
        _mm256_storeu_ps((float *)base + 8, x[1]);
    } else if (kind == KIND_BF16) {
        for (int j = 0; j < 2; ++j) {
            __m256i u = _mm256_castps_si256(x[j]);
            __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(
                _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
            __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x[j], x[j], _CMP_UNORD_Q));
            r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
            _mm_storeu_si128((__m128i *)((uint16_t *)base + 8 * j), w_words(r));
        }
    } else if (kind == KIND_FP16) {
        for (int j = 0; j < 2; ++j) {
            __m256 y = _mm256_mul_ps(x[j], mult);
            __m128i h = _mm256_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            /* a NaN keeps its sign and the quiet bit, drops the payload: 0x7E00 | sign */
            __m128i nan = _mm_packs_epi32(
                _mm256_castsi256_si128(_mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q))),
                _mm256_extracti128_si256(_mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)),
                                         1));
            h = _mm_andnot_si128(_mm_and_si128(nan, _mm_set1_epi16(0x01FF)), h);
            _mm_storeu_si128((__m128i *)((uint16_t *)base + 8 * j), h);
        }
    } else {
        /* codes are 0..255: the saturating packs keep them; words in lane order, then bytes */
        __m256i words = _mm256_permute4x64_epi64(
            _mm256_packus_epi32(w_e4m3_code(x[0], mult, 1), w_e4m3_code(x[1], mult, 1)), 0xD8);
        _mm_storeu_si128((__m128i *)base, _mm_packus_epi16(_mm256_castsi256_si128(words),
                                                           _mm256_extracti128_si256(words, 1)));
    }
}

/* The decode multiplier as w_decode16 uses it: FP8's times 2^8 (its fp16 is the value times
 * 2^-8; exact: wo_fp8_fold_ok). */
static inline __attribute__((always_inline)) float w_dec_mult(int kind, float mult) {
    return kind == KIND_FP8 ? mult * 256.0f : mult;
}

/* The hyper-parameters and multipliers, broadcast once per call. */
typedef struct {
    __m256 lr, b1, omb1, b2, omb2, eps, wd, inv_bc1, inv_bc2, m_dec, v_dec, m_enc, v_enc;
} w_consts;

WO_AVX2_INLINE w_consts w_broadcast(const wo_tensor *t, const wo_hyper *h) {
    w_consts c = {_mm256_set1_ps(h->lr),          _mm256_set1_ps(h->beta1),
                  _mm256_set1_ps(h->one_minus_beta1), _mm256_set1_ps(h->beta2),
                  _mm256_set1_ps(h->one_minus_beta2), _mm256_set1_ps(h->eps),
                  _mm256_set1_ps(h->weight_decay), _mm256_set1_ps(h->inv_bias_correction1),
                  _mm256_set1_ps(h->inv_bias_correction2), _mm256_set1_ps(w_dec_mult(t->m_kind, t->m_decode)),
                  _mm256_set1_ps(w_dec_mult(t->v_kind, t->v_decode)),    _mm256_set1_ps(t->m_encode),
                  _mm256_set1_ps(t->v_encode)};
    return c;
}

/* One step of moments_write over 16 elements from the pointers given: the same operations in
 * the same order. */
WO_AVX2_INLINE void w_write_step(float *restrict p, const float *restrict g, void *restrict m,
                                 void *restrict v, const w_consts *c, const int adam_w_mode,
                                 const int mk, const int vk) {
    __m256 mo[2], vo[2];
    w_decode16(m, mk, c->m_dec, mo);
    w_decode16(v, vk, c->v_dec, vo);
    for (int j = 0; j < 2; ++j) {
        __m256 pi = _mm256_loadu_ps(p + 8 * j);
        __m256 gi = _mm256_loadu_ps(g + 8 * j);
        if (!adam_w_mode) gi = _mm256_add_ps(gi, _mm256_mul_ps(c->wd, pi));
        __m256 mi = _mm256_add_ps(_mm256_mul_ps(c->b1, mo[j]), _mm256_mul_ps(c->omb1, gi));
        __m256 vi = _mm256_add_ps(_mm256_mul_ps(c->b2, vo[j]),
                                  _mm256_mul_ps(_mm256_mul_ps(c->omb2, gi), gi));
        __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, c->inv_bc2)), c->eps);
        __m256 update = _mm256_div_ps(_mm256_mul_ps(mi, c->inv_bc1), denom);
        if (adam_w_mode) update = _mm256_add_ps(update, _mm256_mul_ps(c->wd, pi));
        _mm256_storeu_ps(p + 8 * j, _mm256_sub_ps(pi, _mm256_mul_ps(c->lr, update)));
        mo[j] = mi;
        vo[j] = vi;
    }
    w_encode16(m, mk, mo, c->m_enc);
    w_encode16(v, vk, vo, c->v_enc);
}

/* Bytes per element of a stored kind (KIND_SKIP: none). */
static inline __attribute__((always_inline)) int64_t w_width(int kind) {
    return kind == KIND_FP32 ? 4 : (kind == KIND_FP8 ? 1 : (kind == KIND_SKIP ? 0 : 2));
}

/* Software prefetch about 1024 elements ahead of the step at element i (as the AVX-512
 * loops' v_prefetch64): the FP32 stream's line of each step, a moment's lines every fourth
 * step (64 elements); p NULL or a KIND_SKIP moment: not read. */
static inline __attribute__((always_inline)) void w_prefetch(int64_t i, const float *p,
                                                             const float *g, const void *m,
                                                             int mk, const void *v, int vk) {
    if (p) _mm_prefetch((const char *)(p + i) + 4096, _MM_HINT_T0);
    _mm_prefetch((const char *)(g + i) + 4096, _MM_HINT_T0);
    if (i & 63) return;
    for (int64_t line = 0; line < w_width(mk); ++line)
        _mm_prefetch((const char *)m + (i + 1024) * w_width(mk) + 64 * line, _MM_HINT_T0);
    for (int64_t line = 0; line < w_width(vk); ++line)
        _mm_prefetch((const char *)v + (i + 1024) * w_width(vk) + 64 * line, _MM_HINT_T0);
}

/* The last k < 16 elements of a step, through zero-padded copies (a step reads and writes
 * whole vectors). A NULL p (the amax pass in AdamW mode) stays NULL. */
typedef struct {
    float p[WO_W], g[WO_W];
    uint8_t m[4 * WO_W], v[4 * WO_W];
} w_tail;

static inline __attribute__((always_inline)) void w_tail_in(w_tail *b, int64_t k,
                                                            const float *p, const float *g,
                                                            const void *m, const void *v,
                                                            int mk, int vk) {
    memset(b, 0, sizeof *b);
    if (p) memcpy(b->p, p, (size_t)k * 4);
    memcpy(b->g, g, (size_t)k * 4);
    memcpy(b->m, m, (size_t)(k * w_width(mk)));
    memcpy(b->v, v, (size_t)(k * w_width(vk)));
}

/* moments_write, 16 elements a step. */
WO_AVX2_INLINE void w_moments_write(int64_t k, float *restrict p, const float *restrict g,
                                    void *restrict m, void *restrict v, const wo_tensor *t,
                                    const wo_hyper *h, const int adam_w_mode, const int mk,
                                    const int vk) {
    const w_consts c = w_broadcast(t, h);
    int64_t i = 0;
    for (; i + WO_W <= k; i += WO_W) {
        w_prefetch(i, p, g, m, mk, v, vk);
        w_write_step(p + i, g + i, (char *)m + i * w_width(mk), (char *)v + i * w_width(vk),
                     &c, adam_w_mode, mk, vk);
    }
    if (i == k) return;
    w_tail b;
    void *mi = (char *)m + i * w_width(mk), *vi = (char *)v + i * w_width(vk);
    w_tail_in(&b, k - i, p + i, g + i, mi, vi, mk, vk);
    w_write_step(b.p, b.g, b.m, b.v, &c, adam_w_mode, mk, vk);
    memcpy(p + i, b.p, (size_t)(k - i) * 4);
    memcpy(mi, b.m, (size_t)((k - i) * w_width(mk)));
    memcpy(vi, b.v, (size_t)((k - i) * w_width(vk)));
}

/* One step of moments_amax over 16 elements; lanes past `left` are left out of the maxima. */
WO_AVX2_INLINE void w_amax_step(int64_t left, const float *restrict p, const float *restrict g,
                                const void *restrict m, const void *restrict v,
                                const w_consts *c, const int adam_w_mode, const int mk,
                                const int vk, __m256i *ma, __m256i *va) {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mo[2], vo[2];
    if (mk != KIND_SKIP) w_decode16(m, mk, c->m_dec, mo);
    if (vk != KIND_SKIP) w_decode16(v, vk, c->v_dec, vo);
    for (int j = 0; j < 2; ++j) {
        /* all ones in the lanes that hold elements (every lane of a whole step) */
        const __m256i keep = left >= WO_W ? _mm256_set1_epi32(-1)
                                          : _mm256_cmpgt_epi32(_mm256_set1_epi32((int)left - 8 * j),
                                                               lane);
        __m256 gi = _mm256_loadu_ps(g + 8 * j);
        if (!adam_w_mode) gi = _mm256_add_ps(gi, _mm256_mul_ps(c->wd, _mm256_loadu_ps(p + 8 * j)));
        if (mk != KIND_SKIP) {
            __m256 mi = _mm256_add_ps(_mm256_mul_ps(c->b1, mo[j]), _mm256_mul_ps(c->omb1, gi));
            __m256i bits = _mm256_and_si256(_mm256_castps_si256(mi), magnitude);
            *ma = _mm256_max_epu32(*ma, _mm256_and_si256(bits, keep));
        }
        if (vk != KIND_SKIP) {
            __m256 vi = _mm256_add_ps(_mm256_mul_ps(c->b2, vo[j]),
                                      _mm256_mul_ps(_mm256_mul_ps(c->omb2, gi), gi));
            __m256i bits = _mm256_and_si256(_mm256_castps_si256(vi), magnitude);
            *va = _mm256_max_epu32(*va, _mm256_and_si256(bits, keep));
        }
    }
}

WO_AVX2_INLINE uint32_t w_reduce_max(__m256i x) {
    uint32_t lanes[8], best = 0;
    _mm256_storeu_si256((__m256i *)lanes, x);
    for (int j = 0; j < 8; ++j) best = lanes[j] > best ? lanes[j] : best;
    return best;
}

/* moments_amax, 16 elements a step. */
WO_AVX2_INLINE void w_moments_amax(int64_t k, const float *restrict p, const float *restrict g,
                                   const void *restrict m, const void *restrict v,
                                   const wo_tensor *t, const wo_hyper *h, const int adam_w_mode,
                                   const int mk, const int vk, uint32_t *m_amax,
                                   uint32_t *v_amax) {
    const w_consts c = w_broadcast(t, h);
    __m256i ma = _mm256_setzero_si256(), va = _mm256_setzero_si256();
    const int64_t mw = w_width(mk), vw = w_width(vk);
    int64_t i = 0;
    for (; i + WO_W <= k; i += WO_W) {
        w_prefetch(i, adam_w_mode ? NULL : p, g, m, mk, v, vk);
        w_amax_step(WO_W, adam_w_mode ? p : p + i, g + i, (const char *)m + i * mw,
                    (const char *)v + i * vw, &c, adam_w_mode, mk, vk, &ma, &va);
    }
    if (i < k) {
        w_tail b;
        w_tail_in(&b, k - i, adam_w_mode ? NULL : p + i, g + i, (const char *)m + i * mw,
                  (const char *)v + i * vw, mk, vk);
        w_amax_step(k - i, b.p, b.g, b.m, b.v, &c, adam_w_mode, mk, vk, &ma, &va);
    }
    uint32_t ms = w_reduce_max(ma), vs = w_reduce_max(va);
    *m_amax = ms > *m_amax ? ms : *m_amax;
    *v_amax = vs > *v_amax ? vs : *v_amax;
}

/* split_moments for a tensor with a scaled moment (the only ones sent here). */
WO_AVX2_FN __attribute__((noinline)) static void w_split_moments(
    int64_t k, float *p, const float *g, void *m, void *v, const wo_tensor *t,
    const wo_hyper *h, int pass, uint32_t *m_amax, uint32_t *v_amax) {
    WO_SCALED_SPLIT(w_moments_write, w_moments_amax)
}

static int wo_detect_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#endif
