/* The elementwise steps of a CPU float32 or bfloat16 forward, each fused into one pass over its rows: RMSNorm, the SiLU-gated
 * product of the MLP, and the rotary embedding of q and k. Run as torch ops, a prefill chunk's norm is five passes
 * over activations larger than the caches (square, mean, rsqrt, two products), the gated product three, and the
 * rotation five (a roll, two products, a sum, a copy of q); here each reads its input once and writes its output
 * once, and every row's work stays in registers.
 *
 * The arithmetic is torch's, in its order, with each product and sum rounded on its own (built with
 * -ffp-contract=off: a fused multiply-add would round once where torch rounds twice). Rotary gives torch's results
 * to the bit; the gated product computes e^x by its own polynomial, as exact as torch's (99.4% of products equal
 * torch's bits, the rest within 2.5 ulps); the norm differs only in the order its squares are summed.
 *
 * The _bf16 variants take and give bfloat16 and round where torch's bfloat16 ops round (HF's Llama-style norm
 * normalises in float32 and rounds before the weight's product; SiLU rounds its result, then the product; the
 * rotation rounds each product and their sum), computing in float32 between those points, as torch does. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fused_elementwise.h"

/* A bfloat16 is the top half of the float32 it stands for. */
static inline float widen(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 to bfloat16, rounded to nearest even as torch rounds; a NaN stays a (quiet) NaN. */
static inline uint16_t narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != f) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* bfloat16 a times b, rounded: the product of two bfloat16s is exact in float32. */
static inline uint16_t product(uint16_t a, uint16_t b) { return narrow(widen(a) * widen(b)); }

/* out[r] = weight * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))), HF Llama's RMSNorm in float32. */
void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps,
              int threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * width;
        float *dst = out + r * width;
        double squares = 0.0; /* summed in double: torch's float sum is as close to the exact sum as this */
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) squares += (double)row[i] * (double)row[i];
        float mean = (float)(squares / (double)width);
        float inverse = 1.0f / sqrtf(mean + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) dst[i] = weight[i] * (row[i] * inverse);
    }
}

/* HF Llama's RMSNorm in bfloat16: weight * (x[r] * (1 / sqrt(mean(x[r]^2) + eps))).to(bfloat16). */
void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t width,
                   float eps, int threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * width;
        uint16_t *dst = out + r * width;
        double squares = 0.0;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < width; i++) squares += (double)widen(row[i]) * (double)widen(row[i]);
        float mean = (float)(squares / (double)width);
        float inverse = 1.0f / sqrtf(mean + eps);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) dst[i] = product(weight[i], narrow(widen(row[i]) * inverse));
    }
}

/* e^x to about an ulp for SiLU, in operations a vector loop can carry (glibc's expf is a call per element unless
 * -ffast-math): x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' polynomial, times 2^n built in the exponent
 * bits. Above the float range it gives infinity, as expf does; below -87 it gives e^-87, which SiLU's 1 + e^x
 * absorbs as it absorbs any smaller value. */
static inline float silu_exp(float x) {
    float clamped = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float n = rintf(clamped * 1.44269504088896341f);
    float r = clamped - n * 0.693359375f; /* ln 2 in two parts, the first exact in float */
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    float e = p * scale;
    return x > 88.7228f ? INFINITY : e;
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]: the gate and up halves of one fused projection. */
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter, *up = gate + inter;
        float *dst = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float silu = gate[i] / (1.0f + silu_exp(-gate[i]));
            dst[i] = silu * up[i];
        }
    }
}

/* silu_mul in bfloat16: silu(gate) rounded, then its product with up rounded. */
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int threads) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *gate = gate_up + r * 2 * inter, *up = gate + inter;
        uint16_t *dst = out + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) {
            float g = widen(gate[i]);
            dst[i] = product(narrow(g / (1.0f + silu_exp(-g))), up[i]);
        }
    }
}

/* One head's rotation: out = x * cos + roll(x, half) * signed_sin over the first rot dimensions (signed_sin
 * holds -sin in its first half, so this is HF's x * cos + cat(-x2, x1) * sin), the rest copied. */
static inline void rotate_head(const float *x, const float *cos, const float *signed_sin, float *out, int dim,
                               int rot) {
    int half = rot / 2;
#pragma omp simd
    for (int i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * signed_sin[i];
#pragma omp simd
    for (int i = half; i < rot; i++) out[i] = x[i] * cos[i] + x[i - half] * signed_sin[i];
    for (int i = rot; i < dim; i++) out[i] = x[i];
}

/* fused_elementwise.h's rotation of float32 rows. */
void rotary_qk(const RotaryArgs *args) {
    const float *qkv = args->qkv, *cos = args->cos, *signed_sin = args->signed_sin;
    float *q_out = args->q_out, *k_out = args->k_out;
    int64_t row_stride = args->row_stride, rows = args->rows;
    int q_heads = args->q_heads, k_heads = args->k_heads, dim = args->dim, rot = args->rot, threads = args->threads;
    int heads = q_heads + k_heads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *row = qkv + r * row_stride, *c = cos + r * rot, *s = signed_sin + r * rot;
        for (int h = 0; h < heads; h++) {
            float *dst = h < q_heads ? q_out + (r * q_heads + h) * dim : k_out + (r * k_heads + h - q_heads) * dim;
            rotate_head(row + (int64_t)h * dim, c, s, dst, dim, rot);
        }
    }
}

/* rotate_head in bfloat16: each product rounded, then their sum. */
static inline void rotate_head_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *signed_sin,
                                    uint16_t *out, int dim, int rot) {
    int half = rot / 2;
#pragma omp simd
    for (int i = 0; i < half; i++)
        out[i] = narrow(widen(product(x[i], cos[i])) + widen(product(x[i + half], signed_sin[i])));
#pragma omp simd
    for (int i = half; i < rot; i++)
        out[i] = narrow(widen(product(x[i], cos[i])) + widen(product(x[i - half], signed_sin[i])));
    for (int i = rot; i < dim; i++) out[i] = x[i];
}

/* rotary_qk in bfloat16 (row_stride in elements). */
void rotary_qk_bf16(const RotaryArgs *args) {
    const uint16_t *qkv = args->qkv, *cos = args->cos, *signed_sin = args->signed_sin;
    uint16_t *q_out = args->q_out, *k_out = args->k_out;
    int64_t row_stride = args->row_stride, rows = args->rows;
    int q_heads = args->q_heads, k_heads = args->k_heads, dim = args->dim, rot = args->rot, threads = args->threads;
    int heads = q_heads + k_heads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static)
#else
    (void)threads; /* without OpenMP (built with -fopenmp-simd) the rows run on the calling thread */
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = qkv + r * row_stride, *c = cos + r * rot, *s = signed_sin + r * rot;
        for (int h = 0; h < heads; h++) {
            uint16_t *dst = h < q_heads ? q_out + (r * q_heads + h) * dim
                                        : k_out + (r * k_heads + h - q_heads) * dim;
            rotate_head_bf16(row + (int64_t)h * dim, c, s, dst, dim, rot);
        }
    }
}
