/* y = x W^T for a few rows of x against GGUF-style block-quantized weights, with the activations quantized to
 * int8 per group of 32 as llama.cpp does (its Q8 side of a Q4 dot product), so the inner product is an integer
 * one: AVX512-VNNI's vpdpbusd (unsigned weight x signed activation bytes, four products a lane) where the CPU has
 * it, AVX2's vpmaddubsw elsewhere, plain C on other CPUs.
 *
 * Weights: w[n, k] = u[n, k] * scale[n, g] + offset[n, g], g = k / 32, u unsigned (4-bit: 0..15; 8-bit: Q8_0's
 * signed q plus 128, its offset -128 * scale); each pair has (scale A, scale B, offset A, offset B) as float16 (GGUF's
 * own precision for Q4_0, Q4_1 and Q8_0; Q4_K's products round once). Symmetric rows (Q4_0, Q8_0: the offset is
 * always -2^(bits-1) scales) store only (scale A, scale B), so a row reads what the GGUF holds: 4.5 bits a weight
 * for Q4_0 where stored offsets would make it 5, 8.5 for Q8_0 where they would make it 9. Rows are stored in pairs of groups (64 weights), their bytes in
 * "position" order: position j holds the weight at k = 32 * (lane & 1) + 4 * (lane >> 1) + (j & 3), lane = j / 4,
 * so 4-byte lanes alternate between the pair's two groups and one vector of products carries both groups, each
 * lane's sum belonging to one group's scale. 4-bit rows hold position j in the low nibble of byte j and position
 * j + 32 in its high nibble (32 bytes a pair); 8-bit rows one byte a position (64 bytes a pair).
 *
 * Per group of a row of x: t = 127 x / max |x| is written as two int8 digits, first = round(t) and second =
 * round(128 (t - first)), so the activations keep about 15 bits (bfloat16 keeps 8; one int8 digit, llama.cpp's
 * Q8, about 7 and measurably moved the default model's greedy output), at one more integer dot product a pair:
 * y = sum_g scale_g * dx_g * (u . (128 first + second))_g + offset_g * sum_g(x), dx = max |x| / (127 * 128).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "block_gemv.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define LANES 16
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define LANES 8
#else
#define LANES 2
#endif
#define PREFETCH 8 /* pairs ahead */
/* Activations as two int8 digits: x / dx = first + second / DIGIT, dx = max |x| / 127 a group. */
#define DIGIT_BITS 7
#define DIGIT (1 << DIGIT_BITS)

int block_gemv_isa(void) { return LANES == 16 ? 2 : LANES == 8 ? 1 : 0; }

/* Bytes of float16 factors a row keeps per pair: two scales, and two offsets unless the rows are symmetric. */
static inline int factor_bytes(int symmetric) { return symmetric ? 4 : 8; }

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch rounds */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* One row of x (K floats or bfloat16s) -> xq in position order; per pair, LANES floats of dx and of group sums,
 * each lane carrying its group's (the sums divided by the lanes a group has, which add back up at the row's end). */
