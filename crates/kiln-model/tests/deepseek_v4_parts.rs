//! DeepSeek-V4's parts against transformers' own modules, on every backend: the compressors
//! and lightning indexer (`DeepseekV4HCACompressor`, `DeepseekV4CSACompressor` with its
//! `DeepseekV4Indexer`, run through their caches in chunks as `generate()` runs them: 41
//! tokens in chunks of 5, 3, 1, 1, 9, 2, 12, 8, so chunk boundaries fall inside windows, a
//! chunk closes none or several, and single tokens decode) and the hyper-connections
//! (`DeepseekV4HyperConnection`, `DeepseekV4HyperHead`), and each attention layer
//! (`DeepseekV4Attention`: sliding, CSA, HCA) and MoE layer (`DeepseekV4SparseMoeBlock`:
//! hash-routed, scored) of a tiny random model fed what it was fed inside the model. Goldens
//! by
//! `scripts/make_deepseek_v4_module_fixtures.py` (transformers 5.25, float32).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kiln_model::v4::{
    Compressor, CompressorPools, CompressorWeights, HyperConnection, HyperHead, Indexer,
    IndexerWeights, PagedSeq, V4Cache, V4CacheConfig, V4Model, block_size,
};
use kiln_model::{DeepseekV4Config, SafetensorsFile, V4Attention};
use kiln_tensor::{DType, Device, NO_ENTRY, Recorder, RopeTable, Tensor};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/deepseek_v4")
}

struct Golden {
    config: DeepseekV4Config,
    chunks: Vec<usize>,
    st: SafetensorsFile,
}

fn golden() -> Golden {
    let p = fixtures().join("compressor_config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let config = DeepseekV4Config::from_hf_json(&p.display().to_string(), &text).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let chunks = json["chunks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_u64().unwrap() as usize)
        .collect();
    let st = SafetensorsFile::open(&fixtures().join("compressor.safetensors")).unwrap();
    Golden { config, chunks, st }
}

impl Golden {
    fn shape(&self, name: &str) -> Vec<usize> {
        self.st.info(name).unwrap().1.to_vec()
    }

    fn f32(&self, name: &str) -> Vec<f32> {
        self.st.read_f32(name).unwrap()
    }

    fn tensor(&self, dev: &Device, name: &str) -> Tensor {
        Tensor::from_f32(dev, &self.shape(name), &self.f32(name)).unwrap()
    }

    fn compressor(
        &self,
        dev: &Device,
        prefix: &str,
        ratio: usize,
        overlapping: bool,
    ) -> Compressor {
        let t = |n: &str| self.tensor(dev, &format!("{prefix}{n}"));
        let w = CompressorWeights {
            kv: t("kv_proj.weight"),
            gate: t("gate_proj.weight"),
            ape: t("position_bias"),
            norm: t("kv_norm.weight"),
        };
        Compressor::new(
            "compressor.safetensors",
            prefix,
            w,
            ratio,
            overlapping,
            self.config.rms_eps,
        )
        .unwrap()
    }
}

/// What one run over the tokens made: every HCA and CSA entry, and each token's picks.
struct Run {
    hca: Vec<f32>,
    csa: Vec<f32>,
    picks: Vec<u32>,
}

/// The compressors' paged state: blocks of 8 tokens (HCA's ratio, twice CSA's), laid out
/// out of order in both pools, as a shared pool hands them out.
const BLOCK: usize = 8;
const MAIN: [u32; 6] = [5, 3, 0, 4, 1, 2];
const KEPT: [u32; 6] = [2, 5, 1, 0, 4, 3];

/// Zeroed pools for compressor `c` (`halves`: 2 for overlapping windows).
fn pools(dev: &Device, c: &Compressor, halves: usize) -> CompressorPools {
    let zeros = |r, w| Tensor::zeros(dev, DType::F32, &[r, w]).unwrap();
    let (slots, w) = (MAIN.len() * BLOCK, c.width());
    CompressorPools {
        kv: zeros(slots, halves * w),
        gate: zeros(slots, halves * w),
        entries: zeros(KEPT.len() * BLOCK / c.ratio(), w),
    }
}

