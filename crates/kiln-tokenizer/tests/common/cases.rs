//! The golden-corpus check shared by every model: ids, offsets, decodes and the incremental
//! detokenizer against what the reference Python tokenizer produced.

use kiln_tokenizer::{DecodeOptions, EncodeOptions, Tokenizer};
use serde_json::Value;

use super::TestResult;

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|n| n as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// Byte offsets to char offsets, as Python reports them.
fn char_offsets(text: &str, offsets: &[(usize, usize)]) -> Vec<Vec<u64>> {
    let to_char = |b: usize| text.get(..b).map_or(u64::MAX, |s| s.chars().count() as u64);
    offsets
        .iter()
        .map(|&(s, e)| vec![to_char(s), to_char(e)])
        .collect()
}

pub fn check_cases(name: &str, tok: &Tokenizer, golden: &Value) -> TestResult {
    let cases = golden["cases"].as_array().ok_or("no cases")?;
    assert!(cases.len() >= 40, "corpus has only {} texts", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().ok_or("case without text")?;
        let with = tok.encode_with(
            text,
            EncodeOptions {
                add_special_tokens: true,
                offsets: true,
            },
        )?;
        let without = tok.encode_with(
            text,
            EncodeOptions {
                add_special_tokens: false,
                offsets: false,
            },
        )?;
        let mut check = |what: &str, ok: bool| {
            if !ok {
                failures.push(format!("{name}: {what} differs for {text:?}"));
            }
        };
        check("ids", with.ids == ids(&case["ids"]));
        check(
            "ids without special tokens",
            without.ids == ids(&case["ids_no_special"]),
        );
        check("default encode", tok.encode(text)? == with.ids);
        let want_offsets: Vec<Vec<u64>> = serde_json::from_value(case["offsets"].clone())?;
        check("offsets", char_offsets(text, &with.offsets) == want_offsets);
        check(
            "decode",
            tok.decode(&with.ids)? == case["decode"].as_str().unwrap_or_default(),
        );
        let skip = tok.decode_with(
            &with.ids,
            DecodeOptions {
                skip_special_tokens: true,
            },
        )?;
        check(
            "decode skipping special tokens",
            skip == case["decode_skip_special"].as_str().unwrap_or_default(),
        );
        for (what, options, want) in [
            ("streamed decode", DecodeOptions::default(), &case["decode"]),
            (
                "streamed decode skipping special tokens",
                DecodeOptions {
                    skip_special_tokens: true,
                },
                &case["decode_skip_special"],
            ),
        ] {
            let streamed = stream(tok, &with.ids, options)?;
            check(what, streamed == want.as_str().unwrap_or_default());
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );

    let texts: Vec<&str> = cases.iter().filter_map(|c| c["text"].as_str()).collect();
    let batch = tok.encode_batch(&texts, EncodeOptions::default())?;
    for (enc, case) in batch.iter().zip(cases) {
        assert_eq!(
            enc.ids,
            ids(&case["ids"]),
            "{name}: batch encode of {:?}",
            case["text"]
        );
    }
    Ok(())
}

/// The incremental detokenizer's deltas, concatenated.
fn stream(
    tok: &Tokenizer,
    ids: &[u32],
    options: DecodeOptions,
) -> Result<String, Box<dyn std::error::Error>> {
    let mut detok = tok.detokenizer(options);
    let mut out = String::new();
    for &id in ids {
        out.push_str(&detok.push(id)?);
    }
    out.push_str(&detok.finish()?);
    Ok(out)
}
