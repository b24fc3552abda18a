//! The default model's GGUF, parsed for real. Needs `cargo xtask fetch-model` first; fails (never
//! skips) when the file is absent.

use kiln_gguf::{GgmlType, GgufFile};

use kiln_testkit::default_model_path as model_path;

#[test]
fn default_model_head_parses() -> Result<(), Box<dyn std::error::Error>> {
    let path = model_path()?;
    let file = GgufFile::open(&path)?;
    assert_eq!(file.version(), 3);
    assert_eq!(file.architecture(), Some("llama"));
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.file_len(), 98_362_432);
    let md = file.metadata();
    assert_eq!(md.get_u32("llama.block_count")?, Some(30));
    assert_eq!(md.get_u32("llama.embedding_length")?, Some(576));
    assert_eq!(md.get_str("tokenizer.ggml.model")?, Some("gpt2"));
    assert_eq!(
        md.get_strings("tokenizer.ggml.tokens")?
            .map(<[String]>::len),
        Some(49152)
    );

    assert_eq!(file.tensors().len(), 272);
    let embd = file
        .tensor("token_embd.weight")
        .ok_or("no token_embd.weight")?;
    assert_eq!(embd.ggml_type, GgmlType::Q8_0);
    assert_eq!(embd.dims, [576, 49152]);
    assert_eq!(embd.byte_size, Some(576 * 49152 / 32 * 34));
    let norm = file
        .tensor("blk.0.attn_norm.weight")
        .ok_or("no attn_norm")?;
    assert_eq!(
        (norm.ggml_type, norm.byte_size),
        (GgmlType::F32, Some(576 * 4))
    );
    let q = file.tensor("blk.0.attn_q.weight").ok_or("no attn_q")?;
    assert_eq!(
        (q.ggml_type, q.dims.as_slice()),
        (GgmlType::Q4_1, &[576u64, 576][..])
    );

    // Tensor data tiles the data section without overlaps and ends inside the file.
    let mut ranges: Vec<_> = file
        .tensors()
        .iter()
        .filter_map(|t| t.data_range())
        .collect();
    assert_eq!(ranges.len(), 272, "every tensor type has a known size");
    ranges.sort_by_key(|r| r.start);
    assert_eq!(ranges.first().map(|r| r.start), Some(file.data_offset()));
    for pair in ranges.windows(2) {
        assert!(pair[0].end <= pair[1].start);
    }
    assert!(ranges.last().is_some_and(|r| r.end <= file.file_len()));

    // Whole-buffer parsing agrees with the streaming one.
    let bytes = std::fs::read(&path)?;
    let again = GgufFile::from_bytes(&bytes)?;
    assert_eq!(again.tensors(), file.tensors());
    assert_eq!(again.metadata(), file.metadata());
    assert_eq!(again.tensor_data(&bytes, norm)?.len(), 576 * 4);
    Ok(())
}
