// Decode attention over the paged KV cache in one pass per (sequence, KV head), for the CPU.
//
// Each of the GROUP query heads of a KV head scores the sequence's cached keys, read straight
// from the blocks (FP8 widened in registers with the per-token scale folded into the score, or
// 16/32-bit), then the softmax and the weighted sum of values. No gathered copy of the blocks,
// no batched matmul of 3-row matrices, no mask. The FP8 cache's exact tail (attention/
// exact_tail.py) enters as it does in the torch reference: the new token's tail value replaces
// its block value, and each valid tail position gets q.r added to its score and p.r to the
// output. Built with the other native kernels (build.py); GCC vector extensions, so the
// same source vectorizes for AVX2, AVX-512 or NEON; with AVX512-BF16, a bf16 cache read by bf16
// queries takes the bf16 dot-product instruction for scores and values (exact products, another
// summation order), and so do an E4M3 cache's scores (its codes turned into bf16 exactly); with
// AVX-512, E4M3 values are summed 16 lanes at a time (the same sums); with AVX512-VBMI, 32
// codes are widened by one byte permute and a shift or two (each code in both bytes of a word).
// An FP8 cache's per-token scales are requested for all of a task's blocks before they are read
// (each block's are a line of their own, one memory latency each when read in turn), and a
// decode layer's threads claim their next task one ahead to request its first lines early.
// The row loads and register tiles are in decode_tiles.h, a task's score and value passes over
// its rows in decode_passes.h.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_passes.h"
#include "decode_tiles.h"
#include "hadamard.h"
#include "simd.h"
#include "tail_row.h"
#include "args.h"

enum { NEXT_TASK_BYTES = 32768 };  // prefetch_task's budget

// The cache, the table and the tail store of one call (see infer8_decode_attention).
typedef struct {
    const void *k_cache, *v_cache;
    const uint16_t *k_scale, *v_scale;
    int kind, x_f32;
    const int64_t *table, *seq_lens;
    int64_t table_stride, num_kv_heads, group, num_blocks, block_size, d;
    float sm_scale;
    const uint8_t* store;  // NULL: no exact tail
    const uint16_t* store_scale;
    const int64_t *read_rows, *pos;
    const float* valid;
    int64_t seats, stride, width;
} decode_params;

// The FP8 scale lines of the blocks holding a task's first n positions (a line of their own per
// block: one memory latency each when read in turn), requested at once, into L2 when `ahead`
// (for a task still to come), else into L1.
static inline void prefetch_block_scales(const decode_params* p, const int64_t* trow, int64_t h,
                                         int64_t n, int ahead) {
    for (int64_t j0 = 0; j0 < n; j0 += p->block_size) {
        const int64_t first = (h * p->num_blocks + trow[j0 / p->block_size]) * p->block_size;
        if (ahead) {
            __builtin_prefetch(p->k_scale + first, 0, 2);
            __builtin_prefetch(p->v_scale + first, 0, 2);
        } else {
            __builtin_prefetch(p->k_scale + first);
            __builtin_prefetch(p->v_scale + first);
        }
    }
}

