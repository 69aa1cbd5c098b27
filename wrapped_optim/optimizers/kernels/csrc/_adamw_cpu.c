/*
 * One-pass AdamW for PrecisionAwareAdamW on CPU.
 *
 * torch's fused AdamW needs every operand in one dtype, so moments stored in bf16 beside an
 * FP32 parameter would otherwise be expanded to FP32, updated and re-encoded in separate
 * passes. This loop reads each element once in its stored format, applies Transformer
 * Engine's FusedAdam update in FP32 and writes each result back in its stored format.
 *
 * Build: compiled at first use by wrapped_optim.optimizers.cpu_kernel with
 * -O3 -fno-math-errno -ffp-contract=off, and -fopenmp where the compiler has it. No contraction: every product and sum is rounded on
 * its own, so all clones below (and all machines) give the same bits.
 *
 * Formats: FP32; bf16 (decode exact, encode round-to-nearest-even, NaN as the quiet NaN
 * 0x7FC0, as torch's scalar float -> bfloat16 conversion); a bf16 parameter plus the int16 low half of its FP32
 * master (TE's store_param_remainders bit arithmetic); moments in fp16 or FP8 E4M3 relative to a
 * per-tensor scale (wrapped_optim._formats.codecs: decode = stored value times a multiplier, encode =
 * value times a multiplier, rounded to nearest even, FP8 saturated to +-448). A scaled moment's
 * new scale needs the amax of the whole updated tensor, so those tensors take two passes: pass 1
 * computes only the new scaled moments and their amax (reading the gradient and those moments,
 * nothing is written), Python derives the scales with the codecs' own functions, pass 0 redoes
 * the same arithmetic and writes everything. Each pass is one fused loop per combination of
 * moment formats (split_range); the conversions are integer bit arithmetic and selects on
 * 32-bit lanes, so those loops vectorize. Where the CPU has AVX-512 with VBMI and F16C, the
 * scaled combinations run the hand-written loops of _adamw_cpu_avx512.h instead, else where it
 * has AVX2 and F16C those of _adamw_cpu_avx2.h (same bits; wo_set_loops picks another
 * family this CPU has).
 * Every call runs with MXCSR's FTZ and DAZ off (wo_ieee_begin).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h> /* MXCSR, non-temporal stores */
#endif

/* MASTER_FP32_COPY: an FP32 master whose FP32 param receives its exact value (a host copy and
 * the param it stands for, updated in one pass). */
enum { MASTER_NONE = 0, MASTER_FP32 = 1, MASTER_REMAINDER = 2, MASTER_FP32_COPY = 3 };
enum { KIND_FP32 = 0, KIND_BF16 = 1, KIND_FP16 = 2, KIND_FP8 = 3 };
/* Block-scaled moments (both moments of a tensor in one of them; _adamw_cpu_blocks.h). */
enum { KIND_INT8_BLOCK = 5, KIND_FP8_BLOCK = 6, KIND_INT4_BLOCK = 7 };
enum { PASS_WRITE = 0, PASS_AMAX = 1 };

#define WO_ABI_VERSION 10

int wo_abi_version(void) { return WO_ABI_VERSION; }

/* Bit casts and the exact FP32 <-> bf16 / fp16 / FP8 E4M3 conversions (portable C). */
#include "_adamw_cpu_formats.h"

typedef struct {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    float inv_bias_correction1, inv_bias_correction2;
    int adam_w_mode;
} wo_hyper;

/* One tensor's operands and how each is stored (the enums above). A scaled (fp16/FP8) moment
 * is decoded with its *_decode multiplier and encoded with its *_encode multiplier; pass 1 ORs
 * the bits of the largest |new value| into *_amax (FP32 bits of a non-negative value, or of a
 * NaN: the unsigned order of those bits is the order of the values, NaN above inf). */
typedef struct {
    void *param;
    void *master;
    const void *grad;
    void *exp_avg;
    void *exp_avg_sq;
    int64_t numel;
    int master_kind, grad_kind, m_kind, v_kind;
    float m_decode, v_decode, m_encode, v_encode;
    uint32_t m_amax, v_amax;
    /* block-scaled moments: one scale per qblock values of each moment (read and written) */
    float *m_scales, *v_scales;
    int64_t qblock;
} wo_tensor;

static inline __attribute__((always_inline)) int is_scaled(int kind) {
    return kind == KIND_FP16 || kind == KIND_FP8;
}

