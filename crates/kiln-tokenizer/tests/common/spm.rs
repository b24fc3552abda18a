//! A synthetic SentencePiece (`llama`) vocabulary, shared by several test files.

use kiln_gguf::Metadata;

/// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then a few pieces. Scores rank merges: the
/// merge producing the higher-scored token is applied first, as SentencePiece BPE does.
pub fn spm_metadata(add_space_prefix: bool) -> Metadata {
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut scores = vec![0.0f32; 3];
    let mut types = vec![2i32, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(6);
    }
    let pieces: [(&str, f32); 13] = [
        ("▁", -1000.0),
        ("h", -1000.0),
        ("e", -1000.0),
        ("l", -1000.0),
        ("o", -1000.0),
        ("ll", -4.0),
        ("he", -5.0),
        ("llo", -6.0),
        ("hello", -7.0),
        ("▁hello", -8.0),
        ("w", -1000.0),
        ("▁w", -9.0),
        ("<tool>", 0.0),
    ];
    for (p, s) in pieces {
        tokens.push(p.into());
        scores.push(s);
        types.push(if p == "<tool>" { 4 } else { 1 });
    }
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", "llama");
    md.insert("tokenizer.ggml.tokens", tokens);
    md.insert("tokenizer.ggml.scores", scores);
    md.insert("tokenizer.ggml.token_type", types);
    md.insert("tokenizer.ggml.bos_token_id", 1u32);
    md.insert("tokenizer.ggml.eos_token_id", 2u32);
    md.insert("tokenizer.ggml.unknown_token_id", 0u32);
    md.insert("tokenizer.ggml.add_space_prefix", add_space_prefix);
    md
}
