/* The offloaded AdamW step over one chunk of a host mirror, in one pass per element:
 * gradient in (bf16 staging or fp32), fp32 parameter and Adam moments (fp32 or bf16)
 * updated in place, the new parameter rounded to bf16 into the staging the device copies
 * back from. 28 bytes of memory traffic per element with fp32 moments (the fused-AdamW
 * floor's own), 20 with bf16 moments; no scratch, no second pass.
 *
 * Vector paths: AVX-512 (16 lanes), AVX2 with FMA (8), portable C; the widest this CPU runs
 * is used (BUFFERS_HOST_ADAMW_ISA narrows it). Every path does the same IEEE operations per
 * element, so all give the same bits; a wider one only issues fewer instructions, which
 * matters with bf16 moments, where widening and rounding are much of the work (measured in
 * benchmarks/offload_step.py). The new parameters go into the staging with non-temporal
 * stores on the AVX-512 path where it is aligned for them.
 *
 * Compiled on first use by megatron_ext/offload/host_kernel.py (plain C, no Python or torch
 * headers, -ffp-contract=off so every rounding is the one written here) and called through
 * ctypes, which releases the GIL for the duration of a call.
 *
 * The arithmetic per element is torch's fused CPU AdamW kernel's (torch._fused_adamw_ on
 * fp32 tensors): the constants computed in double and rounded to float as it does, then
 * the same float operations in the same order. Two things vary between torch builds and
 * are parameters here (`variant`), chosen once per process by a probe against
 * torch._fused_adamw_ on random data (host_kernel.py): whether the compiler that built torch
 * fused `v * beta2 + c2 * g * g` into one fused multiply-add, and the same for the scalar
 * code that finishes each tensor's last (numel mod vector width) elements. The element
 * where that scalar tail starts is given per task by the caller.
 *
 * Work is split into tasks (runs of one parameter) shared by a pool of threads that
 * persists between calls; the calling thread takes tasks too and never waits for a thread
 * that has not started. The pool's threads (named "adamw-host") run where the last caller
 * may run: each call that wakes them hands them its CPU affinity, so a caller pinned away
 * from a core (the delayed update's worker, kept off the core of the thread that launches
 * the GPU's work) keeps its helpers off it too, whichever thread created them.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define ADAMW_X86 1
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

/* the vector paths (`vectorized`): the widest this CPU has is the default */
enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

enum { KIND_BF16 = 0, KIND_F32 = 2, KIND_NONE = -1 };

/* variant bits */
enum {
    V_VEC_MASK = 3,        /* vector v: 0 v*b2 + (c2*g)*g; 1 fma(c2*g, g, v*b2); 2 fma(v, b2, (c2*g)*g) */
    V_TAIL_SHIFT = 2,      /* scalar tail v: same three choices in bits 2-3 */
    V_TAIL_LERP_FMA = 16,  /* scalar tail m: m + c*(g-m) (and g - (g-m)*(1-c)) fused */
};

/* One task: a run of one parameter's elements. Laid out as ctypes builds it. */
typedef struct {
    int64_t n;         /* elements */
    int64_t vec_n;     /* the first vec_n take the vector formula, the rest the tail's */
    float *param;      /* fp32 host parameters */
    const void *grad;  /* gradients, grad_kind */
    void *exp_avg;     /* moments, the call's moment kinds */
    void *exp_avg_sq;
    void *out;         /* the new parameters (out_kind: rounded to bf16, or fp32), or NULL */
    int32_t grad_kind; /* KIND_BF16 or KIND_F32 */
    int32_t entry;     /* index into steps */
    int32_t family;    /* index into hyper (5 doubles: lr, beta1, beta2, weight_decay, eps);
                          -1: only write the parameters into out (a gap between parameters) */
    int32_t out_kind;  /* KIND_BF16 or KIND_F32 */
} adamw_task;

typedef struct {
    float wdf, coeff, c1, b2, c2, bc2s, eps, neg_step, step_size;
    int decay, small;
} constants;

