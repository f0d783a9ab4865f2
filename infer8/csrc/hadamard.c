// Rows times the orthonormal Sylvester Hadamard matrix (exact_tail.hadamard), for the CPU: the
// fast Walsh-Hadamard transform, d log2(d) additions and one scale per row instead of a d x d
// matmul (a torch matmul call cost ~60 us at decode sizes, six per layer). Computed in float32,
// returned in the input's dtype, as exact_tail.rotate does (to float32 rounding: another
// summation order).
#include <math.h>
#include <stdint.h>
#include <string.h>

// x: [n, h, d] with strides (s0, s1, 1), bf16 bits or float32 (x_f32); out: [n, h, d]
// contiguous, same dtype. d is a power of two <= 1024.
void infer8_hadamard_rows(const void* x, int64_t n, int64_t h, int64_t d, int64_t s0,
                          int64_t s1, int x_f32, void* out) {
    const float norm = 1.0f / sqrtf((float)d);
#pragma omp parallel for collapse(2) schedule(static) if (n * h >= 64)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t k = 0; k < h; k++) {
            float v[1024];
            const int64_t at = t * s0 + k * s1, o = (t * h + k) * d;
            for (int64_t i = 0; i < d; i++) {
                if (x_f32) {
                    v[i] = ((const float*)x)[at + i];
                } else {
                    uint32_t b = (uint32_t)((const uint16_t*)x)[at + i] << 16;
                    memcpy(&v[i], &b, 4);
                }
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
            for (int64_t i = 0; i < d; i++) {
                const float f = v[i] * norm;
                if (x_f32) {
                    ((float*)out)[o + i] = f;
                } else {
                    uint32_t b;
                    memcpy(&b, &f, 4);
                    b += 0x7FFFu + ((b >> 16) & 1u);  // round to nearest even
                    ((uint16_t*)out)[o + i] = (uint16_t)(b >> 16);
                }
            }
        }
    }
}
