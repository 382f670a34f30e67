//! nanochat's AdamW step over a list of tensors as one fused libtorch kernel
//! (`at::_fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs), through the C++ shim
//! `csrc/fused_adamw.cpp` because tch does not bind it.
//!
//! Why: the same update written as tensor ops (decay, two lerps, a square, bias corrections,
//! sqrt, eps, divide, scale, add) makes about 24 passes over memory per parameter; the fused
//! kernel reads parameter, gradient and both moments once and writes three of them once. The
//! AdamW parameters of a nanochat model are its embeddings, LM head and value embeddings (about
//! 300 M of a d12's parameters), so this is ~8 ms of a 232 ms d12 step on an H100.
//!
//! The arithmetic equals `optim::adamw_reference` (kept for tests): decoupled weight decay
//! `p *= 1 - lr*wd`, `m = lerp(m, g, 1-b1)`, `v = b2*v + (1-b2)*g^2`, and
//! `p -= lr / (1-b1^t) * m / (sqrt(v) / sqrt(1-b2^t) + eps)`, in fp32.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};

use tch::Tensor;

unsafe extern "C" {
    #[allow(clippy::too_many_arguments)]
    fn trainyard_fused_adamw(
        params: *const *const c_void,
        grads: *const *const c_void,
        exp_avgs: *const *const c_void,
        exp_avg_sqs: *const *const c_void,
        steps: *const *const c_void,
        n: usize,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// One AdamW group's hyper-parameters for this step.
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub lr: f64,
    pub betas: (f64, f64),
    pub weight_decay: f64,
    pub eps: f64,
}

/// The tensors of one fused call, index-aligned: parameters (or their owned slices), their
/// gradients, both moments, and each parameter's step count as a 0-d fp32 tensor on its device
/// (already incremented for this step, as torch's optimizer does before the kernel).
#[derive(Default)]
pub struct Batch<'a> {
    pub params: Vec<&'a Tensor>,
    pub grads: Vec<&'a Tensor>,
    pub exp_avgs: Vec<&'a Tensor>,
    pub exp_avg_sqs: Vec<&'a Tensor>,
    pub steps: Vec<Tensor>,
}

/// Runs the fused step in place; the error is libtorch's message (a dtype or device mismatch).
pub fn step(batch: &Batch<'_>, h: Hyper) -> Result<(), String> {
    let n = batch.params.len();
    if [batch.grads.len(), batch.exp_avgs.len(), batch.exp_avg_sqs.len(), batch.steps.len()]
        .iter()
        .any(|&l| l != n)
    {
        return Err("fused AdamW: tensor lists of different lengths".into());
    }
    if n == 0 {
        return Ok(());
    }
    // libtorch's CPU kernel does not check that the tensors match (it walks the parameter's
    // elements and reads the others at the same offsets), so a mismatch is refused here.
    for i in 0..n {
        let p = batch.params[i];
        let (size, device) = (p.size(), p.device());
        for (what, t) in [
            ("gradient", batch.grads[i]),
            ("exp_avg", batch.exp_avgs[i]),
            ("exp_avg_sq", batch.exp_avg_sqs[i]),
        ] {
            if t.size() != size || t.device() != device || t.kind() != p.kind() {
                return Err(format!(
                    "fused AdamW: tensor {i}: {what} is {:?} {:?} on {:?}, the parameter {size:?} {:?} on {device:?}",
                    t.size(),
                    t.kind(),
                    t.device(),
                    p.kind()
                ));
            }
        }
        let step = &batch.steps[i];
        if step.numel() != 1 || step.kind() != tch::Kind::Float || step.device() != device {
            return Err(format!(
                "fused AdamW: tensor {i}: the step count must be one fp32 value on {device:?}"
            ));
        }
    }
    let handles =
        |ts: &[&Tensor]| -> Vec<*const c_void> { ts.iter().map(|t| t.as_ptr() as *const c_void).collect() };
    let steps: Vec<&Tensor> = batch.steps.iter().collect();
    let (p, g, m, v, s) = (
        handles(&batch.params),
        handles(&batch.grads),
        handles(&batch.exp_avgs),
        handles(&batch.exp_avg_sqs),
        handles(&steps),
    );
    let mut error = [0 as c_char; 512];
    // SAFETY: five arrays of `n` live tch tensor handles (borrowed for the call), and an error
    // buffer of the length passed; the shim catches every C++ exception.
    let rc = unsafe {
        trainyard_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n,
            h.lr,
            h.betas.0,
            h.betas.1,
            h.weight_decay,
            h.eps,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        // SAFETY: the shim NUL-terminates within the buffer.
        Err(unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned())
    }
}