/* Whether a decode multiplier of E4M3 codes may carry a factor 2^8 (the AVX2 and block loops
 * decode a code into the fp16 of its value times 2^-8): mult * 2^8 is then exact, and
 * h * (mult * 2^8) rounds the same real product as (h * 2^8) * mult. Not for |mult| >= 2^120
 * (finite): the factor would overflow; those multipliers run the portable loops. */
static inline __attribute__((always_inline)) int wo_fp8_fold_ok(int kind, float mult) {
    float a = __builtin_fabsf(mult);
    return kind != KIND_FP8 || !(a >= 0x1p120f && a <= 0x1.fffffep127f);
}

/* A moment the amax pass does not read (it is not scaled: pass 0 updates it). */
#define KIND_SKIP 4

/* One moment value in FP32: stored value times the decode multiplier (scaled formats). */
static inline __attribute__((always_inline)) float decode_moment(const void *base, int64_t i,
                                                                int kind, float mult) {
    switch (kind) {
        case KIND_FP32:
            return ((const float *)base)[i];
        case KIND_BF16:
            return bf16_to_f32(((const uint16_t *)base)[i]);
        case KIND_FP16:
            return f16_to_f32(((const uint16_t *)base)[i]) * mult;
        default:
            return e4m3_to_f32(((const uint8_t *)base)[i]) * mult;
    }
}

/* One new moment value stored: scaled formats are multiplied by the encode multiplier first,
 * FP8 then saturated to +-448 (NaN stays NaN), as codecs.encode_into. */
static inline __attribute__((always_inline)) void encode_moment(void *base, int64_t i, int kind,
                                                               float mult, float x) {
    switch (kind) {
        case KIND_FP32:
            ((float *)base)[i] = x;
            break;
        case KIND_BF16:
            ((uint16_t *)base)[i] = f32_to_bf16(x);
            break;
        case KIND_FP16:
            ((uint16_t *)base)[i] = f32_to_f16(x * mult);
            break;
        default: {
            float y = x * mult;
            y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
            ((uint8_t *)base)[i] = f32_to_e4m3(y);
            break;
        }
    }
}

static inline __attribute__((always_inline)) const void *offset(const void *base, int64_t i,
                                                               int kind) {
    static const int width[] = {4, 2, 2, 1, 0};
    return (const char *)base + i * width[kind];
}

/*
 * Pass 0 of the split loop over k elements: the parameter p and gradient g in FP32 (in place
 * in the tensor, or in a tile the caller decoded), the moments in their stored formats (kinds
 * known at compile time, so each combination is one fused, vectorized loop). The same
 * operations in the same order as adamw_range.
 */
static inline __attribute__((always_inline)) void moments_write(
    int64_t k, float *restrict p, const float *restrict g, void *restrict m, void *restrict v,
    const wo_tensor *t, const wo_hyper *h, const int adam_w_mode, const int mk, const int vk) {
    const float lr = h->lr, b1 = h->beta1, omb1 = h->one_minus_beta1, b2 = h->beta2;
    const float omb2 = h->one_minus_beta2, eps = h->eps, wd = h->weight_decay;
    const float inv_bc1 = h->inv_bias_correction1, inv_bc2 = h->inv_bias_correction2;
    const float m_dec = t->m_decode, v_dec = t->v_decode;
    const float m_enc = t->m_encode, v_enc = t->v_encode;
    for (int64_t i = 0; i < k; ++i) {
        float pi = p[i];
        float gi = g[i];
        if (!adam_w_mode) gi = gi + wd * pi;
        float mi = b1 * decode_moment(m, i, mk, m_dec) + omb1 * gi;
        float vi = b2 * decode_moment(v, i, vk, v_dec) + omb2 * gi * gi;
        float denom = __builtin_sqrtf(vi * inv_bc2) + eps;
        float update = (mi * inv_bc1) / denom;
        if (adam_w_mode) update = update + wd * pi;
        p[i] = pi - lr * update;
        encode_moment(m, i, mk, m_enc, mi);
        encode_moment(v, i, vk, v_enc, vi);
    }
}

/* Pass 1 of the split loop: only the new scaled moments (a KIND_SKIP one is not read), folded
 * into the largest magnitude's bits. p is read in L2 mode only (the gradient needs it). */
