//! Any byte string fed to the GGUF parser yields a value or an error, never a panic, a hang or
//! a huge allocation; whatever parses is internally consistent.

#![no_main]

use kiln_gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data) else {
        return;
    };
    let md = file.metadata();
    for (key, value) in md.iter() {
        assert!(md.get(key).is_some());
        let _ = value.describe();
        let _ = md.get_u64(key);
        let _ = md.get_strings(key);
        let _ = md.get_i64s(key);
    }
    assert_eq!(file.data_offset() % file.alignment(), 0);
    for t in file.tensors() {
        assert_eq!(file.tensor(&t.name).map(|x| x.offset), Some(t.offset));
        if let Some(range) = t.data_range() {
            assert!(range.end <= data.len() as u64);
            assert_eq!(
                file.tensor_data(data, t).map(<[u8]>::len).ok(),
                t.byte_size.map(|s| s as usize)
            );
        }
        let _ = t.ggml_type.to_string();
    }
});
