//! The native backend's gated activations, `act(gate) · up`, in plain f32 operations that the
//! compiler turns into SIMD: both are `g · σ(t)` (SiLU: t = g; GELU with the tanh
//! approximation: t = 2·√(2/π)·(g + 0.044715·g³), since ½(1 + tanh z) = σ(2z)), with an `exp`
//! from Cephes' range reduction and polynomial instead of libm's scalar `expf`/`tanhf`. Each
//! element is the same sequence of operations at any vector width, so the results do not
//! depend on the ISA or the batch. Tested against the reference's formulas (`ops::glu_row`).

use crate::ops::Activation;

/// e^x, within a few ulp of `f32::exp` on [−87, 88.38]; above it +∞ (as `f32::exp` past
/// 88.72), below it e^−87.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts: n·LN2_HI is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and taking away 1.5·2^23 rounds to the nearest integer (|v| < 2^22).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 89.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 0.166_666_65)
        * r
        + 0.5;
    let e = p * (r * r) + r + 1.0;
    // 2^n from its exponent bits (n in [−126, 128]; 2^128's bits are +∞).
    e * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

/// `g · σ(t)`.
#[inline(always)]
fn gated(g: f32, t: f32) -> f32 {
    g / (1.0 + exp(-t))
}

/// `out[i] = act(row[i]) · row[i + out.len()]`: a `[gate; up]` row, half of it out.
pub(crate) fn glu(row: &[f32], act: Activation, out: &mut [f32]) {
    let (g, u) = row.split_at(out.len());
    match act {
        Activation::Silu => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = gated(g, g) * u;
            }
        }
        Activation::GeluTanh => {
            // 2·√(2/π).
            const C: f32 = 1.595_769;
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                *o = gated(g, C * g * (1.0 + 0.044_715 * g * g)) * u;
            }
        }
        Activation::SwigluOai => {
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                let g = g.min(7.0);
                *o = gated(g, 1.702 * g) * (u.clamp(-7.0, 7.0) + 1.0);
            }
        }
        Activation::SiluClamped { limit } => {
            let l = limit.get();
            for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
                let g = g.min(l);
                *o = gated(g, g) * u.clamp(-l, l);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::glu_row;

    /// Within a few f32 ulp of the reference's formulas (libm's `expf`/`tanhf`), from deep
    /// in the negative tail to past where σ saturates, and zero, NaN-free at the extremes. In
    /// the negative tail the reference's `1 + tanh(z)` cancels to within an ulp of 1 (to 0
    /// once tanh rounds to −1), so the bound has that term too: ulp(1)·|g·u|.
    #[test]
    fn activations_match_the_reference_formulas() {
        let mut gates: Vec<f32> = (-4000..=4000).map(|i| i as f32 / 100.0).collect();
        gates.extend([-1e30, -200.0, -88.5, 88.5, 200.0, 1e30, 1e-30, -1e-30, 0.0]);
        let n = gates.len();
        let row: Vec<f32> = gates
            .iter()
            .copied()
            .chain((0..n).map(|i| 0.5 + (i % 7) as f32 * 0.25))
            .collect();
        let clamped = Activation::SiluClamped {
            limit: crate::ops::ClampLimit::new(10.0).expect("a positive bound"),
        };
        for act in [
            Activation::Silu,
            Activation::GeluTanh,
            Activation::SwigluOai,
            clamped,
        ] {
            let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
            glu(&row, act, &mut got);
            glu_row(&row, act, &mut want);
            for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
                let (g, u) = (gates[i], row[n + i]);
                let bound = 4e-6 * b.abs() + f32::EPSILON * (g * u).abs();
                assert!(
                    a.is_finite() && (a - b).abs() <= bound,
                    "{act:?} at gate {}: {a} vs reference {b}",
                    gates[i]
                );
            }
        }
    }
}