// What task (b, h) reads first, requested into L2 while the task before it runs: its blocks'
// FP8 scales, its residual rows' scales, and its keys and values up to NEXT_TASK_BYTES of them
// (every row of a short context: the task then reads from L2, not memory, where it would wait
// for each row's latency in turn: 0.89x a bf16 layer of 64 x 140 tokens, 0.97x an FP8 one,
// whose rows cost more compute than latency; longer contexts read the rest AHEAD rows ahead).
static void prefetch_task(const decode_params* p, int64_t b, int64_t h) {
    const int64_t len = p->seq_lens[b], bs = p->block_size, d = p->d;
    if (len <= 0) return;
    const int64_t elem = kv_elem(p->kind);
    const int64_t* trow = p->table + b * p->table_stride;
    if (p->kind >= KV_E4M3) prefetch_block_scales(p, trow, h, len, 1);
    const int64_t rows = NEXT_TASK_BYTES / (2 * d * elem);  // K and V rows alike
    for (int64_t j0 = 0; j0 < len && j0 < rows; j0 += bs) {
        const int64_t first = (h * p->num_blocks + trow[j0 / bs]) * bs * d * elem;
        const int64_t bytes = (len - j0 < bs ? len - j0 : bs) * d * elem;
        const char *kb = (const char*)p->k_cache + first, *vb = (const char*)p->v_cache + first;
        for (int64_t at = 0; at < bytes; at += 64) {
            __builtin_prefetch(kb + at, 0, 2);
            __builtin_prefetch(vb + at, 0, 2);
        }
    }
    if (p->store != NULL && p->width > 0) {
        const int64_t seat = p->read_rows[b * p->width / p->stride];
        const int64_t kat = (h * p->seats + seat) * p->stride;
        const int64_t vat = ((p->num_kv_heads + h) * p->seats + seat) * p->stride;
        __builtin_prefetch(p->store_scale + kat, 0, 2);
        __builtin_prefetch(p->store_scale + kat + p->stride - 1, 0, 2);
        __builtin_prefetch(p->store_scale + vat, 0, 2);
        __builtin_prefetch(p->store_scale + vat + p->stride - 1, 0, 2);
    }
}

