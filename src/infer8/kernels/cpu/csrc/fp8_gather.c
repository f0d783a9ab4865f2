// Gather KV-cache blocks stored as FP8 and dequantize them to bf16 or float32 in one pass (CPU).
//
// cache:  [num_kv_heads, num_blocks, block_size, head_dim] uint8 (float8_e4m3fn or float8_e5m2 bits)
// scales: [num_kv_heads, num_blocks, block_size] bf16 bits (dynamic per token and head), or NULL
// static_scale: [num_kv_heads, head_dim] float32 (static per head / channel), used when scales is NULL
// block_ids: [num_ids] int64, the blocks to gather in order
// out:    [num_kv_heads, num_ids, block_size, head_dim] bf16 bits or float32
//
// FP8 -> float32 by moving the sign, exponent and mantissa bits into float32 position and
// multiplying by 2^(127 - bias): exact for normal and subnormal FP8 values (E4M3 bias 7, E5M2
// bias 15). The loop is plain C so the compiler vectorizes it for the host's SIMD width.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "hadamard.h"
#include "simd.h"
#include "tail_row.h"
#include "args.h"

static inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline uint16_t float_to_bf16(float f) {
    // round to nearest even (inputs are finite)
    uint32_t b = float_to_bits(f);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// The FP8 value times 2^-(127-bias) is exact in float32; the product with the (bf16) scale
// has at most 12 significant bits, so it is exact too: written as float32 it equals the
// reference's float32 multiply, and rounded to bf16 once it equals the reference's bf16 one.
static inline float e4m3_value(uint32_t u) {
    return bits_to_float(((u & 0x80u) << 24) | ((u & 0x7Fu) << 20)) * 0x1p120f;
}

static inline float e5m2_value(uint32_t u) {
    return bits_to_float(((u & 0x80u) << 24) | ((u & 0x7Fu) << 21)) * 0x1p112f;
}

static void row(const uint8_t* in, float scale, const float* ch, void* out, int64_t d,
                int is_e5m2, int out_f32) {
    if (out_f32) {
        float* o = (float*)out;
        if (is_e5m2) {
            for (int64_t j = 0; j < d; j++) o[j] = e5m2_value(in[j]) * (scale * ch[j]);
        } else {
            for (int64_t j = 0; j < d; j++) o[j] = e4m3_value(in[j]) * (scale * ch[j]);
        }
    } else {
        uint16_t* o = (uint16_t*)out;
        if (is_e5m2) {
            for (int64_t j = 0; j < d; j++) o[j] = float_to_bf16(e5m2_value(in[j]) * (scale * ch[j]));
        } else {
            for (int64_t j = 0; j < d; j++) o[j] = float_to_bf16(e4m3_value(in[j]) * (scale * ch[j]));
        }
    }
}

// out: bf16 bits, or float32 with out_f32 (the compute dtype on CPUs without bf16 units).
void infer8_gather_dequant_fp8(const uint8_t* cache, const uint16_t* scales,
                               const float* static_scale, const int64_t* block_ids,
                               int64_t num_ids, int64_t num_kv_heads, int64_t num_blocks,
                               int64_t block_size, int64_t head_dim, int is_e5m2,
                               const float* ones, void* out, int out_f32) {
    const int64_t block_elems = block_size * head_dim;
    const int64_t elem_bytes = out_f32 ? 4 : 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t i = 0; i < num_ids; i++) {
            const int64_t blk = block_ids[i];
            const uint8_t* src = cache + (h * num_blocks + blk) * block_elems;
            char* dst = (char*)out + (h * num_ids + i) * block_elems * elem_bytes;
            const float* ch = static_scale ? static_scale + h * head_dim : ones;
            for (int64_t t = 0; t < block_size; t++) {
                float s = 1.0f;
                if (scales) {
                    uint32_t sb = (uint32_t)scales[(h * num_blocks + blk) * block_size + t] << 16;
                    s = bits_to_float(sb);
                }
                row(src + t * head_dim, s, ch, dst + t * head_dim * elem_bytes, head_dim,
                    is_e5m2, out_f32);
            }
        }
    }
}

