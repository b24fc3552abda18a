//! Benchmarks for kiln: criterion benches under `benches/`, and the `kiln-bench` binary
//! (`src/bin/kiln-bench/`) that `cargo xtask bench` runs.
