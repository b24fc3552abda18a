//! Tokenizers built from small synthetic GGUF metadata: SentencePiece (`llama`) behaviour, the
//! byte-level pre-tokenizers by name, and their error messages.

mod common;

use common::TestResult;
use common::pretok::{gpt2_metadata, splits};
use common::spm::spm_metadata;
use kiln_gguf::{GgufWriter, Metadata};
use kiln_tokenizer::{DecodeOptions, EncodeOptions, Tokenizer, TokenizerError};

fn id(tok: &Tokenizer, t: &str) -> Result<u32, String> {
    tok.token_to_id(t).ok_or_else(|| format!("no token {t:?}"))
}

#[test]
fn sentencepiece_prefixes_a_space_and_merges_by_score() -> TestResult {
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata(true))?;
    let hello = id(&tok, "▁hello")?;
    // BOS is added by default for `llama` vocabularies.
    assert_eq!(tok.encode("hello")?, [1, hello]);
    assert!(tok.special_tokens().add_bos);
    let plain = EncodeOptions {
        add_special_tokens: false,
        offsets: false,
    };
    assert_eq!(tok.encode_with("hello hello", plain)?.ids, [hello, hello]);
    // `he` + `llo` only after `ll` and `he` formed: "hell" has no `hello` to reach.
    assert_eq!(
        tok.encode_with("hell", plain)?.ids,
        [id(&tok, "▁")?, id(&tok, "he")?, id(&tok, "ll")?]
    );
    // Special and user-defined tokens are matched whole in text.
    assert_eq!(
        tok.encode_with("hello</s><tool>", plain)?.ids,
        [hello, 2, id(&tok, "<tool>")?]
    );
    assert!(tok.is_special(2) && !tok.is_special(id(&tok, "<tool>")?));
    // The decoder drops the prefix space again.
    // The prefix space is stripped only at the very start of the output, as Hugging Face does.
    assert_eq!(tok.decode(&[1, hello, hello, 2])?, "<s> hello hello</s>");
    assert_eq!(tok.decode(&[hello, hello])?, "hello hello");
    assert_eq!(
        tok.decode_with(
            &[1, hello, hello, 2],
            DecodeOptions {
                skip_special_tokens: true
            }
        )?,
        "hello hello"
    );
    Ok(())
}

#[test]
fn sentencepiece_falls_back_to_bytes_for_unknown_characters() -> TestResult {
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata(true))?;
    let plain = EncodeOptions {
        add_special_tokens: false,
        offsets: false,
    };
    // "é" is not a piece: its UTF-8 bytes C3 A9 become byte tokens; "€" likewise (E2 82 AC).
    let ids = tok.encode_with("hé€", plain)?.ids;
    let want = [
        id(&tok, "▁")?,
        id(&tok, "h")?,
        id(&tok, "<0xC3>")?,
        id(&tok, "<0xA9>")?,
        id(&tok, "<0xE2>")?,
        id(&tok, "<0x82>")?,
        id(&tok, "<0xAC>")?,
    ];
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids)?, "hé€");
    // A byte run that is not valid UTF-8 decodes to one U+FFFD per byte.
    assert_eq!(
        tok.decode(&[id(&tok, "h")?, id(&tok, "<0xC3>")?, id(&tok, "h")?])?,
        "h\u{FFFD}h"
    );
    Ok(())
}

#[test]
fn sentencepiece_without_space_prefix() -> TestResult {
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata(false))?;
    let plain = EncodeOptions {
        add_special_tokens: false,
        offsets: false,
    };
    assert_eq!(tok.encode_with("hello", plain)?.ids, [id(&tok, "hello")?]);
    assert_eq!(tok.encode_with(" hello", plain)?.ids, [id(&tok, "▁hello")?]);
    assert_eq!(tok.decode(&[id(&tok, "▁hello")?])?, " hello");
    Ok(())
}

#[test]
fn sentencepiece_detokenizer_handles_leading_space_and_byte_runs() -> TestResult {
    let tok = Tokenizer::from_gguf_metadata(&spm_metadata(true))?;
    let ids = [
        1,
        id(&tok, "▁hello")?,
        id(&tok, "<0xE2>")?,
        id(&tok, "<0x82>")?,
        id(&tok, "<0xAC>")?,
        id(&tok, "▁w")?,
    ];
    let mut d = tok.detokenizer(DecodeOptions {
        skip_special_tokens: true,
    });
    let deltas: Vec<String> = ids.iter().map(|&i| d.push(i)).collect::<Result<_, _>>()?;
    assert_eq!(deltas, ["", "hello", "", "", "", "€ w"]);
    assert_eq!(d.finish()?, "");
    Ok(())
}

