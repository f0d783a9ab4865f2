// Decode attention over the paged KV cache in one pass per (sequence, KV head), for the CPU.
//
// Each of the GROUP query heads of a KV head scores the sequence's cached keys, read straight
// from the blocks (FP8 widened in registers with the per-token scale folded into the score, or
// 16/32-bit), then the softmax and the weighted sum of values. No gathered copy of the blocks,
// no batched matmul of 3-row matrices, no mask. The FP8 cache's exact tail (attention/
// exact_tail.py) enters as it does in the torch reference: the new token's tail value replaces
// its block value, and each valid tail position gets q.r added to its score and p.r to the
// output. Built with the other native kernels (cpu_native.py); GCC vector extensions, so the
// same source vectorizes for AVX2, AVX-512 or NEON; with AVX512-BF16, a bf16 cache read by bf16
// queries takes the bf16 dot-product instruction for scores and values (exact products, another
// summation order), and so do an E4M3 cache's scores (its codes turned into bf16 exactly); with
// AVX-512, E4M3 values are summed 16 lanes at a time (the same sums); with AVX512-VBMI, 32
// codes are widened by one byte permute and a shift or two (each code in both bytes of a word).
// An FP8 cache's per-token scales are requested for all of a task's blocks before they are read
// (each block's are a line of their own, one memory latency each when read in turn), and a
// decode layer's threads claim their next task one ahead to request its first lines early.

#include <math.h>
#if defined(__F16C__) || defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hadamard.h"
#include "simd.h"
#include "tail_row.h"

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
enum { NEXT_TASK_BYTES = 32768 };  // prefetch_task's budget

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

// The cache, the table and the tail store of one call (see infer8_decode_attention).
typedef struct {
    const void *k_cache, *v_cache;
    const uint16_t *k_scale, *v_scale;
    int kind, x_f32;
    const int64_t *table, *seq_lens;
    int64_t table_stride, num_kv_heads, group, num_blocks, block_size, d;
    float sm_scale;
    const uint8_t* store;  // NULL: no exact tail
    const uint16_t* store_scale;
    const int64_t *read_rows, *pos;
    const float* valid;
    int64_t seats, stride, width;
} decode_params;

// The FP8 scale lines of the blocks holding a task's first n positions (a line of their own per
// block: one memory latency each when read in turn), requested at once, into L2 when `ahead`
// (for a task still to come), else into L1.
static inline void prefetch_block_scales(const decode_params* p, const int64_t* trow, int64_t h,
                                         int64_t n, int ahead) {
    for (int64_t j0 = 0; j0 < n; j0 += p->block_size) {
        const int64_t first = (h * p->num_blocks + trow[j0 / p->block_size]) * p->block_size;
        if (ahead) {
            __builtin_prefetch(p->k_scale + first, 0, 2);
            __builtin_prefetch(p->v_scale + first, 0, 2);
        } else {
            __builtin_prefetch(p->k_scale + first);
            __builtin_prefetch(p->v_scale + first);
        }
    }
}

// What task (b, h) reads first, requested into L2 while the task before it runs: its blocks'
// FP8 scales, its residual rows' scales, and its keys and values up to NEXT_TASK_BYTES of them
// (every row of a short context: the task then reads from L2, not memory, where it would wait
// for each row's latency in turn: 0.89x a bf16 layer of 64 x 140 tokens, 0.97x an FP8 one,
// whose rows cost more compute than latency; longer contexts read the rest AHEAD rows ahead).
static void prefetch_task(const decode_params* p, int64_t b, int64_t h) {
    const int64_t len = p->seq_lens[b], bs = p->block_size, d = p->d;
    if (len <= 0) return;
    const int64_t elem = kv_elem(p->kind);
    const int64_t* trow = p->table + b * p->table_stride;
    if (p->kind >= KV_E4M3) prefetch_block_scales(p, trow, h, len, 1);
    const int64_t rows = NEXT_TASK_BYTES / (2 * d * elem);  // K and V rows alike
    for (int64_t j0 = 0; j0 < len && j0 < rows; j0 += bs) {
        const int64_t first = (h * p->num_blocks + trow[j0 / bs]) * bs * d * elem;
        const int64_t bytes = (len - j0 < bs ? len - j0 : bs) * d * elem;
        const char *kb = (const char*)p->k_cache + first, *vb = (const char*)p->v_cache + first;
        for (int64_t at = 0; at < bytes; at += 64) {
            __builtin_prefetch(kb + at, 0, 2);
            __builtin_prefetch(vb + at, 0, 2);
        }
    }
    if (p->store != NULL && p->width > 0) {
        const int64_t seat = p->read_rows[b * p->width / p->stride];
        const int64_t kat = (h * p->seats + seat) * p->stride;
        const int64_t vat = ((p->num_kv_heads + h) * p->seats + seat) * p->stride;
        __builtin_prefetch(p->store_scale + kat, 0, 2);
        __builtin_prefetch(p->store_scale + kat + p->stride - 1, 0, 2);
        __builtin_prefetch(p->store_scale + vat, 0, 2);
        __builtin_prefetch(p->store_scale + vat + p->stride - 1, 0, 2);
    }
}

