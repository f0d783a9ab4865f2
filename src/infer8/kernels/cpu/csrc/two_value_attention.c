// Causal attention where each (query, key) pair reads one of two values of the key, for float32
// or bf16 CPU tensors (computed in float32): split_prefill.py's two_value_attention (an FP8 cache's exact tail on a short
// prompt: block values, or block + residual inside the tail's band and at the sinks). The torch
// form computes every score twice ([H, q_len, n] products with both keys), selects, masks and
// softmaxes in ~10 passes over the scores; here each task (4 queries x 3 heads of one KV head)
// scores 8 keys at a time against key tiles stored transposed, computing the second keys'
// scores only in tiles where some query reads them, then one softmax pass and one weighted sum
// per row, each key's value read from the side its query reads. bf16 inputs on CPUs with
// AVX512-BF16 (TV_DP): keys transposed as pairs of dims and scored by bf16 dot products (8 keys
// x 2 dims an instruction), the softmax numerators rounded to bf16 (as SDPA's bf16 kernel
// rounds them before its value product; their sum stays float32) and the values summed two
// keys an instruction: ~1.65x the float32 FMAs' speed on a 128-token prompt here.

#include <math.h>
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define TV_DP 1  // bf16 inputs: scores and weighted values by AVX512-BF16 dot products
#else
#define TV_DP 0
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hadamard.h"
#include "simd.h"
#include "args.h"

enum { QB = 4, HB = 3, ROWS = QB * HB, CHUNKS = 4 };  // a task's rows: QB queries x HB heads

typedef uint8_t v8u8 __attribute__((vector_size(8)));

// 8 x 8 floats transposed in registers (r[j][i] -> r[i][j]): three rounds of two-source
// shuffles.
static inline __attribute__((always_inline)) void transpose8(v8f r[8]) {
    const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f a[8], b[8];
    for (int i = 0; i < 4; i++) {  // pairs of rows: columns {0, 1, 4, 5} and {2, 3, 6, 7}
        a[2 * i] = __builtin_shuffle(r[2 * i], r[2 * i + 1], lo);
        a[2 * i + 1] = __builtin_shuffle(r[2 * i], r[2 * i + 1], hi);
    }
    for (int i = 0; i < 2; i++)  // fours of rows: columns {c, c + 4}
        for (int h = 0; h < 2; h++) {
            b[4 * i + 2 * h] = __builtin_shuffle(a[4 * i + h], a[4 * i + 2 + h], lo2);
            b[4 * i + 2 * h + 1] = __builtin_shuffle(a[4 * i + h], a[4 * i + 2 + h], hi2);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shuffle(b[i], b[4 + i], lo4);
        r[4 + i] = __builtin_shuffle(b[i], b[4 + i], hi4);
    }
}

// kt [tiles][d][8]: keys 8t .. 8t + 7 of one KV head (k: n rows of d, `row` elements apart),
// transposed; zero past n. Whole tiles 8 x 8 elements at a time in registers, the last partial
// one element-wise.
static void transpose_keys(const void* k, int64_t n, int64_t d, int64_t row, int bf16,
                           float* kt) {
    const int64_t tiles = (n + 7) / 8;
    for (int64_t t = 0; t < tiles; t++) {
        float* dst = kt + t * d * 8;
        if (t * 8 + 8 <= n) {  // d is a multiple of 8
            for (int64_t c0 = 0; c0 < d; c0 += 8) {
                v8f r[8];
                for (int j = 0; j < 8; j++) r[j] = ld8(k, (t * 8 + j) * row + c0, bf16);
                transpose8(r);
                for (int i = 0; i < 8; i++) memcpy(dst + (c0 + i) * 8, &r[i], 32);
            }
            continue;
        }
        for (int64_t j = 0; j < 8; j++) {
            const int64_t key = t * 8 + j;
            for (int64_t c = 0; c < d; c++) dst[c * 8 + j] = key < n ? ld1(k, key * row + c, bf16) : 0.0f;
        }
    }
}

