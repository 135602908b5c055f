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

/* Request b's KV head h: queries q[b, h * group + g] (g < group) against the request's first len slots. */
static void attend_one(const void *q, const void *k_pool, const void *v_pool, const int64_t *slots, int64_t len,
                       int64_t pool_slots, int b, int h, int heads, int kv_heads, int group, int chunks,
                       float scale, int bf16, void *out) {
    vf query[MAX_GROUP][MAX_DIM / LANES], acc[MAX_GROUP][MAX_DIM / LANES], row[MAX_DIM / LANES];
    float scores[MAX_GROUP][BLOCK] __attribute__((aligned(64)));
    float running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        load_row(q, (int64_t)b * heads + h * group + g, chunks, bf16, query[g]);
        for (int c = 0; c < chunks; c++) {
            query[g][c] *= scale;
            acc[g][c] = (vf){};
        }
        running_max[g] = -3.0e38f;
        running_sum[g] = 0.0f;
    }
    for (int64_t start = 0; start < len; start += BLOCK) {
        int count = len - start < BLOCK ? (int)(len - start) : BLOCK;
        for (int j = 0; j < count; j++) {
            load_row(k_pool, checked(slots[start + j], pool_slots) * kv_heads + h, chunks, bf16, row);
            for (int g = 0; g < group; g++) {
                vf dot = query[g][0] * row[0];
                for (int c = 1; c < chunks; c++) dot += query[g][c] * row[c];
                scores[g][j] = hsum(dot);
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
            load_row(v_pool, checked(slots[start + j], pool_slots) * kv_heads + h, chunks, bf16, row);
            for (int g = 0; g < group; g++)
                for (int c = 0; c < chunks; c++) acc[g][c] += scores[g][j] * row[c];
        }
    }
    for (int g = 0; g < group; g++) {
        float inverse = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
        for (int c = 0; c < chunks; c++) acc[g][c] *= inverse;
        store_row(out, (int64_t)b * heads + h * group + g, chunks, bf16, acc[g]);
    }
}

/* q and out [batch, heads, dim]; k_pool and v_pool [pool_slots, kv_heads, dim]; slots [batch, table_len] (row b's
 * first seq_lens[b] entries are its KV slots); all float32, or all bfloat16 when bf16. Returns 0, or -1 when the
 * shapes are beyond this file's fixed limits (the caller checks them first). */
int paged_decode_attention(const void *q, const void *k_pool, const void *v_pool, int64_t pool_slots,
                           const int64_t *slots, const int64_t *seq_lens, int batch, int64_t table_len, int heads,
                           int kv_heads, int dim, float scale, int bf16, void *out, int threads) {
    if (kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_GROUP || dim > MAX_DIM || dim <= 0
        || dim % LANES)
        return -1;
    int group = heads / kv_heads, chunks = dim / LANES;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int item = 0; item < batch * kv_heads; item++) {
        int b = item / kv_heads;
        int64_t len = seq_lens[b] < table_len ? seq_lens[b] : table_len;
        attend_one(q, k_pool, v_pool, slots + (int64_t)b * table_len, len, pool_slots, b, item % kv_heads, heads,
                   kv_heads, group, chunks, scale, bf16, out);
    }
    return 0;
}
