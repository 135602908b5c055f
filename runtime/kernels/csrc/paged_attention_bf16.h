/* paged_attention.c's block of keys for bfloat16 pools on CPUs with AVX512-BF16 (included there where the build
 * targets AVX512-BF16 and AVX512BW; the build's key hashes this file with it).
 *
 * The float path widens every key and value to float32 and multiplies in float32. Here both products run on the
 * pool's own bfloat16 numbers with vdpbf16ps (pairs of bfloat16 products summed into float32):
 * - scores: query . key over bfloat16 pairs of the head dimension. A product of two bfloat16 is exact in float32,
 *   so the scores are the float path's up to the order of their float32 sums; the scale multiplies them after.
 * - values: two keys' values are interleaved so that a pair of weights meets a pair of values, and each float32
 *   softmax weight is split into two bfloat16 parts, the weight rounded and what the rounding left out, so the
 *   values are weighed to ~2**-17 of the float32 weights, not bfloat16's 2**-9 (torch's bfloat16 SDPA rounds them
 *   once; rounding once here moved the default model's greedy bfloat16 output further from float32's). The
 *   accumulators' lanes hold the head dimension in unpack order (unpermute() restores it once, at the end).
 * The results are the float path's up to the order of float32 sums, for less work a key: no key is widened, and
 * only the values are copied, interleaved. */
#ifndef FURCATE_PAGED_ATTENTION_BF16_H
#define FURCATE_PAGED_ATTENTION_BF16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "paged_attention.h"
#include "paged_attention_block.h"
#include "paged_attention_vec.h"

#define DOT_BF16 1

static const uint16_t ZERO_ROW[MAX_DIM] __attribute__((aligned(64))) = {0};

/* Row r's scores against 16 keys at a time, its bfloat16 query in registers (halves: 32-wide parts of a row). */
static inline __attribute__((always_inline)) void row_scores_dot(const __m512i *query, int halves, int visible,
                                                                 const uint16_t *const *keys, float scale,
                                                                 float *scores) {
    __m512i q[MAX_DIM / 32];
    for (int i = 0; i < halves; i++) q[i] = query[i];
    for (int first = 0; first < visible; first += 16) {
        vf products[16];
        for (int j = 0; j < 16; j++) {
            __m512 dot = _mm512_setzero_ps();
            for (int i = 0; i < halves; i++)
                dot = _mm512_dpbf16_ps(dot, (__m512bh)q[i], (__m512bh)_mm512_loadu_si512(keys[first + j] + 32 * i));
            products[j] = (vf)dot;
        }
        vf sums = lane_sums(products) * scale;
        memcpy(&scores[first], &sums, sizeof sums);
    }
}

/* Keys 2p and 2p + 1's values interleaved, bfloat16 by bfloat16, as `chunks` vectors of pairs (unpacking within
 * 128-bit lanes: the low vector of each 32-wide part holds its dimensions 0-3, 8-11, 16-19, 24-27); the next block's
 * rows 2p and 2p + 1 of head h asked for on the way (prefetch_ahead). */
static inline void pair_values(const uint16_t *const *values, int count, int halves, __m512i *pairs, Ahead ahead,
                               const void *k_pool, const void *v_pool, int64_t pool_slots, int kv_heads, int h) {
    for (int p = 0; p < (count + 1) / 2; p++) {
        prefetch_ahead(ahead, 2 * p, k_pool, v_pool, pool_slots, kv_heads, h, halves * 64);
        prefetch_ahead(ahead, 2 * p + 1, k_pool, v_pool, pool_slots, kv_heads, h, halves * 64);
        for (int i = 0; i < halves; i++) {
            __m512i a = _mm512_loadu_si512(values[2 * p] + 32 * i), b = _mm512_loadu_si512(values[2 * p + 1] + 32 * i);
            pairs[(p * halves + i) * 2] = _mm512_unpacklo_epi16(a, b);
            pairs[(p * halves + i) * 2 + 1] = _mm512_unpackhi_epi16(a, b);
        }
    }
}

/* A row's BLOCK weights as BLOCK / 2 pairs of bfloat16, twice: each weight rounded to bfloat16 (high), and what
 * that rounding left out, rounded again (low). high + low is the float32 weight to ~2**-17 of itself, where high
 * alone would be 2**-9 off. */
static inline void pair_weights(const float *w, uint32_t *high, uint32_t *low) {
    for (int j = 0; j < BLOCK; j += 32) {
        __m512 first = _mm512_loadu_ps(w + j), second = _mm512_loadu_ps(w + j + 16);
        __m512bh rounded = _mm512_cvtne2ps_pbh(second, first);
        __m512i bits = (__m512i)rounded; /* back to float32: a bfloat16 is the top half of its float32 */
        __m512 first_kept = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
        __m512 second_kept = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
        __m512bh rest = _mm512_cvtne2ps_pbh(_mm512_sub_ps(second, second_kept), _mm512_sub_ps(first, first_kept));
        _mm512_storeu_si512(high + j / 2, bits);
        _mm512_storeu_si512(low + j / 2, (__m512i)rest);
    }
}

