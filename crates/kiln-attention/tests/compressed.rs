//! DeepSeek-V4's attention core: over raw rows only it is sliding-window attention with sinks
//! over one K=V head (`contiguous_attention`); with compressed entries, every device matches
//! the CPU reference, for HCA's every-visible-entry rule and CSA's picks.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_attention::{CompressedKv, EntryChoice, compressed_attention, contiguous_attention};
use kiln_tensor::{Device, NO_ENTRY, Recorder, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn randn(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

struct Case {
    heads: usize,
    dim: usize,
    /// Raw rows from position `first`; the queries are the last `tokens` of them.
    first: u32,
    rows: usize,
    tokens: usize,
    window: u32,
    q: Vec<f32>,
    raw: Vec<f32>,
    entries: Vec<f32>,
    sinks: Vec<f32>,
}

impl Case {
    fn new(
        r: &mut StdRng,
        heads: usize,
        dim: usize,
        first: u32,
        rows: usize,
        tokens: usize,
    ) -> Self {
        Self {
            heads,
            dim,
            first,
            rows,
            tokens,
            window: 6,
            q: randn(r, tokens * heads * dim),
            raw: randn(r, rows * dim),
            entries: randn(r, 12 * dim),
            sinks: randn(r, heads),
        }
    }

    fn positions(&self) -> Vec<u32> {
        let end = self.first + self.rows as u32;
        (end - self.tokens as u32..end).collect()
    }

    fn run(&self, dev: &Device, entries: bool, choice: Choice) -> Vec<f32> {
        let t = |shape: &[usize], v: &[f32]| Tensor::from_f32(dev, shape, v).unwrap();
        let q = t(&[self.tokens, self.heads, self.dim], &self.q);
        let raw = t(&[self.rows, self.dim], &self.raw);
        let ent = t(&[12, self.dim], &self.entries);
        let sinks = t(&[self.heads], &self.sinks);
        let picks;
        let choice = match choice {
            Choice::Visible(ratio) => EntryChoice::Visible { ratio },
            Choice::Picked(ref p, k) => {
                picks = Tensor::from_u32(dev, &[self.tokens, k], p).unwrap();
                EntryChoice::Picked(&picks)
            }
        };
        let kv = CompressedKv {
            raw: &raw,
            first: self.first,
            window: self.window,
            entries: entries.then_some(&ent),
            choice,
        };
        let mut rec = Recorder::new(dev);
        let scale = 1.0 / (self.dim as f32).sqrt();
        let out = compressed_attention(&mut rec, &q, &self.positions(), kv, &sinks, scale).unwrap();
        rec.submit().unwrap();
        out.to_f32_vec().unwrap()
    }
}

#[derive(Clone)]
enum Choice {
    Visible(u32),
    Picked(Vec<u32>, usize),
}

fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= atol, "{what}: max |diff| {worst} > {atol}");
}

#[test]
fn raw_rows_alone_are_sliding_window_attention_with_sinks() {
    let mut r = StdRng::seed_from_u64(48);
    for (heads, dim, rows, tokens) in [(4, 32, 9, 9), (2, 512, 20, 3), (3, 100, 1, 1)] {
        let c = Case::new(&mut r, heads, dim, 0, rows, tokens);
        let q_pos: Vec<usize> = c.positions().iter().map(|&p| p as usize).collect();
        let want = contiguous_attention(
            &c.q,
            &q_pos,
            &c.raw,
            &c.raw,
            heads,
            1,
            dim,
            1.0 / (dim as f32).sqrt(),
            Some(c.window as usize),
            Some(&c.sinks),
        );
        for (name, dev) in kiln_testkit::devices() {
            let got = c.run(&dev, false, Choice::Visible(4));
            assert_close(
                &format!("{name} {heads}x{dim}, {rows} rows"),
                &got,
                &want,
                2e-5,
            );
        }
    }
}

#[test]
fn entries_every_visible_one_or_the_picks_match_the_reference_on_every_device() {
    let mut r = StdRng::seed_from_u64(49);
    // Raw rows from position 30 (a window's worth kept), queries at 40..48.
    let c = Case::new(&mut r, 4, 64, 30, 18, 8);
    let k = 3;
    let picks: Vec<u32> = (0..c.tokens)
        .flat_map(|t| match t % 3 {
            0 => vec![0, 5, 9],
            1 => vec![2, 11, NO_ENTRY],
            _ => vec![NO_ENTRY; 3],
        })
        .collect();
    for choice in [
        Choice::Visible(4),
        Choice::Visible(8),
        Choice::Picked(picks, k),
    ] {
        let want = c.run(&Device::reference(), true, choice.clone());
        for (name, dev) in kiln_testkit::devices() {
            let got = c.run(&dev, true, choice.clone());
            assert_close(&format!("{name} with entries"), &got, &want, 2e-5);
        }
    }
}

#[test]
fn a_query_outside_the_raw_rows_is_refused() {
    let dev = Device::reference();
    let t = |shape: &[usize]| {
        Tensor::from_f32(&dev, shape, &vec![0.0; shape.iter().product()]).unwrap()
    };
    let (q, raw, sinks) = (t(&[1, 2, 8]), t(&[4, 8]), t(&[2]));
    let kv = CompressedKv {
        raw: &raw,
        first: 10,
        window: 4,
        entries: None,
        choice: EntryChoice::Visible { ratio: 4 },
    };
    let mut rec = Recorder::new(&dev);
    let e = compressed_attention(&mut rec, &q, &[14], kv, &sinks, 1.0).unwrap_err();
    assert!(
        e.to_string()
            .contains("outside the raw rows of positions 10..14"),
        "{e}"
    );
}
