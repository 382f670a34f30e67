//! The nanochat GPT: untied embedding and LM head, parameter-free RMSNorm, rotary embeddings,
//! QK-norm, causal SDPA, ReLU^2 MLP, per-layer residual and x0 scalars, value embeddings with
//! gates on alternating layers, logit soft-cap, no biases. No I/O here.
//!
//! Master weights are fp32; the forward pass casts every weight to the compute dtype (bf16 on
//! GPU, fp32 on CPU) as nanochat's `Linear` does, instead of autocast.
use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use crate::attention;
use crate::config::GptConfig;
use crate::fused_loss;
use crate::fused_ops;

/// Which optimizer group a parameter belongs to (nanochat's split).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    LmHead,
    Embedding,
    ValueEmbedding,
    ResidLambdas,
    X0Lambdas,
    /// A 2-D matrix of a block: Muon.
    Matrix,
}

pub struct Param {
    pub name: String,
    pub tensor: Tensor,
    pub group: Group,
}

struct Block {
    c_q: usize,
    c_k: usize,
    c_v: usize,
    c_proj: usize,
    ve_gate: Option<usize>,
    c_fc: usize,
    mlp_proj: usize,
}

pub struct Gpt {
    pub cfg: GptConfig,
    pub device: Device,
    pub compute: Kind,
    pub params: Vec<Param>,
    wte: usize,
    lm_head: usize,
    resid_lambdas: usize,
    x0_lambdas: usize,
    value_embeds: BTreeMap<i64, usize>,
    blocks: Vec<Block>,
    cos: Tensor,
    sin: Tensor,
    /// Rotary + QK-norm, ReLU^2 and the residual mix as [`crate::fused_ops`] (a GPU's kernels).
    fused_blocks: bool,
}

/// Width of the input slice the value-embedding gate reads.
const VE_GATE_CHANNELS: i64 = 12;

fn norm(x: &Tensor) -> Tensor {
    let d = *x.size().last().expect("non-scalar");
    x.rms_norm([d], None::<Tensor>, None)
}

impl Gpt {
    /// A model with nanochat's initialisation drawn from `seed`.
    pub fn new(cfg: &GptConfig, device: Device, seed: u64) -> Self {
        let compute = if device.is_cuda() { Kind::BFloat16 } else { Kind::Float };
        let mut params: Vec<Param> = Vec::new();
        let d = cfg.n_embd;
        let v = cfg.vocab_size;
        let hd = cfg.n_head * cfg.head_dim;
        // Drawn where the model lives: on a GPU, initialising a d12 on the CPU and copying it
        // took 5 s of a 6.9 s start-up. (The same seed draws other numbers on a GPU than on the
        // CPU; every rank draws on the same kind of device, so ranks agree.)
        let opts = (Kind::Float, device);
        tch::manual_seed(seed as i64);
        let s = 3f64.sqrt() * (d as f64).powf(-0.5);
        let mut add = |name: String, t: Tensor, group: Group| -> usize {
            params.push(Param { name, tensor: t.to_device(device).set_requires_grad(true), group });
            params.len() - 1
        };
        let (wte, lm_head, resid_lambdas, x0_lambdas, value_embeds, blocks) = tch::no_grad(|| {
            let wte = add("wte".into(), Tensor::empty([v, d], opts).normal_(0.0, 0.8), Group::Embedding);
            let lm_head =
                add("lm_head".into(), Tensor::empty([v, d], opts).normal_(0.0, 0.001), Group::LmHead);
            let l = cfg.depth;
            let denom = (l - 1).max(1) as f64;
            let resid: Vec<f32> = (0..l).map(|i| (1.15 - 0.10 * i as f64 / denom) as f32).collect();
            let x0: Vec<f32> = (0..l).map(|i| (0.20 - 0.15 * i as f64 / denom) as f32).collect();
            let resid_lambdas = add("resid_lambdas".into(), Tensor::from_slice(&resid), Group::ResidLambdas);
            let x0_lambdas = add("x0_lambdas".into(), Tensor::from_slice(&x0), Group::X0Lambdas);
            let mut value_embeds = BTreeMap::new();
            let mut blocks = Vec::new();
            for i in 0..l {
                let u = |rows: i64, cols: i64, b: f64| Tensor::empty([rows, cols], opts).uniform_(-b, b);
                let z = |rows: i64, cols: i64| Tensor::zeros([rows, cols], opts);
                let m = Group::Matrix;
                let c_q = add(format!("h.{i}.c_q"), u(hd, d, s), m);
                let c_k = add(format!("h.{i}.c_k"), u(hd, d, s), m);
                let c_v = add(format!("h.{i}.c_v"), u(hd, d, s), m);
                let c_proj = add(format!("h.{i}.c_proj"), z(d, hd), m);
                let ve_gate = cfg.has_ve(i).then(|| {
                    let g = Tensor::empty([cfg.n_head, VE_GATE_CHANNELS], opts).uniform_(0.0, 0.02);
                    add(format!("h.{i}.ve_gate"), g, m)
                });
                let c_fc = add(format!("h.{i}.c_fc"), u(4 * d, d, 0.4 * s), m);
                let mlp_proj = add(format!("h.{i}.mlp_proj"), z(d, 4 * d), m);
                blocks.push(Block { c_q, c_k, c_v, c_proj, ve_gate, c_fc, mlp_proj });
            }
            for i in 0..l {
                if cfg.has_ve(i) {
                    let t = Tensor::empty([v, hd], opts).uniform_(-s, s);
                    value_embeds.insert(i, add(format!("ve.{i}"), t, Group::ValueEmbedding));
                }
            }
            (wte, lm_head, resid_lambdas, x0_lambdas, value_embeds, blocks)
        });
        let (cos, sin) = rotary(cfg.seq_len, cfg.head_dim, device, compute);
        Self {
            cfg: cfg.clone(),
            device,
            compute,
            params,
            wte,
            lm_head,
            resid_lambdas,
            x0_lambdas,
            value_embeds,
            blocks,
            cos,
            sin,
            fused_blocks: false,
        }
    }