/* rows_values over interleaved values: each row's pair of weights times a pair of values, in sets of rows whose
 * accumulators fit in 16 registers. */
static inline __attribute__((always_inline)) void rows_values_dot(vf (*acc)[MAX_DIM / VL], int rows, int chunks,
                                                                  const int *visible, const __m512i *pairs,
                                                                  const uint32_t *high, const uint32_t *low,
                                                                  Strides at) {
    enum { REGISTERS = 16 };
    int set = chunks >= REGISTERS ? 1 : REGISTERS / chunks;
    for (int r0 = 0; r0 < rows; r0 += set) {
        int n = rows - r0 < set ? rows - r0 : set, last = 0;
        for (int r = 0; r < n; r++) last = visible[r0 + r] > last ? visible[r0 + r] : last;
        __m512 sum[REGISTERS] = {}; /* those past the set's rows unused */
        for (int r = 0; r < set; r++)
            for (int c = 0; c < chunks; c++)
                if (r < n) sum[r * chunks + c] = (__m512)acc[r0 + r][c];
        for (int p = 0; p < (last + 1) / 2; p++)
            for (int r = 0; r < set; r++)
                if (r < n) {
                    int64_t i = (int64_t)(r0 + r) * at.row + p * at.key;
                    __m512bh w = (__m512bh)_mm512_set1_epi32((int)high[i]);
                    __m512bh rest = (__m512bh)_mm512_set1_epi32((int)low[i]);
                    for (int c = 0; c < chunks; c++) {
                        __m512bh v = (__m512bh)pairs[p * chunks + c];
                        sum[r * chunks + c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(sum[r * chunks + c], w, v), rest, v);
                    }
                }
        for (int r = 0; r < set; r++)
            for (int c = 0; c < chunks; c++)
                if (r < n) acc[r0 + r][c] = (vf)sum[r * chunks + c];
    }
}

/* A tile of one request's tokens (prefill) takes a block of keys transposed: lane i of scores[j][v] is row 16v + i's
 * score against key j. Row by row, each score is a dot product's 16 lanes summed across the vector (lane_sums), and a
 * key is loaded once a row; transposed, each row's query pairs lie across 16 rows' lanes (qt), each key's pair is
 * broadcast, and the sums run down the pairs in each lane: no lane sums, a key's pairs read once for 16 rows. The
 * softmax runs across the lanes too, its maxima and sums by vector. Sums in another order than the rows' own, so the
 * results are the row path's up to float32 rounding; decode rows (one token a request) keep the row path, so a
 * request's decode reads the same alone as in a group. */

static inline __attribute__((always_inline)) void tile_scores_dot(const uint32_t *qt, int halves, int rows,
                                                                  const uint16_t *const *keys, int count,
                                                                  float scale, vf (*scores)[MAX_ROWS / VL]) {
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int v = 0; v < (rows + 15) / 16; v++)
        for (int first = 0; first < count; first += 16) {
            __m512 sum[16];
            for (int j = 0; j < 16; j++) sum[j] = _mm512_setzero_ps();
            for (int p = 0; p < halves * 16; p++) {
                __m512bh q = (__m512bh)_mm512_loadu_si512(qt + p * QT_STRIDE + 16 * v);
                for (int j = 0; j < 16; j++) {
                    const uint32_t *key = (const uint32_t *)keys[first + j];
                    sum[j] = _mm512_dpbf16_ps(sum[j], q, (__m512bh)_mm512_set1_epi32((int)key[p]));
                }
            }
            for (int j = 0; j < 16; j++) scores[first + j][v] = (vf)_mm512_mul_ps(sum[j], scaled);
        }
}

/* Weights w (float32) as bfloat16, widened again. */
static inline __m512 rounded_back(__m256bh w) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)w), 16));
}

/* Two keys' weights for 16 rows as pairs of bfloat16 (pair_weights' high and low parts, lane by lane). */
static inline void tile_pair(__m512 even, __m512 odd, uint32_t *high, uint32_t *low) {
    __m256bh high_even = _mm512_cvtneps_pbh(even), high_odd = _mm512_cvtneps_pbh(odd);
    __m256bh low_even = _mm512_cvtneps_pbh(_mm512_sub_ps(even, rounded_back(high_even)));
    __m256bh low_odd = _mm512_cvtneps_pbh(_mm512_sub_ps(odd, rounded_back(high_odd)));
    __m512i h = _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)high_even),
                                _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)high_odd), 16));
    __m512i l = _mm512_or_si512(_mm512_cvtepu16_epi32((__m256i)low_even),
                                _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)low_odd), 16));
    _mm512_storeu_si512(high, h);
    _mm512_storeu_si512(low, l);
}

