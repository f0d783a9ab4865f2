// The argument structs of the native functions with long argument lists: each field named
// and typed once, here (X-macros). The functions take the struct and open their bodies with
// INFER8_<NAME>_FIELDS(INFER8_UNPACK), which declares one local per field; Python reads these
// lists to build its ctypes Structures (library.py) and fills them by field name instead of
// passing 20-40 positional values. infer8_args_layout reports each struct's field offsets and
// size, which a test checks against the Python side.
#pragma once
#include <stdint.h>

// Declares a function's local `name` from its argument struct `a`.
#define INFER8_UNPACK(type, name) type name = a->name;

#define INFER8_DECODE_ATTENTION_FIELDS(X) \
    X(const void*, q) \
    X(const void*, k_cache) \
    X(const void*, v_cache) \
    X(const uint16_t*, k_scale) \
    X(const uint16_t*, v_scale) \
    X(int, kind) \
    X(const int64_t*, table) \
    X(int64_t, table_stride) \
    X(const int64_t*, seq_lens) \
    X(int64_t, batch) \
    X(int64_t, num_kv_heads) \
    X(int64_t, group) \
    X(int64_t, num_blocks) \
    X(int64_t, block_size) \
    X(int64_t, d) \
    X(float, sm_scale) \
    X(int, x_f32) \
    X(const void*, new_k) \
    X(const void*, new_v) \
    X(const uint8_t*, store) \
    X(const uint16_t*, store_scale) \
    X(const int64_t*, read_rows) \
    X(int64_t, seats) \
    X(int64_t, stride) \
    X(const int64_t*, pos) \
    X(const float*, valid) \
    X(int64_t, width) \
    X(void*, out)

#define INFER8_DECODE_LAYER_FIELDS(X) \
    X(const void*, q) \
    X(int64_t, q_stride) \
    X(const void*, k) \
    X(const void*, v) \
    X(int64_t, kv_stride) \
    X(const int64_t*, slot_mapping) \
    X(void*, k_cache) \
    X(void*, v_cache) \
    X(uint16_t*, k_scale) \
    X(uint16_t*, v_scale) \
    X(int, kind) \
    X(const int64_t*, table) \
    X(int64_t, table_stride) \
    X(const int64_t*, seq_lens) \
    X(int64_t, batch) \
    X(int64_t, num_kv_heads) \
    X(int64_t, group) \
    X(int64_t, num_blocks) \
    X(int64_t, block_size) \
    X(int64_t, d) \
    X(float, sm_scale) \
    X(int, x_f32) \
    X(int, rotate_keys) \
    X(int, rotate_values) \
    X(float, cache_per_amax) \
    X(uint8_t*, store) \
    X(uint16_t*, store_scale) \
    X(const int64_t*, read_rows) \
    X(int64_t, seats) \
    X(int64_t, stride) \
    X(const int64_t*, pos) \
    X(const float*, valid) \
    X(int64_t, width) \
    X(float, e4m3_per_amax) \
    X(const int64_t*, sink_ids) \
    X(const int64_t*, sink_slots) \
    X(int64_t, num_sinks) \
    X(const int64_t*, ring_ids) \
    X(const int64_t*, ring_slots) \
    X(int64_t, num_rings) \
    X(void*, out)

#define INFER8_PREFILL_TAIL_FIELDS(X) \
    X(const void*, k) \
    X(int64_t, k_stride) \
    X(const void*, v) \
    X(int64_t, v_stride) \
    X(int64_t, n) \
    X(int64_t, kvh) \
    X(int64_t, d) \
    X(int, x_f32) \
    X(int, rotate_keys) \
    X(int, rotate_values) \
    X(int, block_is_e5m2) \
    X(float, block_per_amax) \
    X(float, e4m3_per_amax) \
    X(const int64_t*, slot_mapping) \
    X(int64_t, num_slots) \
    X(uint8_t*, k_cache) \
    X(uint16_t*, k_scale) \
    X(uint8_t*, v_cache) \
    X(uint16_t*, v_scale) \
    X(uint8_t*, res_q) \
    X(uint16_t*, res_scale) \
    X(void*, tail) \
    X(void*, block)

#define INFER8_TWO_VALUE_ATTENTION_FIELDS(X) \
    X(const void*, q) \
    X(int64_t, q_tok) \
    X(int64_t, q_head) \
    X(const void*, k1) \
    X(int64_t, k1_head) \
    X(const void*, k2) \
    X(int64_t, k2_head) \
    X(const void*, v1) \
    X(int64_t, v1_head) \
    X(const void*, v2) \
    X(int64_t, v2_head) \
    X(int64_t, k_row) \
    X(int64_t, v_row) \
    X(const uint8_t*, second) \
    X(int64_t, num_heads) \
    X(int64_t, num_kv_heads) \
    X(int64_t, q_len) \
    X(int64_t, n) \
    X(int64_t, d) \
    X(int64_t, q_start) \
    X(float, scale) \
    X(int, bf16) \
    X(void*, out) \
    X(int64_t, o_tok) \
    X(int64_t, o_head) \
    X(int, rotate_q) \
    X(int, rotate_out)

#define INFER8_TWO_VALUE_PROMPTS_FIELDS(X) \
    X(const void*, q) \
    X(int64_t, q_tok) \
    X(int64_t, q_head) \
    X(const void*, k1) \
    X(int64_t, k1_head) \
    X(const void*, k2) \
    X(int64_t, k2_head) \
    X(const void*, v1) \
    X(int64_t, v1_head) \
    X(const void*, v2) \
    X(int64_t, v2_head) \
    X(int64_t, k_row) \
    X(int64_t, v_row) \
    X(const uint8_t* const*, seconds) \
    X(int64_t, num_seqs) \
    X(const int64_t*, starts) \
    X(const int64_t*, lens) \
    X(int64_t, num_heads) \
    X(int64_t, num_kv_heads) \
    X(int64_t, d) \
    X(float, scale) \
    X(int, bf16) \
    X(void*, out) \
    X(int64_t, o_tok) \
    X(int64_t, o_head) \
    X(int, rotate_q) \
    X(int, rotate_out)

#define INFER8_FIELD(type, name) type name;
typedef struct { INFER8_DECODE_ATTENTION_FIELDS(INFER8_FIELD) } infer8_decode_attention_args;
typedef struct { INFER8_DECODE_LAYER_FIELDS(INFER8_FIELD) } infer8_decode_layer_args;
typedef struct { INFER8_PREFILL_TAIL_FIELDS(INFER8_FIELD) } infer8_prefill_tail_args;
typedef struct { INFER8_TWO_VALUE_ATTENTION_FIELDS(INFER8_FIELD) } infer8_two_value_attention_args;
typedef struct { INFER8_TWO_VALUE_PROMPTS_FIELDS(INFER8_FIELD) } infer8_two_value_prompts_args;