static inline __attribute__((always_inline)) void moments_amax(
    int64_t k, const float *restrict p, const float *restrict g, const void *restrict m,
    const void *restrict v, const wo_tensor *t, const wo_hyper *h, const int adam_w_mode,
    const int mk, const int vk, uint32_t *m_amax, uint32_t *v_amax) {
    const float b1 = h->beta1, omb1 = h->one_minus_beta1, b2 = h->beta2;
    const float omb2 = h->one_minus_beta2, wd = h->weight_decay;
    const float m_dec = t->m_decode, v_dec = t->v_decode;
    uint32_t ma = *m_amax, va = *v_amax;
    for (int64_t i = 0; i < k; ++i) {
        float gi = g[i];
        if (!adam_w_mode) gi = gi + wd * p[i];
        if (mk != KIND_SKIP) {
            uint32_t b = f2u(b1 * decode_moment(m, i, mk, m_dec) + omb1 * gi) & 0x7FFFFFFFu;
            ma = b > ma ? b : ma;
        }
        if (vk != KIND_SKIP) {
            uint32_t b = f2u(b2 * decode_moment(v, i, vk, v_dec) + omb2 * gi * gi) & 0x7FFFFFFFu;
            va = b > va ? b : va;
        }
    }
    *m_amax = ma;
    *v_amax = va;
}

#define WO_WRITE_CASE(mk, vk)                                              \
    case (mk)*4 + (vk):                                                    \
        if (adam_w_mode)                                                   \
            moments_write(k, p, g, m, v, t, h, 1, mk, vk);                 \
        else                                                               \
            moments_write(k, p, g, m, v, t, h, 0, mk, vk);                 \
        break;
#define WO_WRITE_CASES(mk) \
    WO_WRITE_CASE(mk, 0) WO_WRITE_CASE(mk, 1) WO_WRITE_CASE(mk, 2) WO_WRITE_CASE(mk, 3)

#define WO_AMAX_CASE(mk, vk)                                                       \
    case (mk)*5 + (vk):                                                            \
        if (adam_w_mode)                                                           \
            moments_amax(k, p, g, m, v, t, h, 1, mk, vk, m_amax, v_amax);          \
        else                                                                       \
            moments_amax(k, p, g, m, v, t, h, 0, mk, vk, m_amax, v_amax);          \
        break;

static inline __attribute__((always_inline)) void split_moments(
    int64_t k, float *p, const float *g, void *m, void *v, const wo_tensor *t, const wo_hyper *h,
    int pass, uint32_t *m_amax, uint32_t *v_amax) {
    const int adam_w_mode = h->adam_w_mode;
    if (pass == PASS_WRITE) {
        switch (t->m_kind * 4 + t->v_kind) {
            WO_WRITE_CASES(KIND_FP32)
            WO_WRITE_CASES(KIND_BF16)
            WO_WRITE_CASES(KIND_FP16)
            WO_WRITE_CASES(KIND_FP8)
        }
        return;
    }
    int mk = is_scaled(t->m_kind) ? t->m_kind : KIND_SKIP;
    int vk = is_scaled(t->v_kind) ? t->v_kind : KIND_SKIP;
    switch (mk * 5 + vk) {
        WO_AMAX_CASE(KIND_FP16, KIND_FP16)
        WO_AMAX_CASE(KIND_FP16, KIND_FP8)
        WO_AMAX_CASE(KIND_FP16, KIND_SKIP)
        WO_AMAX_CASE(KIND_FP8, KIND_FP16)
        WO_AMAX_CASE(KIND_FP8, KIND_FP8)
        WO_AMAX_CASE(KIND_FP8, KIND_SKIP)
        WO_AMAX_CASE(KIND_SKIP, KIND_FP16)
        WO_AMAX_CASE(KIND_SKIP, KIND_FP8)
    }
}

