"""PyTorch reference of trainyard's built-in engine: the same nanochat-style GPT, the same
Muon + AdamW (world size 1), the same data sampling. Used by the parity test (same exported
weights, same batches, fp32 on CPU), by bench.sh (tokens/s against the Rust engine on CPU) and
by deploy/gpu/check.sh (the same on a GPU: bf16 compute as the engine does it, eager and, with
--compile, torch.compile).

    python gpt_ref.py --weights init.safetensors --train train_000000.bin --vocab-size 3648 ...

Prints one JSON object: {"losses": [...], "tokens_per_s": ..., "steps": ..., "step_ms": [...]}
plus, on CUDA, the caching allocator's peaks.
"""
import argparse
import json
import math
import struct
import time

import torch
import torch.nn.functional as F

MASK = (1 << 64) - 1
B_REF = 524288.0
POLAR = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def read_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, count = struct.unpack_from("<3i", data, 0)
    assert magic == 20240520 and version == 1, path
    assert len(data) == 1024 + 2 * count, path
    return torch.frombuffer(bytearray(data[1024:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta["dtype"])
        a, b = meta["data_offsets"]
        buf = bytearray(data[8 + n + a : 8 + n + b])
        out[name] = torch.frombuffer(buf, dtype=torch.float32).reshape(meta["shape"]).clone()
    return out


class Rows:
    def __init__(self, paths, seq_len):
        self.row = seq_len + 1
        self.shards = [read_shard(p) for p in paths]
        self.starts = [max(len(s) + 1 - self.row, 0) for s in self.shards]
        self.total = sum(self.starts)

    def window(self, k):
        for s, n in zip(self.shards, self.starts):
            if k < n:
                return s[k : k + self.row]
            k -= n
        raise IndexError(k)

    def random_rows(self, seed, first_row, rows):
        out = []
        for r in range(rows):
            h = splitmix64(seed ^ splitmix64(first_row + r))
            out.append(self.window(h % self.total))
        return torch.stack(out)


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class GPT:
    """Master weights in fp32; on CUDA every weight is cast to bf16 where it is used (as the
    engine and nanochat's Linear do), on CPU everything stays fp32."""

    def __init__(self, weights, depth, n_head, head_dim, seq_len, softcap=15.0, device="cpu"):
        self.w = {k: v.to(device).requires_grad_(True) for k, v in weights.items()}
        self.depth, self.h, self.hd, self.softcap = depth, n_head, head_dim, softcap
        self.dt = torch.bfloat16 if device == "cuda" else torch.float32
        inv = 1.0 / torch.exp(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim * math.log(100000.0))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
        self.cos = freqs.cos().view(1, seq_len, 1, head_dim // 2).to(device, self.dt)
        self.sin = freqs.sin().view(1, seq_len, 1, head_dim // 2).to(device, self.dt)

    def c(self, name):
        return self.w[name].to(self.dt)

    def rope(self, x):
        t, half = x.size(1), self.hd // 2
        cos, sin = self.cos[:, :t], self.sin[:, :t]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], 3)

    def loss(self, idx, targets):
        c = self.c
        B, T = idx.shape
        x = norm(F.embedding(idx, self.w["wte"]).to(self.dt))
        x0 = x
        resid, x0l = c("resid_lambdas"), c("x0_lambdas")
        for i in range(self.depth):
            x = x * resid[i] + x0 * x0l[i]
            p = f"h.{i}."
            xn = norm(x)
            q = F.linear(xn, c(p + "c_q")).view(B, T, self.h, self.hd)
            k = F.linear(xn, c(p + "c_k")).view(B, T, self.h, self.hd)
            v = F.linear(xn, c(p + "c_v")).view(B, T, self.h, self.hd)
            if f"ve.{i}" in self.w:
                ve = F.embedding(idx, self.w[f"ve.{i}"]).to(self.dt).view(B, T, self.h, self.hd)
                gate = torch.sigmoid(F.linear(xn[..., :12], c(p + "ve_gate"))) * 3.0
                v = v + gate.unsqueeze(-1) * ve
            q = norm(self.rope(q)) * 1.2
            k = norm(self.rope(k)) * 1.2
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, -1)
            x = x + F.linear(y, c(p + "c_proj"))
            h = F.relu(F.linear(norm(x), c(p + "c_fc"))).square()
            x = x + F.linear(h, c(p + "mlp_proj"))
        logits = F.linear(norm(x), c("lm_head")).float()
        logits = torch.tanh(logits / self.softcap) * self.softcap
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def fro(x, dims):
    return x.float().square().sum(dim=dims, keepdim=True).sqrt()


class MuonAdamW:
    """nanochat's MuonAdamW for one rank, as per-tensor in-place ops (mirrors optim.rs)."""

    def __init__(self, model, names, a):
        # Newton-Schulz (Polar Express) runs in the compute dtype, as the engine's optim.rs does.
        self.ns_dt = model.dt
        d = model.w["wte"].size(1)
        s_b = a.lr_scale if a.lr_scale is not None else math.sqrt(a.total_batch_size / B_REF)
        dms = (d / 768) ** -0.5
        w = model.w
        ves = [n for n in names if n.startswith("ve.")]
        self.adam = [
            (["lm_head"], a.unembedding_lr * s_b * dms, (0.8, 0.96), 0.01),
            (["wte"], a.embedding_lr * s_b * dms, (0.8, 0.995), 0.001),
            (ves, a.embedding_lr * s_b * dms * 0.5, (0.8, 0.995), 0.01),
            (["resid_lambdas"], a.scalar_lr * s_b * 0.01, (0.8, 0.95), 0.05),
            (["x0_lambdas"], a.scalar_lr * s_b, (0.96, 0.95), 0.0),
        ]
        shapes = {}
        for n in names:
            if n.startswith("h."):
                shapes.setdefault(tuple(w[n].shape), []).append(n)
        self.muon = [(shape, shapes[shape]) for shape in sorted(shapes)]
        self.matrix_lr = a.matrix_lr * s_b
        self.w = w
        self.state = {}

    @torch.no_grad()
    def step(self, lrm, momentum, wd_muon):
        w = self.w
        for params, lr0, (b1, b2), wd in self.adam:
            lr = lr0 * lrm
            for n in params:
                p, g = w[n], w[n].grad
                st = self.state.setdefault(n, {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
                st["step"] += 1
                p.mul_(1 - lr * wd)
                st["m"].lerp_(g, 1 - b1)
                st["v"].lerp_(g.square(), 1 - b2)
                bias1 = 1 - b1 ** st["step"]
                bias2 = 1 - b2 ** st["step"]
                denom = (st["v"] / bias2).sqrt_().add_(1e-10)
                p.add_((st["m"] / denom) * (-lr / bias1))
        for gi, (shape, params) in enumerate(self.muon):
            rows, cols = shape
            g = torch.stack([w[n].grad for n in params])
            P = torch.stack([w[n].detach() for n in params])
            st = self.state.setdefault(("muon", gi), None)
            if st is None:
                second = (len(params), rows, 1) if rows >= cols else (len(params), 1, cols)
                st = {"m": torch.zeros_like(P), "s": torch.zeros(second, device=P.device)}
                self.state[("muon", gi)] = st
            st["m"].lerp_(g, 1 - momentum)
            x = g.lerp(st["m"], momentum).to(self.ns_dt)
            x = x * (fro(x, (-2, -1)) / rows**0.5 / fro(x, (-1,)).clamp_min(1e-6)).to(x.dtype)
            x = x / (fro(x, (-2, -1)) * 1.01 + 1e-6).to(x.dtype)
            for a, b, c in POLAR:
                if rows > cols:
                    A = x.mT @ x
                    x = x * a + x @ (A * b + (A @ A) * c)
                else:
                    A = x @ x.mT
                    x = x * a + (A * b + (A @ A) * c) @ x
            x = x.float()
            x = x * (fro(x, (-2, -1)).clamp_min(1e-6).reciprocal() * min(rows, cols) ** 0.5)
            red, size = (-1, cols) if rows >= cols else (-2, rows)
            v_mean = x.square().mean(dim=red, keepdim=True)
            v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * size).sqrt()
            st["s"].lerp_(v_mean, 1 - 0.9)
            step_size = st["s"].clamp_min(1e-10).rsqrt()
            v_norm_new = ((v_mean * size) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
            x = x * (step_size * (v_norm / v_norm_new.clamp_min(1e-10)))
            lr = self.matrix_lr * lrm * max(1.0, rows / cols) ** 0.5
            mask = ((x * P) >= 0).float()
            P.sub_(x * lr + P * mask * (lr * wd_muon))
            for j, n in enumerate(params):
                w[n].copy_(P[j])
        for p in w.values():
            p.grad = None


def schedules(a, it):
    n = a.num_iterations
    warmdown = round(a.warmdown_ratio * n)
    if it < a.warmup_steps:
        lrm = (it + 1) / a.warmup_steps
    elif it <= n - warmdown:
        lrm = 1.0
    else:
        p = (n - it) / warmdown
        lrm = p + (1 - p) * a.final_lr_frac
    ws = n - warmdown
    if it < 400:
        f = it / 400
        mom = (1 - f) * 0.85 + f * 0.97
    elif it >= ws and warmdown > 0:
        p = (it - ws) / warmdown
        mom = 0.97 * (1 - p) + 0.90 * p
    else:
        mom = 0.97
    wd = a.weight_decay * math.sqrt(a.total_batch_size / B_REF) * 0.5 * (1 + math.cos(math.pi * it / n))
    return lrm, mom, wd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--train", nargs="+", required=True)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--device-batch-size", type=int, default=4)
    ap.add_argument("--total-batch-size", type=int, default=512)
    ap.add_argument("--num-iterations", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--warmdown-ratio", type=float, default=0.65)
    ap.add_argument("--final-lr-frac", type=float, default=0.05)
    ap.add_argument("--matrix-lr", type=float, default=0.02)
    ap.add_argument("--embedding-lr", type=float, default=0.3)
    ap.add_argument("--unembedding-lr", type=float, default=0.008)
    ap.add_argument("--scalar-lr", type=float, default=0.5)
    ap.add_argument("--weight-decay", type=float, default=0.28)
    ap.add_argument("--lr-scale", type=float, default=None)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the forward and loss")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    cuda = a.device == "cuda"
    weights = read_safetensors(a.weights)
    names = list(weights)
    n_embd = weights["wte"].size(1)
    model = GPT(weights, a.depth, n_embd // 128, 128, a.seq_len, device=a.device)
    loss_fn = torch.compile(model.loss) if a.compile else model.loss
    opt = MuonAdamW(model, names, a)
    data = Rows(a.train, a.seq_len)
    B, T = a.device_batch_size, a.seq_len
    accum = a.total_batch_size // (B * T)
    assert accum * B * T == a.total_batch_size
    losses, times = [], []
    for step in range(a.num_iterations):
        t0 = time.perf_counter()
        total = torch.zeros((), device=a.device)
        for micro in range(accum):
            rows = data.random_rows(a.seed, (step * accum + micro) * B, B).to(a.device, non_blocking=True)
            loss = loss_fn(rows[:, :-1], rows[:, 1:])
            (loss / accum).backward()
            total += loss.detach()
        lrm, mom, wd = schedules(a, step)
        opt.step(lrm, mom, wd)
        losses.append(total.item() / accum)  # synchronises the device: the step is done
        times.append(time.perf_counter() - t0)
        if cuda and step == 0:
            torch.cuda.reset_peak_memory_stats()
    steady = times[2:] if len(times) > 4 else times
    out = {"losses": losses, "steps": len(losses), "step_ms": [t * 1e3 for t in times],
           "tokens_per_s": a.total_batch_size * len(steady) / sum(steady),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "compile": a.compile,
           "torch": torch.__version__}
    if cuda:
        out.update({"peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
                    "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version()))})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
