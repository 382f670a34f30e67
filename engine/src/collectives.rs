//! Collectives among the ranks of a job: the `Collectives` trait, a single-rank no-op, a CPU
//! ring over TCP, and NCCL through cudarc. All reductions average (nanochat's `ReduceOp.AVG`).
//!
//! Bootstrap (both multi-rank implementations): rank 0 listens on `MASTER_ADDR:MASTER_PORT`;
//! every other rank connects, says its rank and the address of its own ring listener; rank 0
//! answers everyone with the table of addresses and a 128-byte blob (the NCCL unique id, made by
//! rank 0). The CPU ring then connects each rank to the next.
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use tch::{Device, Kind, Tensor};

pub trait Collectives {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// In-place average over ranks.
    fn all_reduce_avg(&mut self, t: &mut Tensor) -> Result<()>;
    /// `input` (numel = world * output numel, contiguous) averaged over ranks; rank r gets the
    /// r-th contiguous chunk in `output`.
    fn reduce_scatter_avg(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()>;
    /// `output` (numel = world * input numel) = every rank's `input`, in rank order.
    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()>;
    /// Blocks until the device has finished the work queued so far (timing boundaries).
    fn synchronize(&self) {}
    fn name(&self) -> &'static str;
}

/// World of one: nothing to exchange. `gpu` is the CUDA device the rank computes on, so that
/// [`Collectives::synchronize`] really waits for it (a step's wall time would otherwise end
/// when its kernels were issued; its phases are timed by [`crate::clock`]).
pub struct Single {
    pub gpu: Option<usize>,
}

impl Collectives for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_avg(&mut self, _t: &mut Tensor) -> Result<()> {
        Ok(())
    }
    fn reduce_scatter_avg(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
        output.copy_(&input.view_as(output));
        Ok(())
    }
    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
        if input.data_ptr() != output.data_ptr() {
            output.copy_(&input.view_as(output));
        }
        Ok(())
    }
    fn synchronize(&self) {
        if let Some(gpu) = self.gpu {
            tch::Cuda::synchronize(gpu as i64);
        }
    }
    fn name(&self) -> &'static str {
        "single"
    }
}

/// What every rank learns at bootstrap.
pub struct Rendezvous {
    pub peers: Vec<SocketAddr>,
    pub blob: [u8; 128],
    /// Ring listener of this rank (already bound).
    pub listener: TcpListener,
}

fn read_exact_vec(s: &mut TcpStream, n: usize) -> Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// Rank 0 makes `blob` (e.g. the NCCL id) with `make_blob`; everyone gets the address table.
pub fn rendezvous(
    master: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
    make_blob: impl FnOnce() -> Result<[u8; 128]>,
) -> Result<Rendezvous> {
    ensure!(rank < world, "rank {rank} is not below the world size {world}");
    if rank == 0 {
        serve_table(master, world, timeout, make_blob)
    } else {
        fetch_table(master, rank, world, timeout)
    }
}

/// Rank 0's side: waits for every other rank's address, then sends each the table and `blob`.
fn serve_table(
    master: &str,
    world: usize,
    timeout: Duration,
    make_blob: impl FnOnce() -> Result<[u8; 128]>,
) -> Result<Rendezvous> {
    let server =
        TcpListener::bind(master).with_context(|| format!("rank 0: bind the bootstrap address {master}"))?;
    let ip = server.local_addr()?.ip();
    let listener = TcpListener::bind((ip, 0))?;
    let blob = make_blob()?;
    let mut peers = vec![listener.local_addr()?; world];
    let mut conns = Vec::new();
    server.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    while conns.len() + 1 < world {
        match server.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(timeout))?;
                let r = u32::from_le_bytes(read_exact_vec(&mut s, 4)?.try_into().unwrap());
                let n = u32::from_le_bytes(read_exact_vec(&mut s, 4)?.try_into().unwrap());
                let addr: SocketAddr = String::from_utf8(read_exact_vec(&mut s, n as usize)?)?.parse()?;
                ensure!((r as usize) < world && r != 0, "bootstrap: bad rank {r}");
                peers[r as usize] = addr;
                conns.push(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    bail!(
                        "bootstrap: only {} of {world} ranks arrived at {master} within {:?}",
                        conns.len() + 1,
                        timeout
                    );
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let table = peers.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",");
    for s in &mut conns {
        s.write_all(&(table.len() as u32).to_le_bytes())?;
        s.write_all(table.as_bytes())?;
        s.write_all(&blob)?;
    }
    Ok(Rendezvous { peers, blob, listener })
}

