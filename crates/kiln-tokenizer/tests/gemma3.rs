//! Gemma 3's SentencePiece vocabulary, built from its GGUF metadata, against the ids, offsets,
//! decodes and chat renderings transformers produced for the same file
//! (`scripts/make_tokenizer_fixtures.py`). Needs `models/gemma-3-270m-q4_k_m.gguf`: fails, never
//! skips, without it.

mod common;

use common::cases::check_cases;
use common::{TestResult, fixtures, gemma3_tokenizer, golden_file};
use kiln_tokenizer::{ChatMessage, ChatOptions, ChatTemplate};

#[test]
fn gguf_metadata_matches_reference_ids() -> TestResult {
    check_cases(
        "Gemma 3 GGUF",
        &gemma3_tokenizer()?,
        &golden_file("gemma3_golden.json")?,
    )
}

#[test]
fn facts_about_gemma3() -> TestResult {
    let golden = golden_file("gemma3_golden.json")?;
    let tok = gemma3_tokenizer()?;
    let s = tok.special_tokens();
    let want = &golden["special_ids"];
    let id = |k: &str| want[k].as_u64().map(|n| n as u32);
    assert_eq!(
        (s.bos, s.eos, s.unk, s.pad),
        (id("bos"), id("eos"), id("unk"), id("pad"))
    );
    assert_eq!(golden["add_bos_token"].as_bool(), Some(true));
    assert!(s.add_bos && !s.add_eos);
    assert_eq!(
        u64::from(tok.vocab_size()),
        golden["vocab_size"].as_u64().ok_or("vocab_size")?
    );
    // `<end_of_turn>` ends a chat turn: generation stops on it as on `<eos>`.
    assert_eq!(tok.token_to_id("<end_of_turn>"), Some(106));
    assert_eq!(s.stop_ids, [1, 106]);
    // Exactly the reference's special tokens are special (skipped by skip_special_tokens).
    let special: Vec<u64> = (0..tok.vocab_size())
        .filter(|&id| tok.is_special(id))
        .map(u64::from)
        .collect();
    let want: Vec<u64> = serde_json::from_value(golden["special_added_ids"].clone())?;
    assert_eq!(special, want);
    // The GGUF has no chat template and Gemma has no ChatML tokens: chatting without
    // `--chat-template` is an error, not a ChatML prompt the model never saw.
    assert!(tok.chat_template().is_none());
    let e = tok
        .apply_chat_template(&[ChatMessage::new("user", "hi")], &ChatOptions::default())
        .unwrap_err();
    assert!(e.to_string().contains("--chat-template"), "{e}");
    // From the model card's example, with the BOS the model expects.
    assert_eq!(
        tok.encode("The capital of Japan is")?,
        [2, 818, 5279, 529, 6056, 563]
    );
    Ok(())
}

#[test]
fn chat_template_matches_reference_rendering() -> TestResult {
    let golden = golden_file("gemma3_golden.json")?;
    let chats = golden["chats"].as_array().ok_or("no chats")?;
    assert!(chats.len() >= 6);
    let tok = gemma3_tokenizer()?;
    assert!(tok.chat_template().is_none(), "the GGUF ships no template");
    let template = ChatTemplate::from_file(fixtures().join("gemma3/chat_template.jinja"))?;
    for chat in chats {
        let messages: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone())?;
        let options = ChatOptions {
            add_generation_prompt: chat["add_generation_prompt"].as_bool().ok_or("flag")?,
        };
        let rendered = tok.render_chat(&template, &messages, &options)?;
        assert_eq!(rendered, chat["rendered"].as_str().ok_or("rendered")?);
    }
    // The template's own guard.
    let err = tok
        .render_chat(
            &template,
            &[ChatMessage::new("assistant", "first")],
            &ChatOptions::default(),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("Conversation roles must alternate"), "{err}");
    Ok(())
}
