//! Any text read as an HF `config.json` builds a `ModelConfig` or an error naming the file —
//! never a panic or a huge allocation — and a config that builds is usable.

#![no_main]

use kiln_model::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ModelConfig::from_hf_json("fuzz/config.json", text) {
        Ok(cfg) => kiln_fuzz::check_config(&cfg),
        Err(e) => assert!(e.to_string().contains("fuzz/config.json"), "{e}"),
    }
});