/// The first `count` entries in `p` of a compressor pooling every `ratio` tokens, in order.
fn entries(p: &CompressorPools, ratio: usize, count: usize) -> Vec<f32> {
    let (all, w, per) = (
        p.entries.to_f32_vec().unwrap(),
        p.entries.cols(),
        BLOCK / ratio,
    );
    (0..count)
        .flat_map(|e| {
            let slot = KEPT[e / per] as usize * per + e % per;
            all[slot * w..(slot + 1) * w].to_vec()
        })
        .collect()
}

fn run(g: &Golden, dev: &Device, chunks: &[usize]) -> Run {
    let c = &g.config;
    let hca = g.compressor(dev, "hca.", 8, false);
    let csa = g.compressor(dev, "csa.", 4, true);
    let indexer = Indexer::new(
        "compressor.safetensors",
        "csa.indexer.",
        g.compressor(dev, "csa.indexer.", 4, true),
        IndexerWeights {
            q: g.tensor(dev, "csa.indexer.q_b_proj.weight"),
            head_weights: g.tensor(dev, "csa.indexer.scorer.weights_proj.weight"),
        },
        c.indexer.heads,
        c.indexer.topk,
    )
    .unwrap();
    let rope = RopeTable::new(dev, c.compressed_rope(c.head_dim), 64).unwrap();
    let index_rope = RopeTable::new(dev, c.compressed_rope(c.indexer.head_dim), 64).unwrap();
    let (x, qr) = (g.f32("x"), g.f32("qr"));
    let (hidden, q_lora) = (c.hidden, c.q_lora_rank);
    let (mut hp, mut cp, mut ip) = (
        pools(dev, &hca, 1),
        pools(dev, &csa, 2),
        pools(dev, &g.compressor(dev, "csa.indexer.", 4, true), 2),
    );
    let mut out = Run {
        hca: Vec::new(),
        csa: Vec::new(),
        picks: Vec::new(),
    };
    let mut start = 0;
    for &n in chunks {
        let xt = Tensor::from_f32(dev, &[n, hidden], &x[start * hidden..][..n * hidden]).unwrap();
        let qt = Tensor::from_f32(dev, &[n, q_lora], &qr[start * q_lora..][..n * q_lora]).unwrap();
        let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
        let seq = [PagedSeq {
            row: 0,
            start,
            len: n,
            main: &MAIN,
            kept: &KEPT,
            block: BLOCK,
        }];
        let mut rec = Recorder::new(dev);
        hca.step(&mut rec, &xt, &seq, &mut hp, &rope).unwrap();
        csa.step(&mut rec, &xt, &seq, &mut cp, &rope).unwrap();
        let p = indexer
            .step(
                &mut rec,
                &xt,
                &qt,
                &index_rope.positions(&positions).unwrap(),
                &seq,
                &mut ip,
                &index_rope,
            )
            .unwrap();
        rec.submit().unwrap();
        out.picks.extend(p[0].to_u32_vec().unwrap());
        start += n;
    }
    out.hca = entries(&hp, 8, start / 8);
    out.csa = entries(&cp, 4, start / 4);
    out
}

fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(worst <= atol, "{what}: max |diff| {worst} > {atol}");
}

/// transformers' picks, as kiln lists them: rising, [`NO_ENTRY`] for its `-1`.
fn golden_picks(g: &Golden) -> Vec<u32> {
    let k = g.config.indexer.topk;
    g.f32("csa.topk")
        .chunks_exact(k)
        .flat_map(|row| {
            let mut r: Vec<u32> = row
                .iter()
                .map(|&i| if i < 0.0 { NO_ENTRY } else { i as u32 })
                .collect();
            r.sort_unstable();
            r
        })
        .collect()
}

#[test]
fn compressors_and_indexer_match_transformers_on_every_backend() {
    let g = golden();
    let (hca, csa) = (g.f32("hca.entries"), g.f32("csa.entries"));
    let picks = golden_picks(&g);
    for (name, dev) in kiln_testkit::devices() {
        let got = run(&g, &dev, &g.chunks);
        assert_close(&format!("{name} HCA entries"), &got.hca, &hca, 1e-4);
        assert_close(&format!("{name} CSA entries"), &got.csa, &csa, 1e-4);
        assert_eq!(got.picks, picks, "{name} indexer picks");
    }
}

