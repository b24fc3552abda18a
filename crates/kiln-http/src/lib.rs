#![doc = include_str!("../README.md")]

mod config;
mod convert;
mod error;
mod openai;
mod respond;
mod server;

pub use config::HttpConfig;
pub use error::ApiError;
pub use server::{HttpError, HttpServer, REQUEST_ID};
