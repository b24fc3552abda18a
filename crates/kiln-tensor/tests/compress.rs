//! DeepSeek-V4's compressor pooling and lightning-indexer top-k on every wgpu configuration
//! and the native CPU backend, against the CPU reference; the reference's pooling against a
//! direct f64 evaluation of its definition, and its window bookkeeping (a sequence pooled in
//! two calls, the previous window handed back as lead rows, equals one call); `concat_rows`,
//! which joins what a compressor carries to a step's rows.
//! (kiln-model's DeepSeek-V4 tests check the reference against transformers' modules.)

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{assert_close, gpus, randn, rng};
use kiln_tensor::{Device, MappedRows, NO_ENTRY, PoolWindows, Recorder, RowMap, Tensor};
use rand::Rng;

/// The reference, the native CPU backend and every wgpu configuration.
fn devices() -> Vec<(&'static str, Device)> {
    let mut v = vec![
        ("reference", Device::reference()),
        ("cpu", Device::cpu().expect("native CPU backend")),
    ];
    v.extend(gpus());
    v
}

fn pool(
    dev: &Device,
    rows: &[f32],
    gate: &[f32],
    ape: &[f32],
    cols: usize,
    ratio: usize,
    windows: PoolWindows,
) -> Vec<f32> {
    let n = rows.len() / cols;
    let kv = Tensor::from_f32(dev, &[n, cols], rows).unwrap();
    let g = Tensor::from_f32(dev, &[n, cols], gate).unwrap();
    let a = Tensor::from_f32(dev, &[ratio, cols], ape).unwrap();
    let mut rec = Recorder::new(dev);
    let out = rec.compress_pool(&kv, &g, &a, ratio, windows).unwrap();
    rec.submit().unwrap();
    out.to_f32_vec().unwrap()
}

/// Entry `w`, channel `c`, straight from the definition in f64.
fn pool_f64(
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    cols: usize,
    ratio: usize,
    windows: PoolWindows,
) -> Vec<f32> {
    let lead = match windows {
        PoolWindows::Overlapping { previous: true } => ratio,
        _ => 0,
    };
    let n = (kv.len() / cols - lead) / ratio;
    assert!(n > 0);
    let overlap = windows != PoolWindows::Disjoint;
    let width = if overlap { cols / 2 } else { cols };
    let mut out = Vec::new();
    for w in 0..n {
        for c in 0..width {
            // (value, logit) of every slot.
            let mut slots: Vec<(f64, f64)> = Vec::new();
            let own = lead + w * ratio;
            let at = |r: usize, col: usize, j: usize| {
                (
                    f64::from(kv[r * cols + col]),
                    f64::from(gate[r * cols + col]) + f64::from(ape[j * cols + col]),
                )
            };
            if overlap && own >= ratio {
                slots.extend((0..ratio).map(|j| at(own - ratio + j, c, j)));
            }
            let col = if overlap { width + c } else { c };
            slots.extend((0..ratio).map(|j| at(own + j, col, j)));
            let mx = slots.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = slots.iter().map(|s| (s.1 - mx).exp()).sum();
            let acc: f64 = slots.iter().map(|s| (s.1 - mx).exp() * s.0).sum();
            out.push((acc / sum) as f32);
        }
    }
    out
}

#[test]
fn compress_pool_matches_its_definition_on_every_device() {
    let mut r = rng(48);
    for (ratio, windows, cols, n) in [
        (8, PoolWindows::Disjoint, 32, 5),
        (128, PoolWindows::Disjoint, 72, 2),
        (4, PoolWindows::Overlapping { previous: false }, 64, 10),
        (4, PoolWindows::Overlapping { previous: true }, 34, 3),
        (3, PoolWindows::Overlapping { previous: true }, 2, 1),
    ] {
        let lead = if windows == (PoolWindows::Overlapping { previous: true }) {
            ratio
        } else {
            0
        };
        // A window not yet full at the end: not read.
        let rows = lead + n * ratio + ratio / 2;
        let kv = randn(&mut r, rows * cols, 2.0);
        // Gates wide enough that the softmax is far from uniform.
        let gate = randn(&mut r, rows * cols, 6.0);
        let ape = randn(&mut r, ratio * cols, 3.0);
        let want = pool_f64(&kv, &gate, &ape, cols, ratio, windows);
        for (name, dev) in devices() {
            let got = pool(&dev, &kv, &gate, &ape, cols, ratio, windows);
            assert_close(
                &format!("{name} compress_pool ratio {ratio} {windows:?}"),
                &got,
                &want,
                1e-5,
                1e-5,
            );
        }
    }
}