/// Another rank's side: sends its address to rank 0, then reads the table and the blob.
fn fetch_table(master: &str, rank: usize, world: usize, timeout: Duration) -> Result<Rendezvous> {
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match TcpStream::connect(master) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("rank {rank}: connect to {master}"));
            }
        }
    };
    s.set_read_timeout(Some(timeout))?;
    let listener = TcpListener::bind((s.local_addr()?.ip(), 0))?;
    let me = listener.local_addr()?.to_string();
    s.write_all(&(rank as u32).to_le_bytes())?;
    s.write_all(&(me.len() as u32).to_le_bytes())?;
    s.write_all(me.as_bytes())?;
    let n = u32::from_le_bytes(read_exact_vec(&mut s, 4)?.try_into().unwrap());
    let table = String::from_utf8(read_exact_vec(&mut s, n as usize)?)?;
    let peers = table
        .split(',')
        .map(|a| a.parse::<SocketAddr>().map_err(anyhow::Error::from))
        .collect::<Result<Vec<_>>>()?;
    ensure!(peers.len() == world, "bootstrap: table has {} ranks", peers.len());
    let blob: [u8; 128] = read_exact_vec(&mut s, 128)?.try_into().unwrap();
    Ok(Rendezvous { peers, blob, listener })
}

/// Ring reduce-scatter / all-gather over TCP between CPU ranks (fp32 on the wire).
pub struct TcpRing {
    rank: usize,
    world: usize,
    next: TcpStream,
    prev: TcpStream,
}

impl TcpRing {
    pub fn connect(master: &str, rank: usize, world: usize, timeout: Duration) -> Result<Self> {
        ensure!(world >= 2, "a ring needs at least two ranks");
        let rv = rendezvous(master, rank, world, timeout, || Ok([0u8; 128]))?;
        let next_addr = rv.peers[(rank + 1) % world];
        let connector = std::thread::spawn(move || -> Result<TcpStream> {
            let deadline = Instant::now() + timeout;
            loop {
                match TcpStream::connect(next_addr) {
                    Ok(s) => return Ok(s),
                    Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                    Err(e) => return Err(e.into()),
                }
            }
        });
        let (prev, _) = rv.listener.accept().context("ring: accept the previous rank")?;
        let next = connector.join().map_err(|_| anyhow::anyhow!("ring connector panicked"))??;
        for s in [&next, &prev] {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
        }
        Ok(Self { rank, world, next, prev })
    }

    /// Sends `send` to the next rank while receiving as many floats from the previous one.
    fn exchange(&mut self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let bytes: Vec<u8> = send.iter().flat_map(|f| f.to_le_bytes()).collect();
        let mut next = self.next.try_clone()?;
        let mut inbuf = vec![0u8; recv.len() * 4];
        std::thread::scope(|sc| -> Result<()> {
            let w = sc.spawn(move || next.write_all(&bytes));
            self.prev.read_exact(&mut inbuf).context("ring: receive from the previous rank")?;
            w.join().map_err(|_| anyhow::anyhow!("ring sender panicked"))??;
            Ok(())
        })?;
        for (r, c) in recv.iter_mut().zip(inbuf.chunks_exact(4)) {
            *r = f32::from_le_bytes(c.try_into().unwrap());
        }
        Ok(())
    }

    /// Ring reduce-scatter on `data` split in `world` equal chunks; returns the summed chunk
    /// `rank`.
    fn ring_reduce_scatter(&mut self, data: &mut [f32]) -> Result<Vec<f32>> {
        let (w, r) = (self.world, self.rank);
        let n = data.len() / w;
        let mut recv = vec![0f32; n];
        for s in 0..w - 1 {
            let send_idx = (r + 2 * w - s - 1) % w;
            let recv_idx = (r + 2 * w - s - 2) % w;
            let send = data[send_idx * n..(send_idx + 1) * n].to_vec();
            self.exchange(&send, &mut recv)?;
            for (d, x) in data[recv_idx * n..(recv_idx + 1) * n].iter_mut().zip(&recv) {
                *d += x;
            }
        }
        Ok(data[r * n..(r + 1) * n].to_vec())
    }

