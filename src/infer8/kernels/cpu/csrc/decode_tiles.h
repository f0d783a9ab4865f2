// Decode attention's cache rows and register tiles (csrc/decode_attention.c): the cache kinds,
// a row's elements as floats, the score and value tiles over a few rows for a few query heads,
// and with AVX512-BF16 E4M3 codes turned into bf16 for the bf16 dot product.
#ifndef INFER8_DECODE_TILES_H
#define INFER8_DECODE_TILES_H

#include <math.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "simd.h"

typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };

static inline int64_t kv_elem(int kind) { return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1; }

static inline float bf16_to_f32(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline float round_bf16(float f) {  // round to nearest even, as torch's .to(bfloat16)
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7f800000u) != 0x7f800000u) b += 0x7fffu + ((b >> 16) & 1u);
    b &= 0xffff0000u;
    memcpy(&f, &b, 4);
    return f;
}

// 8 consecutive elements of a cache row as floats (FP8: unscaled values; E4M3 / 256 where
// `e4m3_raw`, for callers that fold the exact factor 256 into the row's scale).
static inline v8f load8_as(const void* row, int64_t i, int kind, int e4m3_raw) {
    v8f out;
    if (kind == KV_F32) {
        memcpy(&out, (const float*)row + i, 32);
    } else if (kind == KV_BF16) {
        v8u16 h;
        memcpy(&h, (const uint16_t*)row + i, 16);
        v8i bits = __builtin_convertvector(h, v8i) << 16;
        memcpy(&out, &bits, 32);
    } else {
#ifdef __F16C__
        // FP8 as the high bits of an fp16 (E5M2 exactly; E4M3 with its exponent field in
        // fp16's: value / 256, subnormals included) and F16C widens 8 of them at once
        __m128i raw = _mm_loadl_epi64((const __m128i*)((const uint8_t*)row + i));
        __m128i h = _mm_cvtepu8_epi16(raw);
        if (kind == KV_E4M3)
            h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7));
        else
            h = _mm_slli_epi16(h, 8);
        __m256 f = _mm256_cvtph_ps(h);
        memcpy(&out, &f, 32);
        if (kind == KV_E4M3 && !e4m3_raw) out *= 256.0f;
#else
        v8u8 u;
        memcpy(&u, (const uint8_t*)row + i, 8);
        v8i x = __builtin_convertvector(u, v8i);
        v8i mag = x & 0x7f;
        v8i bits, sub;
        v8f subv;
        if (kind == KV_E4M3) {  // bias 7, 3 mantissa bits; subnormals m * 2^-9
            bits = (mag << 20) + (120 << 23);
            sub = mag < 8;
            subv = __builtin_convertvector(mag, v8f) * (1.0f / 512.0f);
        } else {  // E5M2: bias 15, 2 mantissa bits; subnormals m * 2^-16
            bits = (mag << 21) + (112 << 23);
            sub = mag < 4;
            subv = __builtin_convertvector(mag, v8f) * (1.0f / 65536.0f);
        }
        v8i subbits;
        memcpy(&subbits, &subv, 32);
        bits = (bits & ~sub) | (subbits & sub);
        bits |= (x & 0x80) << 24;
        memcpy(&out, &bits, 32);
#endif
    }
    return out;
}

static inline v8f load8(const void* row, int64_t i, int kind) {
    return load8_as(row, i, kind, 0);
}


// Sums of 4 accumulators, one float each (AVX: a horizontal-add tree; else lane by lane).
static inline void hsum4(v8f a, v8f b, v8f c, v8f e, float* out) {
#ifdef __AVX__
    __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), ce = _mm256_hadd_ps((__m256)c, (__m256)e);
    __m256 all = _mm256_hadd_ps(ab, ce);
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
    _mm_storeu_ps(out, sum);
#else
    out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(e);
#endif
}

enum { MAX_HEADS = 3, MAX_KEYS = 4, MAX_CHUNKS = 2, AHEAD = 16, ROWS = 64 };

