//! DeepSeek-V4's attention core: over raw rows only it is sliding-window attention with sinks
//! over one K=V head (`contiguous_attention`); with compressed entries, every device matches
//! the CPU reference, for HCA's every-visible-entry rule and CSA's picks; and rows and
//! entries read through block tables from pools (the paged cache) give the same bits as read
//! consecutively.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kiln_attention::{CompressedKv, EntryChoice, compressed_attention, contiguous_attention};
use kiln_tensor::{Device, MappedRows, NO_ENTRY, Recorder, RowMap, Tensor};
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
        self.run_paged(dev, entries, choice, None)
    }

    /// With `paged` (`(raw block, entry block, seed)`), the raw rows and the entries are laid
    /// out in pools of shuffled blocks (NaN wherever nothing of this sequence is) and read
    /// through their tables.
    fn run_paged(
        &self,
        dev: &Device,
        entries: bool,
        choice: Choice,
        paged: Option<(u32, u32, u64)>,
    ) -> Vec<f32> {
        let t = |shape: &[usize], v: &[f32]| Tensor::from_f32(dev, shape, v).unwrap();
        let q = t(&[self.tokens, self.heads, self.dim], &self.q);
        let (raw_rows, raw_table, ent_rows, ent_table) = match paged {
            None => (self.raw.clone(), None, self.entries.clone(), None),
            Some((rb, eb, seed)) => {
                let mut r = StdRng::seed_from_u64(seed);
                let (raw, rt) = page(&mut r, &self.raw, self.dim, self.first, rb);
                let (ent, et) = page(&mut r, &self.entries, self.dim, 0, eb);
                (raw, Some((rt, rb)), ent, Some((et, eb)))
            }
        };
        let raw = t(&[raw_rows.len() / self.dim, self.dim], &raw_rows);
        let ent = t(&[ent_rows.len() / self.dim, self.dim], &ent_rows);
        fn map(p: &Option<(Vec<u32>, u32)>) -> RowMap<'_> {
            match p {
                Some((table, block)) => RowMap::Paged {
                    table,
                    block: *block,
                },
                None => RowMap::Consecutive,
            }
        }
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
            raw_map: map(&raw_table),
            first: self.first,
            window: self.window,
            entries: entries.then_some(MappedRows {
                rows: &ent,
                count: 12,
                map: map(&ent_table),
            }),
            choice,
        };
        let mut rec = Recorder::new(dev);
        let scale = 1.0 / (self.dim as f32).sqrt();
        let out = compressed_attention(&mut rec, &q, &self.positions(), kv, &sinks, scale).unwrap();
        rec.submit().unwrap();
        out.to_f32_vec().unwrap()
    }
}

/// `rows` (items `first ..` of `dim` values) in a pool of `block`-row blocks: the logical
/// blocks shuffled among twice as many, NaN wherever no item is; the pool and the table
/// (`u32::MAX` for a block wholly before `first`).
fn page(r: &mut StdRng, rows: &[f32], dim: usize, first: u32, block: u32) -> (Vec<f32>, Vec<u32>) {
    let end = first as usize + rows.len() / dim;
    let (b, logical) = (block as usize, end.div_ceil(block as usize));
    let mut slots: Vec<u32> = (0..2 * logical as u32).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, r.random_range(0..=i));
    }
    let mut pool = vec![f32::NAN; 2 * logical * b * dim];
    let table: Vec<u32> = (0..logical)
        .map(|l| {
            if (l + 1) * b <= first as usize {
                return u32::MAX;
            }
            for i in (l * b).max(first as usize)..((l + 1) * b).min(end) {
                let to = (slots[l] as usize * b + i % b) * dim;
                let from = (i - first as usize) * dim;
                pool[to..to + dim].copy_from_slice(&rows[from..from + dim]);
            }
            slots[l]
        })
        .collect();
    (pool, table)
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
fn rows_and_entries_read_through_block_tables_give_the_same_bits() {
    let mut r = StdRng::seed_from_u64(50);
    // Raw rows from position 30 (blocks wholly before it trimmed), queries at 40..48.
    let c = Case::new(&mut r, 4, 64, 30, 18, 8);
    let picks: Vec<u32> = (0..c.tokens)
        .flat_map(|t| {
            [
                (t as u32 * 5) % 12,
                11,
                if t % 2 == 0 { NO_ENTRY } else { 3 },
            ]
        })
        .collect();
    for choice in [Choice::Visible(4), Choice::Picked(picks, 3)] {
        for (name, dev) in kiln_testkit::devices() {
            let want = c.run(&dev, true, choice.clone());
            for (rb, eb) in [(4, 4), (16, 1), (3, 5), (128, 32)] {
                let got = c.run_paged(&dev, true, choice.clone(), Some((rb, eb, 7)));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{name}, blocks of {rb} and {eb}");
            }
        }
    }
}

#[test]
fn a_row_missing_from_a_block_table_is_refused() {
    let mut r = StdRng::seed_from_u64(51);
    let c = Case::new(&mut r, 2, 8, 30, 18, 2);
    let dev = Device::reference();
    let t = |shape: &[usize], v: &[f32]| Tensor::from_f32(&dev, shape, v).unwrap();
    let (q, sinks) = (t(&[2, 2, 8], &c.q), t(&[2], &c.sinks));
    let (pool, mut table) = page(&mut r, &c.raw, 8, 30, 4);
    let raw = t(&[pool.len() / 8, 8], &pool);
    // Position 44's block (11) given back as if trimmed.
    table[11] = u32::MAX;
    let kv = CompressedKv {
        raw: &raw,
        raw_map: RowMap::Paged {
            table: &table,
            block: 4,
        },
        first: 30,
        window: 6,
        entries: None,
        choice: EntryChoice::Visible { ratio: 4 },
    };
    let mut rec = Recorder::new(&dev);
    let e = compressed_attention(&mut rec, &q, &c.positions(), kv, &sinks, 1.0).unwrap_err();
    assert!(e.to_string().contains("position 44 has no raw row"), "{e}");
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
        raw_map: RowMap::Consecutive,
        first: 10,
        window: 4,
        entries: None,
        choice: EntryChoice::Visible { ratio: 4 },
    };
    let mut rec = Recorder::new(&dev);
    let e = compressed_attention(&mut rec, &q, &[14], kv, &sinks, 1.0).unwrap_err();
    assert!(e.to_string().contains("position 14 has no raw row"), "{e}");
    let e = compressed_attention(&mut rec, &q, &[9], kv, &sinks, 1.0).unwrap_err();
    assert!(e.to_string().contains("a query at 9, before"), "{e}");
}