// acc[r] = (q_r . key_j) for the 8 keys of a transposed tile, all ROWS rows.
static inline __attribute__((always_inline)) void score_tile(const float* const* qr,
                                                             const float* kt, int64_t d,
                                                             v8f acc[ROWS]) {
    for (int r = 0; r < ROWS; r++) acc[r] = (v8f){0};
    for (int64_t c = 0; c < d; c++) {
        v8f kv;
        memcpy(&kv, kt + c * 8, 32);
        for (int r = 0; r < ROWS; r++) acc[r] += qr[r][c] * kv;
    }
}

// a[h][c] = sum_j p[h][j] * value_j[c0 + 8c ..] for HB heads and NC vectors of the head dim,
// value_j from v2 where second[j], else v1 ([n, d] rows): HB x NC accumulators in registers,
// each value row widened once for all heads.
static inline __attribute__((always_inline)) void weighted_rows(
    const float* const* p, const uint8_t* second, const char* v1, const char* v2, int64_t count,
    int64_t row_stride, int64_t c0, int bf16, int nc, v8f a[HB][CHUNKS]) {
    const int64_t es = bf16 ? 2 : 4;
    for (int h = 0; h < HB; h++)
        for (int c = 0; c < nc; c++) a[h][c] = (v8f){0};
    for (int64_t j = 0; j < count; j++) {
        const char* row = (second[j] ? v2 : v1) + (j * row_stride + c0) * es;
        v8f vv[CHUNKS];
        for (int c = 0; c < nc; c++) vv[c] = ld8(row, 8 * c, bf16);
        for (int h = 0; h < HB; h++) {
            const float w = p[h][j];
            for (int c = 0; c < nc; c++) a[h][c] += w * vv[c];
        }
    }
}

#if TV_DP
// kt [tiles][d / 2][8]: the bf16 keys of transpose_keys as pairs of dims (one 32-bit word, as
// AVX512-BF16 multiplies them), keys 8t .. 8t + 7 in a tile; zero past n. d a multiple of 16.
static void transpose_key_pairs(const uint16_t* k, int64_t n, int64_t d, int64_t row,
                                uint32_t* kt) {
    const int64_t tiles = (n + 7) / 8, d2 = d / 2;
    for (int64_t t = 0; t < tiles; t++) {
        uint32_t* dst = kt + t * d2 * 8;
        if (t * 8 + 8 <= n) {
            for (int64_t c0 = 0; c0 < d2; c0 += 8) {  // 8 keys x 8 pairs: words transposed
                v8f r[8];
                for (int j = 0; j < 8; j++) memcpy(&r[j], k + (t * 8 + j) * row + 2 * c0, 32);
                transpose8(r);
                for (int i = 0; i < 8; i++) memcpy(dst + (c0 + i) * 8, &r[i], 32);
            }
            continue;
        }
        for (int64_t j = 0; j < 8; j++)
            for (int64_t c = 0; c < d2; c++) {
                uint32_t w = 0;
                if (t * 8 + j < n) memcpy(&w, k + (t * 8 + j) * row + 2 * c, 4);
                dst[c * 8 + j] = w;
            }
    }
}

// score_tile on bf16 pairs: acc[r] = (q_r . key_j) for a tile's 8 keys, qw[r] row r's d / 2
// pairs; each instruction multiplies 8 keys x 2 dims exactly and adds them in float32.
static inline __attribute__((always_inline)) void score_tile_dp(const uint32_t* const* qw,
                                                                const uint32_t* kt, int64_t d2,
                                                                v8f acc[ROWS]) {
    __m256 a[ROWS];
    for (int r = 0; r < ROWS; r++) a[r] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d2; c++) {
        const __m256bh kv = (__m256bh)_mm256_loadu_si256((const __m256i*)(kt + c * 8));
        for (int r = 0; r < ROWS; r++)
            a[r] = _mm256_dpbf16_ps(a[r], kv, (__m256bh)_mm256_set1_epi32((int)qw[r][c]));
    }
    for (int r = 0; r < ROWS; r++) memcpy(&acc[r], &a[r], 32);
}

