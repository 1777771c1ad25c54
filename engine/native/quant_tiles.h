/* The int8-activation GEMM's packed weight layout (docs/architecture.md#quantized-weights): quant_vnni.c
 * packs stored blocks into it; its AVX-512 VNNI kernel and quant_vnni_avx2.c's AVX2 kernel read it.
 *
 * A tile is 16 output rows; its K / 32 tile blocks each hold the codes of 16 rows x 32 inputs, then fp16
 * d[16] and m[16] (w = d u + m). Codes sit in 64-byte groups, one 32-bit lane per row: group g's lane j
 * holds inputs 4g..4g+3 of row j, so one vpdpbusd (or, in AVX2, maddubs + madd on each 32-byte half: rows
 * 0-7, rows 8-15) multiplies 16 rows x 4 inputs. Nibble codes (kind 4) pack group pair p's two groups in
 * one 64-byte group: group 2p in the low nibbles, 2p + 1 in the high ones. Byte codes (kind 8) are the
 * signed weight + 128. */
#ifndef KVPILOT_NATIVE_QUANT_TILES_H
#define KVPILOT_NATIVE_QUANT_TILES_H
#include <stdint.h>

#define TILE_ROWS 16
enum { KIND_Q4 = 4, KIND_Q8 = 8 };

/* Bytes of one tile block's codes. */
static inline int64_t tile_codes_bytes(int kind) { return kind == KIND_Q4 ? 256 : 512; }
/* Bytes of one tile block: the codes, then fp16 d[16] and m[16]. */
static inline int64_t tile_block_bytes(int kind) { return tile_codes_bytes(kind) + 2 * TILE_ROWS * 2; }

/* The AVX2 kernels (quant_vnni_avx2.c), where the compiler targets AVX2 but not AVX-512 VNNI. */
void kvp_int8_quantize_avx2(const float *x, int64_t xs, int8_t *q, float *dx, float *sx, int64_t M, int64_t K);
/* y = x W^T (+ bias) with q, dx, sx the caller's scratch for x's rounding ([M, K], [M, K / 32] twice). */
void kvp_int8_linear_avx2(const float *x, int64_t xs, const uint8_t *packed, int kind, const float *bias,
                          float *y, int64_t M, int64_t N, int64_t K, int8_t *q, float *dx, float *sx, int nthreads);

#endif
