//! kiln's dequantization against `gguf.quants.dequantize`, bit for bit, on the fixtures
//! `scripts/make_quant_fixtures.py` wrote (blocks from gemma-3-270m Q4_K_M for Q4_K, Q6_K,
//! Q5_0 and Q8_0; random blocks for the formats no local file has, and gguf's own MXFP4
//! quantizer's; kiln's FP8 against torch's `float8_e4m3fn`; see `manifest.json`):
//! the CPU reference, and the device's embedding gather, which dequantizes in the kernel.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::gpus;
use kiln_tensor::{DType, Device, Recorder, Tensor};

macro_rules! fixture {
    ($dtype:ident) => {
        (
            DType::$dtype,
            include_bytes!(concat!("fixtures/quant/", stringify!($dtype), ".blocks")).as_slice(),
            include_bytes!(concat!("fixtures/quant/", stringify!($dtype), ".f32")).as_slice(),
        )
    };
}

fn fixtures() -> [(DType, &'static [u8], &'static [u8]); 11] {
    [
        fixture!(Q4_K),
        fixture!(Q6_K),
        fixture!(Q5_0),
        fixture!(Q8_0),
        fixture!(Q2_K),
        fixture!(Q3_K),
        fixture!(Q5_K),
        fixture!(Q5_1),
        fixture!(BF16),
        fixture!(MXFP4),
        fixture!(FP8),
    ]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The fixture's values, and a tensor of its blocks with one block a row (32 elements a row
/// for BF16).
fn load(dev: &Device, dtype: DType, blocks: &[u8], values: &[u8]) -> (Vec<f32>, Tensor) {
    let want: Vec<f32> = values
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let cols = dtype.block_elems().max(32);
    let t = Tensor::from_bytes(dev, dtype, &[want.len() / cols, cols], blocks).unwrap();
    (want, t)
}

#[test]
fn cpu_dequantization_is_bit_identical_to_gguf_py() {
    for (dtype, blocks, values) in fixtures() {
        let (want, t) = load(&Device::reference(), dtype, blocks, values);
        assert!(want.len() >= 1536, "{dtype:?}: fixture too small");
        let got = t.to_f32_vec().unwrap();
        assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        if dtype.is_quantized() {
            let mut out = vec![0f32; want.len()];
            kiln_tensor::dequantize(dtype, blocks, &mut out).unwrap();
            assert_eq!(bits(&out), bits(&want), "{dtype:?} dequantize");
        }
    }
}

#[test]
fn device_gather_and_readback_match_gguf_py() {
    for (name, dev) in gpus() {
        for (dtype, blocks, values) in fixtures() {
            let (want, t) = load(&dev, dtype, blocks, values);
            assert_eq!(t.to_bytes().unwrap(), blocks, "{name} {dtype:?} bytes");
            let ids: Vec<u32> = (0..t.rows() as u32).rev().collect();
            let mut rec = Recorder::new(&dev);
            let e = rec.embedding(&t, &ids).unwrap();
            rec.submit().unwrap();
            let got = e.to_f32_vec().unwrap();
            let cols = t.cols();
            for (i, &id) in ids.iter().enumerate() {
                let id = id as usize;
                assert_eq!(
                    bits(&got[i * cols..(i + 1) * cols]),
                    bits(&want[id * cols..(id + 1) * cols]),
                    "{name} {dtype:?} row {id}"
                );
            }
        }
    }
}

#[test]
fn fp8_blocks_with_a_nan_code_or_a_non_finite_scale_are_refused() {
    let (_, blocks, _) = fixture!(FP8);
    for (name, dev) in std::iter::once(("reference", Device::reference())).chain(gpus()) {
        let mut nan = blocks[..36].to_vec();
        nan[4 + 5] = 0xff;
        let err = Tensor::from_bytes(&dev, DType::FP8, &[1, 32], &nan).unwrap_err();
        assert!(
            err.to_string().contains("NaN code at element 5"),
            "{name}: {err}"
        );
        let mut inf = blocks[..36].to_vec();
        inf[..4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        let err = Tensor::from_bytes(&dev, DType::FP8, &[1, 32], &inf).unwrap_err();
        assert!(
            err.to_string().contains("non-finite scale"),
            "{name}: {err}"
        );
    }
}
