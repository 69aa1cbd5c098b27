/*
 * Part of _adamw_cpu.c (included by _adamw_cpu_blocks.h after the portable block loop it
 * mirrors; not a header of its own).
 */
/*
 * Hand-written AVX-512 and AVX2 loops for the block-scaled moments' one-pass step
 * (block_moments), chosen by the same loop family as the fp16/FP8 loops (wo_loops).
 *
 * GCC vectorizes the portable block loop, but keeps the per-element selects of every format
 * in it and widens each byte code through several shuffles. These loops do, per block, what
 * block_moments does, in the same order and with the same operations: the update pass (each
 * moment decoded, the Adam arithmetic, the parameter written, the new moments kept in FP32 in
 * stack arrays, their amax), the block's scales (the portable functions), then the encode
 * pass. The hardware gives the same bits where it is used:
 * - int8 codes are widened by sign or zero extension and converted exactly to FP32; encoding
 *   rounds with the FP32 -> int32 conversion under the caller's rounding (nearest even, as
 *   rne's magic-number add: |y| < 2^9 here) and packs with the saturating down-conversions
 *   (exp_avg: then clamped to -127 from below; exp_avg_sq: 0..255);
 * - FP8 E4M3 codes are decoded by one shift into the fp16 of their value times 2^-8 (as
 *   w_decode16; the scale carries the 2^8) and converted by F16C, and encoded as in the
 *   fp16/FP8 loops (the FP32 adder rounds the saturated magnitude to 3 mantissa bits), less
 *   the NaN select (a block holding a NaN stores zeros);
 * - int4 codes are looked up in the block's two 16-value tables (the portable loop's values,
 *   computed once per block) by a lane permute (AVX-512: each lane's nibble moved into place
 *   by one multishift). exp_avg's code counts the table midpoints below |y|: AVX-512 codes 64
 *   values at once, packed to bytes, through a 128-entry table of counts indexed by
 *   ceil(128|y|) (vb_int4_encode64); AVX2 by a three-step binary search (each step a permute
 *   of the midpoints and one compare: the same count as seven compares). exp_avg_sq's is
 *   ceil(16y - 1.5) by the rounding instruction.
 * The AVX-512 loops encode each block after the next one is updated (vb_range).
 * No fused multiply-add (each product and sum rounded on its own, -ffp-contract=off), so every
 * result is bitwise the portable loop's and the torch step's; the tests compare them under
 * each family. AVX-512 steps 16 elements with masks for a block's tail; AVX2 steps 16 (two
 * vectors of 8) and leaves a block whose length is not a multiple of 16 (only a tensor's last
 * block can be) to the portable loop.
 */
#if defined(WO_AVX512) || defined(WO_AVX2)
/* Software prefetch of the block loops' streams about 1024 elements ahead (a block is
 * updated, then encoded from its stack copy: the hardware prefetchers alone left the loads
 * of the next block waiting; about 15 to 25% of the int8 and int4 step over 10M parameters
 * on AMD Zen 4). Bits are unchanged: a prefetch only moves cache lines. */
static inline __attribute__((always_inline)) void wo_block_prefetch(int64_t i, const float *p,
                                                                    const float *g,
                                                                    const uint8_t *mc,
                                                                    const uint8_t *vc) {
    _mm_prefetch((const char *)(p + i) + 4096, _MM_HINT_T0);
    _mm_prefetch((const char *)(g + i) + 4096, _MM_HINT_T0);
    if ((i & 63) == 0) {
        _mm_prefetch((const char *)(mc + i) + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)(vc + i) + 1024, _MM_HINT_T0);
    }
}

/* The int4 tables of a block are these times its old scales (exp_avg_sq's product then
 * squared): exactly block_moments' products, one vector multiply each. exp_avg's value by
 * code, and exp_avg_sq's root by code. */
static const float wo_int4_signed_mags[16] __attribute__((aligned(64))) = {
    0.0f,        6 / 128.0f,   16 / 128.0f,  30 / 128.0f,  48 / 128.0f,  72 / 128.0f,
    100 / 128.0f, 1.0f,        -1.0f,        -1.0f,        -100 / 128.0f, -72 / 128.0f,
    -48 / 128.0f, -30 / 128.0f, -16 / 128.0f, -6 / 128.0f};
static const float wo_int4_roots[16] __attribute__((aligned(64))) = {
    1 * 0.0625f,  2 * 0.0625f,  3 * 0.0625f,  4 * 0.0625f,  5 * 0.0625f,  6 * 0.0625f,
    7 * 0.0625f,  8 * 0.0625f,  9 * 0.0625f,  10 * 0.0625f, 11 * 0.0625f, 12 * 0.0625f,
    13 * 0.0625f, 14 * 0.0625f, 15 * 0.0625f, 16 * 0.0625f};
