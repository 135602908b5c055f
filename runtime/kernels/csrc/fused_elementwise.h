/* fused_elementwise.c's face: its entry points, float32 and bfloat16 (_bf16: uint16_t where float) alike, and the
 * arguments the rotation takes as one struct; included by fused_elementwise.c. fused_elementwise.py's BINDING
 * declares the same entry points and struct (tests/test_native_sources.py checks that they agree). */
#ifndef FURCATE_FUSED_ELEMENTWISE_H
#define FURCATE_FUSED_ELEMENTWISE_H

#include <stdint.h>

/* q_out [rows, q_heads, dim] and k_out [rows, k_heads, dim] (both contiguous) rotated from the first
 * (q_heads + k_heads) * dim columns of qkv, whose rows lie row_stride elements apart; cos and signed_sin are
 * [rows, rot]; float32 for rotary_qk, bfloat16 for rotary_qk_bf16. One struct rather than twelve positional
 * arguments, so that ctypes fills fields by name. */
typedef struct {
    const void *qkv;
    int64_t row_stride;
    const void *cos, *signed_sin;
    void *q_out, *k_out;
    int64_t rows;
    int q_heads, k_heads, dim, rot, threads;
} RotaryArgs;

#ifdef __cplusplus
extern "C" {
#endif

void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t width, float eps, int threads);
void rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t rows, int64_t width, float eps,
                   int threads);
void silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int threads);
void silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter, int threads);
void rotary_qk(const RotaryArgs *args);
void rotary_qk_bf16(const RotaryArgs *args);

#ifdef __cplusplus
}
#endif

#endif
