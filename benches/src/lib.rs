//! Benchmarks for kiln (criterion benches under `benches/`).