#if LANES == 16
static inline __m512 load16(const void *x_row, int x_bf16, int k) {
    if (!x_bf16) return _mm512_loadu_ps((const float *)x_row + k);
    __m256i b = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x_row + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

static void quantize_row(const void *x_row, int x_bf16, int K, int8_t *xq, float *dx_lanes, float *sum_lanes) {
    const __m512i interleave = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m512 alternate = _mm512_castsi512_ps(_mm512_set1_epi64(0xffffffff));
    for (int p = 0; p < K / 64; p++) {
        __m512 v[4], dx[2], inverse[2], sum[2];
        __m128i bytes[8];
        for (int i = 0; i < 4; i++) v[i] = load16(x_row, x_bf16, 64 * p + 16 * i);
        for (int h = 0; h < 2; h++) {
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[2 * h]), _mm512_abs_ps(v[2 * h + 1])));
            float s = _mm512_reduce_add_ps(_mm512_add_ps(v[2 * h], v[2 * h + 1]));
            dx[h] = _mm512_set1_ps(amax / 127.f / DIGIT);
            inverse[h] = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            sum[h] = _mm512_set1_ps(s / (LANES / 2));
        }
        for (int i = 0; i < 4; i++) {
            __m512 t = _mm512_mul_ps(v[i], inverse[i >> 1]);
            __m512 first = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            bytes[i] = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(first));
            bytes[4 + i] = _mm512_cvtsepi32_epi8(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(t, first), _mm512_set1_ps(DIGIT))));
        }
        for (int digit = 0; digit < 2; digit++) {
            __m128i *b = bytes + 4 * digit;
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(b[1], b[0])),
                                           _mm256_set_m128i(b[3], b[2]), 1);
            _mm512_storeu_si512(xq + 128 * p + 64 * digit, _mm512_permutexvar_epi32(interleave, q));
        }
        /* lane l carries group l & 1 (A in even lanes) */
        _mm512_storeu_ps(dx_lanes + 16 * p, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
            _mm512_castps_si512(alternate), _mm512_castps_si512(dx[0]), _mm512_castps_si512(dx[1]), 0xca)));
        _mm512_storeu_ps(sum_lanes + 16 * p, _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
            _mm512_castps_si512(alternate), _mm512_castps_si512(sum[0]), _mm512_castps_si512(sum[1]), 0xca)));
    }
}
#else
/* Only this path reads x one number at a time and computes positions (the AVX512 one permutes whole vectors):
 * defined here, where clang would otherwise warn of unused functions. */
static inline int position_k(int j) {
    int lane = j >> 2;
    return 32 * (lane & 1) + 4 * (lane >> 1) + (j & 3);
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float load_x(const void *x_row, int x_bf16, int k) {
    return x_bf16 ? bf16_to_float(((const uint16_t *)x_row)[k]) : ((const float *)x_row)[k];
}

static void quantize_row(const void *x_row, int x_bf16, int K, int8_t *xq, float *dx_lanes, float *sum_lanes) {
    for (int p = 0; p < K / 64; p++) {
        float x[64], dx[2], inverse[2], sum[2];
        for (int k = 0; k < 64; k++) x[k] = load_x(x_row, x_bf16, 64 * p + k);
        for (int h = 0; h < 2; h++) {
            const float *group = x + 32 * h;
            float amax = 0.f, s = 0.f;
            for (int i = 0; i < 32; i++) {
                float a = fabsf(group[i]);
                amax = a > amax ? a : amax;
                s += group[i];
            }
            dx[h] = amax / 127.f / DIGIT;
            inverse[h] = amax > 0.f ? 127.f / amax : 0.f;
            sum[h] = s / (LANES / 2);
        }
        for (int j = 0; j < 64; j++) {
            int k = position_k(j);
            float t = x[k] * inverse[k >> 5], first = rintf(t);
            xq[128 * p + j] = (int8_t)first;
            xq[128 * p + 64 + j] = (int8_t)lrintf((t - first) * DIGIT);
        }
        for (int l = 0; l < LANES; l++) {
            dx_lanes[LANES * p + l] = dx[l & 1];
            sum_lanes[LANES * p + l] = sum[l & 1];
        }
    }
}
#endif

#if LANES > 2
/* One row's float16 factors of a pair as floats: (scale A, scale B, offset A, offset B), or only the two scales (in
 * the low half) where the rows are symmetric. */
static inline __m128 pair_factors(const uint8_t *factors, int symmetric) {
    if (!symmetric) return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)factors));
    int32_t raw;
    memcpy(&raw, factors, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(raw));
}
#endif

#if LANES == 16
/* Both groups' integer dot products of a pair, lanes alternating between them. */
static inline __m512i pair_dot(const uint8_t *w, int bits, __m512i first, __m512i second) {
    __m512i u;
    if (bits == 4) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)w), low = _mm256_set1_epi8(15);
        __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    } else {
        u = _mm512_loadu_si512(w);
    }
    __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, first), DIGIT_BITS);
    return _mm512_dpbusd_epi32(high, u, second);
}

