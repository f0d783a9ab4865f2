// The element-wise passes of a Llama layer on float32 or bf16 CPU tensors, one pass each where
// torch runs several small ops (each a dispatch, an allocation and a trip through memory):
// RMSNorm, SiLU(gate) * up, and RoPE's rotate_half, in place. Computed in float32; bf16 tensors
// (bf16 != 0) get each rounding the torch ops make in bf16 (the residual sum, the normalized
// row, the weight's product; silu, its product; each RoPE product and sum), so results differ
// from the torch ops by float32 rounding only (summation order of the mean square, exp's last
// bit).

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

// Passes of at least this many elements use every thread. Measured on a 2-core Zen 4, bf16,
// each call after a torch matmul as in a decode step at batch 32: silu * up [32, 1536] 91.7 ->
// 63.4 us, RoPE [32, 12, 64] 34.4 -> 24.2 us, RMSNorm [32, 576] 37.5 -> 32.4 us against a
// 65,536 threshold; no faster at 4,096.
#define PARALLEL_ELEMS 16384

// out[t] = w * (x[t] * 1 / sqrt(mean(x[t]^2) + eps)): x [rows, h] at row stride x_stride, out
// [rows, h] contiguous, w [h], all float32 or all bf16. With `add` (not NULL), x[t] += add[t]
// first, in place (the residual stream), and the norm reads the sum.
void infer8_rms_norm(void* x, int64_t x_stride, const void* add, const void* w, int64_t rows,
                     int64_t h, float eps, int bf16, void* out) {
#pragma omp parallel for schedule(static) if (rows * h >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t xr = t * x_stride, o = t * h;
        v8f acc = {0};
        int64_t i = 0;
        for (; i + 8 <= h; i += 8) {
            v8f v = ld8(x, xr + i, bf16);
            if (add != NULL) {
                v += ld8(add, t * h + i, bf16);
                st8(x, xr + i, v, bf16);
                if (bf16) v = rnd8(v);
            }
            acc += v * v;
        }
        float ss = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; i < h; i++) {
            float v = ld1(x, xr + i, bf16);
            if (add != NULL) {
                v += ld1(add, t * h + i, bf16);
                st1(x, xr + i, v, bf16);
                if (bf16) v = rnd1(v);
            }
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(ss / (float)h + eps);
        for (i = 0; i + 8 <= h; i += 8) {
            v8f y = ld8(x, xr + i, bf16) * r;
            if (bf16) y = rnd8(y);
            st8(out, o + i, ld8(w, i, bf16) * y, bf16);
        }
        for (; i < h; i++) {
            float y = ld1(x, xr + i, bf16) * r;
            if (bf16) y = rnd1(y);
            st1(out, o + i, ld1(w, i, bf16) * y, bf16);
        }
    }
}

// out[t, i] = silu(gu[t, i]) * gu[t, inter + i]: gu [rows, 2 * inter], out [rows, inter].
void infer8_silu_and_mul(const void* gu, int64_t rows, int64_t inter, int bf16, void* out) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t g = t * 2 * inter, u = g + inter, o = t * inter;
        int64_t i = 0;
        for (; i + 8 <= inter; i += 8) {
            v8f gv = ld8(gu, g + i, bf16), uv = ld8(gu, u + i, bf16);
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
            if (bf16) s = rnd8(s);
            st8(out, o + i, s * uv, bf16);
        }
        for (; i < inter; i++) {
            const float gi = ld1(gu, g + i, bf16);
            float s = gi / (1.0f + expf(-gi));
            if (bf16) s = rnd1(s);
            st1(out, o + i, s * ld1(gu, u + i, bf16), bf16);
        }
    }
}

// RoPE (rotate_half) in place: x [rows, heads, d] at row stride x_stride (head stride d), cos
// and sin [rows, d / 2] (x's dtype): x1, x2 = halves; x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
void infer8_rope(void* x, int64_t x_stride, int64_t rows, int64_t heads, int64_t d,
                 const void* cos_t, const void* sin_t, int bf16) {
    const int64_t half = d / 2;
#pragma omp parallel for schedule(static) if (rows * heads * d >= PARALLEL_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t hd = 0; hd < heads; hd++) {
            const int64_t x1 = t * x_stride + hd * d, x2 = x1 + half;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                const v8f a = ld8(x, x1 + i, bf16), b = ld8(x, x2 + i, bf16);
                const v8f c = ld8(cos_t, t * half + i, bf16), s = ld8(sin_t, t * half + i, bf16);
                v8f ac = a * c, bs = b * s, bc = b * c, as = a * s;
                if (bf16) ac = rnd8(ac), bs = rnd8(bs), bc = rnd8(bc), as = rnd8(as);
                st8(x, x1 + i, ac - bs, bf16);
                st8(x, x2 + i, bc + as, bf16);
            }
            for (; i < half; i++) {
                const float a = ld1(x, x1 + i, bf16), b = ld1(x, x2 + i, bf16);
                const float c = ld1(cos_t, t * half + i, bf16), s = ld1(sin_t, t * half + i, bf16);
                float ac = a * c, bs = b * s, bc = b * c, as = a * s;
                if (bf16) ac = rnd1(ac), bs = rnd1(bs), bc = rnd1(bc), as = rnd1(as);
                st1(x, x1 + i, ac - bs, bf16);
                st1(x, x2 + i, bc + as, bf16);
            }
        }
    }
}

// Greedy sampling: out[r] = the first index of the largest value of row r of x [rows, n]
// (float32) after the sampler's sanitizing (NaN -> -limit, values clamped to [-limit, limit]):
// torch's argmax of the sanitized copy, without the copy. One pass keeps each lane's maximum
// and the first index holding it; a maximum at or beyond a limit (ties after the clamp) takes
// a second pass for the first element that sanitizes to it.
static inline float sanitize(float v, float limit) {
    v = v != v ? -limit : v;  // NaN
    v = v < -limit ? -limit : v;
    return v > limit ? limit : v;
}

void infer8_greedy_rows(const float* x, int64_t rows, int64_t n, float limit, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * n;
        int64_t i = 0;
        v8f vm = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                  -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        v8i at = {0, 1, 2, 3, 4, 5, 6, 7}, vi = at;
        for (; i + 8 <= n; i += 8) {
            v8f v;
            memcpy(&v, row + i, 32);
            v8i keep = v > vm, vb, mb;  // strictly greater: a lane keeps its first maximum
            memcpy(&vb, &v, 32);
            memcpy(&mb, &vm, 32);
            mb = (vb & keep) | (mb & ~keep);
            memcpy(&vm, &mb, 32);
            vi = (at & keep) | (vi & ~keep);
            at += 8;
        }
        float m = -INFINITY;
        int64_t best = -1;
        for (int l = 0; l < 8 && i > 0; l++) {  // the first index among the lanes' maxima
            if (vm[l] > m || (vm[l] == m && vi[l] < best)) {
                m = vm[l];
                best = vi[l];
            }
        }
        for (; i < n; i++) {
            if (row[i] > m) {
                m = row[i];
                best = i;
            }
        }
        if (best < 0 || !(m > -limit && m < limit)) {  // NaN only, or ties after the clamp
            m = sanitize(m, limit);
            for (best = 0; best < n - 1 && sanitize(row[best], limit) != m; best++) {
            }
        }
        out[r] = best;
    }
}
