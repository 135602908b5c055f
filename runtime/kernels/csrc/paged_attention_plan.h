/* paged_attention.c's work items and how a batch is cut into them (the build's key hashes this file with it): each
 * request's new tokens in tiles, except that requests sharing a cached prefix of at least BLOCK slots are found
 * (sorted by their first slot, so that they lie side by side) and made items together where their rows fit. */
#ifndef FURCATE_PAGED_ATTENTION_PLAN_H
#define FURCATE_PAGED_ATTENTION_PLAN_H

#include <stdint.h>
#include <stdlib.h>

#include "paged_attention.h"

/* What one work item covers, KV heads h0 .. h0+n-1 of either
 * - one request's new tokens from its token `first` on, `tokens` of them (members 1, shared 0), or
 * - a shared-prefix group: all the new tokens of `members` requests whose first `shared` KV slots are the same
 *   cached slots. The group's rows take those keys together, so each shared key and value row is read once for
 *   all of them, then each member's rows go on alone over its own keys. `shared` is a multiple of BLOCK, so every
 *   row meets the same blocks of keys as it would alone: the result is the same to the bit.
 * The requests are order[member .. member + members - 1]. */
typedef struct {
    int member, members, first, tokens, h0, n;
    int64_t shared;
} Item;

/* The batch's tensors as paged_attention() takes them. */
typedef struct {
    const void *q, *k_pool, *v_pool;
    const int64_t *slots, *q_starts, *q_counts, *prefix_lens;
    int64_t table_len, pool_slots;
    int heads, kv_heads, group, chunks, bf16, dot;
    float scale;
    void *out;
} Batch;

/* Whether request b's rows are scored as a tile, VL rows across a vector's lanes (several new tokens: a prefill's),
 * not row by row. A request's rows take one path wherever they are planned, so a request gets the same alone as
 * beside others. */
static int tiled(const Batch *x, int b) { return x->q_counts[b] > 1; }

/* How many leading slots requests a and b share, up to `most` (cached slots only: no new token's). */
static int64_t common_slots(const Batch *x, int a, int b, int64_t most) {
    const int64_t *sa = x->slots + (int64_t)a * x->table_len, *sb = x->slots + (int64_t)b * x->table_len;
    int64_t n = x->prefix_lens[a] < x->prefix_lens[b] ? x->prefix_lens[a] : x->prefix_lens[b];
    n = n < most ? n : most;
    int64_t i = 0;
    while (i < n && sa[i] == sb[i]) i++;
    return i;
}

/* A request and its first KV slot, to sort by. */
typedef struct {
    int64_t slot;
    int b;
} Lead;

static int by_first_slot(const void *a, const void *b) {
    const Lead *x = a, *y = b;
    return x->slot < y->slot ? -1 : x->slot > y->slot ? 1 : x->b - y->b;
}

/* order: the requests sorted by their first KV slot, so that those sharing a prefix lie side by side. */
static int sort_requests(const Batch *x, int batch, int *order) {
    Lead *leads = malloc((size_t)batch * sizeof(Lead));
    if (leads == NULL) return -1;
    for (int b = 0; b < batch; b++) leads[b] = (Lead){x->slots[(int64_t)b * x->table_len], b};
    qsort(leads, (size_t)batch, sizeof *leads, by_first_slot);
    for (int i = 0; i < batch; i++) order[i] = leads[i].b;
    free(leads);
    return 0;
}

/* The work units of a batch, as items with every KV head (h0 and n not set): each group of requests sharing at
 * least BLOCK cached slots whose new tokens fit MAX_ROWS rows together, then each other request's new tokens in
 * tiles. Returns how many. */
static int plan_units(const Batch *x, int batch, const int *order, Item *units) {
    int tile = MAX_ROWS / x->group < MAX_TILE ? MAX_ROWS / x->group : MAX_TILE, count = 0;
    for (int i = 0; i < batch;) {
        int64_t shared = INT64_MAX, rows = x->q_counts[order[i]] * x->group;
        int j = i + 1;
        for (; j < batch && rows <= MAX_ROWS; j++) {
            int64_t common = common_slots(x, order[j - 1], order[j], shared) / BLOCK * BLOCK;
            rows += x->q_counts[order[j]] * x->group;
            if (rows > MAX_ROWS || common < BLOCK || tiled(x, order[j]) != tiled(x, order[i])) break;
            shared = common;
        }
        if (j - i >= 2) {
            units[count++] = (Item){i, j - i, 0, 0, 0, 0, shared};
        } else {
            int64_t tokens = x->q_counts[order[i]];
            for (int first = 0; first < tokens; first += tile)
                units[count++] = (Item){i, 1, first, tokens - first < tile ? (int)(tokens - first) : tile, 0, 0, 0};
        }
        i = j;
    }
    return count;
}

/* Query rows a unit holds per KV head. */
static int unit_rows(const Batch *x, Item unit, const int *order) {
    if (unit.members == 1) return unit.tokens * x->group;
    int rows = 0;
    for (int m = 0; m < unit.members; m++) rows += (int)x->q_counts[order[unit.member + m]] * x->group;
    return rows;
}

/* The items of a batch: each unit with as many KV heads as MAX_ROWS rows allow, but one KV head an item where
 * fewer than two units a thread would come of it (a small decode batch), so that every thread has work. Returns
 * how many were written into items (room for every token and KV head). */
static int plan_items(const Batch *x, const Item *units, int count, int threads, const int *order, Item *items) {
    int per_item = count >= 2 * threads ? x->kv_heads : 1, written = 0;
    for (int u = 0; u < count; u++) {
        Item item = units[u];
        int heads_fit = MAX_ROWS / unit_rows(x, item, order), n = per_item < heads_fit ? per_item : heads_fit;
        for (item.h0 = 0; item.h0 < x->kv_heads; item.h0 += n) {
            item.n = x->kv_heads - item.h0 < n ? x->kv_heads - item.h0 : n;
            items[written++] = item;
        }
    }
    return written;
}

#endif
