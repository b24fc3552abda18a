//! The default model's tokenizer, from its HF `tokenizer.json` and from its GGUF metadata,
//! against ids, offsets, decodes and chat renderings made by the reference Python tokenizer
//! (`scripts/make_tokenizer_fixtures.py`).

mod common;

use common::{TestResult, gguf_tokenizer, golden, hf_tokenizer};
use kiln_tokenizer::{ChatMessage, ChatOptions, DecodeOptions, EncodeOptions, Tokenizer};
use serde_json::Value;

fn ids(v: &Value) -> Vec<u32> {
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

fn check_cases(name: &str, tok: &Tokenizer) -> TestResult {
    let golden = golden()?;
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

#[test]
fn hf_tokenizer_json_matches_reference_ids() -> TestResult {
    check_cases("tokenizer.json", &hf_tokenizer()?)
}

#[test]
fn gguf_metadata_matches_reference_ids() -> TestResult {
    check_cases("GGUF", &gguf_tokenizer()?)
}

#[test]
fn facts_about_the_default_model() -> TestResult {
    for tok in [hf_tokenizer()?, gguf_tokenizer()?] {
        assert_eq!(
            tok.encode("The capital of France is")?,
            [504, 3575, 282, 4649, 314]
        );
        let s = tok.special_tokens();
        assert_eq!(
            (s.bos, s.eos, s.add_bos, s.add_eos),
            (Some(1), Some(2), false, false)
        );
        assert_eq!(s.stop_ids, [2]);
        assert_eq!(tok.vocab_size(), 49152);
        assert_eq!(tok.id_to_token(2).as_deref(), Some("<|im_end|>"));
        assert!(tok.is_special(1) && tok.is_special(16) && !tok.is_special(17));
    }
    Ok(())
}

#[test]
fn gguf_and_hf_tokenizers_agree_on_vocabulary() -> TestResult {
    let (hf, gguf) = (hf_tokenizer()?, gguf_tokenizer()?);
    for id in 0..hf.vocab_size() {
        assert_eq!(hf.id_to_token(id), gguf.id_to_token(id), "token {id}");
        assert_eq!(hf.is_special(id), gguf.is_special(id), "token {id}");
    }
    Ok(())
}

#[test]
fn chat_template_matches_reference_rendering() -> TestResult {
    let golden = golden()?;
    let chats = golden["chats"].as_array().ok_or("no chats")?;
    assert!(chats.len() >= 4);
    for tok in [hf_tokenizer()?, gguf_tokenizer()?] {
        assert!(tok.chat_template().is_some(), "the model ships a template");
        for chat in chats {
            let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone())?;
            let options = ChatOptions {
                add_generation_prompt: chat["add_generation_prompt"].as_bool().ok_or("flag")?,
            };
            let rendered = tok.apply_chat_template(&messages, &options)?;
            assert_eq!(rendered, chat["rendered"].as_str().ok_or("rendered")?);
        }
    }
    Ok(())
}
