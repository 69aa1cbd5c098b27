/*
 * Part of _adamw_cpu.c (included there after the tile helpers; not a header of its own): the
 * one-pass loop of block-scaled moments (wrapped_optim._formats.blocks has the format and the
 * torch implementation this loop matches bit for bit).
 *
 * Both moments of a tensor are stored in one block format, each block of `qblock` values
 * (from the tensor's start) with a scale of its own: int8 (exp_avg signed linear, codes
 * -127..127; exp_avg_sq as its square root, unsigned linear 0..255) and FP8 E4M3 (both
 * moments, exp_avg_sq itself) under a power-of-two scale 2^(floor(log2(amax)) - K), K the
 * format's headroom (6 / 7 for int8, 8 for FP8), so the largest code of a stored block is
 * always in the format's top binade; int4 (two codes a byte, the even element in the low
 * nibble) as 16-value tables under the block's amax: exp_avg a signed, near zero about
 * geometric table, exp_avg_sq's square root a zero-free linear one (k/16, k = 1..16). Either
 * way decode -> encode gives the same codes and scale (exact resume through FP32
 * checkpoints). A block whose amax is below 2^-50 is stored as zeros (scale 0); one holding
 * inf or NaN as codes 0 with a NaN scale (it decodes to NaN). A positive exp_avg_sq never
 * rounds to zero (int8 and FP8: it takes the smallest nonzero code), so a stored second
 * moment is zero only where the true one is (int4: only in a block of zeros).
 *
 * Each block is updated from memory once: the new moments of its elements are computed into
 * stack arrays (the parameter written as it goes), their amax gives the new scales, then the
 * codes are written. A thread takes every block that starts in its range (a block may end past
 * it: ranges split tensors at 64-element boundaries, blocks at qblock ones), so each block is
 * updated whole by one thread. These loops are the portable C of the file (the AVX-512, AVX2
 * and baseline clones of wo_update_range vectorize them, target_clones); the AVX-512 and AVX2
 * loop families run the hand-written loops of _adamw_cpu_blocks_simd.h instead (same bits).
 */
#define WO_QBLOCK_MAX 2048

enum { FMT_INT8 = 0, FMT_FP8 = 1, FMT_INT4 = 2 };

static inline __attribute__((always_inline)) int block_fmt(int kind) {
    return kind - KIND_INT8_BLOCK;
}

/* Round to nearest even of |y| < 2^22 (exact; the FP32 adder does the rounding). */
static inline __attribute__((always_inline)) float rne(float y) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (y + magic) - magic;
}

/* The headroom K of a moment's code: its scale is 2^(floor(log2(amax)) - K). */
static inline __attribute__((always_inline)) uint32_t block_headroom(int fmt, int second) {
    if (fmt == FMT_FP8) return 8u;
    return second ? 7u : 6u; /* int8 (int4 scales by the amax itself: int4_scale) */
}

/* A block's scale from the bits of its amax (non-negative, NaN above inf); *inv is 1/scale
 * (exact, a power of two), 0 for a zero or NaN scale. */
static inline __attribute__((always_inline)) float block_scale(uint32_t amax, uint32_t k,
                                                              float *inv) {
    if (amax >= 0x7F800000u) {
        *inv = 0.0f;
        return u2f(0x7FC00000u);
    }
    if (amax < (77u << 23)) { /* below 2^-50 */
        *inv = 0.0f;
        return 0.0f;
    }
    uint32_t e = amax >> 23;
    *inv = u2f((254u + k - e) << 23);
    return u2f((e - k) << 23);
}

/* int4 tables (wrapped_optim._formats.blocks has them and says why): the midpoints between
 * the exp_avg magnitudes (a code is the sign and the count of midpoints |y| is above), the
 * exp_avg magnitudes by code. */
static const float INT4_MAG_MIDS[7] = {3 / 128.0f, 11 / 128.0f, 23 / 128.0f, 39 / 128.0f,
                                       60 / 128.0f, 86 / 128.0f, 114 / 128.0f};
static const float INT4_MAGS[8] = {0.0f, 6 / 128.0f, 16 / 128.0f, 30 / 128.0f,
                                  48 / 128.0f, 72 / 128.0f, 100 / 128.0f, 1.0f};
