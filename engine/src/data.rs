//! Token shards (modded-nanogpt's `.bin` format) and deterministic batches.
//!
//! A shard is 256 little-endian int32 (magic 20240520, version 1, token count, the rest zero)
//! followed by `count` little-endian uint16 tokens. Shards are memory-mapped. A batch row is a
//! window of `seq_len + 1` tokens whose place is a pure function of (seed, global row index),
//! the global row index being a function of (step, micro-step, rank, row): so a resumed run
//! sees the same data, and W ranks together see exactly the rows one rank would.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use tch::{Device, Tensor};
use thiserror::Error;

pub const MAGIC: i32 = 20240520;
pub const VERSION: i32 = 1;
pub const HEADER_BYTES: usize = 256 * 4;

#[derive(Debug, Error)]
pub enum DataError {
    #[error("shard {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("shard {path}: file is {len} bytes, shorter than the 1024-byte header")]
    ShortHeader { path: PathBuf, len: u64 },
    #[error("shard {path}: wrong magic {found} (expected {MAGIC}); not a token shard")]
    BadMagic { path: PathBuf, found: i32 },
    #[error("shard {path}: unsupported version {found} (expected {VERSION})")]
    BadVersion { path: PathBuf, found: i32 },
    #[error("shard {path}: header claims {count} tokens ({need} bytes) but the file has {len} bytes")]
    Truncated { path: PathBuf, count: i64, need: u64, len: u64 },
    #[error("shard {path}: token {token} at position {pos} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { path: PathBuf, token: u16, pos: usize, vocab: i64 },
    #[error("no shards given for {0}")]
    NoShards(&'static str),
    #[error("{what}: {tokens} tokens in all, fewer than one row of {need}")]
    TooSmall { what: &'static str, tokens: usize, need: usize },
}

/// One memory-mapped, validated shard.
pub struct Shard {
    pub path: PathBuf,
    map: Mmap,
    count: usize,
}

impl Shard {
    pub fn open(path: &Path) -> Result<Self, DataError> {
        let io = |source| DataError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len < HEADER_BYTES as u64 {
            return Err(DataError::ShortHeader { path: path.to_path_buf(), len });
        }
        // SAFETY: the shard is opened read-only and not modified while mapped (shards are
        // written once, to a temporary name, then renamed).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let word = |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().unwrap());
        if word(0) != MAGIC {
            return Err(DataError::BadMagic { path: path.to_path_buf(), found: word(0) });
        }
        if word(1) != VERSION {
            return Err(DataError::BadVersion { path: path.to_path_buf(), found: word(1) });
        }
        let count = word(2);
        let need = HEADER_BYTES as u64 + 2 * count.max(0) as u64;
        if count < 0 || len != need {
            return Err(DataError::Truncated { path: path.to_path_buf(), count: count as i64, need, len });
        }
        Ok(Self { path: path.to_path_buf(), map, count: count as usize })
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn token(&self, i: usize) -> u16 {
        let o = HEADER_BYTES + 2 * i;
        u16::from_le_bytes([self.map[o], self.map[o + 1]])
    }

    /// Fails on the first token outside `0..vocab`.
    pub fn check_vocab(&self, vocab: i64) -> Result<(), DataError> {
        for i in 0..self.count {
            let t = self.token(i);
            if t as i64 >= vocab {
                return Err(DataError::TokenOutOfRange { path: self.path.clone(), token: t, pos: i, vocab });
            }
        }
        Ok(())
    }
}

/// Writes a shard atomically (temporary name, then rename).
pub fn write_shard(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    let mut header = [0i32; 256];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = i32::try_from(tokens.len()).map_err(std::io::Error::other)?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 2 * tokens.len());
    for w in header {
        bytes.extend_from_slice(&w.to_le_bytes());
    }
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    let tmp = path.with_extension("bin.tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(&bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// SplitMix64: the stateless hash behind every data choice.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A set of shards read as one token stream.
pub struct TokenSet {
    shards: Vec<Shard>,
    /// Number of windows of `row` tokens starting in each shard.
    starts: Vec<usize>,
    total_starts: usize,
    row: usize,
}

impl TokenSet {
    pub fn open(what: &'static str, paths: &[PathBuf], seq_len: i64, vocab: i64) -> Result<Self, DataError> {
        if paths.is_empty() {
            return Err(DataError::NoShards(what));
        }
        let row = seq_len as usize + 1;
        let mut shards = Vec::new();
        for p in paths {
            let s = Shard::open(p)?;
            s.check_vocab(vocab)?;
            shards.push(s);
        }
        let starts: Vec<usize> = shards.iter().map(|s| (s.len() + 1).saturating_sub(row)).collect();
        let total_starts = starts.iter().sum();
        if total_starts == 0 {
            let tokens = shards.iter().map(Shard::len).max().unwrap_or(0);
            return Err(DataError::TooSmall { what, tokens, need: row });
        }
        Ok(Self { shards, starts, total_starts, row })
    }

    pub fn tokens(&self) -> usize {
        self.shards.iter().map(Shard::len).sum()
    }

    /// Window `k` in `0..total_starts` (over all shards), appended to `out` as i64.
    fn window(&self, mut k: usize, out: &mut Vec<i64>) {
        for (s, &n) in self.shards.iter().zip(&self.starts) {
            if k < n {
                out.extend((k..k + self.row).map(|i| s.token(i) as i64));
                return;
            }
            k -= n;
        }
        unreachable!("window index beyond the token set");
    }

    /// Training rows: a random window per global row index (seeded, stateless).
    pub fn random_rows(&self, seed: u64, first_row: u64, rows: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(rows * self.row);
        for r in 0..rows as u64 {
            let h = splitmix64(seed ^ splitmix64(first_row + r));
            self.window((h % self.total_starts as u64) as usize, &mut out);
        }
        out
    }

    /// Evaluation rows: consecutive non-overlapping windows from the start, wrapping around.
    pub fn sequential_rows(&self, first_row: u64, rows: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(rows * self.row);
        let step = self.row - 1;
        for r in 0..rows as u64 {
            let k = ((first_row + r) as usize * step) % self.total_starts;
            self.window(k, &mut out);
        }
        out
    }
}

/// Inputs and targets (B, T) as int64 tensors on `device`.
pub fn to_batch(rows: &[i64], batch: i64, seq_len: i64, device: Device) -> (Tensor, Tensor) {
    let t = Tensor::from_slice(rows).view([batch, seq_len + 1]);
    let x = t.narrow(1, 0, seq_len).to_device(device);
    let y = t.narrow(1, 1, seq_len).to_device(device);
    (x.contiguous(), y.contiguous())
}

/// Where the rows of one micro-step of one rank start in the global row sequence.
pub fn first_row(step: i64, micro: i64, accum: i64, world: i64, rank: i64, batch: i64) -> u64 {
    (((step * accum + micro) * world + rank) * batch) as u64
}

/// GPT-2 BPE tokenisation of text files into shards: every document is `<|endoftext|>`
/// followed by its tokens; the last `val_fraction` of each document's tokens goes to the
/// validation shard. With `compact`, ids are renumbered densely (0 = `<|endoftext|>`, then the
/// GPT-2 ids present, ascending) and `vocab.json` maps them back: a small corpus then trains a
/// model with a vocabulary of a few thousand instead of 50304 (CPU tests). Returns (train
/// tokens, val tokens, vocabulary size to train with).
pub fn tokenize_files(
    files: &[PathBuf],
    out_dir: &Path,
    val_fraction: f64,
    shard_tokens: usize,
    compact: bool,
) -> anyhow::Result<(usize, usize, i64)> {
    anyhow::ensure!(!files.is_empty(), "tokenize: no input files");
    anyhow::ensure!((0.0..1.0).contains(&val_fraction), "val fraction must be in [0, 1)");
    anyhow::ensure!(shard_tokens > 0, "shard size must be positive");
    let bpe = tiktoken_rs::r50k_base()?;
    let mut train: Vec<u16> = Vec::new();
    let mut val: Vec<u16> = Vec::new();
    for f in files {
        let text =
            std::fs::read_to_string(f).map_err(|e| anyhow::anyhow!("tokenize: {}: {e}", f.display()))?;
        let mut doc = vec![crate::config::GPT2_EOT];
        doc.extend(bpe.encode_ordinary(&text).into_iter().map(|t| t as u16));
        let n_val = (doc.len() as f64 * val_fraction).floor() as usize;
        let (a, b) = doc.split_at(doc.len() - n_val);
        train.extend_from_slice(a);
        if !b.is_empty() {
            val.push(crate::config::GPT2_EOT);
            val.extend_from_slice(b);
        }
    }
    std::fs::create_dir_all(out_dir)?;
    let mut vocab = crate::config::GPT2_VOCAB;
    if compact {
        let mut ids: Vec<u16> = train.iter().chain(&val).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids.retain(|&t| t != crate::config::GPT2_EOT);
        ids.insert(0, crate::config::GPT2_EOT);
        let mut map = vec![0u16; 65536];
        for (new, &old) in ids.iter().enumerate() {
            map[old as usize] = new as u16;
        }
        for t in train.iter_mut().chain(val.iter_mut()) {
            *t = map[*t as usize];
        }
        vocab = (ids.len() as i64).div_euclid(64) * 64 + 64;
        let json = serde_json::json!({"gpt2_ids": ids, "vocab_size": vocab});
        std::fs::write(out_dir.join("vocab.json"), serde_json::to_vec(&json)?)?;
    }
    for (i, chunk) in train.chunks(shard_tokens).enumerate() {
        write_shard(&out_dir.join(format!("train_{i:06}.bin")), chunk)?;
    }
    for (i, chunk) in val.chunks(shard_tokens).enumerate() {
        write_shard(&out_dir.join(format!("val_{i:06}.bin")), chunk)?;
    }
    Ok((train.len(), val.len(), vocab))
}

/// Unigram entropy (nats) of the tokens of the shards: the loss of the best context-free model.
pub fn unigram_entropy(paths: &[PathBuf]) -> Result<f64, DataError> {
    let mut counts = vec![0u64; 65536];
    let mut n = 0u64;
    for p in paths {
        let s = Shard::open(p)?;
        for i in 0..s.len() {
            counts[s.token(i) as usize] += 1;
            n += 1;
        }
    }
    Ok(counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.ln()
        })
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_roundtrip_and_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        write_shard(&p, &[1, 2, 3, 65535]).unwrap();
        let s = Shard::open(&p).unwrap();
        assert_eq!((s.len(), s.token(3)), (4, 65535));
        assert!(matches!(s.check_vocab(1000), Err(DataError::TokenOutOfRange { pos: 3, .. })));

        let bytes = std::fs::read(&p).unwrap();
        let short = dir.path().join("short.bin");
        std::fs::write(&short, &bytes[..bytes.len() - 1]).unwrap();
        let e = Shard::open(&short).err().unwrap();
        assert!(matches!(e, DataError::Truncated { count: 4, .. }), "{e}");
        std::fs::write(&short, &bytes[..100]).unwrap();
        assert!(matches!(Shard::open(&short), Err(DataError::ShortHeader { len: 100, .. })));
        let mut bad = bytes.clone();
        bad[0] ^= 1;
        std::fs::write(&short, &bad).unwrap();
        let e = Shard::open(&short).err().unwrap();
        assert!(e.to_string().contains("wrong magic"), "{e}");
        let mut bad = bytes;
        bad[4] = 2;
        std::fs::write(&short, &bad).unwrap();
        assert!(matches!(Shard::open(&short), Err(DataError::BadVersion { found: 2, .. })));
        assert!(matches!(Shard::open(&dir.path().join("missing.bin")), Err(DataError::Io { .. })));
    }

    #[test]
    fn rows_are_deterministic_and_split_across_ranks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.bin");
        let toks: Vec<u16> = (0..1000).map(|i| (i % 97) as u16).collect();
        write_shard(&p, &toks).unwrap();
        let set = TokenSet::open("train", &[p], 8, 100).unwrap();
        let a = set.random_rows(7, 0, 4);
        assert_eq!(a, set.random_rows(7, 0, 4));
        assert_ne!(a, set.random_rows(8, 0, 4));
        // Two ranks with two rows each see the rows of one rank with four.
        let (w, b) = (2, 2);
        let r0 = set.random_rows(7, first_row(0, 0, 1, w, 0, b), 2);
        let r1 = set.random_rows(7, first_row(0, 0, 1, w, 1, b), 2);
        assert_eq!([r0, r1].concat(), set.random_rows(7, first_row(0, 0, 1, 1, 0, 4), 4));
        // Each row is consecutive tokens of the shard.
        for row in a.chunks(9) {
            for k in 1..9 {
                assert_eq!((row[k - 1] + 1) % 97, row[k]);
            }
        }
    }
}
