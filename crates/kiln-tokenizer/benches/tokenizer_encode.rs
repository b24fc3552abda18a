//! Encode throughput of `kiln-tokenizer` against calling `tokenizers` directly, on the default
//! model's tokenizer (the committed `tokenizer.json` fixture) and a mixed corpus (prose, code,
//! CJK, emoji, special tokens). Run with `cargo bench -p kiln-tokenizer --bench tokenizer_encode`.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kiln_tokenizer::{EncodeOptions, Tokenizer};

fn corpus() -> anyhow::Result<Vec<String>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_golden.json");
    let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let texts: Vec<String> = golden["cases"]
        .as_array()
        .map(|cases| {
            cases
                .iter()
                .filter_map(|c| c["text"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    anyhow::ensure!(!texts.is_empty(), "{}: no texts", path.display());
    // About 64 KiB per pass, as many short prompts.
    Ok(texts
        .iter()
        .cycle()
        .take(texts.len() * 24)
        .cloned()
        .collect())
}

fn tokenizer() -> anyhow::Result<Tokenizer> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2");
    Ok(Tokenizer::from_hf_dir(dir)?)
}

fn kiln_pass(tok: &Tokenizer, texts: &[String]) -> anyhow::Result<usize> {
    let mut n = 0;
    for t in texts {
        n += black_box(tok.encode(t)?).len();
    }
    Ok(n)
}

fn direct_pass(tok: &tokenizers::Tokenizer, texts: &[String]) -> anyhow::Result<usize> {
    let mut n = 0;
    for t in texts {
        n += black_box(
            tok.encode_fast(t.as_str(), true)
                .map_err(anyhow::Error::msg)?,
        )
        .len();
    }
    Ok(n)
}

/// MB/s over about a second of passes.
fn rate(bytes: usize, mut pass: impl FnMut() -> anyhow::Result<usize>) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut total = 0usize;
    while start.elapsed() < Duration::from_secs(1) {
        pass()?;
        total += bytes;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64() / 1e6)
}

fn main() -> anyhow::Result<()> {
    let tok = tokenizer()?;
    let texts = corpus()?;
    let bytes: usize = texts.iter().map(String::len).sum();
    anyhow::ensure!(
        kiln_pass(&tok, &texts)? == direct_pass(tok.inner(), &texts)?,
        "kiln and tokenizers disagree"
    );

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("tokenizer_encode");
    group.throughput(Throughput::Bytes(bytes as u64));
    group.bench_function("kiln", |b| b.iter(|| kiln_pass(&tok, &texts)));
    group.bench_function("tokenizers_direct", |b| {
        b.iter(|| direct_pass(tok.inner(), &texts))
    });
    let offsets = EncodeOptions {
        add_special_tokens: true,
        offsets: true,
    };
    group.bench_function("kiln_with_offsets", |b| {
        b.iter(|| {
            texts
                .iter()
                .map(|t| tok.encode_with(t, offsets).map(|e| e.ids.len()))
                .sum::<Result<usize, _>>()
        })
    });
    group.finish();
    c.final_summary();

    let kiln = rate(bytes, || kiln_pass(&tok, &texts))?;
    let direct = rate(bytes, || direct_pass(tok.inner(), &texts))?;
    println!(
        "encode throughput ({} texts, {bytes} bytes per pass): kiln {kiln:.2} MB/s, tokenizers direct {direct:.2} MB/s, kiln/direct = {:.3}",
        texts.len(),
        kiln / direct
    );
    Ok(())
}
