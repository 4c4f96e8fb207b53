// kvgate's CUDA kernels, compiled at start by NVRTC for the device's architecture with the
// model's head size as HEAD_DIM (and --fmad=false: every fused multiply-add is written out).
//
// They compute what the CPU backend computes, operation by operation and in the same order
// (see cpu/dot, cpu/attention.rs, cpu/ggml_math.rs): activations quantised to 8 bits per
// 32-value block as llama.cpp does, integer dot products against the 4- and 8-bit weights,
// 8-lane float accumulation, llama.cpp's expf and summation orders. This model turns last-bit
// differences into different tokens, so the device gives the same tokens only by giving the
// same bits.
//
// Layouts (row-major): residual stream x [tokens, hidden] f32; a product's input as codes
// [rows, cols] i8 with per-block scales d and sums s [rows, cols / 32] f32; the fused QKV
// output [tokens, q_dim + 2 kv_dim] f32; each layer's K and V caches [slots, kv_dim] f16,
// slot = block * block_size + position % block_size.

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif

#define THREADS 128
#define QK 32
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// Tokens per thread in a matrix product: each weight word loaded once serves them all.
#define PRODUCT_TOKENS 8

#if HEAD_DIM <= 0 || THREADS % HEAD_DIM != 0 || HEAD_DIM % 32 != 0
#error "HEAD_DIM must divide the attention block's 128 threads and be a multiple of 32"
#endif

// Weight kinds (ggml type ids).
#define KIND_Q4_0 2
#define KIND_Q4_1 3
#define KIND_Q8_0 8

// Attention summation orders (cpu/attention.rs SumOrder).
#define ORDER_PROMPT 0
#define ORDER_DECODE 1

typedef unsigned short f16;

#ifndef KVGATE_EMULATED
__device__ __forceinline__ f16 to_f16(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float from_f16(f16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}
#endif

__device__ __forceinline__ float round_f16(float x) { return from_f16(to_f16(x)); }

// ggml's hsum_float_8: halves, then pairs, then the last two.
__device__ __forceinline__ float hsum8(const float* v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

// One lane of ggml_v_expf (cpu/ggml_math.rs ggml_expf).
__device__ float ggml_expf(float x) {
    const float r = __int_as_float(0x4B400000);
    float z = fmaf(x, __int_as_float(0x3FB8AA3B), r);
    float n = z - r;
    float b = fmaf(-n, __int_as_float(0x35BFBE8E), fmaf(-n, __int_as_float(0x3F317200), x));
    unsigned e = __float_as_uint(z) << 23;
    float k = __uint_as_float(e + __float_as_uint(1.0f));
    float u = b * b;
    float j = fmaf(fmaf(fmaf(__int_as_float(0x3C072010), b, __int_as_float(0x3D2B9F17)), u,
                        fmaf(__int_as_float(0x3E2AAF33), b, __int_as_float(0x3EFFFEDB))),
                   u, __int_as_float(0x3F7FFFF6) * b);
    if (fabsf(n) <= 126.0f) return fmaf(j, k, k);
    unsigned g = n <= 0.0f ? 0x82000000u : 0u;
    float s1 = __uint_as_float(g + 0x7F000000u);
    if (fabsf(n) > 192.0f) return s1 * s1;
    float s2 = __uint_as_float(e - g);
    return fmaf(s2, j, s2) * s1;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}

__device__ __forceinline__ int warp_sum_int(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}

// Quantises one 32-value block held one value per lane of a warp, as cpu/quant.rs Q8Row
// does: d = amax / 127 (stored through f16), codes rint(v * 127 / amax), s = d * Σ codes.
__device__ void quantize_block(float v, signed char* q, float* d, float* s) {
    int lane = threadIdx.x % 32;
    float amax = warp_max(fabsf(v));
    float dd = amax / 127.0f;
    float id = amax == 0.0f ? 0.0f : 127.0f / amax;
    int code = (int)rintf(v * id);
    code = min(max(code, -127), 127);
    q[lane] = (signed char)code;
    int sum = warp_sum_int(code);
    if (lane == 0) {
        *d = round_f16(dd);
        *s = round_f16(dd * (float)sum);
    }
}

// One block per token: its row of the f32 embedding table.
extern "C" __global__ void embed(const float* table, const int* tokens, float* x, int hidden,
                                 int vocab) {
    int t = blockIdx.x;
    int token = min(max(tokens[t], 0), vocab - 1);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        x[(long long)t * hidden + i] = table[(long long)token * hidden + i];
}

// One block per output row: RMSNorm of input row `rows[r]` (or r, without `rows`) scaled by
// `w` (squares summed in double, as llama.cpp), quantised for the next product.
extern "C" __global__ void rms_norm_q8(const float* x, const float* w, const int* rows,
                                       int hidden, float eps, signed char* q, float* d,
                                       float* s) {
    __shared__ double partial[THREADS / 32];
    __shared__ float scale_shared;
    int r = blockIdx.x;
    const float* row = x + (long long)(rows ? rows[r] : r) * hidden;
    double sum = 0.0;
    for (int i = threadIdx.x; i < hidden; i += THREADS) sum += (double)(row[i] * row[i]);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int i = 0; i < THREADS / 32; i++) total += partial[i];
        scale_shared = 1.0f / sqrtf((float)(total / hidden) + eps);
    }
    __syncthreads();
    float scale = scale_shared;
    int blocks = hidden / QK;
    for (int b = threadIdx.x / 32; b < blocks; b += THREADS / 32) {
        int i = b * QK + threadIdx.x % 32;
        float v = row[i] * scale * w[i];
        quantize_block(v, q + (long long)r * hidden + b * QK, d + (long long)r * blocks + b,
                       s + (long long)r * blocks + b);
    }
}

