//! Muon + AdamW with ZeRO-2 sharding, as nanochat's `MuonAdamW` does it (the same code path
//! for one rank or many).
//!
//! Phase 1 (reduce): AdamW tensors under 1024 elements are all-reduced; larger AdamW tensors
//! are reduce-scattered along dim 0; the Muon matrices of one shape are stacked, padded with
//! zeros to a multiple of the world size and reduce-scattered. Phase 2 (compute + gather): each
//! rank updates the shard it owns and the updated shards are all-gathered. tch has no fused or
//! foreach optimizer ops, so the updates are per-tensor in-place ops (Muon's on the stacked
//! group, one batched matmul chain per shape).
use std::collections::BTreeMap;

use anyhow::{Result, ensure};
use tch::{Kind, Tensor};

use crate::clock::Clock;
use crate::collectives::Collectives;
use crate::config::TrainConfig;
use crate::fused_adamw;
use crate::model::{Gpt, Group};

/// Polar Express coefficients (5 iterations; arXiv 2505.16932), as nanochat uses them.
const POLAR_EXPRESS: [(f64, f64, f64); 5] = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
];
const SMALL: usize = 1024;

#[derive(Debug, Clone)]
pub struct AdamGroup {
    pub name: &'static str,
    pub params: Vec<usize>,
    pub initial_lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
}

#[derive(Debug, Clone)]
pub struct MuonGroup {
    pub shape: Vec<i64>,
    pub params: Vec<usize>,
    pub initial_lr: f64,
    pub beta2: f64,
}

struct AdamState {
    step: i64,
    m: Tensor,
    v: Tensor,
}

struct MuonState {
    momentum: Tensor,
    second: Tensor,
}

/// Seconds spent in each phase of one step (the optimizer phases of docs/field-notes.md §5).
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Phases {
    pub reduce_s: f64,
    pub compute_gather_s: f64,
    pub wait_s: f64,
}

pub struct MuonAdamW {
    pub adam: Vec<AdamGroup>,
    pub muon: Vec<MuonGroup>,
    adam_state: BTreeMap<usize, AdamState>,
    muon_state: Vec<Option<MuonState>>,
    rank: usize,
    world: usize,
    ns_kind: Kind,
}

/// Where a reduced AdamW gradient lives until phase 2.
enum Reduced {
    Full,
    Slice(Tensor),
}

impl MuonAdamW {
    /// nanochat's groups and learning rates for `model`.
    pub fn new(model: &Gpt, cfg: &TrainConfig, rank: usize, world: usize) -> Self {
        let s_b = cfg.batch_lr_scale();
        let dms = (model.cfg.n_embd as f64 / 768.0).powf(-0.5);
        let of = |g: Group| -> Vec<usize> {
            model.params.iter().enumerate().filter(|(_, p)| p.group == g).map(|(i, _)| i).collect()
        };
        let mk = |name, g, lr, betas, wd| AdamGroup {
            name,
            params: of(g),
            initial_lr: lr,
            betas,
            eps: 1e-10,
            weight_decay: wd,
        };
        let adam = vec![
            mk("lm_head", Group::LmHead, cfg.unembedding_lr * s_b * dms, (0.8, 0.96), 0.01),
            mk("wte", Group::Embedding, cfg.embedding_lr * s_b * dms, (0.8, 0.995), 0.001),
            mk("value_embeds", Group::ValueEmbedding, cfg.embedding_lr * s_b * dms * 0.5, (0.8, 0.995), 0.01),
            mk("resid_lambdas", Group::ResidLambdas, cfg.scalar_lr * s_b * 0.01, (0.8, 0.95), 0.05),
            mk("x0_lambdas", Group::X0Lambdas, cfg.scalar_lr * s_b, (0.96, 0.95), 0.0),
        ]
        .into_iter()
        .filter(|g| !g.params.is_empty())
        .collect();
        let mut by_shape: BTreeMap<Vec<i64>, Vec<usize>> = BTreeMap::new();
        for i in of(Group::Matrix) {
            by_shape.entry(model.params[i].tensor.size()).or_default().push(i);
        }
        let muon: Vec<MuonGroup> = by_shape
            .into_iter()
            .map(|(shape, params)| MuonGroup { shape, params, initial_lr: cfg.matrix_lr * s_b, beta2: 0.9 })
            .collect();
        let n = muon.len();
        Self {
            adam,
            muon,
            adam_state: BTreeMap::new(),
            muon_state: (0..n).map(|_| None).collect(),
            rank,
            world,
            ns_kind: model.compute,
        }
    }

