//! The default model's tokenizer, from its HF `tokenizer.json` and from its GGUF metadata,
//! against ids, offsets, decodes and chat renderings made by the reference Python tokenizer
//! (`scripts/make_tokenizer_fixtures.py`).

mod common;

use common::cases::check_cases;
use common::{TestResult, gguf_tokenizer, golden, hf_tokenizer};
use kiln_tokenizer::{ChatMessage, ChatOptions};

#[test]
fn hf_tokenizer_json_matches_reference_ids() -> TestResult {
    check_cases("tokenizer.json", &hf_tokenizer()?, &golden()?)
}

#[test]
fn gguf_metadata_matches_reference_ids() -> TestResult {
    check_cases("GGUF", &gguf_tokenizer()?, &golden()?)
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
