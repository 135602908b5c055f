/* Decode attention read straight from the paged KV pool: one query token per request, each attending to the
 * first seq_len slots of its row of the slot table, without first gathering those K/V rows into a padded block.
 *
 * A gather copies every request's keys and values once per layer and SDPA reads the copy again; at batch 32 with
 * ~550-token contexts that is ~0.8 GB moved per step on the default model, more than its matmuls take. Here each
 * key and value row is read once, where it lies in the pool.
 *
 * One work item is a request and a KV head: its group of query heads (GQA) shares every key and value load.
 * Keys are taken in blocks of BLOCK: scores for the block, then an online softmax (a running maximum and sum,
 * the accumulated values rescaled when the maximum rises), then the block's values. Arithmetic is float32; a
 * bfloat16 pool and queries are widened on load and the output rounded to nearest even, as torch rounds.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64      /* keys scored before their values are read */
#define MAX_GROUP 16  /* query heads per KV head */
#define MAX_QUERIES 64 /* query heads a work item holds */
#define MAX_DIM 256   /* head dimension, a multiple of LANES */
#define LANES 16      /* floats in a vector: one AVX512 register, two AVX2 ones (the compiler splits it) */

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf load_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline float hsum(vf v) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += v[l];
    return sum;
}

/* The lane sums of 16 vectors as one vector (lane j: the sum of v[j]), in 15 shuffle-add steps where 16 separate
 * sums would take ~16 dependent adds each: every round adds the low and high halves of each key's lanes, two
 * vectors at a time, so keys keep their order while their lanes halve (16, 8, 4, 2, 1). */
static inline vf sums16(vf v[16]) {
    static const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    static const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    static const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    static const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    static const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    static const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    static const vi lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    static const vi hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vf eight[8], four[4], two[2];
    for (int i = 0; i < 8; i++)
        eight[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) + __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
    for (int i = 0; i < 4; i++)
        four[i] = __builtin_shuffle(eight[2 * i], eight[2 * i + 1], lo4)
                  + __builtin_shuffle(eight[2 * i], eight[2 * i + 1], hi4);
    for (int i = 0; i < 2; i++)
        two[i] = __builtin_shuffle(four[2 * i], four[2 * i + 1], lo2)
                 + __builtin_shuffle(four[2 * i], four[2 * i + 1], hi2);
    return __builtin_shuffle(two[0], two[1], lo1) + __builtin_shuffle(two[0], two[1], hi1);
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* exp(x) for x <= 0 (scores minus the running maximum), LANES at once: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by Cephes' degree-6 polynomial (relative error ~1e-7, float32's own rounding), 2^n put into the exponent
 * bits. Below -87, exp leaves float32's normal range: 0. */
static inline vf select(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

static inline vf exp_nonpositive(vf x) {
    vi underflows = x < -87.0f;
    vf clamped = select(underflows, (vf){} - 87.0f, x);
    vf n = __builtin_convertvector(__builtin_convertvector(clamped * 1.44269504f - 0.5f, vi), vf);
    vf r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf scale = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return select(underflows, (vf){}, p * scale);
}

/* Row `row` of a [rows, dim] float32 or bfloat16 array as dim / LANES vectors. */
static inline void load_row(const void *base, int64_t row, int chunks, int bf16, vf *out) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + row * chunks * LANES;
        for (int c = 0; c < chunks; c++) out[c] = load_bf16(src + c * LANES);
    } else {
        const float *src = (const float *)base + row * chunks * LANES;
        for (int c = 0; c < chunks; c++) out[c] = load_f32(src + c * LANES);
    }
}

static inline void store_row(void *base, int64_t row, int chunks, int bf16, const vf *in) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)base + row * chunks * LANES;
        for (int c = 0; c < chunks; c++)
            for (int l = 0; l < LANES; l++) dst[c * LANES + l] = float_to_bf16(in[c][l]);
    } else {
        memcpy((float *)base + row * chunks * LANES, in, (size_t)chunks * sizeof(vf));
    }
}

static inline int64_t checked(int64_t slot, int64_t pool_slots) {
    return slot >= 0 && slot < pool_slots ? slot : 0; /* a bad slot reads the reserved slot 0, never past */
}

/* One KV head's queries (group of them, starting at query[0]) over a block of `count` keys at slots: scores,
 * the online softmax's update, then the values. */