/* exp_avg_sq's square roots are k/16 (k = 1..16): computed, not looked up. */

/* int4's scale: the amax itself (the top table value decodes to it exactly); *inv its
 * float32 reciprocal; 0 and 0 below 2^-50, NaN and 0 for inf or NaN. */
static inline __attribute__((always_inline)) float int4_scale(uint32_t amax, float *inv) {
    if (amax >= 0x7F800000u) {
        *inv = 0.0f;
        return u2f(0x7FC00000u);
    }
    if (amax < (77u << 23)) {
        *inv = 0.0f;
        return 0.0f;
    }
    *inv = 1.0f / u2f(amax);
    return u2f(amax);
}

/* int4 codes of y (x times 1/scale): exp_avg's signed nibble, exp_avg_sq's index. */
static inline __attribute__((always_inline)) uint32_t int4_code(float y, int second) {
    uint32_t n = 0;
    if (second) { /* the roots are k/16 (k = 1..16): the count of midpoints (2t + 3)/32
                     below y is ceil(16y - 1.5) in 0..15 (16y and the difference are exact) */
        float c = __builtin_ceilf(16.0f * y - 1.5f);
        c = c < 0.0f ? 0.0f : (c > 15.0f ? 15.0f : c);
        return (uint32_t)(int32_t)c;
    }
    float a = __builtin_fabsf(y);
    for (int t = 0; t < 7; ++t) n += (uint32_t)(a > INT4_MAG_MIDS[t]);
    return (y < 0.0f ? 0u - n : n) & 0xFu;
}

/* The FP32 value of element i of a block (times its scale; squared for the integer formats'
 * second moment): from the FP8 codes, or from the integer codes one per byte (int4 codes
 * unpacked first, see block_moments). */
static inline __attribute__((always_inline)) float block_decode(const uint8_t *codes,
                                                               const int8_t *signed_codes,
                                                               int64_t i, int fmt, int second,
                                                               float scale) {
    if (fmt == FMT_FP8) return e4m3_to_f32(codes[i]) * scale;
    float c = second ? (float)codes[i] : (float)signed_codes[i];
    float x = c * scale;
    return second ? x * x : x;
}

/* The code of x (already multiplied by 1/scale) in a moment's format, as 0..255 (int8: the
 * two's complement byte; int4: the nibble); `positive` (0 or 1) lifts a second moment's code
 * 0 to 1. No branches (bitwise operators, selects): the loops vectorize. */
static inline __attribute__((always_inline)) uint32_t block_code(float y, int fmt, int second,
                                                                 uint32_t positive) {
    uint32_t code;
    if (fmt == FMT_FP8) {
        y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
        code = f32_to_e4m3(y);
    } else {
        float top = second ? 255.0f : 127.0f; /* int8 (int4: int4_code) */
        float r = rne(y);
        r = r > top ? top : (r < -top ? -top : r);
        code = (uint32_t)(int32_t)r & 0xFFu;
    }
    if (!second) return code; /* known at compile time */
    return code + (positive & (uint32_t)(code == 0));
}

/*
 * One block of k <= qblock elements: p and g in FP32 (p updated in place), the codes of the
 * block's first element (int4: its byte) and the block's two scales (read, then written).
 */
