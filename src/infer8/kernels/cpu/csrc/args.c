// The layout of the argument structs (args.h), for the test that checks the Python side.
#include <stddef.h>
#include <string.h>

#include "args.h"

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