#endif

#ifdef WO_AVX512
/* int4 exp_avg's code magnitude by k = ceil(128|y|) (0..127): the count of midpoints below |y|,
 * INT4_MAG_MIDS times 128 being the integers 3, 11, 23, 39, 60, 86, 114 (|y| > m / 128 exactly
 * when ceil(128|y|) > m); one two-register byte permute looks up 64 codes. */
static const uint8_t wo_int4_counts[128] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    3, 3, 3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5,
    5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 6,
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
};
/* Byte order of 64 nibble pairs packed from four groups of 16 codes (vb_int4_encode64): the
 * packs leave element 16g + 4L + r at byte 16L + 4g + r, each pair's byte at its first. */
static const uint8_t wo_int4_pair_order[64] __attribute__((aligned(64))) = {
    0, 2, 16, 18, 32, 34, 48, 50, 4, 6, 20, 22, 36, 38, 52, 54, 8, 10, 24, 26, 40, 42, 56, 58, 12, 14, 28, 30, 44, 46, 60, 62,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
};
/* Bit offset of nibble d of an 8-byte group, at byte 0 of 32-bit lane d (vb_int4_decode16: the
 * table permute reads the low 4 bits of each lane). */
static const uint8_t wo_int4_nibble_shifts[64] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 4, 0, 0, 0, 8, 0, 0, 0, 12, 0, 0, 0, 16, 0, 0, 0, 20, 0, 0, 0, 24, 0, 0, 0, 28, 0, 0, 0,
    32, 0, 0, 0, 36, 0, 0, 0, 40, 0, 0, 0, 44, 0, 0, 0, 48, 0, 0, 0, 52, 0, 0, 0, 56, 0, 0, 0, 60, 0, 0, 0,
};
#endif

#ifdef WO_AVX512
/* 16 old moment values from element i (lanes past the block read code 0). */
WO_AVX512_INLINE __m512 vb_decode(const uint8_t *c, int64_t i, int64_t left, int fmt,
                                  int second, __m512 scale, __m512 lut) {
    const __mmask16 lanes = v_lanes(left);
    if (fmt == FMT_INT4 && left >= 16) {
        /* the 8 bytes broadcast, each lane's nibble moved to its low bits by one
         * multishift */
        int64_t group;
        memcpy(&group, c + i / 2, sizeof group);
        __m512i w = _mm512_multishift_epi64_epi8(_mm512_load_si512(wo_int4_nibble_shifts),
                                                 _mm512_set1_epi64(group));
        return _mm512_permutexvar_ps(w, lut);
    }
    if (fmt == FMT_INT4) {
        const __mmask16 bytes = v_lanes((left + 1) / 2);
        __m128i b = _mm_maskz_loadu_epi8(bytes, c + i / 2);
        __m512i w = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        /* odd lanes take the high nibble; the permute reads the low 4 bits of each lane */
        w = _mm512_srlv_epi32(w, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4,
                                                  0));
        return _mm512_permutexvar_ps(w, lut);
    }
    __m128i b = _mm_maskz_loadu_epi8(lanes, c + i);
    if (fmt == FMT_FP8) {
        /* the sign-extended byte shifted left by 7 holds the magnitude bits in the fp16 bits
         * 7..13 and the sign in bit 15: the fp16 of the value times 2^-8, subnormals included
         * (the scale carries the 2^8); no NaN code (0x7F, 0xFF) reaches here (vb_moments) */
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                     _mm256_set1_epi16((short)0xBF80));
        return _mm512_mul_ps(_mm512_cvtph_ps(h), scale);
    }
    __m512i w = second ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b);
    __m512 x = _mm512_mul_ps(_mm512_cvtepi32_ps(w), scale);
    return second ? _mm512_mul_ps(x, x) : x;
}

/* Stores the int8 or FP8 codes of 16 new moment values x (already zero where the scale is 0 or
 * NaN, and past the block) from element i (int4: vb_int4_encode64). */
WO_AVX512_INLINE void vb_encode(uint8_t *c, int64_t i, int64_t left, int fmt, int second,
                                __m512 x, __m512 inv) {
    const __mmask16 lanes = v_lanes(left);
    __m512i code;
    if (fmt == FMT_FP8) {
        code = v_e4m3_code(x, inv, 0); /* no NaN: a block holding one stores zeros */
    } else {
        code = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv)); /* nearest even, as rne */
        if (!second) {
            _mm_mask_storeu_epi8(c + i, lanes,
                                 _mm512_cvtsepi32_epi8(_mm512_max_epi32(code, _mm512_set1_epi32(-127))));
            return;
        }
    }
    if (second) /* a positive exp_avg_sq never takes code 0: max(code, min(bits of x, 1)) lifts
                   it to 1 where x > 0 (as an integer, a negative x's bits are below 0) */
        code = _mm512_max_epi32(code, _mm512_min_epi32(_mm512_castps_si512(x),
                                                       _mm512_set1_epi32(1)));
    /* (the down-conversions to a register, then one masked store: their memory forms are
     * slow on AMD Zen 4) */
    _mm_mask_storeu_epi8(c + i, lanes,
                         fmt == FMT_FP8 ? _mm512_cvtepi32_epi8(code) : _mm512_cvtusepi32_epi8(code));
}

