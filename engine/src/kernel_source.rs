//! The CUDA C of every kernel of the engine, compiled as one NVRTC program by
//! [`crate::kernels`] and launched by it ([`crate::kernels::softcap_xent`]) and by
//! [`crate::block_kernels`]. Text only: this module imports nothing.

/// What every kernel source shares: bf16 as raw bits (no CUDA headers needed by NVRTC) and
/// sums over a warp and over a block.
const PRELUDE: &str = r#"
__device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ float block_sum(float v, float* buf) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) buf[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? buf[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) buf[32] = v;
    }
    __syncthreads();
    return buf[32];
}
"#;

/// The soft-capped cross-entropy of one row of bf16 logits per block, forward and backward in
/// one kernel: it reads the row twice (the sum of `exp(z - cap)`, where `z = cap * tanh(x /
/// cap)` is at most `cap`, so no running maximum is needed; then the gradient) and overwrites
/// it with `dL/dx = (softmax(z) - onehot(t)) * (1 - (z/cap)^2) * scale` in bf16. Intermediates
/// are fp32, as `torch.compile`'s fused kernels keep them. A negative target is ignored: loss 0,
/// gradient 0. Rows are `stride` apart; the columns from `vocab` to `stride` (the padding that
/// keeps rows 16-byte aligned for the tensor cores) are not logits and get gradient 0. bf16 is
/// handled as raw bits ([`PRELUDE`]).
const SOFTCAP_XENT: &str = r#"
extern "C" __global__ void softcap_xent(unsigned short* logits, const long long* targets,
                                        float* row_loss, const float* scale_ptr, int vocab,
                                        int stride, float cap) {
    __shared__ float buf[33];
    __shared__ float target_z;
    unsigned short* x = logits + (long long)blockIdx.x * stride;
    const long long t = targets[blockIdx.x];
    const bool valid = t >= 0 && t < vocab;
    const float inv_cap = 1.f / cap;
    if (threadIdx.x == 0) target_z = valid ? cap * tanhf(bf16_to_f32(x[t]) * inv_cap) : 0.f;
    float s = 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float z = cap * tanhf(bf16_to_f32(x[j]) * inv_cap);
        s += expf(z - cap);
    }
    s = block_sum(s, buf);
    const float lse = cap + logf(s);
    const float scale = valid ? *scale_ptr : 0.f;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float z = cap * tanhf(bf16_to_f32(x[j]) * inv_cap);
        const float p = expf(z - lse) - (j == t ? 1.f : 0.f);
        const float r = z * inv_cap;
        x[j] = f32_to_bf16(p * (1.f - r * r) * scale);
    }
    for (int j = vocab + threadIdx.x; j < stride; j += blockDim.x) x[j] = 0;
    if (threadIdx.x == 0) row_loss[blockIdx.x] = valid ? lse - target_z : 0.f;
}
"#;

