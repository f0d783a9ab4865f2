// Rows times the orthonormal Sylvester Hadamard matrix (exact_tail.hadamard), for the CPU: the
// fast Walsh-Hadamard transform, d log2(d) additions and one scale per row instead of a d x d
// matmul (a torch matmul call cost ~60 us at decode sizes, six per layer). Computed in float32,
// returned in the input's dtype, as exact_tail.rotate does (to float32 rounding: another
// summation order).
#include "hadamard.h"
#include "simd.h"

#include <math.h>

// One butterfly stage of span `len` < 8 inside each 8-lane vector: lane j (with partner
// j ^ len) becomes v[j] + v[j + len] where j & len == 0, v[j - len] - v[j] otherwise, written
// as partner + sign * self (the same two float additions as the scalar butterflies).
static inline v8f stage_in_vector(v8f v, int len) {
    static const v8i perm[3] = {
        {1, 0, 3, 2, 5, 4, 7, 6}, {2, 3, 0, 1, 6, 7, 4, 5}, {4, 5, 6, 7, 0, 1, 2, 3}};
    static const v8f sign[3] = {
        {1, -1, 1, -1, 1, -1, 1, -1}, {1, 1, -1, -1, 1, 1, -1, -1}, {1, 1, 1, 1, -1, -1, -1, -1}};
    const int s = len == 1 ? 0 : len == 2 ? 1 : 2;
    return __builtin_shuffle(v, perm[s]) + sign[s] * v;
}

static void fwht_row(float* v, int64_t d) {
    if (d % 8 == 0) {  // whole vectors: spans 1, 2, 4 inside each, the rest between them
        for (int64_t i = 0; i < d; i += 8) {
            v8f x;
            memcpy(&x, v + i, 32);
            x = stage_in_vector(stage_in_vector(stage_in_vector(x, 1), 2), 4);
            memcpy(v + i, &x, 32);
        }
        for (int64_t len = 8; len < d; len <<= 1) {
            for (int64_t i = 0; i < d; i += len << 1) {
                for (int64_t j = i; j < i + len; j += 8) {
                    v8f a, b;
                    memcpy(&a, v + j, 32);
                    memcpy(&b, v + j + len, 32);
                    const v8f s = a + b, t = a - b;
                    memcpy(v + j, &s, 32);
                    memcpy(v + j + len, &t, 32);
                }
            }
        }
        return;
    }
    for (int64_t len = 1; len < d; len <<= 1) {
        for (int64_t i = 0; i < d; i += len << 1) {
            for (int64_t j = i; j < i + len; j++) {
                const float a = v[j], b = v[j + len];
                v[j] = a + b;
                v[j + len] = a - b;
            }
        }
    }
}

// v [d] (floats) times the orthonormal Hadamard matrix in place, each result rounded to bf16
// precision unless x_f32: one row of infer8_hadamard_rows, for decode_attention.c.
void infer8_hadamard_row(float* v, int64_t d, int x_f32) {
#ifdef __AVX512F__  // the common head dims in registers
    if (d == 64) {
        if (x_f32) hadamard_zmm(v, 4, 1); else hadamard_zmm(v, 4, 0);
        return;
    }
    if (d == 128) {
        if (x_f32) hadamard_zmm(v, 8, 1); else hadamard_zmm(v, 8, 0);
        return;
    }
#endif
    const float norm = 1.0f / sqrtf((float)d);
    fwht_row(v, d);
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) {
        v8f y;
        memcpy(&y, v + i, 32);
        y *= norm;
        if (!x_f32) y = rnd8(y);
        memcpy(v + i, &y, 32);
    }
    for (; i < d; i++) v[i] = x_f32 ? v[i] * norm : rnd1(v[i] * norm);
}

// x: [n, h, d] with strides (s0, s1, 1), bf16 bits or float32 (x_f32); out: [n, h, d]
// contiguous, same dtype. d is a power of two <= 1024.
void infer8_hadamard_rows(const void* x, int64_t n, int64_t h, int64_t d, int64_t s0,
                          int64_t s1, int x_f32, void* out) {
    const float norm = 1.0f / sqrtf((float)d);
    const int bf16 = !x_f32;
#pragma omp parallel for schedule(static) if (n * h >= 64)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t k = 0; k < h; k++) {
            float v[1024] __attribute__((aligned(32)));
            const int64_t at = t * s0 + k * s1, o = (t * h + k) * d;
            if (d % 8 == 0) {  // 8 lanes in and out (the same values and roundings)
                for (int64_t i = 0; i < d; i += 8) {
                    v8f x8 = ld8(x, at + i, bf16);
                    memcpy(v + i, &x8, 32);
                }
                infer8_hadamard_row(v, d, 1);  // scaled (in registers where it can), unrounded
                for (int64_t i = 0; i < d; i += 8) {
                    v8f y;
                    memcpy(&y, v + i, 32);
                    st8(out, o + i, y, bf16);  // rounded once, into the output's dtype
                }
                continue;
            }
            for (int64_t i = 0; i < d; i++) v[i] = ld1(x, at + i, bf16);
            fwht_row(v, d);
            for (int64_t i = 0; i < d; i++) st1(out, o + i, v[i] * norm, bf16);
        }
    }
}