    /// Checks the sharding constraints before training starts.
    pub fn check(&self, model: &Gpt) -> Result<()> {
        for g in &self.adam {
            for &i in &g.params {
                let t = &model.params[i].tensor;
                if t.numel() >= SMALL {
                    ensure!(
                        t.size()[0] % self.world as i64 == 0,
                        "{}: dim 0 ({}) does not divide across {} ranks",
                        model.params[i].name,
                        t.size()[0],
                        self.world
                    );
                }
            }
        }
        Ok(())
    }

    /// One step: of `(lrm, momentum, muon_wd)`, `lrm` multiplies every LR and Muon gets
    /// `momentum` and `muon_wd`. Returns the phase times (taken by `clock`, which does not stop
    /// the GPU between phases) and the global gradient norm (of the rank-averaged gradient); the
    /// GPU is synchronised when it returns.
    ///
    /// `grads` holds this rank's gradient of every parameter, in `model.params` order, as
    /// [`crate::model::Gpt::grads`] returns them. They are values the step consumes, not the
    /// parameters' `.grad` fields: autograd writes them fresh instead of zeroing and
    /// accumulating into persistent buffers (two extra passes over every gradient per step,
    /// 2-3 % of a d12 step on an H100), and they are freed when the step returns.
    pub fn step(
        &mut self,
        model: &mut Gpt,
        grads: Vec<Tensor>,
        coll: &mut dyn Collectives,
        clock: &Clock,
        (lrm, momentum, muon_wd): (f64, f64, f64),
    ) -> Result<(Phases, f64)> {
        let _guard = tch::no_grad_guard();
        let world = self.world;
        let mut sq = Tensor::zeros([], (Kind::Float, model.device));
        let m0 = clock.mark();

        // Phase 1: reductions, in group order.
        let adam_reduced = self.reduce_adam(model, &grads, coll, &mut sq)?;
        let muon_reduced = self.reduce_muon(model, &grads, coll, &mut sq)?;
        let m1 = clock.mark();

        // Phase 2: update the owned shard (one fused AdamW kernel per group), gather.
        self.update_adam(model, &grads, &adam_reduced, coll, lrm)?;
        self.update_muon(model, &muon_reduced, coll, lrm, momentum, muon_wd)?;
        let m2 = clock.mark();
        coll.all_reduce_avg(&mut sq)?;
        coll.synchronize();
        let grad_norm = (sq.double_value(&[]) * world as f64).sqrt();
        let m3 = clock.mark();
        let phases = Phases {
            reduce_s: Clock::seconds(&m0, &m1),
            compute_gather_s: Clock::seconds(&m1, &m2),
            wait_s: Clock::seconds(&m2, &m3),
        };
        Ok((phases, grad_norm))
    }

    /// AdamW gradients averaged over the ranks: small tensors (and every tensor in a world of
    /// one) whole, large ones reduce-scattered into this rank's row slice. Adds their squared
    /// norm (rank 0 counts the whole ones) to `sq`.
    fn reduce_adam(
        &self,
        model: &Gpt,
        grads: &[Tensor],
        coll: &mut dyn Collectives,
        sq: &mut Tensor,
    ) -> Result<Vec<Vec<Reduced>>> {
        let (rank, world) = (self.rank, self.world);
        let mut adam_reduced: Vec<Vec<Reduced>> = Vec::new();
        for g in &self.adam {
            let mut v = Vec::new();
            for &i in &g.params {
                let p = &model.params[i].tensor;
                let mut grad = grads[i].shallow_clone();
                // A world of one owns every whole tensor: no slice, no copy.
                if p.numel() < SMALL || world == 1 {
                    coll.all_reduce_avg(&mut grad)?;
                    if rank == 0 {
                        *sq += sq_norm(&grad);
                    }
                    v.push(Reduced::Full);
                } else {
                    let rs = p.size()[0] / world as i64;
                    let mut slice = grad.narrow(0, 0, rs).empty_like();
                    coll.reduce_scatter_avg(&grad, &mut slice)?;
                    *sq += sq_norm(&slice);
                    v.push(Reduced::Slice(slice));
                }
            }
            adam_reduced.push(v);
        }
        Ok(adam_reduced)
    }

