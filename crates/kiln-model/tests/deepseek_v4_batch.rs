//! DeepSeek-V4 served as a batch, its state in one paged [`V4Cache`] whose blocks `kiln-kv`'s
//! block manager hands out (a main pool for the window's and the compressors' rows, a kept
//! pool for the entries and indexer keys), gives what each sequence gives alone, on every
//! backend: prompts prefilled 7 tokens a step (chunk boundaries inside CSA's windows of 4 and
//! HCA's of 128) beside other sequences' prefills and decodes, then decoded together; a
//! prompt whose first block the prefix cache holds (its entries kept, its window's rows
//! still in the main pool) after its first owner has gone; a step that fails gives its
//! blocks back. The tiny checkpoint is the one `deepseek_v4_model` checks against
//! transformers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_kv::{BlockManager, BlockManagerConfig, KeptPool, SeqConfig, SeqId};
use kiln_model::LogitsAt;
use kiln_model::SafetensorsFile;
use kiln_model::v4::{
    V4Cache, V4CacheConfig, V4Input, V4Model, V4Sequence, block_size, main_window,
};
use kiln_tensor::{Device, Recorder};

const CHUNK: usize = 7;
const NEW: usize = 6;
const MAIN_BLOCKS: u32 = 12;
const KEPT_BLOCKS: u32 = 12;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

/// The golden's 173 token ids.
fn tokens() -> Vec<u32> {
    SafetensorsFile::open(&fixtures().join("model_golden.safetensors"))
        .unwrap()
        .read_f32("input_ids")
        .unwrap()
        .iter()
        .map(|&v| v as u32)
        .collect()
}

/// The last-row logits of each step of `prompt` run alone: the prompt in one step, then
/// each greedy token.
fn alone(model: &V4Model, dev: &Device, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut seq = V4Sequence::new(model, prompt.len() + NEW, prompt.len()).unwrap();
    let (mut next, mut rows) = (prompt.to_vec(), Vec::new());
    for _ in 0..NEW {
        let mut rec = Recorder::new(dev);
        let logits = model.forward(&mut rec, &next, &mut seq).unwrap();
        rec.submit().unwrap();
        let all = logits.to_f32_vec().unwrap();
        let row = all[all.len() - logits.cols()..].to_vec();
        next = vec![argmax(&row)];
        rows.push(row);
    }
    rows
}

fn argmax(r: &[f32]) -> u32 {
    (0..r.len()).fold(0, |m, i| if r[i] > r[m] { i } else { m }) as u32
}

/// A shared pool and the block manager that hands out its blocks.
struct Server {
    kv: BlockManager,
    cache: V4Cache,
}

struct Running {
    id: SeqId,
    tokens: Vec<u32>,
    /// Logits rows once its prompt is computed, one a step.
    rows: Vec<Vec<f32>>,
}

impl Server {
    fn new(model: &V4Model, dev: &Device) -> Self {
        let c = model.config();
        let kv = BlockManager::new(BlockManagerConfig {
            block_size: block_size(c) as u32,
            watermark: 0.0,
            kept: Some(KeptPool {
                num_blocks: KEPT_BLOCKS,
                window: main_window(c),
            }),
            ..BlockManagerConfig::new(MAIN_BLOCKS)
        })
        .unwrap();
        let cfg = V4CacheConfig {
            main_blocks: MAIN_BLOCKS as usize,
            kept_blocks: KEPT_BLOCKS as usize,
        };
        let cache = V4Cache::new(dev, c, cfg).unwrap();
        Self { kv, cache }
    }

    /// Admits `prompt` as `id`; returns it and the tokens the prefix cache supplied.
    fn admit(&mut self, id: u64, prompt: &[u32]) -> (Running, usize) {
        let id = SeqId(id);
        let a = self.kv.allocate(id, prompt, SeqConfig::default()).unwrap();
        let r = Running {
            id,
            tokens: prompt.to_vec(),
            rows: Vec::new(),
        };
        (r, a.cached_tokens)
    }

