//! Every `tokenizer.ggml.pre` name kiln maps, against the pre-tokenizer of the models that use
//! it, as their own `tokenizer.json` builds it in Hugging Face `tokenizers`
//! (`scripts/make_tokenizer_fixtures.py`), over a corpus covering each Unicode class the split
//! regexes name: numbers (`\p{N}` beyond ASCII digits, digit runs), letters, marks,
//! punctuation, symbols, CJK, emoji, whitespace runs and contractions.

mod common;

use common::pretok::{gpt2_metadata, splits};
use common::{TestResult, golden_file};
use kiln_tokenizer::Tokenizer;

#[test]
fn every_mapped_name_splits_like_its_reference() -> TestResult {
    let golden = golden_file("pretok_golden.json")?;
    let texts: Vec<String> = serde_json::from_value(golden["texts"].clone())?;
    let groups = golden["groups"].as_array().ok_or("no groups")?;
    assert_eq!(groups.len(), 4);
    let mut failures = Vec::new();
    let mut checked = 0;
    for group in groups {
        let names: Vec<String> = serde_json::from_value(group["names"].clone())?;
        let want: Vec<Vec<String>> = serde_json::from_value(group["splits"].clone())?;
        assert_eq!(want.len(), texts.len());
        for name in &names {
            let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata(name))?;
            for (text, want) in texts.iter().zip(&want) {
                let got = splits(&tok, text)?;
                if &got != want {
                    failures.push(format!(
                        "`{name}` on {text:?}:\n  kiln {got:?}\n  HF   {want:?}"
                    ));
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 800, "only {checked} splits checked");
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}

/// " ½": Hugging Face's `Digits(individual_digits=true)` (SmolLM2's and StarCoder's
/// tokenizer.json) isolates every `\p{N}` character, ASCII or not, so the space stays a token of
/// its own; plain GPT-2 splitting (what transformers 5.24 builds for `smollm`, which it does not
/// know) keeps " ½" together.
#[test]
fn smollm_isolates_every_numeric_character() -> TestResult {
    let tok = Tokenizer::from_gguf_metadata(&gpt2_metadata("smollm"))?;
    assert_eq!(
        splits(&tok, " ½ Ⅻ ٣4")?,
        ["Ġ", "Â½", "Ġ", "âħ«", "Ġ", "Ù£", "4"]
    );
    let gpt2 = Tokenizer::from_gguf_metadata(&gpt2_metadata("gpt2"))?;
    assert_eq!(splits(&gpt2, " ½ Ⅻ ٣4")?, ["ĠÂ½", "Ġâħ«", "ĠÙ£4"]);
    Ok(())
}
