/* Attention read straight from the paged KV pool, for decode and prefill batches alike: token i of request b's new
 * tokens (at position prefix_lens[b] + i) attends to its row of the slot table up to and including its own slot,
 * without first gathering those K/V rows into a padded block.
 *
 * A gather copies every request's keys and values once per layer and SDPA reads the copy again; at batch 32 with
 * ~550-token contexts that is ~0.8 GB moved per decode step on the default model, more than its matmuls take; a
 * prefill chunk's padded, masked SDPA computes every key against every query. Here each key and value row is read
 * once per tile of queries, where it lies in the pool, and keys past a tile's last position are never read.
 *
 * A work item is a tile of a request's new tokens (up to MAX_ROWS query rows: tokens x query heads of a KV head)
 * and some of its KV heads; the heads take each block of keys in turn, so a slot's row (all heads side by side)
 * comes from memory once. Per head and block of BLOCK keys: scores (VL keys' dot products summed at once),
 * causal masking per row, an online softmax (a running maximum and sum, the accumulated values rescaled when the
 * maximum rises), then the block's values, taken by sets of rows so that a value row is read once a set. Each head
 * asks for its rows of the next block as it goes: a request's decoded tokens lie a batch's worth of slots apart.
 *
 * Requests whose tables start with the same cached slots (a program's forks, the choices of a select, a batch
 * behind one system prompt) are a work item together where their rows fit: the shared keys are read once for all
 * their rows, then each request's rows go on over its own keys (a cascade, without a merge: the online softmax
 * simply continues). At batch 32 with 512 shared tokens, each shared key row is otherwise read 32 times a layer.
 *
 * float32 or bfloat16 queries, pool and output (one type for all three). bfloat16 is computed as float32: on a CPU
 * with AVX512-BF16 by bfloat16 products summed in float32 (paged_attention_bf16.h), elsewhere by widening each row
 * to float32 as it is read. Either way the output is rounded to the nearest bfloat16 once, at the end.
 *
 * The rows of a request with several new tokens (a prefill's) are scored VL at a time across a vector's lanes
 * (tile_scores), decode rows one by one: a request's rows take one path wherever they are planned. A vector is one
 * register: 16 floats with AVX512, 8 with AVX2 (paged_attention_vec.h).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"
#include "paged_attention_vec.h"
#include "paged_attention_block.h"

/* Row r's scores against the block's first `count` keys (rounded up to 16; the keys past count are zeros), its
 * query in registers: VL keys' dot products at a time, their lanes summed at once. */
static inline __attribute__((always_inline)) void row_scores(const vf *query, int chunks, int count,
                                                             const vf *keys, float *scores) {
    vf q[MAX_DIM / VL];
    for (int c = 0; c < chunks; c++) q[c] = query[c];
    for (int first = 0; first < count; first += VL) {
        vf products[VL];
        for (int j = 0; j < VL; j++) {
            const vf *key = keys + (first + j) * chunks;
            vf dot = q[0] * key[0];
            for (int c = 1; c < chunks; c++) dot += q[c] * key[c];
            products[j] = dot;
        }
        vf sums = lane_sums(products);
        memcpy(&scores[first], &sums, sizeof sums);
    }
}

/* Each row's acc += the weighted sum of the block's values (row r's weights[r]: zero past the keys it sees), the
 * rows in sets whose accumulators fill half the vector registers, so that a value row is read once a set, and the
 * set's rows x chunks independent sums keep the multiply-adds from waiting on each other. */
static inline __attribute__((always_inline)) void rows_values(vf (*acc)[MAX_DIM / VL], int rows, int chunks,
                                                              const int *visible, const vf *values,
                                                              const float *weights, Strides at) {
    enum { REGISTERS = VF_REGISTERS / 2 };
    int set = chunks >= REGISTERS ? 1 : REGISTERS / chunks;
    for (int r0 = 0; r0 < rows; r0 += set) {
        int n = rows - r0 < set ? rows - r0 : set, last = 0;
        for (int r = 0; r < n; r++) last = visible[r0 + r] > last ? visible[r0 + r] : last;
        vf sum[REGISTERS > MAX_DIM / VL ? REGISTERS : MAX_DIM / VL] = {}; /* past the set's rows unused */
        for (int r = 0; r < set; r++)
            for (int c = 0; c < chunks; c++)
                if (r < n) sum[r * chunks + c] = acc[r0 + r][c];
        for (int j = 0; j < last; j++)
            for (int r = 0; r < set; r++)
                if (r < n) {
                    float w = weights[(int64_t)(r0 + r) * at.row + j * at.key];
                    for (int c = 0; c < chunks; c++) sum[r * chunks + c] += w * values[j * chunks + c];
                }
        for (int r = 0; r < set; r++)
            for (int c = 0; c < chunks; c++)
                if (r < n) acc[r0 + r][c] = sum[r * chunks + c];
    }
}

