/* Unpack PyTorch's CPU int4 weight layout into a dense bf16 matrix, for steps with enough rows
 * that one dense matmul beats the packed kernel (which unpacks the weights again for every four
 * rows). Plain C, no Python or torch headers: `batcher/runtime/int4_unpack.py` builds it with the
 * system's C compiler and checks it against the packed kernel before any layer uses it.
 *
 * packed: [N / 64, K, 32] bytes: for each block of 64 output rows and each input column k, byte i
 *         holds row i's 4-bit value in its low nibble and row 32 + i's in its high nibble.
 * sz:     [K / group, N, 2] bf16: each group's scale and zero point, w = (q - 8) * scale + zero.
 * out:    [K, N] bf16, the transposed weight (x @ out is the layer's matmul).
 */
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

int int4pack_to_bf16(const uint8_t *packed, const uint16_t *sz, uint16_t *out,
                     int n, int k, int group) {
    if (n <= 0 || k <= 0 || group <= 0 || n % 64 || k % group) return -1;
    for (int block = 0; block < n / 64; block++) {
        const uint8_t *src = packed + (size_t)block * k * 32;
        for (int g0 = 0; g0 < k; g0 += group) {
            float scale[64], offset[64]; /* w = q * scale + offset */
            const uint16_t *g = sz + ((size_t)(g0 / group) * n + (size_t)block * 64) * 2;
            for (int i = 0; i < 64; i++) {
                scale[i] = bf16_to_float(g[2 * i]);
                offset[i] = bf16_to_float(g[2 * i + 1]) - 8.0f * scale[i];
            }
            for (int col = g0; col < g0 + group; col++) {
                const uint8_t *bytes = src + (size_t)col * 32;
                uint16_t *dst = out + (size_t)col * n + (size_t)block * 64;
                for (int i = 0; i < 32; i++) {
                    dst[i] = float_to_bf16((float)(bytes[i] & 15) * scale[i] + offset[i]);
                    dst[32 + i] = float_to_bf16((float)(bytes[i] >> 4) * scale[32 + i]
                                                + offset[32 + i]);
                }
            }
        }
    }
    return 0;
}