    /// Each Muon group's gradients stacked (padded to a multiple of the world size) and
    /// reduce-scattered: (the stacked gradients, this rank's averaged chunk). Adds the chunk's
    /// squared norm to `sq`.
    fn reduce_muon(
        &self,
        model: &Gpt,
        grads: &[Tensor],
        coll: &mut dyn Collectives,
        sq: &mut Tensor,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let world = self.world as i64;
        let mut muon_reduced: Vec<(Tensor, Tensor)> = Vec::new();
        for g in &self.muon {
            let k = g.params.len() as i64;
            let chunk = (k + world - 1) / world;
            let mut shape = vec![chunk * world];
            shape.extend(&g.shape);
            let group: Vec<&Tensor> = g.params.iter().map(|&i| &grads[i]).collect();
            let stacked = if chunk * world == k {
                Tensor::stack(&group, 0)
            } else {
                // Padded to a multiple of the world size; the padding stays zero.
                let stacked = Tensor::zeros(shape.as_slice(), (Kind::Float, model.device));
                stacked.narrow(0, 0, k).copy_(&Tensor::stack(&group, 0));
                stacked
            };
            let grad_chunk = if world == 1 {
                stacked.shallow_clone()
            } else {
                shape[0] = chunk;
                let mut grad_chunk = Tensor::empty(shape.as_slice(), (Kind::Float, model.device));
                coll.reduce_scatter_avg(&stacked, &mut grad_chunk)?;
                grad_chunk
            };
            *sq += sq_norm(&grad_chunk);
            muon_reduced.push((stacked, grad_chunk));
        }
        Ok(muon_reduced)
    }

    /// One fused AdamW kernel per group over the parameters (or row slices) this rank owns,
    /// then the slices gathered back into every rank's whole parameter.
    fn update_adam(
        &mut self,
        model: &mut Gpt,
        grads: &[Tensor],
        adam_reduced: &[Vec<Reduced>],
        coll: &mut dyn Collectives,
        lrm: f64,
    ) -> Result<()> {
        let rank = self.rank;
        for (gi, g) in self.adam.iter().enumerate() {
            // (parameter index, owned view of the parameter, its reduced gradient, gathered?)
            let mut owned: Vec<(usize, Tensor, Tensor, bool)> = Vec::with_capacity(g.params.len());
            for (j, &i) in g.params.iter().enumerate() {
                let p = model.params[i].tensor.shallow_clone();
                let (view, grad, sliced) = match &adam_reduced[gi][j] {
                    Reduced::Full => (p, grads[i].shallow_clone(), false),
                    Reduced::Slice(grad) => {
                        let rs = grad.size()[0];
                        (p.narrow(0, rank as i64 * rs, rs), grad.shallow_clone(), true)
                    }
                };
                let st = self.adam_state.entry(i).or_insert_with(|| new_adam_state(&view));
                st.step += 1;
                owned.push((i, view, grad, sliced));
            }
            let state = |i: &usize| &self.adam_state[i];
            let batch = fused_adamw::Batch {
                params: owned.iter().map(|o| &o.1).collect(),
                grads: owned.iter().map(|o| &o.2).collect(),
                exp_avgs: owned.iter().map(|o| &state(&o.0).m).collect(),
                exp_avg_sqs: owned.iter().map(|o| &state(&o.0).v).collect(),
                steps: owned
                    .iter()
                    .map(|o| Tensor::full([0i64; 0], state(&o.0).step as f64, (Kind::Float, model.device)))
                    .collect(),
            };
            let hyper = fused_adamw::Hyper {
                lr: g.initial_lr * lrm,
                betas: g.betas,
                weight_decay: g.weight_decay,
                eps: g.eps,
            };
            fused_adamw::step(&batch, hyper).map_err(|e| anyhow::anyhow!("AdamW group {}: {e}", g.name))?;
            for (i, view, _, sliced) in &owned {
                if *sliced {
                    let mut full = model.params[*i].tensor.shallow_clone();
                    coll.all_gather(view, &mut full)?;
                }
            }
        }
        Ok(())
    }