// One block per token: SwiGLU of its [gate | up] row, gate / (1 + exp(-gate)) * up, quantised.
extern "C" __global__ void silu_q8(const float* gate_up, int ffn, signed char* q, float* d,
                                   float* s) {
    int t = blockIdx.x, blocks = ffn / QK;
    const float* row = gate_up + (long long)t * 2 * ffn;
    for (int b = threadIdx.x / 32; b < blocks; b += THREADS / 32) {
        int i = b * QK + threadIdx.x % 32;
        float g = row[i], u = row[ffn + i];
        // llama.cpp's vector expf covers whole runs of 8; a tail would take libm's expf.
        float e = i < ffn / 8 * 8 ? ggml_expf(0.0f - g) : expf(-g);
        float v = g / (1.0f + e) * u;
        quantize_block(v, q + (long long)t * ffn + b * QK, d + (long long)t * blocks + b,
                       s + (long long)t * blocks + b);
    }
}

// out[t, n] (+)= W[n] · a[t] for quantised weights W [rows, k] (per block: 16 bytes of
// nibbles, or 32 codes for Q8_0; scales wd, Q4_1 offsets wm) and quantised activations.
// Eight threads per output row, one per float lane of llama.cpp's AVX2 kernel: lane `l` takes
// the block's values 4l..4l+3, fuses (Σ integer products) * (wd * ad) into its accumulator
// block after block; the lanes are then summed as hsum_float_8, plus Q4_1's Σ m * s.
extern "C" __global__ void matmul_q(const unsigned char* qs, const float* wd, const float* wm,
                                    int kind, int rows, int k, const signed char* aq,
                                    const float* ad, const float* as, int tokens, float* out,
                                    int ldo, int accumulate) {
    int lane = threadIdx.x % 8;
    int n = blockIdx.x * (THREADS / 8) + threadIdx.x / 8;
    int t0 = blockIdx.y * PRODUCT_TOKENS;
    int blocks = k / QK;
    bool active = n < rows;
    long long row = active ? n : 0;
    int block_bytes = kind == KIND_Q8_0 ? 32 : 16;
    float acc[PRODUCT_TOKENS], off[PRODUCT_TOKENS];
    for (int i = 0; i < PRODUCT_TOKENS; i++) acc[i] = off[i] = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const unsigned char* block = qs + (row * blocks + b) * block_bytes;
        int w4;
        if (kind == KIND_Q8_0) {
            w4 = *(const int*)(block + 4 * lane);
        } else {
            // Value j < 16 is byte j's low nibble, j >= 16 byte j - 16's high nibble.
            int word = *(const int*)(block + 4 * (lane % 4));
            w4 = lane < 4 ? (word & 0x0F0F0F0F) : ((word >> 4) & 0x0F0F0F0F);
            if (kind == KIND_Q4_0) w4 = __vsub4(w4, 0x08080808);
        }
        float dw = wd[row * blocks + b];
        float mw = kind == KIND_Q4_1 ? wm[row * blocks + b] : 0.0f;
        for (int i = 0; i < PRODUCT_TOKENS; i++) {
            int t = t0 + i;
            if (t >= tokens) break;
            int a4 = *(const int*)(aq + (long long)t * k + b * QK + 4 * lane);
            int sum = __dp4a(w4, a4, 0);
            acc[i] = fmaf((float)sum, dw * ad[(long long)t * blocks + b], acc[i]);
            if (kind == KIND_Q4_1) off[i] = fmaf(mw, as[(long long)t * blocks + b], off[i]);
        }
    }
    // The eight lanes of each output meet in shared memory; the loop is uniform across the
    // block (t0 is), so every thread reaches the barriers.
    __shared__ float lanes[THREADS];
    for (int i = 0; i < PRODUCT_TOKENS && t0 + i < tokens; i++) {
        lanes[threadIdx.x] = acc[i];
        __syncthreads();
        if (lane == 0 && active) {
            float r = hsum8(&lanes[threadIdx.x]);
            if (kind == KIND_Q4_1) r = r + off[i];
            float* o = out + (long long)(t0 + i) * ldo + n;
            *o = accumulate ? *o + r : r;
        }
        __syncthreads();
    }
}

