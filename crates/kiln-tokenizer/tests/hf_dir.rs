//! Loading Hugging Face folders: config files, their errors, and template failures.

mod common;

use std::path::{Path, PathBuf};

use common::{TestResult, fixtures};
use kiln_tokenizer::{ChatMessage, ChatOptions, Tokenizer};

/// A scratch folder holding the SmolLM2 `tokenizer.json` and the given extra files.
fn folder(name: &str, files: &[(&str, &str)]) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("kiln-tok-{name}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(
        fixtures().join("smollm2/tokenizer.json"),
        dir.join("tokenizer.json"),
    )?;
    for (file, text) in files {
        std::fs::write(dir.join(file), text)?;
    }
    Ok(dir)
}

fn load_err(dir: &Path) -> String {
    match Tokenizer::from_hf_dir(dir) {
        Ok(_) => String::from("loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_files_set_specials_bos_and_templates() -> TestResult {
    let dir = folder(
        "cfg",
        &[
            (
                "tokenizer_config.json",
                r#"{"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": true,
                    "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}"#,
            ),
            ("generation_config.json", r#"{"eos_token_id": [2, 0]}"#),
        ],
    )?;
    let tok = Tokenizer::from_hf_dir(&dir)?;
    let s = tok.special_tokens();
    assert_eq!((s.bos, s.eos, s.add_bos), (Some(1), Some(2), true));
    assert_eq!(s.stop_ids, [2, 0]);
    assert_eq!(
        tok.encode("The capital of France is")?,
        [1, 504, 3575, 282, 4649, 314]
    );
    assert_eq!(
        tok.apply_chat_template(&[], &ChatOptions::default())?,
        "<|im_start|>D"
    );

    // chat_template.jinja wins over the config's template.
    std::fs::write(dir.join("chat_template.jinja"), "J{{ messages | length }}")?;
    let tok = Tokenizer::from_hf_dir(&dir)?;
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", "x")], &ChatOptions::default())?,
        "J1"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn models_without_a_template_get_chatml() -> TestResult {
    let dir = folder("chatml", &[])?;
    let tok = Tokenizer::from_hf_dir(&dir)?;
    assert!(tok.chat_template().is_none());
    let opts = ChatOptions {
        add_generation_prompt: true,
    };
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", "hi")], &opts)?,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn missing_and_malformed_files_are_named() -> TestResult {
    let missing = std::env::temp_dir().join("kiln-tok-does-not-exist");
    let msg = load_err(&missing);
    assert!(
        msg.contains("kiln-tok-does-not-exist/tokenizer.json: cannot read"),
        "{msg}"
    );

    let dir = folder("broken-json", &[])?;
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 3}")?;
    let msg = load_err(&dir);
    assert!(
        msg.contains("tokenizer.json: cannot build tokenizer"),
        "{msg}"
    );

    let dir = folder(
        "broken-config",
        &[("tokenizer_config.json", "{\"bos_token\": ")],
    )?;
    let msg = load_err(&dir);
    assert!(
        msg.contains("tokenizer_config.json: EOF while parsing"),
        "{msg}"
    );

    let dir = folder(
        "bad-bos",
        &[("tokenizer_config.json", r#"{"bos_token": "<s>"}"#)],
    )?;
    let msg = load_err(&dir);
    assert!(
        msg.ends_with("tokenizer_config.json: field `bos_token`: `<s>` is not in the vocabulary"),
        "{msg}"
    );

    let dir = folder(
        "bad-flag",
        &[("tokenizer_config.json", r#"{"add_bos_token": "yes"}"#)],
    )?;
    let msg = load_err(&dir);
    assert!(
        msg.ends_with("field `add_bos_token`: expected a bool, found \"yes\""),
        "{msg}"
    );

    let dir = folder(
        "bad-gen",
        &[("generation_config.json", r#"{"eos_token_id": [-1]}"#)],
    )?;
    let msg = load_err(&dir);
    assert!(
        msg.ends_with("generation_config.json: field `eos_token_id`: -1 is not a token id"),
        "{msg}"
    );

    let dir = folder("bad-template", &[("chat_template.jinja", "{% for %}")])?;
    let msg = load_err(&dir);
    assert!(
        msg.starts_with("chat template `model` does not compile"),
        "{msg}"
    );

    for name in [
        "broken-json",
        "broken-config",
        "bad-bos",
        "bad-flag",
        "bad-gen",
        "bad-template",
    ] {
        std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("kiln-tok-{name}-{}", std::process::id())),
        )?;
    }
    Ok(())
}

#[test]
fn a_template_that_fails_reports_why() -> TestResult {
    let dir = folder(
        "raise",
        &[(
            "chat_template.jinja",
            "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}{{ m.content }}{% endfor %}",
        )],
    )?;
    let tok = Tokenizer::from_hf_dir(&dir)?;
    assert_eq!(
        tok.apply_chat_template(&[ChatMessage::new("user", "ok")], &ChatOptions::default())?,
        "ok"
    );
    let err = tok
        .apply_chat_template(&[ChatMessage::new("tool", "x")], &ChatOptions::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.starts_with("chat template `model` failed: ")
            && err.contains("tool messages are not supported"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
