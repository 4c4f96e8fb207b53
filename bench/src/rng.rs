//! A small deterministic random source (SplitMix64): the same seed gives the same workload on
//! every machine, with no dependency for it.

#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(f64::MIN_POSITIVE);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Log-normal with the given mean and shape `sigma` (of the underlying normal).
    pub fn log_normal(&mut self, mean: f64, sigma: f64) -> f64 {
        let mu = mean.ln() - sigma * sigma / 2.0;
        (mu + sigma * self.normal()).exp()
    }

    /// Exponential with the given mean (gaps of a Poisson process).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.uniform()).ln()
    }

    /// Fisher–Yates.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_have_their_means() {
        let mut r = Rng::new(7);
        let n = 200_000;
        let ln: f64 = (0..n).map(|_| r.log_normal(500.0, 0.8)).sum::<f64>() / n as f64;
        assert!((ln / 500.0 - 1.0).abs() < 0.02, "log-normal mean {ln}");
        let ex: f64 = (0..n).map(|_| r.exponential(0.25)).sum::<f64>() / n as f64;
        assert!((ex / 0.25 - 1.0).abs() < 0.02, "exponential mean {ex}");
        assert_eq!(Rng::new(1).next_u64(), Rng::new(1).next_u64());
    }
}
