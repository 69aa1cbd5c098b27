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
 * Formats: FP32; bf16 (decode exact, encode round-to-nearest-even, NaN as the quiet NaN
 * 0x7FC0, as torch's scalar float -> bfloat16 conversion); a bf16 parameter plus the int16 low half of its FP32
 * master (TE's store_param_remainders bit arithmetic).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

enum { MASTER_NONE = 0, MASTER_FP32 = 1, MASTER_REMAINDER = 2 };
enum { KIND_FP32 = 0, KIND_BF16 = 1 };

#define WO_ABI_VERSION 5

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
 * write one cache line within a tensor), taken from a shared counter, so a worker that wakes
 * late simply takes fewer blocks. The calling thread takes blocks too; the workers belong to
 * a persistent pool (threads created per call were no faster than one thread: a new thread
 * starts on its creator's core) and spin briefly before sleeping. After fork() the child
 * starts with an empty pool. The split never changes a result: every element is updated by
 * the same operations whichever thread runs it.
 */

#define WO_MAX_THREADS 256
#ifndef WO_SPINS
#define WO_SPINS 2000
#endif

typedef struct {
    const wo_tensor *tensors;
    int64_t count, total, blocks, block;
    const wo_hyper *h;
    int participants; /* workers with an index below this take blocks */
} wo_job;

static pthread_mutex_t wo_call_mu = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_mutex_t wo_mu = PTHREAD_MUTEX_INITIALIZER;      /* guards the sleeps */
static pthread_cond_t wo_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t wo_done = PTHREAD_COND_INITIALIZER;
static atomic_ulong wo_generation;
static atomic_int wo_pending;
static atomic_llong wo_next_block;
static int wo_workers; /* started workers; read and written under wo_call_mu */
static wo_job wo_current;
/* The generation before a worker's first job, set before the worker is created: a worker
 * that starts late must still see that job as new. */
static unsigned long wo_start_generation[WO_MAX_THREADS];
static pthread_once_t wo_atfork_once = PTHREAD_ONCE_INIT;

static inline void wo_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void wo_take_blocks(const wo_job *job) {
    wo_cursor at = {0, 0};
    for (;;) {
        long long b = atomic_fetch_add(&wo_next_block, 1);
        if (b >= job->blocks) return;
        int64_t begin = (int64_t)b * job->block;
        int64_t end = begin + job->block < job->total ? begin + job->block : job->total;
        wo_update_range(job->tensors, job->count, begin, end, job->h, &at);
    }
}

static void *wo_worker(void *arg) {
    intptr_t index = (intptr_t)arg;
    unsigned long seen = wo_start_generation[index];
    for (;;) {
        unsigned long now = seen;
        for (int spin = 0; spin < WO_SPINS && now == seen; ++spin) {
            wo_relax();
            now = atomic_load(&wo_generation);
        }
        if (now == seen) {
            pthread_mutex_lock(&wo_mu);
            while ((now = atomic_load(&wo_generation)) == seen)
                pthread_cond_wait(&wo_wake, &wo_mu);
            pthread_mutex_unlock(&wo_mu);
        }
        seen = now;
        if (index < wo_current.participants) wo_take_blocks(&wo_current);
        if (atomic_fetch_sub(&wo_pending, 1) == 1) {
            pthread_mutex_lock(&wo_mu);
            pthread_cond_signal(&wo_done);
            pthread_mutex_unlock(&wo_mu);
        }
    }
    return NULL;
}

static void wo_after_fork_in_child(void) {
    /* The workers did not come along; locks held by other threads at fork() never unlock. */
    pthread_mutex_init(&wo_call_mu, NULL);
    pthread_mutex_init(&wo_mu, NULL);
    pthread_cond_init(&wo_wake, NULL);
    pthread_cond_init(&wo_done, NULL);
    atomic_store(&wo_pending, 0);
    wo_workers = 0;
}

static void wo_register_atfork(void) { pthread_atfork(NULL, NULL, wo_after_fork_in_child); }

/*
 * Updates all elements of the tensors with up to `threads` threads (the caller included).
 * Returns 0, -1 for an operand kind outside the enums above (the Python side validates
 * first; this is a last guard, never a silent no-op) or -2 for a bad thread count or block
 * size. With no
 * worker available the calling thread does all the work.
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
    pthread_once(&wo_atfork_once, wo_register_atfork);
    pthread_mutex_lock(&wo_call_mu);
    while (wo_workers < threads - 1) {
        pthread_t id;
        wo_start_generation[wo_workers + 1] = atomic_load(&wo_generation);
        if (pthread_create(&id, NULL, wo_worker, (void *)(intptr_t)(wo_workers + 1)) != 0)
            break;
        pthread_detach(id);
        wo_workers++;
    }
    wo_current = (wo_job){tensors, count, total, blocks, block, h, threads};
    atomic_store(&wo_next_block, 0);
    int helpers = wo_workers;
    if (helpers > 0) {
        atomic_store(&wo_pending, helpers);
        pthread_mutex_lock(&wo_mu);
        atomic_fetch_add(&wo_generation, 1);
        pthread_cond_broadcast(&wo_wake);
        pthread_mutex_unlock(&wo_mu);
    }
    wo_take_blocks(&wo_current);
    if (helpers > 0) {
        for (int spin = 0; spin < WO_SPINS && atomic_load(&wo_pending) != 0; ++spin)
            wo_relax();
        pthread_mutex_lock(&wo_mu);
        while (atomic_load(&wo_pending) != 0) pthread_cond_wait(&wo_done, &wo_mu);
        pthread_mutex_unlock(&wo_mu);
    }
    pthread_mutex_unlock(&wo_call_mu);
    return 0;
}