/// One prefill of all 41 tokens makes the entries and picks of the chunked run.
#[test]
fn one_prefill_equals_the_chunked_run() {
    let g = golden();
    let total = g.chunks.iter().sum();
    for (name, dev) in kiln_testkit::devices() {
        let chunked = run(&g, &dev, &g.chunks);
        let whole = run(&g, &dev, &[total]);
        assert_close(&format!("{name} HCA"), &whole.hca, &chunked.hca, 1e-5);
        assert_close(&format!("{name} CSA"), &whole.csa, &chunked.csa, 1e-5);
        assert_eq!(whole.picks, chunked.picks, "{name} picks");
    }
}

fn st_tensor(st: &SafetensorsFile, dev: &Device, name: &str) -> Tensor {
    let shape = st.info(name).unwrap().1.to_vec();
    Tensor::from_f32(dev, &shape, &st.read_f32(name).unwrap()).unwrap()
}

/// The hyper-connection's collapse, the streams after a sublayer, and the head's collapse.
#[test]
fn hyper_connections_match_transformers_on_every_backend() {
    let g = golden();
    let st = SafetensorsFile::open(&fixtures().join("hyper.safetensors")).unwrap();
    let cfg = g.config.hc;
    for (name, dev) in kiln_testkit::devices() {
        let t = |n: &str| st_tensor(&st, &dev, n);
        let hc = HyperConnection::new(
            "hyper.safetensors",
            ["hc.fn", "hc.base", "hc.scale"],
            [t("hc.fn"), t("hc.base"), t("hc.scale")],
            cfg,
            g.config.rms_eps,
        )
        .unwrap();
        let head = HyperHead::new(
            "hyper.safetensors",
            ["head.hc_fn", "head.hc_base", "head.hc_scale"],
            [t("head.hc_fn"), t("head.hc_base"), t("head.hc_scale")],
            cfg,
            g.config.rms_eps,
        )
        .unwrap();
        let (x, y) = (t("x"), t("y"));
        let mut rec = Recorder::new(&dev);
        let (collapsed, w) = hc.collapse(&mut rec, &x).unwrap();
        let after = hc.expand(&mut rec, &x, &y, &w).unwrap();
        let out = head.collapse(&mut rec, &x).unwrap();
        rec.submit().unwrap();
        let read = |t: &Tensor| t.to_f32_vec().unwrap();
        let want = |n: &str| st.read_f32(n).unwrap();
        assert_close(
            &format!("{name} post"),
            &read(&w.post),
            &want("hc.post"),
            1e-5,
        );
        assert_close(
            &format!("{name} comb"),
            &read(&w.comb),
            &want("hc.comb"),
            1e-5,
        );
        assert_close(
            &format!("{name} collapsed"),
            &read(&collapsed),
            &want("hc.collapsed"),
            1e-4,
        );
        assert_close(
            &format!("{name} after"),
            &read(&after),
            &want("hc.after"),
            1e-4,
        );
        assert_close(
            &format!("{name} head"),
            &read(&out),
            &want("head.out"),
            1e-4,
        );
    }
}

#[test]
fn hyper_connection_weights_of_the_wrong_shape_are_refused_by_name() {
    let g = golden();
    let dev = Device::reference();
    let z = |shape: &[usize]| {
        Tensor::from_f32(&dev, shape, &vec![0.0; shape.iter().product()]).unwrap()
    };
    let e = HyperConnection::new(
        "model.safetensors",
        [
            "layers.0.hc_attn_fn",
            "layers.0.hc_attn_base",
            "layers.0.hc_attn_scale",
        ],
        [z(&[24, 256]), z(&[20]), z(&[3])],
        g.config.hc,
        1e-6,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("model.safetensors: tensor `layers.0.hc_attn_base`"),
        "{e}"
    );
    assert!(e.to_string().contains("expected F32 [24]"), "{e}");
}

/// The tiny random model, loaded, and its goldens.
struct Tiny {
    config: DeepseekV4Config,
    golden: SafetensorsFile,
}

fn tiny() -> Tiny {
    let p = fixtures().join("tiny/config.json");
    let text = std::fs::read_to_string(&p).unwrap();
    Tiny {
        config: DeepseekV4Config::from_hf_json(&p.display().to_string(), &text).unwrap(),
        golden: SafetensorsFile::open(&fixtures().join("model_golden.safetensors")).unwrap(),
    }
}

