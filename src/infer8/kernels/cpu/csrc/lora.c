// Multi-LoRA's low-rank products on CPU: every token adds its own adapter's (x A^T) B to a
// fused projection's output (lora/slots.py). A pair of oneDNN matmuls per projection spends most
// of its time outside the arithmetic at these sizes (rank 16 is a small N for the first and a
// small K for the second: ~45-90 us at 64 rows where the products need a few), and grouping a
// step's tokens by adapter costs gathers and scatters on top; here blocks of up to four tokens
// of one adapter share every load of A and B, and a token's h stays in float32 between the two.
//
// Layout (LoRASlots, float32): A of slot s is rows [0, rank * n) of a + s * a_slot_stride, each
// `in` wide; B likewise, `out` wide. Rows are rank-major: row j * n + i is rank j of the fused
// projection's module i, whose output columns are [cols[i], cols[i + 1]): the expand reads only
// those (B is zero elsewhere). x and y are float32 or bf16 (bf16 != 0); y is rounded once.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

typedef float v16f __attribute__((vector_size(64)));

#define TOKENS 4        // tokens of one adapter per block
#define MAX_ROWS 1024   // rank x modules (lora/slots.py checks)
#define PARALLEL_MACS (1 << 17)
#define TILE 64         // output columns per expand task

static inline v16f ld16(const float* p) {
    v16f v;
    memcpy(&v, p, 64);
    return v;
}

static inline float hsum16(v16f v) {
    v8f lo, hi;
    memcpy(&lo, &v, 32);
    memcpy(&hi, (const char*)&v + 32, 32);
    return hsum(lo + hi);
}

// h[t * rows + r] = x[t] . a[r] for the block's nt (1 or TOKENS) tokens, four rows at a time
// (xf: their rows in float32, `in` apart). Named accumulators: an array of them would live on
// the stack (gcc 12 keeps it there), every FMA a memory round trip.
#define SHRINK_STEP(T)                                   \
    {                                                    \
        const v16f xv = ld16(xf + (T) * in + k);         \
        s##T##0 += xv * av0;                             \
        s##T##1 += xv * av1;                             \
        s##T##2 += xv * av2;                             \
        s##T##3 += xv * av3;                             \
    }
#define SHRINK_STORE(T)                                                        \
    {                                                                          \
        const v16f sv[4] = {s##T##0, s##T##1, s##T##2, s##T##3};              \
        for (int64_t q = 0; q < 4; q++) {                                      \
            const float* aq = a + rr[q] * in;                                  \
            float acc = hsum16(sv[q]);                                         \
            for (int64_t kk = k16; kk < in; kk++) acc += xf[(T) * in + kk] * aq[kk]; \
            h[(T) * rows + rr[q]] = acc;                                       \
        }                                                                      \
    }

static void shrink(const float* xf, int64_t nt, const float* a, int64_t rows, int64_t in, float* h) {
    const int64_t k16 = in & ~(int64_t)15;
    for (int64_t r = 0; r < rows; r += 4) {
        int64_t rr[4];  // rows past the last one repeat it (computed again, stored once more)
        for (int64_t q = 0; q < 4; q++) rr[q] = r + q < rows ? r + q : rows - 1;
        const float *a0 = a + rr[0] * in, *a1 = a + rr[1] * in, *a2 = a + rr[2] * in,
                    *a3 = a + rr[3] * in;
        if (nt == TOKENS) {
            v16f s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0}, s10 = {0}, s11 = {0}, s12 = {0},
                 s13 = {0}, s20 = {0}, s21 = {0}, s22 = {0}, s23 = {0}, s30 = {0}, s31 = {0},
                 s32 = {0}, s33 = {0};
            for (int64_t k = 0; k < k16; k += 16) {
                const v16f av0 = ld16(a0 + k), av1 = ld16(a1 + k), av2 = ld16(a2 + k),
                           av3 = ld16(a3 + k);
                SHRINK_STEP(0) SHRINK_STEP(1) SHRINK_STEP(2) SHRINK_STEP(3)
            }
            SHRINK_STORE(0) SHRINK_STORE(1) SHRINK_STORE(2) SHRINK_STORE(3)
        } else {
            for (int64_t t = 0; t < nt; t++) {
                const float* xt = xf + t * in;
                v16f s00 = {0}, s01 = {0}, s02 = {0}, s03 = {0};
                for (int64_t k = 0; k < k16; k += 16) {
                    const v16f av0 = ld16(a0 + k), av1 = ld16(a1 + k), av2 = ld16(a2 + k),
                               av3 = ld16(a3 + k);
                    const v16f xv = ld16(xt + k);
                    s00 += xv * av0;
                    s01 += xv * av1;
                    s02 += xv * av2;
                    s03 += xv * av3;
                }
                const v16f sv[4] = {s00, s01, s02, s03};
                for (int64_t q = 0; q < 4; q++) {
                    const float* aq = a + rr[q] * in;
                    float acc = hsum16(sv[q]);
                    for (int64_t kk = k16; kk < in; kk++) acc += xt[kk] * aq[kk];
                    h[t * rows + rr[q]] = acc;
                }
            }
        }
    }
}