// out[h][c0 ..] = sum_j p[h][j] * value_j[c0 ..] for HB heads over NS slabs of 32 dims, p the
// softmax numerators rounded to bf16 (as SDPA's bf16 kernel rounds them before its value
// product; zero from count on), value_j from v2 where second[j], else v1 ([n, d] bf16 rows):
// two keys per instruction (each 32-bit lane a dim of key j and of key j + 1, their weights
// broadcast as the matching pair). The interleave keeps 128-bit lanes: accumulators hold dims
// 8L + {0..3} (lo) and 8L + {4..7} (hi) of each slab, put back in order at the end.
static inline __attribute__((always_inline)) void weighted_pairs(
    const uint16_t* const* p, const uint8_t* second, const uint16_t* v1, const uint16_t* v2,
    int64_t count, int64_t n, int64_t d, int64_t row, int64_t c0, int ns, float* out) {
    static const uint16_t zero_row[512] = {0};
    __m512 lo[HB][2], hi[HB][2];
    for (int h = 0; h < HB; h++)
        for (int s = 0; s < ns; s++) lo[h][s] = hi[h][s] = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 2) {
        const uint16_t* ra = (second[j] ? v2 : v1) + j * row + c0;
        // past count p is 0 (row j + 1 a real row, or zeros past n)
        const uint16_t* rb = j + 1 < n ? (second[j + 1] ? v2 : v1) + (j + 1) * row + c0 : zero_row;
        __m512bh pl[2], ph[2];
        for (int s = 0; s < ns; s++) {
            const __m512i a = _mm512_loadu_si512((const void*)(ra + 32 * s));
            const __m512i b = _mm512_loadu_si512((const void*)(rb + 32 * s));
            pl[s] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            ph[s] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        for (int h = 0; h < HB; h++) {
            uint32_t pw;
            memcpy(&pw, p[h] + j, 4);
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pw);
            for (int s = 0; s < ns; s++) {
                lo[h][s] = _mm512_dpbf16_ps(lo[h][s], pl[s], w);
                hi[h][s] = _mm512_dpbf16_ps(hi[h][s], ph[s], w);
            }
        }
    }
    for (int h = 0; h < HB; h++)
        for (int s = 0; s < ns; s++) {
            float l[16], u[16];
            _mm512_storeu_ps(l, lo[h][s]);
            _mm512_storeu_ps(u, hi[h][s]);
            float* o = out + h * d + c0 + 32 * s;
            for (int i = 0; i < 16; i++) {
                o[8 * (i / 4) + i % 4] = l[i];
                o[8 * (i / 4) + 4 + i % 4] = u[i];
            }
        }
}
#endif

