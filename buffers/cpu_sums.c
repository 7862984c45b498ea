/* Sums of |x|^p (p = 1, 2) over bf16, fp16 and fp32 arrays, one pass, accumulated in fp64.
 *
 * Compiled on first use by buffers/native.py (plain C, no Python or torch headers) and
 * called through ctypes, which releases the GIL for the duration of a call.
 *
 * Every element is widened to fp64 before it is squared (or its absolute value taken) and
 * added: a bf16/fp16/fp32 square is exact in fp64, and a sum of millions of them keeps
 * ~1e-15 relative accuracy, so the result only rounds when the caller narrows it to fp32.
 * Independent accumulators are combined in a fixed order, so the same input gives the same
 * bits every time. The AVX2 path and the portable one add in different orders and may
 * differ in the last fp64 bits; which one runs depends only on the CPU.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define BUFFERS_X86 1
#endif

enum { KIND_BF16 = 0, KIND_F16 = 1, KIND_F32 = 2 };

static int64_t element_size(int kind) { return kind == KIND_F32 ? 4 : 2; }

/* ---- portable path ---------------------------------------------------------------- */

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

__attribute__((unused)) static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) { /* inf, nan */
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) { /* normal */
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) { /* zero */
        u = sign;
    } else { /* subnormal: mant * 2^-24, renormalised */
        uint32_t e = 113u;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        u = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One loop per element kind and power, eight accumulators: the compiler can keep them in
 * vector registers (no reassociation is needed, so no fast-math flag). */
#define PORTABLE_SUM(name, type, convert, expr)                                             \
    static double name(const void *base, int64_t n) {                                       \
        const type *in = (const type *)base;                                                \
        double acc[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};                           \
        int64_t i = 0;                                                                      \
        for (; i + 8 <= n; i += 8) {                                                        \
            for (int j = 0; j < 8; j++) {                                                   \
                double x = (double)convert(in[i + j]);                                      \
                acc[j] += expr;                                                             \
            }                                                                               \
        }                                                                                   \
        for (; i < n; i++) {                                                                \
            double x = (double)convert(in[i]);                                              \
            acc[0] += expr;                                                                 \
        }                                                                                   \
        return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }

#define AS_IS(v) (v)
PORTABLE_SUM(sq_bf16, uint16_t, bf16_to_f32, x * x)
PORTABLE_SUM(abs_bf16, uint16_t, bf16_to_f32, x < 0 ? -x : x)
#ifdef __aarch64__ /* the hardware converts fp16 */
PORTABLE_SUM(sq_f16, __fp16, AS_IS, x * x)
PORTABLE_SUM(abs_f16, __fp16, AS_IS, x < 0 ? -x : x)
#else
PORTABLE_SUM(sq_f16, uint16_t, f16_to_f32, x * x)
PORTABLE_SUM(abs_f16, uint16_t, f16_to_f32, x < 0 ? -x : x)
#endif
PORTABLE_SUM(sq_f32, float, AS_IS, x * x)
PORTABLE_SUM(abs_f32, float, AS_IS, x < 0 ? -x : x)

static double sum_portable(int kind, int p, const void *base, int64_t n) {
    switch (kind) {
    case KIND_BF16:
        return p == 2 ? sq_bf16(base, n) : abs_bf16(base, n);
    case KIND_F16:
        return p == 2 ? sq_f16(base, n) : abs_f16(base, n);
    default:
        return p == 2 ? sq_f32(base, n) : abs_f32(base, n);
    }
}

/* ---- AVX2 path -------------------------------------------------------------------- */

#ifdef BUFFERS_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

/* 16 elements as two vectors of 8 floats (in any order: only the sum is wanted). */
AVX2 static inline void load16(int kind, const void *base, int64_t i, __m256 *a, __m256 *b) {
    if (kind == KIND_F32) {
        *a = _mm256_loadu_ps((const float *)base + i);
        *b = _mm256_loadu_ps((const float *)base + i + 8);
    } else if (kind == KIND_BF16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
        __m256i zero = _mm256_setzero_si256();
        *a = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        *b = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    } else {
        const __m128i *q = (const __m128i *)((const uint16_t *)base + i);
        *a = _mm256_cvtph_ps(_mm_loadu_si128(q));
        *b = _mm256_cvtph_ps(_mm_loadu_si128(q + 1));
    }
}

AVX2 static inline __m256d term(int p, __m256d x, __m256d acc) {
    if (p == 2)
        return _mm256_fmadd_pd(x, x, acc);
    const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
    return _mm256_add_pd(acc, _mm256_and_pd(x, magnitude));
}

AVX2 static double sum_avx2(int kind, int p, const void *base, int64_t n) {
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a, b;
        load16(kind, base, i, &a, &b);
        acc0 = term(p, _mm256_cvtps_pd(_mm256_castps256_ps128(a)), acc0);
        acc1 = term(p, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)), acc1);
        acc2 = term(p, _mm256_cvtps_pd(_mm256_castps256_ps128(b)), acc2);
        acc3 = term(p, _mm256_cvtps_pd(_mm256_extractf128_ps(b, 1)), acc3);
    }
    __m256d acc = _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3));
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    double total = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    if (i < n) {
        const char *rest = (const char *)base + i * element_size(kind);
        total += sum_portable(kind, p, rest, n - i);
    }
    return total;
}
#endif

/* ---- entry points ----------------------------------------------------------------- */

/* 1 when the AVX2 path runs on this CPU, else 0. */
int buffers_sums_vectorized(void);

/* 1 when arrays of element kind `kind` are summed about as fast as memory delivers them on
 * this CPU (AVX2, or aarch64's vector units and fp16 conversion), else 0: elsewhere the
 * portable loop widens 16-bit elements two at a time, and converts fp16 element by element
 * in a branchy function. */
int buffers_sums_fast(int kind) {
#ifdef __aarch64__
    (void)kind;
    return 1;
#else
    return buffers_sums_vectorized() || kind == KIND_F32;
#endif
}

int buffers_sums_vectorized(void) {
#ifdef BUFFERS_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

static double sum_one(int kind, int p, const void *base, int64_t n, int vectorized) {
#ifdef BUFFERS_X86
    if (vectorized)
        return sum_avx2(kind, p, base, n);
#endif
    (void)vectorized;
    return sum_portable(kind, p, base, n);
}

/* The `count` arrays (array k at address ptrs[k], lens[k] elements of kind `kind`), taken
 * in order as one sequence, are cut into pieces of `piece` elements (the last may be
 * short); out[q] = sum of |x|^p (p = 1 or 2) over piece q, accumulated in fp64, for every
 * q in [first, last). The pieces do not depend on who asks for which range, so a caller
 * that adds out[] in order gets the same bits however it shares the ranges out. */
void buffers_piece_sums(int kind, int p, const uintptr_t *ptrs, const int64_t *lens,
                        int64_t count, int64_t piece, int64_t first, int64_t last, double *out,
                        int vectorized) {
    const int64_t size = element_size(kind);
    int64_t k = 0, off = first * piece;
    while (k < count && off >= lens[k]) {
        off -= lens[k];
        k++;
    }
    for (int64_t q = first; q < last; q++) {
        int64_t need = piece;
        double total = 0.0;
        while (need > 0 && k < count) {
            int64_t take = lens[k] - off < need ? lens[k] - off : need;
            if (take > 0)
                total += sum_one(kind, p, (const char *)ptrs[k] + off * size, take, vectorized);
            off += take;
            need -= take;
            if (off == lens[k]) {
                k++;
                off = 0;
            }
        }
        out[q] = total;
    }
}
