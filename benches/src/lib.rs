//! kiln's serving benchmarks: the `kiln-bench` binary (`src/bin/kiln-bench/`) that
//! `cargo xtask bench` runs. Criterion keeps the kernel micro-benchmarks, next to the crates
//! they measure: `cargo bench -p kiln-tensor --bench kernels` and
//! `cargo bench -p kiln-tokenizer --bench tokenizer_encode`.
