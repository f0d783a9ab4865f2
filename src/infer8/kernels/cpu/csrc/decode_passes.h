// Decode attention's passes over one task's rows (csrc/decode_attention.c): the scores of n
// cached keys and the weighted sum of n cached value rows for a KV head's query heads, one copy
// of the loops per cache kind and head count, the E4M3 value route with 16-lane registers and
// the bf16 pair route.
#ifndef INFER8_DECODE_PASSES_H
#define INFER8_DECODE_PASSES_H

#include "decode_tiles.h"

// The scores of n cached keys (no tail value) for NH heads, in tiles of MAX_KEYS keys.
static inline __attribute__((always_inline)) void score_keys(
    const float* qf, int64_t d, const char* const* rows, const float* kscale, int64_t n,
    int kind, int nh, int x_f32, float sm_scale, float* scores, int64_t len,
    const char* const* also) {
    float dots[MAX_HEADS][MAX_KEYS];
    const int64_t row_bytes = d * kv_elem(kind);
#ifdef __AVX512BF16__
    // bf16 queries (their float values are bf16's) against a bf16 cache: the bf16 dot products
    uint16_t qb[MAX_HEADS * 512];
    const int paired = (kind == KV_BF16 || kind == KV_E4M3) && !x_f32 && d % 32 == 0 && d <= 512;
    if (paired)
        for (int64_t i = 0; i < nh * d; i++) {
            uint32_t bits;
            memcpy(&bits, qf + i, 4);
            qb[i] = (uint16_t)(bits >> 16);
        }
#define DOT_TILE(R, KJ)                                             \
    do {                                                            \
        if (paired)                                                 \
            dot_tile_bf16(qb, d, R, nh, KJ, kind == KV_E4M3, dots); \
        else                                                        \
            dot_tile(qf, d, R, kind, nh, KJ, dots);                 \
    } while (0)
#else
#define DOT_TILE(R, KJ) dot_tile(qf, d, R, kind, nh, KJ, dots)
#endif
    int64_t j = 0;
    for (; j + MAX_KEYS <= n; j += MAX_KEYS) {
        for (int64_t k = j + AHEAD; k < j + AHEAD + MAX_KEYS && k < n; k++) {
            prefetch_row(rows[k], row_bytes);
            if (also != NULL) prefetch_row(also[k], row_bytes);
        }
        DOT_TILE(rows + j, MAX_KEYS);
        v4f ks;
        memcpy(&ks, kscale + j, 16);
        for (int g = 0; g < nh; g++) {  // 4 lanes at once: the same roundings as one by one
            v4f sc;
            memcpy(&sc, dots[g], 16);
            sc *= ks;
            if (!x_f32) sc = rnd4(sc);
            sc *= sm_scale;
            memcpy(scores + g * len + j, &sc, 16);
        }
    }
    for (; j < n; j++) {
        DOT_TILE(rows + j, 1);
        for (int g = 0; g < nh; g++) {
            float sc = dots[g][0] * kscale[j];
            if (!x_f32) sc = round_bf16(sc);
            scores[g * len + j] = sc * sm_scale;
        }
    }
#undef DOT_TILE
}

// The weighted sum of n cached value rows for NH heads into acc [NH, d].
static inline __attribute__((always_inline)) void sum_values(
    const float* w, int64_t stride, const char* const* rows, int64_t n, int kind, int nh,
    float* acc, int64_t d) {
    // ROWS rows at a time through every tile of the head dim, so that a float32 context
    // longer than the L2 cache is read from memory once, not once per tile
    const int64_t row_bytes = d * kv_elem(kind);
    for (int64_t j0 = 0; j0 < n; j0 += ROWS) {
        const int64_t m = n - j0 < ROWS ? n - j0 : ROWS;
        for (int64_t j = j0 + AHEAD; j < j0 + AHEAD + m && j < n; j++)
            prefetch_row(rows[j], row_bytes);
        int64_t c0 = 0;
        for (; c0 + 8 * MAX_CHUNKS <= d; c0 += 8 * MAX_CHUNKS)
            value_tile(w + j0, stride, rows + j0, m, kind, c0, nh, MAX_CHUNKS, acc, d);
        for (; c0 < d; c0 += 8) value_tile(w + j0, stride, rows + j0, m, kind, c0, nh, 1, acc, d);
    }
}