fn tiny_model(dev: &Device) -> V4Model {
    V4Model::load(&fixtures().join("tiny"), dev, 256).unwrap()
}

impl Tiny {
    /// The chunks transformers ran the model's tokens in.
    fn chunks(&self) -> Vec<usize> {
        let c = self.golden.read_f32("chunks").unwrap();
        c.iter().map(|&v| v as usize).collect()
    }
}

/// Each attention layer (sliding, CSA, HCA) of the tiny model, fed what transformers' layer
/// was fed, step by step in the chunks transformers ran, returns what it returned.
#[test]
fn attention_layers_match_transformers_on_every_backend() {
    let tiny = tiny();
    let c = &tiny.config;
    let chunks = tiny.chunks();
    assert_eq!(
        c.attention,
        [
            V4Attention::Sliding,
            V4Attention::Csa { ratio: 4 },
            V4Attention::Hca { ratio: 128 }
        ]
    );
    for (name, dev) in kiln_testkit::devices() {
        let model = tiny_model(&dev);
        for layer in 0..c.layers {
            let attn = model.attention(layer).unwrap();
            let x = tiny.golden.read_f32(&format!("attn_in.{layer}")).unwrap();
            let want = tiny.golden.read_f32(&format!("attn_out.{layer}")).unwrap();
            // The pools' blocks out of order, as a shared pool hands them out.
            let blocks = chunks.iter().sum::<usize>().div_ceil(block_size(c));
            let cfg = V4CacheConfig {
                main_blocks: blocks,
                kept_blocks: blocks,
            };
            let mut cache = V4Cache::new(&dev, c, cfg).unwrap();
            let table: Vec<u32> = (0..blocks as u32).rev().collect();
            let (mut start, mut got) = (0, Vec::new());
            for &n in &chunks {
                let h = c.hidden;
                let xt = Tensor::from_f32(&dev, &[n, h], &x[start * h..][..n * h]).unwrap();
                let positions: Vec<u32> = (start as u32..(start + n) as u32).collect();
                let seq = [PagedSeq {
                    row: 0,
                    start,
                    len: n,
                    main: &table,
                    kept: &table,
                    block: cache.block_size(),
                }];
                let mut rec = Recorder::new(&dev);
                let y = attn
                    .forward(
                        &mut rec,
                        &xt,
                        &model.ropes().positions(&positions).unwrap(),
                        &seq,
                        cache.layer_mut(layer).unwrap(),
                        model.ropes(),
                    )
                    .unwrap();
                rec.submit().unwrap();
                got.extend(y.to_f32_vec().unwrap());
                start += n;
            }
            assert_close(
                &format!("{name} layer {layer} ({:?})", c.attention[layer]),
                &got,
                &want,
                1e-4,
            );
        }
    }
}

/// Each MoE layer of the tiny model (the first hash-routed, the others scored with a
/// selection bias), fed what transformers' DeepseekV4SparseMoeBlock was fed, returns what it
/// returned.
#[test]
fn moe_layers_match_transformers_on_every_backend() {
    let tiny = tiny();
    let c = &tiny.config;
    assert_eq!(c.moe.hash_layers, 1);
    let ids: Vec<u32> = tiny
        .golden
        .read_f32("input_ids")
        .unwrap()
        .iter()
        .map(|&v| v as u32)
        .collect();
    for (name, dev) in kiln_testkit::devices() {
        let model = tiny_model(&dev);
        for layer in 0..c.layers {
            let moe = model.moe(layer).unwrap();
            let x = tiny.golden.read_f32(&format!("mlp_in.{layer}")).unwrap();
            let want = tiny.golden.read_f32(&format!("mlp_out.{layer}")).unwrap();
            let xt = Tensor::from_f32(&dev, &[ids.len(), c.hidden], &x).unwrap();
            let mut rec = Recorder::new(&dev);
            let y = moe.forward(&mut rec, &xt, &ids).unwrap();
            rec.submit().unwrap();
            // The native backend quantizes activations to 8 bits for its products.
            let tol = 1e-4;
            assert_close(
                &format!("{name} MoE layer {layer}"),
                &y.to_f32_vec().unwrap(),
                &want,
                tol,
            );
        }
    }
}