    /// Runs the blocks' elementwise ops fused ([`crate::fused_ops`]); only where their kernels
    /// load (see `train::block_path`).
    pub fn set_fused_blocks(&mut self, on: bool) {
        self.fused_blocks = on;
    }

    fn p(&self, i: usize) -> &Tensor {
        &self.params[i].tensor
    }

    fn linear(&self, x: &Tensor, w: usize) -> Tensor {
        x.linear(&self.p(w).to_kind(self.compute), None::<Tensor>)
    }

    fn rope(&self, x: &Tensor) -> Tensor {
        let t = x.size()[1];
        let half = self.cfg.head_dim / 2;
        let cos = self.cos.narrow(1, 0, t);
        let sin = self.sin.narrow(1, 0, t);
        let x1 = x.narrow(3, 0, half);
        let x2 = x.narrow(3, half, half);
        let y1 = &x1 * &cos + &x2 * &sin;
        let y2 = &x2 * &cos - &x1 * &sin;
        Tensor::cat(&[y1, y2], 3)
    }

    fn attention(&self, layer: i64, b: &Block, x: &Tensor, ve: Option<&Tensor>) -> anyhow::Result<Tensor> {
        let (bs, t, _) = x.size3().expect("(B, T, C)");
        let (h, hd) = (self.cfg.n_head, self.cfg.head_dim);
        let q = self.linear(x, b.c_q).view([bs, t, h, hd]);
        let k = self.linear(x, b.c_k).view([bs, t, h, hd]);
        let v = self.linear(x, b.c_v).view([bs, t, h, hd]);
        // Value residual: v + gate * ve, gate = 3 * sigmoid(W x[..., :12]) in (0, 3).
        let v = match (ve, b.ve_gate) {
            (Some(ve), Some(g)) => {
                let gate = self.linear(&x.narrow(2, 0, VE_GATE_CHANNELS), g).sigmoid() * 3.0;
                v + gate.unsqueeze(-1) * ve.view([bs, t, h, hd])
            }
            _ => v,
        };
        let (q, k) = if self.fused_blocks {
            let half = [-1, hd / 2];
            let (cos, sin) = (self.cos.view(half), self.sin.view(half));
            (fused_ops::rope_norm(&q, &cos, &sin)?, fused_ops::rope_norm(&k, &cos, &sin)?)
        } else {
            (norm(&self.rope(&q)) * fused_ops::QK_SCALE, norm(&self.rope(&k)) * fused_ops::QK_SCALE)
        };
        let y = attention::causal(&q, &k, &v, self.cfg.window(layer))?;
        let y = y.contiguous().view([bs, t, h * hd]);
        Ok(self.linear(&y, b.c_proj))
    }