// Gather whole blocks of a 16/32-bit cache: out[h, i] = cache[h, block_ids[i]] (block_bytes each).
// index_select runs single-threaded here; this splits the copy over the OpenMP threads.
void infer8_gather_blocks(const uint8_t* cache, const int64_t* block_ids, int64_t num_ids,
                          int64_t num_kv_heads, int64_t num_blocks, int64_t block_bytes,
                          uint8_t* out) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t i = 0; i < num_ids; i++) {
            memcpy(out + (h * num_ids + i) * block_bytes,
                   cache + (h * num_blocks + block_ids[i]) * block_bytes, (size_t)block_bytes);
        }
    }
}

// ---- The FP8 cache's exact tail (attention/exact_tail.py): block value + E4M3 residual ----
//
// float32 -> FP8 with round-to-nearest-even, as torch's casts do (inputs are clamped to the
// format's max first, so only the saturating branch of an overflow is kept). Values below the
// smallest normal are rounded by adding a power of two that puts the FP8 subnormal grid on
// float32's last mantissa bits; normal values by adding half an FP8 ulp (minus one, plus the
// kept bit's oddness: ties to even) and truncating.
// x clamped to [-m, m] with plain comparisons (fminf/fmaxf's NaN rules keep loops scalar);
// inputs are finite.
static inline float clampf(float x, float m) {
    x = x < -m ? -m : x;
    return x > m ? m : x;
}

static inline uint8_t float_to_fp8(float f, int is_e5m2) {
    // Branch-free (every case computed, one selected) so loops over a row vectorize; callers
    // pass a constant is_e5m2 through their specialized loops.
    const int mant = is_e5m2 ? 2 : 3, bias = is_e5m2 ? 15 : 7;
    const uint32_t max_bits = is_e5m2 ? 0x476FFFFFu : 0x43EFFFFFu;  // below 61440 / 480
    const uint32_t max_code = is_e5m2 ? 0x7Bu : 0x7Eu;  // the largest finite value
    uint32_t b = float_to_bits(f);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t magic = (uint32_t)(127 - bias + 23 - mant + 1) << 23;
    const uint32_t sub = float_to_bits(bits_to_float(b) + bits_to_float(magic)) - magic;
    const int shift = 23 - mant;
    const uint32_t odd = (b >> shift) & 1u;
    const uint32_t nor =
        (b + ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1u) + odd) >> shift;
    const uint32_t smallest_normal = (uint32_t)(127 - bias + 1) << 23;
    const uint32_t r = b > max_bits ? max_code : (b < smallest_normal ? sub : nor);
    return (uint8_t)((r & 0xFFu) | (sign >> 24));
}

static inline float bf16_value(uint16_t h) { return bits_to_float((uint32_t)h << 16); }

// float_to_fp8(y) and the value it encodes, as a float, from one rounding (y clamped to the
// format's max: no saturation case; subnormals on the 2^-9 / 2^-16 grid, normal values to 3 / 2
// mantissa bits, ties to even): the rounded value's bits give its code (a normal's exponent
// rebased and shifted down, a subnormal's grid index from the same magic-number sum).
static inline float fp8_round_code(float y, int is_e5m2, uint8_t* code) {
    const int mant = is_e5m2 ? 2 : 3, bias = is_e5m2 ? 15 : 7;
    uint32_t b = float_to_bits(y);
    const uint32_t sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t magic_bits = (uint32_t)(127 - bias + 23 - mant + 1) << 23;
    const float magic = bits_to_float(magic_bits);
    const float summed = bits_to_float(b) + magic;
    const int shift = 23 - mant;
    const uint32_t odd = (b >> shift) & 1u;
    const uint32_t nor = (b + ((1u << (shift - 1)) - 1u) + odd) & ~((1u << shift) - 1u);
    const uint32_t smallest_normal = (uint32_t)(127 - bias + 1) << 23;
    const int is_sub = b < smallest_normal;
    const uint32_t c = is_sub ? float_to_bits(summed) - magic_bits
                              : (nor - ((uint32_t)(127 - bias) << 23)) >> shift;
    *code = (uint8_t)((c & 0xFFu) | (sign >> 24));
    return bits_to_float((is_sub ? float_to_bits(summed - magic) : nor) | sign);
}