/* A tile's rows (those of requests with several new tokens, tiled()) scored VL at a time: lane i of scores[j][v] is
 * row VL v + i's score against key j, from the rows' scaled queries transposed (dimension d of row r at
 * qt[d * QT_STRIDE + r]) and each key's number broadcast. Row by row, each score is a dot product whose lanes are
 * then summed across the vector (lane_sums); here the sums run down the dimensions in each lane, for as many keys
 * at once as half the registers hold (16 with AVX512, 8 with AVX2; the block's keys are padded to 16). */
static inline __attribute__((always_inline)) void tile_scores(const uint32_t *qt, int chunks, int rows, const vf *keys,
                                                              int count, vf (*scores)[MAX_ROWS / VL]) {
    enum { KEYS = VF_REGISTERS / 2 < 16 ? VF_REGISTERS / 2 : 16 };
    for (int v = 0; v < (rows + VL - 1) / VL; v++)
        for (int first = 0; first < count; first += KEYS) {
            vf sum[KEYS] = {};
            for (int d = 0; d < chunks * VL; d++) {
                vf q = load_f32((const float *)(qt + d * QT_STRIDE + VL * v)); /* the floats' bits */
                for (int j = 0; j < KEYS; j++) sum[j] += q * ((const float *)(keys + (first + j) * chunks))[d];
            }
            for (int j = 0; j < KEYS; j++) scores[first + j][v] = sum[j];
        }
}

/* One KV head's query rows (tokens x group; row r = token r / group) over a block of `count` keys at slots, the
 * block's first key at position `first_pos`; row r sees keys up to position last_pos[r / group]. The block's
 * keys and values are widened once into float buffers, then each row scores them with its query in registers, and
 * the rows take the values in sets. Inlined per head size (chunks), so that those loops have constant bounds. */