// One block per token: RoPE on its Q and K heads with the step's angles (`rope`: per token,
// HEAD_DIM / 2 pairs of cos, sin, computed on the host exactly as the CPU backend does), K
// and V stored as f16 at its slot (none where the slot is negative), then Q rounded to f16
// for attention's f16 dot products.
extern "C" __global__ void rope_store(float* qkv, const float* rope, const int* slots,
                                      f16* k_cache, f16* v_cache, int heads, int kv_heads) {
    int t = blockIdx.x;
    int q_dim = heads * HEAD_DIM, kv_dim = kv_heads * HEAD_DIM;
    float* row = qkv + (long long)t * (q_dim + 2 * kv_dim);
    const float* angles = rope + (long long)t * HEAD_DIM;
    int slot = slots[t];
    int pairs = (q_dim + kv_dim) / 2;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        int i = p % (HEAD_DIM / 2);
        float c = angles[2 * i], s = angles[2 * i + 1];
        float a = row[2 * p], b = row[2 * p + 1];
        float ra = fmaf(a, c, -(b * s)), rb = fmaf(a, s, b * c);
        int k = 2 * p - q_dim;
        if (k < 0) {
            row[2 * p] = round_f16(ra);
            row[2 * p + 1] = round_f16(rb);
        } else if (slot >= 0) {
            k_cache[(long long)slot * kv_dim + k] = to_f16(ra);
            k_cache[(long long)slot * kv_dim + k + 1] = to_f16(rb);
        }
    }
    if (slot >= 0)
        for (int i = threadIdx.x; i < kv_dim; i += blockDim.x)
            v_cache[(long long)slot * kv_dim + i] = to_f16(row[q_dim + kv_dim + i]);
}

__device__ __forceinline__ long long slot_of(const int* table, int j, int block_size) {
    return (long long)table[j / block_size] * block_size + j % block_size;
}