/* The int4 codes of the values x[i, i + left) (fewer than 64 past i: the rest read as 0;
 * keep 0: all 0), as nibble pairs at c + i / 2. mult is 1/scale times 128 (exp_avg) or 16
 * (exp_avg_sq): a power of two more than the portable loop's y = x / scale, the same product
 * scaled exactly (a y too small for a normal float codes 0 either way). Four groups of 16
 * values are coded in 32-bit lanes, packed to bytes, looked up (exp_avg) and paired:
 * - exp_avg: k = ceil(min(128|y|, 127)) with y's sign in bit 7; the count of midpoints below
 *   |y| is wo_int4_counts[k], negated where the sign is set (the portable loop's
 *   (0 - n) & 0xF);
 * - exp_avg_sq: ceil(16y - 1.5) by the conversion's rounding, clamped to 0..15 by the
 *   unsigned packs (below 0) and a byte minimum. */
WO_AVX512_INLINE void vb_int4_encode64(uint8_t *c, const float *x, int64_t i, int64_t left,
                                       __mmask16 keep, __m512 mult, int second) {
    const int rounding = _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC;
    __m512i q[4];
    for (int j = 0; j < 4; ++j) {
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(v_lanes(left - 16 * j) & keep,
                                                       x + i + 16 * j),
                                 mult);
        if (second) {
            q[j] = _mm512_cvt_roundps_epi32(_mm512_sub_ps(v, _mm512_set1_ps(1.5f)), rounding);
        } else {
            __m512i k = _mm512_cvt_roundps_epi32(_mm512_range_ps(v, _mm512_set1_ps(127.0f), 0x0A),
                                                 rounding);
            /* k | (the sign bit moved to bit 7) */
            q[j] = _mm512_ternarylogic_epi32(k, _mm512_srli_epi32(_mm512_castps_si512(v), 24),
                                             _mm512_set1_epi32(0x80), 0xF8);
        }
    }
    __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(q[0], q[1]),
                                    _mm512_packus_epi32(q[2], q[3]));
    if (second) {
        b = _mm512_min_epu8(b, _mm512_set1_epi8(15));
    } else {
        __m512i n = _mm512_permutex2var_epi8(_mm512_load_si512(wo_int4_counts), b,
                                             _mm512_load_si512(wo_int4_counts + 64));
        b = _mm512_mask_sub_epi8(n, _mm512_movepi8_mask(b), _mm512_setzero_si512(), n);
    }
    /* each pair's byte: its first code's low nibble, the second's above it (16-bit shift) */
    b = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), b, _mm512_srli_epi16(b, 4), 0xCA);
    b = _mm512_permutexvar_epi8(_mm512_load_si512(wo_int4_pair_order), b);
    const int64_t bytes = ((left < 64 ? left : 64) + 1) / 2;
    _mm256_mask_storeu_epi8(c + i / 2, (__mmask32)(((uint64_t)1 << bytes) - 1),
                            _mm512_castsi512_si256(b));
}

/* The hyper-parameters, broadcast once per block, and the block's old scales (int4: its
 * tables). */
typedef struct {
    __m512 lr, b1, omb1, b2, omb2, eps, wd, inv_bc1, inv_bc2, m_scale, v_scale, m_lut, v_lut;
} vb_consts;

/* The update of 16 elements from i (fewer when left < 16): the parameter written, the new
 * moments (exp_avg_sq's stored value) into M and S, their magnitudes into the amax. Called
 * with left = 16 for every whole step, so its masks are constants (plain loads and stores). */
