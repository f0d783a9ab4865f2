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
#include <stdint.h>
#include <string.h>

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