#ifdef __AVX512BF16__
// sum_cached for a bf16 cache whose weights are bf16 values (probabilities rounded to bf16,
// unit scales) and d a multiple of 32: acc [group, d] += sum_j w_g[j] * row_j, two rows per
// AVX512-BF16 instruction (each 32-bit lane holds a dim of row j and of row j + 1, the weights
// broadcast as the matching pair): the same exact products, summed in another order. The
// interleave keeps 128-bit lanes, so accumulators hold dims 8L + {0..3} (low) and 8L + {4..7}
// (high) of each 32-dim slab; they are put back in order once per slab.
static void pair_values(const float* w, int64_t stride, const char* const* rows, int64_t n,
                        int64_t group, float* acc, int64_t d) {
    static const uint16_t zero_row[512] = {0};
    for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
        const int nh = group - g0 < MAX_HEADS ? (int)(group - g0) : MAX_HEADS;
        for (int64_t slab = 0; slab < d; slab += 32) {
            __m512 lo[MAX_HEADS], hi[MAX_HEADS];
            for (int g = 0; g < nh; g++) lo[g] = hi[g] = _mm512_setzero_ps();
            for (int64_t j = 0; j < n; j += 2) {
                if (slab == 0 && j + AHEAD + 1 < n) {
                    prefetch_row(rows[j + AHEAD], d * 2);
                    prefetch_row(rows[j + AHEAD + 1], d * 2);
                }
                const char* r1 = j + 1 < n ? rows[j + 1] : (const char*)zero_row;
                const __m512i a = _mm512_loadu_si512((const void*)(rows[j] + slab * 2));
                const __m512i b = _mm512_loadu_si512((const void*)(r1 + slab * 2));
                const __m512bh plo = (__m512bh)_mm512_unpacklo_epi16(a, b);
                const __m512bh phi = (__m512bh)_mm512_unpackhi_epi16(a, b);
                for (int g = 0; g < nh; g++) {
                    const float* wg = w + (g0 + g) * stride;
                    uint32_t p0, p1 = 0;
                    memcpy(&p0, wg + j, 4);
                    if (j + 1 < n) memcpy(&p1, wg + j + 1, 4);
                    const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)((p1 & 0xffff0000u) | (p0 >> 16)));
                    lo[g] = _mm512_dpbf16_ps(lo[g], plo, pw);
                    hi[g] = _mm512_dpbf16_ps(hi[g], phi, pw);
                }
            }
            for (int g = 0; g < nh; g++) {
                float l[16], h[16];
                _mm512_storeu_ps(l, lo[g]);
                _mm512_storeu_ps(h, hi[g]);
                float* out = acc + (g0 + g) * d + slab;
                for (int i = 0; i < 16; i++) {
                    out[8 * (i / 4) + i % 4] += l[i];
                    out[8 * (i / 4) + 4 + i % 4] += h[i];
                }
            }
        }
    }
}
#endif

