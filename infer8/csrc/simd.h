// Shared by the native CPU kernels: 8-lane vector types (GCC vector extensions: AVX2,
// AVX-512 or NEON from the same source), a vectorized e^x for softmaxes, a horizontal sum.
#ifndef INFER8_SIMD_H
#define INFER8_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

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

#endif