WO_AVX512_INLINE void vb_update16(int64_t i, int64_t left, float *restrict p,
                                  const float *restrict g, const uint8_t *restrict mc,
                                  const uint8_t *restrict vc, float *restrict M,
                                  float *restrict S, const vb_consts *c, const int adam_w_mode,
                                  const int fmt, __m512i *ma, __m512i *va) {
    const __mmask16 lanes = v_lanes(left);
    const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
    wo_block_prefetch(i, p, g, mc, vc);
    __m512 pi = _mm512_maskz_loadu_ps(lanes, p + i);
    __m512 gi = _mm512_maskz_loadu_ps(lanes, g + i);
    if (!adam_w_mode) gi = _mm512_add_ps(gi, _mm512_mul_ps(c->wd, pi));
    __m512 m_dec = vb_decode(mc, i, left, fmt, 0, c->m_scale, c->m_lut);
    __m512 v_dec = vb_decode(vc, i, left, fmt, 1, c->v_scale, c->v_lut);
    __m512 mi = _mm512_add_ps(_mm512_mul_ps(c->b1, m_dec), _mm512_mul_ps(c->omb1, gi));
    __m512 vi = _mm512_add_ps(_mm512_mul_ps(c->b2, v_dec),
                              _mm512_mul_ps(_mm512_mul_ps(c->omb2, gi), gi));
    __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(vi, c->inv_bc2)), c->eps);
    __m512 update = _mm512_div_ps(_mm512_mul_ps(mi, c->inv_bc1), denom);
    if (adam_w_mode) update = _mm512_add_ps(update, _mm512_mul_ps(c->wd, pi));
    _mm512_mask_storeu_ps(p + i, lanes, _mm512_sub_ps(pi, _mm512_mul_ps(c->lr, update)));
    __m512 si = fmt == FMT_FP8 ? vi : _mm512_sqrt_ps(vi);
    _mm512_storeu_ps(M + i, mi);
    _mm512_storeu_ps(S + i, si);
    *ma = _mm512_max_epu32(*ma, _mm512_maskz_and_epi32(lanes, _mm512_castps_si512(mi), magnitude));
    *va = _mm512_max_epu32(*va, _mm512_maskz_and_epi32(lanes, _mm512_castps_si512(si), magnitude));
}

/* The codes of 16 elements from i (fewer when left < 16); keep 0: the scale is 0 or NaN, the
 * codes are zeros. */
WO_AVX512_INLINE void vb_encode16(int64_t i, int64_t left, uint8_t *restrict mc,
                                  uint8_t *restrict vc, const float *restrict M,
                                  const float *restrict S, __mmask16 m_keep, __mmask16 v_keep,
                                  __m512 m_mult, __m512 v_mult, const int fmt) {
    const __mmask16 lanes = v_lanes(left);
    vb_encode(mc, i, left, fmt, 0, _mm512_maskz_loadu_ps(lanes & m_keep, M + i), m_mult);
    vb_encode(vc, i, left, fmt, 1, _mm512_maskz_loadu_ps(lanes & v_keep, S + i), v_mult);
}

/* A block whose encode waits (vb_range): where its codes go, its length, the inverses of its
 * new scales, and its new moments (M, S). */
typedef struct {
    uint8_t *mc, *vc;
    int64_t k;
    float m_inv, v_inv;
    float M[WO_QBLOCK_MAX + 16], S[WO_QBLOCK_MAX + 16];
} vb_block;

/* 1 when an FP8 block holds a NaN code (0x7F, 0xFF: only from a checkpoint); such a block
 * runs the portable loop: the decode leaves them out. */
WO_AVX512_INLINE int vb_fp8_nan_codes(int64_t k, const uint8_t *mc, const uint8_t *vc) {
    const __m512i top = _mm512_set1_epi8((char)0x80);
    __m512i high = top;
    for (int64_t i = 0; i < k; i += 64) {
        const __mmask64 b = v_bytes(k - i);
        high = _mm512_max_epu8(high, _mm512_or_si512(_mm512_maskz_loadu_epi8(b, mc + i), top));
        high = _mm512_max_epu8(high, _mm512_or_si512(_mm512_maskz_loadu_epi8(b, vc + i), top));
    }
    return _mm512_cmpeq_epi8_mask(high, _mm512_set1_epi8((char)0xFF)) != 0;
}

/* block_moments' update of one block, 16 elements a step: the parameter written, the new
 * moments into out->M and out->S, the new scales into *ms and *vs and their inverses into
 * out (the encode is vb_encode_block's). c holds the hyper-parameters; its scales and tables
 * are set here from the block's old scales. */