static inline __attribute__((always_inline)) void block_moments(
    int64_t k, float *restrict p, const float *restrict g, uint8_t *restrict mc,
    uint8_t *restrict vc, float *restrict ms, float *restrict vs, const wo_hyper *h,
    const int adam_w_mode, const int fmt) {
    const float lr = h->lr, b1 = h->beta1, omb1 = h->one_minus_beta1, b2 = h->beta2;
    const float omb2 = h->one_minus_beta2, eps = h->eps, wd = h->weight_decay;
    const float inv_bc1 = h->inv_bias_correction1, inv_bc2 = h->inv_bias_correction2;
    const float m_old = *ms, v_old = *vs;
    float M[WO_QBLOCK_MAX + 1], S[WO_QBLOCK_MAX + 1];
    /* int4: the old moments decoded into M and S first (a loop of its own, through the
     * block's 16-value tables: code value times scale, squared for exp_avg_sq), so the
     * update loop reads every format element by element */
    const int8_t *mq = (const int8_t *)mc;
    /* int4 codes one per byte (unit-stride loops vectorize; nibble pairs do not) */
    int32_t QM[WO_QBLOCK_MAX + 2], QV[WO_QBLOCK_MAX + 2];
    if (fmt == FMT_INT4) {
        float LM[16];
        for (int t = 0; t < 16; ++t) {
            float mag = INT4_MAGS[t < 8 ? t : (t == 8 ? 7 : 16 - t)];
            LM[t] = (t < 8 ? mag : -mag) * m_old;
        }
        for (int64_t j = 0; j < (k + 1) / 2; ++j) {
            uint32_t mb = mc[j], vb = vc[j];
            QM[2 * j] = (int32_t)(mb & 0xFu);
            QM[2 * j + 1] = (int32_t)(mb >> 4);
            QV[2 * j] = (int32_t)(vb & 0xFu);
            QV[2 * j + 1] = (int32_t)(vb >> 4);
        }
        for (int64_t i = 0; i < k; ++i) {
            M[i] = LM[QM[i]];
            float r = ((float)(QV[i] + 1) * 0.0625f) * v_old; /* INT4_ROOTS[QV[i]] * v_old */
            S[i] = r * r;
        }
    }
    uint32_t ma = 0, va = 0;
    for (int64_t i = 0; i < k; ++i) {
        float pi = p[i];
        float gi = g[i];
        if (!adam_w_mode) gi = gi + wd * pi;
        float m_dec = fmt == FMT_INT4 ? M[i] : block_decode(mc, mq, i, fmt, 0, m_old);
        float v_dec = fmt == FMT_INT4 ? S[i] : block_decode(vc, NULL, i, fmt, 1, v_old);
        float mi = b1 * m_dec + omb1 * gi;
        float vi = b2 * v_dec + omb2 * gi * gi;
        float denom = __builtin_sqrtf(vi * inv_bc2) + eps;
        float update = (mi * inv_bc1) / denom;
        if (adam_w_mode) update = update + wd * pi;
        p[i] = pi - lr * update;
        /* what is stored of the second moment: itself (FP8) or its square root */
        float si = fmt == FMT_FP8 ? vi : __builtin_sqrtf(vi);
        M[i] = mi;
        S[i] = si;
        uint32_t mb = f2u(mi) & 0x7FFFFFFFu, sb = f2u(si) & 0x7FFFFFFFu;
        ma = mb > ma ? mb : ma;
        va = sb > va ? sb : va;
    }
    float m_inv, v_inv, m_new, v_new;
    if (fmt == FMT_INT4) {
        m_new = int4_scale(ma, &m_inv);
        v_new = int4_scale(va, &v_inv);
    } else {
        m_new = block_scale(ma, block_headroom(fmt, 0), &m_inv);
        v_new = block_scale(va, block_headroom(fmt, 1), &v_inv);
    }
    *ms = m_new;
    *vs = v_new;
    /* A zero or NaN scale (inverse 0) stores codes 0 (a rare block: its own branch, so the
     * loops below have no per-element condition); otherwise every value is finite. */
    if (m_inv == 0.0f)
        for (int64_t i = 0; i < k; ++i) M[i] = 0.0f;
    if (v_inv == 0.0f)
        for (int64_t i = 0; i < k; ++i) S[i] = 0.0f;
    if (fmt == FMT_INT4) {
        if (k & 1) { /* the odd last element's partner nibble is a zero */
            M[k] = 0.0f;
            S[k] = 0.0f;
        }
        const int64_t even = (k + 1) & ~(int64_t)1;
        for (int64_t i = 0; i < even; ++i) {
            QM[i] = (int32_t)int4_code(M[i] * m_inv, 0);
            QV[i] = (int32_t)int4_code(S[i] * v_inv, 1);
        }
        for (int64_t j = 0; j < even / 2; ++j) {
            mc[j] = (uint8_t)((uint32_t)QM[2 * j] | ((uint32_t)QM[2 * j + 1] << 4));
            vc[j] = (uint8_t)((uint32_t)QV[2 * j] | ((uint32_t)QV[2 * j + 1] << 4));
        }
        return;
    }
    for (int64_t i = 0; i < k; ++i) {
        mc[i] = (uint8_t)block_code(M[i] * m_inv, fmt, 0, 0);
        vc[i] = (uint8_t)block_code(S[i] * v_inv, fmt, 1, (uint32_t)(S[i] > 0.0f));
    }
}