/* acc + one row's pair: scale * dx * dot + offset * sum per group. A symmetric row's offset is -zero scales, so
 * that is scale * (dx * dot - zero * sum), zero * sum computed once a pair for all rows (zsums). */
static inline __m512 accumulate(__m512 acc, __m512 dot, const uint8_t *factors, int symmetric, __m512 dx,
                                __m512 sums, __m512 zsums) {
    __m128 so = pair_factors(factors, symmetric);
    __m512 s = _mm512_broadcast_f32x2(so);
    if (symmetric) return _mm512_fmadd_ps(s, _mm512_fmsub_ps(dot, dx, zsums), acc);
    __m512 o = _mm512_broadcast_f32x2(_mm_movehl_ps(so, so));
    return _mm512_fmadd_ps(o, sums, _mm512_fmadd_ps(dot, _mm512_mul_ps(s, dx), acc));
}

static inline __attribute__((always_inline)) void dot_rows(const uint8_t *block, int P, int bits, int symmetric,
                                                          const int8_t *xq, const float *dx_lanes,
                                                          const float *sum_lanes, float *result) {
    int pair_bytes = 8 * bits, factors = factor_bytes(symmetric), stride = ROWS * (pair_bytes + factors);
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        /* The hardware prefetcher stalls at each 4 KiB page of a cold stream; ask a few pairs ahead. */
        for (int line = 0; line < stride; line += 64) _mm_prefetch((const char *)block + (size_t)(p + PREFETCH) * stride + line, _MM_HINT_T0);
        __m512i first = _mm512_loadu_si512(xq + 128 * p), second = _mm512_loadu_si512(xq + 128 * p + 64);
        __m512 dx = _mm512_loadu_ps(dx_lanes + 16 * p), sums = _mm512_loadu_ps(sum_lanes + 16 * p);
        __m512 zsums = _mm512_mul_ps(sums, _mm512_set1_ps((float)(1 << (bits - 1))));
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *pair = block + (size_t)p * stride;
            __m512 dot = _mm512_cvtepi32_ps(pair_dot(pair + r * pair_bytes, bits, first, second));
            acc[r] = accumulate(acc[r], dot, pair + ROWS * pair_bytes + factors * r, symmetric, dx, sums, zsums);
        }
    }
    for (int r = 0; r < ROWS; r++) result[r] = _mm512_reduce_add_ps(acc[r]);
}

/* 4-bit rows two at a time. Rows r and r + 1 of a pair are 64 adjacent bytes: one load, one unpack gives both rows'
 * low nibbles (positions 0-31) and high nibbles (32-63), which vpdpbusd takes against those positions' activation
 * bytes repeated in both halves. Lanes 0-7 then sum row r's products and lanes 8-15 row r + 1's, each lane within
 * one group as in dot_rows (group = lane & 1), so dx is the same vector and each lane carries a quarter of its
 * group's sum (twice dot_rows' eighth). Half the unpacking and factor work of a row at a time: the kernel is
 * compute-bound on a 2-core VM at batch 1. */
static inline __m512i two_rows_dot(const uint8_t *w, const __m512i x[4]) {
    __m512i packed = _mm512_loadu_si512(w), low = _mm512_set1_epi8(15);
    __m512i lo = _mm512_and_si512(packed, low), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    __m512i high = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x[0]), hi, x[1]);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(high, DIGIT_BITS), lo, x[2]), hi, x[3]);
}

/* Lanes 0-7 take (A, B) from floats (a, a + 1), lanes 8-15 from (b, b + 1): two rows' factors in each row's lanes. */
static inline __m512 two_rows_factor(__m512 floats, int a, int b) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                                   b, b + 1, b, b + 1, b, b + 1, b, b + 1), floats);
}

