//! Any byte string that parses as GGUF builds a `ModelConfig` or an error naming the file —
//! never a panic, a hang or a huge allocation — and a config that builds is usable.

#![no_main]

use kiln_gguf::GgufFile;
use kiln_model::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_reader(data, data.len() as u64, "fuzz.gguf") else {
        return;
    };
    match ModelConfig::from_gguf(&file) {
        Ok(cfg) => kiln_fuzz::check_config(&cfg),
        Err(e) => assert!(e.to_string().contains("fuzz.gguf"), "{e}"),
    }
});
