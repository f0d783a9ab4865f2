// The band of a prefill chunk with an FP8 cache's exact tail (split_prefill.py's Band), for
// float32 or bf16 CPU tensors (computed in float32): query i of the chunk, at position
// a = first_position + W - 1 + i, sees band keys i .. i + W - 1 (those below valid_from
// excepted), those from its segment's start (positions >= max(a / segment * segment,
// exact_start)) in their exact values, the ones before in their block values. One pass per (query head, query): W dot
// products, their log-sum-exp, the weighted values; the torch form pads queries into blocks,
// unfolds the keys and runs ~10 element-wise passes over [blocks, B, B + W - 1] scores.

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

// q [H, L, d]; k, v (exact), kq, vq (block values) [KVH, n, d] (n >= L + W - 1); query head h
// reads KV head h / group.
// out [H, L, d] (q's dtype), lse [H, L] float32: a query that sees no key gets lse = -inf and a
// zero row. q, k, v, out: float32, or bf16 where bf16 != 0.
void infer8_band_attention(const void* q, const void* k, const void* v, const void* kq,
                           const void* vq, int64_t num_heads, int64_t group, int64_t q_len,
                           int64_t n, int64_t d, int64_t window, int64_t valid_from,
                           int64_t first_position, int64_t exact_start, int64_t segment,
                           float scale, int bf16, void* out, float* lse) {
#pragma omp parallel
    {
        float* s = malloc(sizeof(float) * (window + 8 + 2 * d));
        float* qr = s + window + 8;  // the query row as floats
        float* o = qr + d;           // its output row
#pragma omp for schedule(static)
        for (int64_t row = 0; row < num_heads * q_len; row++) {
            const int64_t h = row / q_len, i = row % q_len;
            for (int64_t c = 0; c < d; c++) qr[c] = ld1(q, row * d + c, bf16);
            const int64_t kh = (h / group) * n * d;  // the KV head's first element
            const int64_t first = i > valid_from ? i : valid_from;  // band keys first .. last
            const int64_t last = i + window - 1 < n - 1 ? i + window - 1 : n - 1;
            const int64_t count = last - first + 1;
            const int64_t a = first_position + window - 1 + i;  // the query's position
            int64_t seg = a / segment * segment;
            seg = seg > exact_start ? seg : exact_start;
            const int64_t split = seg - first_position;  // band keys below it: block values
            memset(o, 0, sizeof(float) * d);
            if (count <= 0) {
                for (int64_t c = 0; c < d; c++) st1(out, row * d + c, 0.0f, bf16);
                lse[row] = -INFINITY;
                continue;
            }
            float m = -INFINITY;
            for (int64_t t = 0; t < count; t++) {
                const int64_t kr = kh + (first + t) * d;
                const void* kx = first + t < split ? kq : k;
                v8f acc = {0};
                int64_t c = 0;
                for (; c + 8 <= d; c += 8) {
                    v8f x;
                    memcpy(&x, qr + c, 32);
                    acc += x * ld8(kx, kr + c, bf16);
                }
                float dot = hsum(acc);
                for (; c < d; c++) dot += qr[c] * ld1(kx, kr + c, bf16);
                s[t] = dot * scale;
                m = s[t] > m ? s[t] : m;
            }
            float sum = 0.0f;
            int64_t t = 0;
            for (; t + 8 <= count; t += 8) {
                v8f x;
                memcpy(&x, s + t, 32);
                x = exp8(x - m);
                memcpy(s + t, &x, 32);
                sum += hsum(x);
            }
            for (; t < count; t++) {
                v8f x = {s[t] - m};
                s[t] = exp8(x)[0];
                sum += s[t];
            }
            const float inv = 1.0f / sum;
            for (t = 0; t < count; t++) {
                const float p = s[t] * inv;
                const int64_t vr = kh + (first + t) * d;
                const void* vx = first + t < split ? vq : v;
                for (int64_t c = 0; c < d; c++) o[c] += p * ld1(vx, vr + c, bf16);
            }
            for (int64_t c = 0; c < d; c++) st1(out, row * d + c, o[c], bf16);
            lse[row] = m + logf(sum);
        }
        free(s);
    }
}