static inline __attribute__((always_inline)) void atomic_max_u32(uint32_t *slot, uint32_t value) {
    uint32_t seen = __atomic_load_n(slot, __ATOMIC_RELAXED);
    while (value > seen &&
           !__atomic_compare_exchange_n(slot, &seen, value, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/*
 * Which loops run the fp16/FP8 moment combinations: the portable ones above, or the
 * hand-written ones of one vector family. The family is chosen when the library is loaded
 * (the best this CPU has) and may be changed between steps (wo_set_loops: the tests and the
 * benchmark run every family this CPU supports); every family gives the same bits.
 */
enum { LOOPS_PORTABLE = 0, LOOPS_AVX2 = 1, LOOPS_AVX512 = 2 };
static int wo_loops = LOOPS_PORTABLE;

/* The body of a hand-written split_moments: every scaled combination of moment formats,
 * dispatched to write_fn (pass 0) or amax_fn (pass 1) with the kinds as constants, so each
 * combination is one loop. */
#define WO_SCALED_WRITE_CASE(fn, mk, vk)                \
    case (mk)*4 + (vk):                                 \
        if (h->adam_w_mode)                             \
            fn(k, p, g, m, v, t, h, 1, mk, vk);         \
        else                                            \
            fn(k, p, g, m, v, t, h, 0, mk, vk);         \
        return;
#define WO_SCALED_AMAX_CASE(fn, mk, vk)                                 \
    case (mk)*5 + (vk):                                                 \
        if (h->adam_w_mode)                                             \
            fn(k, p, g, m, v, t, h, 1, mk, vk, m_amax, v_amax);         \
        else                                                            \
            fn(k, p, g, m, v, t, h, 0, mk, vk, m_amax, v_amax);         \
        return;
#define WO_SCALED_SPLIT(write_fn, amax_fn)                                    \
    if (pass == PASS_WRITE) {                                                 \
        switch (t->m_kind * 4 + t->v_kind) {                                  \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP32, KIND_FP16)              \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP32, KIND_FP8)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_BF16, KIND_FP16)              \
            WO_SCALED_WRITE_CASE(write_fn, KIND_BF16, KIND_FP8)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP16, KIND_FP32)              \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP16, KIND_BF16)              \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP16, KIND_FP16)              \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP16, KIND_FP8)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP8, KIND_FP32)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP8, KIND_BF16)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP8, KIND_FP16)               \
            WO_SCALED_WRITE_CASE(write_fn, KIND_FP8, KIND_FP8)                \
        }                                                                     \
        return;                                                               \
    }                                                                         \
    switch ((is_scaled(t->m_kind) ? t->m_kind : KIND_SKIP) * 5 +              \
            (is_scaled(t->v_kind) ? t->v_kind : KIND_SKIP)) {                 \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP16, KIND_FP16)                    \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP16, KIND_FP8)                     \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP16, KIND_SKIP)                    \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP8, KIND_FP16)                     \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP8, KIND_FP8)                      \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_FP8, KIND_SKIP)                     \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_SKIP, KIND_FP16)                    \
        WO_SCALED_AMAX_CASE(amax_fn, KIND_SKIP, KIND_FP8)                     \
    }

/* The hand-written loops of the fp16/FP8 moments: AVX-512 (WO_AVX512 where they build) and
 * AVX2 (WO_AVX2). */
#include "_adamw_cpu_avx512.h"
#include "_adamw_cpu_avx2.h"

/* 1 when this CPU (and this build) can run a loop family, else 0 (-1: no such family). */
int wo_loops_supported(int family) {
    switch (family) {
        case LOOPS_PORTABLE:
            return 1;
        case LOOPS_AVX2:
#ifdef WO_AVX2
            return wo_detect_avx2();
#else
            return 0;
#endif
        case LOOPS_AVX512:
#ifdef WO_AVX512
            return wo_detect_avx512();
#else
            return 0;
#endif
        default:
            return -1;
    }
}

/* The tables are filled and the best family chosen when the library is loaded: before any
 * call, so no thread ever sees a half-filled table. */
__attribute__((constructor)) static void wo_init_loops(void) {
#ifdef WO_AVX512
    wo_fill_e4m3_tables();
#endif
    wo_loops = wo_loops_supported(LOOPS_AVX512) == 1
                   ? LOOPS_AVX512
                   : (wo_loops_supported(LOOPS_AVX2) == 1 ? LOOPS_AVX2 : LOOPS_PORTABLE);
}

/* The family the fp16/FP8 moments run now (LOOPS_*). */
int wo_get_loops(void) { return wo_loops; }

/* Runs the fp16/FP8 moments with `family` from the next call on; returns it, or -1 (nothing
 * changed) when this CPU or build cannot run it. Not while a step runs. */
int wo_set_loops(int family) {
    if (wo_loops_supported(family) != 1) return -1;
    wo_loops = family;
    return family;
}

/*
 * The split loop, for scaled moments, mixed moment formats and L2 mode: WO_TILE elements at a
 * time, the parameter and gradient are FP32 pointers into the tensors where they are stored in
 * FP32 (updated in place), else decoded into FP32 tiles on the stack (a bf16 gradient, a bf16
 * parameter with its remainder) and written back from there; the moments are read and written
 * in their formats inside one fused loop per combination of moment formats. Memory traffic is
 * one read and one write of each stored element in pass 0, and in pass 1 one read of what the
 * new scaled moments need (gradient, those moments, the parameter in L2 mode only).
 */
#define WO_TILE 512

