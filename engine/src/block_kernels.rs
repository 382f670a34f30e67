//! The transformer block's elementwise kernels (NVRTC, built with [`crate::kernels`]' prelude):
//! each replaces a chain of libtorch kernels, forward and backward, that the profile of a d12
//! step showed as a third of its time (docs/gpu-results/2026-11-26-h200-4). Their numerics are
//! [`crate::fused_ops`]' tensor-op references, which the CPU tests hold to autograd; the GPU
//! tests launch these and compare.
//!
//! All tensors are bf16 (raw bits); every intermediate is fp32.
use anyhow::{Result, bail};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use tch::{Device, Kind, Tensor};

use crate::kernels::with_kernel;

pub(crate) const SOURCE: &str = r#"
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

/// Threads per block of every kernel here.
const THREADS: u32 = 256;

fn gpu_of(t: &Tensor, what: &str) -> Result<usize> {
    match t.device() {
        Device::Cuda(g) => Ok(g),
        d => bail!("{what}: tensor on {d:?}, not a GPU"),
    }
}

fn check_bf16(t: &Tensor, what: &str) -> Result<()> {
    if t.kind() != Kind::BFloat16 {
        bail!("{what}: expected bf16, got {:?}", t.kind());
    }
    Ok(())
}

/// Whether `t` can be read `n` bf16 at a time: contiguous, a multiple of `n` long, aligned.
pub(crate) fn vectorizable(t: &Tensor, n: usize) -> bool {
    t.is_contiguous() && t.numel().is_multiple_of(n) && (t.data_ptr() as usize).is_multiple_of(2 * n)
}

/// Whether the rope kernels take `x` (B, T, H, D) and tables `cos`/`sin`: D a multiple of 4 and
/// at most 256 (two passes of a warp), D contiguous, even strides, 4-byte aligned.
pub(crate) fn rope_fits(x: &Tensor, tables: &[&Tensor]) -> bool {
    let (s, d) = (x.stride(), x.size().last().copied().unwrap_or(0));
    s.len() == 4
        && s[3] == 1
        && s[..3].iter().all(|v| v % 2 == 0)
        && d % 4 == 0
        && d <= 256
        && (x.data_ptr() as usize).is_multiple_of(4)
        && tables.iter().all(|t| t.is_contiguous() && (t.data_ptr() as usize).is_multiple_of(4))
}

fn grid_for(n4: i64, cap: i64) -> u32 {
    ((n4 + THREADS as i64 - 1) / THREADS as i64).clamp(1, cap) as u32
}

fn config(blocks: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Strides of dims 0..3 of a (B, T, H, D) tensor whose last dim is contiguous.
fn row_strides(t: &Tensor, what: &str) -> Result<(i64, i64, i64)> {
    let s = t.stride();
    if s.len() != 4 || s[3] != 1 {
        bail!("{what}: expected (B, T, H, D) with D contiguous, got strides {s:?}");
    }
    Ok((s[0], s[1], s[2]))
}

/// [`crate::fused_ops::RopeNorm`]'s forward: `x` (B, T, H, D) bf16, `cos`/`sin` (T', D/2) bf16
/// contiguous with T' >= T.
pub(crate) fn rope_norm_fwd(x: &Tensor, cos: &Tensor, sin: &Tensor, scale: f64, eps: f64) -> Result<Tensor> {
    let gpu = gpu_of(x, "rope_norm")?;
    check_bf16(x, "rope_norm x")?;
    let (b, t, h, d) = x.size4()?;
    let (sb, st, sh) = row_strides(x, "rope_norm x")?;
    let y = Tensor::empty([b, t, h, d], (Kind::BFloat16, x.device()));
    let rows = b * t * h;
    if rows == 0 {
        return Ok(y);
    }
    let (xp, cp, sp, yp) =
        (x.data_ptr() as u64, cos.data_ptr() as u64, sin.data_ptr() as u64, y.data_ptr() as u64);
    let (t32, h32, d32) = (t as i32, h as i32, d as i32);
    let (scale, eps) = (scale as f32, eps as f32);
    let blocks = u32::try_from((rows + 7) / 8)?;
    with_kernel(gpu, "rope_norm_fwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        l.arg(&xp).arg(&sb).arg(&st).arg(&sh).arg(&cp).arg(&sp).arg(&yp);
        l.arg(&rows).arg(&t32).arg(&h32).arg(&d32).arg(&scale).arg(&eps);
        // SAFETY: live bf16 tensors of the checked shapes on this GPU, kept by the caller until
        // the stream (libtorch's) has run the kernel.
        unsafe { l.launch(config(blocks)) }?;
        Ok(())
    })?;
    Ok(y)
}

