// Decode attention over the paged KV cache in one pass per (sequence, KV head), for the CPU.
//
// Each of the GROUP query heads of a KV head scores the sequence's cached keys, read straight
// from the blocks (FP8 widened in registers with the per-token scale folded into the score, or
// 16/32-bit), then the softmax and the weighted sum of values. No gathered copy of the blocks,
// no batched matmul of 3-row matrices, no mask. The FP8 cache's exact tail (attention/
// exact_tail.py) enters as it does in the torch reference: the new token's tail value replaces
// its block value, and each valid tail position gets q.r added to its score and p.r to the
// output. Built with the other native kernels (cpu_native.py); GCC vector extensions, so the
// same source vectorizes for AVX2, AVX-512 or NEON.

#include <math.h>
#ifdef __F16C__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint8_t v8u8 __attribute__((vector_size(8)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

enum { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };

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

// 8 consecutive elements of a cache row as floats (FP8: unscaled values).
static inline v8f load8(const void* row, int64_t i, int kind) {
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
        if (kind == KV_E4M3) out *= 256.0f;
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

// e^x for x <= 0 (a softmax's shifted scores), 8 lanes: Cephes' expf (range reduction by
// ln 2, degree-6 polynomial), ~1 ulp; glibc's scalar expf was a tenth of the kernel's time.
static inline v8f exp8(v8f x) {
    const v8f lo = {-87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f, -87.0f};
    v8i below = x < lo, xb, lob;  // x = max(x, lo): e^-87 ~ 1.6e-38, zero next to the max's 1
    memcpy(&xb, &x, 32);
    memcpy(&lob, &lo, 32);
    xb = (xb & ~below) | (lob & below);
    memcpy(&x, &xb, 32);
    v8f fx = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(fx, v8i);  // toward zero; floor below
    v8f nf = __builtin_convertvector(n, v8f);
    v8i fix = nf > fx;
    n += fix;  // -1 where truncation rounded up
    nf = __builtin_convertvector(n, v8f);
    x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    v8f y = 1.9875691500e-4f * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * x * x + x + 1.0f;
    v8i bits = (n + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, 32);
    return y * scale;
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// q: [B, H, D] (query rows of the decode sequences); cache: [KVH, NB, BS, D]; scales:
// [KVH, NB, BS] bf16 (FP8 only); table: [B, table_stride]; seq_lens: [B]. Tail (new_k NULL:
// none): new_k/new_v [B, KVH, D] tail values of each sequence's newest token; res_k/res_v
// [KVH, res_rows, D] residual rows, sequence b's W first at row b * W; pos/valid [B, W]. out: [B, H, D]. x_f32: q/new/res/out are
// float32 (else bf16, with the torch reference's roundings: scores, probabilities, output).
void infer8_decode_attention(
    const void* q, const void* k_cache, const void* v_cache, const uint16_t* k_scale,
    const uint16_t* v_scale, int kind, const int64_t* table, int64_t table_stride,
    const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t group,
    int64_t num_blocks, int64_t block_size, int64_t d, float sm_scale, int x_f32,
    const void* new_k, const void* new_v, const void* res_k, const void* res_v,
    const int64_t* pos, const float* valid, int64_t width, int64_t res_rows, void* out) {
    const int64_t elem = kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
    const int is_fp8 = kind >= KV_E4M3;
    const int64_t num_heads = num_kv_heads * group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t len = seq_lens[b];
        if (len <= 0) continue;  // callers pass real sequences only
        float* qf = malloc(sizeof(float) * (group * d + group * len + group * d + d));
        float* scores = qf + group * d;
        float* acc = scores + group * len;
        float* row = acc + group * d;  // one converted row (the tail's values)
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++) {
                int64_t at = (b * num_heads + h * group + g) * d + i;
                qf[g * d + i] = x_f32 ? ((const float*)q)[at] : bf16_to_f32(((const uint16_t*)q)[at]);
            }
        const int64_t* trow = table + b * table_stride;
        // scores
        for (int64_t j = 0; j < len; j++) {
            const int64_t blk = trow[j / block_size], off = j % block_size;
            const int64_t slot = (h * num_blocks + blk) * block_size + off;
            const char* krow = (const char*)k_cache + slot * d * elem;
            float ks = is_fp8 ? bf16_to_f32(k_scale[slot]) : 1.0f;
            int fresh = new_k != NULL && j == len - 1;
            if (fresh) {  // the newest token's tail value, not its block value
                for (int64_t i = 0; i < d; i++) {
                    int64_t at = (b * num_kv_heads + h) * d + i;
                    row[i] = x_f32 ? ((const float*)new_k)[at] : bf16_to_f32(((const uint16_t*)new_k)[at]);
                }
                ks = 1.0f;
            }
            const float* kf = row;  // the key as floats: converted once for all query heads
            if (!fresh && kind == KV_F32)
                kf = (const float*)krow;
            else if (!fresh)
                for (int64_t i = 0; i < d; i += 8) {
                    v8f kv = load8(krow, i, kind);
                    memcpy(row + i, &kv, 32);
                }
            for (int64_t g = 0; g < group; g++) {
                v8f s = {0};
                for (int64_t i = 0; i < d; i += 8) {
                    v8f kv, qv;
                    memcpy(&kv, kf + i, 32);
                    memcpy(&qv, qf + g * d + i, 32);
                    s += qv * kv;
                }
                float sc = hsum(s) * ks;
                if (!x_f32) sc = round_bf16(sc);
                scores[g * len + j] = sc * sm_scale;
            }
        }
        // tail corrections: q.r at each valid tail position
        for (int64_t w = 0; w < width; w++) {
            if (valid[b * width + w] == 0.0f) continue;
            const int64_t p = pos[b * width + w];
            const int64_t at = (h * res_rows + b * width + w) * d;
            for (int64_t i = 0; i < d; i += 8) {
                v8f r = load8(x_f32 ? (const void*)((const float*)res_k + at)
                                    : (const void*)((const uint16_t*)res_k + at),
                              i, x_f32 ? KV_F32 : KV_BF16);
                memcpy(row + i, &r, 32);
            }
            for (int64_t g = 0; g < group; g++) {
                v8f acc8 = {0};
                for (int64_t i = 0; i < d; i += 8) {
                    v8f a, r;
                    memcpy(&a, qf + g * d + i, 32);
                    memcpy(&r, row + i, 32);
                    acc8 += a * r;
                }
                float s = hsum(acc8);
                if (!x_f32) s = round_bf16(s);
                scores[g * len + p] += s * sm_scale;
            }
        }
        // softmax per query head (probabilities in the model dtype, as the reference casts)
        for (int64_t g = 0; g < group; g++) {
            float* sg = scores + g * len;
            float m = -INFINITY, sum = 0.0f;
            for (int64_t j = 0; j < len; j++) m = sg[j] > m ? sg[j] : m;
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
            for (int64_t j = 0; j < len; j++) {
                sg[j] *= inv;
                if (!x_f32) sg[j] = round_bf16(sg[j]);
            }
        }
        // values
        memset(acc, 0, sizeof(float) * group * d);
        for (int64_t j = 0; j < len; j++) {
            const int64_t blk = trow[j / block_size], off = j % block_size;
            const int64_t slot = (h * num_blocks + blk) * block_size + off;
            const char* vrow = (const char*)v_cache + slot * d * elem;
            float vs = is_fp8 ? bf16_to_f32(v_scale[slot]) : 1.0f;
            int fresh = new_v != NULL && j == len - 1;
            if (fresh) {
                for (int64_t i = 0; i < d; i++) {
                    int64_t at = (b * num_kv_heads + h) * d + i;
                    row[i] = x_f32 ? ((const float*)new_v)[at] : bf16_to_f32(((const uint16_t*)new_v)[at]);
                }
                vs = 1.0f;
            }
            for (int64_t i = 0; i < d; i += 8) {
                v8f vv;
                if (fresh)
                    memcpy(&vv, row + i, 32);
                else
                    vv = load8(vrow, i, kind);
                for (int64_t g = 0; g < group; g++) {
                    v8f a;
                    memcpy(&a, acc + g * d + i, 32);
                    a += (scores[g * len + j] * vs) * vv;
                    memcpy(acc + g * d + i, &a, 32);
                }
            }
        }
        for (int64_t w = 0; w < width; w++) {  // p.r at each valid tail position
            if (valid[b * width + w] == 0.0f) continue;
            const int64_t p = pos[b * width + w];
            const int64_t at = (h * res_rows + b * width + w) * d;
            for (int64_t i = 0; i < d; i += 8) {
                v8f r = load8(x_f32 ? (const void*)((const float*)res_v + at)
                                    : (const void*)((const uint16_t*)res_v + at),
                              i, x_f32 ? KV_F32 : KV_BF16);
                for (int64_t g = 0; g < group; g++) {
                    v8f a;
                    memcpy(&a, acc + g * d + i, 32);
                    a += scores[g * len + p] * r;
                    memcpy(acc + g * d + i, &a, 32);
                }
            }
        }
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < d; i++) {
                int64_t at = (b * num_heads + h * group + g) * d + i;
                if (x_f32)
                    ((float*)out)[at] = acc[g * d + i];
                else {
                    float f = round_bf16(acc[g * d + i]);
                    uint32_t bits;
                    memcpy(&bits, &f, 4);
                    ((uint16_t*)out)[at] = (uint16_t)(bits >> 16);
                }
            }
        free(qf);
    }
}
