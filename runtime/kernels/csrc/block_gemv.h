/* block_gemv.c's face: the layout its weights take, the arguments its entry point takes as one struct, and its
 * entry points; included by block_gemv.c and block_gemv_op.cpp. block_gemv.py's BINDING declares the same limits
 * and struct (tests/test_native_sources.py checks that they agree). */
#ifndef FURCATE_BLOCK_GEMV_H
#define FURCATE_BLOCK_GEMV_H

#include <stdint.h>

#define ROWS 4         /* weight rows a block holds, and a thread runs at once, sharing each pair's activation loads */
#define PAIR 64        /* weights of a pair of 32-weight groups, the kernel's unit along K */
#define LANE_FLOATS 16 /* per pair and row of x: the widest build's lanes of dx and of group sums */

/* out[m, n] (M x N, float32 or bfloat16 where out_bf16) = x[m, :] . w[n, :] for x M x K (float32 or bfloat16
 * where x_bf16), K a multiple of PAIR. w: blocks of ROWS rows (N padded with zero rows), each a run of the rows'
 * pairs: pair p of every row of the block, then each row's float16 (scale A, scale B, offset A, offset B) of that
 * pair, or (scale A, scale B) where symmetric; one stream a thread reads front to back. scratch: 2 * M * K bytes
 * for the quantized activations; lane_scratch: 2 * M * (K / PAIR) * LANE_FLOATS floats. One struct rather than
 * thirteen positional arguments, so that ctypes and the C++ op fill fields by name. */
typedef struct {
    const void *x;
    int x_bf16, M, K, N;
    const uint8_t *w;
    int bits, symmetric;
    void *out;
    int out_bf16;
    int8_t *scratch;
    float *lane_scratch;
    int threads;
} BlockGemvArgs;

#ifdef __cplusplus
extern "C" {
#endif

void block_gemv(const BlockGemvArgs *args);

/* The vector path this build runs: 2 = AVX512-VNNI, 1 = AVX2, 0 = plain C. */
int block_gemv_isa(void);

#ifdef __cplusplus
}
#endif

#endif