WO_AVX512_INLINE void vb_update_block(int64_t k, float *restrict p, const float *restrict g,
                                      uint8_t *mc, uint8_t *vc, float *ms, float *vs,
                                      vb_consts *c, const int adam_w_mode, const int fmt,
                                      vb_block *out) {
    const float m_old = *ms, v_old = *vs;
    c->m_scale = _mm512_set1_ps(fmt == FMT_FP8 ? m_old * 256.0f : m_old);
    c->v_scale = _mm512_set1_ps(fmt == FMT_FP8 ? v_old * 256.0f : v_old);
    if (fmt == FMT_INT4) {
        c->m_lut = _mm512_mul_ps(_mm512_load_ps(wo_int4_signed_mags), c->m_scale);
        __m512 r = _mm512_mul_ps(_mm512_load_ps(wo_int4_roots), c->v_scale);
        c->v_lut = _mm512_mul_ps(r, r);
    }
    float *restrict M = out->M, *restrict S = out->S;
    __m512i ma = _mm512_setzero_si512(), va = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) vb_update16(i, 16, p, g, mc, vc, M, S, c, adam_w_mode, fmt, &ma, &va);
    if (i < k) vb_update16(i, k - i, p, g, mc, vc, M, S, c, adam_w_mode, fmt, &ma, &va);
    uint32_t m_amax = _mm512_reduce_max_epu32(ma), v_amax = _mm512_reduce_max_epu32(va);
    if (fmt == FMT_INT4) {
        *ms = int4_scale(m_amax, &out->m_inv);
        *vs = int4_scale(v_amax, &out->v_inv);
    } else {
        *ms = block_scale(m_amax, block_headroom(fmt, 0), &out->m_inv);
        *vs = block_scale(v_amax, block_headroom(fmt, 1), &out->v_inv);
    }
    out->mc = mc;
    out->vc = vc;
    out->k = k;
}

/* block_moments' encode of a block vb_update_block left (a zero or NaN scale, inverse 0,
 * stores codes 0: no lane is read). */
WO_AVX512_INLINE void vb_encode_block(const vb_block *b, const int fmt) {
    const int64_t k = b->k;
    const __mmask16 m_keep = b->m_inv == 0.0f ? 0 : 0xFFFF, v_keep = b->v_inv == 0.0f ? 0 : 0xFFFF;
    int64_t i;
    if (fmt == FMT_INT4) {
        const __m512 m_mult = _mm512_set1_ps(b->m_inv * 128.0f);
        const __m512 v_mult = _mm512_set1_ps(b->v_inv * 16.0f);
        for (i = 0; i < k; i += 64) {
            vb_int4_encode64(b->mc, b->M, i, k - i, m_keep, m_mult, 0);
            vb_int4_encode64(b->vc, b->S, i, k - i, v_keep, v_mult, 1);
        }
        return;
    }
    const __m512 m_mult = _mm512_set1_ps(b->m_inv), v_mult = _mm512_set1_ps(b->v_inv);
    for (i = 0; i + 16 <= k; i += 16)
        vb_encode16(i, 16, b->mc, b->vc, b->M, b->S, m_keep, v_keep, m_mult, v_mult, fmt);
    if (i < k) vb_encode16(i, k - i, b->mc, b->vc, b->M, b->S, m_keep, v_keep, m_mult, v_mult, fmt);
}

/* block_range with these loops: the blocks of t that start in [begin, end), each updated
 * whole. A block's encode waits until the next block is updated: its codes need its new
 * scales (an amax reduction and, for int4, a division: tens of cycles of latency), and
 * running them right after its update stalled the step on that chain (about a third of the
 * int4 step at 128-value blocks). The blocks' codes, scales and elements are disjoint, so the
 * order changes no bits. */
