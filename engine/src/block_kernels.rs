//! The transformer block's elementwise kernels (CUDA C in [`crate::kernel_source`], NVRTC):
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
