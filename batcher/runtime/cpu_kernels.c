/* Small CPU kernels in plain C, for the steps where PyTorch's many small ops cost more than the
 * arithmetic: no Python or torch headers. `batcher/runtime/cpu_kernels.py` builds this file with
 * the system's C compiler, and each user checks its functions against torch before use
 * (`int4_unpack.py`, `fused_decode.py`).
 *
 * Tensors are bf16 (as uint16_t), computed in fp32 and rounded to nearest even as torch does.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
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

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* PyTorch's CPU int4 weight layout unpacked into a dense bf16 matrix, for steps with enough rows
 * that one dense matmul beats the packed kernel (which unpacks the weights again for every four
 * rows).
 *
 * packed: [N / 64, K, 32] bytes: for each block of 64 output rows and each input column k, byte i
 *         holds row i's 4-bit value in its low nibble and row 32 + i's in its high nibble.
 * sz:     [K / group, N, 2] bf16: each group's scale and zero point, w = (q - 8) * scale + zero.
 * out:    [K, N] bf16, the transposed weight (x @ out is the layer's matmul).
 */
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

/* RMSNorm as the Llama reference computes it in bf16: normalise in fp32, round, then multiply by
 * the weight in bf16. x, out: [rows, dim]; weight: [dim]. The sum of squares may add in another
 * order than torch's, which can move an output by one bf16 step. */
int rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int rows, int dim,
                  float eps) {
    if (rows < 0 || dim <= 0) return -1;
    for (int r = 0; r < rows; r++) {
        const uint16_t *xr = x + (size_t)r * dim;
        uint16_t *o = out + (size_t)r * dim;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += bf16_to_float(xr[d]) * bf16_to_float(xr[d]);
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int d = 0; d < dim; d++)
            o[d] = float_to_bf16(bf16_to_float(weight[d]) * round_bf16(bf16_to_float(xr[d]) * inv));
    }
    return 0;
}

/* e^x for x <= 0 (a softmax's shifted scores), to about 2e-7 relative: 2^t = 2^n * 2^f with
 * n = trunc(t) and f in (-1, 0], a degree-6 polynomial for 2^f. Arithmetic without branches, so a
 * loop of it vectorizes. */
static inline float exp_nonpositive(float x) {
    float t = fmaxf(x, -87.0f) * 1.442695041f;
    int n = (int)t;
    float f = t - (float)n;
    float p = 1.093875238e-04f;
    p = p * f + 1.275716217e-03f;
    p = p * f + 9.580058454e-03f;
    p = p * f + 5.549103528e-02f;
    p = p * f + 2.402243555e-01f;
    p = p * f + 6.931470473e-01f;
    p = p * f + 9.999999986e-01f;
    union { uint32_t u; float f; } two_n = { .u = (uint32_t)(n + 127) << 23 };
    return p * two_n.f;
}

/* The residual add before a norm, then the norm: x += delta in bf16 (each sum rounded, as torch's
 * `x + delta` does), written back into x, and out = rms_norm(x) as `rms_norm_bf16` computes it.
 * x, delta, out: [rows, dim]; weight: [dim]. */
int add_rms_norm_bf16(uint16_t *x, const uint16_t *delta, const uint16_t *weight, uint16_t *out,
                      int rows, int dim, float eps) {
    if (rows < 0 || dim <= 0) return -1;
    for (size_t i = 0; i < (size_t)rows * dim; i++)
        x[i] = float_to_bf16(bf16_to_float(x[i]) + bf16_to_float(delta[i]));
    return rms_norm_bf16(x, weight, out, rows, dim, eps);
}

/* A SwiGLU MLP's activation: out = silu(gate) * up, each rounded to bf16 as torch's
 * `F.silu(gate) * up` rounds them. gate_up: [rows, 2 * inter] (gate then up, as the fused
 * projection lays them); out: [rows, inter]. silu(g) = g * sigmoid(g), with e^-|g| from
 * `exp_nonpositive`, so the sigmoid agrees with torch's to about 1e-7 relative. */
int silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int rows, int inter) {
    if (rows < 0 || inter <= 0) return -1;
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + (size_t)r * 2 * inter;
        const uint16_t *u = g + inter;
        uint16_t *o = out + (size_t)r * inter;
        for (int i = 0; i < inter; i++) {
            float x = bf16_to_float(g[i]);
            float e = exp_nonpositive(-fabsf(x));
            float sigmoid = (x >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = float_to_bf16(round_bf16(x * sigmoid) * bf16_to_float(u[i]));
        }
    }
    return 0;
}

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* Rotary embedding of one head as `batcher.models.llama.apply_rope` computes it in bf16:
 * x * cos + roll(x, half) * sin, each product and the sum rounded. */