    /// Muon over the chunk of each group's matrices this rank owns, then the updated matrices
    /// gathered into every rank (a world of one writes them straight back).
    fn update_muon(
        &mut self,
        model: &mut Gpt,
        muon_reduced: &[(Tensor, Tensor)],
        coll: &mut dyn Collectives,
        lrm: f64,
        momentum: f64,
        muon_wd: f64,
    ) -> Result<()> {
        let (rank, world) = (self.rank, self.world);
        for (gi, g) in self.muon.iter().enumerate() {
            let (stacked, grad_chunk) = &muon_reduced[gi];
            let k = g.params.len() as i64;
            let chunk = grad_chunk.size()[0];
            let start = rank as i64 * chunk;
            let owned = chunk.min((k - start).max(0));
            // A world of one writes its update straight back: nothing to gather.
            let updated = if world == 1 { None } else { Some(grad_chunk.zeros_like()) };
            if owned > 0 {
                let mut params: Vec<Tensor> = g.params[start as usize..(start + owned) as usize]
                    .iter()
                    .map(|&i| model.params[i].tensor.detach())
                    .collect();
                let mut stacked_p = Tensor::stack(&params, 0);
                let st = self.muon_state[gi].get_or_insert_with(|| {
                    let (rows, cols) = (g.shape[0], g.shape[1]);
                    let second = if rows >= cols { [owned, rows, 1] } else { [owned, 1, cols] };
                    MuonState {
                        momentum: stacked_p.zeros_like(),
                        second: Tensor::zeros(second, (Kind::Float, model.device)),
                    }
                });
                let lr = g.initial_lr * lrm;
                muon_update(
                    &grad_chunk.narrow(0, 0, owned),
                    &mut stacked_p,
                    st,
                    momentum,
                    lr,
                    muon_wd,
                    g.beta2,
                    self.ns_kind,
                );
                match &updated {
                    Some(updated) => {
                        updated.narrow(0, 0, owned).copy_(&stacked_p);
                    }
                    None => {
                        for (j, p) in params.iter_mut().enumerate() {
                            p.copy_(&stacked_p.get(j as i64));
                        }
                    }
                }
                params.clear();
            }
            let Some(updated) = updated else { continue };
            let mut gathered = stacked.shallow_clone();
            coll.all_gather(&updated, &mut gathered)?;
            for (j, &i) in g.params.iter().enumerate() {
                model.params[i].tensor.detach().copy_(&gathered.get(j as i64));
            }
        }
        Ok(())
    }

    /// This rank's optimizer state by name (checkpoints).
    pub fn state_tensors(&self, model: &Gpt) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (i, st) in &self.adam_state {
            let n = &model.params[*i].name;
            out.push((format!("adam.{n}.m"), st.m.shallow_clone()));
            out.push((format!("adam.{n}.v"), st.v.shallow_clone()));
            out.push((format!("adam.{n}.step"), Tensor::from_slice(&[st.step])));
        }
        for (gi, st) in self.muon_state.iter().enumerate() {
            if let Some(st) = st {
                out.push((format!("muon.{gi}.momentum"), st.momentum.shallow_clone()));
                out.push((format!("muon.{gi}.second"), st.second.shallow_clone()));
            }
        }
        out
    }

    pub fn load_state(&mut self, model: &Gpt, tensors: &[(String, Tensor)]) -> Result<()> {
        let map: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let dev = model.device;
        self.adam_state.clear();
        for (i, p) in model.params.iter().enumerate() {
            let key = |s: &str| format!("adam.{}.{s}", p.name);
            if let (Some(m), Some(v), Some(step)) =
                (map.get(key("m").as_str()), map.get(key("v").as_str()), map.get(key("step").as_str()))
            {
                self.adam_state.insert(
                    i,
                    AdamState { step: step.int64_value(&[0]), m: m.to_device(dev), v: v.to_device(dev) },
                );
            }
        }
        for (gi, st) in self.muon_state.iter_mut().enumerate() {
            *st = match (
                map.get(format!("muon.{gi}.momentum").as_str()),
                map.get(format!("muon.{gi}.second").as_str()),
            ) {
                (Some(m), Some(s)) => {
                    Some(MuonState { momentum: m.to_device(dev), second: s.to_device(dev) })
                }
                _ => None,
            };
        }
        Ok(())
    }
}