// Scores q · k_j * scale for every (token, head, position j it sees), one thread each, in
// llama.cpp's f16 dot-product order for the token's slice: one 8-lane accumulator for a
// prompt (tinyBLAS), four for a single token (ggml_vec_dot_f16). Rows of `stride` floats,
// (token - token0, head) row-major.
extern "C" __global__ void attn_scores(const float* qkv, const f16* k_cache, const int* tables,
                                       const int* table_start, const int* visible,
                                       const int* order, float* scores, int heads,
                                       int kv_heads, int block_size, int stride, float scale,
                                       int token0) {
    int j = blockIdx.x * THREADS + threadIdx.x, head = blockIdx.y;
    int t = token0 + blockIdx.z;
    if (j >= visible[t]) return;
    int q_dim = heads * HEAD_DIM, kv_dim = kv_heads * HEAD_DIM;
    const float* q = qkv + (long long)t * (q_dim + 2 * kv_dim) + head * HEAD_DIM;
    int kv_head = head / (heads / kv_heads);
    const f16* k =
        k_cache + slot_of(tables + table_start[t], j, block_size) * kv_dim + kv_head * HEAD_DIM;
    float dot;
    if (order[t] == ORDER_PROMPT) {
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < HEAD_DIM; i += 8)
            for (int u = 0; u < 8; u++) l[u] = fmaf(q[i + u], from_f16(k[i + u]), l[u]);
        dot = hsum8(l);
    } else {
        float a[4][8];
        for (int c = 0; c < 4; c++)
            for (int u = 0; u < 8; u++) a[c][u] = 0.0f;
        for (int i = 0; i < HEAD_DIM; i += 32)
            for (int c = 0; c < 4; c++)
                for (int u = 0; u < 8; u++)
                    a[c][u] = fmaf(q[i + 8 * c + u], from_f16(k[i + 8 * c + u]), a[c][u]);
        float x[8];
        for (int u = 0; u < 8; u++) x[u] = (a[0][u] + a[2][u]) + (a[1][u] + a[3][u]);
        dot = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
    }
    scores[((long long)blockIdx.z * heads + head) * stride + j] = dot * scale;
}

// One block per (head, token) row: softmax as ggml_vec_soft_max_f32 (llama.cpp's expf, each
// run of 8 summed as hsum_float_8, the runs summed in double), each weight rounded to f16
// for the f16 products with V.
extern "C" __global__ void attn_softmax(float* scores, const int* visible, int heads,
                                        int stride, int token0) {
    __shared__ float max_part[THREADS / 32];
    __shared__ double sum_part[THREADS / 32];
    __shared__ float shared_max;
    __shared__ float shared_inv;
    int t = token0 + blockIdx.y;
    float* row = scores + ((long long)blockIdx.y * heads + blockIdx.x) * stride;
    int n = visible[t];
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += THREADS) m = fmaxf(m, row[j]);
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) max_part[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        float all = max_part[0];
        for (int i = 1; i < THREADS / 32; i++) all = fmaxf(all, max_part[i]);
        shared_max = all;
    }
    __syncthreads();
    m = shared_max;
    for (int j = threadIdx.x; j < n; j += THREADS) row[j] = ggml_expf(row[j] - m);
    __syncthreads();
    double sum = 0.0;
    for (int c = threadIdx.x; c < (n + 7) / 8; c += THREADS) {
        float l[8];
        for (int u = 0; u < 8; u++) l[u] = 8 * c + u < n ? row[8 * c + u] : 0.0f;
        sum += (double)hsum8(l);
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (threadIdx.x % 32 == 0) sum_part[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int i = 0; i < THREADS / 32; i++) total += sum_part[i];
        shared_inv = (float)(1.0 / total);
    }
    __syncthreads();
    float inv = shared_inv;
    for (int j = threadIdx.x; j < n; j += THREADS) row[j] = round_f16(row[j] * inv);
}

