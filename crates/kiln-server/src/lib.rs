#![doc = include_str!("../README.md")]

mod config;
mod convert;
mod edge;
mod generation;
mod info;
mod kv_events;
mod metrics;
pub mod pb;
mod server;
mod status;

pub use config::ServerConfig;
pub use edge::REQUEST_ID;
pub use kv_events::{KvEventPublisher, KvEventsConfig, KvEventsError};
pub use server::{Server, ServerError};