/// Frobenius / row norm over `dims` (kept), accumulated in fp32.
fn fro(x: &Tensor, dims: &[i64]) -> Tensor {
    x.to_kind(Kind::Float).square().sum_dim_intlist(dims, true, Kind::Float).sqrt()
}

fn new_adam_state(p: &Tensor) -> AdamState {
    AdamState { step: 0, m: p.zeros_like(), v: p.zeros_like() }
}

/// The AdamW update of [`fused_adamw`] written as tensor ops (what the PyTorch reference in
/// `engine/reference/gpt_ref.py` does); the fused kernel is tested against it.
#[cfg(test)]
fn adamw_reference(p: &Tensor, grad: &Tensor, st: &mut AdamState, lr: f64, g: &AdamGroup) {
    let (b1, b2) = g.betas;
    st.step += 1;
    let mut p = p.shallow_clone();
    let _ = p.g_mul_scalar_(1.0 - lr * g.weight_decay);
    let _ = st.m.lerp_(grad, 1.0 - b1);
    let _ = st.v.lerp_(&grad.square(), 1.0 - b2);
    let bias1 = 1.0 - b1.powi(st.step as i32);
    let bias2 = 1.0 - b2.powi(st.step as i32);
    let mut denom = &st.v / bias2;
    let _ = denom.sqrt_().g_add_scalar_(g.eps);
    let _ = p.g_add_(&((&st.m / &denom) * (-lr / bias1)));
}

/// Squared L2 norm in fp32, read in one pass with no temporary the size of `t` (the grad norm
/// of every step reads every gradient once).
fn sq_norm(t: &Tensor) -> Tensor {
    let n = t.norm_scalaropt_dtype(2.0, Kind::Float);
    &n * &n
}

