//! Reproducible noise for tests and benches without a crate: xorshift64* for uniforms and
//! Box-Muller for normals, so a "lognormal step time" in a test is the same on every machine.

/// A seeded generator.
pub struct Noise(u64);

impl Noise {
    /// A generator from `seed` (any value; 0 is replaced, xorshift needs a non-zero state).
    pub fn new(seed: u64) -> Noise {
        Noise(if seed == 0 { 0x9E37_79B9_7F4A_7C15 } else { seed })
    }

    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal.
    pub fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::Noise;

    #[test]
    fn normals_have_the_right_moments_and_repeat_by_seed() {
        let mut n = Noise::new(3);
        let xs: Vec<f64> = (0..20_000).map(|_| n.normal()).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean}, variance {var}");
        assert_eq!(Noise::new(3).normal(), xs[0]);
        assert!((0..1000).map(|_| n.uniform()).all(|u| u > 0.0 && u < 1.0));
    }
}