// Sequence b's attention for KV head h: qf [group, d] its query heads (floats), newk / newv
// [d] the newest token's tail values (NULL without a tail: the newest row is read from the
// cache); acc [group, d] the output, unrounded.
static void attend_task(const decode_params* p, int64_t b, int64_t h, const float* qf,
                        const float* newk, const float* newv, float* acc) {
    const int64_t len = p->seq_lens[b], d = p->d, group = p->group, width = p->width;
    const int kind = p->kind, x_f32 = p->x_f32;
    const int64_t elem = kv_elem(kind);
    const int is_fp8 = kind >= KV_E4M3;
    // the newest token's tail value replaces its block value: n cached rows are read
    const int64_t n = newk != NULL ? len - 1 : len;
    float* scores = malloc(sizeof(float) * (2 * group * len + 2 * len + 2 * width +
                                            2 * group * width) +
                           3 * sizeof(int64_t) * width + 2 * sizeof(const char*) * (len + width));
    float* w = scores + group * len;  // probabilities times each value row's scale
    float* ks = w + group * len;      // per-row scales (1 unless FP8)
    float* vs = ks + len;
    // the valid tail positions' residual rows (E4M3, read in place) and their scales
    float* tks = vs + len;
    float* tvs = tks + width;
    float* tscores = tvs + width;         // [group, width]: q.r of each
    float* tw = tscores + group * width;  // [group, width]: p times its scale
    const char** krows = (const char**)(tw + group * width);
    const char** vrows = krows + len;
    const char** tkrows = vrows + len;
    const char** tvrows = tkrows + width;
    int64_t* tpos = (int64_t*)(tvrows + width);
    int64_t* tkat = tpos + width;  // the store slots of K's and V's residual rows
    int64_t* tvat = tkat + width;
    int64_t nt = 0;  // valid tail positions
    // position t is at offset t % stride of store row read_rows[(b * width + t) / stride]
    // (width a multiple of stride): counted along, not divided per position
    for (int64_t t = 0, row = width > 0 ? b * width / p->stride : 0, off = 0; t < width;
         t++, off = off + 1 == p->stride ? 0 : off + 1, row += off == 0) {
        if (p->valid[b * width + t] == 0.0f) continue;
        const int64_t seat = p->read_rows[row];
        const int64_t kat = (h * p->seats + seat) * p->stride + off;
        const int64_t vat = ((p->num_kv_heads + h) * p->seats + seat) * p->stride + off;
        tkrows[nt] = (const char*)(p->store + kat * d);
        tvrows[nt] = (const char*)(p->store + vat * d);
        tkat[nt] = kat;
        tvat[nt] = vat;
        __builtin_prefetch(p->store_scale + kat);
        __builtin_prefetch(p->store_scale + vat);
        prefetch_row(tkrows[nt], d);  // read after the cached keys: in cache by then
        prefetch_row(tvrows[nt], d);
        tpos[nt++] = p->pos[b * width + t];
    }
    const int64_t* trow = p->table + b * p->table_stride;
    // E4M3 rows are widened as value / 256 (load8_as): the exact 256 goes into the scale
    const float unit = kind == KV_E4M3 ? 256.0f : 1.0f;
    uint16_t vmax = 0;  // the largest value scale's bits (wide_values)
    if (is_fp8) prefetch_block_scales(p, trow, h, n, 0);  // all requested before the reads
    for (int64_t j0 = 0; j0 < n; j0 += p->block_size) {
        const int64_t first = (h * p->num_blocks + trow[j0 / p->block_size]) * p->block_size;
        const int64_t stop = n - j0 < p->block_size ? n - j0 : p->block_size;
        // separate loops, each vectorized: the rows' addresses, then their scales
        const char* kbase = (const char*)p->k_cache + first * d * elem;
        const char* vbase = (const char*)p->v_cache + first * d * elem;
        for (int64_t off = 0; off < stop; off++) {
            krows[j0 + off] = kbase + off * d * elem;
            vrows[j0 + off] = vbase + off * d * elem;
        }
        if (is_fp8) {
            const uint16_t *ksc = p->k_scale + first, *vsc = p->v_scale + first;
            for (int64_t off = 0; off < stop; off++) {
                ks[j0 + off] = bf16_to_f32(ksc[off]) * unit;
                vs[j0 + off] = bf16_to_f32(vsc[off]) * unit;
                vmax = vsc[off] > vmax ? vsc[off] : vmax;
            }
        } else {
            for (int64_t off = 0; off < stop; off++) ks[j0 + off] = vs[j0 + off] = 1.0f;
        }
    }
#ifdef __AVX512F__
    const int wide = kind == KV_E4M3 && wide_values(d, vmax);
    for (int64_t j = 0; wide && j < n; j++) vs[j] *= 0x1p112f;  // 256 * 2^112, exactly
#else
    const int wide = 0;
#endif
    for (int64_t j = n; j < len; j++) vs[j] = 1.0f;  // the newest token's tail value
    const float sm_scale = p->sm_scale;
    // scores (the value rows are requested while the keys are scored)
    score_cached(qf, d, krows, ks, n, kind, group, x_f32, sm_scale, scores, len, vrows);
    if (n < len) {  // the newest token's tail key, as written by the model
        const char* fresh = (const char*)newk;
        float one = 1.0f;
        score_cached(qf, d, &fresh, &one, 1, KV_F32, group, x_f32, sm_scale, scores + n, len,
                     NULL);
    }
    // tail corrections: q.r at each valid tail position, in the cached keys' tiles
    // the tail's scales, requested in the setup loop and read only now (their lines have
    // come in meanwhile); E4M3 is widened as value / 256 (load8_as): the 256 goes into them
    for (int64_t i = 0; i < nt; i++) tks[i] = bf16_to_f32(p->store_scale[tkat[i]]) * 256.0f;
    if (nt > 0) {
        score_cached(qf, d, tkrows, tks, nt, KV_E4M3, group, x_f32, sm_scale, tscores, width,
                     tvrows);
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < nt; i++) scores[g * len + tpos[i]] += tscores[g * width + i];
    }
    // softmax per query head (probabilities in the model dtype, as the reference casts)
    for (int64_t g = 0; g < group; g++) {
        float* sg = scores + g * len;
        const float m = max_of(sg, len);
        float sum = 0.0f;
        int64_t j = 0;
        v8f vsum = {0};
        for (; j + 8 <= len; j += 8) {
            v8f x;
            memcpy(&x, sg + j, 32);
            x = exp8(x - m);
            memcpy(sg + j, &x, 32);
            vsum += x;
        }
        for (; j < len; j++) {
            v8f x = {sg[j] - m};
            sg[j] = exp8(x)[0];
            sum += sg[j];
        }
        sum += hsum(vsum);
        const float inv = 1.0f / sum;
        j = 0;
        for (; j + 8 <= len; j += 8) {  // vs is 1 past n (the newest token's tail value)
            v8f pr, sv;
            memcpy(&pr, sg + j, 32);
            memcpy(&sv, vs + j, 32);
            pr *= inv;
            if (!x_f32) pr = rnd8(pr);
            memcpy(sg + j, &pr, 32);
            pr *= sv;
            memcpy(w + g * len + j, &pr, 32);
        }
        for (; j < len; j++) {
            sg[j] *= inv;
            if (!x_f32) sg[j] = round_bf16(sg[j]);
            w[g * len + j] = sg[j] * vs[j];
        }
    }
    // values
    memset(acc, 0, sizeof(float) * group * d);