/// nanochat's Muon on a stack of matrices (n, rows, cols): Nesterov momentum, MuonEq row
/// equilibration, 5 Polar Express iterations, Muon+ renormalisation, NorMuon variance
/// reduction, cautious weight decay; LR scaled by `max(1, rows/cols)^0.5`.
#[allow(clippy::too_many_arguments)]
fn muon_update(
    grads: &Tensor,
    params: &mut Tensor,
    st: &mut MuonState,
    momentum: f64,
    lr: f64,
    wd: f64,
    beta2: f64,
    ns_kind: Kind,
) {
    let size = params.size();
    let (rows, cols) = (size[1], size[2]);
    let _ = st.momentum.lerp_(grads, 1.0 - momentum);
    let g = grads.lerp(&st.momentum, momentum);
    let mut x = g.to_kind(ns_kind);
    let target = fro(&x, &[-2, -1]) / (rows as f64).sqrt();
    let row_norm = fro(&x, &[-1]).clamp_min(1e-6);
    x = &x * (target / row_norm).to_kind(ns_kind);
    x = &x / (fro(&x, &[-2, -1]) * 1.01 + 1e-6).to_kind(ns_kind);
    if rows > cols {
        for (a, b, c) in POLAR_EXPRESS {
            let at = x.mt().matmul(&x);
            let bm = &at * b + at.matmul(&at) * c;
            x = &x * a + x.matmul(&bm);
        }
    } else {
        for (a, b, c) in POLAR_EXPRESS {
            let at = x.matmul(&x.mt());
            let bm = &at * b + at.matmul(&at) * c;
            x = &x * a + bm.matmul(&x);
        }
    }
    let mut g = x.to_kind(params.kind());
    let target_norm = (rows.min(cols) as f64).sqrt();
    let current = fro(&g, &[-2, -1]).clamp_min(1e-6);
    g = &g * (current.reciprocal() * target_norm).to_kind(g.kind());
    let red_dim: i64 = if rows >= cols { -1 } else { -2 };
    let red_size = if rows >= cols { cols } else { rows } as f64;
    let v_mean = g.to_kind(Kind::Float).square().mean_dim([red_dim].as_slice(), true, None::<Kind>);
    let v_norm = (v_mean.sum_dim_intlist([-2i64, -1].as_slice(), true, None::<Kind>) * red_size).sqrt();
    let _ = st.second.lerp_(&v_mean.to_kind(st.second.kind()), 1.0 - beta2);
    let step_size = st.second.clamp_min(1e-10).rsqrt();
    let scaled = (&v_mean * red_size) * step_size.to_kind(Kind::Float).square();
    let v_norm_new = scaled.sum_dim_intlist([-2i64, -1].as_slice(), true, None::<Kind>).sqrt();
    let final_scale = &step_size * (v_norm / v_norm_new.clamp_min(1e-10));
    g = &g * final_scale.to_kind(g.kind());
    let lr_eff = lr * (rows as f64 / cols as f64).max(1.0).sqrt();
    let mask = (&g * &*params).ge(0.0).to_kind(params.kind());
    let upd = &g * lr_eff + &*params * &mask * (lr_eff * wd);
    let _ = params.g_sub_(&upd);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's fused AdamW kernel (one call for a whole group, including a 0-d-shaped and a
    /// sliced view) takes the same steps as the update written as tensor ops.
    #[test]
    fn fused_adamw_equals_the_tensor_op_reference() {
        tch::manual_seed(7);
        let group = AdamGroup {
            name: "test",
            params: vec![],
            initial_lr: 0.01,
            betas: (0.8, 0.95),
            eps: 1e-10,
            weight_decay: 0.05,
        };
        let shapes: [&[i64]; 3] = [&[64, 16], &[5], &[1]];
        let params: Vec<Tensor> =
            shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, tch::Device::Cpu))).collect();
        let expected: Vec<Tensor> = params.iter().map(|p| p.copy()).collect();
        // The fused side updates a slice of a bigger tensor in place, as ZeRO-2 shards do.
        let backing = Tensor::zeros([2, 64, 16], (Kind::Float, tch::Device::Cpu));
        backing.get(1).copy_(&params[0]);
        let fused_params = [backing.get(1), params[1].copy(), params[2].copy()];
        let mut fused: Vec<AdamState> = fused_params.iter().map(new_adam_state).collect();
        let mut reference: Vec<AdamState> = expected.iter().map(new_adam_state).collect();
        for step in 1..=5 {
            let grads: Vec<Tensor> =
                shapes.iter().map(|s| Tensor::randn(*s, (Kind::Float, tch::Device::Cpu))).collect();
            let lr = group.initial_lr * (1.0 - 0.1 * step as f64);
            for ((p, g), st) in expected.iter().zip(&grads).zip(reference.iter_mut()) {
                adamw_reference(p, g, st, lr, &group);
            }
            fused.iter_mut().for_each(|st| st.step += 1);
            let batch = fused_adamw::Batch {
                params: fused_params.iter().collect(),
                grads: grads.iter().collect(),
                exp_avgs: fused.iter().map(|s| &s.m).collect(),
                exp_avg_sqs: fused.iter().map(|s| &s.v).collect(),
                steps: fused
                    .iter()
                    .map(|s| Tensor::full([0i64; 0], s.step as f64, (Kind::Float, tch::Device::Cpu)))
                    .collect(),
            };
            let hyper = fused_adamw::Hyper {
                lr,
                betas: group.betas,
                weight_decay: group.weight_decay,
                eps: group.eps,
            };
            fused_adamw::step(&batch, hyper).expect("fused AdamW");
        }
        for (i, (f, r)) in fused_params.iter().zip(&expected).enumerate() {
            let diff = (f - r).abs().max().double_value(&[]);
            assert!(diff < 1e-6, "parameter {i}: fused and reference differ by {diff}");
            assert!((f - &params[i]).abs().max().double_value(&[]) > 1e-3, "parameter {i} did not move");
        }
        assert_eq!(backing.get(0).abs().sum(Kind::Float).double_value(&[]), 0.0, "only the slice is written");
        // A mismatch is an error with libtorch's words, not a crash.
        let bad = fused_adamw::Batch {
            params: vec![&params[0]],
            grads: vec![&params[1]],
            exp_avgs: vec![&params[0]],
            exp_avg_sqs: vec![&params[0]],
            steps: vec![Tensor::full([0i64; 0], 1.0, (Kind::Float, tch::Device::Cpu))],
        };
        let hyper = fused_adamw::Hyper { lr: 0.1, betas: (0.9, 0.9), weight_decay: 0.0, eps: 1e-8 };
        let refused = fused_adamw::step(&bad, hyper).expect_err("mismatched shapes are refused");
        assert!(refused.contains("tensor 0: gradient is [5]"), "{refused}");
    }
}