#[test]
fn byte_level_pre_tokenizers_split_like_their_models() -> TestResult {
    let text = "Hello world's 12345 !!\n\n  x";
    let expect: [(&str, &[&str]); 4] = [
        (
            "default",
            &["Hello", "Ġworld", "'s", "Ġ12345", "Ġ!!", "ĊĊĠ", "Ġx"],
        ),
        (
            "smollm",
            &[
                "Hello", "Ġworld", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġ!!", "ĊĊĠ", "Ġx",
            ],
        ),
        (
            "llama-bpe",
            &[
                "Hello", "Ġworld", "'s", "Ġ", "123", "45", "Ġ!!ĊĊ", "Ġ", "Ġx",
            ],
        ),
        (
            "qwen2",
            &[
                "Hello", "Ġworld", "'s", "Ġ", "1", "2", "3", "4", "5", "Ġ!!ĊĊ", "Ġ", "Ġx",
            ],
        ),
    ];
    for (pre, want) in expect {
        let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata(pre))?;
        assert_eq!(splits(&tok, text)?, want, "pre-tokenizer {pre}");
    }
    // Llama 3 keeps a letter run's leading punctuation and splits case-insensitive contractions.
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("llama3"))?;
    assert_eq!(splits(&tok, "I'M (ok)")?, ["I", "'M", "Ġ(", "ok", ")"]);
    // Qwen2 normalizes to NFC first: e + combining acute becomes one é.
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("qwen2"))?;
    assert_eq!(splits(&tok, "e\u{301}")?, ["Ã©"]);
    Ok(())
}

fn err(md: &Metadata) -> String {
    match Tokenizer::from_gguf_metadata(md) {
        Ok(_) => String::from("built"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn gguf_metadata_errors_are_clear() -> TestResult {
    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.ggml.model", "bert");
    assert_eq!(
        err(&md),
        "GGUF tokenizer model `bert` is not supported (kiln supports `gpt2` and `llama`)"
    );

    let md = gpt2_metadata("falcon");
    assert!(
        err(&md).starts_with("GGUF pre-tokenizer `falcon` is not supported"),
        "{}",
        err(&md)
    );

    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.ggml.bos_token_id", 7u32);
    assert_eq!(
        err(&md),
        "GGUF metadata `tokenizer.ggml.bos_token_id`: id 7 is outside the 2-token vocabulary"
    );

    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.ggml.token_type", vec![1i32]);
    assert_eq!(
        err(&md),
        "GGUF metadata `tokenizer.ggml.token_type`: 1 entries for 2 tokens"
    );

    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.ggml.merges", vec!["ab"]);
    assert!(
        err(&md).contains("entry \"ab\" has no space"),
        "{}",
        err(&md)
    );

    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.ggml.tokens", 5u32);
    assert_eq!(
        err(&md),
        "metadata key `tokenizer.ggml.tokens` holds u32 5, expected an array of strings"
    );

    assert_eq!(
        err(&Metadata::new()),
        "GGUF metadata `tokenizer.ggml.model`: missing"
    );

    let mut md = spm_metadata(true);
    md.insert("tokenizer.ggml.scores", vec![0.0f32; 3]);
    assert!(err(&md).contains("3 scores for 272 tokens"), "{}", err(&md));

    let mut md = gpt2_metadata("default");
    md.insert("tokenizer.chat_template", "{% if %}");
    assert!(
        err(&md).starts_with("chat template `model` does not compile"),
        "{}",
        err(&md)
    );
    Ok(())
}

#[test]
fn gguf_files_are_read_and_bad_ones_named() -> TestResult {
    let dir = std::env::temp_dir().join(format!("kiln-tok-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let mut w = GgufWriter::new();
    for (k, v) in spm_metadata(true).iter() {
        w.metadata(k, v.clone());
    }
    let good = dir.join("spm.gguf");
    std::fs::write(&good, w.to_bytes()?)?;
    let tok = Tokenizer::from_gguf_file(&good)?;
    assert_eq!(tok.vocab_size(), 272);

    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"not a gguf file")?;
    match Tokenizer::from_gguf_file(&bad) {
        Err(TokenizerError::Gguf(e)) => {
            assert!(e.to_string().contains("bad.gguf: not a GGUF file"))
        }
        other => return Err(format!("expected a GGUF error, got {other:?}").into()),
    }
    let mut w = GgufWriter::new();
    w.metadata("tokenizer.ggml.model", "t5");
    let unknown = dir.join("t5.gguf");
    std::fs::write(&unknown, w.to_bytes()?)?;
    let msg = Tokenizer::from_gguf_file(&unknown)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        msg.ends_with(
            "t5.gguf: GGUF tokenizer model `t5` is not supported (kiln supports `gpt2` and `llama`)"
        ),
        "{msg}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