    /// Ring all-gather: `data` holds this rank's chunk at `rank`; fills the others.
    fn ring_all_gather(&mut self, data: &mut [f32]) -> Result<()> {
        let (w, r) = (self.world, self.rank);
        let n = data.len() / w;
        let mut recv = vec![0f32; n];
        for s in 0..w - 1 {
            let send_idx = (r + w - s) % w;
            let recv_idx = (r + 2 * w - s - 1) % w;
            let send = data[send_idx * n..(send_idx + 1) * n].to_vec();
            self.exchange(&send, &mut recv)?;
            data[recv_idx * n..(recv_idx + 1) * n].copy_from_slice(&recv);
        }
        Ok(())
    }
}

fn to_vec_f32(t: &Tensor) -> Vec<f32> {
    let flat = t.to_kind(Kind::Float).to_device(Device::Cpu).contiguous().view([-1]);
    Vec::<f32>::try_from(&flat).expect("float tensor")
}

fn write_back(dst: &mut Tensor, data: &[f32]) {
    let src = Tensor::from_slice(data).view(dst.size().as_slice());
    dst.copy_(&src.to_kind(dst.kind()).to_device(dst.device()));
}

impl Collectives for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_avg(&mut self, t: &mut Tensor) -> Result<()> {
        let mut data = to_vec_f32(t);
        let n = data.len();
        let w = self.world;
        data.resize(n.div_ceil(w) * w, 0.0);
        let mine = self.ring_reduce_scatter(&mut data)?;
        let c = mine.len();
        data[self.rank * c..(self.rank + 1) * c].copy_from_slice(&mine);
        self.ring_all_gather(&mut data)?;
        let inv = 1.0 / w as f32;
        let out: Vec<f32> = data[..n].iter().map(|x| x * inv).collect();
        write_back(t, &out);
        Ok(())
    }
    fn reduce_scatter_avg(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
        ensure!(
            input.numel() == output.numel() * self.world,
            "reduce_scatter: {} elements in, {} out, world {}",
            input.numel(),
            output.numel(),
            self.world
        );
        let mut data = to_vec_f32(input);
        let inv = 1.0 / self.world as f32;
        let mine: Vec<f32> = self.ring_reduce_scatter(&mut data)?.into_iter().map(|x| x * inv).collect();
        write_back(output, &mine);
        Ok(())
    }
    fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
        ensure!(output.numel() == input.numel() * self.world, "all_gather: sizes");
        let n = input.numel();
        let mut data = vec![0f32; n * self.world];
        data[self.rank * n..(self.rank + 1) * n].copy_from_slice(&to_vec_f32(input));
        self.ring_all_gather(&mut data)?;
        write_back(output, &data);
        Ok(())
    }
    fn name(&self) -> &'static str {
        "tcp-ring"
    }
}

pub use nccl::Nccl;

/// NCCL through cudarc. The rank binds its GPU's primary context (the one libtorch uses) and
/// runs every collective on the legacy default stream, libtorch's default stream, so collectives
/// are ordered with the kernels around them without host synchronisation.
mod nccl {
    use std::marker::PhantomData;
    use std::sync::Arc;
    use std::time::Duration;

    use anyhow::{Context, Result, bail, ensure};
    use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
    use cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
    use tch::{Kind, Tensor};

    use super::Collectives;