// Sequence b's attention for KV head h: qf [group, d] its query heads (floats), newk / newv
// [d] the newest token's tail values (NULL without a tail: the newest row is read from the
// cache); acc [group, d] the output, unrounded.
static void attend_task(const decode_params* p, int64_t b, int64_t h, const float* qf,
                        const float* newk, const float* newv, float* acc) {
    const int64_t len = p->seq_lens[b], d = p->d, group = p->group, width = p->width;
    const int kind = p->kind, x_f32 = p->x_f32;
    const int64_t elem = kv_elem(kind);
    const int is_fp8 = kind >= KV_E4M3;
    // the newest token's tail value replaces its block value: n cached rows are read
    const int64_t n = newk != NULL ? len - 1 : len;
    float* scores = malloc(sizeof(float) * (2 * group * len + 2 * len + 2 * width +
                                            2 * group * width) +
                           3 * sizeof(int64_t) * width + 2 * sizeof(const char*) * (len + width));
    float* w = scores + group * len;  // probabilities times each value row's scale
    float* ks = w + group * len;      // per-row scales (1 unless FP8)
    float* vs = ks + len;
    // the valid tail positions' residual rows (E4M3, read in place) and their scales
    float* tks = vs + len;
    float* tvs = tks + width;
    float* tscores = tvs + width;         // [group, width]: q.r of each
    float* tw = tscores + group * width;  // [group, width]: p times its scale
    const char** krows = (const char**)(tw + group * width);
    const char** vrows = krows + len;
    const char** tkrows = vrows + len;
    const char** tvrows = tkrows + width;
    int64_t* tpos = (int64_t*)(tvrows + width);
    int64_t* tkat = tpos + width;  // the store slots of K's and V's residual rows
    int64_t* tvat = tkat + width;
    int64_t nt = 0;  // valid tail positions
    // position t is at offset t % stride of store row read_rows[(b * width + t) / stride]
    // (width a multiple of stride): counted along, not divided per position
    for (int64_t t = 0, row = width > 0 ? b * width / p->stride : 0, off = 0; t < width;
         t++, off = off + 1 == p->stride ? 0 : off + 1, row += off == 0) {
        if (p->valid[b * width + t] == 0.0f) continue;
        const int64_t seat = p->read_rows[row];
        const int64_t kat = (h * p->seats + seat) * p->stride + off;
        const int64_t vat = ((p->num_kv_heads + h) * p->seats + seat) * p->stride + off;
        tkrows[nt] = (const char*)(p->store + kat * d);
        tvrows[nt] = (const char*)(p->store + vat * d);
        tkat[nt] = kat;
        tvat[nt] = vat;
        __builtin_prefetch(p->store_scale + kat);
        __builtin_prefetch(p->store_scale + vat);
        prefetch_row(tkrows[nt], d);  // read after the cached keys: in cache by then
        prefetch_row(tvrows[nt], d);
        tpos[nt++] = p->pos[b * width + t];
    }
    const int64_t* trow = p->table + b * p->table_stride;
    // E4M3 rows are widened as value / 256 (load8_as): the exact 256 goes into the scale
    const float unit = kind == KV_E4M3 ? 256.0f : 1.0f;
    uint16_t vmax = 0;  // the largest value scale's bits (wide_values)
    if (is_fp8) prefetch_block_scales(p, trow, h, n, 0);  // all requested before the reads
    for (int64_t j0 = 0; j0 < n; j0 += p->block_size) {
        const int64_t first = (h * p->num_blocks + trow[j0 / p->block_size]) * p->block_size;
        const int64_t stop = n - j0 < p->block_size ? n - j0 : p->block_size;
        // separate loops, each vectorized: the rows' addresses, then their scales
        const char* kbase = (const char*)p->k_cache + first * d * elem;
        const char* vbase = (const char*)p->v_cache + first * d * elem;
        for (int64_t off = 0; off < stop; off++) {
            krows[j0 + off] = kbase + off * d * elem;
            vrows[j0 + off] = vbase + off * d * elem;
        }
        if (is_fp8) {
            const uint16_t *ksc = p->k_scale + first, *vsc = p->v_scale + first;
            for (int64_t off = 0; off < stop; off++) {
                ks[j0 + off] = bf16_to_f32(ksc[off]) * unit;
                vs[j0 + off] = bf16_to_f32(vsc[off]) * unit;
                vmax = vsc[off] > vmax ? vsc[off] : vmax;
            }
        } else {
            for (int64_t off = 0; off < stop; off++) ks[j0 + off] = vs[j0 + off] = 1.0f;
        }
    }
#ifdef __AVX512F__
    const int wide = kind == KV_E4M3 && wide_values(d, vmax);
    for (int64_t j = 0; wide && j < n; j++) vs[j] *= 0x1p112f;  // 256 * 2^112, exactly
#else
    const int wide = 0;
#endif
    for (int64_t j = n; j < len; j++) vs[j] = 1.0f;  // the newest token's tail value
    const float sm_scale = p->sm_scale;
    // scores (the value rows are requested while the keys are scored)
    score_cached(qf, d, krows, ks, n, kind, group, x_f32, sm_scale, scores, len, vrows);
    if (n < len) {  // the newest token's tail key, as written by the model
        const char* fresh = (const char*)newk;
        float one = 1.0f;
        score_cached(qf, d, &fresh, &one, 1, KV_F32, group, x_f32, sm_scale, scores + n, len,
                     NULL);
    }
    // tail corrections: q.r at each valid tail position, in the cached keys' tiles
    // the tail's scales, requested in the setup loop and read only now (their lines have
    // come in meanwhile); E4M3 is widened as value / 256 (load8_as): the 256 goes into them
    for (int64_t i = 0; i < nt; i++) tks[i] = bf16_to_f32(p->store_scale[tkat[i]]) * 256.0f;
    if (nt > 0) {
        score_cached(qf, d, tkrows, tks, nt, KV_E4M3, group, x_f32, sm_scale, tscores, width,
                     tvrows);
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < nt; i++) scores[g * len + tpos[i]] += tscores[g * width + i];
    }
    // softmax per query head (probabilities in the model dtype, as the reference casts)
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * len;
        const float m = max_of(sg, len);
        float sum = 0.0f;
        int64_t j = 0;
        v8f vsum = {0};
        for (; j + 8 <= len; j += 8) {
            v8f x;
            memcpy(&x, sg + j, 32);
            x = exp8(x - m);
            memcpy(sg + j, &x, 32);
            vsum += x;
        }
        for (; j < len; j++) {
            v8f x = {sg[j] - m};
            sg[j] = exp8(x)[0];
            sum += sg[j];
        }
        sum += hsum(vsum);
        const float inv = 1.0f / sum;
        j = 0;
        for (; j + 8 <= len; j += 8) {  // vs is 1 past n (the newest token's tail value)
            v8f pr, sv;
            memcpy(&pr, sg + j, 32);
            memcpy(&sv, vs + j, 32);
            pr *= inv;
            if (!x_f32) pr = rnd8(pr);
            memcpy(sg + j, &pr, 32);
            pr *= sv;
            memcpy(w + g * len + j, &pr, 32);
        }
        for (; j < len; j++) {
            sg[j] *= inv;
            if (!x_f32) sg[j] = round_bf16(sg[j]);
            w[g * len + j] = sg[j] * vs[j];
        }
    }
    // values
    memset(acc, 0, sizeof(float) * group * d);
