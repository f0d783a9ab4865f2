// One row of an FP8 exact tail's write (csrc/fp8_gather.c: prefill_tail's rows, the decode
// layer's new K/V rows): where it is read and where its codes, residual and values go.
#ifndef INFER8_TAIL_ROW_H
#define INFER8_TAIL_ROW_H

#include <stdint.h>

typedef struct {
    const void* src;       // the row at element `at` (bf16 bits or float32)
    int64_t at;
    int rotate;            // Hadamard-rotated first
    uint8_t* codes;        // its block codes and scale
    uint16_t* code_scale;
    uint8_t* res_q;        // its E4M3 residual and scale
    uint16_t* res_scale;
    int64_t o;             // its tail (and block) values at element o of theirs
} tail_row_args;

// Two rows (a pair: where AVX-512 holds them in registers, one row's dependency chain overlaps
// the other's); tail / block: see infer8_prefill_tail (block NULL: no block values, the tail
// values as floats whatever the dtype).
void infer8_tail_pair(const tail_row_args rows[2], int64_t d, int x_f32, int block_is_e5m2,
                      float block_per_amax, float e4m3_per_amax, void* tail, void* block);

#endif
