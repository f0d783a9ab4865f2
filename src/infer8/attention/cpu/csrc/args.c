// Struct-argument entry points of the native functions with long argument lists (args.h):
// each unpacks its struct into the function's own arguments.
#include <stddef.h>
#include <string.h>

#include "args.h"

void infer8_decode_attention(const void* q, const void* k_cache, const void* v_cache, const uint16_t* k_scale, const uint16_t* v_scale, int kind, const int64_t* table, int64_t table_stride, const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t group, int64_t num_blocks, int64_t block_size, int64_t d, float sm_scale, int x_f32, const void* new_k, const void* new_v, const uint8_t* store, const uint16_t* store_scale, const int64_t* read_rows, int64_t seats, int64_t stride, const int64_t* pos, const float* valid, int64_t width, void* out);
void infer8_decode_layer(const void* q, int64_t q_stride, const void* k, const void* v, int64_t kv_stride, const int64_t* slot_mapping, void* k_cache, void* v_cache, uint16_t* k_scale, uint16_t* v_scale, int kind, const int64_t* table, int64_t table_stride, const int64_t* seq_lens, int64_t batch, int64_t num_kv_heads, int64_t group, int64_t num_blocks, int64_t block_size, int64_t d, float sm_scale, int x_f32, int rotate_keys, int rotate_values, float cache_per_amax, uint8_t* store, uint16_t* store_scale, const int64_t* read_rows, int64_t seats, int64_t stride, const int64_t* pos, const float* valid, int64_t width, float e4m3_per_amax, const int64_t* sink_ids, const int64_t* sink_slots, int64_t num_sinks, const int64_t* ring_ids, const int64_t* ring_slots, int64_t num_rings, void* out);
void infer8_prefill_tail(const void* k, int64_t k_stride, const void* v, int64_t v_stride, int64_t n, int64_t kvh, int64_t d, int x_f32, int rotate_keys, int rotate_values, int block_is_e5m2, float block_per_amax, float e4m3_per_amax, const int64_t* slot_mapping, int64_t num_slots, uint8_t* k_cache, uint16_t* k_scale, uint8_t* v_cache, uint16_t* v_scale, uint8_t* res_q, uint16_t* res_scale, void* tail, void* block);
void infer8_two_value_attention(const void* q, int64_t q_tok, int64_t q_head, const void* k1, int64_t k1_head, const void* k2, int64_t k2_head, const void* v1, int64_t v1_head, const void* v2, int64_t v2_head, int64_t k_row, int64_t v_row, const uint8_t* second, int64_t num_heads, int64_t num_kv_heads, int64_t q_len, int64_t n, int64_t d, int64_t q_start, float scale, int bf16, void* out, int64_t o_tok, int64_t o_head, int rotate_q, int rotate_out);
void infer8_two_value_prompts(const void* q, int64_t q_tok, int64_t q_head, const void* k1, int64_t k1_head, const void* k2, int64_t k2_head, const void* v1, int64_t v1_head, const void* v2, int64_t v2_head, int64_t k_row, int64_t v_row, const uint8_t* const* seconds, int64_t num_seqs, const int64_t* starts, const int64_t* lens, int64_t num_heads, int64_t num_kv_heads, int64_t d, float scale, int bf16, void* out, int64_t o_tok, int64_t o_head, int rotate_q, int rotate_out);

void infer8_decode_attention_struct(const infer8_decode_attention_args* a) {
    infer8_decode_attention(a->q, a->k_cache, a->v_cache, a->k_scale, a->v_scale, a->kind, a->table, a->table_stride, a->seq_lens, a->batch, a->num_kv_heads, a->group, a->num_blocks, a->block_size, a->d, a->sm_scale, a->x_f32, a->new_k, a->new_v, a->store, a->store_scale, a->read_rows, a->seats, a->stride, a->pos, a->valid, a->width, a->out);
}

void infer8_decode_layer_struct(const infer8_decode_layer_args* a) {
    infer8_decode_layer(a->q, a->q_stride, a->k, a->v, a->kv_stride, a->slot_mapping, a->k_cache, a->v_cache, a->k_scale, a->v_scale, a->kind, a->table, a->table_stride, a->seq_lens, a->batch, a->num_kv_heads, a->group, a->num_blocks, a->block_size, a->d, a->sm_scale, a->x_f32, a->rotate_keys, a->rotate_values, a->cache_per_amax, a->store, a->store_scale, a->read_rows, a->seats, a->stride, a->pos, a->valid, a->width, a->e4m3_per_amax, a->sink_ids, a->sink_slots, a->num_sinks, a->ring_ids, a->ring_slots, a->num_rings, a->out);
}

