//! The transformer block's fused elementwise ops, as autograd ops with hand-written backwards
//! ([`crate::custom_op`]): on a GPU each pass is one of [`crate::block_kernels`]' kernels; the
//! tensor-op versions here are their reference, which the CPU tests hold to autograd on the
//! unfused composition (the model itself runs them unfused on the CPU, where the parity test
//! holds it to PyTorch step for step).
//!
//! - [`rope_norm`]: rotary embedding, RMSNorm over the head and the QK scale (nanochat's
//!   `norm(rope(q)) * 1.2`): ten libtorch kernels forward and backward become one each.
//! - [`relu_square`]: `relu(u)^2`, the MLP's activation.
//! - [`resid_mix`]: `a x + b x0`, the per-layer residual and x0 scalars.
use std::sync::{Arc, OnceLock};

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};

use crate::block_kernels as k;
use crate::custom_op::{self, Op};

/// nanochat's scale of the normed queries and keys.
pub const QK_SCALE: f64 = 1.2;

/// The RMSNorm epsilon libtorch uses when none is given (fp32's, for bf16 inputs too).
const EPS: f64 = f32::EPSILON as f64;

fn on_gpu_bf16(ts: &[&Tensor]) -> bool {
    ts.iter().all(|t| t.device().is_cuda() && t.kind() == Kind::BFloat16)
}

/// rope over the last dim of `x` (B, T, H, D) in fp32, with `cos`/`sin` (T', D/2).
fn rope_f32(x: &Tensor, cos: &Tensor, sin: &Tensor, transpose: bool) -> Tensor {
    let (_, t, _, d) = x.size4().expect("(B, T, H, D)");
    let half = d / 2;
    let c = cos.narrow(0, 0, t).to_kind(Kind::Float).view([1, t, 1, half]);
    let s = sin.narrow(0, 0, t).to_kind(Kind::Float).view([1, t, 1, half]);
    let s = if transpose { -s } else { s };
    let x = x.to_kind(Kind::Float);
    let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
    Tensor::cat(&[&x1 * &c + &x2 * &s, &x2 * &c - &x1 * &s], 3)
}

fn rstd(r: &Tensor) -> Tensor {
    (r.square().mean_dim([-1i64].as_slice(), true, Kind::Float) + EPS).rsqrt()
}

/// `scale * rmsnorm(rope(x))`; inputs x (B, T, H, D), cos, sin (T', D/2).
struct RopeNorm {
    scale: f64,
}

impl Op for RopeNorm {
    fn name(&self) -> &'static str {
        "rope_norm"
    }
    fn outputs(&self) -> usize {
        1
    }
    fn forward(&self, i: &[Tensor]) -> Result<Vec<Tensor>> {
        let (x, cos, sin) = (&i[0], &i[1], &i[2]);
        if on_gpu_bf16(&[x, cos, sin]) && k::rope_fits(x, &[cos, sin]) {
            return Ok(vec![k::rope_norm_fwd(x, cos, sin, self.scale, EPS)?]);
        }
        let r = rope_f32(x, cos, sin, false);
        Ok(vec![(&r * rstd(&r) * self.scale).to_kind(x.kind())])
    }
    fn backward(&self, i: &[Tensor], _: &[Tensor], g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (x, cos, sin) = (&i[0], &i[1], &i[2]);
        if on_gpu_bf16(&[x, cos, sin, &g[0]]) && k::rope_fits(x, &[cos, sin]) {
            let g = if k::rope_fits(&g[0], &[]) { g[0].shallow_clone() } else { g[0].contiguous() };
            return Ok(vec![Some(k::rope_norm_bwd(x, &g, cos, sin, self.scale, EPS)?), None, None]);
        }
        let d = x.size()[3] as f64;
        let r = rope_f32(x, cos, sin, false);
        let rs = rstd(&r);
        let gf = g[0].to_kind(Kind::Float);
        let dot = (&gf * &r).sum_dim_intlist([-1i64].as_slice(), true, Kind::Float);
        let dr = (&gf - &r * rs.square() * dot / d) * &rs * self.scale;
        Ok(vec![Some(rope_f32(&dr, cos, sin, true).to_kind(x.kind())), None, None])
    }
}