/// The transformer block's kernels ([`crate::block_kernels`] launches them).
const BLOCK: &str = r#"
// Rotary embedding, then RMSNorm over the head dimension, then a scale: y = scale * n(rope(x)),
// one warp per row of D (a head of a token; D a multiple of 4, at most 256). x is (B, T, H, D)
// with even strides sb, st, sh (D contiguous); cos and sin are (T, D/2); y is contiguous. rope:
// (x1, x2) -> (x1 c + x2 s, x2 c - x1 s) over the two halves. Each lane reads two neighbouring
// values of each half at a time (a warp reads 128 contiguous bytes) and keeps the row in
// registers between the sum of squares and the write.
#define ROPE_ITERS 2
__device__ __forceinline__ long long rope_row(long long row, int T, int H, long long sb,
                                              long long st, long long sh, int* t_out) {
    const int h = (int)(row % H);
    const long long bt = row / H;
    const int t = (int)(bt % T);
    *t_out = t;
    return (bt / T) * sb + (long long)t * st + (long long)h * sh;
}
__device__ __forceinline__ float lo16(unsigned int v) { return bf16_to_f32((unsigned short)(v & 0xffffu)); }
__device__ __forceinline__ float hi16(unsigned int v) { return bf16_to_f32((unsigned short)(v >> 16)); }
__device__ __forceinline__ unsigned int pack2(float a, float b) {
    return (unsigned int)f32_to_bf16(a) | ((unsigned int)f32_to_bf16(b) << 16);
}
__device__ __forceinline__ unsigned int ld2(const unsigned short* p) {
    return *(const unsigned int*)p;
}
// r[k] = rope of the lane's two pairs at p = 2 lane + 64 k: r[k][0..2] first half, [2..4] second.
__device__ __forceinline__ void rope_load(const unsigned short* xr, const unsigned short* c,
                                          const unsigned short* s, int half, int lane,
                                          float r[ROPE_ITERS][4], float cs[ROPE_ITERS][4]) {
#pragma unroll
    for (int k = 0; k < ROPE_ITERS; ++k) {
        const int p = 2 * lane + 64 * k;
        if (p < half) {
            const unsigned int a = ld2(xr + p), b = ld2(xr + half + p);
            const unsigned int cw = ld2(c + p), sw = ld2(s + p);
            const float x1[2] = {lo16(a), hi16(a)}, x2[2] = {lo16(b), hi16(b)};
            const float cc[2] = {lo16(cw), hi16(cw)}, sv[2] = {lo16(sw), hi16(sw)};
            for (int j = 0; j < 2; ++j) {
                r[k][j] = x1[j] * cc[j] + x2[j] * sv[j];
                r[k][2 + j] = x2[j] * cc[j] - x1[j] * sv[j];
                cs[k][j] = cc[j];
                cs[k][2 + j] = sv[j];
            }
        } else {
            for (int j = 0; j < 4; ++j) r[k][j] = cs[k][j] = 0.f;
        }
    }
}
extern "C" __global__ void rope_norm_fwd(const unsigned short* x, long long sb, long long st,
                                         long long sh, const unsigned short* cs,
                                         const unsigned short* sn, unsigned short* y,
                                         long long rows, int T, int H, int D, float scale,
                                         float eps) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, half = D >> 1;
    int t;
    const unsigned short* xr = x + rope_row(row, T, H, sb, st, sh, &t);
    float r[ROPE_ITERS][4], tab[ROPE_ITERS][4];
    rope_load(xr, cs + (long long)t * half, sn + (long long)t * half, half, lane, r, tab);
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < ROPE_ITERS; ++k)
        for (int j = 0; j < 4; ++j) ss += r[k][j] * r[k][j];
    const float m = rsqrtf(warp_sum(ss) / D + eps) * scale;
    unsigned short* yr = y + row * D;
#pragma unroll
    for (int k = 0; k < ROPE_ITERS; ++k) {
        const int p = 2 * lane + 64 * k;
        if (p < half) {
            *(unsigned int*)(yr + p) = pack2(r[k][0] * m, r[k][1] * m);
            *(unsigned int*)(yr + half + p) = pack2(r[k][2] * m, r[k][3] * m);
        }
    }
}
// dL/dx from x and g = dL/dy (strides gb, gt, gh, even): with r = rope(x), rstd = (mean r^2 +
// eps)^-1/2, dL/dr = scale rstd (g - r rstd^2 <g, r> / D), then rope's transpose.
extern "C" __global__ void rope_norm_bwd(const unsigned short* x, long long sb, long long st,
                                         long long sh, const unsigned short* g, long long gb,
                                         long long gt, long long gh, const unsigned short* cs,
                                         const unsigned short* sn, unsigned short* dx,
                                         long long rows, int T, int H, int D, float scale,
                                         float eps) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int lane = threadIdx.x & 31, half = D >> 1;
    int t;
    const unsigned short* xr = x + rope_row(row, T, H, sb, st, sh, &t);
    const unsigned short* gr = g + rope_row(row, T, H, gb, gt, gh, &t);
    float r[ROPE_ITERS][4], tab[ROPE_ITERS][4], gv[ROPE_ITERS][4];
    rope_load(xr, cs + (long long)t * half, sn + (long long)t * half, half, lane, r, tab);
    float ss = 0.f, dot = 0.f;
