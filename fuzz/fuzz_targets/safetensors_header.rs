//! Any byte string read as a safetensors file yields tensors or an error, never a panic or a
//! huge allocation; whatever parses names tensors whose data lies inside the input.

#![no_main]

use kiln_model::{SafetensorsFile, StDtype};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = SafetensorsFile::from_bytes("fuzz.safetensors".into(), data.to_vec()) else {
        return;
    };
    let names: Vec<String> = file.names().map(str::to_string).collect();
    for name in &names {
        assert!(file.contains(name));
        let (dtype, shape) = file.info(name).expect("listed tensors have infos");
        let size = match dtype {
            StDtype::F32 => 4,
            StDtype::F16 | StDtype::BF16 => 2,
            StDtype::Other => continue,
        };
        let elems = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).expect("a parsed shape does not overflow");
        assert!(elems.saturating_mul(size) <= data.len(), "{name}: data past the input");
    }
});
