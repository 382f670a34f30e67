//! Autograd ops with our own forward and backward (tch has no custom autograd Function):
//! `csrc/custom_op.cpp` defines one libtorch Function that calls back into [`dispatch`] for both
//! passes, so an op here can launch its own kernels forward and backward while autograd records
//! it like any ATen op (saved tensors, gradient accumulation, the backward thread).
//!
//! An [`Op`] is registered once ([`register`]) and applied with [`apply`]. Its forward returns
//! its outputs followed by any extra tensors its backward needs; its inputs are kept for the
//! backward too. Errors of either pass come back as errors (forward) or as libtorch's error
//! from `backward` (the autograd engine carries the exception to its caller).
use std::ffi::CStr;
use std::os::raw::{c_char, c_int, c_void};
use std::sync::{Arc, Once, OnceLock, RwLock};

use anyhow::{Result, anyhow, bail};
use tch::Tensor;

type Callback = unsafe extern "C" fn(
    op: i64,
    backward: c_int,
    tensors: *const *const c_void,
    n_tensors: usize,
    outputs: *mut *mut c_void,
    n_outputs: usize,
    error: *mut c_char,
    error_len: usize,
) -> c_int;

unsafe extern "C" {
    fn trainyard_custom_op_register(f: Callback);
    fn trainyard_custom_op(
        op: i64,
        inputs: *const *const c_void,
        n_in: usize,
        n_out: i64,
        n_extra: i64,
        outputs: *mut *mut c_void,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// An op with its own forward and backward.
pub trait Op: Send + Sync {
    /// For errors.
    fn name(&self) -> &'static str;
    /// How many outputs the forward returns (before the extras).
    fn outputs(&self) -> usize;
    /// How many extra tensors the forward keeps for the backward.
    fn extras(&self) -> usize {
        0
    }
    /// The outputs, then the extras.
    fn forward(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    /// One gradient per input (`None`: the input needs none) from the inputs, the extras and
    /// the gradients of the outputs.
    fn backward(&self, inputs: &[Tensor], extras: &[Tensor], grads: &[Tensor])
    -> Result<Vec<Option<Tensor>>>;
}

fn registry() -> &'static RwLock<Vec<Arc<dyn Op>>> {
    static OPS: OnceLock<RwLock<Vec<Arc<dyn Op>>>> = OnceLock::new();
    OPS.get_or_init(Default::default)
}

/// Registers `op` for [`apply`]; the id lives as long as the process.
pub fn register(op: Arc<dyn Op>) -> i64 {
    static CALLBACK: Once = Once::new();
    // SAFETY: `dispatch` has the callback's signature and never unwinds.
    CALLBACK.call_once(|| unsafe { trainyard_custom_op_register(dispatch) });
    let mut ops = registry().write().unwrap_or_else(|e| e.into_inner());
    ops.push(op);
    (ops.len() - 1) as i64
}

fn op(id: i64) -> Result<Arc<dyn Op>> {
    let ops = registry().read().unwrap_or_else(|e| e.into_inner());
    usize::try_from(id).ok().and_then(|i| ops.get(i).cloned()).ok_or_else(|| anyhow!("no custom op {id}"))
}

/// Applies the registered op `id` to `inputs`; autograd records it.
pub fn apply(id: i64, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let o = op(id)?;
    let n_out = o.outputs();
    let ptrs: Vec<*const c_void> = inputs.iter().map(|t| t.as_ptr() as *const c_void).collect();
    let mut out: Vec<*mut c_void> = vec![std::ptr::null_mut(); n_out];
    let mut error = [0 as c_char; 512];
    // SAFETY: live tch handles borrowed for the call, an out array of `n_out` slots and an error
    // buffer of the length passed; the shim catches every C++ exception and, on success, fills
    // every slot with a new `at::Tensor*` that tch then owns.
    let rc = unsafe {
        trainyard_custom_op(
            id,
            ptrs.as_ptr(),
            ptrs.len(),
            n_out as i64,
            o.extras() as i64,
            out.as_mut_ptr(),
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if rc != 0 || out.iter().any(|p| p.is_null()) {
        // SAFETY: the shim NUL-terminates within the buffer.
        let why = unsafe { CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
        bail!("{}: {why}", o.name());
    }
    // SAFETY: heap-allocated at::Tensor handles from the shim, owned from here on.
    Ok(out.into_iter().map(|p| unsafe { Tensor::from_ptr(p as *mut torch_sys::C_tensor) }).collect())
}

/// Hands a tensor's handle to C++ (which deletes it).
fn into_raw(mut t: Tensor) -> *mut c_void {
    let p = t.as_mut_ptr() as *mut c_void;
    std::mem::forget(t);
    p
}

/// The shim's callback: runs the forward or backward of op `id` on borrowed handles.
unsafe extern "C" fn dispatch(
    id: i64,
    backward: c_int,
    tensors: *const *const c_void,
    n_tensors: usize,
    outputs: *mut *mut c_void,
    n_outputs: usize,
    error: *mut c_char,
    error_len: usize,
) -> c_int {
    let run = || -> Result<Vec<Option<Tensor>>> {
        // SAFETY: the shim passes `n_tensors` live `at::Tensor*` handles; each is shallow-cloned
        // into a tch tensor that Rust owns, leaving the shim's own.
        let ts: Vec<Tensor> = (0..n_tensors)
            .map(|i| unsafe { Tensor::clone_from_ptr(*tensors.add(i) as *mut torch_sys::C_tensor) })
            .collect();
        let o = op(id)?;
        if backward == 0 {
            let out = o.forward(&ts)?;
            if out.len() != o.outputs() + o.extras() {
                bail!("forward returned {} tensors, not {}", out.len(), o.outputs() + o.extras());
            }
            return Ok(out.into_iter().map(Some).collect());
        }
        // Backward: inputs (as many as gradients asked for), extras, output gradients.
        let n_in = n_outputs;
        if n_tensors != n_in + o.extras() + o.outputs() {
            bail!("backward got {n_tensors} tensors for {n_in} inputs");
        }
        let (inputs, rest) = ts.split_at(n_in);
        let (extras, grads) = rest.split_at(o.extras());
        let g = o.backward(inputs, extras, grads)?;
        if g.len() != n_in {
            bail!("backward returned {} gradients for {n_in} inputs", g.len());
        }
        Ok(g)
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run))
        .unwrap_or_else(|_| Err(anyhow!("panicked (see the log)")));
    match result {
        Ok(v) if v.len() == n_outputs => {
            for (i, t) in v.into_iter().enumerate() {
                // SAFETY: the shim passes an array of `n_outputs` slots.
                unsafe { *outputs.add(i) = t.map(into_raw).unwrap_or(std::ptr::null_mut()) };
            }
            0
        }
        Ok(v) => write_error(&format!("{} tensors for {n_outputs} slots", v.len()), error, error_len),
        Err(e) => write_error(&format!("{e:#}"), error, error_len),
    }
}

fn write_error(msg: &str, error: *mut c_char, error_len: usize) -> c_int {
    if !error.is_null() && error_len > 0 {
        let n = msg.len().min(error_len - 1);
        // SAFETY: the shim's buffer holds `error_len` bytes; we write at most that, NUL included.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, error, n);
            *error.add(n) = 0;
        }
    }
    1
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// y = x * w (elementwise), with a hand-written backward that also counts its calls, and
    /// z = x (a second output) whose gradient adds straight through.
    struct MulOp {
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Op for MulOp {
        fn name(&self) -> &'static str {
            "test mul"
        }
        fn outputs(&self) -> usize {
            2
        }
        fn extras(&self) -> usize {
            1
        }
        fn forward(&self, i: &[Tensor]) -> Result<Vec<Tensor>> {
            if i[0].size() != i[1].size() {
                bail!("shapes {:?} and {:?} differ", i[0].size(), i[1].size());
            }
            Ok(vec![&i[0] * &i[1], i[0].copy(), i[1].sum(Kind::Float)])
        }
        fn backward(&self, i: &[Tensor], extras: &[Tensor], g: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            assert_eq!(extras[0].double_value(&[]), i[1].sum(Kind::Float).double_value(&[]));
            Ok(vec![Some(&g[0] * &i[1] + &g[1]), Some(&g[0] * &i[0])])
        }
    }

    #[test]
    fn a_custom_op_is_recorded_by_autograd_with_its_own_backward() {
        let op = Arc::new(MulOp { calls: 0.into() });
        let id = register(op.clone());
        let x = Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let w = Tensor::randn([3, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let out = apply(id, &[&x, &w]).unwrap();
        assert_eq!(out.len(), 2);
        let loss = (&out[0] * 2.0).sum(Kind::Float) + out[1].sum(Kind::Float) * 3.0;
        let g = Tensor::run_backward(&[loss], &[&x, &w], false, false);
        assert_eq!(op.calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        let want_x = &w * 2.0 + 3.0;
        let want_w = &x.detach() * 2.0;
        assert!(g[0].allclose(&want_x, 1e-6, 1e-6, false));
        assert!(g[1].allclose(&want_w, 1e-6, 1e-6, false));
    }

    #[test]
    fn a_forward_error_names_the_op_and_the_cause() {
        let id = register(Arc::new(MulOp { calls: 0.into() }));
        let x = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        let w = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let e = apply(id, &[&x, &w]).unwrap_err().to_string();
        assert!(e.contains("test mul") && e.contains("shapes [2] and [3] differ"), "{e}");
    }
}
