// Gather KV-cache blocks stored as FP8 and dequantize them to bf16 in one pass (CPU).
//
// cache:  [num_kv_heads, num_blocks, block_size, head_dim] uint8 (float8_e4m3fn or float8_e5m2 bits)
// scales: [num_kv_heads, num_blocks, block_size] bf16 bits (dynamic per token and head), or NULL
// static_scale: [num_kv_heads, head_dim] float32 (static per head / channel), used when scales is NULL
// block_ids: [num_ids] int64, the blocks to gather in order
// out:    [num_kv_heads, num_ids, block_size, head_dim] bf16 bits
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
// has at most 12 significant bits, so it is exact too and rounds to bf16 once, like the
// reference's bf16 multiply.
static void row_e4m3(const uint8_t* in, float scale, const float* ch, uint16_t* out, int64_t d) {
    for (int64_t j = 0; j < d; j++) {
        uint32_t u = in[j];
        uint32_t b = ((u & 0x80u) << 24) | ((u & 0x7Fu) << 20);
        out[j] = float_to_bf16((bits_to_float(b) * 0x1p120f) * (scale * ch[j]));
    }
}

static void row_e5m2(const uint8_t* in, float scale, const float* ch, uint16_t* out, int64_t d) {
    for (int64_t j = 0; j < d; j++) {
        uint32_t u = in[j];
        uint32_t b = ((u & 0x80u) << 24) | ((u & 0x7Fu) << 21);
        out[j] = float_to_bf16((bits_to_float(b) * 0x1p112f) * (scale * ch[j]));
    }
}

void infer8_gather_dequant_fp8(const uint8_t* cache, const uint16_t* scales,
                               const float* static_scale, const int64_t* block_ids,
                               int64_t num_ids, int64_t num_kv_heads, int64_t num_blocks,
                               int64_t block_size, int64_t head_dim, int is_e5m2,
                               const float* ones, uint16_t* out) {
    const int64_t block_elems = block_size * head_dim;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < num_kv_heads; h++) {
        for (int64_t i = 0; i < num_ids; i++) {
            const int64_t blk = block_ids[i];
            const uint8_t* src = cache + (h * num_blocks + blk) * block_elems;
            uint16_t* dst = out + (h * num_ids + i) * block_elems;
            const float* ch = static_scale ? static_scale + h * head_dim : ones;
            for (int64_t t = 0; t < block_size; t++) {
                float s = 1.0f;
                if (scales) {
                    uint32_t sb = (uint32_t)scales[(h * num_blocks + blk) * block_size + t] << 16;
                    s = bits_to_float(sb);
                }
                if (is_e5m2) {
                    row_e5m2(src + t * head_dim, s, ch, dst + t * head_dim, head_dim);
                } else {
                    row_e4m3(src + t * head_dim, s, ch, dst + t * head_dim, head_dim);
                }
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
