//! Choosing the next token from logits: greedy, or temperature + nucleus (top-p) + top-k sampling
//! with a seeded generator, so a request with a seed is reproducible (streaming or not).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

/// How a request wants its tokens chosen (OpenAI's parameters).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probabilities add up to at least this (1 = all).
    pub top_p: f32,
    /// Keep at most this many of the most likely tokens (0 = no limit).
    pub top_k: usize,
    /// Seeds the generator; `None` draws a seed from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Refuses values no sampler can honour (checked once, when a request arrives).
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::Input(format!(
                "temperature {} must be ≥ 0",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::Input(format!(
                "top_p {} must be in (0, 1]",
                self.top_p
            )));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Scratch: (probability, token) pairs, reused across steps.
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_entropy(),
        };
        Ok(Self {
            params,
            rng,
            scratch: Vec::new(),
        })
    }

    /// The next token for one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() {
            return Err(Error::Input("no logits to sample from".into()));
        }
        if self.params.temperature == 0.0 {
            return Ok(argmax(logits));
        }
        let inv_t = 1.0 / self.params.temperature;
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (((l - max) * inv_t).exp(), i as u32)),
        );
        // Most likely first; ties by token id, so the order (and the draw) is deterministic.
        self.scratch
            .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        if self.params.top_k > 0 {
            self.scratch.truncate(self.params.top_k);
        }
        let total: f32 = self.scratch.iter().map(|p| p.0).sum();
        if !(total.is_finite() && total > 0.0) {
            return Err(Error::Input("logits are not finite".into()));
        }
        if self.params.top_p < 1.0 {
            let mut cumulative = 0.0;
            let keep = self
                .scratch
                .iter()
                .position(|p| {
                    cumulative += p.0 / total;
                    cumulative >= self.params.top_p
                })
                .map_or(self.scratch.len(), |i| i + 1);
            self.scratch.truncate(keep);
        }
        let kept: f32 = self.scratch.iter().map(|p| p.0).sum();
        let mut target = self.rng.r#gen::<f32>() * kept;
        for &(p, token) in &self.scratch {
            if target < p {
                return Ok(token);
            }
            target -= p;
        }
        // Rounding left the target past the end: the last kept token.
        Ok(self.scratch.last().map_or(0, |p| p.1))
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k: 0,
            seed: Some(seed),
        }
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]).unwrap(), 1);
    }

    #[test]
    fn a_seed_reproduces_the_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(params(1.0, 1.0, seed)).unwrap();
            (0..20)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // Probabilities ~0.64, 0.24, 0.09, 0.03: top_p 0.8 keeps the first two.
        let logits = [3.0, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(params(1.0, 0.8, 1)).unwrap();
        let drawn: std::collections::BTreeSet<u32> =
            (0..500).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(drawn.into_iter().collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn bad_parameters_are_refused() {
        assert!(Sampler::new(params(-1.0, 1.0, 0)).is_err());
        assert!(Sampler::new(params(1.0, 0.0, 0)).is_err());
        assert!(Sampler::new(params(f32::NAN, 1.0, 0)).is_err());
    }
}