// fp8.dynamic_scale: amax * (1 + 2^-7) / format max, at least 1e-12, rounded to bf16.
static inline uint16_t dynamic_scale(float amax, float per_amax) {
    float s = amax * per_amax;
    return float_to_bf16(s < 1e-12f ? 1e-12f : s);
}

// Round a float32 to the compute dtype (bf16 when !out_f32) and back.
static inline float to_dtype(float f, int out_f32) {
    return out_f32 ? f : bf16_value(float_to_bf16(f));
}

// For each row of x ([rows, d], bf16 bits or float32): quantize it as the FP8 cache does on
// write (dynamic per-row scale, format `block_is_e5m2`), take the residual x - block value,
// quantize that to E4M3 with its own scale, and return block value + dequantized residual (the
// value the tail reads), in the compute dtype: the same numbers, bit for bit, as the torch
// reference in exact_tail.py (`tail_values`).
// max |v[j]| over j < d, 8 lanes at a time (a float max reduction the compiler leaves scalar
// without -ffast-math; the maximum is exact in any order).
static inline float abs_max(const float* v, int64_t d) {
    v8f m = {0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8) {
        v8f x;
        v8i bits, mb;
        memcpy(&bits, v + j, 32);
        bits &= 0x7FFFFFFF;  // |x|
        memcpy(&x, &bits, 32);
        v8i more = x > m;
        memcpy(&mb, &m, 32);
        mb = (bits & more) | (mb & ~more);
        memcpy(&m, &mb, 32);
    }
    float out = 0.0f;
    for (int l = 0; l < 8; l++) out = m[l] > out ? m[l] : out;
    if (d % 8 != 0)  // a scalar tail only where one is left (none for a constant d of 8s)
        for (; j < d; j++) out = fabsf(v[j]) > out ? fabsf(v[j]) : out;
    return out;
}

// One row of infer8_tail_residual: v [d] (the compute dtype's values as floats) -> res_q [d],
// *res_scale, tail [d] (floats holding values of the compute dtype).
// With `codes` (not NULL), also the row's block codes and scale (what quantize_row stores) and
// its block values in the compute dtype (`block`, floats).
static inline __attribute__((always_inline)) void residual_row_full(
    const float* v, int64_t d, int x_f32, int block_is_e5m2, float block_per_amax,
    float e4m3_per_amax, uint8_t* res_q, uint16_t* res_scale, float* tail, uint8_t* codes,
    uint16_t* code_scale, float* block) {
    const float block_max = block_is_e5m2 ? 57344.0f : 448.0f;
    float xb[512], res[512];
    uint8_t cb[512];
    if (d > 512) return;  // the callers check head_dim (and the compiler learns the bound)
    const uint16_t s1_bits = dynamic_scale(abs_max(v, d), block_per_amax);
    const float s1 = bf16_value(s1_bits);
    for (int64_t j = 0; j < d; j++) {  // no reduction inside: the loop vectorizes
        float y = clampf(v[j] / s1, block_max);
        xb[j] = to_dtype(fp8_round_code(y, block_is_e5m2, cb + j) * s1, x_f32);
        res[j] = v[j] - xb[j];
    }
    if (codes != NULL) {
        *code_scale = s1_bits;
        memcpy(codes, cb, (size_t)d);
        memcpy(block, xb, sizeof(float) * (size_t)d);
    }
    const float ramax = abs_max(res, d);
    const uint16_t s2_bits = dynamic_scale(ramax, e4m3_per_amax);
    const float s2 = bf16_value(s2_bits);
    *res_scale = s2_bits;
    for (int64_t j = 0; j < d; j++) {
        const float y = clampf(res[j] / s2, 448.0f);
        tail[j] = to_dtype(xb[j] + to_dtype(fp8_round_code(y, 0, res_q + j) * s2, x_f32), x_f32);
    }
}