    /// Logits (B, T, V) in fp32 after the soft-cap.
    pub fn logits(&self, idx: &Tensor) -> anyhow::Result<Tensor> {
        let logits = self.linear(&self.hidden(idx)?, self.lm_head).to_kind(Kind::Float);
        let cap = self.cfg.softcap;
        Ok((logits / cap).tanh() * cap)
    }

    /// The final normed hidden states (B, T, d) in the compute kind: the LM head's input.
    pub fn hidden(&self, idx: &Tensor) -> anyhow::Result<Tensor> {
        let c = self.compute;
        let mut x = Tensor::embedding(self.p(self.wte), idx, -1, false, false).to_kind(c);
        x = norm(&x);
        let x0 = x.shallow_clone();
        let resid = self.p(self.resid_lambdas).to_kind(c);
        let x0l = self.p(self.x0_lambdas).to_kind(c);
        for (i, b) in self.blocks.iter().enumerate() {
            let (r, l) = (resid.get(i as i64), x0l.get(i as i64));
            x = if self.fused_blocks { fused_ops::resid_mix(&x, &x0, &r, &l)? } else { &x * r + &x0 * l };
            let ve = self
                .value_embeds
                .get(&(i as i64))
                .map(|&p| Tensor::embedding(self.p(p), idx, -1, false, false).to_kind(c));
            x = &x + self.attention(i as i64, b, &norm(&x), ve.as_ref())?;
            let u = self.linear(&norm(&x), b.c_fc);
            let h = if self.fused_blocks { fused_ops::relu_square(&u)? } else { u.relu().square() };
            x = &x + self.linear(&h, b.mlp_proj);
        }
        Ok(norm(&x))
    }

    /// Mean cross-entropy of `targets` (B, T) given `idx` (B, T).
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> anyhow::Result<Tensor> {
        let logits = self.logits(idx)?;
        let v = self.cfg.vocab_size;
        Ok(logits.reshape([-1, v]).cross_entropy_loss(
            &targets.reshape([-1]),
            None::<Tensor>,
            tch::Reduction::Mean,
            -1,
            0.0,
        ))
    }