// One block per (token, head), one thread per output dimension d: Σ_j p_j v_j[d] in
// llama.cpp's order (position j fused into slot j % 8 for a prompt, j % 32 for a single
// token, the slots then summed as its dot products' lanes are), quantised for the output
// projection (each warp's 32 dimensions are one of the row's blocks).
extern "C" __global__ void attn_pv(const float* scores, const f16* v_cache, const int* tables,
                                   const int* table_start, const int* visible,
                                   const int* order, int heads, int kv_heads, int block_size,
                                   int stride, int token0, signed char* q, float* d,
                                   float* s) {
    int t = token0 + blockIdx.x, head = blockIdx.y, dim = threadIdx.x;
    const float* p = scores + ((long long)blockIdx.x * heads + head) * stride;
    const int* table = tables + table_start[t];
    int n = visible[t];
    int kv_dim = kv_heads * HEAD_DIM;
    const f16* v = v_cache + (head / (heads / kv_heads)) * HEAD_DIM + dim;
    float r;
    if (order[t] == ORDER_PROMPT) {
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int base = 0; base < n; base += 8)
            for (int u = 0; u < 8; u++)
                if (base + u < n)
                    l[u] = fmaf(p[base + u],
                                from_f16(v[slot_of(table, base + u, block_size) * kv_dim]), l[u]);
        r = hsum8(l);
    } else {
        float l[32];
        for (int u = 0; u < 32; u++) l[u] = 0.0f;
        for (int base = 0; base < n; base += 32)
            for (int u = 0; u < 32; u++)
                if (base + u < n)
                    l[u] = fmaf(p[base + u],
                                from_f16(v[slot_of(table, base + u, block_size) * kv_dim]), l[u]);
        float x[8];
        for (int i = 0; i < 8; i++) x[i] = (l[i] + l[16 + i]) + (l[8 + i] + l[24 + i]);
        r = ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
    }
    long long q_dim = heads * HEAD_DIM, first = (long long)t * q_dim + head * HEAD_DIM;
    int block = (head * HEAD_DIM + dim) / QK;
    quantize_block(r, q + first + dim / QK * QK, d + t * (q_dim / QK) + block,
                   s + t * (q_dim / QK) + block);
}

// One block per row: the index of its largest logit (the lowest index among equals).
extern "C" __global__ void argmax(const float* logits, int vocab, int* out) {
    __shared__ float best_v[THREADS];
    __shared__ int best_i[THREADS];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float v = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += THREADS)
        if (row[i] > v) {
            v = row[i];
            idx = i;
        }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = idx;
    __syncthreads();
    for (int s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = best_v[threadIdx.x + s];
            int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] ||
                (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}

// Sampling with top-k: each row's best k tokens by logit over the row's temperature, ties to
// the lower id (the host's order, sample/mod.rs), as (id, logit) pairs in no particular order;
// k is cut to TOP_K_MAX and rows with k = 0 are skipped. The k-th best is found by radix
// selection on a 64-bit key (the value's bits made order-preserving, then the inverted id, so
// no two keys tie), eight bits a pass; then every token whose key is at or above it is taken.
#define TOP_K_MAX 1024
typedef unsigned long long u64;

__device__ __forceinline__ u64 rank_key(float v, int id) {
    unsigned bits = __float_as_uint(v);
    unsigned order = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return ((u64)order << 32) | (u64)(~(unsigned)id);
}

extern "C" __global__ void top_k(const float* logits, int vocab, const int* ks,
                                 const float* temperatures, int* ids, float* values) {
    __shared__ unsigned counts[256];
    __shared__ u64 kth;
    __shared__ unsigned remaining, taken;
    const int k = min(ks[blockIdx.x], min(vocab, TOP_K_MAX));
    if (k <= 0) return;
    const float* row = logits + (long long)blockIdx.x * vocab;
    const float t = temperatures[blockIdx.x];
    if (threadIdx.x == 0) {
        kth = 0;
        remaining = (unsigned)k;
        taken = 0;
    }
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += THREADS) counts[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += THREADS) {
            u64 key = rank_key(row[i] / t, i);
            // Only keys that begin with the bytes chosen so far (none at first).
            if (shift == 56 || (key >> (shift + 8)) == kth)
                atomicAdd(&counts[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned above = 0;
            int b = 255;
            while (above + counts[b] < remaining) above += counts[b--];
            kth = (kth << 8) | (u64)b;
            remaining -= above;
        }
        __syncthreads();
    }
    int* row_ids = ids + (long long)blockIdx.x * TOP_K_MAX;
    float* row_values = values + (long long)blockIdx.x * TOP_K_MAX;
    for (int i = threadIdx.x; i < vocab; i += THREADS) {
        if (rank_key(row[i] / t, i) >= kth) {
            unsigned slot = atomicAdd(&taken, 1u);
            row_ids[slot] = i;
            row_values[slot] = row[i];
        }
    }
}
