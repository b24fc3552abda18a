//! Weights of a model's shapes made from a seed, for benchmarks on machines that have no
//! checkpoint (a GPU check carries no model; a 7B file would not fit what it may carry).
//! Projections and the embedding are random blocks of a block dtype with small scales, norms
//! are ones: the numbers mean nothing, the shapes, dtypes and bytes are a real model's.

use kiln_tensor::{DType, Device, Tensor};

use crate::weights::{Weight, WeightSource};
use crate::{ModelConfig, ModelError, Result};

/// A [`WeightSource`] of random weights for `cfg`'s shapes.
#[derive(Debug, Clone)]
pub struct SyntheticSource {
    cfg: ModelConfig,
    dtype: DType,
    seed: u64,
    name: String,
}

/// SplitMix64: a fast, well-mixed stream from a seed.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl SyntheticSource {
    /// Weights of `dtype` (Q8_0, Q4_0, Q4_1 or Q4_K) for `cfg`, from `seed`.
    pub fn new(cfg: ModelConfig, dtype: DType, seed: u64) -> Result<Self> {
        if !matches!(dtype, DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q4_K) {
            return Err(ModelError::Batch(format!(
                "synthetic weights are Q8_0, Q4_0, Q4_1 or Q4_K, not {dtype:?}"
            )));
        }
        Ok(Self {
            name: format!("synthetic {dtype:?} weights (seed {seed})"),
            cfg,
            dtype,
            seed,
        })
    }

    /// The bytes of `blocks` random blocks: scale |d| ≈ 1/(16·√k) (so a row's dot product
    /// stays near 1 whatever k is; Q4_K's, under its sub-block scales, 32 times less), quants
    /// uniform. Every format's values are centred on zero: Q4_1's offset is −8·d, Q4_K's
    /// sub-blocks take scale s and offset 7.5·s (the first four s = 8, offset 60; the last
    /// four, whose offsets are 4 bits, s = 2, offset 15), so no row carries a common bias
    /// (which would route every token of a mixture of experts to the same experts).
    fn blocks(&self, which: u64, blocks: usize, k: usize) -> Vec<u8> {
        let mut r = Mix(self.seed ^ which.wrapping_mul(0xd6e8_feb8_6659_fd93));
        let sub = if self.dtype == DType::Q4_K { 32.0 } else { 1.0 };
        let d = half::f16::from_f32(1.0 / (16.0 * sub * (k as f32).sqrt())).to_le_bytes();
        let bb = self.dtype.block_bytes();
        let mut out = vec![0u8; blocks * bb];
        for b in out.chunks_exact_mut(bb) {
            let head = match self.dtype {
                // d and dmin (its offsets' scale), then the sub-block scales and the quants.
                DType::Q4_K => {
                    b[..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&d);
                    // ggml's 12 packed bytes: scales then offsets (6 bits) of sub-blocks 0-3,
                    // then the low (scale) and high (offset) nibbles of sub-blocks 4-7.
                    b[4..16].copy_from_slice(&Q4_K_CENTRED_SCALES);
                    16
                }
                DType::Q4_1 => {
                    b[..2].copy_from_slice(&d);
                    let m = half::f16::from_f32(-8.0 * f32::from(half::f16::from_le_bytes(d)));
                    b[2..4].copy_from_slice(&m.to_le_bytes());
                    4
                }
                _ => {
                    b[..2].copy_from_slice(&d);
                    2
                }
            };
            for q in b[head..].chunks_mut(8) {
                let v = r.next().to_le_bytes();
                q.copy_from_slice(&v[..q.len()]);
            }
        }
        out
    }
}

/// Q4_K sub-block scales whose offsets are 7.5 times the scales ([`SyntheticSource::blocks`]).
const Q4_K_CENTRED_SCALES: [u8; 12] = [8, 8, 8, 8, 60, 60, 60, 60, 0xf2, 0xf2, 0xf2, 0xf2];

/// A number per weight role and layer, so each weight gets its own stream.
fn stream(w: Weight) -> u64 {
    use Weight::*;
    let (kind, layer) = match w {
        Embed => (0, 0),
        FinalNorm => (1, 0),
        LmHead => (2, 0),
        AttnNorm(l) => (3, l),
        Q(l) => (4, l),
        K(l) => (5, l),
        V(l) => (6, l),
        QBias(l) => (7, l),
        KBias(l) => (8, l),
        VBias(l) => (9, l),
        O(l) => (10, l),
        FfnNorm(l) => (11, l),
        Gate(l) => (12, l),
        Up(l) => (13, l),
        Down(l) => (14, l),
        QNorm(l) => (15, l),
        KNorm(l) => (16, l),
        PostAttnNorm(l) => (17, l),
        PreFfnNorm(l) => (18, l),
        PostFfnNorm(l) => (19, l),
        Router(l) => (20, l),
        OBias(l) => (21, l),
        Sinks(l) => (22, l),
        RouterBias(l) => (23, l),
        // Each expert's projections: streams of their own, above every other weight's.
        Expert(l, e, p) => return 1 << 48 | (l as u64) << 24 | (3 * e as u64 + p as u64),
    };
    (layer as u64) << 8 | kind
}