#ifdef __AVX512BF16__
    if (kind == KV_BF16 && !x_f32 && d % 32 == 0 && d <= 512)  // w: bf16 probabilities
        pair_values(w, len, vrows, n, group, acc, d);
    else
#endif
        sum_cached(w, len, vrows, n, kind, group, acc, d, wide);
    if (n < len) {  // the newest token's tail value
        const char* fresh = (const char*)newv;
        sum_cached(w + n, len, &fresh, 1, KV_F32, group, acc, d, 0);
    }
    if (nt > 0) {  // p.r at each valid tail position, in the cached values' tiles
        uint16_t tmax = 0;  // the residual rows' scales, widened alike where they allow it
        for (int64_t i = 0; i < nt; i++)
            tmax = p->store_scale[tvat[i]] > tmax ? p->store_scale[tvat[i]] : tmax;
#ifdef __AVX512F__
        const int twide = wide_values(d, tmax);
#else
        const int twide = 0;
#endif
        const float tunit = twide ? 0x1p120f : 256.0f;
        for (int64_t i = 0; i < nt; i++) tvs[i] = bf16_to_f32(p->store_scale[tvat[i]]) * tunit;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < nt; i++)
                tw[g * width + i] = scores[g * len + tpos[i]] * tvs[i];
        sum_cached(tw, width, tvrows, nt, KV_E4M3, group, acc, d, twide);
    }
    free(scores);
}