#ifdef __AVX512BF16__
    if (kind == KV_BF16 && !x_f32 && d % 32 == 0 && d <= 512)  // w: bf16 probabilities
        pair_values(w, len, vrows, n, group, acc, d);
    else
#endif
        sum_cached(w, len, vrows, n, kind, group, acc, d, wide);
    if (n < len) {  // the newest token's tail value
        const char* fresh = (const char*)newv;
        sum_cached(w + n, len, &fresh, 1, KV_F32, group, acc, d, 0);
    }
    if (nt > 0) {  // p.r at each valid tail position, in the cached values' tiles
        uint16_t tmax = 0;  // the residual rows' scales, widened alike where they allow it
        for (int64_t i = 0; i < nt; i++)
            tmax = p->store_scale[tvat[i]] > tmax ? p->store_scale[tvat[i]] : tmax;
#ifdef __AVX512F__
        const int twide = wide_values(d, tmax);
#else
        const int twide = 0;
#endif
        const float tunit = twide ? 0x1p120f : 256.0f;
        for (int64_t i = 0; i < nt; i++) tvs[i] = bf16_to_f32(p->store_scale[tvat[i]]) * tunit;
        for (int64_t g = 0; g < group; g++)
            for (int64_t i = 0; i < nt; i++)
                tw[g * width + i] = scores[g * len + tpos[i]] * tvs[i];
        sum_cached(tw, width, tvrows, nt, KV_E4M3, group, acc, d, twide);
    }
    free(scores);
}

// A row of float32 (x_f32) or bf16 bits as floats, and back (rounded to nearest even).
static inline void load_row(const void* x, int64_t at, int64_t d, int x_f32, float* out) {
    for (int64_t i = 0; i < d; i++)
        out[i] = x_f32 ? ((const float*)x)[at + i] : bf16_to_f32(((const uint16_t*)x)[at + i]);
}

static inline void store_row(void* x, int64_t at, int64_t d, int x_f32, const float* v) {
    for (int64_t i = 0; i < d; i++) {
        if (x_f32) {
            ((float*)x)[at + i] = v[i];
        } else {
            float f = round_bf16(v[i]);
            uint32_t bits;
            memcpy(&bits, &f, 4);
            ((uint16_t*)x)[at + i] = (uint16_t)(bits >> 16);
        }
    }
}

// q: [B, H, D] (query rows of the decode sequences); cache: [KVH, NB, BS, D]; scales:
// [KVH, NB, BS] bf16 (FP8 only); table: [B, table_stride]; seq_lens: [B]. Tail (new_k NULL:
// none): new_k/new_v [B, KVH, D] tail values of each sequence's newest token; the residual
// store (K's heads, then V's: [2 KVH, seats, stride, D] E4M3, scales bf16) read in place,
// sequence b's width positions t at store row read_rows[b * width / stride + t / stride],
// offset t % stride; pos/valid [B, width]. out: [B, H, D]. x_f32: q/new/out are float32 (else
// bf16, with the torch reference's roundings of scores, probabilities and the output; the
// residuals' scales are applied after their dot products, as the cached rows' are).
void infer8_decode_attention_struct(const infer8_decode_attention_args* a) {
    INFER8_DECODE_ATTENTION_FIELDS(INFER8_UNPACK)
    const decode_params p = {k_cache, v_cache, k_scale, v_scale, kind, x_f32, table, seq_lens,
                             table_stride, num_kv_heads, group, num_blocks, block_size, d,
                             sm_scale, new_k != NULL ? store : NULL, store_scale, read_rows,
                             pos, valid, seats, stride, new_k != NULL ? width : 0};
    const int64_t num_heads = num_kv_heads * group;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
        if (seq_lens[b] <= 0) continue;  // callers pass real sequences only
        float* qf = malloc(sizeof(float) * 4 * group * d);
        float *acc = qf + group * d, *nk = acc + group * d, *nv = nk + d;
        load_row(q, (b * num_heads + h * group) * d, group * d, x_f32, qf);
        if (new_k != NULL) {
            load_row(new_k, (b * num_kv_heads + h) * d, d, x_f32, nk);
            load_row(new_v, (b * num_kv_heads + h) * d, d, x_f32, nv);
        }
        attend_task(&p, b, h, qf, new_k != NULL ? nk : NULL, new_k != NULL ? nv : NULL, acc);
        store_row(out, (b * num_heads + h * group) * d, group * d, x_f32, acc);
        free(qf);
    }
}

