//! The output layer and its soft-capped cross-entropy, forward and backward together, in chunks
//! of rows, so that the fp32 logits are never materialised.
//!
//! Unfused (autograd, eager PyTorch), a d12 step at batch 16 x 2048 writes 6.6 GB of fp32 logits
//! and reads and writes them again in the cast, the soft-cap's divide, tanh and multiply, the
//! log-softmax and the loss, forward and backward: about 20 passes. Here, per chunk of rows:
//! one matmul writes the chunk's bf16 logits; one kernel ([`crate::kernels::softcap_xent`])
//! reads them twice and overwrites them with their gradient; two matmuls turn that into the
//! gradients of the hidden states and of the LM head (accumulated in fp32). The loss and the
//! gradients are computed at once, so the backward pass of the layers below starts from the
//! hidden states' gradient (see `Gpt::loss_and_grads`).
//!
//! On the CPU (and on a GPU whose NVRTC cannot be loaded) the same chunked algorithm runs with
//! tensor ops in fp32 ([`softcap_xent_reference`]): that is the reference the kernel is tested
//! against, and it is itself tested against autograd on the unfused loss.
use anyhow::Result;
use tch::{Kind, Tensor};

/// Bytes of logits per chunk: 512 MiB (5,341 rows of a 50,257-token vocabulary in bf16), large
/// enough that the three matmuls run at full rate.
const CHUNK_BYTES: i64 = 512 << 20;

/// How the loss kernel ran, for the launch receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Our NVRTC kernel on bf16 logits.
    Kernel,
    /// Tensor ops in fp32 (CPU, or no NVRTC).
    TensorOps,
}

pub struct Output {
    /// The mean loss over counted targets (0-d fp32, detached, not scaled).
    pub loss: Tensor,
    /// Gradient of `scale * loss` with respect to the hidden states (N x d, their kind).
    pub d_hidden: Tensor,
    /// Gradient of `scale * loss` with respect to the LM head (V x d, fp32).
    pub d_weight: Tensor,
}

/// Rows per chunk for a vocabulary of `vocab` in `kind`.
pub fn chunk_rows(vocab: i64, kind: Kind) -> i64 {
    let elem = if kind == Kind::Float { 4 } else { 2 };
    (CHUNK_BYTES / (padded(vocab) * elem)).max(1)
}

/// The vocabulary rounded up to a multiple of 64. A row of logits whose length is odd (GPT-2's
/// 50,257) is not 16-byte aligned, and cuBLAS then falls back to slow `align1` kernels for
/// every matmul that touches it: on an H200 the LM head's three matmuls took 61 ms of a 200 ms
/// d12 step that way (nanochat pads its vocabulary for the same reason). The padding rows of
/// the weight are zero and the loss ignores the padding columns.
pub fn padded(vocab: i64) -> i64 {
    (vocab + 63) / 64 * 64
}

/// Loss and gradients of `scale * mean_i CE(cap * tanh(h_i W^T / cap), t_i)` over the rows `h`
/// (N x d, detached, the compute kind), the fp32 master weight `w` (V x d) and targets `t` (N,
/// int64; negative = ignored), `rows` rows at a time.
pub fn softcapped_xent(
    h: &Tensor,
    w: &Tensor,
    t: &Tensor,
    cap: f64,
    scale: f64,
    rows: i64,
    path: Path,
) -> Result<Output> {
    let _g = tch::no_grad_guard();
    let (n, d) = h.size2()?;
    let device = h.device();
    let (v, vp) = (w.size()[0], padded(w.size()[0]));
    let wc = if vp == v {
        w.to_kind(h.kind())
    } else {
        let p = Tensor::zeros([vp, d], (h.kind(), device));
        p.narrow(0, 0, v).copy_(w);
        p
    };
    let counted = t.ge(0).sum(Kind::Float).clamp_min(1.0);
    // The gradient scale as a device value: no host round trip per step.
    let grad_scale = counted.reciprocal() * scale;
    let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
    let d_hidden = Tensor::empty_like(h);
    let mut d_weight: Option<Tensor> = None;
    let mut start = 0;
    while start < n {
        let len = rows.min(n - start);
        let hc = h.narrow(0, start, len);
        let tc = t.narrow(0, start, len);
        let logits = hc.mm(&wc.tr());
        let row_loss = match path {
            Path::Kernel => crate::kernels::softcap_xent(&logits, v, &tc, &grad_scale, cap)?,
            Path::TensorOps => softcap_xent_reference(&logits, v, &tc, &grad_scale, cap),
        };
        loss_sum += row_loss.sum(Kind::Float);
        let _ = logits.mm_out(&d_hidden.narrow(0, start, len), &wc);
        d_weight = Some(match d_weight {
            None => mm_fp32(&logits.tr(), &hc),
            Some(acc) => addmm_fp32(&acc, &logits.tr(), &hc),
        });
        start += len;
    }
    let d_weight = match d_weight {
        Some(g) if vp != v => g.narrow(0, 0, v),
        Some(g) => g,
        None => Tensor::zeros_like(w),
    };
    Ok(Output { loss: loss_sum / counted, d_hidden, d_weight })
}