static inline float sum_half(__m512 v, int upper) {
    __m256 h = upper ? _mm512_extractf32x8_ps(v, 1) : _mm512_castps512_ps256(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __attribute__((always_inline)) void dot_two_rows(const uint8_t *block, int P, int symmetric,
                                                              const int8_t *xq, const float *dx_lanes,
                                                              const float *sum_lanes, float *result) {
    int factors = factor_bytes(symmetric), stride = ROWS * (32 + factors);
    __m512 acc[ROWS / 2];
    for (int r = 0; r < ROWS / 2; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < P; p++) {
        for (int line = 0; line < stride; line += 64) _mm_prefetch((const char *)block + (size_t)(p + PREFETCH) * stride + line, _MM_HINT_T0);
        __m512i x[4];
        for (int i = 0; i < 4; i++) x[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(xq + 128 * p + 32 * i)));
        __m512 dx = _mm512_loadu_ps(dx_lanes + 16 * p), sums = _mm512_mul_ps(_mm512_loadu_ps(sum_lanes + 16 * p), _mm512_set1_ps(2.f));
        __m512 zsums = _mm512_mul_ps(sums, _mm512_set1_ps(8.f));
        const uint8_t *pair = block + (size_t)p * stride;
        for (int r = 0; r < ROWS / 2; r++) {
            __m512 dot = _mm512_cvtepi32_ps(two_rows_dot(pair + 64 * r, x));
            const uint8_t *f = pair + ROWS * 32 + 2 * factors * r;
            if (symmetric) { /* (scale A, scale B) of row r, then of row r + 1 */
                __m512 floats = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)f)));
                acc[r] = _mm512_fmadd_ps(two_rows_factor(floats, 0, 2), _mm512_fmsub_ps(dot, dx, zsums), acc[r]);
            } else { /* (scale A, scale B, offset A, offset B) of row r, then of row r + 1 */
                __m512 floats = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)f)));
                __m512 s = two_rows_factor(floats, 0, 4), o = two_rows_factor(floats, 2, 6);
                acc[r] = _mm512_fmadd_ps(o, sums, _mm512_fmadd_ps(dot, _mm512_mul_ps(s, dx), acc[r]));
            }
        }
    }
    for (int r = 0; r < ROWS; r++) result[r] = sum_half(acc[r / 2], r & 1);
}
#elif LANES == 8
static inline __m256i nibble_dot(__m256i nibbles, __m256i xq) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles, xq), _mm256_set1_epi16(1));
}

/* vpmaddubsw saturates at 16 bits: 4-bit weights are safe (2 * 15 * 127), bytes go as two nibbles. */
static inline __m256i byte_dot(__m256i u, __m256i xq, __m256i low) {
    __m256i hi = nibble_dot(_mm256_and_si256(_mm256_srli_epi16(u, 4), low), xq);
    return _mm256_add_epi32(nibble_dot(_mm256_and_si256(u, low), xq), _mm256_slli_epi32(hi, 4));
}

/* An 8-bit pair's (first: its positions 0-31, second: 32-63) dot product with one digit's 64 bytes. */
static inline __m256i bytes_dot(__m256i first, __m256i second, const int8_t *xq, __m256i low) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)xq), x1 = _mm256_loadu_si256((const __m256i *)(xq + 32));
    return _mm256_add_epi32(byte_dot(first, x0, low), byte_dot(second, x1, low));
}

/* A 4-bit pair's (first: the low nibbles, second: the high ones) dot product with one digit's 64 bytes: the two
 * halves' 16-bit pair sums (each at most 2 * 15 * 127 = 3810) added before they widen, times `widen`, in one
 * vpmaddwd. */
static inline __m256i nibbles_dot(__m256i first, __m256i second, const int8_t *xq, __m256i widen) {
    __m256i x0 = _mm256_loadu_si256((const __m256i *)xq), x1 = _mm256_loadu_si256((const __m256i *)(xq + 32));
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(first, x0), _mm256_maddubs_epi16(second, x1));
    return _mm256_madd_epi16(pairs, widen);
}