static inline void rope_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                             int hd, float *out) {
    int half = hd / 2;
    for (int d = 0; d < hd; d++) {
        float rolled = bf16_to_float(x[d < half ? d + half : d - half]);
        out[d] = round_bf16(round_bf16(bf16_to_float(x[d]) * bf16_to_float(cos[d]))
                            + round_bf16(rolled * bf16_to_float(sin[d])));
    }
}

/* The shapes the kernels' fixed arrays take, and every row's length and blocks inside the pool
 * (checked before anything is written). */
static int check_step(int rows, int heads, int kv_heads, int hd, int block_size, int num_blocks,
                      const int32_t *tables, int max_blocks, const int32_t *lens) {
    if (!(rows > 0 && hd > 0 && hd <= MAX_HEAD_DIM && hd % 2 == 0 && kv_heads > 0
          && heads % kv_heads == 0 && heads / kv_heads <= MAX_GROUP && block_size > 0
          && max_blocks > 0 && num_blocks > 0)) return 0;
    for (int r = 0; r < rows; r++) {
        if (lens[r] <= 0 || lens[r] > max_blocks * block_size) return 0;
        int used = (lens[r] + block_size - 1) / block_size;
        for (int b = 0; b < used; b++) {
            int32_t block = tables[(size_t)r * max_blocks + b];
            if (block < 0 || block >= num_blocks) return 0;
        }
    }
    return 1;
}

/* Each row's query heads attend to its cached tokens, reading the blocks in place. q: [rows, heads
 * * hd] with row stride q_stride; rotated here by cos/sin first unless cos is NULL (then q is
 * rotated already). tables: [rows, max_blocks]; lens: [rows]; out: [rows, heads * hd]. */
static int attend(const uint16_t *q_in, long q_stride, const uint16_t *cos, const uint16_t *sin,
                  const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *tables,
                  int max_blocks, const int32_t *lens, int rows, int heads, int kv_heads, int hd,
                  int block_size, float scale, uint16_t *out) {
    int group = heads / kv_heads;
    size_t tok_stride = (size_t)kv_heads * hd;
    int maxlen = 1;
    for (int r = 0; r < rows; r++) maxlen = lens[r] > maxlen ? lens[r] : maxlen;
    float *scores = malloc(sizeof(float) * (size_t)group * (size_t)maxlen);
    if (!scores) return -2;
    for (int r = 0; r < rows; r++) {
        int len = lens[r];
        const int32_t *table = tables + (size_t)r * max_blocks;
        const uint16_t *row = q_in + (size_t)r * q_stride;
        for (int h = 0; h < kv_heads; h++) {
            float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
            for (int g = 0; g < group; g++) {
                const uint16_t *head = row + (size_t)(h * group + g) * hd;
                if (cos)
                    rope_bf16(head, cos + (size_t)r * hd, sin + (size_t)r * hd, hd, q[g]);
                else
                    for (int d = 0; d < hd; d++) q[g][d] = bf16_to_float(head[d]);
                for (int d = 0; d < hd; d++) {
                    q[g][d] *= scale;
                    acc[g][d] = 0.0f;
                }
            }
            /* scores = q . k for every cached token, block by block (no division per token) */
            for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
                const uint16_t *kb = k_cache + (size_t)table[b] * block_size * tok_stride
                                     + (size_t)h * hd;
                int n = len - t0 < block_size ? len - t0 : block_size;
                for (int i = 0; i < n; i++) {
                    float k[MAX_HEAD_DIM];
                    for (int d = 0; d < hd; d++) k[d] = bf16_to_float(kb[i * tok_stride + d]);
                    for (int g = 0; g < group; g++) {
                        float s = 0.0f;
                        for (int d = 0; d < hd; d++) s += q[g][d] * k[d];
                        scores[(size_t)g * len + t0 + i] = s;
                    }
                }
            }
            float inv_sum[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                float *sg = scores + (size_t)g * len;
                float m = sg[0];
                for (int t = 1; t < len; t++) m = fmaxf(m, sg[t]);
                for (int t = 0; t < len; t++) sg[t] = exp_nonpositive(sg[t] - m);
                float sum = 0.0f;
                for (int t = 0; t < len; t++) sum += sg[t];
                inv_sum[g] = 1.0f / sum;
            }
            for (int t0 = 0, b = 0; t0 < len; t0 += block_size, b++) {
                const uint16_t *vb = v_cache + (size_t)table[b] * block_size * tok_stride
                                     + (size_t)h * hd;
                int n = len - t0 < block_size ? len - t0 : block_size;
                for (int i = 0; i < n; i++) {
                    float v[MAX_HEAD_DIM];
                    for (int d = 0; d < hd; d++) v[d] = bf16_to_float(vb[i * tok_stride + d]);
                    for (int g = 0; g < group; g++) {
                        float p = scores[(size_t)g * len + t0 + i];
                        for (int d = 0; d < hd; d++) acc[g][d] += p * v[d];
                    }
                }
            }
            for (int g = 0; g < group; g++) {
                uint16_t *o = out + (size_t)r * heads * hd + (size_t)(h * group + g) * hd;
                for (int d = 0; d < hd; d++) o[d] = float_to_bf16(acc[g][d] * inv_sum[g]);
            }
        }
    }
    free(scores);
    return 0;
}