static inline void residual_row(const float* v, int64_t d, int x_f32, int block_is_e5m2,
                                float block_per_amax, float e4m3_per_amax, uint8_t* res_q,
                                uint16_t* res_scale, float* tail) {
    residual_row_full(v, d, x_f32, block_is_e5m2, block_per_amax, e4m3_per_amax, res_q,
                      res_scale, tail, NULL, NULL, NULL);
}

void infer8_tail_residual(const void* x, int64_t rows, int64_t d, int x_f32, int block_is_e5m2,
                          float block_per_amax, float e4m3_per_amax, uint8_t* res_q,
                          uint16_t* res_scale, void* tail) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float v[512], t[512];
        if (d > 512) continue;  // the caller checks head_dim
        for (int64_t j = 0; j < d; j++) {
            v[j] = x_f32 ? ((const float*)x)[r * d + j] : bf16_value(((const uint16_t*)x)[r * d + j]);
        }
        residual_row(v, d, x_f32, block_is_e5m2, block_per_amax, e4m3_per_amax, res_q + r * d,
                     res_scale + r, t);
        for (int64_t j = 0; j < d; j++) {
            if (x_f32) {
                ((float*)tail)[r * d + j] = t[j];
            } else {
                ((uint16_t*)tail)[r * d + j] = float_to_bf16(t[j]);
            }
        }
    }
}

// Quantize new K or V on write, as the FP8 cache stores it (reference.write_blocks' dynamic path):
// x [num_tokens, num_kv_heads, d] (bf16 bits or float32), one scale per token and head
// (fp8.dynamic_scale), values to cache[h, slot_mapping[t], :] and scales[h, slot_mapping[t]]
// (cache viewed as [num_kv_heads, num_slots, d]). Bit for bit the torch path.
// One row of infer8_write_fp8: v [d] -> out [d] FP8 bits and *scale (bf16 bits).
static inline void quantize_row(const float* v, int64_t d, int is_e5m2, float per_amax,
                                uint8_t* out, uint16_t* scale) {
    const float fmax = is_e5m2 ? 57344.0f : 448.0f;
    const uint16_t s_bits = dynamic_scale(abs_max(v, d), per_amax);
    const float s = bf16_value(s_bits);
    *scale = s_bits;
    if (is_e5m2) {
        for (int64_t j = 0; j < d; j++) out[j] = float_to_fp8(clampf(v[j] / s, fmax), 1);
    } else {
        for (int64_t j = 0; j < d; j++) out[j] = float_to_fp8(clampf(v[j] / s, fmax), 0);
    }
}

void infer8_quantize_row(const float* v, int64_t d, int is_e5m2, float per_amax, uint8_t* out,
                         uint16_t* scale) {  // for decode_attention.c
    quantize_row(v, d, is_e5m2, per_amax, out, scale);
}

void infer8_write_fp8(const void* x, int64_t num_tokens, int64_t num_kv_heads, int64_t d,
                      int x_f32, int is_e5m2, float per_amax, const int64_t* slot_mapping,
                      int64_t num_slots, uint8_t* cache, uint16_t* scales) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t r = t * num_kv_heads + h;
            float v[512];
            if (d > 512) continue;  // the caller checks head_dim
            for (int64_t j = 0; j < d; j++) {
                v[j] = x_f32 ? ((const float*)x)[r * d + j] : bf16_value(((const uint16_t*)x)[r * d + j]);
            }
            const int64_t slot = h * num_slots + slot_mapping[t];
            quantize_row(v, d, is_e5m2, per_amax, cache + slot * d, scales + slot);
        }
    }
}