// Defined beside the batched passes they serve one row of (fp8_gather.c, hadamard.c).
void infer8_quantize_row(const float* v, int64_t d, int is_e5m2, float per_amax, uint8_t* out,
                         uint16_t* scale);

// Residual rows of sequence b (K's head h, V's head kvh + h) into the store's slots where
// ids[i] == b: exact_tail.write_store for one (sequence, KV head).
static void store_residuals(uint8_t* store, uint16_t* store_scale, int64_t store_slots,
                            int64_t num_kv_heads, int64_t h, int64_t d, const int64_t* ids,
                            const int64_t* slots, int64_t n, int64_t b, const uint8_t* rk,
                            uint16_t sk, const uint8_t* rv, uint16_t sv) {
    int64_t i = 0, hi = n;  // ids ascend (build_tail_metadata lists a step's tokens in order)
    while (i < hi) {
        const int64_t mid = (i + hi) / 2;
        if (ids[mid] < b) i = mid + 1; else hi = mid;
    }
    for (; i < n && ids[i] == b; i++) {
        const int64_t kat = h * store_slots + slots[i];
        const int64_t vat = (num_kv_heads + h) * store_slots + slots[i];
        memcpy(store + kat * d, rk, (size_t)d);
        memcpy(store + vat * d, rv, (size_t)d);
        store_scale[kat] = sk;
        store_scale[vat] = sv;
    }
}