static inline __attribute__((always_inline)) void attend_block_sized(
    vf (*query)[MAX_DIM / VL], vf (*acc)[MAX_DIM / VL], float *running_max, float *running_sum,
    const void *k_pool, const void *v_pool, const int64_t *slots, int count, Ahead ahead, int64_t first_pos,
    const int64_t *last_pos, int rows, int64_t pool_slots, int h, int kv_heads, int group, int chunks, int bf16,
    const uint32_t *qt) {
    vf keys[BLOCK * chunks], values[BLOCK * chunks];
    float weights[BLOCK * QT_STRIDE] __attribute__((aligned(64)));
    int visible[MAX_ROWS];
    for (int j = 0; j < count; j++) {
        int64_t slot = checked(slots[j], pool_slots) * kv_heads + h;
        load_row(k_pool, slot, chunks, keys + j * chunks, bf16);
        load_row(v_pool, slot, chunks, values + j * chunks, bf16);
    }
    for (int j = count * chunks; j < ((count + 15) & ~15) * chunks; j++) keys[j] = (vf){};
    rows_visible(visible, rows, group, count, first_pos, last_pos);
    int row_bytes = chunks * VL * (bf16 ? 2 : 4);
    if (qt) {
        for (int j = 0; j < ahead.count; j++)
            prefetch_ahead(ahead, j, k_pool, v_pool, pool_slots, kv_heads, h, row_bytes);
        vf scores[BLOCK][MAX_ROWS / VL];
        tile_scores(qt, chunks, rows, keys, count, scores);
        tile_softmax(scores, visible, rows, count, acc, chunks, running_max, running_sum, weights);
        rows_values(acc, rows, chunks, visible, values, weights, (Strides){1, QT_STRIDE});
        return;
    }
    float (*by_row)[BLOCK] = (float (*)[BLOCK])weights;
    int per_row = (ahead.count + rows - 1) / rows;
    for (int r = 0; r < rows; r++) {
        for (int j = r * per_row; j < (r + 1) * per_row; j++)
            prefetch_ahead(ahead, j, k_pool, v_pool, pool_slots, kv_heads, h, row_bytes);
        if (visible[r]) row_scores(query[r], chunks, visible[r], keys, by_row[r]);
    }
    softmax_rows(by_row, visible, rows, acc, chunks, running_max, running_sum);
    rows_values(acc, rows, chunks, visible, values, weights, (Strides){BLOCK, 1});
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include "paged_attention_bf16.h"
#endif

/* Whether the item's blocks run paged_attention_bf16.h's bfloat16 products: a bfloat16 pool, a head dimension in
 * 32-wide parts, and a CPU with AVX512-BF16. */
static inline int dot_bf16(int bf16, int chunks) {
#ifdef DOT_BF16
    return bf16 && chunks % 2 == 0;
#else
    (void)bf16, (void)chunks;
    return 0;
#endif
}

/* One KV head's rows over a block: paged_attention_bf16.h's bfloat16 products where `dot`, else the float path;
 * inlined per head size, so that their loops have constant bounds. */
static void attend_block(vf (*query)[MAX_DIM / VL], vf (*acc)[MAX_DIM / VL], float *running_max,
                         float *running_sum, const void *k_pool, const void *v_pool, const int64_t *slots, int count,
                         Ahead ahead, int64_t first_pos, const int64_t *last_pos, int rows, int64_t pool_slots, int h,
                         int kv_heads, int group, int chunks, int bf16, int dot, float scale, const uint32_t *qt) {
#ifdef DOT_BF16
#define DOT_SIZED(n)                                                                                          \
    if (dot) {                                                                                                \
        attend_block_dot_sized(query, acc, running_max, running_sum, k_pool, v_pool, slots, count, ahead,       \
                               first_pos, last_pos, rows, pool_slots, h, kv_heads, group, n, scale, qt);        \
        return;                                                                                               \
    }
#else
#define DOT_SIZED(n) (void)dot, (void)scale;
#endif
#define SIZED(n)                                                                                              \
    DOT_SIZED(n)                                                                                              \
    attend_block_sized(query, acc, running_max, running_sum, k_pool, v_pool, slots, count, ahead, first_pos,    \
                       last_pos, rows, pool_slots, h, kv_heads, group, n, bf16, qt)
    switch (chunks) { /* head_dim 16, 32, 64, 128, 256; others with a variable bound */
#if VL == 16
    case 1: SIZED(1); break;
#endif
    case 2: SIZED(2); break;
    case 4: SIZED(4); break;
    case 8: SIZED(8); break;
    case 16: SIZED(16); break;
#if VL == 8
    case 32: SIZED(32); break;
#endif
    default: SIZED(chunks);
    }
#undef SIZED
#undef DOT_SIZED
}

#include "paged_attention_plan.h"

/* Keys [from, to) of one slot table for some of an item's rows: rows [r0, r0 + rows) of each of its n heads' sets
 * of `stride` rows; row r0 + r is of the token whose last position is last_pos[r / group]. qt: the rows' queries
 * transposed (tile_queries), for a tile's rows, else NULL. */
static void attend_keys(const Batch *x, Item it, vf (*query)[MAX_DIM / VL], vf (*acc)[MAX_DIM / VL],
                        float *running_max, float *running_sum, const int64_t *slots, int64_t from, int64_t to,
                        const int64_t *last_pos, int r0, int rows, int stride, const uint32_t *qt) {
    for (int64_t key = from; key < to; key += BLOCK) {
        int count = to - key < BLOCK ? (int)(to - key) : BLOCK;
        Ahead ahead = {slots + key + BLOCK, to - key - count < BLOCK ? (int)(to - key - count) : BLOCK};
        for (int k = 0; k < it.n; k++) {
            int at = k * stride + r0;
            attend_block(query + at, acc + at, running_max + at, running_sum + at, x->k_pool, x->v_pool,
                         slots + key, count, ahead, key, last_pos, rows, x->pool_slots, it.h0 + k, x->kv_heads,
                         x->group, x->chunks, x->bf16, x->dot, x->scale, qt ? qt + at : NULL);
        }
    }
}

/* For the rows of requests with several new tokens (tiled()): their queries transposed into qt, 4-byte element e of
 * row r at e * QT_STRIDE + r (a pair of bfloat16 numbers on the bfloat16 products' path, else a float); else NULL
 * (decode rows, one token a request, keep the row path). */
static const uint32_t *tile_queries(const Batch *x, Item it, const int *order, vf (*query)[MAX_DIM / VL],
                                    int rows, uint32_t *qt) {
    if (!tiled(x, order[it.member])) return NULL;
    int elements = x->chunks * VL / (x->dot ? 2 : 1);
    memset(qt, 0, sizeof(uint32_t) * elements * QT_STRIDE);
    for (int r = 0; r < it.n * rows; r++) {
        const uint32_t *row = (const uint32_t *)query[r];
        for (int e = 0; e < elements; e++) qt[e * QT_STRIDE + r] = row[e];
    }
    return qt;
}

/* The item's queries against their requests' slots up to each token's own position: the shared keys for all
 * rows at once, then each member's own. Token t of the item is row q_row[t] of q and out. */
static void attend_item(const Batch *x, Item it, const int *order) {
    vf query[MAX_ROWS][MAX_DIM / VL], acc[MAX_ROWS][MAX_DIM / VL];
    float running_max[MAX_ROWS], running_sum[MAX_ROWS];
    int64_t last_pos[MAX_ROWS], q_row[MAX_ROWS];
    int first_token[MAX_ROWS + 1], tokens = 0, group = x->group, chunks = x->chunks;
    for (int m = 0; m < it.members; m++) {
        int b = order[it.member + m];
        int first = it.members == 1 ? it.first : 0, count = it.members == 1 ? it.tokens : (int)x->q_counts[b];
        first_token[m] = tokens;
        for (int t = first; t < first + count; t++, tokens++) {
            q_row[tokens] = x->q_starts[b] + t;
            last_pos[tokens] = x->prefix_lens[b] + t;
        }
    }
    first_token[it.members] = tokens;
    int rows = tokens * group;
    for (int k = 0; k < it.n; k++)
        for (int r = 0; r < rows; r++) { /* row r: token r / group, query head (h0 + k) * group + r % group */
            int64_t row = q_row[r / group] * x->heads + (it.h0 + k) * group + r % group;
            vf *qs = query[k * rows + r];
            if (x->dot) { /* the bfloat16 row as it is, in the first half of its place */
                memcpy(qs, (const uint16_t *)x->q + row * chunks * VL, (size_t)chunks * VL * 2);
            } else {
                load_row(x->q, row, chunks, qs, x->bf16);
                for (int c = 0; c < chunks; c++) qs[c] *= x->scale;
            }
            for (int c = 0; c < chunks; c++) acc[k * rows + r][c] = (vf){};
            running_max[k * rows + r] = -3.0e38f;
            running_sum[k * rows + r] = 0.0f;
        }
    uint32_t transposed[MAX_DIM * QT_STRIDE] __attribute__((aligned(64)));
    const uint32_t *qt = tile_queries(x, it, order, query, rows, transposed);
    const int64_t *first_slots = x->slots + (int64_t)order[it.member] * x->table_len;
    attend_keys(x, it, query, acc, running_max, running_sum, first_slots, 0, it.shared, last_pos, 0, rows, rows,
                qt);
    for (int m = 0; m < it.members; m++) {
        int t0 = first_token[m], t1 = first_token[m + 1];
        const int64_t *slots = x->slots + (int64_t)order[it.member + m] * x->table_len;
        attend_keys(x, it, query, acc, running_max, running_sum, slots, it.shared, last_pos[t1 - 1] + 1,
                    last_pos + t0, t0 * group, (t1 - t0) * group, rows, qt);
    }
    for (int k = 0; k < it.n; k++)
        for (int r = 0; r < rows; r++) {
            int i = k * rows + r;
#ifdef DOT_BF16
            if (x->dot) unpermute(acc[i], chunks);
#endif
            float inverse = running_sum[i] > 0.0f ? 1.0f / running_sum[i] : 0.0f;
            for (int c = 0; c < chunks; c++) acc[i][c] *= inverse;
            store_row(x->out, q_row[r / group] * x->heads + (it.h0 + k) * group + r % group, chunks, acc[i],
                      x->bf16);
        }
}

int paged_attention_bf16_products(void) {
#ifdef DOT_BF16
    return 1;
#else
    return 0;
#endif
}

/* The batch paged_attention.h describes (its args); its statuses there. */
int paged_attention(const PagedAttentionArgs *args) {
    int batch = args->batch, heads = args->heads, kv_heads = args->kv_heads, dim = args->dim;
    int threads = args->threads, bf16 = args->bf16;
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim > MAX_DIM || dim <= 0
        || dim % LANES)
        return -1;
    const int64_t *spans = args->spans;
    Batch x = {args->q, args->k_pool, args->v_pool, args->slots, spans, spans + batch, spans + 2 * (int64_t)batch,
               args->table_len, args->pool_slots, heads, kv_heads, heads / kv_heads, dim / VL, bf16,
               dot_bf16(bf16, dim / VL), args->scale, args->out};
    if (batch <= 0) return 0;
    int64_t most = 0;
    for (int b = 0; b < batch; b++) {
        if (x.q_counts[b] < 1 || x.prefix_lens[b] < 0 || x.prefix_lens[b] + x.q_counts[b] > x.table_len) return -2;
        most += x.q_counts[b]; /* a unit has a token at least */
    }
    Item *units = malloc((size_t)most * sizeof(Item)), *items = malloc((size_t)most * kv_heads * sizeof(Item));
    int *order = malloc((size_t)batch * sizeof(int));
    int count = -1;
    if (units && items && order && sort_requests(&x, batch, order) == 0)
        count = plan_items(&x, units, plan_units(&x, batch, order, units), threads, order, items);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
#endif
    for (int i = 0; i < count; i++) attend_item(&x, items[i], order);
    free(units), free(items), free(order);
    return count < 0 ? -3 : 0;
}