/* A tile's softmax weights (tile_softmax's, key by key) as bfloat16 pairs, pair p of row r at p * QT_STRIDE + r. */
static inline void tile_pairs(const float *weights, int rows, int count, uint32_t *high, uint32_t *low) {
    for (int v = 0; v < (rows + 15) / 16; v++)
        for (int p = 0; p < (count + 1) / 2; p++) {
            int at = p * QT_STRIDE + 16 * v;
            __m512 even = _mm512_loadu_ps(weights + 2 * p * QT_STRIDE + 16 * v);
            __m512 odd = 2 * p + 1 < count ? _mm512_loadu_ps(weights + (2 * p + 1) * QT_STRIDE + 16 * v)
                                           : _mm512_setzero_ps();
            tile_pair(even, odd, high + at, low + at);
        }
}

/* GCC (12, at -O3) takes visible and the tile's weights for uninitialized where they reach the softmax and
 * tile_pairs by pointer: rows_visible and tile_softmax write every element those read, which it cannot follow
 * through the inlined loops. Zeroing the weights first would cost a 16 KiB store a block. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/* attend_block_sized for a bfloat16 pool: the same rows, keys and softmax; query[r] holds row r's bfloat16 query
 * (unscaled) in its first halves vectors, and where qt is given (a tile's rows) the same pairs transposed, pair p of
 * row r at qt[p * QT_STRIDE + r]. */
static inline __attribute__((always_inline)) void attend_block_dot_sized(
    vf (*query)[MAX_DIM / VL], vf (*acc)[MAX_DIM / VL], float *running_max, float *running_sum,
    const void *k_pool, const void *v_pool, const int64_t *slots, int count, Ahead ahead, int64_t first_pos,
    const int64_t *last_pos, int rows, int64_t pool_slots, int h, int kv_heads, int group, int chunks, float scale,
    const uint32_t *qt) {
    int halves = chunks / 2, dim = chunks * VL;
    const uint16_t *keys[BLOCK + 1], *values[BLOCK + 1]; /* past count: a row of zeros */
    for (int j = 0; j <= BLOCK; j++) {
        int64_t row = j < count ? checked(slots[j], pool_slots) * kv_heads + h : -1;
        keys[j] = row < 0 ? ZERO_ROW : (const uint16_t *)k_pool + row * dim;
        values[j] = row < 0 ? ZERO_ROW : (const uint16_t *)v_pool + row * dim;
    }
    __m512i pairs[BLOCK / 2 * chunks];
    pair_values(values, count, halves, pairs, ahead, k_pool, v_pool, pool_slots, kv_heads, h);
    uint32_t high[BLOCK / 2 * QT_STRIDE] __attribute__((aligned(64))), low[BLOCK / 2 * QT_STRIDE]
        __attribute__((aligned(64)));
    int visible[MAX_ROWS];
    rows_visible(visible, rows, group, count, first_pos, last_pos);
    if (qt) {
        vf scores[BLOCK][MAX_ROWS / VL];
        float weights[BLOCK * QT_STRIDE] __attribute__((aligned(64)));
        tile_scores_dot(qt, halves, rows, keys, count, scale, scores);
        tile_softmax(scores, visible, rows, count, acc, chunks, running_max, running_sum, weights);
        tile_pairs(weights, rows, count, high, low);
        rows_values_dot(acc, rows, chunks, visible, pairs, high, low, (Strides){1, QT_STRIDE});
        return;
    }
    float weights[MAX_ROWS][BLOCK] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++)
        if (visible[r]) row_scores_dot((const __m512i *)query[r], halves, visible[r], keys, scale, weights[r]);
    softmax_rows(weights, visible, rows, acc, chunks, running_max, running_sum);
    for (int r = 0; r < rows; r++) pair_weights(weights[r], high + r * BLOCK / 2, low + r * BLOCK / 2);
    rows_values_dot(acc, rows, chunks, visible, pairs, high, low, (Strides){BLOCK / 2, 1});
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* An accumulator row in the head dimension's order again: each 32-wide part's two vectors from unpack order. */
static inline void unpermute(vf *row, int chunks) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < chunks; c += 2) {
        __m512 low = (__m512)row[c], high = (__m512)row[c + 1];
        row[c] = (vf)_mm512_permutex2var_ps(low, first, high);
        row[c + 1] = (vf)_mm512_permutex2var_ps(low, second, high);
    }
}

#endif