// A cache row's lines requested ahead of use: rows come block by block in the block table's
// order, which the hardware prefetcher cannot follow across blocks.
static inline void prefetch_row(const char* row, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(row + at);
}

// dots[g][k] = q_g . row_k for NH query heads and KJ key rows: NH x KJ accumulators stay in
// registers (both constants after inlining), each key row widened once for all heads.
static inline __attribute__((always_inline)) void dot_tile(
    const float* qf, int64_t d, const char* const* rows, int kind, int nh, int kj,
    float dots[MAX_HEADS][MAX_KEYS]) {
    v8f acc[MAX_HEADS][MAX_KEYS];
    for (int g = 0; g < nh; g++)
        for (int k = 0; k < kj; k++) acc[g][k] = (v8f){0};
    for (int64_t i = 0; i < d; i += 8) {
        v8f kv[MAX_KEYS];
        for (int k = 0; k < kj; k++) kv[k] = load8_as(rows[k], i, kind, 1);
        for (int g = 0; g < nh; g++) {
            v8f qv;
            memcpy(&qv, qf + g * d + i, 32);
            for (int k = 0; k < kj; k++) acc[g][k] += qv * kv[k];
        }
    }
    for (int g = 0; g < nh; g++) {
        if (kj == MAX_KEYS)
            hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3], dots[g]);
        else
            for (int k = 0; k < kj; k++) dots[g][k] = hsum(acc[g][k]);
    }
}

// acc_g[c0 .. c0 + 8 NC) += sum_j w_g[j] * row_j[c0 ..] over n rows, for NH heads: NH x NC
// accumulators in registers; w: [NH][stride] weights (probabilities times the row's scale).
static inline __attribute__((always_inline)) void value_tile(
    const float* w, int64_t stride, const char* const* rows, int64_t n, int kind, int64_t c0,
    int nh, int nc, float* acc, int64_t d) {
    v8f a[MAX_HEADS][MAX_CHUNKS];
    for (int g = 0; g < nh; g++)
        for (int c = 0; c < nc; c++) memcpy(&a[g][c], acc + g * d + c0 + 8 * c, 32);
    for (int64_t j = 0; j < n; j++) {
        v8f vv[MAX_CHUNKS];
        for (int c = 0; c < nc; c++) vv[c] = load8_as(rows[j], c0 + 8 * c, kind, 1);
        for (int g = 0; g < nh; g++) {
            const float p = w[g * stride + j];
            for (int c = 0; c < nc; c++) a[g][c] += p * vv[c];
        }
    }
    for (int g = 0; g < nh; g++)
        for (int c = 0; c < nc; c++) memcpy(acc + g * d + c0 + 8 * c, &a[g][c], 32);
}