#pragma unroll
    for (int k = 0; k < ROPE_ITERS; ++k) {
        const int p = 2 * lane + 64 * k;
        if (p < half) {
            const unsigned int a = ld2(gr + p), b = ld2(gr + half + p);
            gv[k][0] = lo16(a); gv[k][1] = hi16(a); gv[k][2] = lo16(b); gv[k][3] = hi16(b);
        } else {
            for (int j = 0; j < 4; ++j) gv[k][j] = 0.f;
        }
        for (int j = 0; j < 4; ++j) {
            ss += r[k][j] * r[k][j];
            dot += gv[k][j] * r[k][j];
        }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    const float rstd = rsqrtf(ss / D + eps);
    const float coef = rstd * rstd * dot / D, m = scale * rstd;
    unsigned short* o = dx + row * D;
#pragma unroll
    for (int k = 0; k < ROPE_ITERS; ++k) {
        const int p = 2 * lane + 64 * k;
        if (p < half) {
            float d1[2], d2[2];
            for (int j = 0; j < 2; ++j) {
                const float a1 = m * (gv[k][j] - r[k][j] * coef);
                const float a2 = m * (gv[k][2 + j] - r[k][2 + j] * coef);
                const float cc = tab[k][j], sv = tab[k][2 + j];
                d1[j] = a1 * cc - a2 * sv;
                d2[j] = a1 * sv + a2 * cc;
            }
            *(unsigned int*)(o + p) = pack2(d1[0], d1[1]);
            *(unsigned int*)(o + half + p) = pack2(d2[0], d2[1]);
        }
    }
}
// Four bf16 values in 8 bytes.
__device__ __forceinline__ float lane4(unsigned long long v, int k) {
    return bf16_to_f32((unsigned short)(v >> (16 * k)));
}
__device__ __forceinline__ unsigned long long pack4(const float* f) {
    unsigned long long r = 0;
    for (int k = 0; k < 4; ++k) r |= (unsigned long long)f32_to_bf16(f[k]) << (16 * k);
    return r;
}
#define GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)gridDim.x * blockDim.x)
// Eight bf16 values in 16 bytes.
struct __attribute__((aligned(16))) bf16x8 { unsigned long long lo, hi; };
__device__ __forceinline__ float lane8(const bf16x8& v, int k) {
    return lane4(k < 4 ? v.lo : v.hi, k & 3);
}
// h = relu(u)^2 over n8 groups of eight.
extern "C" __global__ void relu_square_fwd(const bf16x8* u, bf16x8* h, long long n8) {
    GRID_STRIDE(i, n8) {
        const bf16x8 a = u[i];
        float f[8];
        for (int k = 0; k < 8; ++k) {
            const float v = lane8(a, k);
            f[k] = v > 0.f ? v * v : 0.f;
        }
        bf16x8 o;
        o.lo = pack4(f);
        o.hi = pack4(f + 4);
        h[i] = o;
    }
}
// du = 2 relu(u) dh.
extern "C" __global__ void relu_square_bwd(const bf16x8* u, const bf16x8* dh, bf16x8* du,
                                           long long n8) {
    GRID_STRIDE(i, n8) {
        const bf16x8 a = u[i], g = dh[i];
        float f[8];
        for (int k = 0; k < 8; ++k) {
            const float v = lane8(a, k);
            f[k] = v > 0.f ? 2.f * v * lane8(g, k) : 0.f;
        }
        bf16x8 o;
        o.lo = pack4(f);
        o.hi = pack4(f + 4);
        du[i] = o;
    }
}
// The residual stream's mix: y = a x + b x0 (a, b: one bf16 each, on the device).
extern "C" __global__ void resid_mix_fwd(const unsigned long long* x,
                                         const unsigned long long* x0,
                                         const unsigned short* a, const unsigned short* b,
                                         unsigned long long* y, long long n4) {
    const float fa = bf16_to_f32(*a), fb = bf16_to_f32(*b);
    GRID_STRIDE(i, n4) {
        const unsigned long long p = x[i], q = x0[i];
        float f[4];
        for (int k = 0; k < 4; ++k) f[k] = fa * lane4(p, k) + fb * lane4(q, k);
        y[i] = pack4(f);
    }
}
// dx = a g, dx0 = b g, and sums[0] += <g, x>, sums[1] += <g, x0> (fp32, zeroed by the caller).
extern "C" __global__ void resid_mix_bwd(const unsigned long long* x,
                                         const unsigned long long* x0,
                                         const unsigned short* a, const unsigned short* b,
                                         const unsigned long long* g, unsigned long long* dx,
                                         unsigned long long* dx0, float* sums, long long n4) {
    __shared__ float buf[33];
    const float fa = bf16_to_f32(*a), fb = bf16_to_f32(*b);
    float sa = 0.f, sb = 0.f;
    GRID_STRIDE(i, n4) {
        const unsigned long long p = x[i], q = x0[i], d = g[i];
        float fx[4], fx0[4];
        for (int k = 0; k < 4; ++k) {
            const float gk = lane4(d, k);
            sa += gk * lane4(p, k);
            sb += gk * lane4(q, k);
            fx[k] = fa * gk;
            fx0[k] = fb * gk;
        }
        dx[i] = pack4(fx);
        dx0[i] = pack4(fx0);
    }
    sa = block_sum(sa, buf);
    sb = block_sum(sb, buf);
    if (threadIdx.x == 0) {
        atomicAdd(&sums[0], sa);
        atomicAdd(&sums[1], sb);
    }
}
"#;

/// Every kernel's source, as one NVRTC program.
pub(crate) fn source() -> String {
    [PRELUDE, SOFTCAP_XENT, BLOCK].concat()
}

/// The kernels' entry points (each `extern "C" __global__` in [`source`]).
pub(crate) const ENTRIES: [&str; 7] = [
    "softcap_xent",
    "rope_norm_fwd",
    "rope_norm_bwd",
    "relu_square_fwd",
    "relu_square_bwd",
    "resid_mix_fwd",
    "resid_mix_bwd",
];