    /// A borrowed libtorch CUDA buffer presented to cudarc (no ownership, never freed here).
    struct TorchBuf<'t, T> {
        ptr: u64,
        len: usize,
        stream: Arc<CudaStream>,
        _t: PhantomData<&'t Tensor>,
        _e: PhantomData<T>,
    }

    impl<T> DeviceSlice<T> for TorchBuf<'_, T> {
        fn len(&self) -> usize {
            self.len
        }
        fn stream(&self) -> &Arc<CudaStream> {
            &self.stream
        }
    }
    impl<T> DevicePtr<T> for TorchBuf<'_, T> {
        fn device_ptr<'a>(
            &'a self,
            _s: &'a CudaStream,
        ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
            (self.ptr, SyncOnDrop::Sync(None))
        }
    }
    impl<T> DevicePtrMut<T> for TorchBuf<'_, T> {
        fn device_ptr_mut<'a>(
            &'a mut self,
            _s: &'a CudaStream,
        ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
            (self.ptr, SyncOnDrop::Sync(None))
        }
    }

    pub struct Nccl {
        rank: usize,
        world: usize,
        gpu: usize,
        stream: Arc<CudaStream>,
        comm: Comm,
    }

    impl Nccl {
        /// Binds GPU `gpu` on this thread and joins the NCCL communicator of the job.
        pub fn connect(
            master: &str,
            rank: usize,
            world: usize,
            gpu: usize,
            timeout: Duration,
        ) -> Result<Self> {
            // cudarc panics (instead of erring) when a library is missing: probe first.
            // SAFETY: these only try to dlopen the libraries.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                bail!("NCCL collectives need the CUDA driver (libcuda) and none was found");
            }
            if !unsafe { cudarc::nccl::sys::is_culib_present() } {
                bail!(
                    "NCCL not found: cudarc loads libnccl.so; deploy/setup.sh links it to the \
                     torch wheel's libnccl.so.2 in .venv/nccl-lib"
                );
            }
            // Retains the primary context of `gpu` and makes it current on this thread, so
            // libtorch (runtime API) and NCCL both use device `gpu` and the same context.
            let ctx = CudaContext::new(gpu).context("CUDA context")?;
            let stream = ctx.default_stream();
            let rv = super::rendezvous(master, rank, world, timeout, || {
                let id = Id::new().map_err(|e| anyhow::anyhow!("ncclGetUniqueId: {e:?}"))?;
                let mut blob = [0u8; 128];
                for (b, c) in blob.iter_mut().zip(id.internal()) {
                    *b = *c as u8;
                }
                Ok(blob)
            })?;
            drop(rv.listener);
            let mut internal = [0 as core::ffi::c_char; 128];
            for (c, b) in internal.iter_mut().zip(rv.blob) {
                *c = b as core::ffi::c_char;
            }
            let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal))
                .map_err(|e| anyhow::anyhow!("ncclCommInitRank: {e:?}"))?;
            Ok(Self { rank, world, gpu, stream, comm })
        }

        fn buf<'t, T>(&self, t: &'t Tensor) -> Result<TorchBuf<'t, T>> {
            ensure!(t.is_contiguous(), "NCCL buffers must be contiguous");
            ensure!(t.device() == tch::Device::Cuda(self.gpu), "tensor not on GPU {}", self.gpu);
            Ok(TorchBuf {
                ptr: t.data_ptr() as u64,
                len: t.numel(),
                stream: self.stream.clone(),
                _t: PhantomData,
                _e: PhantomData,
            })
        }

        fn run<T: NcclType>(
            &self,
            input: &Tensor,
            output: &Tensor,
            op: Option<ReduceOp>,
            gather: bool,
        ) -> Result<()> {
            let send = self.buf::<T>(input)?;
            let mut recv = self.buf::<T>(output)?;
            let r = match (op, gather) {
                (Some(op), false) if input.data_ptr() == output.data_ptr() => {
                    self.comm.all_reduce_in_place(&mut recv, &op)
                }
                (Some(op), false) => self.comm.reduce_scatter(&send, &mut recv, &op),
                _ => self.comm.all_gather(&send, &mut recv),
            };
            r.map(|_| ()).map_err(|e| anyhow::anyhow!("NCCL: {e:?}"))
        }

        fn dispatch(
            &self,
            input: &Tensor,
            output: &Tensor,
            op: Option<ReduceOp>,
            gather: bool,
        ) -> Result<()> {
            ensure!(input.kind() == output.kind(), "NCCL: dtype mismatch");
            match input.kind() {
                Kind::Float => self.run::<f32>(input, output, op, gather),
                Kind::BFloat16 => self.run::<half::bf16>(input, output, op, gather),
                k => bail!("NCCL: unsupported dtype {k:?}"),
            }
        }
    }

    impl Collectives for Nccl {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            self.world
        }
        fn all_reduce_avg(&mut self, t: &mut Tensor) -> Result<()> {
            self.dispatch(t, t, Some(ReduceOp::Avg), false)
        }
        fn reduce_scatter_avg(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
            ensure!(input.numel() == output.numel() * self.world, "reduce_scatter: sizes");
            self.dispatch(input, output, Some(ReduceOp::Avg), false)
        }
        fn all_gather(&mut self, input: &Tensor, output: &mut Tensor) -> Result<()> {
            ensure!(output.numel() == input.numel() * self.world, "all_gather: sizes");
            self.dispatch(input, output, None, true)
        }
        fn synchronize(&self) {
            tch::Cuda::synchronize(self.gpu as i64);
        }
        fn name(&self) -> &'static str {
            "nccl"
        }
    }
}