    /// Steps every sequence of `seqs` (a chunk of its prompt, or its last token) until each
    /// has `NEW` logits rows.
    fn run(&mut self, model: &V4Model, dev: &Device, seqs: &mut [Running]) {
        while seqs.iter().any(|s| s.rows.len() < NEW) {
            let mut chunks = Vec::new();
            for s in seqs.iter().filter(|s| s.rows.len() < NEW) {
                let start = self.kv.computed_len(s.id).unwrap();
                let n = (s.tokens.len() - start).min(CHUNK);
                self.kv.reserve(s.id, n).unwrap();
                chunks.push((s.id, start, n));
            }
            let inputs: Vec<V4Input<'_>> = chunks
                .iter()
                .map(|&(id, start, n)| V4Input {
                    tokens: &seqs.iter().find(|s| s.id == id).unwrap().tokens[start..start + n],
                    start,
                    main: self.kv.block_table(id).unwrap(),
                    kept: self.kv.kept_table(id).unwrap(),
                })
                .collect();
            let mut rec = Recorder::new(dev);
            let logits = model
                .step(&mut rec, &mut self.cache, &inputs, LogitsAt::Last)
                .unwrap();
            rec.submit().unwrap();
            let (all, vocab) = (logits.to_f32_vec().unwrap(), logits.cols());
            for (i, &(id, start, n)) in chunks.iter().enumerate() {
                let s = seqs.iter_mut().find(|s| s.id == id).unwrap();
                self.kv.commit(id, &s.tokens[start..start + n]).unwrap();
                if start + n < s.tokens.len() {
                    continue;
                }
                let row = all[i * vocab..(i + 1) * vocab].to_vec();
                s.tokens.push(argmax(&row));
                s.rows.push(row);
                if s.rows.len() < NEW {
                    self.kv.append_slots(id, 1).unwrap();
                }
            }
        }
    }
}

fn assert_rows(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: steps");
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        let worst = g
            .iter()
            .zip(w)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-4, "{what}, step {step}: max |diff| {worst}");
        assert_eq!(argmax(g), argmax(w), "{what}, step {step}: greedy token");
    }
}

#[test]
fn a_batch_in_one_paged_pool_gives_what_each_sequence_gives_alone() {
    let ids = tokens();
    let prompts: Vec<Vec<u32>> = vec![
        ids[..5].to_vec(),
        ids[..37].to_vec(),
        ids[20..160].to_vec(),
        ids.clone(),
    ];
    // Shares its first block (128 tokens) with the last prompt, and then differs.
    let mut shared = ids[..131].to_vec();
    shared.extend(ids[40..52].iter().rev());
    for (name, dev) in kiln_testkit::devices() {
        let model = V4Model::load(&fixtures().join("tiny"), &dev, 256).unwrap();
        let mut server = Server::new(&model, &dev);
        let mut seqs: Vec<Running> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| server.admit(i as u64, p).0)
            .collect();
        server.run(&model, &dev, &mut seqs);
        for (p, s) in prompts.iter().zip(&seqs) {
            let what = format!("{name}: a {}-token prompt in a batch", p.len());
            assert_rows(&what, &s.rows, &alone(&model, &dev, p));
        }
        for s in &seqs {
            server.kv.free(s.id).unwrap();
        }
        // The last prompt's first block is cached in both pools; a new prompt reuses it.
        let (mut s, cached) = server.admit(9, &shared);
        assert_eq!(cached, 128, "{name}: tokens from the prefix cache");
        server.run(&model, &dev, std::slice::from_mut(&mut s));
        let what = format!("{name}: a prompt after a prefix hit");
        assert_rows(&what, &s.rows, &alone(&model, &dev, &shared));
        server.kv.free(s.id).unwrap();
        server.kv.check_invariants().unwrap();
    }
}

#[test]
fn a_failed_step_leaves_the_sequence_as_it_was() {
    let ids = tokens();
    let dev = Device::Reference;
    let model = V4Model::load(&fixtures().join("tiny"), &dev, 256).unwrap();
    let mut seq = V4Sequence::new(&model, 64, 16).unwrap();
    let mut rec = Recorder::new(&dev);
    model.forward(&mut rec, &ids[..10], &mut seq).unwrap();
    // A token outside the vocabulary fails the step and takes nothing.
    let err = model
        .forward(&mut Recorder::new(&dev), &[3, 999], &mut seq)
        .unwrap_err();
    assert!(err.to_string().contains("999"), "{err}");
    assert_eq!(seq.len(), 10);
    // More tokens than the sequence was made for (a kept block of 128) fail before they run.
    let err = model
        .forward(&mut Recorder::new(&dev), &ids[10..], &mut seq)
        .unwrap_err();
    assert_eq!(seq.len(), 10, "{err}");
    // And the sequence goes on as if neither had been tried.
    let mut rec = Recorder::new(&dev);
    let got = model.forward(&mut rec, &ids[10..14], &mut seq).unwrap();
    rec.submit().unwrap();
    let mut again = V4Sequence::new(&model, 64, 16).unwrap();
    let mut rec = Recorder::new(&dev);
    let want = model.forward(&mut rec, &ids[..14], &mut again).unwrap();
    rec.submit().unwrap();
    let (got, want) = (got.to_f32_vec().unwrap(), want.to_f32_vec().unwrap());
    assert_rows(
        "after two failed steps",
        std::slice::from_ref(&got),
        &[want[want.len() - got.len()..].to_vec()],
    );
}
