//! Causal self-attention over the whole context or over a sliding window (nanochat's `S`
//! layers: query `i` sees keys `i - w ..= i`).
//!
//! Full context goes through libtorch's `scaled_dot_product_attention` (FlashAttention or cuDNN
//! on a GPU). A window on a GPU goes through libtorch's FlashAttention kernel with
//! `window_size_left` (`csrc/window_attention.cpp`, since tch does not bind it), which skips the
//! blocks outside the window; elsewhere (the CPU, fp32) through SDPA with an explicit band mask,
//! which is also the reference the GPU test compares the kernel with.
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};

use anyhow::{Result, bail};
use tch::{Device, Kind, Tensor};

unsafe extern "C" {
    fn trainyard_window_attention(
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        window_left: i64,
        out: *mut *mut c_void,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// Attention of `q`, `k`, `v` (B, T, H, D), causal, each query seeing the `window` keys before
/// it (and itself) or the whole context; the result is (B, T, H, D).
pub fn causal(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<i64>) -> Result<Tensor> {
    let t = q.size()[1];
    match window {
        Some(w) if w < t - 1 => {
            let flash = q.device().is_cuda() && matches!(q.kind(), Kind::BFloat16 | Kind::Half);
            if flash { flash_window(q, k, v, w) } else { Ok(masked(q, k, v, w)) }
        }
        _ => Ok(sdpa(q, k, v, None, true)),
    }
}

fn sdpa(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<Tensor>, is_causal: bool) -> Tensor {
    Tensor::scaled_dot_product_attention(
        &q.transpose(1, 2),
        &k.transpose(1, 2),
        &v.transpose(1, 2),
        mask,
        0.0,
        is_causal,
        None,
        false,
    )
    .transpose(1, 2)
}

/// The band `0 <= i - j <= w` as a boolean mask (T, T): true where query `i` may see key `j`.
pub fn band(t: i64, w: i64, device: Device) -> Tensor {
    let i = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(1);
    let j = Tensor::arange(t, (Kind::Int64, device)).unsqueeze(0);
    let d = i - j;
    d.ge(0).logical_and(&d.le(w))
}

/// The sliding window through SDPA with an explicit mask (any device, any kind).
pub fn masked(q: &Tensor, k: &Tensor, v: &Tensor, w: i64) -> Tensor {
    sdpa(q, k, v, Some(band(q.size()[1], w, q.device())), false)
}

/// The sliding window through libtorch's FlashAttention (GPU, bf16/fp16); autograd records it.
pub fn flash_window(q: &Tensor, k: &Tensor, v: &Tensor, w: i64) -> Result<Tensor> {
    let (q, k, v) = (q.contiguous(), k.contiguous(), v.contiguous());
    let mut out: *mut c_void = std::ptr::null_mut();
    let mut error = [0 as c_char; 512];
    // SAFETY: three live tch tensor handles borrowed for the call, an out slot and an error
    // buffer of the length passed; the shim catches every C++ exception and, on success, hands
    // over a new `at::Tensor*` that tch then owns.
    let rc = unsafe {
        trainyard_window_attention(
            q.as_ptr() as *const c_void,
            k.as_ptr() as *const c_void,
            v.as_ptr() as *const c_void,
            w,
            &mut out,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if rc != 0 || out.is_null() {
        // SAFETY: the shim NUL-terminates within the buffer.
        let why = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        bail!("FlashAttention with a {w}-token window: {why}");
    }
    // SAFETY: a heap-allocated at::Tensor from the shim, owned from here on.
    Ok(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qkv(t: i64, kind: Kind, device: Device) -> (Tensor, Tensor, Tensor) {
        let r =
            || (Tensor::randn([2, t, 2, 16], (Kind::Float, device))).to_kind(kind).set_requires_grad(true);
        (r(), r(), r())
    }

    #[test]
    fn a_window_sees_exactly_its_keys() {
        tch::manual_seed(7);
        let (t, w) = (12, 3);
        let (q, k, v) = qkv(t, Kind::Float, Device::Cpu);
        let y = causal(&q, &k, &v, Some(w)).unwrap();
        // Query 9 by hand: softmax over keys 6..=9 only.
        let (qi, ks, vs) = (q.get(0).get(9), k.get(0).narrow(0, 6, 4), v.get(0).narrow(0, 6, 4));
        let scores = (ks * qi.unsqueeze(0)).sum_dim_intlist([2i64].as_slice(), false, Kind::Float) / 4.0;
        let p = scores.softmax(0, Kind::Float);
        let want = (p.unsqueeze(2) * vs).sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
        let err = (y.get(0).get(9) - want).abs().max().double_value(&[]);
        assert!(err < 1e-5, "query 9: {err}");
        // The first w+1 queries see everything before them: equal to full causal attention.
        let full = causal(&q, &k, &v, None).unwrap();
        let head = (y.narrow(1, 0, w + 1) - full.narrow(1, 0, w + 1)).abs().max().double_value(&[]);
        assert!(head < 1e-6, "{head}");
        // A window as long as the sequence is full causal attention.
        let same = (causal(&q, &k, &v, Some(t)).unwrap() - &full).abs().max().double_value(&[]);
        assert_eq!(same, 0.0);
    }

    /// On a GPU: the FlashAttention window against the masked reference, forward and backward.
    /// Skipped (and says so) without one.
    #[test]
    fn flash_window_matches_the_mask_on_a_gpu() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device (the window's mask reference ran above)");
            return;
        }
        tch::manual_seed(8);
        let dev = Device::Cuda(0);
        let (t, w) = (1024, 256);
        let r = || {
            (Tensor::randn([2, t, 4, 128], (Kind::Float, dev)))
                .to_kind(Kind::BFloat16)
                .set_requires_grad(true)
        };
        let (q, k, v) = (r(), r(), r());
        let y = flash_window(&q, &k, &v, w).unwrap();
        let m = masked(&q, &k, &v, w);
        let rel = |a: &Tensor, b: &Tensor| {
            (a - b).abs().max().double_value(&[]) / b.abs().max().double_value(&[]).max(1e-12)
        };
        assert!(rel(&y, &m) < 2e-2, "forward: {}", rel(&y, &m));
        let dy = Tensor::randn_like(&y);
        let gf = Tensor::run_backward(&[(&y * &dy).sum(Kind::Float)], &[&q, &k, &v], false, false);
        let gm = Tensor::run_backward(&[(&m * &dy).sum(Kind::Float)], &[&q, &k, &v], false, false);
        for (name, a, b) in [("q", &gf[0], &gm[0]), ("k", &gf[1], &gm[1]), ("v", &gf[2], &gm[2])] {
            assert!(rel(a, b) < 3e-2, "d{name}: {}", rel(a, b));
        }
    }
}