WO_AVX512_INLINE void vb_range(wo_tensor *t, int64_t begin, int64_t end, const wo_hyper *h,
                               const int adam_w_mode, const int fmt) {
    float P[WO_QBLOCK_MAX], G[WO_QBLOCK_MAX];
    vb_block done[2];
    int waiting = -1; /* the block in done[] whose encode waits, or -1 */
    vb_consts c = {_mm512_set1_ps(h->lr),
                   _mm512_set1_ps(h->beta1),
                   _mm512_set1_ps(h->one_minus_beta1),
                   _mm512_set1_ps(h->beta2),
                   _mm512_set1_ps(h->one_minus_beta2),
                   _mm512_set1_ps(h->eps),
                   _mm512_set1_ps(h->weight_decay),
                   _mm512_set1_ps(h->inv_bias_correction1),
                   _mm512_set1_ps(h->inv_bias_correction2),
                   _mm512_setzero_ps(),
                   _mm512_setzero_ps(),
                   _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    const int64_t q = t->qblock;
    for (int64_t s = (begin + q - 1) / q * q; s < end; s += q) {
        const wo_block_ops o = block_ops(t, s, P, G, fmt);
        /* FP8 scales at or past 2^120 (see wo_fp8_fold_ok) and FP8 NaN codes: the portable
         * loop, update and encode at once */
        if (fmt == FMT_FP8 &&
            (!(wo_fp8_fold_ok(KIND_FP8, *o.ms) && wo_fp8_fold_ok(KIND_FP8, *o.vs)) ||
             vb_fp8_nan_codes(o.k, o.mc, o.vc))) {
            block_moments(o.k, o.p, o.g, o.mc, o.vc, o.ms, o.vs, h, adam_w_mode, fmt);
        } else {
            const int next = waiting == 0 ? 1 : 0;
            vb_update_block(o.k, o.p, o.g, o.mc, o.vc, o.ms, o.vs, &c, adam_w_mode, fmt,
                            &done[next]);
            if (waiting >= 0) vb_encode_block(&done[waiting], fmt);
            waiting = next;
        }
        tile_store_param(t, s, o.k, o.p);
    }
    if (waiting >= 0) vb_encode_block(&done[waiting], fmt);
}

WO_AVX512_FN __attribute__((noinline)) static void vb_block_range(wo_tensor *t, int64_t begin,
                                                                 int64_t end, const wo_hyper *h) {
    const int fmt = block_fmt(t->m_kind);
#define WO_VB_CASE(f)                                  \
    case f:                                            \
        if (h->adam_w_mode)                            \
            vb_range(t, begin, end, h, 1, f);          \
        else                                           \
            vb_range(t, begin, end, h, 0, f);          \
        return;
    switch (fmt) {
        WO_VB_CASE(FMT_INT8)
        WO_VB_CASE(FMT_FP8)
        WO_VB_CASE(FMT_INT4)
    }
#undef WO_VB_CASE
}
#endif

#ifdef WO_AVX2
/* 16 old moment values from element i, two groups of 8. */
WO_AVX2_INLINE void wb_decode16(const uint8_t *c, int64_t i, int fmt, int second, __m256 scale,
                                __m256 lut_low, __m256 lut_high, __m256 out[2]) {
    if (fmt == FMT_FP8) { /* w_decode16's shift, no NaN code here (wb_moments) */
        __m256i h = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(c + i))), 7),
            _mm256_set1_epi16((short)0xBF80));
        out[0] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), scale);
        out[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), scale);
        return;
    }
    if (fmt == FMT_INT4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(c + i / 2));
        b = _mm_unpacklo_epi8(b, b);
        for (int j = 0; j < 2; ++j) {
            __m256i w = _mm256_cvtepu8_epi32(j ? _mm_srli_si128(b, 8) : b);
            /* odd lanes take the high nibble; each permute reads the low 3 bits of a lane,
             * bit 3 (moved to the sign) picks the table's half */
            w = _mm256_srlv_epi32(w, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
            __m256 low = _mm256_permutevar8x32_ps(lut_low, w);
            __m256 high = _mm256_permutevar8x32_ps(lut_high, w);
            out[j] = _mm256_blendv_ps(low, high, _mm256_castsi256_ps(_mm256_slli_epi32(w, 28)));
        }
        return;
    }
    for (int j = 0; j < 2; ++j) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(c + i + 8 * j));
        __m256i w = second ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b);
        __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(w), scale);
        out[j] = second ? _mm256_mul_ps(x, x) : x;
    }
}

/* 16 lanes of 0..255 (two vectors of 8, in order) stored as bytes at c. */
WO_AVX2_INLINE void wb_store_bytes(uint8_t *c, __m256i a, __m256i b, int is_signed) {
    __m256i words = _mm256_permute4x64_epi64(
        is_signed ? _mm256_packs_epi32(a, b) : _mm256_packus_epi32(a, b), 0xD8);
    __m128i low = _mm256_castsi256_si128(words), high = _mm256_extracti128_si256(words, 1);
    _mm_storeu_si128((__m128i *)c,
                     is_signed ? _mm_packs_epi16(low, high) : _mm_packus_epi16(low, high));
}

