// The sampler's candidates on CPU (worker/sampler.py): each row's tokens that a top-k / top-p
// draw can reach, found in three passes over the row instead of a partial sort of it.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { BINS = 64 };  // half natural-log units below a row's maximum (32 units)

// x [rows, n] float32 (scaled logits, finite); top_p [rows]; top_k [rows] (n: off); cap: the
// most candidates a row may have. Per row: row_max, row_sum = sum of e^max(x - max, -87) (the
// softmax's denominator, as the sampler's torch path clamps it); ids [rows, cap] the indices of
// every token within B half units of the maximum (in index order), where B is the fewest half
// units whose tokens hold top_p of row_sum (top_p < 1; 1e-4 more, for rounding) and number at
// least top_k (< n): a set that holds every token above its smallest one;
// count [rows] how many, or -1 where no B < BINS does or more than cap tokens are in it.
void infer8_nucleus_candidates(const float* x, int64_t rows, int64_t n, const float* top_p,
                               const int64_t* top_k, int64_t cap, float* row_max,
                               float* row_sum, int64_t* ids, int64_t* count) {
#pragma omp parallel for schedule(dynamic, 1) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * n;
        const float m = max_of(row, n);
        int64_t i;
        // the denominator, and each half unit's mass and count (tokens 32 or more units down
        // hold under n * e^-32 of the mass: no top_p below 1 needs them)
        float mass[2][BINS] = {{0}}, sum = 0.0f;  // two copies: lanes alternate between
        int32_t num[2][BINS] = {{0}};              // them (no chain through one bin's sum)
        v8f vs = {0};
        const v8f vmax = {m, m, m, m, m, m, m, m};
        for (i = 0; i + 8 <= n; i += 8) {
            v8f v, e;
            memcpy(&v, row + i, 32);
            e = exp8(v - vmax);
            vs += e;
            v8i near = v > vmax - (float)(BINS / 2);  // lanes inside the bins' 32 units
            int64_t any = 0;
            for (int l = 0; l < 8; l++) any |= near[l];
            if (!any) continue;  // (most of a peaked row)
            for (int l = 0; l < 8; l++) {
                const float d = 2.0f * (m - v[l]);
                if (d < (float)BINS) {
                    mass[l & 1][(int)d] += e[l];
                    num[l & 1][(int)d]++;
                }
            }
        }
        for (; i < n; i++) {
            const v8f v = {row[i] - m};
            const float e = exp8(v)[0], d = 2.0f * (m - row[i]);
            sum += e;
            if (d < (float)BINS) {
                mass[0][(int)d] += e;
                num[0][(int)d]++;
            }
        }
        for (int l = 0; l < 8; l++) sum += vs[l];
        row_max[r] = m;
        row_sum[r] = sum;
        const float need = top_p[r] < 1.0f ? top_p[r] * sum : 0.0f;
        const int64_t k = top_k[r] < n ? top_k[r] : 0;  // n: top-k off
        float held = 0.0f;
        int64_t taken = 0, last = -1;
        for (int b = 0; b < BINS && (need > 0.0f || k > 0); b++) {  // (neither: whole rows)
            held += mass[0][b] + mass[1][b];
            taken += num[0][b] + num[1][b];
            if (held >= need * (1.0f + 1e-4f) && taken >= k) {  // (the margin: rounding)
                last = b;
                break;
            }
        }
        int64_t c = 0;
        if (last >= 0) {
            int64_t* out = ids + r * cap;
            const float reach = (float)(last + 1) / 2.0f;  // (a little past the last bin)
            for (i = 0; i < n && c <= cap; i += 8) {
                if (i + 8 <= n) {  // skip 8 tokens at once where none is near the maximum
                    v8f v;
                    memcpy(&v, row + i, 32);
                    v8i near = v >= vmax - (reach + 1.0f);
                    int64_t any = 0;
                    for (int l = 0; l < 8; l++) any |= near[l];
                    if (!any) continue;
                }
                for (int64_t j = i; j < i + 8 && j < n; j++) {
                    const float d = 2.0f * (m - row[j]);
                    if (d < (float)BINS && (int)d <= last) {
                        if (c < cap) out[c] = j;
                        c++;
                    }
                }
            }
        }
        count[r] = last >= 0 && c <= cap ? c : -1;
    }
}
