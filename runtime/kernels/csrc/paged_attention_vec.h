/* paged_attention.c's vectors of VL floats (GCC's vector extensions, which clang shares) and the helpers both its
 * paths use: lane sums and maxima, exp for the softmax, rows read and written as float32 or bfloat16. */
#ifndef FURCATE_PAGED_ATTENTION_VEC_H
#define FURCATE_PAGED_ATTENTION_VEC_H

#include <stdint.h>
#include <string.h>

#include "paged_attention.h"

/* A vector is one register of the CPU: 16 floats with AVX512, else 8 (AVX2's). GCC keeps a vector wider than the
 * registers in memory, one load and store around every operation (a 16-float vector on AVX2 ran prefill attention
 * 7x slower than on AVX512). VF_REGISTERS: how many the registers hold, by which loops size the sums they keep. */
#if defined(__AVX512F__)
#define VL 16
#define VF_REGISTERS 32
#else
#define VL 8
#define VF_REGISTERS 16
#endif

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));

static inline vf load_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Lanes of a and b (lanes VL to 2 VL - 1 are b's) picked by constant indices: GCC's __builtin_shuffle takes them as a
 * vector, clang's __builtin_shufflevector as arguments (clang has no __builtin_shuffle). The same lanes either way,
 * so the same sums. */
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* A vector's lanes summed (or their maximum taken) in halving steps, not VL dependent ones: each step swaps halves
 * of 8 (with 16 lanes), 4, 2 and 1 lanes. */
#if VL == 16
#define SWAP8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define SWAP4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define SWAP2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define SWAP1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define SWAP4 4, 5, 6, 7, 0, 1, 2, 3
#define SWAP2 2, 3, 0, 1, 6, 7, 4, 5
#define SWAP1 1, 0, 3, 2, 5, 4, 7, 6
#endif

static inline float hsum(vf v) {
#if VL == 16
    v += SHUFFLE(v, v, SWAP8);
#endif
    v += SHUFFLE(v, v, SWAP4);
    v += SHUFFLE(v, v, SWAP2);
    v += SHUFFLE(v, v, SWAP1);
    return v[0];
}

static inline vf vmax(vf a, vf b) { return (vf)(((vi)a & (a > b)) | ((vi)b & ~(a > b))); }

static inline float hmax(vf v) {
#if VL == 16
    v = vmax(v, SHUFFLE(v, v, SWAP8));
#endif
    v = vmax(v, SHUFFLE(v, v, SWAP4));
    v = vmax(v, SHUFFLE(v, v, SWAP2));
    v = vmax(v, SHUFFLE(v, v, SWAP1));
    return v[0];
}

/* The lane sums of VL vectors as one vector (lane j: the sum of v[j]), in VL - 1 shuffle-add steps where VL
 * separate sums would take ~VL dependent adds each: every round adds the low and high halves of each key's lanes,
 * two vectors at a time, so keys keep their order while their lanes halve (16, 8, 4, 2, 1). */
#if VL == 16
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define LO2 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define HI2 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define LO1 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define HI1 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31

#else
#define LO4 0, 1, 2, 3, 8, 9, 10, 11
#define HI4 4, 5, 6, 7, 12, 13, 14, 15
#define LO2 0, 1, 4, 5, 8, 9, 12, 13
#define HI2 2, 3, 6, 7, 10, 11, 14, 15
#define LO1 0, 2, 4, 6, 8, 10, 12, 14
#define HI1 1, 3, 5, 7, 9, 11, 13, 15
#endif

static inline vf lane_sums(vf v[VL]) {
    vf four[4], two[2];
#if VL == 16
    vf eight[8];
    for (int i = 0; i < 8; i++)
        eight[i] = SHUFFLE(v[2 * i], v[2 * i + 1], LO8) + SHUFFLE(v[2 * i], v[2 * i + 1], HI8);
#else
    vf *eight = v;
#endif
    for (int i = 0; i < 4; i++)
        four[i] = SHUFFLE(eight[2 * i], eight[2 * i + 1], LO4) + SHUFFLE(eight[2 * i], eight[2 * i + 1], HI4);
    for (int i = 0; i < 2; i++)
        two[i] = SHUFFLE(four[2 * i], four[2 * i + 1], LO2) + SHUFFLE(four[2 * i], four[2 * i + 1], HI2);
    return SHUFFLE(two[0], two[1], LO1) + SHUFFLE(two[0], two[1], HI1);
}

/* exp(x) for x <= 0 (scores minus the running maximum), VL at once: x = n ln2 + r with |r| <= ln2 / 2,
 * exp(r) by Cephes' degree-6 polynomial (relative error ~1e-7, float32's own rounding), 2^n put into the exponent
 * bits. Below -87, exp leaves float32's normal range: 0. */
static inline vf pick(vi mask, vf yes, vf no) { return (vf)((mask & (vi)yes) | (~mask & (vi)no)); }

static inline vf exp_nonpositive(vf x) {
    vi underflows = x < -87.0f;
    vf clamped = pick(underflows, (vf){} - 87.0f, x);
    vf n = __builtin_convertvector(__builtin_convertvector(clamped * 1.44269504f - 0.5f, vi), vf);
    vf r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vf scale = (vf)((__builtin_convertvector(n, vi) + 127) << 23);
    return pick(underflows, (vf){}, p * scale);
}

typedef uint16_t vh __attribute__((vector_size(2 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* Row `row` of a [rows, dim] array (float32, or bfloat16 where bf16) as dim / VL float32 vectors: a bfloat16
 * is the top half of the float32 it stands for. */
static inline void load_row(const void *base, int64_t row, int chunks, vf *out, int bf16) {
    if (!bf16) {
        memcpy(out, (const float *)base + row * chunks * VL, (size_t)chunks * sizeof(vf));
        return;
    }
    const uint16_t *halves = (const uint16_t *)base + row * chunks * VL;
    for (int c = 0; c < chunks; c++) {
        vh h;
        memcpy(&h, halves + c * VL, sizeof h);
        out[c] = (vf)(__builtin_convertvector(h, vu) << 16);
    }
}

/* float32 to bfloat16, rounded to nearest even as torch rounds; a NaN stays a (quiet) NaN. */
static inline vh to_bf16(vf x) {
    vu bits = (vu)x;
    vu rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16;
    vu quiet = (bits >> 16) | 0x40;
    return __builtin_convertvector((vu)pick(x != x, (vf)quiet, (vf)rounded), vh);
}

static inline void store_row(void *base, int64_t row, int chunks, const vf *in, int bf16) {
    if (!bf16) {
        memcpy((float *)base + row * chunks * VL, in, (size_t)chunks * sizeof(vf));
        return;
    }
    uint16_t *halves = (uint16_t *)base + row * chunks * VL;
    for (int c = 0; c < chunks; c++) {
        vh h = to_bf16(in[c]);
        memcpy(halves + c * VL, &h, sizeof h);
    }
}

static inline int64_t checked(int64_t slot, int64_t pool_slots) {
    return slot >= 0 && slot < pool_slots ? slot : 0; /* a bad slot reads the reserved slot 0, never past */
}

#endif