/* Stores the codes of 16 new moment values x (zero where the scale is 0 or NaN). */
WO_AVX2_INLINE void wb_encode16(uint8_t *c, int64_t i, int fmt, int second, const __m256 x[2],
                                __m256 inv) {
    const __m256 zero = _mm256_setzero_ps();
    __m256i code[2];
    for (int j = 0; j < 2; ++j) {
        __m256 y = _mm256_mul_ps(x[j], inv);
        if (fmt == FMT_INT4 && second) {
            __m256 t = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(16.0f), y),
                                     _mm256_set1_ps(1.5f));
            t = _mm256_round_ps(t, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC);
            t = _mm256_min_ps(_mm256_max_ps(t, zero), _mm256_set1_ps(15.0f));
            code[j] = _mm256_cvttps_epi32(t);
        } else if (fmt == FMT_INT4) {
            __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y);
            /* the count of midpoints below |y| by vb_encode's binary search (a true compare
             * is -1) */
            const float *M = INT4_MAG_MIDS;
            __m256i n = _mm256_and_si256(
                _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(M[3]), _CMP_GT_OQ)),
                _mm256_set1_epi32(4));
            __m256 mid = _mm256_permutevar8x32_ps(_mm256_setr_ps(M[1], 0, 0, 0, M[5], 0, 0, 0), n);
            n = _mm256_add_epi32(n, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(
                                                         a, mid, _CMP_GT_OQ)),
                                                     _mm256_set1_epi32(2)));
            mid = _mm256_permutevar8x32_ps(_mm256_setr_ps(M[0], 0, M[2], 0, M[4], 0, M[6], 0), n);
            n = _mm256_sub_epi32(n, _mm256_castps_si256(_mm256_cmp_ps(a, mid, _CMP_GT_OQ)));
            __m256 negative = _mm256_cmp_ps(y, zero, _CMP_LT_OQ);
            n = _mm256_castps_si256(_mm256_blendv_ps(
                _mm256_castsi256_ps(n),
                _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_setzero_si256(), n)), negative));
            code[j] = _mm256_and_si256(n, _mm256_set1_epi32(0xF));
        } else if (fmt == FMT_FP8) {
            code[j] = w_e4m3_code(x[j], inv, 0); /* no NaN: a block holding one stores zeros */
        } else {
            code[j] = _mm256_cvtps_epi32(y); /* nearest even, as rne */
            if (!second) code[j] = _mm256_max_epi32(code[j], _mm256_set1_epi32(-127));
        }
        if (second && fmt != FMT_INT4) /* a positive exp_avg_sq never takes code 0 (as vb_encode) */
            code[j] = _mm256_max_epi32(code[j], _mm256_min_epi32(_mm256_castps_si256(x[j]),
                                                                 _mm256_set1_epi32(1)));
    }
    if (fmt != FMT_INT4) {
        wb_store_bytes(c + i, code[0], code[1], fmt == FMT_INT8 && !second);
        return;
    }
    /* lanes 2j and 2j + 1 into one byte (low nibble, high nibble): bytes 0 and 8 of each
     * 128-bit lane, gathered into 8 bytes */
    const __m256i gather = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            -1, -1, -1, -1);
    __m128i out = _mm_setzero_si128();
    for (int j = 0; j < 2; ++j) {
        __m256i q = _mm256_or_si256(code[j], _mm256_srli_epi64(code[j], 28));
        q = _mm256_shuffle_epi8(q, gather);
        __m128i four = _mm_or_si128(_mm256_castsi256_si128(q),
                                    _mm_slli_si128(_mm256_extracti128_si256(q, 1), 2));
        out = _mm_or_si128(out, j ? _mm_slli_si128(four, 4) : four);
    }
    _mm_storel_epi64((__m128i *)(c + i / 2), out);
}