// New K or V rows into a 16/32-bit cache (reference.write_blocks' 16/32-bit store): x [num_tokens,
// num_kv_heads, d] at token stride x_stride (elements; heads d apart), float32 or bf16 bits
// (x_f32), to cache[h, slot_mapping[t], :] (cache viewed as [num_kv_heads, num_slots, d]),
// float32 or bf16 (cache_f32; float32 -> bf16 rounds to nearest even, as .to() does).
void infer8_write_rows(const void* x, int64_t x_stride, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t d, int x_f32, const int64_t* slot_mapping, int64_t num_slots,
                       void* cache, int cache_f32) {
#pragma omp parallel for collapse(2) schedule(static) if (num_tokens * num_kv_heads >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t from = t * x_stride + h * d, to = (h * num_slots + slot_mapping[t]) * d;
            if (x_f32 == cache_f32) {
                const int64_t bytes = d * (x_f32 ? 4 : 2);
                memcpy((char*)cache + to * (x_f32 ? 4 : 2), (const char*)x + from * (x_f32 ? 4 : 2),
                       (size_t)bytes);
            } else if (x_f32) {  // float32 into bf16
                for (int64_t j = 0; j < d; j++)
                    ((uint16_t*)cache)[to + j] = float_to_bf16(((const float*)x)[from + j]);
            } else {  // bf16 into float32: exact
                for (int64_t j = 0; j < d; j++)
                    ((float*)cache)[to + j] = bf16_value(((const uint16_t*)x)[from + j]);
            }
        }
    }
}

// exact_tail.write_store: the residuals of tokens token_ids[i] ([tokens, heads, d] E4M3 values,
// [tokens, heads] bf16 scales) into the tail store's slots slots[i] (store [heads,
// store_slots, d], scales [heads, store_slots]). A decode step writes one row per sequence and
// head: a plain loop, no threads.
void infer8_write_store(const uint8_t* res_q, const uint16_t* res_scale, const int64_t* token_ids,
                        const int64_t* slots, int64_t n, int64_t heads, int64_t d,
                        int64_t store_slots, uint8_t* store, uint16_t* store_scale) {
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t from = token_ids[i] * heads + h, to = h * store_slots + slots[i];
            memcpy(store + to * d, res_q + from * d, (size_t)d);
            store_scale[to] = res_scale[from];
        }
    }
}

// A prefill step's new K and V with an exact tail, in one pass (the general path's write then
// _tail_values, bit for bit): each row of k, v ([n, kvh, d] at token strides k_stride /
// v_stride, heads d apart; bf16 bits or float32) rotated (rotate_keys; V too with
// rotate_values), quantized into the FP8 cache at slot_mapping[t] (dynamic scales), its E4M3
// residual and scale (res_q [n, 2, kvh, d], res_scale [n, 2, kvh]: K's heads, then V's), and
// in the compute dtype its tail value (block + residual) and its block value, head-major:
// tail, block [2, kvh, n, d] (a sequence's rows of one head are contiguous).
// One (token, side, head) row of infer8_prefill_tail; inlined with constant d, format and
// dtype (d = 64: 1.6x the generic loop's speed).
static inline __attribute__((always_inline)) void prefill_row(
    const void* src, int64_t at, int64_t d, int x_f32, int rotate, int block_is_e5m2,
    float block_per_amax, float e4m3_per_amax, uint8_t* codes, uint16_t* code_scale,
    uint8_t* res_q, uint16_t* res_scale, void* tail, void* block, int64_t o) {
    float x[512], tv[512], bv[512];
    for (int64_t j = 0; j < d; j++)
        x[j] = x_f32 ? ((const float*)src)[at + j] : bf16_value(((const uint16_t*)src)[at + j]);
    if (rotate) infer8_hadamard_row(x, d, x_f32);
    residual_row_full(x, d, x_f32, block_is_e5m2, block_per_amax, e4m3_per_amax, res_q,
                      res_scale, tv, codes, code_scale, bv);
    if (block == NULL) {  // a decode row: its tail values as floats (of the compute dtype)
        memcpy((float*)tail + o, tv, sizeof(float) * (size_t)d);
        return;
    }
    for (int64_t j = 0; j < d; j++) {
        if (x_f32) {
            ((float*)tail)[o + j] = tv[j];
            ((float*)block)[o + j] = bv[j];
        } else {
            ((uint16_t*)tail)[o + j] = float_to_bf16(tv[j]);
            ((uint16_t*)block)[o + j] = float_to_bf16(bv[j]);
        }
    }
}