// A whole decode layer's attention for an all-decode batch (token b is sequence b) in one call
// instead of a dozen: what the CPU backend's general path does, in its order and
// with their roundings, in two passes over (sequence, KV head) tasks: (1) the new K/V rows
// (x [B, KVH, D] at row stride kv_stride, head stride d) rotated by the Hadamard matrix
// (rotate_keys; V too with rotate_values), written to the cache at slot_mapping[b] (copied, or
// quantized with a dynamic scale: cache_per_amax) and, with a tail store (store not NULL),
// their residuals and tail values (exact_tail.tail_values) and the sink rows stored
// (sink_ids/slots); (2) the attention of q [B, H, D] (row stride q_stride; rotated with the
// keys), the output [B, H, D] rotated back with the values, then (3) the task's ring rows
// stored (ring_ids/slots: its sequence's own seat, which no other task reads; the slot a new
// row takes is the oldest position this task has just read). Every write lands before any
// read of it, as AttentionMetadata requires.
void infer8_decode_layer_struct(const infer8_decode_layer_args* a) {
    INFER8_DECODE_LAYER_FIELDS(INFER8_UNPACK)
    const decode_params p = {k_cache, v_cache, k_scale, v_scale, kind, x_f32, table, seq_lens,
                             table_stride, num_kv_heads, group, num_blocks, block_size, d,
                             sm_scale, store, store_scale, read_rows, pos, valid, seats, stride,
                             store != NULL ? width : 0};
    const int64_t tasks = batch * num_kv_heads, num_heads = num_kv_heads * group;
    const int64_t store_slots = seats * stride;
    const int64_t elem = kv_elem(kind);
    // per task: the tail values of K and V (floats), their residuals (E4M3) and scales
    float* tails = malloc(sizeof(float) * 2 * d * tasks + (2 * d + 4) * tasks);
    uint8_t* residuals = (uint8_t*)(tails + 2 * d * tasks);
    uint16_t* scales = (uint16_t*)(residuals + 2 * d * tasks);
    int64_t claimed = 0;  // pass (2)'s next task
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            float nk[512], nv[512];
            if (d > 512 || seq_lens[b] <= 0) continue;  // the caller checks both
            const int64_t slot = h * num_blocks * block_size + slot_mapping[b];
            if (store != NULL) {  // written, residuals and tail values in one pass per row
                const int e5m2 = kind == KV_E5M2;
                float* tk = tails + 2 * d * task;
                uint8_t* rk = residuals + 2 * d * task;
                uint16_t* sk = scales + 2 * task;
                // K's row and V's as a pair; tail values as floats (block NULL)
                const int64_t at = b * kv_stride + h * d;
                const tail_row_args rows[2] = {
                    {k, at, rotate_keys, (uint8_t*)k_cache + slot * d, k_scale + slot, rk, sk, 0},
                    {v, at, rotate_keys && rotate_values, (uint8_t*)v_cache + slot * d,
                     v_scale + slot, rk + d, sk + 1, d}};
                infer8_tail_pair(rows, d, x_f32, e5m2, cache_per_amax, e4m3_per_amax, tk, NULL);
                store_residuals(store, store_scale, store_slots, num_kv_heads, h, d, sink_ids,
                                sink_slots, num_sinks, b, rk, sk[0], rk + d, sk[1]);
                continue;
            }
            load_row(k, b * kv_stride + h * d, d, x_f32, nk);
            load_row(v, b * kv_stride + h * d, d, x_f32, nv);
            if (rotate_keys) infer8_hadamard_row(nk, d, x_f32);
            if (rotate_keys && rotate_values) infer8_hadamard_row(nv, d, x_f32);
            if (kind >= KV_E4M3) {  // reference.write_blocks' dynamic FP8 write
                const int e5m2 = kind == KV_E5M2;
                infer8_quantize_row(nk, d, e5m2, cache_per_amax, (uint8_t*)k_cache + slot * d,
                                    k_scale + slot);
                infer8_quantize_row(nv, d, e5m2, cache_per_amax, (uint8_t*)v_cache + slot * d,
                                    v_scale + slot);
            } else {  // a copy (rounded to nearest even into a bf16 cache)
                store_row((char*)k_cache + slot * d * elem, 0, d, kind == KV_F32, nk);
                store_row((char*)v_cache + slot * d * elem, 0, d, kind == KV_F32, nv);
            }
        }
        // (2) tasks claimed one ahead (a dynamic schedule that knows each thread's next
        // task), whose first lines are requested before this one runs
        int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (next < tasks) {
            const int64_t task = next;
            next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (next < tasks) prefetch_task(&p, next / num_kv_heads, next % num_kv_heads);
            const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
            if (d > 512 || seq_lens[b] <= 0) continue;
            float* qf = malloc(sizeof(float) * 2 * group * d);
            float* acc = qf + group * d;
            load_row(q, b * q_stride + h * group * d, group * d, x_f32, qf);
            if (rotate_keys) hadamard_rows_inline(qf, group, d, d, x_f32);
            const float* tk = store != NULL ? tails + 2 * d * task : NULL;
            attend_task(&p, b, h, qf, tk, tk != NULL ? tk + d : NULL, acc);
            if (rotate_keys && rotate_values) {  // the output rounded, then rotated back
                if (!x_f32)
                    for (int64_t i = 0; i < group * d; i++) acc[i] = round_bf16(acc[i]);
                hadamard_rows_inline(acc, group, d, d, x_f32);
            }
            store_row(out, (b * num_heads + h * group) * d, group * d, x_f32, acc);
            free(qf);
            if (store != NULL)  // (3) the ring rows, once this task's reads are done
                store_residuals(store, store_scale, store_slots, num_kv_heads, h, d, ring_ids,
                                ring_slots, num_rings, b, residuals + 2 * d * task,
                                scales[2 * task], residuals + 2 * d * task + d,
                                scales[2 * task + 1]);
        }
    }
    free(tails);
}
