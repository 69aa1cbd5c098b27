/*
 * One-pass AdamW for PrecisionAwareAdamW on CPU.
 *
 * torch's fused AdamW needs every operand in one dtype, so moments stored in bf16 beside an
 * FP32 parameter would otherwise be expanded to FP32, updated and re-encoded in separate
 * passes. This loop reads each element once in its stored format, applies Transformer
 * Engine's FusedAdam update in FP32 and writes each result back in its stored format.
 *
 * Build: compiled at first use by wrapped_optim.optimizers.cpu_kernel with
 * -O3 -fno-math-errno -ffp-contract=off. No contraction: every product and sum is rounded on
 * its own, so all clones below (and all machines) give the same bits.
 *
 * Formats: FP32; bf16 (decode exact, encode round-to-nearest-even with quiet NaN 0x7FC0, as
 * torch's float -> bfloat16 conversion); a bf16 parameter plus the int16 low half of its FP32
 * master (TE's store_param_remainders bit arithmetic).
 */
#include <stdint.h>
#include <string.h>

enum { MASTER_NONE = 0, MASTER_FP32 = 1, MASTER_REMAINDER = 2 };
enum { KIND_FP32 = 0, KIND_BF16 = 1 };

#define WO_ABI_VERSION 1

int wo_abi_version(void) { return WO_ABI_VERSION; }

static inline __attribute__((always_inline)) uint32_t f2u(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline __attribute__((always_inline)) float u2f(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t h) {
    return u2f((uint32_t)h << 16);
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float x) {
    uint32_t u = f2u(x);
    uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (x != x) ? (uint16_t)0x7FC0u : (uint16_t)rounded;
}

static inline __attribute__((always_inline)) float load(const void *base, int64_t i, int kind) {
    if (kind == KIND_BF16) return bf16_to_f32(((const uint16_t *)base)[i]);
    return ((const float *)base)[i];
}

static inline __attribute__((always_inline)) void store(void *base, int64_t i, int kind, float x) {
    if (kind == KIND_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

typedef struct {
    float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    float bias_correction1, bias_correction2;
    int adam_w_mode;
} wo_hyper;

/*
 * TE's update, per element:
 *   g' = g + wd * p                      (L2 mode only)
 *   m  = beta1 * m + (1 - beta1) * g'
 *   v  = beta2 * v + (1 - beta2) * g' * g'
 *   u  = (m / bc1) / (sqrt(v / bc2) + eps)
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
    const float bc1 = h->bias_correction1, bc2 = h->bias_correction2;
    for (int64_t i = begin; i < end; ++i) {
        float p;
        if (master_kind == MASTER_NONE) {
            p = ((const float *)param)[i];
        } else if (master_kind == MASTER_FP32) {
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
        float denom = __builtin_sqrtf(v / bc2) + eps;
        float update = (m / bc1) / denom;
        if (adam_w_mode) update = update + wd * p;
        p = p - lr * update;
        store(exp_avg, i, m_kind, m);
        store(exp_avg_sq, i, v_kind, v);
        if (master_kind == MASTER_NONE) {
            ((float *)param)[i] = p;
        } else if (master_kind == MASTER_FP32) {
            ((float *)master)[i] = p;
            ((uint16_t *)param)[i] = f32_to_bf16(p);
        } else {
            uint32_t bits = f2u(p);
            int16_t rem = (int16_t)(bits & 0xFFFFu);
            ((int16_t *)master)[i] = rem;
            ((uint16_t *)param)[i] = (uint16_t)((bits - (uint32_t)(int32_t)rem) >> 16);
        }
    }
}

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define WO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WO_CLONES
#define WO_CLONES
#endif

#define WO_CASE(mk, gk, ak, vk)                                                            \
    case (((mk)*2 + (gk)) * 2 + (ak)) * 2 + (vk):                                          \
        if (h->adam_w_mode)                                                                \
            adamw_range(begin, end, param, master, grad, exp_avg, exp_avg_sq, h, 1, mk, gk, \
                        ak, vk);                                                           \
        else                                                                               \
            adamw_range(begin, end, param, master, grad, exp_avg, exp_avg_sq, h, 0, mk, gk, \
                        ak, vk);                                                           \
        return 0;

#define WO_CASES_FOR_MASTER(mk)                                          \
    WO_CASE(mk, 0, 0, 0) WO_CASE(mk, 0, 0, 1) WO_CASE(mk, 0, 1, 0)       \
    WO_CASE(mk, 0, 1, 1) WO_CASE(mk, 1, 0, 0) WO_CASE(mk, 1, 0, 1)       \
    WO_CASE(mk, 1, 1, 0) WO_CASE(mk, 1, 1, 1)

/*
 * Updates elements [begin, end). Returns 0, or -1 for a kind outside the enums above (the
 * Python side validates first; this is a last guard, never a silent no-op).
 */
WO_CLONES int wo_adamw_step(int64_t begin, int64_t end, void *param, void *master,
                            int master_kind, const void *grad, int grad_kind, void *exp_avg,
                            int m_kind, void *exp_avg_sq, int v_kind, const wo_hyper *h) {
    if (master_kind < 0 || master_kind > 2 || grad_kind < 0 || grad_kind > 1 || m_kind < 0 ||
        m_kind > 1 || v_kind < 0 || v_kind > 1)
        return -1;
    switch (((master_kind * 2 + grad_kind) * 2 + m_kind) * 2 + v_kind) {
        WO_CASES_FOR_MASTER(MASTER_NONE)
        WO_CASES_FOR_MASTER(MASTER_FP32)
        WO_CASES_FOR_MASTER(MASTER_REMAINDER)
        default:
            return -1;
    }
}