/* The FP32 gradient of elements [s, s + k): in place, or decoded into the tile G. */
static inline __attribute__((always_inline)) const float *tile_grad(const wo_tensor *t,
                                                                    int64_t s, int64_t k,
                                                                    float *G) {
    if (t->grad_kind != KIND_BF16) return (const float *)t->grad + s;
    const uint16_t *src = (const uint16_t *)t->grad + s;
    for (int64_t i = 0; i < k; ++i) G[i] = bf16_to_f32(src[i]);
    return G;
}

/* The FP32 value updated for elements [s, s + k): the param or master in place, or a bf16
 * param joined with its remainder in the tile P. */
static inline __attribute__((always_inline)) float *tile_param(const wo_tensor *t, int64_t s,
                                                              int64_t k, float *P) {
    const int mk = t->master_kind;
    if (mk == MASTER_NONE) return (float *)t->param + s;
    if (mk == MASTER_FP32 || mk == MASTER_FP32_COPY) return (float *)t->master + s;
    const uint16_t *hi = (const uint16_t *)t->param + s;
    const int16_t *lo = (const int16_t *)t->master + s;
    for (int64_t i = 0; i < k; ++i) P[i] = u2f(((uint32_t)hi[i] << 16) + (uint32_t)(int32_t)lo[i]);
    return P;
}

/* TE's store_param_remainders split of an FP32 master x into the bf16 parameter *hi (its high
 * bits rounded half away from zero) and the int16 remainder *lo (its low bits); a NaN into the
 * bf16 quiet NaN and remainder 0 (its bits would round to any bf16, -0.0 for CUDA's
 * 0x7FFFFFFF; wrapped_optim._formats.remainders says why). Selects only: the loops vectorize. */
static inline __attribute__((always_inline)) void split_remainder(float x, uint16_t *hi,
                                                                  int16_t *lo) {
    const uint32_t bits = f2u(x);
    const int nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
    const int16_t rem = nan ? (int16_t)0 : (int16_t)(bits & 0xFFFFu);
    *lo = rem;
    *hi = nan ? (uint16_t)0x7FC0u : (uint16_t)((bits - (uint32_t)(int32_t)rem) >> 16);
}

/* After the update of [s, s + k) in p (tile_param's pointer): the param (and remainder)
 * written from it, where the value updated is not the param itself. */
static inline __attribute__((always_inline)) void tile_store_param(const wo_tensor *t, int64_t s,
                                                                   int64_t k, const float *p) {
    const int mk = t->master_kind;
    if (mk == MASTER_FP32) {
        uint16_t *out = (uint16_t *)t->param + s;
        for (int64_t i = 0; i < k; ++i) out[i] = f32_to_bf16(p[i]);
    } else if (mk == MASTER_FP32_COPY) {
        float *out = (float *)t->param + s;
        for (int64_t i = 0; i < k; ++i) out[i] = p[i];
    } else if (mk == MASTER_REMAINDER) {
        uint16_t *hi = (uint16_t *)t->param + s;
        int16_t *lo = (int16_t *)t->master + s;
        for (int64_t i = 0; i < k; ++i) split_remainder(p[i], hi + i, lo + i);
    }
}

static inline __attribute__((always_inline)) void split_range(wo_tensor *t, int64_t begin,
                                                               int64_t end, const wo_hyper *h,
                                                               int pass) {
    float P[WO_TILE], G[WO_TILE];
    uint32_t m_amax = 0, v_amax = 0;
    const int need_p = pass == PASS_WRITE || !h->adam_w_mode;
    for (int64_t s = begin; s < end; s += WO_TILE) {
        int64_t k = end - s < WO_TILE ? end - s : WO_TILE;
        const float *g = tile_grad(t, s, k, G);
        float *p = need_p ? tile_param(t, s, k, P) : NULL;
        void *m = (void *)offset(t->exp_avg, s, t->m_kind);
        void *v = (void *)offset(t->exp_avg_sq, s, t->v_kind);
        const int scaled = is_scaled(t->m_kind) || is_scaled(t->v_kind);
#ifdef WO_AVX512
        if (scaled && wo_loops == LOOPS_AVX512)
            v_split_moments(k, p, g, m, v, t, h, pass, &m_amax, &v_amax);
        else
#endif
#ifdef WO_AVX2
        if (scaled && wo_loops == LOOPS_AVX2 && wo_fp8_fold_ok(t->m_kind, t->m_decode) &&
            wo_fp8_fold_ok(t->v_kind, t->v_decode))
            w_split_moments(k, p, g, m, v, t, h, pass, &m_amax, &v_amax);
        else
#endif
            split_moments(k, p, g, m, v, t, h, pass, &m_amax, &v_amax);
        if (pass == PASS_AMAX) continue;
        tile_store_param(t, s, k, p);
    }
    if (pass == PASS_AMAX) {
        atomic_max_u32(&t->m_amax, m_amax);
        atomic_max_u32(&t->v_amax, v_amax);
    }
}