void infer8_prefill_tail_struct(const infer8_prefill_tail_args* a) {
    infer8_prefill_tail(a->k, a->k_stride, a->v, a->v_stride, a->n, a->kvh, a->d, a->x_f32, a->rotate_keys, a->rotate_values, a->block_is_e5m2, a->block_per_amax, a->e4m3_per_amax, a->slot_mapping, a->num_slots, a->k_cache, a->k_scale, a->v_cache, a->v_scale, a->res_q, a->res_scale, a->tail, a->block);
}

void infer8_two_value_attention_struct(const infer8_two_value_attention_args* a) {
    infer8_two_value_attention(a->q, a->q_tok, a->q_head, a->k1, a->k1_head, a->k2, a->k2_head, a->v1, a->v1_head, a->v2, a->v2_head, a->k_row, a->v_row, a->second, a->num_heads, a->num_kv_heads, a->q_len, a->n, a->d, a->q_start, a->scale, a->bf16, a->out, a->o_tok, a->o_head, a->rotate_q, a->rotate_out);
}

void infer8_two_value_prompts_struct(const infer8_two_value_prompts_args* a) {
    infer8_two_value_prompts(a->q, a->q_tok, a->q_head, a->k1, a->k1_head, a->k2, a->k2_head, a->v1, a->v1_head, a->v2, a->v2_head, a->k_row, a->v_row, a->seconds, a->num_seqs, a->starts, a->lens, a->num_heads, a->num_kv_heads, a->d, a->scale, a->bf16, a->out, a->o_tok, a->o_head, a->rotate_q, a->rotate_out);
}

#define INFER8_OFFSET(type, name) (int64_t)offsetof(STRUCT, name),

// Write the field offsets of the struct `name` (the function's name without infer8_) and then
// its size into offsets (room for max values); return the number of fields, -1 if unknown.
int64_t infer8_args_layout(const char* name, int64_t* offsets, int64_t max) {
    const int64_t* found = NULL;
    int64_t count = 0, size = 0;
    if (strcmp(name, "decode_attention") == 0) {
#define STRUCT infer8_decode_attention_args
        static const int64_t layout[] = {INFER8_DECODE_ATTENTION_FIELDS(INFER8_OFFSET)};
#undef STRUCT
        found = layout, count = sizeof(layout) / sizeof(layout[0]), size = sizeof(infer8_decode_attention_args);
    }
    if (strcmp(name, "decode_layer") == 0) {
#define STRUCT infer8_decode_layer_args
        static const int64_t layout[] = {INFER8_DECODE_LAYER_FIELDS(INFER8_OFFSET)};
#undef STRUCT
        found = layout, count = sizeof(layout) / sizeof(layout[0]), size = sizeof(infer8_decode_layer_args);
    }
    if (strcmp(name, "prefill_tail") == 0) {
#define STRUCT infer8_prefill_tail_args
        static const int64_t layout[] = {INFER8_PREFILL_TAIL_FIELDS(INFER8_OFFSET)};
#undef STRUCT
        found = layout, count = sizeof(layout) / sizeof(layout[0]), size = sizeof(infer8_prefill_tail_args);
    }
    if (strcmp(name, "two_value_attention") == 0) {
#define STRUCT infer8_two_value_attention_args
        static const int64_t layout[] = {INFER8_TWO_VALUE_ATTENTION_FIELDS(INFER8_OFFSET)};
#undef STRUCT
        found = layout, count = sizeof(layout) / sizeof(layout[0]), size = sizeof(infer8_two_value_attention_args);
    }
    if (strcmp(name, "two_value_prompts") == 0) {
#define STRUCT infer8_two_value_prompts_args
        static const int64_t layout[] = {INFER8_TWO_VALUE_PROMPTS_FIELDS(INFER8_OFFSET)};
#undef STRUCT
        found = layout, count = sizeof(layout) / sizeof(layout[0]), size = sizeof(infer8_two_value_prompts_args);
    }
    if (found == NULL || count + 1 > max) return -1;
    for (int64_t i = 0; i < count; i++) offsets[i] = found[i];
    offsets[count] = size;
    return count;
}