#ifdef __AVX512F__
// prefill_row for d = 16 R (R = 4 or 8, a constant after inlining) with the row in registers
// from its load to its stores: the rotation (hadamard_regs), the block's and the residual's
// quantization (fp8_round_code, clampf, to_dtype on 16 lanes: the same operations, so the same
// bits), no arrays between the steps.
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));

static inline v16f select16(v16i mask, v16f a, v16f b) {  // mask ? a : b, lane by lane
    return (v16f)((mask & (v16i)a) | (~mask & (v16i)b));
}

static inline v16f clamp16(v16f x, float m) {  // clampf
    x = select16(x < -m, (v16f){} - m, x);
    return select16(x > m, (v16f){} + m, x);
}

static inline v16f to_dtype16(v16f f, int out_f32) {  // to_dtype: rounded to bf16 precision
    if (out_f32) return f;
    v16u b = (v16u)f;
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    return (v16f)b;
}

static inline v16f round_code16(v16f y, int is_e5m2, v16u* code) {  // fp8_round_code
    const int mant = is_e5m2 ? 2 : 3, bias = is_e5m2 ? 15 : 7;
    v16u b = (v16u)y;
    const v16u sign = b & 0x80000000u;
    b ^= sign;
    const uint32_t magic_bits = (uint32_t)(127 - bias + 23 - mant + 1) << 23;
    const float magic = bits_to_float(magic_bits);
    const v16f summed = (v16f)b + magic;
    const int shift = 23 - mant;
    const v16u odd = (b >> shift) & 1u;
    const v16u nor = (b + ((1u << (shift - 1)) - 1u) + odd) & ~((1u << shift) - 1u);
    const uint32_t smallest_normal = (uint32_t)(127 - bias + 1) << 23;
    const v16i is_sub = (v16i)(b < smallest_normal);
    const v16u c = (v16u)select16(is_sub, (v16f)((v16u)summed - magic_bits),
                                  (v16f)((nor - ((uint32_t)(127 - bias) << 23)) >> shift));
    *code = (c & 0xffu) | (sign >> 24);
    return (v16f)((v16u)select16(is_sub, summed - magic, (v16f)nor) | sign);
}

static inline float abs_max16(const v16f* x, int r) {
    v16u m = {0};
#pragma GCC unroll 8
    for (int i = 0; i < r; i++) {
        const v16u a = (v16u)x[i] & 0x7fffffffu;  // finite: the integer order is the float one
        m = (v16u)select16((v16i)(a > m), (v16f)a, (v16f)m);
    }
    uint32_t out = 0;
    for (int l = 0; l < 16; l++) out = m[l] > out ? m[l] : out;
    return bits_to_float(out);
}

// The two rows' dynamic scales (of their absolute maxima), stored as bf16 bits at out0 / out1
// and returned as floats in s.
static inline __attribute__((always_inline)) void pair_scales(const v16f x[2][8], int r,
                                                              float per_amax, uint16_t* out0,
                                                              uint16_t* out1, float s[2]) {
    const uint16_t b0 = dynamic_scale(abs_max16(x[0], r), per_amax);
    const uint16_t b1 = dynamic_scale(abs_max16(x[1], r), per_amax);
    *out0 = b0;
    *out1 = b1;
    s[0] = bf16_value(b0);
    s[1] = bf16_value(b1);
}