typedef struct {
    const adamw_task *tasks;
    int64_t ntasks;
    const double *hyper;
    const float *steps;
    int m_kind, v_kind, variant, vectorized, stream;
    atomic_int_fast64_t next;
    atomic_int_fast64_t done;
} job;

/* ---- constants, as torch computes them -------------------------------------------- */

static constants make_constants(const double *h, float step_f) {
    double lr = h[0], beta1 = h[1], beta2 = h[2], wd = h[3], eps = h[4];
    double step = (double)step_f;
    double bias_correction1 = 1 - pow(beta1, step);
    double bias_correction2 = 1 - pow(beta2, step);
    double c1 = 1 - beta1, c2 = 1 - beta2;
    double bc2s = sqrt(bias_correction2);
    double step_size = lr / bias_correction1;
    constants k;
    k.decay = wd != 0.0f;
    k.wdf = (float)(1 - lr * wd);
    k.c1 = (float)c1;
    k.small = fabsf(k.c1) < 0.5f;
    k.coeff = k.small ? k.c1 : k.c1 - 1.0f;
    k.b2 = (float)beta2;
    k.c2 = (float)c2;
    k.bc2s = (float)bc2s;
    k.eps = (float)eps;
    k.neg_step = (float)(-step_size);
    k.step_size = (float)step_size;
    return k;
}

/* ---- element conversions ------------------------------------------------------------ */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch's fp32 -> bf16 conversion; NaN -> 0x7fc0 */
static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float load(const void *base, int kind, int64_t i) {
    return kind == KIND_BF16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store(void *base, int kind, int64_t i, float x) {
    if (kind == KIND_BF16)
        ((uint16_t *)base)[i] = f32_to_bf16(x);
    else
        ((float *)base)[i] = x;
}

/* ---- the per-element formulas ------------------------------------------------------- */

static inline float second_moment(float v, float g, const constants *k, int mode) {
    float vb = v * k->b2;
    float cg = k->c2 * g;
    if (mode == 1) return fmaf(cg, g, vb);
    if (mode == 2) return fmaf(v, k->b2, cg * g);
    return vb + cg * g;
}

/* torch's vector body, one element */
static inline void vector_formula(float *p, float *m, float *v, float g, const constants *k,
                                  int mode) {
    float pv = *p;
    if (k->decay) pv = pv * k->wdf;
    *m = fmaf(k->coeff, g - *m, k->small ? *m : g);
    *v = second_moment(*v, g, k, mode);
    float denom = sqrtf(*v) / k->bc2s + k->eps;
    *p = pv + (k->neg_step * *m) / denom;
}

/* torch's scalar tail, one element */
static inline void tail_formula(float *p, float *m, float *v, float g, const constants *k,
                                int variant) {
    float pv = *p;
    if (k->decay) pv = pv * k->wdf;
    int fused = variant & V_TAIL_LERP_FMA;
    if (k->small)
        *m = fused ? fmaf(k->c1, g - *m, *m) : *m + k->c1 * (g - *m);
    else
        *m = fused ? fmaf(-(g - *m), 1.0f - k->c1, g) : g - (g - *m) * (1.0f - k->c1);
    *v = second_moment(*v, g, k, (variant >> V_TAIL_SHIFT) & 3);
    float denom = sqrtf(*v) / k->bc2s + k->eps;
    *p = pv - (k->step_size * *m) / denom;
}

static void run_portable(const adamw_task *t, const constants *k, const job *j, int64_t from,
                         int64_t to, int tail) {
    for (int64_t i = from; i < to; i++) {
        float g = load(t->grad, t->grad_kind, i);
        float m = load(t->exp_avg, j->m_kind, i);
        float v = load(t->exp_avg_sq, j->v_kind, i);
        if (tail)
            tail_formula(&t->param[i], &m, &v, g, k, j->variant);
        else
            vector_formula(&t->param[i], &m, &v, g, k, j->variant & V_VEC_MASK);
        store(t->exp_avg, j->m_kind, i, m);
        store(t->exp_avg_sq, j->v_kind, i, v);
        if (t->out) store(t->out, t->out_kind, i, t->param[i]);
    }
}

/* ---- the vector paths: AVX2 (8 lanes) and AVX-512 (16) --------------------------------- */

#ifdef ADAMW_X86
AVX2 static inline __attribute__((always_inline)) __m256 load8(const void *base, int kind, int64_t i) {
    if (kind == KIND_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)base + i);
}

