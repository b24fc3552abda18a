//! Property tests: the incremental detokenizer reproduces `decode`, the stop matcher never
//! leaks stop text and never holds text forever.

mod common;

use std::sync::OnceLock;

use kiln_tokenizer::{DecodeOptions, StopMatcher, Tokenizer};
use proptest::prelude::*;

fn smollm2() -> Result<&'static Tokenizer, TestCaseError> {
    static TOK: OnceLock<Result<Tokenizer, String>> = OnceLock::new();
    TOK.get_or_init(|| common::hf_tokenizer().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| TestCaseError::fail(e.clone()))
}

fn spm() -> Result<&'static Tokenizer, TestCaseError> {
    static TOK: OnceLock<Result<Tokenizer, String>> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_gguf_metadata(&common::spm::spm_metadata(true)).map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| TestCaseError::fail(e.clone()))
}

/// Feeds `ids` one at a time and checks every delta and the total against `decode`.
fn check_stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Result<(), TestCaseError> {
    let options = DecodeOptions {
        skip_special_tokens: skip,
    };
    let fail = |e: kiln_tokenizer::TokenizerError| TestCaseError::fail(e.to_string());
    let mut detok = tok.detokenizer(options);
    let full = tok.decode_with(ids, options).map_err(fail)?;
    let mut text = String::new();
    for (i, &id) in ids.iter().enumerate() {
        let delta = detok.push(id).map_err(fail)?;
        text.push_str(&delta);
        // What was emitted is final: a prefix of the decode of the ids fed so far, and of
        // the decode of the whole sequence.
        let so_far = tok.decode_with(&ids[..=i], options).map_err(fail)?;
        prop_assert!(
            so_far.starts_with(&text),
            "emitted {text:?}, decode so far {so_far:?}"
        );
        prop_assert!(
            full.starts_with(&text),
            "emitted {text:?}, full decode {full:?}"
        );
    }
    text.push_str(&detok.finish().map_err(fail)?);
    prop_assert_eq!(text, full);
    Ok(())
}

/// Ids biased towards the hard cases: single bytes of multi-byte characters, special tokens.
fn smollm2_ids() -> impl Strategy<Value = Vec<u32>> {
    // In the byte-level alphabet, ids 17..=272 are the 256 single-byte tokens of SmolLM2.
    let id = prop_oneof![
        4 => 0u32..49152,
        4 => 17u32..273,
        1 => 0u32..17,
    ];
    proptest::collection::vec(id, 0..24)
}