// q element (h, i, c) at q[i * q_tok + h * q_head + c], out likewise (o_tok, o_head); k1, k2,
// v1, v2: [kvh, n, d] rows of d elements, KV head x at x + x_head stride, key j's row at
// j * k_row (k1, k2) or j * v_row (v1, v2); all float32, or all
// bf16 (bf16 != 0); second [q_len, n]: 1 where query i reads key j's second value. Query i
// sits at position q_start + i and sees keys 0 .. q_start + i; query head h reads KV head
// h / group. d is a multiple of 8. rotate_q / rotate_out: q rows times the Hadamard matrix as
// they are read, output rows as they are written (exact_tail.rotate: the values and roundings
// of rotating q before the call and the output after it; d a power of two).
void infer8_two_value_attention_struct(const infer8_two_value_attention_args* a) {
    INFER8_TWO_VALUE_ATTENTION_FIELDS(INFER8_UNPACK)
    const int64_t es = bf16 ? 2 : 4;  // element size in bytes
    const int64_t group = num_heads / num_kv_heads, tiles = (n + 7) / 8, padded = tiles * 8;
    // one set of transposed tiles when both sides are the same keys (causal_attention)
    const int64_t sides = k1 == k2 && k1_head == k2_head ? 1 : 2;
    // bf16 with AVX512-BF16: keys as pairs of dims, q rows and probabilities as bf16
    const int dp = TV_DP && bf16 && d % 32 == 0 && d <= 512;
    const int64_t tile_words = dp ? d / 2 * 8 : d * 8;  // a tile's 32-bit words
    float* kt = malloc(sizeof(float) * sides * num_kv_heads * tiles * tile_words);
#pragma omp parallel for schedule(static)
    for (int64_t x = 0; x < sides * num_kv_heads; x++) {
        const char* src = x < num_kv_heads ? (const char*)k1 + x * k1_head * es
                                           : (const char*)k2 + (x - num_kv_heads) * k2_head * es;
#if TV_DP
        if (dp) {
            transpose_key_pairs((const uint16_t*)src, n, d, k_row,
                                (uint32_t*)kt + x * tiles * tile_words);
            continue;
        }
#endif
        transpose_keys(src, n, d, k_row, bf16, kt + x * tiles * tile_words);
    }
    const int64_t qblocks = (q_len + QB - 1) / QB, hblocks = (group + HB - 1) / HB;
#pragma omp parallel
    {
        float* s = malloc(sizeof(float) * ROWS * padded);
        float* qbuf = malloc(sizeof(float) * ROWS * d);  // the task's query rows as floats
        float* obuf = malloc(sizeof(float) * HB * d + 64);  // output rows before the rotation
        // dp: the q rows and probabilities as bf16
        uint16_t* qbits = dp ? malloc(sizeof(uint16_t) * ROWS * d) : NULL;
        uint16_t* pb = dp ? malloc(sizeof(uint16_t) * ROWS * padded) : NULL;
        float* vals = malloc(sizeof(float) * HB * d);  // a query's weighted values
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_kv_heads * hblocks * qblocks; task++) {
            // the longest rows first: the last query block (most keys) gets task 0
            const int64_t qb = qblocks - 1 - task % qblocks, hb = task / qblocks % hblocks;
            const int64_t kvh = task / qblocks / hblocks;
            const int64_t heads = group - hb * HB < HB ? group - hb * HB : HB;  // real ones
            const float* qr[ROWS];
            int64_t pos[ROWS], qi[ROWS];
            for (int r = 0; r < ROWS; r++) {  // rows past the end repeat the last real one
                const int64_t i = qb * QB + r / HB, g = hb * HB + r % HB;
                qi[r] = i < q_len ? i : q_len - 1;
                const int64_t h = kvh * group + (g < group ? g : group - 1);
                for (int64_t c = 0; c < d; c += 8) {  // d a multiple of 8
                    const v8f x = ld8(q, qi[r] * q_tok + h * q_head + c, bf16);
                    memcpy(qbuf + r * d + c, &x, 32);
                }
                qr[r] = qbuf + r * d;
                pos[r] = q_start + qi[r];
            }
            if (rotate_q) hadamard_rows_inline(qbuf, ROWS, d, d, !bf16);
#if TV_DP
            const uint32_t* qw[ROWS];
            if (dp) {  // bf16 values (rotated rows rounded to bf16 above): their high halves
                for (int64_t i = 0; i < ROWS * d; i++) {
                    uint32_t bits;
                    memcpy(&bits, qbuf + i, 4);
                    qbits[i] = (uint16_t)(bits >> 16);
                }
                for (int r = 0; r < ROWS; r++) qw[r] = (const uint32_t*)(qbits + r * d);
            }
#endif
            const int64_t last = pos[ROWS - 1] < n - 1 ? pos[ROWS - 1] : n - 1;
            const float* kt1 = kt + kvh * tiles * tile_words;
            const float* kt2 = kt + ((sides - 1) * num_kv_heads + kvh) * tiles * tile_words;
            for (int64_t t = 0; t * 8 <= last; t++) {
                v8f acc[ROWS], alt[ROWS];
                v8i pick[QB];  // per query: -1 where it reads the key's second value
                int mixed = 0, only_second = 1;  // only: every key a query sees reads it
                for (int qq = 0; qq < QB; qq++) {
                    const int r = qq * HB;
                    uint64_t bits = 0;
                    if (t * 8 <= pos[r]) {
                        const uint8_t* row = second + qi[r] * n + t * 8;
                        if (t * 8 + 8 <= n) {
                            memcpy(&bits, row, 8);
                        } else {
                            for (int64_t j = 0; j < n - t * 8; j++) bits |= (uint64_t)row[j] << (8 * j);
                        }
                        const int64_t seen = pos[r] - t * 8 + 1;  // causal: keys <= pos
                        const uint64_t visible = seen < 8 ? (1ull << (8 * seen)) - 1 : ~0ull;
                        bits &= visible;
                        only_second &= bits == (0x0101010101010101ull & visible);
                    }
                    v8u8 b;
                    memcpy(&b, &bits, 8);
                    pick[qq] = __builtin_convertvector(b, v8i) != 0;
                    mixed |= bits != 0;
                }
                // inside every query's band: second keys only
                const float* first_tile = (mixed && only_second ? kt2 : kt1) + t * tile_words;
#if TV_DP
                if (dp)
                    score_tile_dp(qw, (const uint32_t*)first_tile, d / 2, acc);
                else
#endif
                    score_tile(qr, first_tile, d, acc);
                if (mixed && !only_second) {  // some rows read second values: score them too
#if TV_DP
                    if (dp)
                        score_tile_dp(qw, (const uint32_t*)(kt2 + t * tile_words), d / 2, alt);
                    else
#endif
                        score_tile(qr, kt2 + t * tile_words, d, alt);
                    for (int r = 0; r < ROWS; r++) {
                        v8i a, b;
                        memcpy(&a, &alt[r], 32);
                        memcpy(&b, &acc[r], 32);
                        a = (a & pick[r / HB]) | (b & ~pick[r / HB]);
                        memcpy(&acc[r], &a, 32);
                    }
                }
                for (int r = 0; r < ROWS; r++) {
                    v8f sc = acc[r] * scale;
                    if (t * 8 + 7 > pos[r])
                        for (int j = 0; j < 8; j++)
                            if (t * 8 + j > pos[r]) sc[j] = -INFINITY;  // causal (and past n)
                    memcpy(s + r * padded + t * 8, &sc, 32);
                }
            }
            float inv[ROWS];
            for (int r = 0; r < ROWS; r++) {  // softmax numerators in place, 1 / their sum
                float* sr = s + r * padded;
                const int64_t count = pos[r] + 1, span = (count + 7) / 8 * 8;
                const float m = max_of(sr, count);
                v8f sum = {0};
                for (int64_t j = 0; j < span; j += 8) {  // -inf past count: zeros
                    v8f x;
                    memcpy(&x, sr + j, 32);
                    x = exp8(x - m);
                    if (j + 8 > count)
                        for (int l = 0; l < 8; l++)
                            if (j + l >= count) x[l] = 0.0f;
                    memcpy(sr + j, &x, 32);
                    sum += x;
                }
                inv[r] = 1.0f / hsum(sum);
#if TV_DP
                if (dp)  // rounded to nearest even, as the value product reads them
                    for (int64_t j = 0; j < span; j += 8) {
                        const __m128bh h = _mm256_cvtneps_pbh(_mm256_loadu_ps(sr + j));
                        memcpy(pb + r * padded + j, &h, 16);
                    }
#endif
            }
            const char* a1 = (const char*)v1 + kvh * v1_head * es;
            const char* a2 = (const char*)v2 + kvh * v2_head * es;
            for (int qq = 0; qq < QB; qq++) {  // a query's heads share its keys' value rows
                const int64_t i = qb * QB + qq;
                if (i >= q_len) break;
                const float* p[HB];
                for (int h = 0; h < HB; h++) p[h] = s + (qq * HB + h) * padded;
                const int64_t count = pos[qq * HB] + 1;
                // every head's weighted value rows into vals (unnormalized)
#if TV_DP
                if (dp) {  // 64 dims a pass (then 32)
                    const uint16_t* ph[HB];
                    for (int h = 0; h < HB; h++) ph[h] = pb + (qq * HB + h) * padded;
                    const uint16_t *b1 = (const uint16_t*)a1, *b2 = (const uint16_t*)a2;
                    const uint8_t* sec = second + i * n;
                    for (int64_t c0 = 0; c0 < d; c0 += 64) {
                        if (d - c0 >= 64)
                            weighted_pairs(ph, sec, b1, b2, count, n, d, v_row, c0, 2, vals);
                        else
                            weighted_pairs(ph, sec, b1, b2, count, n, d, v_row, c0, 1, vals);
                    }
                } else
#endif
                    for (int64_t c0 = 0; c0 < d;) {  // CHUNKS vectors of the dim, then singles
                        const int nc = d - c0 >= 8 * CHUNKS ? CHUNKS : 1;
                        v8f a[HB][CHUNKS];
                        if (nc == CHUNKS)
                            weighted_rows(p, second + i * n, a1, a2, count, v_row, c0, bf16,
                                          CHUNKS, a);
                        else
                            weighted_rows(p, second + i * n, a1, a2, count, v_row, c0, bf16, 1,
                                          a);
                        for (int h = 0; h < heads; h++)
                            for (int c = 0; c < nc; c++)
                                memcpy(vals + h * d + c0 + 8 * c, &a[h][c], 32);
                        c0 += 8 * nc;
                    }
                for (int h = 0; h < heads; h++) {  // not the repeated heads
                    const int64_t o = i * o_tok + (kvh * group + hb * HB + h) * o_head;
                    for (int64_t c = 0; c < d; c += 8) {
                        v8f y;
                        memcpy(&y, vals + h * d + c, 32);
                        y *= inv[qq * HB + h];
                        if (!rotate_out) {
                            st8(out, o + c, y, bf16);
                            continue;
                        }
                        if (bf16) y = rnd8(y);  // the row as the output dtype holds it
                        memcpy(obuf + h * d + c, &y, 32);
                    }
                }
                if (rotate_out) hadamard_rows_inline(obuf, heads, d, d, !bf16);
                for (int h = 0; rotate_out && h < heads; h++) {
                    const int64_t o = i * o_tok + (kvh * group + hb * HB + h) * o_head;
                    for (int64_t c = 0; c < d; c += 8) {
                        v8f y;
                        memcpy(&y, obuf + h * d + c, 32);
                        st8(out, o + c, y, bf16);
                    }
                }
            }
        }
        free(s);
        free(qbuf);
        free(obuf);
        free(qbits);
        free(pb);
        free(vals);
    }
    free(kt);
}

