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
 * master (TE's store_param_remainders bit arithmetic).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

enum { MASTER_NONE = 0, MASTER_FP32 = 1, MASTER_REMAINDER = 2 };
enum { KIND_FP32 = 0, KIND_BF16 = 1 };

#define WO_ABI_VERSION 6

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
    float inv_bias_correction1, inv_bias_correction2;
    int adam_w_mode;
} wo_hyper;

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
        } else {
            uint32_t bits = f2u(p);
            int16_t rem = (int16_t)(bits & 0xFFFFu);
            ((int16_t *)master)[i] = rem;
            ((uint16_t *)param)[i] = (uint16_t)((bits - (uint32_t)(int32_t)rem) >> 16);
        }
    }
}

/* Clones need the loader's ifunc support (glibc/ELF); elsewhere the baseline build runs.
 * -DWO_NO_CLONES builds the baseline alone (the tests compare it with the clones). */
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) && \
    !defined(WO_NO_CLONES)
#if __has_attribute(target_clones)
#define WO_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef WO_CLONES
#define WO_CLONES
#endif

#define WO_CASE(mk, gk, ak, vk)                                                              \
    case (((mk)*2 + (gk)) * 2 + (ak)) * 2 + (vk):                                            \
        if (h->adam_w_mode)                                                                  \
            adamw_range(begin, end, t->param, t->master, t->grad, t->exp_avg, t->exp_avg_sq, \
                        h, 1, mk, gk, ak, vk);                                               \
        else                                                                                 \
            adamw_range(begin, end, t->param, t->master, t->grad, t->exp_avg, t->exp_avg_sq, \
                        h, 0, mk, gk, ak, vk);                                               \
        return 0;

#define WO_CASES_FOR_MASTER(mk)                                          \
    WO_CASE(mk, 0, 0, 0) WO_CASE(mk, 0, 0, 1) WO_CASE(mk, 0, 1, 0)       \
    WO_CASE(mk, 0, 1, 1) WO_CASE(mk, 1, 0, 0) WO_CASE(mk, 1, 0, 1)       \
    WO_CASE(mk, 1, 1, 0) WO_CASE(mk, 1, 1, 1)

/* One tensor's operands and how each is stored (the enums above). */
typedef struct {
    void *param;
    void *master;
    const void *grad;
    void *exp_avg;
    void *exp_avg_sq;
    int64_t numel;
    int master_kind, grad_kind, m_kind, v_kind;
} wo_tensor;

static inline __attribute__((always_inline)) int adamw_tensor(const wo_tensor *t,
                                                              int64_t begin, int64_t end,
                                                              const wo_hyper *h) {
    switch (((t->master_kind * 2 + t->grad_kind) * 2 + t->m_kind) * 2 + t->v_kind) {
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
        if (t->master_kind < 0 || t->master_kind > 2 || t->grad_kind < 0 || t->grad_kind > 1 ||
            t->m_kind < 0 || t->m_kind > 1 || t->v_kind < 0 || t->v_kind > 1)
            return 0;
    }
    return 1;
}

/* Where a thread is in the tensors laid end to end: blocks it takes only move forward. */
typedef struct {
    int64_t tensor, offset;
} wo_cursor;

/* Updates elements [begin, end) of the tensors laid end to end. */
WO_CLONES static void wo_update_range(const wo_tensor *tensors, int64_t count, int64_t begin,
                                      int64_t end, const wo_hyper *h, wo_cursor *at) {
    while (at->tensor < count && at->offset + tensors[at->tensor].numel <= begin) {
        at->offset += tensors[at->tensor].numel;
        at->tensor++;
    }
    int64_t offset = at->offset;
    for (int64_t k = at->tensor; k < count && offset < end; ++k) {
        const wo_tensor *t = &tensors[k];
        int64_t lo = begin > offset ? begin - offset : 0;
        int64_t hi = end - offset < t->numel ? end - offset : t->numel;
        if (lo < hi) adamw_tensor(t, lo, hi, h);
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
    const wo_tensor *tensors;
    int64_t count, total, blocks, block;
    const wo_hyper *h;
    atomic_llong next;
} wo_job;

static void wo_take_blocks(wo_job *job) {
    wo_cursor at = {0, 0};
    for (;;) {
        long long b = atomic_fetch_add(&job->next, 1);
        if (b >= job->blocks) return;
        int64_t begin = (int64_t)b * job->block;
        int64_t end = begin + job->block < job->total ? begin + job->block : job->total;
        wo_update_range(job->tensors, job->count, begin, end, job->h, &at);
    }
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
 * Updates all elements of the tensors with up to `threads` threads (the caller included).
 * Returns 0, -1 for an operand kind outside the enums above (the Python side validates
 * first; this is a last guard, never a silent no-op) or -2 for a bad thread count or block
 * size.
 */
int wo_adamw_step(const wo_tensor *tensors, int64_t count, int64_t total, int threads,
                  int64_t block, const wo_hyper *h) {
    if (!wo_kinds_ok(tensors, count)) return -1;
    if (threads < 1 || threads > WO_MAX_THREADS || block < 64 || block % 64 != 0) return -2;
    int64_t blocks = (total + block - 1) / block;
    if (threads > blocks) threads = blocks > 0 ? (int)blocks : 1;
    if (threads == 1) {
        wo_cursor at = {0, 0};
        wo_update_range(tensors, count, 0, total, h, &at);
        return 0;
    }
    wo_job job = {tensors, count, total, blocks, block, h, 0};
#pragma omp parallel num_threads(threads)
    wo_take_blocks(&job);
    return 0;
}