/* block_moments, 16 elements a step (k a multiple of 16). */
WO_AVX2_INLINE void wb_moments(int64_t k, float *restrict p, const float *restrict g,
                               uint8_t *restrict mc, uint8_t *restrict vc, float *restrict ms,
                               float *restrict vs, const wo_hyper *h, const int adam_w_mode,
                               const int fmt) {
    const __m256 lr = _mm256_set1_ps(h->lr), b1 = _mm256_set1_ps(h->beta1);
    const __m256 omb1 = _mm256_set1_ps(h->one_minus_beta1), b2 = _mm256_set1_ps(h->beta2);
    const __m256 omb2 = _mm256_set1_ps(h->one_minus_beta2), eps = _mm256_set1_ps(h->eps);
    const __m256 wd = _mm256_set1_ps(h->weight_decay);
    const __m256 inv_bc1 = _mm256_set1_ps(h->inv_bias_correction1);
    const __m256 inv_bc2 = _mm256_set1_ps(h->inv_bias_correction2);
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
    const float m_old = *ms, v_old = *vs;
    if (fmt == FMT_FP8) { /* a block holding a NaN code runs the portable loop (as vb_moments) */
        const __m128i top = _mm_set1_epi8((char)0x80);
        __m128i high = top;
        for (int64_t i = 0; i < k; i += 16) {
            high = _mm_max_epu8(high, _mm_or_si128(_mm_loadu_si128((const __m128i *)(mc + i)), top));
            high = _mm_max_epu8(high, _mm_or_si128(_mm_loadu_si128((const __m128i *)(vc + i)), top));
        }
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(high, _mm_set1_epi8((char)0xFF)))) {
            block_moments(k, p, g, mc, vc, ms, vs, h, adam_w_mode, fmt);
            return;
        }
    }
    /* FP8: the decode's fp16 is the value times 2^-8 (w_decode16) */
    const __m256 m_scale = _mm256_set1_ps(fmt == FMT_FP8 ? m_old * 256.0f : m_old);
    const __m256 v_scale = _mm256_set1_ps(fmt == FMT_FP8 ? v_old * 256.0f : v_old);
    /* int4: the block's tables (wo_int4_signed_mags) */
    const __m256 m_low = _mm256_mul_ps(_mm256_load_ps(wo_int4_signed_mags), m_scale);
    const __m256 m_high = _mm256_mul_ps(_mm256_load_ps(wo_int4_signed_mags + 8), m_scale);
    const __m256 r_low = _mm256_mul_ps(_mm256_load_ps(wo_int4_roots), v_scale);
    const __m256 r_high = _mm256_mul_ps(_mm256_load_ps(wo_int4_roots + 8), v_scale);
    const __m256 v_low = _mm256_mul_ps(r_low, r_low), v_high = _mm256_mul_ps(r_high, r_high);
    float M[WO_QBLOCK_MAX], S[WO_QBLOCK_MAX];
    __m256i ma = _mm256_setzero_si256(), va = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i += 16) {
        wo_block_prefetch(i, p, g, mc, vc);
        __m256 mo[2], vo[2];
        wb_decode16(mc, i, fmt, 0, m_scale, m_low, m_high, mo);
        wb_decode16(vc, i, fmt, 1, v_scale, v_low, v_high, vo);
        for (int j = 0; j < 2; ++j) {
            float *pj = p + i + 8 * j;
            __m256 pi = _mm256_loadu_ps(pj);
            __m256 gi = _mm256_loadu_ps(g + i + 8 * j);
            if (!adam_w_mode) gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
            __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, mo[j]), _mm256_mul_ps(omb1, gi));
            __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, vo[j]),
                                      _mm256_mul_ps(_mm256_mul_ps(omb2, gi), gi));
            __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(vi, inv_bc2)), eps);
            __m256 update = _mm256_div_ps(_mm256_mul_ps(mi, inv_bc1), denom);
            if (adam_w_mode) update = _mm256_add_ps(update, _mm256_mul_ps(wd, pi));
            _mm256_storeu_ps(pj, _mm256_sub_ps(pi, _mm256_mul_ps(lr, update)));
            __m256 si = fmt == FMT_FP8 ? vi : _mm256_sqrt_ps(vi);
            _mm256_storeu_ps(M + i + 8 * j, mi);
            _mm256_storeu_ps(S + i + 8 * j, si);
            ma = _mm256_max_epu32(ma, _mm256_and_si256(_mm256_castps_si256(mi), magnitude));
            va = _mm256_max_epu32(va, _mm256_and_si256(_mm256_castps_si256(si), magnitude));
        }
    }
    float m_inv, v_inv;
    if (fmt == FMT_INT4) {
        *ms = int4_scale(w_reduce_max(ma), &m_inv);
        *vs = int4_scale(w_reduce_max(va), &v_inv);
    } else {
        *ms = block_scale(w_reduce_max(ma), block_headroom(fmt, 0), &m_inv);
        *vs = block_scale(w_reduce_max(va), block_headroom(fmt, 1), &v_inv);
    }
    /* a zero or NaN scale (inverse 0) stores codes 0: its values are replaced by zeros */
    const __m256 m_keep = _mm256_castsi256_ps(_mm256_set1_epi32(m_inv == 0.0f ? 0 : -1));
    const __m256 v_keep = _mm256_castsi256_ps(_mm256_set1_epi32(v_inv == 0.0f ? 0 : -1));
    const __m256 m_mult = _mm256_set1_ps(m_inv), v_mult = _mm256_set1_ps(v_inv);
    for (int64_t i = 0; i < k; i += 16) {
        __m256 mx[2], sx[2];
        for (int j = 0; j < 2; ++j) {
            mx[j] = _mm256_and_ps(_mm256_loadu_ps(M + i + 8 * j), m_keep);
            sx[j] = _mm256_and_ps(_mm256_loadu_ps(S + i + 8 * j), v_keep);
        }
        wb_encode16(mc, i, fmt, 0, mx, m_mult);
        wb_encode16(vc, i, fmt, 1, sx, v_mult);
    }
}

WO_AVX2_FN __attribute__((noinline)) static void wb_block_moments(
    int64_t k, float *p, const float *g, uint8_t *mc, uint8_t *vc, float *ms, float *vs,
    const wo_hyper *h, int fmt) {
#define WO_WB_CASE(f)                                        \
    case f:                                                  \
        if (h->adam_w_mode)                                  \
            wb_moments(k, p, g, mc, vc, ms, vs, h, 1, f);    \
        else                                                 \
            wb_moments(k, p, g, mc, vc, ms, vs, h, 0, f);    \
        return;
    switch (fmt) {
        WO_WB_CASE(FMT_INT8)
        WO_WB_CASE(FMT_FP8)
        WO_WB_CASE(FMT_INT4)
    }
#undef WO_WB_CASE
}
#endif