/// Pooling rows `0..a` and then, with the last window of the first call handed back as lead
/// rows, rows `a..`, gives the entries of one call over all rows: what a chunk boundary
/// needs.
#[test]
fn overlapping_pool_in_two_calls_equals_one() {
    let mut r = rng(7);
    let (ratio, cols, windows) = (4, 24, 9);
    let rows = ratio * windows;
    let kv = randn(&mut r, rows * cols, 1.0);
    let gate = randn(&mut r, rows * cols, 4.0);
    let ape = randn(&mut r, ratio * cols, 1.0);
    for (name, dev) in devices() {
        let whole = pool(
            &dev,
            &kv,
            &gate,
            &ape,
            cols,
            ratio,
            PoolWindows::Overlapping { previous: false },
        );
        let split = 4 * ratio;
        let mut parts = pool(
            &dev,
            &kv[..split * cols],
            &gate[..split * cols],
            &ape,
            cols,
            ratio,
            PoolWindows::Overlapping { previous: false },
        );
        let from = (split - ratio) * cols;
        parts.extend(pool(
            &dev,
            &kv[from..],
            &gate[from..],
            &ape,
            cols,
            ratio,
            PoolWindows::Overlapping { previous: true },
        ));
        // The same values through the same arithmetic: exact.
        assert_close(&format!("{name} split pool"), &parts, &whole, 0.0, 0.0);
    }
}

fn topk(
    dev: &Device,
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    shape: [usize; 3],
    visible: &[u32],
    k: usize,
) -> Vec<u32> {
    topk_paged(dev, q, w, keys, shape, visible, k, None)
}

/// [`topk`] with the keys in a pool of `block`-row blocks, shuffled among twice as many
/// (NaN where no key is), read through their table.
#[allow(clippy::too_many_arguments)]
fn topk_paged(
    dev: &Device,
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    shape: [usize; 3],
    visible: &[u32],
    k: usize,
    block: Option<usize>,
) -> Vec<u32> {
    let [tokens, heads, dim] = shape;
    let qt = Tensor::from_f32(dev, &[tokens, heads, dim], q).unwrap();
    let wt = Tensor::from_f32(dev, &[tokens, heads], w).unwrap();
    let count = keys.len() / dim;
    let (pool, table) = match block {
        None => (keys.to_vec(), Vec::new()),
        Some(b) => {
            let blocks = count.div_ceil(b);
            let mut slots: Vec<u32> = (0..2 * blocks as u32).collect();
            let mut r = rng(count as u64);
            for i in (1..slots.len()).rev() {
                slots.swap(i, r.random_range(0..=i));
            }
            let mut pool = vec![f32::NAN; 2 * blocks * b * dim];
            for i in 0..count {
                let to = (slots[i / b] as usize * b + i % b) * dim;
                pool[to..to + dim].copy_from_slice(&keys[i * dim..(i + 1) * dim]);
            }
            (pool, slots[..blocks].to_vec())
        }
    };
    let kt = Tensor::from_f32(dev, &[pool.len() / dim, dim], &pool).unwrap();
    let key_rows = MappedRows {
        rows: &kt,
        count: count as u32,
        map: match block {
            Some(b) => RowMap::Paged {
                table: &table,
                block: b as u32,
            },
            None => RowMap::Consecutive,
        },
    };
    let mut rec = Recorder::new(dev);
    let scale = 1.0 / ((dim * heads) as f32).sqrt();
    let out = rec
        .indexer_topk(&qt, &wt, key_rows, visible, k, scale)
        .unwrap();
    rec.submit().unwrap();
    out.to_u32_vec().unwrap()
}

/// The picks straight from the definition, in f64: the `k` best visible entries (ties to the
/// lower one), rising.
fn topk_f64(
    q: &[f32],
    w: &[f32],
    keys: &[f32],
    shape: [usize; 3],
    visible: &[u32],
    k: usize,
) -> Vec<u32> {
    let [_, heads, dim] = shape;
    let mut out = Vec::new();
    for (t, &n) in visible.iter().enumerate() {
        let mut scored: Vec<(u32, f64)> = (0..n)
            .map(|s| {
                let key = &keys[s as usize * dim..][..dim];
                let score: f64 = (0..heads)
                    .map(|h| {
                        let qh = &q[(t * heads + h) * dim..][..dim];
                        let d: f64 = qh
                            .iter()
                            .zip(key)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum();
                        f64::from(w[t * heads + h]) * d.max(0.0)
                    })
                    .sum();
                (s, score)
            })
            .collect();
        scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut picks: Vec<u32> = scored.iter().take(k).map(|p| p.0).collect();
        picks.sort_unstable();
        picks.resize(k, NO_ENTRY);
        out.extend(picks);
    }
    out
}