impl WeightSource for SyntheticSource {
    fn describe(&self) -> &str {
        &self.name
    }

    fn has(&self, w: Weight) -> bool {
        !matches!(w, Weight::LmHead) || !self.cfg.tie_embeddings
    }

    fn load(&self, device: &Device, w: Weight, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let k = shape.last().copied().unwrap_or(1);
        let vector = shape.len() == 1;
        if vector || !k.is_multiple_of(self.dtype.block_elems()) {
            // Norms (ones) and biases (zeros); the rare matrix whose rows are not whole
            // blocks stays F32.
            let fill = match w {
                Weight::QBias(_)
                | Weight::KBias(_)
                | Weight::VBias(_)
                | Weight::OBias(_)
                | Weight::Sinks(_)
                | Weight::RouterBias(_) => 0.0,
                _ if vector => 1.0,
                _ => 1.0 / (16.0 * (k as f32).sqrt()),
            };
            return Ok(Tensor::from_f32(device, shape, &vec![fill; n])?);
        }
        let bytes = self.blocks(stream(w), n / self.dtype.block_elems(), k);
        Tensor::from_bytes(device, self.dtype, shape, &bytes).map_err(|source| ModelError::Upload {
            file: self.name.clone(),
            tensor: format!("{w:?}"),
            source: Box::new(source),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn tiny() -> ModelConfig {
        let json = r#"{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 96,
            "vocab_size": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
            "tie_word_embeddings": true}"#;
        ModelConfig::from_hf_json("config.json", json).unwrap()
    }

    #[test]
    fn the_same_seed_gives_the_same_weights_and_a_model_that_runs() {
        let a = SyntheticSource::new(tiny(), DType::Q4_1, 7).unwrap();
        let b = SyntheticSource::new(tiny(), DType::Q4_1, 7).unwrap();
        let c = SyntheticSource::new(tiny(), DType::Q4_1, 8).unwrap();
        let load = |s: &SyntheticSource, w| {
            s.load(&Device::Reference, w, &[96, 64])
                .unwrap()
                .to_bytes()
                .unwrap()
        };
        assert_eq!(load(&a, Weight::Gate(1)), load(&b, Weight::Gate(1)));
        assert_ne!(load(&a, Weight::Gate(1)), load(&c, Weight::Gate(1)));
        assert_ne!(load(&a, Weight::Gate(1)), load(&a, Weight::Up(1)));
        let model = crate::Model::load(&Device::Reference, tiny(), &a).unwrap();
        let mut runner = crate::ModelRunner::new(
            model,
            crate::KvPoolConfig {
                block_size: 16,
                num_blocks: 4,
                dtype: kiln_kv::KvDtype::F16,
            },
        )
        .unwrap();
        let table = [kiln_kv::BlockId(0)];
        let out = runner
            .step(
                &[crate::StepSeq {
                    tokens: &[1, 2, 3],
                    block_table: &table,
                    kept_table: &[],
                    context_len: 3,
                    logits_rows: 1,
                    read_logits: true,
                    sample: None,
                }],
                &[],
            )
            .unwrap();
        assert!(out.logits(0, 0).unwrap().iter().all(|v| v.is_finite()));
        assert!(SyntheticSource::new(tiny(), DType::Q6_K, 1).is_err());
        // Q4_K's values are centred: the mean of a row is a small part of its spread.
        let k4 = SyntheticSource::new(tiny(), DType::Q4_K, 3).unwrap();
        let w = k4
            .load(&Device::Reference, Weight::Gate(0), &[8, 256])
            .unwrap();
        for row in w.to_f32_vec().unwrap().chunks(256) {
            let mean = row.iter().sum::<f32>() / 256.0;
            let rms = (row.iter().map(|v| v * v).sum::<f32>() / 256.0).sqrt();
            assert!(
                rms > 0.0 && mean.abs() < 0.25 * rms,
                "mean {mean}, rms {rms}"
            );
        }
    }
}
