//! Qwen2's byte-level BPE (also Qwen3's: same vocabulary, merges and `qwen2` split), from the real
//! vocabulary llama.cpp ships as `ggml-vocab-qwen2.gguf`, against the ids Hugging Face's Qwen2
//! tokenizer gives (`scripts/make_tokenizer_fixtures.py`, which first checks that reference
//! against llama.cpp's own ids for the same file). Qwen3's chat template renders as transformers
//! renders it.

mod common;

use common::cases::check_cases;
use common::{TestResult, fixtures, golden_file, qwen2_tokenizer};
use kiln_tokenizer::{ChatOptions, ChatTemplate};

#[test]
fn gguf_metadata_matches_reference_ids() -> TestResult {
    check_cases(
        "Qwen2 GGUF",
        &qwen2_tokenizer()?,
        &golden_file("qwen2_golden.json")?,
    )
}

#[test]
fn facts_about_qwen2() -> TestResult {
    let tok = qwen2_tokenizer()?;
    let s = tok.special_tokens();
    assert_eq!(
        (s.bos, s.eos, s.add_bos, s.add_eos),
        (Some(151643), Some(151643), false, false)
    );
    // `<|im_end|>` ends a ChatML turn.
    assert_eq!(s.stop_ids, [151643, 151645]);
    assert_eq!(tok.vocab_size(), 151936);
    assert!(tok.is_special(151644) && !tok.is_special(151646));
    Ok(())
}

#[test]
fn qwen3_chat_template_matches_reference_rendering() -> TestResult {
    let golden = golden_file("qwen2_golden.json")?;
    let chats = golden["chats"].as_array().ok_or("no chats")?;
    assert!(chats.len() >= 8);
    let tok = qwen2_tokenizer()?;
    let template = ChatTemplate::from_file(fixtures().join("qwen2/qwen3_chat_template.jinja"))?;
    for chat in chats {
        let messages = chat["messages"].as_array().ok_or("messages")?;
        let options = ChatOptions {
            add_generation_prompt: chat["add_generation_prompt"].as_bool().ok_or("flag")?,
        };
        let mut extra = serde_json::Map::new();
        for key in ["tools", "enable_thinking"] {
            if let Some(v) = chat.get(key) {
                extra.insert(key.to_owned(), v.clone());
            }
        }
        let rendered = template.render_with(
            messages,
            &options,
            &extra,
            None,
            tok.id_to_token(151643).as_deref(),
        )?;
        assert_eq!(
            rendered,
            chat["rendered"].as_str().ok_or("rendered")?,
            "{chat}"
        );
    }
    Ok(())
}