/* The block-scaled moments' one-pass loop. */
#include "_adamw_cpu_blocks.h"

/*
 * TE's update, per element, with the bias corrections applied as multiplications by their
 * reciprocals (one division per element instead of three):
 *   g' = g + wd * p                      (L2 mode only)
 *   m  = beta1 * m + (1 - beta1) * g'
 *   v  = beta2 * v + (1 - beta2) * g' * g'
 *   u  = (m * (1 / bc1)) / (sqrt(v * (1 / bc2)) + eps)
 *   u += wd * p                          (AdamW mode only)
 *   p  = p - lr * u
 */
static inline __attribute__((always_inline)) void adamw_range(
    int64_t begin, int64_t end, void *restrict param, void *restrict master,
    const void *restrict grad, void *restrict exp_avg, void *restrict exp_avg_sq,
    const wo_hyper *h, const int adam_w_mode, const int master_kind, const int grad_kind,
    const int m_kind, const int v_kind) {
    const float lr = h->lr, b1 = h->beta1, omb1 = h->one_minus_beta1, b2 = h->beta2;
    const float omb2 = h->one_minus_beta2, eps = h->eps, wd = h->weight_decay;
    const float inv_bc1 = h->inv_bias_correction1, inv_bc2 = h->inv_bias_correction2;
    for (int64_t i = begin; i < end; ++i) {
        float p;
        if (master_kind == MASTER_NONE) {
            p = ((const float *)param)[i];
        } else if (master_kind == MASTER_FP32 || master_kind == MASTER_FP32_COPY) {
            p = ((const float *)master)[i];
        } else {
            uint32_t high = (uint32_t)((const uint16_t *)param)[i] << 16;
            uint32_t low = (uint32_t)(int32_t)((const int16_t *)master)[i];
            p = u2f(high + low);
        }
        float g = load(grad, i, grad_kind);
        float m = load(exp_avg, i, m_kind);
        float v = load(exp_avg_sq, i, v_kind);
        if (!adam_w_mode) g = g + wd * p;
        m = b1 * m + omb1 * g;
        v = b2 * v + omb2 * g * g;
        float denom = __builtin_sqrtf(v * inv_bc2) + eps;
        float update = (m * inv_bc1) / denom;
        if (adam_w_mode) update = update + wd * p;
        p = p - lr * update;
        store(exp_avg, i, m_kind, m);
        store(exp_avg_sq, i, v_kind, v);
        if (master_kind == MASTER_NONE) {
            ((float *)param)[i] = p;
        } else if (master_kind == MASTER_FP32) {
            ((float *)master)[i] = p;
            ((uint16_t *)param)[i] = f32_to_bf16(p);
        } else if (master_kind == MASTER_FP32_COPY) {
            ((float *)master)[i] = p;
            ((float *)param)[i] = p;
        } else {
            split_remainder(p, (uint16_t *)param + i, (int16_t *)master + i);
        }
    }
}

/* Clones need the loader's ifunc support (glibc/ELF); elsewhere the baseline build runs.
 * -DWO_NO_CLONES builds the baseline alone (the tests compare it with the clones). */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && \
    !defined(WO_NO_CLONES)
#if __has_attribute(target_clones)
#define WO_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
#endif
#ifndef WO_CLONES
#define WO_CLONES
#endif

/* The common formats (AdamW mode, both moments FP32 or both bf16) get a loop of their own,
 * each operand loaded and stored in its format inline; every other combination (scaled
 * moments, mixed moment formats, L2 mode) goes through the tile loop, which does the same
 * operations in the same order. Fewer instantiations keep the build short (three clones). */
#define WO_CASE(mk, gk, k)                                                               \
    case ((mk)*2 + (gk)) * 2 + (k):                                                      \
        adamw_range(begin, end, t->param, t->master, t->grad, t->exp_avg, t->exp_avg_sq, \
                    h, 1, mk, gk, k, k);                                                 \
        return 0;

#define WO_CASES_FOR_MASTER(mk) WO_CASE(mk, 0, 0) WO_CASE(mk, 0, 1) WO_CASE(mk, 1, 0) WO_CASE(mk, 1, 1)