// A row of float32 (x_f32) or bf16 bits as floats, and back (rounded to nearest even).
static inline void load_row(const void* x, int64_t at, int64_t d, int x_f32, float* out) {
    for (int64_t i = 0; i < d; i++)
        out[i] = x_f32 ? ((const float*)x)[at + i] : bf16_to_f32(((const uint16_t*)x)[at + i]);
}

static inline void store_row(void* x, int64_t at, int64_t d, int x_f32, const float* v) {
    for (int64_t i = 0; i < d; i++) {
        if (x_f32) {
            ((float*)x)[at + i] = v[i];
        } else {
            float f = round_bf16(v[i]);
            uint32_t bits;
            memcpy(&bits, &f, 4);
            ((uint16_t*)x)[at + i] = (uint16_t)(bits >> 16);
        }
    }
}

// q: [B, H, D] (query rows of the decode sequences); cache: [KVH, NB, BS, D]; scales:
// [KVH, NB, BS] bf16 (FP8 only); table: [B, table_stride]; seq_lens: [B]. Tail (new_k NULL:
// none): new_k/new_v [B, KVH, D] tail values of each sequence's newest token; the residual
// store (K's heads, then V's: [2 KVH, seats, stride, D] E4M3, scales bf16) read in place,
// sequence b's width positions t at store row read_rows[b * width / stride + t / stride],
// offset t % stride; pos/valid [B, width]. out: [B, H, D]. x_f32: q/new/out are float32 (else
// bf16, with the torch reference's roundings of scores, probabilities and the output; the
// residuals' scales are applied after their dot products, as the cached rows' are).
void infer8_decode_attention(
    const void* q, const void* k_cache, const void* v_cache, const uint16_t* k_scale,
    const uint16_t* v_scale, int kind, const int64_t* table, int64_t table_stride,
    const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
    int64_t num_blocks, int64_t block_size, int64_t d, float sm_scale, int x_f32,
    const void* new_k, const void* new_v, const uint8_t* store, const uint16_t* store_scale,
    const int64_t* read_rows, int64_t seats, int64_t stride, const int64_t* pos,
    const float* valid, int64_t width, void* out) {
    const decode_params p = {k_cache, v_cache, k_scale, v_scale, kind, x_f32, table, seq_lens,
                             table_stride, num_kv_heads, group, num_blocks, block_size, d,
                             sm_scale, new_k != NULL ? store : NULL, store_scale, read_rows,
                             pos, valid, seats, stride, new_k != NULL ? width : 0};
    const int64_t num_heads = num_kv_heads * group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        if (seq_lens[b] <= 0) continue;  // callers pass real sequences only
        float* qf = malloc(sizeof(float) * 4 * group * d);
        float *acc = qf + group * d, *nk = acc + group * d, *nv = nk + d;
        load_row(q, (b * num_heads + h * group) * d, group * d, x_f32, qf);
        if (new_k != NULL) {
            load_row(new_k, (b * num_kv_heads + h) * d, d, x_f32, nk);
            load_row(new_v, (b * num_kv_heads + h) * d, d, x_f32, nv);
        }
        attend_task(&p, b, h, qf, new_k != NULL ? nk : NULL, new_k != NULL ? nv : NULL, acc);
        store_row(out, (b * num_heads + h * group) * d, group * d, x_f32, acc);
        free(qf);
    }
}