#ifdef __AVX512F__
// sum_values for an E4M3 cache with 16-lane registers and every dim of a row in one pass (d =
// 16 NC, NH x NC accumulators): 16 codes widened at once (value / 256 through F16C, as
// load8_as), the same FMAs per dim in the same row order as value_tile: bit for bit its sums.
// `wide`: the weights carry 2^112 more (wide_values) and the codes are widened as
// value * 2^-120: sign-extended to 32 bits and shifted, sign, exponent and mantissa land in
// float32's fields (a subnormal code as a denormal): three integer ops per 16, no permute or
// F16C (0.97x an FP8 decode layer), the same products.
static inline __attribute__((always_inline)) void e4m3_values_tile(
    const float* w, int64_t stride, const char* const* rows, int64_t n, int nh, int nc,
    float* acc, int64_t d, int wide) {
    __m512 a[MAX_HEADS][8];
    for (int g = 0; g < nh; g++)
        for (int c = 0; c < nc; c++) a[g][c] = _mm512_loadu_ps(acc + g * d + 16 * c);
#ifdef __AVX512VBMI__
    const __m512i dup = e4m3_dup_index(), bits = _mm512_set1_epi16((short)0xbf80);
#else
    const __m256i low7 = _mm256_set1_epi16(0x7f), sign = _mm256_set1_epi16(0x80);
#endif
    for (int64_t j = 0; j < n; j++) {
        if (j + AHEAD < n) prefetch_row(rows[j + AHEAD], d);
        __m512 vv[8];
        if (wide) {
            for (int c = 0; c < nc; c++) {
                const __m512i x = _mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i*)((const uint8_t*)rows[j] + 16 * c)));
                vv[c] = _mm512_castsi512_ps(_mm512_and_si512(
                    _mm512_slli_epi32(x, 20), _mm512_set1_epi32((int)0x87f00000u)));
            }
        } else {
#ifdef __AVX512VBMI__
        // 32 codes at once, each in both bytes of its word (one vpermb): shifted right 1
        // (arithmetically), bits 15 and 13..7 are the fp16 of value / 256
        for (int c = 0; c < nc; c += 2) {
            const __m512i x = _mm512_permutexvar_epi8(
                dup, _mm512_castsi256_si512(
                         _mm256_loadu_si256((const __m256i*)((const uint8_t*)rows[j] + 16 * c))));
            const __m512i f16 = _mm512_and_si512(_mm512_srai_epi16(x, 1), bits);
            vv[c] = _mm512_cvtph_ps(_mm512_castsi512_si256(f16));
            vv[c + 1] = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1));
        }
#else
        for (int c = 0; c < nc; c++) {
            const __m256i h = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i*)((const uint8_t*)rows[j] + 16 * c)));
            const __m256i f16 = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(h, sign), 8),
                                                _mm256_slli_epi16(_mm256_and_si256(h, low7), 7));
            vv[c] = _mm512_cvtph_ps(f16);
        }
#endif
        }
        for (int g = 0; g < nh; g++) {
            const __m512 p = _mm512_set1_ps(w[g * stride + j]);
            for (int c = 0; c < nc; c++) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
        }
    }
    for (int g = 0; g < nh; g++)
        for (int c = 0; c < nc; c++) _mm512_storeu_ps(acc + g * d + 16 * c, a[g][c]);
}

// Whether E4M3 values whose largest scale has bf16 bits max_scale are widened as value * 2^-120
// (e4m3_values_tile's `wide`), 2^120 in their scales: where e4m3_values runs, the thread reads
// denormals (MXCSR's DAZ clear: the subnormal codes) and every scale keeps 2^120 finite (< 2^8;
// scales are >= 0, so their bits order as the floats).
static inline int wide_values(int64_t d, uint16_t max_scale) {
    return (d == 64 || d == 128) && !(_mm_getcsr() & 0x40) && max_scale < 0x4380;
}

// e4m3_values_tile for d = 64 or 128 (the common head dims), or 0 where it does not apply.
static inline int e4m3_values(const float* w, int64_t stride, const char* const* rows, int64_t n,
                              int64_t group, float* acc, int64_t d, int wide) {
    if (d != 64 && d != 128) return 0;
    for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
        const int nh = group - g0 < MAX_HEADS ? (int)(group - g0) : MAX_HEADS;
#define E4M3_VALUES(NH, NC)                                                                \
    do {                                                                                   \
        if (wide)                                                                          \
            e4m3_values_tile(w + g0 * stride, stride, rows, n, NH, NC, acc + g0 * d, d, 1); \
        else                                                                               \
            e4m3_values_tile(w + g0 * stride, stride, rows, n, NH, NC, acc + g0 * d, d, 0); \
    } while (0)
        if (d == 64) {
            switch (nh) {
                case 1: E4M3_VALUES(1, 4); break;
                case 2: E4M3_VALUES(2, 4); break;
                default: E4M3_VALUES(3, 4); break;
            }
        } else {
            switch (nh) {
                case 1: E4M3_VALUES(1, 8); break;
                case 2: E4M3_VALUES(2, 8); break;
                default: E4M3_VALUES(3, 8); break;
            }
        }
#undef E4M3_VALUES
    }
    return 1;
}
#endif