/// [`crate::fused_ops::RopeNorm`]'s backward: dL/dx from `x` and `g` = dL/dy (both (B, T, H, D)).
pub(crate) fn rope_norm_bwd(
    x: &Tensor,
    g: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    scale: f64,
    eps: f64,
) -> Result<Tensor> {
    let gpu = gpu_of(x, "rope_norm")?;
    check_bf16(x, "rope_norm x")?;
    check_bf16(g, "rope_norm grad")?;
    let (b, t, h, d) = x.size4()?;
    let (sb, st, sh) = row_strides(x, "rope_norm x")?;
    let (gb, gt, gh) = row_strides(g, "rope_norm grad")?;
    let dx = Tensor::empty([b, t, h, d], (Kind::BFloat16, x.device()));
    let rows = b * t * h;
    if rows == 0 {
        return Ok(dx);
    }
    let (xp, gp, cp, sp, op) = (
        x.data_ptr() as u64,
        g.data_ptr() as u64,
        cos.data_ptr() as u64,
        sin.data_ptr() as u64,
        dx.data_ptr() as u64,
    );
    let (t32, h32, d32) = (t as i32, h as i32, d as i32);
    let (scale, eps) = (scale as f32, eps as f32);
    let blocks = u32::try_from((rows + 7) / 8)?;
    with_kernel(gpu, "rope_norm_bwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        l.arg(&xp).arg(&sb).arg(&st).arg(&sh).arg(&gp).arg(&gb).arg(&gt).arg(&gh);
        l.arg(&cp).arg(&sp).arg(&op).arg(&rows).arg(&t32).arg(&h32).arg(&d32).arg(&scale).arg(&eps);
        // SAFETY: as in rope_norm_fwd.
        unsafe { l.launch(config(blocks)) }?;
        Ok(())
    })?;
    Ok(dx)
}

/// relu(u)^2 (u contiguous bf16, [`vectorizable`] by 8).
pub(crate) fn relu_square_fwd(u: &Tensor) -> Result<Tensor> {
    let gpu = gpu_of(u, "relu_square")?;
    check_bf16(u, "relu_square")?;
    let h = Tensor::empty_like(u);
    let n8 = u.numel() as i64 / 8;
    let (up, hp) = (u.data_ptr() as u64, h.data_ptr() as u64);
    with_kernel(gpu, "relu_square_fwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        l.arg(&up).arg(&hp).arg(&n8);
        // SAFETY: as in rope_norm_fwd; both tensors hold 8 * n8 bf16 values, 16-byte aligned.
        unsafe { l.launch(config(grid_for(n8, 1 << 20))) }?;
        Ok(())
    })?;
    Ok(h)
}

/// 2 relu(u) dh (both contiguous bf16 of one shape, [`vectorizable`] by 8).
pub(crate) fn relu_square_bwd(u: &Tensor, dh: &Tensor) -> Result<Tensor> {
    let gpu = gpu_of(u, "relu_square")?;
    let du = Tensor::empty_like(u);
    let n8 = u.numel() as i64 / 8;
    let (up, gp, dp) = (u.data_ptr() as u64, dh.data_ptr() as u64, du.data_ptr() as u64);
    with_kernel(gpu, "relu_square_bwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        l.arg(&up).arg(&gp).arg(&dp).arg(&n8);
        // SAFETY: as in relu_square_fwd.
        unsafe { l.launch(config(grid_for(n8, 1 << 20))) }?;
        Ok(())
    })?;
    Ok(du)
}

/// a x + b x0 (x, x0 contiguous bf16 of one shape, [`vectorizable`] by 4; a, b one bf16 each).
pub(crate) fn resid_mix_fwd(x: &Tensor, x0: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let gpu = gpu_of(x, "resid_mix")?;
    let y = Tensor::empty_like(x);
    let n4 = x.numel() as i64 / 4;
    let (xp, x0p, ap, bp, yp) = (
        x.data_ptr() as u64,
        x0.data_ptr() as u64,
        a.data_ptr() as u64,
        b.data_ptr() as u64,
        y.data_ptr() as u64,
    );
    with_kernel(gpu, "resid_mix_fwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        l.arg(&xp).arg(&x0p).arg(&ap).arg(&bp).arg(&yp).arg(&n4);
        // SAFETY: as in relu_square_fwd; a and b are one bf16 each on this GPU.
        unsafe { l.launch(config(grid_for(n4, 1 << 20))) }?;
        Ok(())
    })?;
    Ok(y)
}

/// (dx, dx0, [<g, x>, <g, x0>] in fp32).
pub(crate) fn resid_mix_bwd(
    x: &Tensor,
    x0: &Tensor,
    a: &Tensor,
    b: &Tensor,
    g: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let gpu = gpu_of(x, "resid_mix")?;
    let (dx, dx0) = (Tensor::empty_like(x), Tensor::empty_like(x));
    let sums = Tensor::zeros([2], (Kind::Float, x.device()));
    let n4 = x.numel() as i64 / 4;
    let ptrs = [x, x0, a, b, g, &dx, &dx0, &sums].map(|t| t.data_ptr() as u64);
    with_kernel(gpu, "resid_mix_bwd", |stream, f| {
        let mut l = stream.launch_builder(f);
        for p in &ptrs {
            l.arg(p);
        }
        l.arg(&n4);
        // SAFETY: as in resid_mix_fwd; sums holds two fp32 values. Few blocks: each adds its
        // partial sums atomically.
        unsafe { l.launch(config(grid_for(n4, 2048))) }?;
        Ok(())
    })?;
    Ok((dx, dx0, sums))
}