// Defined beside the batched passes they serve one row of (fp8_gather.c, hadamard.c).
void infer8_quantize_row(const float* v, int64_t d, int is_e5m2, float per_amax, uint8_t* out,
                         uint16_t* scale);

// Residual rows of sequence b (K's head h, V's head kvh + h) into the store's slots where
// ids[i] == b: exact_tail.write_store for one (sequence, KV head).
static void store_residuals(uint8_t* store, uint16_t* store_scale, int64_t store_slots,
                            int64_t num_kv_heads, int64_t h, int64_t d, const int64_t* ids,
                            const int64_t* slots, int64_t n, int64_t b, const uint8_t* rk,
                            uint16_t sk, const uint8_t* rv, uint16_t sv) {
    int64_t i = 0, hi = n;  // ids ascend (build_tail_metadata lists a step's tokens in order)
    while (i < hi) {
        const int64_t mid = (i + hi) / 2;
        if (ids[mid] < b) i = mid + 1; else hi = mid;
    }
    for (; i < n && ids[i] == b; i++) {
        const int64_t kat = h * store_slots + slots[i];
        const int64_t vat = (num_kv_heads + h) * store_slots + slots[i];
        memcpy(store + kat * d, rk, (size_t)d);
        memcpy(store + vat * d, rv, (size_t)d);
        store_scale[kat] = sk;
        store_scale[vat] = sv;
    }
}