#[test]
fn indexer_topk_picks_the_best_visible_entries_on_every_device() {
    let mut r = rng(49);
    for (tokens, heads, dim, entries, k) in [
        (7, 16, 16, 10, 3),
        (3, 8, 128, 300, 64),
        (2, 4, 32, 1000, 512),
        (5, 2, 8, 3, 8),
        (6, 64, 128, 2000, 512),
    ] {
        let q = randn(&mut r, tokens * heads * dim, 1.0);
        let w = randn(&mut r, tokens * heads, 1.0);
        let keys = randn(&mut r, entries * dim, 1.0);
        // Every count from none to all, as the queries of one prefill see them.
        let visible: Vec<u32> = (0..tokens)
            .map(|t| (entries * t / (tokens - 1).max(1)) as u32)
            .collect();
        let shape = [tokens, heads, dim];
        let want = topk_f64(&q, &w, &keys, shape, &visible, k);
        for (name, dev) in devices() {
            let got = topk(&dev, &q, &w, &keys, shape, &visible, k);
            assert_eq!(
                got, want,
                "{name} indexer_topk {shape:?} over {entries}, k {k}"
            );
        }
    }
}

/// Keys read through a block table from a pool give the same picks as read consecutively,
/// on every device.
#[test]
fn indexer_topk_reads_its_keys_through_a_block_table() {
    let mut r = rng(51);
    let (tokens, heads, dim, entries, k) = (9, 8, 32, 300, 16);
    let q = randn(&mut r, tokens * heads * dim, 1.0);
    let w = randn(&mut r, tokens * heads, 1.0);
    let keys = randn(&mut r, entries * dim, 1.0);
    let visible: Vec<u32> = (0..tokens).map(|t| (t * 37) as u32).collect();
    let shape = [tokens, heads, dim];
    for (name, dev) in devices() {
        let want = topk(&dev, &q, &w, &keys, shape, &visible, k);
        for block in [1, 7, 32] {
            let got = topk_paged(&dev, &q, &w, &keys, shape, &visible, k, Some(block));
            assert_eq!(got, want, "{name}, blocks of {block}");
        }
    }
}

/// Scores of more queries than one binding holds (bindings capped at 16 KiB: 40 queries of
/// 200 entries are 32,000 bytes of scores) are made a group of queries at a time, with the
/// same picks.
#[test]
fn indexer_topk_scores_a_group_of_queries_at_a_time_past_one_binding() {
    let Some(dev) = common::gpu_split() else {
        return;
    };
    let mut r = rng(50);
    let (tokens, heads, dim, entries, k) = (40, 4, 16, 200, 7);
    let q = randn(&mut r, tokens * heads * dim, 1.0);
    let w = randn(&mut r, tokens * heads, 1.0);
    let keys = randn(&mut r, entries * dim, 1.0);
    let visible: Vec<u32> = (0..tokens).map(|t| (5 * t) as u32).collect();
    let shape = [tokens, heads, dim];
    let want = topk_f64(&q, &w, &keys, shape, &visible, k);
    assert_eq!(topk(&dev, &q, &w, &keys, shape, &visible, k), want);
}

/// Scores that tie (every ReLU off: each query points away from every key) go to the lowest
/// entries, on every device.
#[test]
fn indexer_topk_breaks_ties_towards_the_lower_entry() {
    let (tokens, heads, dim, entries, k) = (2, 3, 4, 70, 5);
    let q = vec![-1.0; tokens * heads * dim];
    let w: Vec<f32> = (0..tokens * heads).map(|i| i as f32 + 1.0).collect();
    let keys = vec![1.0; entries * dim];
    let visible = [70, 66];
    for (name, dev) in devices() {
        let got = topk(&dev, &q, &w, &keys, [tokens, heads, dim], &visible, k);
        assert_eq!(got, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4], "{name}");
    }
}

/// `concat_rows` moves values: exact on every device.
#[test]
fn concat_rows_puts_the_second_after_the_first() {
    let mut r = rng(50);
    for (ra, rb, cols) in [(1, 1, 1), (3, 70, 24), (65, 2, 3)] {
        let a = randn(&mut r, ra * cols, 1.0);
        let b = randn(&mut r, rb * cols, 1.0);
        let want: Vec<f32> = a.iter().chain(&b).copied().collect();
        for (name, dev) in devices() {
            let at = Tensor::from_f32(&dev, &[ra, cols], &a).unwrap();
            let bt = Tensor::from_f32(&dev, &[rb, cols], &b).unwrap();
            let mut rec = Recorder::new(&dev);
            let out = rec.concat_rows(&at, &bt).unwrap();
            rec.submit().unwrap();
            assert_eq!(out.shape(), [ra + rb, cols], "{name}");
            assert_close(
                &format!("{name} concat_rows"),
                &out.to_f32_vec().unwrap(),
                &want,
                0.0,
                0.0,
            );
        }
    }
}