/* dst[0, n) = src[0, n), the aligned middle with non-temporal stores: dst's cache lines are
 * written without being read first (a plain store reads each line before writing it). */
static inline __attribute__((always_inline)) void stream_copy(float *restrict dst,
                                                              const float *restrict src,
                                                              int64_t n) {
    int64_t i = 0;
#if defined(__x86_64__)
    for (; i < n && ((uintptr_t)(dst + i) & 15u); ++i) dst[i] = src[i];
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
#endif
    for (; i < n; ++i) dst[i] = src[i];
}

/* An FP32 master whose FP32 param gets its value, in the common formats: the master is
 * updated in place (as a param without master) a tile at a time, and each tile is streamed
 * into the param while it is still in cache: 4 bytes per element for the param instead of 8. */
#define WO_COPY_TILE 2048
static inline __attribute__((always_inline)) void copy_master_range(wo_tensor *t, int64_t begin,
                                                                   int64_t end,
                                                                   const wo_hyper *h) {
    for (int64_t s = begin; s < end; s += WO_COPY_TILE) {
        int64_t e = end - s < WO_COPY_TILE ? end : s + WO_COPY_TILE;
        switch (t->grad_kind * 2 + t->m_kind) {
            case 0:
                adamw_range(s, e, t->master, NULL, t->grad, t->exp_avg, t->exp_avg_sq, h, 1,
                            MASTER_NONE, KIND_FP32, KIND_FP32, KIND_FP32);
                break;
            case 1:
                adamw_range(s, e, t->master, NULL, t->grad, t->exp_avg, t->exp_avg_sq, h, 1,
                            MASTER_NONE, KIND_FP32, KIND_BF16, KIND_BF16);
                break;
            case 2:
                adamw_range(s, e, t->master, NULL, t->grad, t->exp_avg, t->exp_avg_sq, h, 1,
                            MASTER_NONE, KIND_BF16, KIND_FP32, KIND_FP32);
                break;
            default:
                adamw_range(s, e, t->master, NULL, t->grad, t->exp_avg, t->exp_avg_sq, h, 1,
                            MASTER_NONE, KIND_BF16, KIND_BF16, KIND_BF16);
                break;
        }
        stream_copy((float *)t->param + s, (const float *)t->master + s, e - s);
    }
}

static inline __attribute__((always_inline)) int adamw_tensor(wo_tensor *t, int64_t begin,
                                                              int64_t end, const wo_hyper *h,
                                                              int pass) {
    if (t->m_kind >= KIND_INT8_BLOCK) { /* block scales are local: one pass, no amax pass */
        if (pass == PASS_WRITE) block_range(t, begin, end, h);
        return 0;
    }
    int scaled = is_scaled(t->m_kind) || is_scaled(t->v_kind);
    if (pass == PASS_AMAX && !scaled) return 0; /* nothing to measure: pass 0 updates it */
    if (scaled || !h->adam_w_mode || t->m_kind != t->v_kind) {
        split_range(t, begin, end, h, pass);
        return 0;
    }
    if (t->master_kind == MASTER_FP32_COPY) {
        copy_master_range(t, begin, end, h);
        return 0;
    }
    switch ((t->master_kind * 2 + t->grad_kind) * 2 + t->m_kind) {
        WO_CASES_FOR_MASTER(MASTER_NONE)
        WO_CASES_FOR_MASTER(MASTER_FP32)
        WO_CASES_FOR_MASTER(MASTER_REMAINDER)
        default:
            return -1;
    }
}

static int wo_kinds_ok(const wo_tensor *tensors, int64_t count) {
    for (int64_t k = 0; k < count; ++k) {
        const wo_tensor *t = &tensors[k];
        if (t->master_kind < 0 || t->master_kind > 3 || t->grad_kind < 0 || t->grad_kind > 1)
            return 0;
        if (t->m_kind >= KIND_INT8_BLOCK) { /* both moments in one block format */
            if (t->m_kind > KIND_INT4_BLOCK || t->v_kind != t->m_kind || t->qblock < 2 ||
                t->qblock > WO_QBLOCK_MAX || (t->qblock & 1) || !t->m_scales || !t->v_scales)
                return 0;
            continue;
        }
        if (t->m_kind < 0 || t->m_kind > 3 || t->v_kind < 0 || t->v_kind > 3) return 0;
    }
    return 1;
}

/* Where a thread is in the tensors laid end to end: blocks it takes only move forward. */
typedef struct {
    int64_t tensor, offset;
} wo_cursor;