static inline __attribute__((always_inline)) void block_moments_any(
    int64_t k, float *p, const float *g, uint8_t *mc, uint8_t *vc, float *ms, float *vs,
    const wo_hyper *h, const int fmt) {
    if (h->adam_w_mode)
        block_moments(k, p, g, mc, vc, ms, vs, h, 1, fmt);
    else
        block_moments(k, p, g, mc, vc, ms, vs, h, 0, fmt);
}

/* The operands of t's block from element s: its length, FP32 param and gradient (through the
 * tiles P and G where they are stored in another dtype), codes and scales. */
typedef struct {
    int64_t k;
    float *p;
    const float *g;
    uint8_t *mc, *vc;
    float *ms, *vs;
} wo_block_ops;

static inline __attribute__((always_inline)) wo_block_ops block_ops(const wo_tensor *t,
                                                                    int64_t s, float *P,
                                                                    float *G, const int fmt) {
    const int64_t q = t->qblock, byte = fmt == FMT_INT4 ? s / 2 : s;
    wo_block_ops o;
    o.k = t->numel - s < q ? t->numel - s : q;
    o.g = tile_grad(t, s, o.k, G);
    o.p = tile_param(t, s, o.k, P);
    o.mc = (uint8_t *)t->exp_avg + byte;
    o.vc = (uint8_t *)t->exp_avg_sq + byte;
    o.ms = t->m_scales + s / q;
    o.vs = t->v_scales + s / q;
    return o;
}

/* The hand-written loops of the block formats (WO_AVX512 / WO_AVX2 where they build). */
#include "_adamw_cpu_blocks_simd.h"

/* One block through the loops of the family in use (wo_loops). The AVX2 loops take whole
 * steps of 16 only: a block of another length (a tensor's last one) runs the portable loop. */
static inline __attribute__((always_inline)) void block_step(
    int64_t k, float *p, const float *g, uint8_t *mc, uint8_t *vc, float *ms, float *vs,
    const wo_hyper *h, const int fmt) {
    /* FP8 scales at or past 2^120 (only from a checkpoint): the portable loop (see
     * wo_fp8_fold_ok) */
    const int fold = fmt != FMT_FP8 || (wo_fp8_fold_ok(KIND_FP8, *ms) && wo_fp8_fold_ok(KIND_FP8, *vs));
#ifdef WO_AVX2
    if (wo_loops == LOOPS_AVX2 && k % 16 == 0 && fold) {
        wb_block_moments(k, p, g, mc, vc, ms, vs, h, fmt);
        return;
    }
#endif
    block_moments_any(k, p, g, mc, vc, ms, vs, h, fmt);
}

/* The blocks of t that start in [begin, end): each updated whole (see the file's note). */
static inline __attribute__((always_inline)) void block_range(wo_tensor *t, int64_t begin,
                                                               int64_t end, const wo_hyper *h) {
#ifdef WO_AVX512
    if (wo_loops == LOOPS_AVX512) {
        vb_block_range(t, begin, end, h);
        return;
    }
#endif
    float P[WO_QBLOCK_MAX], G[WO_QBLOCK_MAX];
    const int64_t q = t->qblock;
    const int fmt = block_fmt(t->m_kind);
    for (int64_t s = (begin + q - 1) / q * q; s < end; s += q) {
        wo_block_ops o;
        switch (fmt) {
            case FMT_INT8:
                o = block_ops(t, s, P, G, FMT_INT8);
                block_step(o.k, o.p, o.g, o.mc, o.vc, o.ms, o.vs, h, FMT_INT8);
                break;
            case FMT_FP8:
                o = block_ops(t, s, P, G, FMT_FP8);
                block_step(o.k, o.p, o.g, o.mc, o.vc, o.ms, o.vs, h, FMT_FP8);
                break;
            default:
                o = block_ops(t, s, P, G, FMT_INT4);
                block_step(o.k, o.p, o.g, o.mc, o.vc, o.ms, o.vs, h, FMT_INT4);
                break;
        }
        tile_store_param(t, s, o.k, o.p);
    }
}