    /// The mean loss (0-d, detached) and the gradient of `scale * loss` for every parameter, in
    /// `params` order. With `fused`, the output layer and the loss run forward and backward
    /// together in chunks ([`crate::fused_loss`]) and autograd starts from the hidden states;
    /// otherwise autograd runs over the whole unfused loss.
    pub fn loss_and_grads(
        &self,
        idx: &Tensor,
        targets: &Tensor,
        scale: f64,
        fused: Option<fused_loss::Path>,
    ) -> anyhow::Result<(Tensor, Vec<Tensor>)> {
        let Some(path) = fused else {
            let loss = self.loss(idx, targets)?;
            let grads = self.grads(&if scale == 1.0 { loss.shallow_clone() } else { &loss * scale });
            return Ok((loss.detach(), grads));
        };
        let h = self.hidden(idx)?;
        let d = self.cfg.n_embd;
        let h = h.reshape([-1, d]);
        let rows = fused_loss::chunk_rows(self.cfg.vocab_size, self.compute);
        let out = fused_loss::softcapped_xent(
            &h.detach(),
            self.p(self.lm_head),
            &targets.reshape([-1]),
            self.cfg.softcap,
            scale,
            rows,
            path,
        )?;
        // d(sum(h * dh))/dh = dh: autograd takes the hidden states' gradient from here.
        let surrogate = (&h * &out.d_hidden).sum(Kind::Float);
        let others: Vec<&Tensor> = self
            .params
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != self.lm_head)
            .map(|(_, p)| &p.tensor)
            .collect();
        let mut grads = Tensor::run_backward(&[surrogate], &others, false, false);
        grads.insert(self.lm_head, out.d_weight);
        Ok((out.loss, grads))
    }

    /// The gradient of `loss` for every parameter, in `params` order, computed by autograd
    /// without touching the parameters' `.grad` fields (see [`crate::optim::MuonAdamW::step`]).
    pub fn grads(&self, loss: &Tensor) -> Vec<Tensor> {
        let params: Vec<&Tensor> = self.params.iter().map(|p| &p.tensor).collect();
        Tensor::run_backward(&[loss], &params, false, false)
    }

    pub fn num_params(&self) -> i64 {
        self.params.iter().map(|p| p.tensor.numel() as i64).sum()
    }

    /// Parameters by name (checkpoints, weight export).
    pub fn named(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|p| (p.name.clone(), p.tensor.shallow_clone())).collect()
    }

    /// Overwrites every parameter from `tensors` (all names must be present, shapes equal).
    pub fn load_named(&mut self, tensors: &[(String, Tensor)]) -> anyhow::Result<()> {
        let map: BTreeMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        tch::no_grad(|| {
            for p in &mut self.params {
                let src = map
                    .get(p.name.as_str())
                    .ok_or_else(|| anyhow::anyhow!("weights lack parameter {}", p.name))?;
                anyhow::ensure!(
                    src.size() == p.tensor.size(),
                    "parameter {}: shape {:?}, weights have {:?}",
                    p.name,
                    p.tensor.size(),
                    src.size()
                );
                p.tensor.copy_(&src.to_device(self.device).to_kind(p.tensor.kind()));
            }
            Ok(())
        })
    }
}