/// `relu(u)^2`.
struct ReluSquare;

impl Op for ReluSquare {
    fn name(&self) -> &'static str {
        "relu_square"
    }
    fn outputs(&self) -> usize {
        1
    }
    fn forward(&self, i: &[Tensor]) -> Result<Vec<Tensor>> {
        let u = &i[0];
        if on_gpu_bf16(&[u]) && k::vectorizable(u, 8) {
            return Ok(vec![k::relu_square_fwd(u)?]);
        }
        Ok(vec![u.to_kind(Kind::Float).relu().square().to_kind(u.kind())])
    }
    fn backward(&self, i: &[Tensor], _: &[Tensor], g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let u = &i[0];
        let g = g[0].contiguous();
        if on_gpu_bf16(&[u, &g]) && k::vectorizable(u, 8) && k::vectorizable(&g, 8) {
            return Ok(vec![Some(k::relu_square_bwd(u, &g)?)]);
        }
        let du = u.to_kind(Kind::Float).relu() * 2.0 * g.to_kind(Kind::Float);
        Ok(vec![Some(du.to_kind(u.kind()))])
    }
}

/// `a x + b x0`; inputs x, x0 (one shape), a, b (0-d).
struct ResidMix;

impl Op for ResidMix {
    fn name(&self) -> &'static str {
        "resid_mix"
    }
    fn outputs(&self) -> usize {
        1
    }
    fn forward(&self, i: &[Tensor]) -> Result<Vec<Tensor>> {
        let (x, x0, a, b) = (&i[0], &i[1], &i[2], &i[3]);
        if x.size() != x0.size() || a.numel() != 1 || b.numel() != 1 {
            bail!("resid_mix: x {:?}, x0 {:?}, a and b must be one value each", x.size(), x0.size());
        }
        if on_gpu_bf16(&[x, x0, a, b]) && k::vectorizable(x, 4) && k::vectorizable(x0, 4) {
            return Ok(vec![k::resid_mix_fwd(x, x0, a, b)?]);
        }
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        Ok(vec![(f(x) * f(a) + f(x0) * f(b)).to_kind(x.kind())])
    }
    fn backward(&self, i: &[Tensor], _: &[Tensor], g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let (x, x0, a, b) = (&i[0], &i[1], &i[2], &i[3]);
        let g = g[0].contiguous();
        if on_gpu_bf16(&[x, x0, a, b, &g]) && [x, x0, &g].iter().all(|t| k::vectorizable(t, 4)) {
            let (dx, dx0, sums) = k::resid_mix_bwd(x, x0, a, b, &g)?;
            let da = sums.get(0).to_kind(a.kind()).reshape(a.size());
            let db = sums.get(1).to_kind(b.kind()).reshape(b.size());
            return Ok(vec![Some(dx), Some(dx0), Some(da), Some(db)]);
        }
        let f = |t: &Tensor| t.to_kind(Kind::Float);
        let gf = f(&g);
        let da = (&gf * f(x)).sum(Kind::Float).to_kind(a.kind()).reshape(a.size());
        let db = (&gf * f(x0)).sum(Kind::Float).to_kind(b.kind()).reshape(b.size());
        Ok(vec![
            Some((&gf * f(a)).to_kind(x.kind())),
            Some((&gf * f(b)).to_kind(x0.kind())),
            Some(da),
            Some(db),
        ])
    }
}

struct Ids {
    rope_norm: i64,
    relu_square: i64,
    resid_mix: i64,
}

fn ids() -> &'static Ids {
    static IDS: OnceLock<Ids> = OnceLock::new();
    IDS.get_or_init(|| Ids {
        rope_norm: custom_op::register(Arc::new(RopeNorm { scale: QK_SCALE })),
        relu_square: custom_op::register(Arc::new(ReluSquare)),
        resid_mix: custom_op::register(Arc::new(ResidMix)),
    })
}

