//! The phase times of a step without stopping the GPU between phases: on a GPU each boundary is
//! a CUDA event on the stream libtorch and our collectives use (the legacy default stream), read
//! once the step has ended; elsewhere the wall clock. A host synchronisation between the forward
//! and backward pass and the optimizer left the GPU idle while the CPU issued the optimizer's
//! first kernels (GPU busy 83.6 ms of an 87.5 ms d12 step on an H200,
//! docs/gpu-results/2026-11-26-h200-6): with events the CPU issues the optimizer while the GPU
//! still runs the backward pass.
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaEvent, CudaStream, sys::CUevent_flags};
use tch::Device;

/// Where a step's phase boundaries are taken.
pub struct Clock {
    stream: Option<Arc<CudaStream>>,
}

/// A boundary between phases.
pub enum Mark {
    Event(CudaEvent),
    Wall(Instant),
}

impl Clock {
    /// Events on `device`'s stream when it is a GPU whose driver cudarc can reach; else the
    /// wall clock, with the GPU synchronised at each mark (the old behaviour).
    pub fn new(device: Device) -> Self {
        let stream = match device {
            Device::Cuda(gpu) => cudarc::driver::CudaContext::new(gpu).ok().map(|c| c.default_stream()),
            _ => None,
        };
        Self { stream }
    }

    /// Marks the stream (or the wall clock) here.
    pub fn mark(&self) -> Mark {
        if let Some(e) =
            self.stream.as_ref().and_then(|s| s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok())
        {
            return Mark::Event(e);
        }
        Mark::Wall(Instant::now())
    }

    /// Seconds from `a` to `b`; for events, waits until the GPU has passed both.
    pub fn seconds(a: &Mark, b: &Mark) -> f64 {
        match (a, b) {
            (Mark::Event(a), Mark::Event(b)) => a.elapsed_ms(b).map(|ms| ms as f64 / 1e3).unwrap_or(f64::NAN),
            (Mark::Wall(a), Mark::Wall(b)) => b.saturating_duration_since(*a).as_secs_f64(),
            _ => f64::NAN,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_clock_is_the_wall_clock() {
        let c = Clock::new(Device::Cpu);
        let a = c.mark();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let b = c.mark();
        let s = Clock::seconds(&a, &b);
        assert!((0.019..1.0).contains(&s), "{s}");
        assert_eq!(Clock::seconds(&b, &a), 0.0);
    }

    /// On a GPU: an event-timed matmul takes as long as the device says, and marking does not
    /// wait for the GPU. Skipped (and says so) without one.
    #[test]
    fn gpu_marks_time_the_stream_without_waiting() {
        if !tch::Cuda::is_available() {
            eprintln!("skipped: no CUDA device");
            return;
        }
        let c = Clock::new(Device::Cuda(0));
        let x = tch::Tensor::randn([4096, 4096], (tch::Kind::Float, Device::Cuda(0)));
        tch::Cuda::synchronize(0);
        let a = c.mark();
        let t = Instant::now();
        let mut y = x.mm(&x);
        for _ in 0..20 {
            y = y.mm(&x) / 4096.0;
        }
        let b = c.mark();
        let issued = t.elapsed().as_secs_f64();
        let gpu = Clock::seconds(&a, &b);
        assert!(matches!(a, Mark::Event(_)), "a GPU clock marks with events");
        assert!(gpu > issued, "GPU time {gpu} s should exceed the {issued} s it took to issue the work");
        drop(y);
    }
}