// A whole decode layer's attention for an all-decode batch (token b is sequence b) in one call
// instead of a dozen: what TorchRefAttention's write_kv then forward do, in their order and
// with their roundings, in two passes over (sequence, KV head) tasks: (1) the new K/V rows
// (x [B, KVH, D] at row stride kv_stride, head stride d) rotated by the Hadamard matrix
// (rotate_keys; V too with rotate_values), written to the cache at slot_mapping[b] (copied, or
// quantized with a dynamic scale: cache_per_amax) and, with a tail store (store not NULL),
// their residuals and tail values (exact_tail.tail_values) and the sink rows stored
// (sink_ids/slots); (2) the attention of q [B, H, D] (row stride q_stride; rotated with the
// keys), the output [B, H, D] rotated back with the values, then (3) the task's ring rows
// stored (ring_ids/slots: its sequence's own seat, which no other task reads; the slot a new
// row takes is the oldest position this task has just read). Every write lands before any
// read of it, as AttentionMetadata requires.
void infer8_decode_layer(
    const void* q, int64_t q_stride, const void* k, const void* v, int64_t kv_stride,
    const int64_t* slot_mapping, void* k_cache, void* v_cache, uint16_t* k_scale,
    uint16_t* v_scale, int kind, const int64_t* table, int64_t table_stride,
    const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
    int64_t num_blocks, int64_t block_size, int64_t d, float sm_scale, int x_f32,
    int rotate_keys, int rotate_values, float cache_per_amax, uint8_t* store,
    uint16_t* store_scale, const int64_t* read_rows, int64_t seats, int64_t stride,
    const int64_t* pos, const float* valid, int64_t width, float e4m3_per_amax,
    const int64_t* sink_ids, const int64_t* sink_slots, int64_t num_sinks,
    const int64_t* ring_ids, const int64_t* ring_slots, int64_t num_rings, void* out) {
    const decode_params p = {k_cache, v_cache, k_scale, v_scale, kind, x_f32, table, seq_lens,
                             table_stride, num_kv_heads, group, num_blocks, block_size, d,
                             sm_scale, store, store_scale, read_rows, pos, valid, seats, stride,
                             store != NULL ? width : 0};
    const int64_t tasks = batch * num_kv_heads, num_heads = num_kv_heads * group;
    const int64_t store_slots = seats * stride;
    const int64_t elem = kv_elem(kind);
    // per task: the tail values of K and V (floats), their residuals (E4M3) and scales
    float* tails = malloc(sizeof(float) * 2 * d * tasks + (2 * d + 4) * tasks);
    uint8_t* residuals = (uint8_t*)(tails + 2 * d * tasks);
    uint16_t* scales = (uint16_t*)(residuals + 2 * d * tasks);
    int64_t claimed = 0;  // pass (2)'s next task
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            float nk[512], nv[512];
            if (d > 512 || seq_lens[b] <= 0) continue;  // the caller checks both
            const int64_t slot = h * num_blocks * block_size + slot_mapping[b];
            if (store != NULL) {  // written, residuals and tail values in one pass per row
                const int e5m2 = kind == KV_E5M2;
                float* tk = tails + 2 * d * task;
                uint8_t* rk = residuals + 2 * d * task;
                uint16_t* sk = scales + 2 * task;
                // K's row and V's as a pair; tail values as floats (block NULL)
                const int64_t at = b * kv_stride + h * d;
                const tail_row_args rows[2] = {
                    {k, at, rotate_keys, (uint8_t*)k_cache + slot * d, k_scale + slot, rk, sk, 0},
                    {v, at, rotate_keys && rotate_values, (uint8_t*)v_cache + slot * d,
                     v_scale + slot, rk + d, sk + 1, d}};
                infer8_tail_pair(rows, d, x_f32, e5m2, cache_per_amax, e4m3_per_amax, tk, NULL);
                store_residuals(store, store_scale, store_slots, num_kv_heads, h, d, sink_ids,
                                sink_slots, num_sinks, b, rk, sk[0], rk + d, sk[1]);
                continue;
            }
            load_row(k, b * kv_stride + h * d, d, x_f32, nk);
            load_row(v, b * kv_stride + h * d, d, x_f32, nv);
            if (rotate_keys) infer8_hadamard_row(nk, d, x_f32);
            if (rotate_keys && rotate_values) infer8_hadamard_row(nv, d, x_f32);
            if (kind >= KV_E4M3) {  // torch_ref.write_kv's dynamic FP8 write
                const int e5m2 = kind == KV_E5M2;
                infer8_quantize_row(nk, d, e5m2, cache_per_amax, (uint8_t*)k_cache + slot * d,
                                    k_scale + slot);
                infer8_quantize_row(nv, d, e5m2, cache_per_amax, (uint8_t*)v_cache + slot * d,
                                    v_scale + slot);
            } else {  // a copy (rounded to nearest even into a bf16 cache)
                store_row((char*)k_cache + slot * d * elem, 0, d, kind == KV_F32, nk);
                store_row((char*)v_cache + slot * d * elem, 0, d, kind == KV_F32, nv);
            }
        }
        // (2) tasks claimed one ahead (a dynamic schedule that knows each thread's next
        // task), whose first lines are requested before this one runs
        int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (next < tasks) {
            const int64_t task = next;
            next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (next < tasks) prefetch_task(&p, next / num_kv_heads, next % num_kv_heads);
            const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            if (d > 512 || seq_lens[b] <= 0) continue;
            float* qf = malloc(sizeof(float) * 2 * group * d);
            float* acc = qf + group * d;
            load_row(q, b * q_stride + h * group * d, group * d, x_f32, qf);
            if (rotate_keys) hadamard_rows_inline(qf, group, d, d, x_f32);
            const float* tk = store != NULL ? tails + 2 * d * task : NULL;
            attend_task(&p, b, h, qf, tk, tk != NULL ? tk + d : NULL, acc);
            if (rotate_keys && rotate_values) {  // the output rounded, then rotated back
                if (!x_f32)
                    for (int64_t i = 0; i < group * d; i++) acc[i] = round_bf16(acc[i]);
                hadamard_rows_inline(acc, group, d, d, x_f32);
            }
            store_row(out, (b * num_heads + h * group) * d, group * d, x_f32, acc);
            free(qf);
            if (store != NULL)  // (3) the ring rows, once this task's reads are done
                store_residuals(store, store_scale, store_slots, num_kv_heads, h, d, ring_ids,
                                ring_slots, num_rings, b, residuals + 2 * d * task,
                                scales[2 * task], residuals + 2 * d * task + d,
                                scales[2 * task + 1]);
        }
    }
    free(tails);
}