static void attend_block(vf (*query)[MAX_DIM / LANES], vf (*acc)[MAX_DIM / LANES], float *running_max,
                         float *running_sum, const void *k_pool, const void *v_pool, const int64_t *slots, int count,
                         int64_t pool_slots, int h, int kv_heads, int group, int chunks, int bf16) {
    float scores[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    vf row[MAX_DIM / LANES];
    for (int first = 0; first < count; first += 16) {
        vf products[MAX_GROUP][16]; /* per query head and key: the lanes of their dot product */
        for (int j = 0; j < 16; j++) {
            if (first + j >= count) {
                for (int g = 0; g < group; g++) products[g][j] = (vf){};
                continue;
            }
            load_row(k_pool, checked(slots[first + j], pool_slots) * kv_heads + h, chunks, bf16, row);
            for (int g = 0; g < group; g++) {
                vf dot = query[g][0] * row[0];
                for (int c = 1; c < chunks; c++) dot += query[g][c] * row[c];
                products[g][j] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            vf sums = sums16(products[g]);
            memcpy(&scores[g][first], &sums, sizeof sums);
        }
    }
    for (int j = count; j < BLOCK; j++)
        for (int g = 0; g < group; g++) scores[g][j] = -3.0e38f; /* exp gives 0 */
    for (int g = 0; g < group; g++) {
        float block_max = scores[g][0];
        for (int j = 1; j < count; j++) block_max = scores[g][j] > block_max ? scores[g][j] : block_max;
        float new_max = block_max > running_max[g] ? block_max : running_max[g];
        float rescale = exp_nonpositive((vf){} + (running_max[g] - new_max))[0];
        vf block_sum = {};
        for (int j = 0; j < BLOCK; j += LANES) {
            vf weights = exp_nonpositive(load_f32(&scores[g][j]) - new_max);
            memcpy(&scores[g][j], &weights, sizeof weights);
            block_sum += weights;
        }
        running_sum[g] = running_sum[g] * rescale + hsum(block_sum);
        running_max[g] = new_max;
        for (int c = 0; c < chunks; c++) acc[g][c] *= rescale;
    }
    for (int j = 0; j < count; j++) {
        load_row(v_pool, checked(slots[j], pool_slots) * kv_heads + h, chunks, bf16, row);
        for (int g = 0; g < group; g++)
            for (int c = 0; c < chunks; c++) acc[g][c] += scores[g][j] * row[c];
    }
}

/* Request b's KV heads h0 .. h0 + n - 1 (queries q[b, h * group + g]) against its first len slots. The heads take
 * each block of keys in turn, so a slot's row, all heads side by side in the pool, is read from memory once. */
static void attend_request(const void *q, const void *k_pool, const void *v_pool, const int64_t *slots,
                           int64_t len, int64_t pool_slots, int b, int h0, int n, int heads, int kv_heads, int group,
                           int chunks, float scale, int bf16, void *out) {
    vf query[MAX_QUERIES][MAX_DIM / LANES], acc[MAX_QUERIES][MAX_DIM / LANES];
    float running_max[MAX_QUERIES], running_sum[MAX_QUERIES];
    int queries = n * group;
    for (int i = 0; i < queries; i++) {
        load_row(q, (int64_t)b * heads + h0 * group + i, chunks, bf16, query[i]);
        for (int c = 0; c < chunks; c++) {
            query[i][c] *= scale;
            acc[i][c] = (vf){};
        }
        running_max[i] = -3.0e38f;
        running_sum[i] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += BLOCK) {
        int count = len - start < BLOCK ? (int)(len - start) : BLOCK;
        for (int k = 0; k < n; k++)
            attend_block(query + k * group, acc + k * group, running_max + k * group, running_sum + k * group,
                         k_pool, v_pool, slots + start, count, pool_slots, h0 + k, kv_heads, group, chunks, bf16);
    }
    for (int i = 0; i < queries; i++) {
        float inverse = running_sum[i] > 0.0f ? 1.0f / running_sum[i] : 0.0f;
        for (int c = 0; c < chunks; c++) acc[i][c] *= inverse;
        store_row(out, (int64_t)b * heads + h0 * group + i, chunks, bf16, acc[i]);
    }
}

/* q and out [batch, heads, dim]; k_pool and v_pool [pool_slots, kv_heads, dim]; slots [batch, table_len] (row b's
 * first seq_lens[b] entries are its KV slots); all float32, or all bfloat16 when bf16. A work item is a request
 * and as many of its KV heads as MAX_QUERIES queries allow; below two items a thread, one KV head, so that a
 * small batch still keeps every thread busy. Returns 0, or -1 when the shapes are beyond this file's limits
 * (the caller checks them first). */
int paged_decode_attention(const void *q, const void *k_pool, const void *v_pool, int64_t pool_slots,
                           const int64_t *slots, const int64_t *seq_lens, int batch, int64_t table_len, int heads,
                           int kv_heads, int dim, float scale, int bf16, void *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim > MAX_DIM || dim <= 0
        || dim % LANES)
        return -1;
    int group = heads / kv_heads, chunks = dim / LANES;
    int per_item = batch >= 2 * threads ? MAX_QUERIES / group : 1;
    per_item = per_item < kv_heads ? per_item : kv_heads;
    int items_per_request = (kv_heads + per_item - 1) / per_item;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int item = 0; item < batch * items_per_request; item++) {
        int b = item / items_per_request, h0 = item % items_per_request * per_item;
        int n = kv_heads - h0 < per_item ? kv_heads - h0 : per_item;
        int64_t len = seq_lens[b] < table_len ? seq_lens[b] : table_len;
        attend_request(q, k_pool, v_pool, slots + (int64_t)b * table_len, len, pool_slots, b, h0, n, heads,
                       kv_heads, group, chunks, scale, bf16, out);
    }
    return 0;
}