// Two rows in lockstep, each step of both before the next step: one row's long dependency
// chain (rotation, maximum, scale, division, rounding, twice) overlaps the other's (1.15x one
// row at a time, in a hot loop). The same operations per row: the same bits.
static inline __attribute__((always_inline)) void prefill_rows_zmm(
    const tail_row_args* a, int r, int x_f32, int block_is_e5m2, float block_per_amax,
    float e4m3_per_amax, void* tail, void* block) {
    enum { P = 2 };
    v16f x[2][8], xb[2][8], res[2][8];
    float s1[2], s2[2];
#pragma GCC unroll 2
    for (int p = 0; p < P; p++) {
#pragma GCC unroll 8
        for (int i = 0; i < r; i++) {
            if (x_f32) {
                memcpy(&x[p][i], (const float*)a[p].src + a[p].at + 16 * i, 64);
            } else {
                v16u16 h;
                memcpy(&h, (const uint16_t*)a[p].src + a[p].at + 16 * i, 32);
                x[p][i] = (v16f)(__builtin_convertvector(h, v16u) << 16);
            }
        }
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; p++)
        if (a[p].rotate) hadamard_regs((__m512*)x[p], r, x_f32);
    const float block_max = block_is_e5m2 ? 57344.0f : 448.0f;
    pair_scales(x, r, block_per_amax, a[0].code_scale, a[1].code_scale, s1);
#pragma GCC unroll 2
    for (int p = 0; p < P; p++) {
#pragma GCC unroll 8
        for (int i = 0; i < r; i++) {
            v16u c;
            const v16f y = clamp16(x[p][i] / s1[p], block_max);
            xb[p][i] = to_dtype16(round_code16(y, block_is_e5m2, &c) * s1[p], x_f32);
            res[p][i] = x[p][i] - xb[p][i];
            const v16u8 c8 = __builtin_convertvector(c, v16u8);
            memcpy(a[p].codes + 16 * i, &c8, 16);
        }
    }
    pair_scales(res, r, e4m3_per_amax, a[0].res_scale, a[1].res_scale, s2);
#pragma GCC unroll 2
    for (int p = 0; p < P; p++) {
        const int64_t o = a[p].o;
#pragma GCC unroll 8
        for (int i = 0; i < r; i++) {
            v16u c;
            const v16f y = clamp16(res[p][i] / s2[p], 448.0f);
            const v16f q = to_dtype16(round_code16(y, 0, &c) * s2[p], x_f32);
            const v16f tv = to_dtype16(xb[p][i] + q, x_f32);
            const v16u8 c8 = __builtin_convertvector(c, v16u8);
            memcpy(a[p].res_q + 16 * i, &c8, 16);
            if (block == NULL || x_f32) {  // floats (a decode row's tail: always)
                memcpy((float*)tail + o + 16 * i, &tv, 64);
                if (block != NULL) memcpy((float*)block + o + 16 * i, &xb[p][i], 64);
            } else {  // bf16 bits: both already hold bf16 values
                const v16u16 t16 = __builtin_convertvector((v16u)tv >> 16, v16u16);
                const v16u16 b16 = __builtin_convertvector((v16u)xb[p][i] >> 16, v16u16);
                memcpy((uint16_t*)tail + o + 16 * i, &t16, 32);
                memcpy((uint16_t*)block + o + 16 * i, &b16, 32);
            }
        }
    }
}
#endif