AVX2 static inline __attribute__((always_inline)) __m128i round8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi); /* every lane is <= 0xffff: packing keeps it */
}

AVX2 static inline __attribute__((always_inline)) void store8(void *base, int kind, int64_t i, __m256 x) {
    if (kind == KIND_BF16)
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), round8(x));
    else
        _mm256_storeu_ps((float *)base + i, x);
}

/* The AVX2 path writes the staging with plain stores: its 16-byte non-temporal stores of a
 * bf16 staging measured slower (benchmarks/offload_step.py, docs/RESULTS.md). */
AVX2 static inline __attribute__((always_inline)) void store8_out(void *base, int kind, int64_t i,
                                                                  __m256 x, int stream) {
    (void)stream;
    store8(base, kind, i, x);
}

static inline int streams8(int stream, const void *out, int kind) {
    (void)stream, (void)out, (void)kind;
    return 0;
}

AVX512 static inline __attribute__((always_inline)) __m512 load16(const void *base, int kind, int64_t i) {
    if (kind == KIND_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + i);
}

AVX512 static inline __attribute__((always_inline)) __m256i round16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r); /* every lane is <= 0xffff: narrowing keeps it */
}

AVX512 static inline __attribute__((always_inline)) void store16(void *base, int kind, int64_t i, __m512 x) {
    if (kind == KIND_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + i), round16(x));
    else
        _mm512_storeu_ps((float *)base + i, x);
}

/* The new parameters into the staging, with non-temporal stores where the caller asks for
 * them (`stream`, the default) and the staging is aligned for them (streams16): its lines go
 * to memory without first being read into the cache (2 bytes per element of a bf16
 * staging; the device's copy reads it next, not this CPU). Their order against other
 * threads' reads comes from the sfence at the end of each task. */
AVX512 static inline __attribute__((always_inline)) void store16_out(void *base, int kind, int64_t i,
                                                                     __m512 x, int stream) {
    if (!stream)
        store16(base, kind, i, x);
    else if (kind == KIND_BF16)
        _mm256_stream_si256((__m256i *)((uint16_t *)base + i), round16(x));
    else
        _mm512_stream_ps((float *)base + i, x);
}

/* whether `out` takes the non-temporal stores: asked for, and 32 bytes aligned for bf16, 64
 * for fp32 (every 16-element store from an element that is a multiple of 16 then is too) */
static inline int streams16(int stream, const void *out, int kind) {
    return stream && out && ((uintptr_t)out & (kind == KIND_BF16 ? 31u : 63u)) == 0;
}

/* One path, written once for both widths (W: 256 or 512 bits, LANES: 8 or 16; SUFFIX names
 * its load, store, staging store and streaming test): the vector formula over the elements
 * [from, to) of a task (multiples of LANES), specialised per mode and dtypes so that no
 * choice is made per element (run_SUFFIX), and the packing of a gap (pack_SUFFIX). */