// One (sequence, KV head)'s cached keys and values for a constant kind (after inlining) and
// head count: the scores of the first n keys into scores [group, len], the weighted values
// (weights `w`, scaled probabilities) into acc.
#define HEADS_SWITCH(nh, CALL) \
    switch (nh) {              \
        case 1: CALL(1); break; \
        case 2: CALL(2); break; \
        default: CALL(3); break; \
    }

static inline __attribute__((always_inline)) void score_all(
    const float* qf, int64_t d, const char* const* rows, const float* kscale, int64_t n,
    int kind, int64_t group, int x_f32, float sm_scale, float* scores, int64_t len,
    const char* const* also) {
    for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
        const int64_t nh = group - g0 < MAX_HEADS ? group - g0 : MAX_HEADS;
#define SCORE(NH) \
    score_keys(qf + g0 * d, d, rows, kscale, n, kind, NH, x_f32, sm_scale, scores + g0 * len, len, \
               g0 == 0 ? also : NULL)
        HEADS_SWITCH(nh, SCORE)
#undef SCORE
    }
}

static inline __attribute__((always_inline)) void values_all(
    const float* w, int64_t stride, const char* const* rows, int64_t n, int kind, int64_t group,
    float* acc, int64_t d) {
    for (int64_t g0 = 0; g0 < group; g0 += MAX_HEADS) {
        const int64_t nh = group - g0 < MAX_HEADS ? group - g0 : MAX_HEADS;
#define VALUES(NH) sum_values(w + g0 * stride, stride, rows, n, kind, NH, acc + g0 * d, d)
        HEADS_SWITCH(nh, VALUES)
#undef VALUES
    }
}

static void score_cached(const float* qf, int64_t d, const char* const* rows,
                         const float* kscale, int64_t n, int kind, int64_t group, int x_f32,
                         float sm_scale, float* scores, int64_t len, const char* const* also) {
    switch (kind) {  // one copy of the loops per cache dtype: load8's branch folds away
        case KV_F32: score_all(qf, d, rows, kscale, n, KV_F32, group, x_f32, sm_scale, scores, len, also); break;
        case KV_BF16: score_all(qf, d, rows, kscale, n, KV_BF16, group, x_f32, sm_scale, scores, len, also); break;
        case KV_E4M3: score_all(qf, d, rows, kscale, n, KV_E4M3, group, x_f32, sm_scale, scores, len, also); break;
        default: score_all(qf, d, rows, kscale, n, KV_E5M2, group, x_f32, sm_scale, scores, len, also); break;
    }
}

// wide: E4M3 weights carrying 2^112 more (where wide_values holds)
static void sum_cached(const float* w, int64_t stride, const char* const* rows, int64_t n,
                       int kind, int64_t group, float* acc, int64_t d, int wide) {
#ifdef __AVX512F__
    if (kind == KV_E4M3 && e4m3_values(w, stride, rows, n, group, acc, d, wide)) return;
#endif
    switch (kind) {
        case KV_F32: values_all(w, stride, rows, n, KV_F32, group, acc, d); break;
        case KV_BF16: values_all(w, stride, rows, n, KV_BF16, group, acc, d); break;
        case KV_E4M3: values_all(w, stride, rows, n, KV_E4M3, group, acc, d); break;
        default: values_all(w, stride, rows, n, KV_E5M2, group, acc, d); break;
    }
}

#endif