/// `a @ b` with an fp32 result, for bf16 operands without rounding the product to bf16.
fn mm_fp32(a: &Tensor, b: &Tensor) -> Tensor {
    if a.kind() == Kind::Float {
        return a.mm(b);
    }
    a.f_mm_dtype(b, Kind::Float).unwrap_or_else(|_| a.mm(b).to_kind(Kind::Float))
}

/// `acc + a @ b`, fp32 `acc`.
fn addmm_fp32(acc: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
    if a.kind() == Kind::Float {
        return acc.addmm(a, b);
    }
    acc.f_addmm_dtype(a, b, Kind::Float).unwrap_or_else(|_| acc + a.mm(b).to_kind(Kind::Float))
}

/// The kernel's arithmetic in tensor ops (fp32): overwrites the first `vocab` columns of
/// `logits` with their gradient times `scale`, the rest (padding) with 0, and returns each row's
/// loss. See [`crate::kernels`] for the formula.
pub fn softcap_xent_reference(
    logits: &Tensor,
    vocab: i64,
    targets: &Tensor,
    scale: &Tensor,
    cap: f64,
) -> Tensor {
    let x = logits.narrow(1, 0, vocab).to_kind(Kind::Float);
    let r = (&x / cap).tanh();
    let z = &r * cap;
    let lse = z.logsumexp([1], true);
    let valid = targets.ge(0);
    let safe = targets.clamp_min(0).unsqueeze(1);
    let z_t = z.gather(1, &safe, false);
    let row_loss = ((&lse - z_t).squeeze_dim(1)) * valid.to_kind(Kind::Float);
    let onehot = Tensor::zeros_like(&z).scatter_value(1, &safe, 1.0);
    let row_scale = valid.to_kind(Kind::Float).unsqueeze(1) * scale;
    let g = ((z - lse).exp() - onehot) * (1.0 - r.square()) * row_scale;
    logits.narrow(1, 0, vocab).copy_(&g);
    let pad = logits.size()[1] - vocab;
    if pad > 0 {
        let _ = logits.narrow(1, vocab, pad).fill_(0.0);
    }
    row_loss
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    /// The unfused loss through autograd: the numbers the chunked path must reproduce.
    fn autograd(h: &Tensor, w: &Tensor, t: &Tensor, cap: f64, scale: f64) -> (f64, Tensor, Tensor) {
        let h = h.detach().set_requires_grad(true);
        let w = w.detach().set_requires_grad(true);
        let logits = (h.mm(&w.tr()) / cap).tanh() * cap;
        let loss = logits.cross_entropy_loss(t, None::<Tensor>, tch::Reduction::Mean, -1, 0.0);
        let g = Tensor::run_backward(&[&loss * scale], &[&h, &w], false, false);
        (loss.double_value(&[]), g[0].shallow_clone(), g[1].shallow_clone())
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f64 {
        let scale = b.abs().max().double_value(&[]).max(1e-30);
        (a - b).abs().max().double_value(&[]) / scale
    }

    #[test]
    fn the_chunked_loss_matches_autograd_on_the_unfused_loss() {
        tch::manual_seed(3);
        let (n, d, v) = (37, 16, 101);
        // Logits of a few units, so the soft-cap of 3 bends them.
        let h = Tensor::randn([n, d], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([v, d], (Kind::Float, Device::Cpu)) * 0.8;
        let t = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
        // Two ignored rows.
        let _ = t.get(5).fill_(-1);
        let _ = t.get(30).fill_(-1);
        let (cap, scale) = (3.0, 0.5);
        let (loss, dh, dw) = autograd(&h, &w, &t, cap, scale);
        // 37 rows in chunks of 8 (a short last chunk), of 37 and of 1.
        for rows in [8, 37, 1] {
            let out = softcapped_xent(&h, &w, &t, cap, scale, rows, Path::TensorOps).unwrap();
            let l = out.loss.double_value(&[]);
            assert!((l - loss).abs() < 1e-5 * loss, "rows {rows}: loss {l} vs {loss}");
            assert!(
                max_rel(&out.d_hidden, &dh) < 1e-5,
                "rows {rows}: d_hidden {}",
                max_rel(&out.d_hidden, &dh)
            );
            assert!(
                max_rel(&out.d_weight, &dw) < 1e-5,
                "rows {rows}: d_weight {}",
                max_rel(&out.d_weight, &dw)
            );
            assert_eq!(out.d_weight.kind(), Kind::Float);
        }
    }

    #[test]
    fn ignored_rows_carry_neither_loss_nor_gradient() {
        // Two padding columns after the 7 logits: they change nothing and get gradient 0.
        let logits = Tensor::randn([3, 9], (Kind::Float, Device::Cpu));
        let unpadded = logits.narrow(1, 0, 7).copy();
        let t = Tensor::from_slice(&[2i64, -1, 6]);
        let scale = Tensor::from(1.0f32);
        let row_loss = softcap_xent_reference(&logits, 7, &t, &scale, 15.0);
        let same = softcap_xent_reference(&unpadded, 7, &t, &scale, 15.0);
        assert_eq!(f64::try_from((&row_loss - same).abs().max()).unwrap(), 0.0);
        assert_eq!(logits.narrow(1, 7, 2).abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert_eq!(row_loss.double_value(&[1]), 0.0);
        assert!(row_loss.double_value(&[0]) > 0.0);
        assert_eq!(logits.get(1).abs().sum(Kind::Float).double_value(&[]), 0.0);
        // Each counted row's gradient sums to ~0 before the tanh factor bends it, and its target
        // entry is the only negative one.
        assert!(logits.double_value(&[0, 2]) < 0.0);
        assert!(logits.double_value(&[2, 6]) < 0.0);
    }

    /// On a GPU: our kernel on bf16 logits against the fp32 reference, and the whole chunked
    /// path against autograd in bf16. Skipped (and says so) without one.
    #[test]
    fn the_kernel_matches_the_reference_on_a_gpu() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device (the kernel needs a GPU; its reference ran above)");
            return;
        }
        let dev = Device::Cuda(0);
        if let Err(why) = crate::kernels::available(dev) {
            panic!("CUDA is here but our kernels are not: {why}");
        }
        tch::manual_seed(5);
        // GPT-2's odd vocabulary in rows padded to 50,304 columns.
        let (n, v) = (300, 50_257);
        let logits = (Tensor::randn([n, padded(v)], (Kind::Float, dev)) * 6.0).to_kind(Kind::BFloat16);
        let t = Tensor::randint(v, [n], (Kind::Int64, dev));
        let _ = t.get(7).fill_(-1);
        let scale = Tensor::from(1.0f32 / 299.0).to_device(dev);
        let reference = logits.to_kind(Kind::Float);
        let ref_loss = softcap_xent_reference(&reference, v, &t, &scale, 15.0);
        let before = crate::kernels::launches();
        let got = logits.copy();
        let loss = crate::kernels::softcap_xent(&got, v, &t, &scale, 15.0).unwrap();
        assert_eq!(crate::kernels::launches(), before + 1, "the kernel did not run");
        assert!(max_rel(&loss, &ref_loss) < 1e-5, "row losses: {}", max_rel(&loss, &ref_loss));
        let pad =
            got.narrow(1, v, padded(v) - v).to_kind(Kind::Float).abs().sum(Kind::Float).double_value(&[]);
        assert_eq!(pad, 0.0, "padding columns got a gradient");
        // The gradient, rounded to bf16 once.
        let err = max_rel(&got.to_kind(Kind::Float), &reference);
        assert!(err < 1e-2, "gradients: {err}");

        // The whole chunked path against autograd, in fp32 weights with bf16 compute.
        let (n, d) = (2048, 256);
        let h = (Tensor::randn([n, d], (Kind::Float, dev)) * 0.5).to_kind(Kind::BFloat16);
        let w = Tensor::randn([v, d], (Kind::Float, dev)) * 0.2;
        let t = Tensor::randint(v, [n], (Kind::Int64, dev));
        let fused = softcapped_xent(&h, &w, &t, 15.0, 1.0, 700, Path::Kernel).unwrap();
        let ops = softcapped_xent(&h, &w, &t, 15.0, 1.0, 700, Path::TensorOps).unwrap();
        let (lf, lo) = (fused.loss.double_value(&[]), ops.loss.double_value(&[]));
        assert!((lf - lo).abs() < 1e-4 * lo, "loss {lf} vs {lo}");
        assert!(max_rel(&fused.d_hidden, &ops.d_hidden) < 2e-2);
        assert!(max_rel(&fused.d_weight, &ops.d_weight) < 2e-2);
    }
}