// two_value_attention for each of num_seqs prompts computed whole in one step (a
// prompt's queries are its keys: q_len = n, q_start 0), one call instead of one per prompt:
// prompt s holds rows starts[s] .. starts[s] + lens[s] of q, the keys, the values and out
// (row strides q_tok, k_row, v_row, o_tok), reading seconds[s] ([len, len]: 1 where a query
// reads a key's second value; seconds NULL: first values only, one side when k1 == k2).
void infer8_two_value_prompts_struct(const infer8_two_value_prompts_args* a) {
    INFER8_TWO_VALUE_PROMPTS_FIELDS(INFER8_UNPACK)
    const int64_t es = bf16 ? 2 : 4;
    int64_t longest = 0;
    for (int64_t s = 0; s < num_seqs; s++) longest = lens[s] > longest ? lens[s] : longest;
    uint8_t* none = seconds == NULL ? calloc((size_t)(longest * longest) + 1, 1) : NULL;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t start = starts[s], n = lens[s];
        if (n <= 0) continue;
        const infer8_two_value_attention_args one = {
            .q = (const char*)q + start * q_tok * es, .q_tok = q_tok, .q_head = q_head,
            .k1 = (const char*)k1 + start * k_row * es, .k1_head = k1_head,
            .k2 = (const char*)k2 + start * k_row * es, .k2_head = k2_head,
            .v1 = (const char*)v1 + start * v_row * es, .v1_head = v1_head,
            .v2 = (const char*)v2 + start * v_row * es, .v2_head = v2_head, .k_row = k_row,
            .v_row = v_row, .second = seconds != NULL ? seconds[s] : none,
            .num_heads = num_heads, .num_kv_heads = num_kv_heads, .q_len = n, .n = n, .d = d,
            .q_start = 0, .scale = scale, .bf16 = bf16, .out = (char*)out + start * o_tok * es,
            .o_tok = o_tok, .o_head = o_head, .rotate_q = rotate_q, .rotate_out = rotate_out};
        infer8_two_value_attention_struct(&one);
    }
    free(none);
}