fn one(id: i64, inputs: &[&Tensor]) -> Result<Tensor> {
    Ok(custom_op::apply(id, inputs)?.remove(0))
}

/// `QK_SCALE * rmsnorm(rope(x))` for `x` (B, T, H, D) and `cos`, `sin` (T' >= T, D/2), contiguous.
pub fn rope_norm(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    one(ids().rope_norm, &[x, cos, sin])
}

/// `relu(u)^2`.
pub fn relu_square(u: &Tensor) -> Result<Tensor> {
    one(ids().relu_square, &[u])
}

/// `a x + b x0` with `a`, `b` one value each (gradients flow to all four).
pub fn resid_mix(x: &Tensor, x0: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    one(ids().resid_mix, &[x, x0, a, b])
}

/// Whether the block's ops can run fused on `device` (a GPU whose NVRTC loads).
pub fn available(device: Device) -> std::result::Result<(), String> {
    crate::kernels::available(device)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        (&a - &b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-12)
    }

    /// The model's unfused composition (as `Gpt::attention` writes it without fused ops).
    fn rope_norm_plain(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (_, t, _, d) = x.size4().unwrap();
        let half = d / 2;
        let c = cos.narrow(0, 0, t).view([1, t, 1, half]);
        let s = sin.narrow(0, 0, t).view([1, t, 1, half]);
        let (x1, x2) = (x.narrow(3, 0, half), x.narrow(3, half, half));
        let r = Tensor::cat(&[&x1 * &c + &x2 * &s, &x2 * &c - &x1 * &s], 3);
        r.rms_norm([d], None::<Tensor>, None) * QK_SCALE
    }

    fn tables(t: i64, half: i64, kind: Kind, device: Device) -> (Tensor, Tensor) {
        let f = Tensor::arange(t, (Kind::Float, device)).outer(&Tensor::rand([half], (Kind::Float, device)));
        (f.cos().to_kind(kind), f.sin().to_kind(kind))
    }

    /// Forward and every input's gradient of `fused` against autograd over `plain`.
    fn check(
        fused: impl Fn(&[Tensor]) -> Tensor,
        plain: impl Fn(&[Tensor]) -> Tensor,
        inputs: &[Tensor],
        grad_of: &[usize],
        tol: f64,
    ) {
        let leaf = |ts: &[Tensor]| -> Vec<Tensor> {
            ts.iter()
                .enumerate()
                .map(|(i, t)| t.detach().copy().set_requires_grad(grad_of.contains(&i)))
                .collect()
        };
        let (a, b) = (leaf(inputs), leaf(inputs));
        let (ya, yb) = (fused(&a), plain(&b));
        assert!(rel(&ya, &yb) < tol, "forward: {}", rel(&ya, &yb));
        let dy = Tensor::randn_like(&yb.to_kind(Kind::Float)).to_kind(yb.kind());
        let wrt = |ts: &[Tensor]| grad_of.iter().map(|&i| ts[i].shallow_clone()).collect::<Vec<_>>();
        let (wa, wb) = (wrt(&a), wrt(&b));
        let ga = Tensor::run_backward(
            &[(&ya * &dy).sum(Kind::Float)],
            &wa.iter().collect::<Vec<_>>(),
            false,
            false,
        );
        let gb = Tensor::run_backward(
            &[(&yb * &dy).sum(Kind::Float)],
            &wb.iter().collect::<Vec<_>>(),
            false,
            false,
        );
        for (n, (x, y)) in grad_of.iter().zip(ga.iter().zip(&gb)) {
            assert!(rel(x, y) < tol, "gradient of input {n}: {}", rel(x, y));
        }
    }

    #[test]
    fn rope_norm_reference_equals_autograd() {
        tch::manual_seed(1);
        let (cos, sin) = tables(10, 8, Kind::Float, Device::Cpu);
        let x = Tensor::randn([2, 6, 3, 16], (Kind::Float, Device::Cpu)) * 3.0;
        check(
            |i| rope_norm(&i[0], &i[1], &i[2]).unwrap(),
            |i| rope_norm_plain(&i[0], &i[1], &i[2]),
            &[x, cos, sin],
            &[0],
            1e-5,
        );
        // A non-contiguous gradient (as attention's backward hands it over) changes nothing.
        let x = Tensor::randn([2, 6, 3, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let (c, s) = tables(6, 8, Kind::Float, Device::Cpu);
        let y = rope_norm(&x, &c, &s).unwrap().transpose(1, 2).contiguous().transpose(1, 2);
        let g1 = Tensor::run_backward(&[y.sum(Kind::Float)], &[&x], false, false);
        let y2 = rope_norm(&x, &c, &s).unwrap();
        let g2 = Tensor::run_backward(&[y2.sum(Kind::Float)], &[&x], false, false);
        assert!(rel(&g1[0], &g2[0]) < 1e-6);
    }

    #[test]
    fn relu_square_reference_equals_autograd() {
        let u = Tensor::randn([5, 12], (Kind::Float, Device::Cpu));
        check(|i| relu_square(&i[0]).unwrap(), |i| i[0].relu().square(), &[u], &[0], 1e-6);
    }

    #[test]
    fn resid_mix_reference_equals_autograd_and_bad_shapes_are_named() {
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu));
        let (x, x0) = (r(&[4, 8]), r(&[4, 8]));
        let (a, b) = (Tensor::from(1.1f32), Tensor::from(0.2f32));
        check(
            |i| resid_mix(&i[0], &i[1], &i[2], &i[3]).unwrap(),
            |i| &i[0] * &i[2] + &i[1] * &i[3],
            &[x, x0, a.shallow_clone(), b.shallow_clone()],
            &[0, 1, 2, 3],
            1e-5,
        );
        let e = resid_mix(&r(&[4, 8]), &r(&[4, 9]), &a, &b).unwrap_err().to_string();
        assert!(e.contains("resid_mix") && e.contains("[4, 9]"), "{e}");
    }

    /// On a GPU: each kernel runs (the launch count grows) and matches autograd over the
    /// unfused bf16 composition, forward and backward. Skipped (and says so) without one.
    #[test]
    fn the_block_kernels_match_the_unfused_ops_on_a_gpu() {
        let dev = Device::Cuda(0);
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device (the references ran above)");
            return;
        }
        if let Err(why) = available(dev) {
            panic!("a GPU but no kernels: {why}");
        }
        tch::manual_seed(2);
        let bf = |t: Tensor| t.to_kind(Kind::BFloat16);
        let before = crate::kernels::launches();
        let (cos, sin) = tables(256, 64, Kind::BFloat16, dev);
        let x = bf(Tensor::randn([2, 200, 3, 128], (Kind::Float, dev)));
        check(
            |i| rope_norm(&i[0], &i[1], &i[2]).unwrap(),
            |i| rope_norm_plain(&i[0], &i[1], &i[2]),
            &[x, cos, sin],
            &[0],
            2e-2,
        );
        assert_eq!(crate::kernels::launches(), before + 2, "rope_norm's kernels did not both run");
        let u = bf(Tensor::randn([64, 3072], (Kind::Float, dev)));
        check(|i| relu_square(&i[0]).unwrap(), |i| i[0].relu().square(), &[u], &[0], 1e-2);
        assert_eq!(crate::kernels::launches(), before + 4, "relu_square's kernels did not both run");
        let (x, x0) = (
            bf(Tensor::randn([64, 768], (Kind::Float, dev))),
            bf(Tensor::randn([64, 768], (Kind::Float, dev))),
        );
        let ab = bf(Tensor::from_slice(&[1.1f32, 0.2]).to_device(dev));
        check(
            |i| resid_mix(&i[0], &i[1], &i[2].get(0), &i[2].get(1)).unwrap(),
            |i| &i[0] * i[2].get(0) + &i[1] * i[2].get(1),
            &[x, x0, ab],
            &[0, 1, 2],
            2e-2,
        );
        assert_eq!(crate::kernels::launches(), before + 6, "resid_mix's kernels did not both run");
    }
}
