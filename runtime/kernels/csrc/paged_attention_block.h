/* paged_attention.c's pieces of a block of keys that both its paths take (the float path there and the bfloat16
 * products of paged_attention_bf16.h): where a row's weights lie, the online softmax by rows and across a tile's
 * lanes, how many of a block's keys each row sees, and the next block's rows asked for on the way. */
#ifndef FURCATE_PAGED_ATTENTION_BLOCK_H
#define FURCATE_PAGED_ATTENTION_BLOCK_H

#include <stdint.h>
#include <string.h>

#include "paged_attention.h"
#include "paged_attention_vec.h"

/* Where row r's weight for key j (or pair of keys j) lies in a block's weights: r * row + j * key (row by row for
 * the rows' own scores, key by key for a tile's). */
typedef struct {
    int row, key;
} Strides;

/* Rows' scores (weights[r], the first visible[r] of them) become softmax weights against each row's running
 * maximum, zero past the keys the row sees, up to BLOCK; its running sum and accumulator are rescaled where the
 * maximum rose. A row that sees none of the block's keys keeps its state. */
static inline void softmax_rows(float (*weights)[BLOCK], const int *visible, int rows, vf (*acc)[MAX_DIM / VL],
                                int chunks, float *running_max, float *running_sum) {
    for (int r = 0; r < rows; r++) {
        float *w = weights[r];
        int vectors = (visible[r] + VL - 1) / VL;
        for (int j = visible[r]; j < vectors * VL; j++) w[j] = -3.0e38f; /* exp gives 0 */
        if (vectors) {
            vf most = load_f32(w);
            for (int j = 1; j < vectors; j++) most = vmax(most, load_f32(&w[j * VL]));
            float block_max = hmax(most);
            float new_max = block_max > running_max[r] ? block_max : running_max[r];
            float rescale = exp_nonpositive((vf){} + (running_max[r] - new_max))[0];
            vf block_sum = {};
            for (int j = 0; j < vectors * VL; j += VL) {
                vf e = exp_nonpositive(load_f32(&w[j]) - new_max);
                memcpy(&w[j], &e, sizeof e);
                block_sum += e;
            }
            running_sum[r] = running_sum[r] * rescale + hsum(block_sum);
            running_max[r] = new_max;
            for (int c = 0; c < chunks; c++) acc[r][c] *= rescale;
        }
        for (int j = vectors * VL; j < BLOCK; j++) w[j] = 0.0f;
    }
}

/* softmax_rows across lanes, VL rows at once: their maxima and sums by vector, the weights stored key by key (row
 * r's weight for key j at weights[j * QT_STRIDE + r]). A row that sees none of the block's keys keeps its state (its
 * rescale is exp(0), exactly 1). */
static inline void tile_softmax(vf (*scores)[MAX_ROWS / VL], const int *visible, int rows, int count,
                                vf (*acc)[MAX_DIM / VL], int chunks, float *running_max, float *running_sum,
                                float *weights) {
    const vf none = (vf){} - 3.0e38f;
    for (int v = 0; v < (rows + VL - 1) / VL; v++) {
        int lanes = rows - VL * v < VL ? rows - VL * v : VL;
        vi seen = {};
        vf old_max = none, old_sum = {}, most = none, sum = {};
        for (int r = 0; r < lanes; r++) {
            seen[r] = visible[VL * v + r];
            old_max[r] = running_max[VL * v + r];
            old_sum[r] = running_sum[VL * v + r];
        }
        for (int j = 0; j < count; j++) most = vmax(most, pick(seen > j, scores[j][v], none));
        vf new_max = vmax(old_max, most), rescale = exp_nonpositive(old_max - new_max);
        for (int j = 0; j < count; j++) { /* a key the row does not see weighs 0, whatever its maximum */
            vf e = pick(seen > j, exp_nonpositive(scores[j][v] - new_max), (vf){});
            memcpy(weights + j * QT_STRIDE + VL * v, &e, sizeof e);
            sum += e;
        }
        vf total = old_sum * rescale + sum;
        for (int r = 0; r < lanes; r++) {
            running_sum[VL * v + r] = total[r];
            running_max[VL * v + r] = new_max[r];
            for (int c = 0; c < chunks; c++) acc[VL * v + r][c] *= rescale[r];
        }
    }
}

/* How many of the block's keys (from position first_pos) each row sees: row r, of token r / group, up to position
 * last_pos[r / group]. */
static inline void rows_visible(int *visible, int rows, int group, int count, int64_t first_pos,
                                const int64_t *last_pos) {
    for (int r = 0; r < rows; r++) {
        int64_t seen = last_pos[r / group] - first_pos + 1;
        visible[r] = seen < 0 ? 0 : seen < count ? (int)seen : count;
    }
}

/* The next block's slots (count of them; 0 at an item's last block), whose rows a block asks for while it reads its
 * own: a request's decoded tokens lie a batch's worth of slots apart, where the hardware prefetcher does not follow.
 * A few rows at a time, between the block's own loads and products: asked for all at once, at the block's start, the
 * next block came no sooner; spread, bfloat16 decode at batch 32 ran ~10% faster and float32 ~4%. */
typedef struct {
    const int64_t *slots;
    int count;
} Ahead;

/* Ask for head h's K and V rows of the next block's j-th slot. */
static inline void prefetch_ahead(Ahead ahead, int j, const void *k_pool, const void *v_pool, int64_t pool_slots,
                                  int kv_heads, int h, int row_bytes) {
    if (j >= ahead.count) return;
    int64_t at = (checked(ahead.slots[j], pool_slots) * kv_heads + h) * row_bytes;
    for (int line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch((const char *)k_pool + at + line);
        __builtin_prefetch((const char *)v_pool + at + line);
    }
}

#endif