// y[t][c] += sum_j h[t * rank * n + j * n + i] b[j * n + i][c] over module i's columns c in
// [c0, c1), for the block's nt (1 or TOKENS) tokens: 16 columns of four tokens in registers.
#define EXPAND_LOAD(T) v8f y##T##0 = ld8(y[T], c, bf16), y##T##1 = ld8(y[T], c + 8, bf16);
#define EXPAND_FMA(T)                                  \
    {                                                  \
        const float hv = h[(T) * hs + row];            \
        y##T##0 += hv * b0;                            \
        y##T##1 += hv * b1;                            \
    }
#define EXPAND_STORE(T)            \
    st8(y[T], c, y##T##0, bf16);   \
    st8(y[T], c + 8, y##T##1, bf16);

static void expand(const float* h, int64_t nt, const float* b, int64_t rank, int64_t n, int64_t i,
                   int64_t c0, int64_t c1, int64_t out, void* const* y, int bf16) {
    const int64_t hs = rank * n;
    int64_t c = c0;
    if (nt == TOKENS) {
        for (; c + 16 <= c1; c += 16) {
            EXPAND_LOAD(0) EXPAND_LOAD(1) EXPAND_LOAD(2) EXPAND_LOAD(3)
            for (int64_t j = 0; j < rank; j++) {
                const int64_t row = j * n + i;
                const v8f b0 = ld8(b + row * out, c, 0), b1 = ld8(b + row * out, c + 8, 0);
                EXPAND_FMA(0) EXPAND_FMA(1) EXPAND_FMA(2) EXPAND_FMA(3)
            }
            EXPAND_STORE(0) EXPAND_STORE(1) EXPAND_STORE(2) EXPAND_STORE(3)
        }
    } else {
        for (; c + 16 <= c1; c += 16) {
            for (int64_t t = 0; t < nt; t++) {
                v8f lo = ld8(y[t], c, bf16), hi = ld8(y[t], c + 8, bf16);
                for (int64_t j = 0; j < rank; j++) {
                    const int64_t row = j * n + i;
                    const float hv = h[t * hs + row];
                    lo += hv * ld8(b + row * out, c, 0);
                    hi += hv * ld8(b + row * out, c + 8, 0);
                }
                st8(y[t], c, lo, bf16);
                st8(y[t], c + 8, hi, bf16);
            }
        }
    }
    for (; c < c1; c++) {
        for (int64_t t = 0; t < nt; t++) {
            float acc = ld1(y[t], c, bf16);
            for (int64_t j = 0; j < rank; j++) acc += h[t * hs + j * n + i] * b[(j * n + i) * out + c];
            st1(y[t], c, acc, bf16);
        }
    }
}

// For the tokens order[0 .. num) (sorted by slot; slots[token] >= 0), y[token] += (x[token]
// A_s^T) B_s in place: x [*, in] and y [*, out] at row strides x_stride / y_stride (elements);
// cols: n + 1 column bounds of the fused projection's modules.
void infer8_lora_add(const void* x, int64_t x_stride, void* y, int64_t y_stride, const float* a,
                     int64_t a_slot_stride, const float* b, int64_t b_slot_stride,
                     const int64_t* order, const int32_t* slots, int64_t num, int64_t in,
                     int64_t out, int64_t n, int64_t rank, const int64_t* cols, int bf16) {
    const int64_t rows = rank * n;
    if (num <= 0 || rows <= 0 || rows > MAX_ROWS) return;  // the caller checks the rows
    // blocks of up to TOKENS consecutive tokens of one slot
    int64_t* starts = malloc((size_t)(num + 1) * sizeof(int64_t));
    if (starts == NULL) return;
    int64_t num_blocks = 0;
    for (int64_t i = 0; i < num;) {
        starts[num_blocks++] = i;
        const int32_t s = slots[order[i]];
        int64_t j = i + 1;
        while (j < num && j < i + TOKENS && slots[order[j]] == s) j++;
        i = j;
    }
    starts[num_blocks] = num;
    // the expand's column tiles: B's rows of a tile stay in L1 across a slot's tokens
    int64_t num_tiles = 0;
    for (int64_t i = 0; i < n; i++) num_tiles += (cols[i + 1] - cols[i] + TILE - 1) / TILE;
    float* hall = malloc((size_t)(num * rows) * sizeof(float));  // [num, rows], in order
    if (hall == NULL) {
        free(starts);
        return;
    }
    const int64_t esize = bf16 ? 2 : 4;
#pragma omp parallel if (num * rows * (in + out) >= PARALLEL_MACS)
    {
        float* xf = malloc((size_t)(TOKENS * in) * sizeof(float));
        if (xf != NULL) {
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < num_blocks; blk++) {
                const int64_t first = starts[blk], nt = starts[blk + 1] - first;
                for (int64_t t = 0; t < nt; t++) {
                    const char* xt = (const char*)x + order[first + t] * x_stride * esize;
                    int64_t k = 0;
                    for (; k + 8 <= in; k += 8) {
                        const v8f v = ld8(xt, k, bf16);
                        memcpy(xf + t * in + k, &v, 32);
                    }
                    for (; k < in; k++) xf[t * in + k] = ld1(xt, k, bf16);
                }
                const float* as = a + slots[order[first]] * a_slot_stride;
                shrink(xf, nt, as, rows, in, hall + first * rows);
            }
        }
        free(xf);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < num_tiles; tile++) {
            int64_t i = 0, t0 = tile;  // module i, its t0-th tile
            while (t0 >= (cols[i + 1] - cols[i] + TILE - 1) / TILE) {
                t0 -= (cols[i + 1] - cols[i] + TILE - 1) / TILE;
                i++;
            }
            const int64_t c0 = cols[i] + t0 * TILE;
            const int64_t c1 = c0 + TILE < cols[i + 1] ? c0 + TILE : cols[i + 1];
            for (int64_t blk = 0; blk < num_blocks; blk++) {
                const int64_t first = starts[blk], nt = starts[blk + 1] - first;
                void* yt[TOKENS];
                for (int64_t t = 0; t < nt; t++) {
                    yt[t] = (char*)y + order[first + t] * y_stride * esize;
                }
                const float* bs = b + slots[order[first]] * b_slot_stride;
                const float* h = hall + first * rows;
                expand(h, nt, bs, rank, n, i, c0, c1, out, yt, bf16);
            }
        }
    }
    free(hall);
    free(starts);
}
