//! The protobuf messages, clients and servers generated from `proto/kiln/v1/*.proto`.

#![allow(
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic,
    rust_2018_idioms,
    unreachable_pub
)]

tonic::include_proto!("kiln.v1");

/// The encoded `FileDescriptorSet` of the kiln protos, served by reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/kiln_descriptor.bin"));