#ifdef __AVX512VBMI__
// vpermb's index that puts byte i of 32 in both bytes of word i
static inline __m512i e4m3_dup_index(void) {
    return _mm512_set_epi8(
        31, 31, 30, 30, 29, 29, 28, 28, 27, 27, 26, 26, 25, 25, 24, 24, 23, 23, 22, 22, 21, 21,
        20, 20, 19, 19, 18, 18, 17, 17, 16, 16, 15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10,
        9, 9, 8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
}
#endif

#ifdef __AVX512BF16__
// 32 E4M3 values / 256 as bf16 bits, exactly: a normal's exponent and mantissa fields shifted
// into bf16's (bias 127 - 7 - 8 = 112), a subnormal (exponent field 0: m * 2^-9 / 256) from a
// table of the 8 (vpermw reads the low 5 bits, which are m there), the sign moved to bit 15.
// E4M3's NaN (0x7f) reads as 1.875 as in load8_as (the cache writes saturate: no NaN is stored).
static inline __m512bh e4m3x32_as_bf16(const uint8_t* src) {
#ifdef __AVX512VBMI__
    // each code in both bytes of its word (one vpermb): the high byte shifted right 4
    // (arithmetically: the sign lands on bit 15) is sign, exponent and mantissa in bf16's
    // fields; the low byte still holds the code for the subnormal test and table index
    const __m512i dup = e4m3_dup_index();
    const __m512i x = _mm512_permutexvar_epi8(
        dup, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)src)));
    // (x >> 4) & 0x87f0 | 112 << 7: the exponent's bias added as bits (no carry: field clear)
    __m512i r = _mm512_ternarylogic_epi32(_mm512_srai_epi16(x, 4),
                                          _mm512_set1_epi16((short)0x87f0),
                                          _mm512_set1_epi16(112 << 7), 0xEA);  // a & b | c
    const __mmask32 sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));
    // a subnormal lane holds sign | 112 << 7 | m << 4: xor'ed with that ^ the table's value
    const __m512i delta = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x0010, 0x0020, 0x0070, 0x0040, 0x0ff0, 0x0fa0, 0x0f10, 0x3800);
    r = _mm512_xor_si512(r, _mm512_maskz_permutexvar_epi16(sub, x, delta));
    return (__m512bh)r;
#else
    const __m512i sub_table = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x3860, 0x3840, 0x3820, 0x3800, 0x37c0, 0x3780, 0x3700, 0);
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)src));
    __m512i r = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x7f0)),
                                 _mm512_set1_epi16(112 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));
    r = _mm512_mask_permutexvar_epi16(r, sub, x, sub_table);
    r = _mm512_or_si512(r, _mm512_and_si512(_mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000)));
    return (__m512bh)r;
#endif
}

// dot_tile for a bf16 cache (or an E4M3 one: `e4m3`, rows turned into bf16 as value / 256, as
// dot_tile's e4m3_raw, once for all heads) and bf16 queries (qb: [nh][d] bf16 bits, d a multiple
// of 32) with AVX512-BF16: each instruction multiplies 32 bf16 pairs exactly and adds them into
// 16 float32 lanes, where dot_tile widens both to float32 and takes 8 FMAs per 64 dims. The same
// products, summed in another order (float32 rounding; the scores then rounded as before).
static inline __attribute__((always_inline)) void dot_tile_bf16(
    const uint16_t* qb, int64_t d, const char* const* rows, int nh, int kj, int e4m3,
    float dots[MAX_HEADS][MAX_KEYS]) {
    __m512 acc[MAX_HEADS][MAX_KEYS];
    for (int g = 0; g < nh; g++)
        for (int k = 0; k < kj; k++) acc[g][k] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
        __m512bh kv[MAX_KEYS];
        for (int k = 0; k < kj; k++)
            kv[k] = e4m3 ? e4m3x32_as_bf16((const uint8_t*)rows[k] + i)
                         : (__m512bh)_mm512_loadu_si512((const void*)(rows[k] + i * 2));
        for (int g = 0; g < nh; g++) {
            const __m512bh qv = (__m512bh)_mm512_loadu_si512((const void*)(qb + g * d + i));
            for (int k = 0; k < kj; k++) acc[g][k] = _mm512_dpbf16_ps(acc[g][k], qv, kv[k]);
        }
    }
    for (int g = 0; g < nh; g++) {
        if (kj == MAX_KEYS) {  // 16 lanes folded to 8, then the 4-key horizontal sums
            v8f h[MAX_KEYS];
            for (int k = 0; k < MAX_KEYS; k++) {
                const __m256 hi =
                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[g][k]), 1));
                __m256 s = _mm256_add_ps(_mm512_castps512_ps256(acc[g][k]), hi);
                memcpy(&h[k], &s, 32);
            }
            hsum4(h[0], h[1], h[2], h[3], dots[g]);
        } else {
            for (int k = 0; k < kj; k++) dots[g][k] = _mm512_reduce_add_ps(acc[g][k]);
        }
    }
}
#endif

#endif
