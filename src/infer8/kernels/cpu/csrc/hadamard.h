// The orthonormal Hadamard transform of a row held in AVX-512 registers (hadamard.c's fast path
// for d = 64 / 128), shared with the passes that rotate rows on their way elsewhere
// (fp8_gather.c's tail rows) so the row need not go through memory.
#ifndef INFER8_HADAMARD_H
#define INFER8_HADAMARD_H

#include <math.h>
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#ifdef __AVX512F__
// fwht_row's butterflies of span `len` < 16 inside a 16-lane register, as partner + sign * self
// in one fused multiply-add (sign * self is exact: the same rounded sums as a + b, a - b).
static inline __attribute__((always_inline)) __m512 stage_in_zmm(__m512 v, int len) {
    __m512 partner;
    __mmask16 minus;  // lanes j with j & len: a - b
    if (len == 1) {
        partner = _mm512_permute_ps(v, 0xb1);
        minus = 0xaaaa;
    } else if (len == 2) {
        partner = _mm512_permute_ps(v, 0x4e);
        minus = 0xcccc;
    } else if (len == 4) {
        partner = _mm512_shuffle_f32x4(v, v, 0xb1);
        minus = 0xf0f0;
    } else {
        partner = _mm512_shuffle_f32x4(v, v, 0x4e);
        minus = 0xff00;
    }
    const __m512 sign = _mm512_mask_blend_ps(minus, _mm512_set1_ps(1.0f), _mm512_set1_ps(-1.0f));
    return _mm512_fmadd_ps(sign, v, partner);
}

// A row of d = 16 R floats (R = 1, 2, 4 or 8, a constant after inlining) in R registers, times
// the orthonormal Hadamard matrix in place: fwht_row's butterflies in its order (spans 1 .. 8
// inside each register, then between them), scaled, each rounded to bf16 precision unless
// x_f32: the same values and roundings as infer8_hadamard_row's loop, without stores between
// stages.
static inline __attribute__((always_inline)) void hadamard_regs(__m512* x, int r, int x_f32) {
#pragma GCC unroll 4
    for (int len = 1; len < 16; len <<= 1)
#pragma GCC unroll 8
        for (int i = 0; i < r; i++) x[i] = stage_in_zmm(x[i], len);
#define BFLY(j, k) \
    (tmp = x[j], x[j] = _mm512_add_ps(tmp, x[k]), x[k] = _mm512_sub_ps(tmp, x[k]))
    // spans of 16, 32, 64 between registers, written out (loops over x left it on the stack)
    __m512 tmp;
    if (r >= 2) BFLY(0, 1);
    if (r >= 4) BFLY(2, 3);
    if (r == 8) BFLY(4, 5), BFLY(6, 7);
    if (r >= 4) BFLY(0, 2), BFLY(1, 3);
    if (r == 8) BFLY(4, 6), BFLY(5, 7);
    if (r == 8) BFLY(0, 4), BFLY(1, 5), BFLY(2, 6), BFLY(3, 7);
#undef BFLY
    const __m512 norm = _mm512_set1_ps(1.0f / sqrtf(16.0f * (float)r));
#pragma GCC unroll 8
    for (int i = 0; i < r; i++) {
        __m512i b = _mm512_castps_si512(_mm512_mul_ps(x[i], norm));
        if (!x_f32) {  // rnd8: to nearest even at bf16 precision
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
            b = _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7fff)), odd);
            b = _mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u));
        }
        x[i] = _mm512_castsi512_ps(b);
    }
}

// hadamard_regs on v [16 R] in memory (~2x fwht_row's speed at d = 64).
static inline __attribute__((always_inline)) void hadamard_zmm(float* v, int r, int x_f32) {
    __m512 x[8];
#pragma GCC unroll 8
    for (int i = 0; i < r; i++)  // by halves: rows often come from 32-byte stores just made,
        // which forward to loads of their size only
        x[i] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(v + 16 * i)),
                                  _mm256_loadu_ps(v + 16 * i + 8), 1);
    hadamard_regs(x, r, x_f32);
#pragma GCC unroll 8
    for (int i = 0; i < r; i++) _mm512_storeu_ps(v + 16 * i, x[i]);
}
#endif

void infer8_hadamard_row(float* v, int64_t d, int x_f32);  // hadamard.c

// infer8_hadamard_row on `rows` rows of d floats, `stride` apart, in place; at d = 64 two rows
// at a time in registers (independent chains the core overlaps: a task's few query or output
// rows otherwise wait on one transform's latency after another).
static inline void hadamard_rows_inline(float* v, int64_t rows, int64_t stride, int64_t d,
                                        int x_f32) {
    int64_t i = 0;
#ifdef __AVX512F__
    if (d == 64) {
        for (; i + 2 <= rows; i += 2) {
            __m512 x[8];
            for (int j = 0; j < 4; j++) {
                x[j] = _mm512_loadu_ps(v + i * stride + 16 * j);
                x[4 + j] = _mm512_loadu_ps(v + (i + 1) * stride + 16 * j);
            }
            if (x_f32) {
                hadamard_regs(x, 4, 1);
                hadamard_regs(x + 4, 4, 1);
            } else {
                hadamard_regs(x, 4, 0);
                hadamard_regs(x + 4, 4, 0);
            }
            for (int j = 0; j < 4; j++) {
                _mm512_storeu_ps(v + i * stride + 16 * j, x[j]);
                _mm512_storeu_ps(v + (i + 1) * stride + 16 * j, x[4 + j]);
            }
        }
    }
#endif
    for (; i < rows; i++) infer8_hadamard_row(v + i * stride, d, x_f32);
}

#endif
