#![doc = include_str!("../README.md")]

mod agents;
mod anthropic;
mod convert;
mod error;
mod openai;
mod respond;
mod responses;
mod responses_out;
mod server;
mod store;
mod tokenize;
mod turn;

pub use error::ErrorReply;
pub use server::{HttpError, HttpServer, REQUEST_ID};