/* Updates elements [begin, end) of the tensors laid end to end. */
WO_CLONES static void wo_update_range(wo_tensor *tensors, int64_t count, int64_t begin,
                                      int64_t end, const wo_hyper *h, int pass, wo_cursor *at) {
    while (at->tensor < count && at->offset + tensors[at->tensor].numel <= begin) {
        at->offset += tensors[at->tensor].numel;
        at->tensor++;
    }
    int64_t offset = at->offset;
    for (int64_t k = at->tensor; k < count && offset < end; ++k) {
        wo_tensor *t = &tensors[k];
        int64_t lo = begin > offset ? begin - offset : 0;
        int64_t hi = end - offset < t->numel ? end - offset : t->numel;
        if (lo < hi) adamw_tensor(t, lo, hi, h, pass);
        offset += t->numel;
    }
}

/*
 * Threads share the work in blocks of `block` elements (a multiple of 64: no two threads
 * write one cache line within a tensor), taken from a counter, so a thread that starts late
 * simply takes fewer blocks. The threads are OpenMP's (built with -fopenmp): the library
 * names libgomp.so.1, which the loader resolves to the runtime torch has already loaded, so
 * the kernel runs on torch's own worker threads, still spinning from torch's last parallel
 * op (a pool of our own had to wake its threads and shared the cores with torch's spinning
 * ones). Built without OpenMP, the pragma is ignored and the calling thread does all the work.
 * The split never changes a result: every element is updated by the same operations
 * whichever thread runs it.
 */
typedef struct {
    wo_tensor *tensors;
    int64_t count, total, blocks, block;
    const wo_hyper *h;
    int pass;
    atomic_llong next;
} wo_job;

/*
 * Every thread runs the loops with MXCSR's DAZ and FTZ off: subnormal inputs and results are
 * kept (IEEE), whatever the caller set (torch.set_flush_denormal sets both), so the bits do not
 * depend on it, and the AVX-512 FP8 decode, which builds subnormal FP32 values, is exact.
 */
#if defined(__x86_64__) || defined(__i386__)
static inline unsigned int wo_ieee_begin(void) {
    unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved & ~0x8040u); /* FTZ (bit 15) and DAZ (bit 6) off */
    return saved;
}
/* Also orders this thread's non-temporal stores (stream_copy) before the call returns. */
static inline void wo_ieee_end(unsigned int saved) {
    _mm_sfence();
    _mm_setcsr(saved);
}
#else
static inline unsigned int wo_ieee_begin(void) { return 0; }
static inline void wo_ieee_end(unsigned int saved) { (void)saved; }
#endif

static void wo_take_blocks(wo_job *job) {
    unsigned int csr = wo_ieee_begin();
    wo_cursor at = {0, 0};
    for (;;) {
        long long b = atomic_fetch_add(&job->next, 1);
        if (b >= job->blocks) break;
        int64_t begin = (int64_t)b * job->block;
        int64_t end = begin + job->block < job->total ? begin + job->block : job->total;
        wo_update_range(job->tensors, job->count, begin, end, job->h, job->pass, &at);
    }
    wo_ieee_end(csr);
}

#define WO_MAX_THREADS 256

/* 1 when built with OpenMP (threads > 1 can run in parallel), else 0. */
int wo_parallel(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/*
 * Updates all elements of the tensors with up to `threads` threads (the caller included);
 * with pass PASS_AMAX only measures the new amax of the scaled moments (writing nothing but
 * the *_amax fields). Returns 0, -1 for an operand kind outside the enums above (the Python
 * side validates first; this is a last guard, never a silent no-op) or -2 for a bad thread
 * count, block size or pass.
 */
int wo_adamw_step(wo_tensor *tensors, int64_t count, int64_t total, int threads, int64_t block,
                  const wo_hyper *h, int pass) {
    if (!wo_kinds_ok(tensors, count)) return -1;
    if (threads < 1 || threads > WO_MAX_THREADS || block < 64 || block % 64 != 0) return -2;
    if (pass != PASS_WRITE && pass != PASS_AMAX) return -2;
    int64_t blocks = (total + block - 1) / block;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
    if (threads == 1) {
        unsigned int csr = wo_ieee_begin();
        wo_cursor at = {0, 0};
        wo_update_range(tensors, count, 0, total, h, pass, &at);
        wo_ieee_end(csr);
        return 0;
    }
    wo_job job = {tensors, count, total, blocks, block, h, pass, 0};
#pragma omp parallel num_threads(threads)
    wo_take_blocks(&job);
    return 0;
}