#define ADAMW_VECTOR_PATH(SUFFIX, ATTR, W, LANES, LOAD, STORE, STORE_OUT, STREAMS)            \
    ATTR static inline __attribute__((always_inline)) void run_##SUFFIX##_mode(                \
        const adamw_task *t, const constants *k, int64_t from, int64_t to, int mode, int gk,    \
        int mk, int vk, int stream) {                                                          \
        const __m##W wdf = _mm##W##_set1_ps(k->wdf), coeff = _mm##W##_set1_ps(k->coeff);      \
        const __m##W b2 = _mm##W##_set1_ps(k->b2), c2 = _mm##W##_set1_ps(k->c2);               \
        const __m##W bc2s = _mm##W##_set1_ps(k->bc2s), eps = _mm##W##_set1_ps(k->eps);        \
        const __m##W neg_step = _mm##W##_set1_ps(k->neg_step);                                 \
        const int decay = k->decay, small = k->small;                                          \
        for (int64_t i = from; i < to; i += LANES) {                                           \
            __m##W p = _mm##W##_loadu_ps(t->param + i);                                        \
            __m##W g = LOAD(t->grad, gk, i);                                                   \
            __m##W m = LOAD(t->exp_avg, mk, i);                                                \
            __m##W v = LOAD(t->exp_avg_sq, vk, i);                                             \
            if (decay) p = _mm##W##_mul_ps(p, wdf);                                            \
            m = _mm##W##_fmadd_ps(coeff, _mm##W##_sub_ps(g, m), small ? m : g);                \
            __m##W cg = _mm##W##_mul_ps(c2, g);                                                \
            if (mode == 1)                                                                     \
                v = _mm##W##_fmadd_ps(cg, g, _mm##W##_mul_ps(v, b2));                          \
            else if (mode == 2)                                                                \
                v = _mm##W##_fmadd_ps(v, b2, _mm##W##_mul_ps(cg, g));                          \
            else                                                                               \
                v = _mm##W##_add_ps(_mm##W##_mul_ps(v, b2), _mm##W##_mul_ps(cg, g));           \
            __m##W denom = _mm##W##_add_ps(_mm##W##_div_ps(_mm##W##_sqrt_ps(v), bc2s), eps);   \
            p = _mm##W##_add_ps(p, _mm##W##_div_ps(_mm##W##_mul_ps(neg_step, m), denom));      \
            _mm##W##_storeu_ps(t->param + i, p);                                               \
            STORE(t->exp_avg, mk, i, m);                                                       \
            STORE(t->exp_avg_sq, vk, i, v);                                                    \
            if (t->out) STORE_OUT(t->out, t->out_kind, i, p, stream);                          \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    ATTR static void run_##SUFFIX(const adamw_task *t, const constants *k, const job *j,       \
                                  int64_t from, int64_t to) {                                  \
        int gk = t->grad_kind, mk = j->m_kind, vk = j->v_kind;                                 \
        int stream = STREAMS(j->stream, t->out, t->out_kind);                                  \
        switch (j->variant & V_VEC_MASK) {                                                     \
        case 1: ADAMW_KINDS(run_##SUFFIX##_mode, 1); break;                                    \
        case 2: ADAMW_KINDS(run_##SUFFIX##_mode, 2); break;                                    \
        default: ADAMW_KINDS(run_##SUFFIX##_mode, 0); break;                                   \
        }                                                                                      \
    }                                                                                          \
                                                                                               \
    ATTR static void pack_##SUFFIX(const adamw_task *t, int64_t from, int64_t to, int stream) { \
        stream = STREAMS(stream, t->out, t->out_kind);                                         \
        for (int64_t i = from; i < to; i += LANES)                                             \
            STORE_OUT(t->out, t->out_kind, i, _mm##W##_loadu_ps(t->param + i), stream);        \
    }

/* the loop of one mode for the common dtypes as constants, the rest as they come */
#define ADAMW_KINDS(RUN, mode)                                                            \
    do {                                                                                  \
        if (gk == KIND_BF16 && mk == KIND_F32 && vk == KIND_F32)                          \
            RUN(t, k, from, to, mode, KIND_BF16, KIND_F32, KIND_F32, stream);             \
        else if (gk == KIND_F32 && mk == KIND_F32 && vk == KIND_F32)                      \
            RUN(t, k, from, to, mode, KIND_F32, KIND_F32, KIND_F32, stream);              \
        else if (gk == KIND_BF16 && mk == KIND_BF16 && vk == KIND_BF16)                   \
            RUN(t, k, from, to, mode, KIND_BF16, KIND_BF16, KIND_BF16, stream);           \
        else if (gk == KIND_F32 && mk == KIND_BF16 && vk == KIND_BF16)                    \
            RUN(t, k, from, to, mode, KIND_F32, KIND_BF16, KIND_BF16, stream);            \
        else                                                                              \
            RUN(t, k, from, to, mode, gk, mk, vk, stream);                                \
    } while (0)

ADAMW_VECTOR_PATH(avx2, AVX2, 256, 8, load8, store8, store8_out, streams8)
ADAMW_VECTOR_PATH(avx512, AVX512, 512, 16, load16, store16, store16_out, streams16)
#endif

/* a gap between parameters: its host values rounded into the staging, nothing updated */
static void pack_only(const adamw_task *t, int vectorized, int stream) {
    int64_t i = 0;
#ifdef ADAMW_X86
    if (vectorized >= ISA_AVX512) {
        i = t->n - t->n % 16;
        pack_avx512(t, 0, i, stream);
    }
    if (vectorized >= ISA_AVX2) {
        int64_t to = i + (t->n - i) / 8 * 8;
        pack_avx2(t, i, to, stream);
        i = to;
    }
#endif
    (void)vectorized;
    (void)stream;
    for (; i < t->n; i++) store(t->out, t->out_kind, i, t->param[i]);
}

/* a run of one parameter updated: the widest vector path over as much of the vector body
 * as it takes, AVX2 over what is left of it (fewer than 16), the portable code over the
 * rest and over torch's scalar tail */
static void update(const job *j, const adamw_task *t) {
    constants k = make_constants(j->hyper + 5 * t->family, j->steps[t->entry]);
    int64_t vec_n = t->vec_n < t->n ? t->vec_n : t->n;
    int64_t done = 0;
#ifdef ADAMW_X86
    if (j->vectorized >= ISA_AVX512) {
        done = vec_n - vec_n % 16;
        run_avx512(t, &k, j, 0, done);
    }
    if (j->vectorized >= ISA_AVX2) {
        int64_t to = done + (vec_n - done) / 8 * 8;
        run_avx2(t, &k, j, done, to);
        done = to;
    }
#endif
    run_portable(t, &k, j, done, vec_n, 0);
    run_portable(t, &k, j, vec_n, t->n, 1);
}

static void run_task(const job *j, int64_t index) {
    const adamw_task *t = &j->tasks[index];
    if (t->family >= 0)
        update(j, t);
    else if (t->out)
        pack_only(t, j->vectorized, j->stream);
#ifdef ADAMW_X86
    if (j->vectorized >= ISA_AVX512) _mm_sfence(); /* non-temporal stores, before "done" */
#endif
}

/* ---- the thread pool ------------------------------------------------------------------ */

enum { MAX_THREADS = 256 };

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static int pool_size;              /* worker threads started */
static uint64_t pool_generation;   /* advances with every call that uses the workers */
static job *pool_job;              /* the current call's job, NULL once it is over */
static int pool_wanted;            /* workers asked to help with the current job */
static atomic_int pool_inside;     /* workers working on pool_job */
static cpu_set_t pool_mask;        /* the CPUs the last caller may run on: workers follow */
static uint64_t pool_mask_generation; /* advances when pool_mask changes (0: never set) */

static void work(job *j) {
    int64_t i;
    while ((i = atomic_fetch_add(&j->next, 1)) < j->ntasks) {
        run_task(j, i);
        atomic_fetch_add(&j->done, 1);
    }
}

static void *worker(void *arg) {
    int me = (int)(intptr_t)arg;
    uint64_t seen = 0, seen_mask = 0;
    for (;;) {
        pthread_mutex_lock(&pool_lock);
        while (pool_generation == seen) pthread_cond_wait(&pool_wake, &pool_lock);
        seen = pool_generation;
        job *j = me < pool_wanted ? pool_job : NULL;
        if (j) atomic_fetch_add(&pool_inside, 1);
        int move = seen_mask != pool_mask_generation;
        cpu_set_t mask = pool_mask;
        seen_mask = pool_mask_generation;
        pthread_mutex_unlock(&pool_lock);
        /* where the caller runs (a failure leaves this thread where it was: only placement) */
        if (move) pthread_setaffinity_np(pthread_self(), sizeof mask, &mask);
        if (j) {
            work(j);
            atomic_fetch_sub(&pool_inside, 1);
        }
    }
    return NULL;
}

/* a child process after fork() has none of the workers: it starts its own when it needs
 * them (a worker holding the lock at the fork cannot leave it held in the child either) */
static void forget_pool_in_child(void) {
    pthread_mutex_init(&pool_lock, NULL);
    pthread_cond_init(&pool_wake, NULL);
    pool_size = 0;
    pool_job = NULL;
    pool_wanted = 0;
    atomic_store(&pool_inside, 0);
    CPU_ZERO(&pool_mask);
    pool_mask_generation = 0;
}

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static void register_fork_handler(void) { pthread_atfork(NULL, NULL, forget_pool_in_child); }

static void grow_pool(int workers) {
    pthread_once(&pool_once, register_fork_handler);
    if (workers > MAX_THREADS - 1) workers = MAX_THREADS - 1;
    while (pool_size < workers) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&th, &attr, worker, (void *)(intptr_t)pool_size);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers: the caller does the rest */
        pthread_setname_np(th, "adamw-host");
        pool_size++;
    }
}

static inline void relax(long spins) {
#ifdef ADAMW_X86
    if (spins < 4096) {
        _mm_pause();
        return;
    }
#endif
    (void)spins;
    sched_yield();
}

/* ---- the entry points ----------------------------------------------------------------- */

/* One chunk's update: `ntasks` tasks on up to `threads` threads (the caller included).
 * hyper: 5 doubles per family; steps: the step each entry's constants use (the count
 * after this update, as torch reads it). moment kinds: KIND_F32 or KIND_BF16. */
void adamw_host_step(const adamw_task *tasks, int64_t ntasks, const double *hyper,
                     const float *steps, int m_kind, int v_kind, int variant, int vectorized,
                     int threads, int stream) {
    job j;
    j.tasks = tasks;
    j.ntasks = ntasks;
    j.hyper = hyper;
    j.steps = steps;
    j.m_kind = m_kind;
    j.v_kind = v_kind;
    j.variant = variant;
    j.vectorized = vectorized;
    j.stream = stream;
    atomic_init(&j.next, 0);
    atomic_init(&j.done, 0);
    int helpers = threads - 1;
    if (helpers > ntasks - 1) helpers = (int)(ntasks - 1);
    if (helpers > 0) {
        cpu_set_t mine;
        int placed = pthread_getaffinity_np(pthread_self(), sizeof mine, &mine) == 0;
        pthread_mutex_lock(&pool_lock);
        grow_pool(helpers);
        if (placed && (pool_mask_generation == 0 || !CPU_EQUAL(&mine, &pool_mask))) {
            pool_mask = mine;
            pool_mask_generation++;
        }
        pool_job = &j;
        pool_wanted = helpers;
        pool_generation++;
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    work(&j);
    if (helpers > 0) {
        long spins = 0;
        while (atomic_load(&j.done) < ntasks) relax(spins++);
        pthread_mutex_lock(&pool_lock);
        pool_job = NULL; /* a helper that wakes from now on finds nothing to do */
        pthread_mutex_unlock(&pool_lock);
        spins = 0;
        while (atomic_load(&pool_inside) > 0) relax(spins++); /* none still reads j */
    }
}

/* the widest vector path this CPU runs: ISA_AVX512 (AVX-512F with AVX2 and FMA), ISA_AVX2
 * (AVX2 and FMA) or ISA_PORTABLE */
int adamw_host_vectorized(void) {
#ifdef ADAMW_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return ISA_PORTABLE;
    return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
#else
    return ISA_PORTABLE;
#endif
}

int adamw_host_task_size(void) { return (int)sizeof(adamw_task); }