fn spm_ids() -> impl Strategy<Value = Vec<u32>> {
    proptest::collection::vec(0u32..272, 0..24)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn byte_level_deltas_concatenate_to_decode(ids in smollm2_ids(), skip in any::<bool>()) {
        check_stream(smollm2()?, &ids, skip)?;
    }

    #[test]
    fn sentencepiece_deltas_concatenate_to_decode(ids in spm_ids(), skip in any::<bool>()) {
        check_stream(spm()?, &ids, skip)?;
    }

    #[test]
    fn text_round_trips_through_the_detokenizer(text in "\\PC{0,40}") {
        let tok = smollm2()?;
        let ids = tok.encode(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_stream(tok, &ids, false)?;
        prop_assert_eq!(tok.decode(&ids).map_err(|e| TestCaseError::fail(e.to_string()))?, text);
    }

    #[test]
    fn stop_matcher_never_leaks_and_never_withholds(
        text in "[ab🛑c]{0,40}",
        stops in proptest::collection::vec("[ab🛑c]{1,4}", 0..3),
        cuts in proptest::collection::vec(0usize..50, 0..8),
    ) {
        // Reference: the stop string completing first (longest on a tie) in the whole text.
        let first = stops
            .iter()
            .filter_map(|s| text.find(s.as_str()).map(|p| (p + s.len(), std::cmp::Reverse(s.len()), p)))
            .min()
            .map(|(_, _, p)| p);
        let longest = stops.iter().map(String::len).max().unwrap_or(0);

        let mut bounds: Vec<usize> = cuts.into_iter().filter(|&c| c < text.len() && text.is_char_boundary(c)).collect();
        bounds.push(0);
        bounds.push(text.len());
        bounds.sort_unstable();
        bounds.dedup();

        let mut m = StopMatcher::new(stops.clone());
        let mut out = String::new();
        let mut hit = false;
        for w in bounds.windows(2) {
            let o = m.push(&text[w[0]..w[1]]);
            out.push_str(&o.text);
            prop_assert!(m.held().len() < longest.max(1), "held {:?}", m.held());
            if o.hit.is_some() {
                hit = true;
                break;
            }
        }
        if !hit {
            out.push_str(&m.finish());
        }
        match first {
            Some(p) => {
                prop_assert!(hit);
                prop_assert_eq!(out.as_str(), &text[..p]);
            }
            None => {
                prop_assert!(!hit);
                prop_assert_eq!(out.as_str(), text.as_str());
            }
        }
        for s in &stops {
            prop_assert!(!out.contains(s.as_str()), "emitted text contains stop {s:?}");
        }
    }
}

#[test]
fn multibyte_characters_are_held_until_complete() -> common::TestResult {
    let tok = common::hf_tokenizer()?;
    let ids = tok.encode("a😀b")?;
    let mut detok = tok.detokenizer(DecodeOptions::default());
    let deltas: Vec<String> = ids
        .iter()
        .map(|&i| detok.push(i))
        .collect::<Result<_, _>>()?;
    assert!(
        deltas.len() > 3,
        "the emoji is split over byte tokens: {ids:?}"
    );
    assert_eq!(deltas.concat(), "a😀b");
    assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
    assert_eq!(deltas.iter().filter(|d| d.contains('😀')).count(), 1);
    assert_eq!(detok.finish()?, "");
    // An unfinished character at the end is flushed as U+FFFD, as `decode` does.
    let mut detok = tok.detokenizer(DecodeOptions::default());
    let first_byte = tok.token_to_id("ð").ok_or("no byte token for F0")?;
    assert_eq!(detok.push(first_byte)?, "");
    assert_eq!(detok.finish()?, "\u{FFFD}");
    // Unknown ids are errors, not panics.
    assert!(detok.push(1_000_000).is_err());
    Ok(())
}

/// The concatenated [`Tokenizer::token_bytes`] of `ids`, special tokens left out.
fn joined_bytes(tok: &Tokenizer, ids: &[u32]) -> Result<Vec<u8>, TestCaseError> {
    let table = tok
        .token_bytes()
        .ok_or_else(|| TestCaseError::fail("no token bytes for this decoder"))?;
    let mut out = Vec::new();
    for &id in ids {
        let t = table
            .get(id as usize)
            .ok_or_else(|| TestCaseError::fail(format!("id {id} has no entry")))?;
        if !t.special {
            out.extend_from_slice(&t.bytes);
        }
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Token bytes are what `tokenizers`' own decoder writes: byte-level ids of any kind.
    #[test]
    fn byte_level_token_bytes_are_what_decode_writes(ids in smollm2_ids()) {
        let tok = smollm2()?;
        let fail = |e: kiln_tokenizer::TokenizerError| TestCaseError::fail(e.to_string());
        let want = tok.decode_with(&ids, DecodeOptions { skip_special_tokens: true }).map_err(fail)?;
        let got = joined_bytes(tok, &ids)?;
        prop_assert_eq!(String::from_utf8_lossy(&got), want);
    }

    /// SentencePiece: the pieces of an encoded text spell it (after the dummy-prefix space
    /// the decoder strips), byte-fallback bytes included.
    #[test]
    fn sentencepiece_token_bytes_spell_the_text(text in "\\PC{0,40}") {
        let tok = spm()?;
        let fail = |e: kiln_tokenizer::TokenizerError| TestCaseError::fail(e.to_string());
        let ids = tok.encode(&text).map_err(fail)?;
        let want = tok.decode_with(&ids, DecodeOptions { skip_special_tokens: true }).map_err(fail)?;
        let got = String::from_utf8_lossy(&joined_bytes(tok, &ids)?).into_owned();
        prop_assert!(
            got == want || got.strip_prefix(' ') == Some(want.as_str()),
            "pieces spell {got:?}, decode gives {want:?}"
        );
    }
}

#[test]
fn special_tokens_are_flagged_in_token_bytes() -> Result<(), TestCaseError> {
    let tok = smollm2()?;
    let table = tok
        .token_bytes()
        .ok_or_else(|| TestCaseError::fail("no token bytes"))?;
    assert_eq!(table.len(), tok.vocab_size() as usize);
    let eos = tok
        .special_tokens()
        .eos
        .ok_or_else(|| TestCaseError::fail("no eos"))?;
    assert!(table[eos as usize].special);
    assert_eq!(table[eos as usize].bytes, b"<|im_end|>");
    let space_a = tok
        .token_to_id("\u{120}a")
        .ok_or_else(|| TestCaseError::fail("no Ġa"))?;
    assert_eq!(table[space_a as usize].bytes, b" a");
    assert!(!table[space_a as usize].special);
    Ok(())
}