#[test]
fn bad_shapes_are_refused_by_name() {
    let dev = Device::reference();
    let t = |shape: &[usize]| {
        let n = shape.iter().product();
        Tensor::from_f32(&dev, shape, &vec![0.0; n]).unwrap()
    };
    let mut rec = Recorder::new(&dev);
    // 3 rows hold no window of 4.
    let e = rec
        .compress_pool(
            &t(&[3, 8]),
            &t(&[3, 8]),
            &t(&[4, 8]),
            4,
            PoolWindows::Disjoint,
        )
        .unwrap_err();
    assert!(e.to_string().contains("no window of 4 in 3 rows"), "{e}");
    // An overlapping pool needs an even width.
    let e = rec
        .compress_pool(
            &t(&[8, 7]),
            &t(&[8, 7]),
            &t(&[4, 7]),
            4,
            PoolWindows::Overlapping { previous: false },
        )
        .unwrap_err();
    assert!(e.to_string().contains("compress_pool"), "{e}");
    // More entries visible than there are.
    let e = rec
        .indexer_topk(
            &t(&[1, 2, 4]),
            &t(&[1, 2]),
            MappedRows::consecutive(&t(&[3, 4])),
            &[4],
            2,
            1.0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("visible entries"), "{e}");
    // A key whose block the table lacks.
    let e = rec
        .indexer_topk(
            &t(&[1, 2, 4]),
            &t(&[1, 2]),
            MappedRows {
                rows: &t(&[8, 4]),
                count: 6,
                map: RowMap::Paged {
                    table: &[1, u32::MAX],
                    block: 4,
                },
            },
            &[6],
            2,
            1.0,
        )
        .unwrap_err();
    assert!(e.to_string().contains("key 4 of 6 has no row"), "{e}");
}

/// `write_rows` puts rows into a pool in place on every device; what the pool held elsewhere
/// stays; a write after reads in the same recorder lands before later reads; bad rows are
/// refused naming them.
#[test]
fn write_rows_puts_rows_into_a_pool_in_place() {
    for (name, dev) in devices() {
        let mut pool = Tensor::from_f32(&dev, &[6, 3], &[1.0; 18]).unwrap();
        let src = Tensor::from_f32(&dev, &[2, 3], &[10., 11., 12., 20., 21., 22.]).unwrap();
        let mut rec = Recorder::new(&dev);
        rec.write_rows(&mut pool, &[4, 1], &src).unwrap();
        // Read in the same step: the gather sees the write.
        let seen = rec.concat_rows(&pool, &src).unwrap();
        rec.submit().unwrap();
        let mut want = vec![1.0; 18];
        want[12..15].copy_from_slice(&[10., 11., 12.]);
        want[3..6].copy_from_slice(&[20., 21., 22.]);
        assert_eq!(seen.to_f32_vec().unwrap()[..18], want[..], "{name}");
        drop(seen);
        let mut rec = Recorder::new(&dev);
        for (bad, what) in [
            (vec![6, 0], "pool row"),
            (vec![2, 2], "row 2 written twice"),
        ] {
            let e = rec.write_rows(&mut pool, &bad, &src).unwrap_err();
            assert!(e.to_string().contains(what), "{name}: {e}");
        }
        let e = rec.write_rows(&mut pool, &[0], &src).unwrap_err();
        assert!(e.to_string().contains("write_rows"), "{name}: {e}");
        assert_eq!(
            pool.to_f32_vec().unwrap(),
            want,
            "{name}: a refused write changed it"
        );
    }
    // On the CPU backends a pool another tensor shares is refused: the write would show
    // through one handle and not the other.
    let dev = Device::reference();
    let mut pool = Tensor::from_f32(&dev, &[2, 1], &[0.0, 0.0]).unwrap();
    let shared = pool.clone();
    let one = Tensor::from_f32(&dev, &[1, 1], &[5.0]).unwrap();
    let e = Recorder::new(&dev)
        .write_rows(&mut pool, &[0], &one)
        .unwrap_err();
    assert!(e.to_string().contains("shared"), "{e}");
    drop(shared);
    Recorder::new(&dev)
        .write_rows(&mut pool, &[0], &one)
        .unwrap();
    assert_eq!(pool.to_f32_vec().unwrap(), [5.0, 0.0]);
}