/* A decode-only step's attention from the QKV projection to the heads' output: RoPE on Q and K,
 * the new K and V written to the paged cache, then `attend`.
 *
 * qkv:    [rows, (heads + 2 * kv_heads) * hd], row stride qkv_stride: Q heads, K heads, V heads.
 * cos, sin: [rows, hd], the rows' positions (sin's first half negated: rotate-half).
 * k_cache, v_cache: [num_blocks, block_size, kv_heads, hd].
 * slots:  [rows] cache slot (block * block_size + offset) of each row's new token.
 * tables: [rows, max_blocks] block ids; lens: [rows] tokens to attend to, the new one included.
 * out:    [rows, heads * hd].
 */
int decode_attention_bf16(const uint16_t *qkv, long qkv_stride, const uint16_t *cos,
                          const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache,
                          int num_blocks, const int64_t *slots, const int32_t *tables,
                          int max_blocks, const int32_t *lens, int rows, int heads, int kv_heads,
                          int hd, int block_size, float scale, uint16_t *out) {
    if (!check_step(rows, heads, kv_heads, hd, block_size, num_blocks, tables, max_blocks, lens))
        return -1;
    for (int r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= (int64_t)num_blocks * block_size) return -1;
    size_t tok_stride = (size_t)kv_heads * hd;
    /* New K (rotated) and V into the cache first: every query sees its own token. */
    for (int r = 0; r < rows; r++) {
        const uint16_t *row = qkv + (size_t)r * qkv_stride;
        const uint16_t *cr = cos + (size_t)r * hd, *sr = sin + (size_t)r * hd;
        uint16_t *kdst = k_cache + (size_t)slots[r] * tok_stride;
        uint16_t *vdst = v_cache + (size_t)slots[r] * tok_stride;
        for (int h = 0; h < kv_heads; h++) {
            float k[MAX_HEAD_DIM];
            rope_bf16(row + (size_t)(heads + h) * hd, cr, sr, hd, k);
            for (int d = 0; d < hd; d++) kdst[(size_t)h * hd + d] = float_to_bf16(k[d]);
        }
        memcpy(vdst, row + (size_t)(heads + kv_heads) * hd, sizeof(uint16_t) * tok_stride);
    }
    return attend(qkv, qkv_stride, cos, sin, k_cache, v_cache, tables, max_blocks, lens, rows,
                  heads, kv_heads, hd, block_size, scale, out);
}

/* The decode rows of a mixed step, whose Q is rotated and whose K/V are in the cache already
 * (torch's ops did both for every row of the step): `attend` alone. q: [rows, heads * hd], row
 * stride q_stride. */
int paged_decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_cache,
                                const uint16_t *v_cache, int num_blocks, const int32_t *tables,
                                int max_blocks, const int32_t *lens, int rows, int heads,
                                int kv_heads, int hd, int block_size, float scale,
                                uint16_t *out) {
    if (!check_step(rows, heads, kv_heads, hd, block_size, num_blocks, tables, max_blocks, lens))
        return -1;
    return attend(q, q_stride, NULL, NULL, k_cache, v_cache, tables, max_blocks, lens, rows,
                  heads, kv_heads, hd, block_size, scale, out);
}
