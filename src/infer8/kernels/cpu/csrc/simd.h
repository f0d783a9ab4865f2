// Shared by the native CPU kernels: 8-lane vector types (GCC vector extensions: AVX2,
// AVX-512 or NEON from the same source), a vectorized e^x for softmaxes, float32 / bf16 loads
// and stores, a horizontal sum.
#ifndef INFER8_SIMD_H
#define INFER8_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));

// The largest of x[0..n) (-inf for none), 8 lanes at a time: no serial compare chain (a float
// max reduction the compiler leaves scalar without -ffast-math; exact in any order). NaN-free
// inputs.
static inline float max_of(const float* x, int64_t n) {
    v8f vm = {-__builtin_inff(), -__builtin_inff(), -__builtin_inff(), -__builtin_inff(),
              -__builtin_inff(), -__builtin_inff(), -__builtin_inff(), -__builtin_inff()};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        v8f v;
        memcpy(&v, x + j, 32);
        v8i more = v > vm, vb, mb;
        memcpy(&vb, &v, 32);
        memcpy(&mb, &vm, 32);
        mb = (vb & more) | (mb & ~more);
        memcpy(&vm, &mb, 32);
    }
    float m = -__builtin_inff();
    for (int l = 0; l < 8; l++) m = vm[l] > m ? vm[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
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

// float32 or bf16 (bf16 != 0) tensors as floats: element i, 8 elements from i; stores round to
// nearest even as torch's .to(bfloat16) does (finite values).
static inline float ld1(const void* x, int64_t i, int bf16) {
    if (!bf16) return ((const float*)x)[i];
    const uint32_t b = (uint32_t)((const uint16_t*)x)[i] << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline v8f ld8(const void* x, int64_t i, int bf16) {
    v8f out;
    if (!bf16) {
        memcpy(&out, (const float*)x + i, 32);
    } else {
        typedef uint16_t v8u16_ __attribute__((vector_size(16)));
        v8u16_ h;
        memcpy(&h, (const uint16_t*)x + i, 16);
        v8i bits = __builtin_convertvector(h, v8i) << 16;
        memcpy(&out, &bits, 32);
    }
    return out;
}

static inline float rnd1(float f) {  // f rounded to bf16 precision (kept as a float)
    uint32_t b;
    memcpy(&b, &f, 4);
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &b, 4);
    return f;
}

static inline v8f rnd8(v8f v) {
    v8i b;
    memcpy(&b, &v, 32);
    b = (b + 0x7fff + ((b >> 16) & 1)) & (int32_t)0xffff0000;
    memcpy(&v, &b, 32);
    return v;
}

static inline v4f rnd4(v4f v) {  // rnd8 on 4 lanes
    v4i b;
    memcpy(&b, &v, 16);
    b = (b + 0x7fff + ((b >> 16) & 1)) & (int32_t)0xffff0000;
    memcpy(&v, &b, 16);
    return v;
}

static inline void st1(void* x, int64_t i, float f, int bf16) {
    if (!bf16) {
        ((float*)x)[i] = f;
        return;
    }
    f = rnd1(f);
    uint32_t b;
    memcpy(&b, &f, 4);
    ((uint16_t*)x)[i] = (uint16_t)(b >> 16);
}

static inline void st8(void* x, int64_t i, v8f v, int bf16) {
    if (!bf16) {
        memcpy((float*)x + i, &v, 32);
        return;
    }
    typedef uint16_t v8u16_ __attribute__((vector_size(16)));
    v8i b;
    memcpy(&b, &v, 32);
    b = (b + 0x7fff + ((b >> 16) & 1)) >> 16;
    v8u16_ h = __builtin_convertvector(b, v8u16_);
    memcpy((uint16_t*)x + i, &h, 16);
}

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#endif