// Two rows of infer8_prefill_tail or infer8_decode_layer's new rows (tail_row.h): with AVX-512
// and head_dim 64 / 128 prefill_rows_zmm, else prefill_row inlined with constant d, each row in
// turn; a constant format and dtype either way.
void infer8_tail_pair(const tail_row_args rows[2], int64_t d, int x_f32, int block_is_e5m2,
                      float block_per_amax, float e4m3_per_amax, void* tail, void* block) {
    if (d > 512) return;  // the caller checks head_dim
#define BY_FORMAT(CALL)                                        \
    if (block_is_e5m2) {                                       \
        if (x_f32) { CALL(1, 1); } else { CALL(1, 0); }        \
    } else {                                                   \
        if (x_f32) { CALL(0, 1); } else { CALL(0, 0); }        \
    }
#ifdef __AVX512F__
#define ZMM(E5M2, F32)                                                                       \
    if (d == 64)                                                                             \
        prefill_rows_zmm(rows, 4, F32, E5M2, block_per_amax, e4m3_per_amax, tail, block);    \
    else                                                                                     \
        prefill_rows_zmm(rows, 8, F32, E5M2, block_per_amax, e4m3_per_amax, tail, block)
    if (d == 64 || d == 128) {
        BY_FORMAT(ZMM)
        return;
    }
#undef ZMM
#endif
    for (int i = 0; i < 2; i++) {
        const tail_row_args* a = rows + i;
#define ROW(E5M2, F32, D)                                                                     \
    prefill_row(a->src, a->at, D, F32, a->rotate, E5M2, block_per_amax, e4m3_per_amax,       \
                a->codes, a->code_scale, a->res_q, a->res_scale, tail, block, a->o)
#define ROW64(E5M2, F32) ROW(E5M2, F32, 64)
#define ROW128(E5M2, F32) ROW(E5M2, F32, 128)
#define ROWD(E5M2, F32) ROW(E5M2, F32, d)
        if (d == 64) {
            BY_FORMAT(ROW64)
        } else if (d == 128) {
            BY_FORMAT(ROW128)
        } else {
            BY_FORMAT(ROWD)
        }
#undef ROWD
#undef ROW128
#undef ROW64
#undef ROW
    }
#undef BY_FORMAT
}

void infer8_prefill_tail_struct(const infer8_prefill_tail_args* a) {
    INFER8_PREFILL_TAIL_FIELDS(INFER8_UNPACK)
    // rows r = (t * 2 + side) * kvh + h, two at a time (2 n kvh of them: an even number)
    const int64_t rows = n * 2 * kvh;
#pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += 2) {
        // token t + 8's K and V rows requested at token t's first row: strided views of the
        // projection's output, which the hardware's prefetchers left to wait on (28% of the
        // pass's samples on those loads; 0.82x the pass of 4,096 tokens)
        if (r0 % (2 * kvh) == 0 && r0 / (2 * kvh) + 8 < n) {
            const int64_t t = r0 / (2 * kvh) + 8, es = x_f32 ? 4 : 2;
            const char* kr = (const char*)k + t * k_stride * es;
            const char* vr = (const char*)v + t * v_stride * es;
            for (int64_t at = 0; at < kvh * d * es; at += 64) {
                __builtin_prefetch(kr + at);
                __builtin_prefetch(vr + at);
            }
        }
        tail_row_args a[2];
        for (int64_t i = 0; i < 2; i++) {
            const int64_t r = r0 + i, h = r % kvh, side = r / kvh % 2, t = r / (2 * kvh);
            const int64_t slot = h * num_slots + slot_mapping[t];
            a[i] = (tail_row_args){side ? v : k,
                                   t * (side ? v_stride : k_stride) + h * d,
                                   rotate_keys && (side == 0 || rotate_values),
                                   (side ? v_cache : k_cache) + slot * d,
                                   (side ? v_scale : k_scale) + slot,
                                   res_q + r * d,
                                   res_scale + r,
                                   ((side * kvh + h) * n + t) * d};
        }
        infer8_tail_pair(a, d, x_f32, block_is_e5m2, block_per_amax, e4m3_per_amax, tail,
                         block);
    }
}
