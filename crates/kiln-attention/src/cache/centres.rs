//! The INT4 pool's key centres on a [`KvCache`]: setting them, and reading an F32 pool's keys
//! to measure them ([`key_centres`](crate::key_centres)).

use kiln_kv::KvDtype;
use kiln_tensor::{Device, Tensor};

use super::{HostPool, KvCache, Store, invalid};
use crate::Result;
use crate::stored::{CENTRED_PAIRS, CentreTurns, KeyCentre};

impl KvCache {
    /// Centre an INT4 pool's keys (`centres` is `[layers, kv_heads, CENTRED_PAIRS]`, as
    /// [`key_centres`](crate::key_centres) measures them per layer): from now on each key is
    /// stored less its head's centres rotated to its position, and attention adds them back
    /// ([`KeyCentre`]). Only before any key is written: a stored row is read back with the
    /// centres in force, so changing them would move the keys already stored.
    pub fn set_key_centres(&mut self, centres: &[KeyCentre]) -> Result<()> {
        let (kvh, hd) = (self.cfg.kv_heads, self.cfg.head_dim);
        if self.cfg.dtype != KvDtype::Int4 {
            return invalid(format!(
                "key centres apply to an int4 cache, not {}",
                self.cfg.dtype
            ));
        }
        if self.written {
            return invalid(
                "key centres are set before any key is written (stored keys would move)".into(),
            );
        }
        if centres.len() != self.centres.len() {
            return invalid(format!(
                "{} key centres for [{} layers, {kvh} kv heads, {CENTRED_PAIRS}]",
                centres.len(),
                self.cfg.layers
            ));
        }
        for (i, c) in centres.iter().enumerate() {
            let finite = c.freq.is_finite() && c.mean.iter().all(|m| m.is_finite());
            let fits = usize::from(c.lo.max(c.hi)) < hd && (c.lo != c.hi || c.mean == [0.0; 2]);
            if !finite || !fits {
                return invalid(format!(
                    "key centre {i}: {c:?} needs finite values and two channels below {hd}"
                ));
            }
        }
        if let Store::Gpu(layers) = &mut self.store {
            let per_layer = kvh * CENTRED_PAIRS;
            for (layer, c) in layers.iter_mut().zip(centres.chunks_exact(per_layer)) {
                layer.centres = Some(centre_tensor(&self.device, c)?);
            }
        }
        self.centres.copy_from_slice(centres);
        self.turns = CentreTurns::new(centres);
        Ok(())
    }

    /// The key centres in force (`[layers, kv_heads, CENTRED_PAIRS]`; zero unless set).
    pub fn key_centres(&self) -> &[KeyCentre] {
        &self.centres
    }

    /// The K rows of `layer` at `slots` (`[slots, kv_heads, head_dim]`) from an F32 pool,
    /// whose rows are the model's keys exactly (what [`key_centres`](crate::key_centres)
    /// measures).
    pub fn keys(&self, layer: usize, slots: &[u32]) -> Result<Vec<f32>> {
        self.check_layer(layer)?;
        if self.cfg.dtype != KvDtype::F32 {
            return invalid(format!(
                "keys are read from an f32 cache, not {}",
                self.cfg.dtype
            ));
        }
        if let Some(&bad) = slots.iter().find(|&&s| s as usize >= self.cfg.slots()) {
            return invalid(format!("slot {bad} of {}", self.cfg.slots()));
        }
        let row = self.cfg.kv_heads * self.cfg.head_dim;
        let pool = match &self.store {
            Store::Cpu(layers) => match &layers[layer][0] {
                HostPool::F32(p) => std::borrow::Cow::Borrowed(p),
                _ => return invalid("an f32 cache's host pool holds other values".into()),
            },
            Store::Gpu(layers) => std::borrow::Cow::Owned(layers[layer].k.to_f32_vec()?),
        };
        Ok(slots
            .iter()
            .flat_map(|&s| pool[s as usize * row..][..row].iter().copied())
            .collect())
    }
}

/// A layer's key centres as the kernels read them: per entry four words, `lo | hi << 16`
/// and the bits of freq, mean lo and mean hi.
pub(super) fn centre_tensor(device: &Device, centres: &[KeyCentre]) -> Result<Tensor> {
    let flat: Vec<u32> = centres
        .iter()
        .flat_map(|c| {
            let pair = u32::from(c.lo) | (u32::from(c.hi) << 16);
            [
                pair,
                c.freq.to_bits(),
                c.mean[0].to_bits(),
                c.mean[1].to_bits(),
            ]
        })
        .collect();
    Ok(Tensor::from_u32(device, &[flat.len()], &flat)?)
}
