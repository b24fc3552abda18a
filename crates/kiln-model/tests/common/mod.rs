//! Shared test setup: the default model file and the devices under test.
#![allow(
    dead_code,
    unused_imports,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic
)]

pub mod golden;
pub mod tiny;
pub mod tolerance;

pub use kiln_testkit::{default_model as model_path, devices};