static inline __m256i pair_dot(const uint8_t *w, int bits, const int8_t *xq) {
    __m256i low = _mm256_set1_epi8(15);
    if (bits == 4) { /* the first digit's products widen times DIGIT, the second's times 1 */
        __m256i packed = _mm256_loadu_si256((const __m256i *)w);
        __m256i first = _mm256_and_si256(packed, low), second = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        return _mm256_add_epi32(nibbles_dot(first, second, xq, _mm256_set1_epi16(DIGIT)),
                                nibbles_dot(first, second, xq + 64, _mm256_set1_epi16(1)));
    }
    __m256i first = _mm256_loadu_si256((const __m256i *)w), second = _mm256_loadu_si256((const __m256i *)(w + 32));
    __m256i high = _mm256_slli_epi32(bytes_dot(first, second, xq, low), DIGIT_BITS);
    return _mm256_add_epi32(high, bytes_dot(first, second, xq + 64, low));
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256 broadcast_pair(__m128 v) { return _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(v))); }

/* As the AVX512 path's accumulate. */
static inline __m256 accumulate(__m256 acc, __m256 dot, const uint8_t *factors, int symmetric, __m256 dx,
                                __m256 sums, __m256 zsums) {
    __m128 so = pair_factors(factors, symmetric);
    __m256 s = broadcast_pair(so);
    if (symmetric) return _mm256_fmadd_ps(s, _mm256_fmsub_ps(dot, dx, zsums), acc);
    __m256 o = broadcast_pair(_mm_movehl_ps(so, so));
    return _mm256_fmadd_ps(o, sums, _mm256_fmadd_ps(dot, _mm256_mul_ps(s, dx), acc));
}

static inline __attribute__((always_inline)) void dot_rows(const uint8_t *block, int P, int bits, int symmetric,
                                                          const int8_t *xq, const float *dx_lanes,
                                                          const float *sum_lanes, float *result) {
    int pair_bytes = 8 * bits, factors = factor_bytes(symmetric), stride = ROWS * (pair_bytes + factors);
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int p = 0; p < P; p++) {
        for (int line = 0; line < stride; line += 64) _mm_prefetch((const char *)block + (size_t)(p + PREFETCH) * stride + line, _MM_HINT_T0);
        __m256 dx = _mm256_loadu_ps(dx_lanes + 8 * p), sums = _mm256_loadu_ps(sum_lanes + 8 * p);
        __m256 zsums = _mm256_mul_ps(sums, _mm256_set1_ps((float)(1 << (bits - 1))));
        for (int r = 0; r < ROWS; r++) {
            const uint8_t *pair = block + (size_t)p * stride;
            __m256 dot = _mm256_cvtepi32_ps(pair_dot(pair + r * pair_bytes, bits, xq + 128 * p));
            acc[r] = accumulate(acc[r], dot, pair + ROWS * pair_bytes + factors * r, symmetric, dx, sums, zsums);
        }
    }
    for (int r = 0; r < ROWS; r++) result[r] = sum8(acc[r]);
}
#else
static inline float half_to_float(uint16_t h) {
    int exponent = (h >> 10) & 31, mantissa = h & 1023;
    float magnitude = exponent == 0 ? ldexpf((float)mantissa, -24)
                      : exponent == 31 ? (mantissa ? NAN : INFINITY)
                      : ldexpf((float)(mantissa | 1024), exponent - 25);
    return h & 0x8000 ? -magnitude : magnitude;
}

static inline int weight_at(const uint8_t *pair, int bits, int j) {
    if (bits == 8) return pair[j];
    return j < 32 ? (pair[j] & 15) : (pair[j - 32] >> 4);
}

