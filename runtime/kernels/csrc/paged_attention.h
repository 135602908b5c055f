/* paged_attention.c's face: its sizes and limits, the arguments its entry point takes as one struct, and its entry
 * points; included by paged_attention.c, its headers and paged_attention_op.cpp. paged_attention.py's BINDING
 * declares the same limits, status texts and struct (tests/test_native_sources.py checks that they agree). */
#ifndef FURCATE_PAGED_ATTENTION_H
#define FURCATE_PAGED_ATTENTION_H

#include <stdint.h>

#define BLOCK 64      /* keys scored before their values are read */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_ROWS 48   /* query rows (tokens x query heads) a work item holds */
#define MAX_TILE 16   /* tokens a prefill tile holds */
#define MAX_DIM 256   /* head dimension, a multiple of LANES */
#define LANES 16      /* head dimensions come in parts of this many floats (the vectors: paged_attention_vec.h's VL) */
#define QT_STRIDE (MAX_ROWS + 16) /* a tile's transposed queries: an element of each row, room for spare lanes */

/* q and out [tokens, heads, dim] (float32, or bfloat16 where bf16, as the pools are); spans [3, batch]: request b's
 * new tokens are rows spans[0][b] .. spans[0][b] + spans[1][b] - 1 of q, after spans[2][b] cached ones; k_pool and
 * v_pool [pool_slots, kv_heads, dim]; slots [batch, table_len]: row b holds request b's KV slots in position order,
 * its new tokens' own included (written before this runs). One struct rather than fifteen positional arguments, so
 * that ctypes and the C++ op fill fields by name. */
typedef struct {
    const void *q, *k_pool, *v_pool;
    int64_t pool_slots;
    const int64_t *slots;
    int64_t table_len;
    const int64_t *spans;
    int batch, heads, kv_heads, dim;
    float scale;
    void *out;
    int threads, bf16;
} PagedAttentionArgs;

#ifdef __cplusplus
extern "C" {
#endif

/* Returns 0; -1 for shapes beyond the limits above, -2 for spans past the table, -3 when out of memory (nothing
 * is computed then). */
int paged_attention(const PagedAttentionArgs *args);

/* Whether bfloat16 pools take paged_attention_bf16.h's path in this build (where the head dimension allows). */
int paged_attention_bf16_products(void);

#ifdef __cplusplus
}
#endif

#endif