/// cos/sin of rotary embeddings (base 100000), shape (1, T, 1, D/2).
fn rotary(seq_len: i64, head_dim: i64, device: Device, kind: Kind) -> (Tensor, Tensor) {
    let half = head_dim / 2;
    let opts = (Kind::Float, Device::Cpu);
    let ch = Tensor::arange_start_step(0, head_dim, 2, opts);
    let inv_freq = (ch / head_dim as f64 * 100000f64.ln()).exp().reciprocal();
    let t = Tensor::arange(seq_len, opts);
    let freqs = t.outer(&inv_freq);
    let shape = [1, seq_len, 1, half];
    let cos = freqs.cos().view(shape).to_kind(kind).to_device(device);
    let sin = freqs.sin().view(shape).to_kind(kind).to_device(device);
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_params_and_initial_loss() {
        let cfg = GptConfig::preset("d2", 16, 256).unwrap();
        let m = Gpt::new(&cfg, Device::Cpu, 1);
        // d2: width 128, one head; VE on layer 1 only.
        assert!(m.params.iter().any(|p| p.name == "ve.1"));
        assert!(!m.params.iter().any(|p| p.name == "ve.0"));
        let idx = Tensor::randint(256, [2, 16], (Kind::Int64, Device::Cpu));
        let logits = m.logits(&idx).unwrap();
        assert_eq!(logits.size(), vec![2, 16, 256]);
        // Tiny LM head init: the loss starts at ln(V).
        let loss = m.loss(&idx, &idx).unwrap().double_value(&[]);
        assert!((loss - 256f64.ln()).abs() < 0.05, "{loss}");
        loss_backward_reaches_every_param(&m, &idx);
    }

    /// The controller costs a built-in job's collectives from the preset alone
    /// (`trainyard_placement::cost::gpt_params`); it must list the parameters this model has.
    #[test]
    fn the_controller_knows_the_parameters_of_every_preset() {
        for (preset, vocab) in [("d2", 256), ("d5", 1000)] {
            let cfg = GptConfig::preset(preset, 16, vocab).unwrap();
            let m = Gpt::new(&cfg, Device::Cpu, 1);
            let ours: Vec<(Vec<u64>, bool)> = m
                .params
                .iter()
                .map(|p| {
                    (p.tensor.size().iter().map(|&d| d as u64).collect(), matches!(p.group, Group::Matrix))
                })
                .collect();
            let depth = cfg.depth as u64;
            assert_eq!(ours, trainyard_placement::cost::gpt_params(depth, vocab as u64), "{preset}");
        }
    }

    /// The fused path (chunked, tensor ops on the CPU) gives the unfused loss and gradients.
    #[test]
    fn the_fused_loss_path_equals_autograd() {
        let cfg = GptConfig::preset("d2", 16, 256).unwrap();
        let m = Gpt::new(&cfg, Device::Cpu, 1);
        // A larger LM head than the tiny init, so the soft-cap and the gradient matter.
        tch::no_grad(|| {
            let _ = m.p(m.lm_head).shallow_clone().normal_(0.0, 0.5);
        });
        let idx = Tensor::randint(256, [3, 16], (Kind::Int64, Device::Cpu));
        let y = Tensor::randint(256, [3, 16], (Kind::Int64, Device::Cpu));
        let (l0, g0) = m.loss_and_grads(&idx, &y, 0.5, None).unwrap();
        let (l1, g1) = m.loss_and_grads(&idx, &y, 0.5, Some(fused_loss::Path::TensorOps)).unwrap();
        let (l0, l1) = (l0.double_value(&[]), l1.double_value(&[]));
        assert!((l0 - l1).abs() < 1e-5 * l0, "{l0} vs {l1}");
        for ((p, a), b) in m.params.iter().zip(&g0).zip(&g1) {
            // Absolute floor: the residual scalars' gradients cancel to ~1e-7 at this init.
            let scale = a.abs().max().double_value(&[]);
            let err = (a - b).abs().max().double_value(&[]);
            assert!(err < 1e-4 * scale + 1e-6, "{}: {err} of {scale}", p.name);
        }
    }

    /// The fused block ops (their tensor-op references here, through the custom autograd op)
    /// give the unfused model's loss and gradients; on a GPU the same wiring runs the kernels.
    #[test]
    fn the_fused_blocks_equal_the_unfused_ones() {
        let cfg = GptConfig::preset("d2", 16, 256).unwrap();
        let mut m = Gpt::new(&cfg, Device::Cpu, 3);
        tch::no_grad(|| {
            // Non-zero output projections, so every op's gradient reaches the loss.
            for p in &m.params {
                if p.name.ends_with("c_proj") || p.name.ends_with("mlp_proj") {
                    let _ = p.tensor.shallow_clone().normal_(0.0, 0.05);
                }
            }
        });
        let idx = Tensor::randint(256, [2, 16], (Kind::Int64, Device::Cpu));
        let (l0, g0) = m.loss_and_grads(&idx, &idx, 1.0, None).unwrap();
        m.set_fused_blocks(true);
        let (l1, g1) = m.loss_and_grads(&idx, &idx, 1.0, None).unwrap();
        let (l0, l1) = (l0.double_value(&[]), l1.double_value(&[]));
        assert!((l0 - l1).abs() < 1e-5 * l0, "{l0} vs {l1}");
        for ((p, a), b) in m.params.iter().zip(&g0).zip(&g1) {
            let scale = a.abs().max().double_value(&[]);
            let err = (a - b).abs().max().double_value(&[]);
            assert!(err < 1e-4 * scale + 1e-7, "{}: {err} of {scale}", p.name);
        }
    }

    fn loss_backward_reaches_every_param(m: &Gpt, idx: &Tensor) {
        let grads = m.grads(&m.loss(idx, idx).unwrap());
        assert_eq!(grads.len(), m.params.len());
        for (p, g) in m.params.iter().zip(&grads) {
            assert!(g.defined(), "{} has no gradient", p.name);
            assert_eq!(g.size(), p.tensor.size(), "{}", p.name);
            // Returned, not accumulated into the parameter's .grad.
            assert!(!p.tensor.grad().defined(), "{} has a .grad", p.name);
        }
    }
}