static inline __attribute__((always_inline)) void dot_rows(const uint8_t *block, int P, int bits, int symmetric,
                                                          const int8_t *xq, const float *dx_lanes,
                                                          const float *sum_lanes, float *result) {
    int pair_bytes = 8 * bits, factors = factor_bytes(symmetric), stride = ROWS * (pair_bytes + factors);
    for (int r = 0; r < ROWS; r++) {
        float acc = 0.f;
        for (int p = 0; p < P; p++) {
            const uint8_t *pair = block + (size_t)p * stride;
            uint16_t so[4];
            memcpy(so, pair + ROWS * pair_bytes + factors * r, factors);
            int32_t dot[2] = {0, 0};
            for (int j = 0; j < 64; j++) dot[(j >> 2) & 1] += weight_at(pair + r * pair_bytes, bits, j) *
                                                    (DIGIT * xq[128 * p + j] + xq[128 * p + 64 + j]);
            for (int h = 0; h < 2; h++) {
                float scale = half_to_float(so[h]), dx = dx_lanes[2 * p + h], sum = sum_lanes[2 * p + h] * (LANES / 2);
                acc += symmetric ? scale * (dx * (float)dot[h] - (float)(1 << (bits - 1)) * sum)
                                 : scale * dx * (float)dot[h] + half_to_float(so[2 + h]) * sum;
            }
        }
        result[r] = acc;
    }
}
#endif

/* block_gemv.h's product (its args). */
void block_gemv(const BlockGemvArgs *args) {
    const void *x = args->x;
    const uint8_t *w = args->w;
    void *out = args->out;
    int8_t *scratch = args->scratch;
    int x_bf16 = args->x_bf16, M = args->M, K = args->K, N = args->N, bits = args->bits;
    int symmetric = args->symmetric, out_bf16 = args->out_bf16, threads = args->threads;
    float *lane_scratch = args->lane_scratch;
    int pairs = K / 64;
    size_t block_bytes = (size_t)pairs * ROWS * (8 * bits + factor_bytes(symmetric)), lanes = (size_t)pairs * LANES;
    float *dx_lanes = lane_scratch, *sum_lanes = lane_scratch + (size_t)M * lanes;
    size_t x_row_bytes = (size_t)K * (x_bf16 ? 2 : 4);
    for (int m = 0; m < M; m++)
        quantize_row((const char *)x + m * x_row_bytes, x_bf16, K, scratch + (size_t)m * 2 * K, dx_lanes + m * lanes,
                     sum_lanes + m * lanes);
    int blocks = (N + ROWS - 1) / ROWS;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP the blocks run on the calling thread */
#endif
    for (int b = 0; b < blocks; b++) {
        int n0 = b * ROWS, count = N - n0 < ROWS ? N - n0 : ROWS;
        float result[ROWS];
        for (int m = 0; m < M; m++) {
            const int8_t *xq = scratch + (size_t)m * 2 * K;
            const uint8_t *rows = w + b * block_bytes;
            const float *dx = dx_lanes + m * lanes, *sums = sum_lanes + m * lanes;
            /* Constant widths and layouts let the compiler drop the branches on them. */
#if LANES == 16
            if (bits == 4 && symmetric) dot_two_rows(rows, pairs, 1, xq, dx, sums, result);
            else if (bits == 4) dot_two_rows(rows, pairs, 0, xq, dx, sums, result);
#else
            if (bits == 4 && symmetric) dot_rows(rows, pairs, 4, 1, xq, dx, sums, result);
            else if (bits == 4) dot_rows(rows, pairs, 4, 0, xq, dx, sums, result);
#endif
            else if (symmetric) dot_rows(rows, pairs, 8, 1, xq, dx, sums, result);
            else dot_rows(rows, pairs, 8, 0, xq, dx, sums, result);
            for (int r = 0; r < count; r++) {
                size_t at = (size_t)m * N + n0 + r;
                if (out_bf16) ((uint16_t *)out)[at] = float_to_bf16(result[r]);
                else ((float *)out)[at] = result[r];
            }
        }
    }
}
