// The element-wise passes of a Llama layer on float32 CPU tensors, one pass each where torch
// runs several small ops (each a dispatch, an allocation and a trip through memory): RMSNorm,
// SiLU(gate) * up, and RoPE's rotate_half, in place. Results differ from the torch ops by
// float32 rounding only (summation order of the mean square, exp's last bit).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

// Rows worth a thread each: below ~64 K elements the OpenMP fork costs more than it saves.
#define PARALLEL_ELEMS 65536

// out[t] = w * (x[t] * 1 / sqrt(mean(x[t]^2) + eps)): x [rows, h] at row stride x_stride, out
// [rows, h] contiguous. With `add` (not NULL), x[t] += add[t] first, in place (the residual
// stream), and the norm reads the sum.
void infer8_rms_norm(float* x, int64_t x_stride, const float* add, const float* w, int64_t rows,
                     int64_t h, float eps, float* out) {
#pragma omp parallel for schedule(static) if (rows * h >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        float* xr = x + t * x_stride;
        float* o = out + t * h;
        v8f acc = {0};
        int64_t i = 0;
        for (; i + 8 <= h; i += 8) {
            v8f v;
            memcpy(&v, xr + i, 32);
            if (add != NULL) {
                v8f a;
                memcpy(&a, add + t * h + i, 32);
                v += a;
                memcpy(xr + i, &v, 32);
            }
            acc += v * v;
        }
        float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; i < h; i++) {
            if (add != NULL) xr[i] += add[t * h + i];
            ss += xr[i] * xr[i];
        }
        const float r = 1.0f / sqrtf(ss / (float)h + eps);
        for (i = 0; i < h; i++) o[i] = w[i] * (xr[i] * r);
    }
}

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]: gu [rows, 2 * inter], out [rows, inter].
void infer8_silu_and_mul(const float* gu, int64_t rows, int64_t inter, float* out) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float* g = gu + t * 2 * inter;
        const float* u = g + inter;
        float* o = out + t * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            v8f gv, uv;
            memcpy(&gv, g + i, 32);
            memcpy(&uv, u + i, 32);
            // silu(g) = g / (1 + e^-g) for g >= 0, g e^g / (1 + e^g) below: e^-|g| never overflows
            v8i neg = gv < 0.0f, gb, nb;
            memcpy(&gb, &gv, 32);
            nb = gb | (int32_t)0x80000000;  // -|g|
            v8f minus_abs;
            memcpy(&minus_abs, &nb, 32);
            v8f e = exp8(minus_abs);  // e^-|g|, which is e^g where g < 0
            const v8f one = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
            v8i eb, ob, numb;
            memcpy(&eb, &e, 32);
            memcpy(&ob, &one, 32);
            numb = (eb & neg) | (ob & ~neg);
            v8f num;
            memcpy(&num, &numb, 32);
            v8f s = gv * num / (1.0f + e);
            s *= uv;
            memcpy(o + i, &s, 32);
        }
        for (; i < inter; i++) {
            const float gi = g[i];
            o[i] = gi / (1.0f + expf(-gi)) * u[i];
        }
    }
}

// RoPE (rotate_half) in place: x [rows, heads, d] at row stride x_stride (head stride d), cos
// and sin [rows, d / 2]: x1, x2 = halves; x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void infer8_rope(float* x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d,
                 const float* cos_t, const float* sin_t) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const float* c = cos_t + t * half;
        const float* s = sin_t + t * half;
        for (int64_t hd = 0; hd < heads; hd++) {
            float* x1 = x + t * x_stride + hd * d;
            float* x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                const float ac = a * c[i], bs = b * s[i], bc = b * c[i], as = a * s[i];
                x1[i] = ac - bs;
                x2[i] = bc + as;
            }
        }
    }
}
