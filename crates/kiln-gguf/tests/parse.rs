//! Parser tests over files built with `GgufWriter` and hand-made broken ones.

use kiln_gguf::{
    GgmlType, GgufError, GgufFile, GgufWriter, MetadataArray, MetadataValue, ValueType,
};
use proptest::prelude::*;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn every_value_type() -> Vec<(&'static str, MetadataValue)> {
    vec![
        ("t.u8", MetadataValue::U8(200)),
        ("t.i8", MetadataValue::I8(-100)),
        ("t.u16", MetadataValue::U16(60_000)),
        ("t.i16", MetadataValue::I16(-30_000)),
        ("t.u32", MetadataValue::U32(4_000_000_000)),
        ("t.i32", MetadataValue::I32(-2_000_000_000)),
        ("t.f32", MetadataValue::F32(1.5)),
        ("t.bool", MetadataValue::Bool(true)),
        ("t.string", MetadataValue::String("héllo ▁ 🎉".into())),
        ("t.u64", MetadataValue::U64(u64::MAX)),
        ("t.i64", MetadataValue::I64(i64::MIN)),
        ("t.f64", MetadataValue::F64(-2.25)),
        ("t.arr.u8", vec![1u8, 2, 3].into()),
        ("t.arr.i8", vec![-1i8, 2].into()),
        ("t.arr.u16", vec![1u16, 65535].into()),
        ("t.arr.i16", vec![-1i16].into()),
        ("t.arr.u32", vec![7u32; 5].into()),
        ("t.arr.i32", vec![-7i32, 3].into()),
        ("t.arr.f32", vec![0.5f32, -0.25].into()),
        ("t.arr.bool", vec![true, false, true].into()),
        ("t.arr.string", vec!["a", "", "ü"].into()),
        ("t.arr.u64", vec![u64::MAX, 0].into()),
        ("t.arr.i64", vec![i64::MIN].into()),
        ("t.arr.f64", vec![1e300f64].into()),
        (
            "t.arr.empty",
            MetadataValue::Array(MetadataArray::String(vec![])),
        ),
        (
            "t.arr.nested",
            MetadataValue::Array(MetadataArray::Array(vec![
                MetadataArray::U32(vec![1, 2]),
                MetadataArray::String(vec!["x".into()]),
                MetadataArray::Array(vec![MetadataArray::Bool(vec![false])]),
            ])),
        ),
    ]
}

#[test]
fn every_value_type_round_trips() -> TestResult {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_type() {
        w.metadata(k, v);
    }
    let file = GgufFile::from_bytes(&w.to_bytes()?)?;
    let got: Vec<(&str, &MetadataValue)> = file.metadata().iter().collect();
    let want = every_value_type();
    assert_eq!(got.len(), want.len());
    for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
        assert_eq!(gk, wk);
        assert_eq!(*gv, wv, "value of {wk}");
    }
    assert_eq!(
        file.metadata()
            .get("t.arr.nested")
            .map(MetadataValue::value_type),
        Some(ValueType::Array)
    );
    Ok(())
}

#[test]
fn version_2_files_parse() -> TestResult {
    let mut w = GgufWriter::new().with_version(2);
    w.metadata("k", 1u32);
    let file = GgufFile::from_bytes(&w.to_bytes()?)?;
    assert_eq!(file.version(), 2);
    assert_eq!(file.metadata().get_u32("k")?, Some(1));
    Ok(())
}

#[test]
fn tensor_offsets_honour_alignment() -> TestResult {
    for alignment in [1u32, 8, 32, 64, 4096] {
        let mut w = GgufWriter::new();
        w.metadata("general.alignment", alignment)
            .tensor("a", &[3], GgmlType::F32, vec![1; 12])
            .tensor("b", &[32, 2], GgmlType::Q8_0, vec![2; 68])
            .tensor("c", &[64], GgmlType::Q4_0, vec![3; 36])
            .tensor("d", &[32], GgmlType::Q4_1, vec![4; 20])
            .tensor("e", &[5, 1, 1, 2], GgmlType::F16, vec![5; 20]);
        let bytes = w.to_bytes()?;
        let file = GgufFile::from_bytes(&bytes)?;
        assert_eq!(file.alignment(), u64::from(alignment));
        assert_eq!(file.data_offset() % u64::from(alignment), 0);
        for (t, fill) in file.tensors().iter().zip(1u8..) {
            assert_eq!(t.offset % u64::from(alignment), 0, "{}", t.name);
            let data = file.tensor_data(&bytes, t)?;
            assert!(data.iter().all(|&b| b == fill), "{}", t.name);
        }
        let e = file.tensor("e").ok_or("no e")?;
        assert_eq!(
            (e.dims.clone(), e.n_elements, e.byte_size),
            (vec![5, 1, 1, 2], 10, Some(20))
        );
    }
    Ok(())
}

#[test]
fn unknown_layouts_are_named_and_parsed_without_a_size() -> TestResult {
    let mut w = GgufWriter::new();
    w.tensor("iq", &[256], GgmlType(16), vec![0; 66]);
    let bytes = w.to_bytes()?;
    let file = GgufFile::from_bytes(&bytes)?;
    let t = file.tensor("iq").ok_or("no iq")?;
    assert_eq!(t.ggml_type.to_string(), "IQ2_XXS");
    assert_eq!(t.byte_size, None);
    let err = file
        .tensor_data(&bytes, t)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("size of ggml type IQ2_XXS is not known"),
        "{err}"
    );
    Ok(())
}

fn err_of(bytes: &[u8]) -> String {
    match GgufFile::from_bytes(bytes) {
        Ok(_) => String::from("parsed"),
        Err(e) => e.to_string(),
    }
}

fn header(version: u32, tensors: u64, kvs: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&tensors.to_le_bytes());
    b.extend_from_slice(&kvs.to_le_bytes());
    b
}

fn push_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

#[test]
fn bad_magic_is_reported() {
    let mut b = header(3, 0, 0);
    b[..4].copy_from_slice(b"GGML");
    assert_eq!(
        err_of(&b),
        "<bytes>: not a GGUF file: magic is [47, 47, 4d, 4c], expected \"GGUF\""
    );
    assert!(err_of(b"GG").contains("truncated at byte 0 reading magic"));
}

#[test]
fn unsupported_versions_are_reported() {
    for v in [0u32, 1, 4, 0x0300_0000] {
        let msg = err_of(&header(v, 0, 0));
        assert!(
            msg.contains(&format!("unsupported GGUF version {v}")),
            "{msg}"
        );
    }
}

#[test]
fn every_truncation_of_a_valid_file_is_an_error() -> TestResult {
    let mut w = GgufWriter::new();
    for (k, v) in every_value_type() {
        w.metadata(k, v);
    }
    w.tensor("t", &[32], GgmlType::Q8_0, vec![9; 34]);
    let bytes = w.to_bytes()?;
    GgufFile::from_bytes(&bytes)?;
    for cut in 0..bytes.len() {
        let Err(e) = GgufFile::from_bytes(&bytes[..cut]) else {
            return Err(format!("prefix of {cut} bytes parsed").into());
        };
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::Malformed { .. }),
            "cut {cut}: {e}"
        );
    }
    Ok(())
}

#[test]
fn absurd_counts_fail_before_allocating() {
    let msg = err_of(&header(3, u64::MAX, 0));
    assert!(msg.contains("reading tensor count of header"), "{msg}");
    let msg = err_of(&header(3, 0, 1 << 60));
    assert!(msg.contains("reading metadata count"), "{msg}");

    // A string length of 2^62.
    let mut b = header(3, 0, 1);
    b.extend_from_slice(&(1u64 << 62).to_le_bytes());
    b.extend_from_slice(&[0; 8]);
    let msg = err_of(&b);
    assert!(msg.contains("needs 4611686018427387904 bytes"), "{msg}");

    // An array of 2^61 u32 elements, and of 2^60 strings.
    for (tag, what) in [(4u32, "u32"), (8, "string")] {
        let mut b = header(3, 0, 1);
        push_str(&mut b, "big");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&tag.to_le_bytes());
        b.extend_from_slice(&(1u64 << 61).to_le_bytes());
        let msg = err_of(&b);
        assert!(
            msg.contains("array length of metadata key `big`"),
            "{what}: {msg}"
        );
    }
}

#[test]
fn deeply_nested_arrays_are_rejected() {
    let mut b = header(3, 0, 1);
    push_str(&mut b, "deep");
    b.extend_from_slice(&9u32.to_le_bytes());
    for _ in 0..100 {
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
    }
    b.extend_from_slice(&[0; 64]);
    let msg = err_of(&b);
    assert!(msg.contains("arrays nested deeper than 8 levels"), "{msg}");
}

fn one_kv(tag: u32, payload: &[u8]) -> Vec<u8> {
    let mut b = header(3, 0, 1);
    push_str(&mut b, "k");
    b.extend_from_slice(&tag.to_le_bytes());
    b.extend_from_slice(payload);
    b
}

#[test]
fn malformed_values_are_reported() {
    assert!(
        err_of(&one_kv(13, &[0; 8]))
            .contains("value type of metadata key `k`: unknown value type 13")
    );
    assert!(err_of(&one_kv(7, &[2])).contains("byte 2 is neither 0 nor 1"));
    let mut s = 2u64.to_le_bytes().to_vec();
    s.extend_from_slice(&[0xff, 0xfe]);
    assert!(err_of(&one_kv(8, &s)).contains("string of metadata key `k`: not valid UTF-8"));

    let mut b = header(3, 0, 2);
    for _ in 0..2 {
        push_str(&mut b, "dup");
        b.extend_from_slice(&0u32.to_le_bytes());
        b.push(1);
    }
    assert!(err_of(&b).contains("key of metadata key `dup`: appears twice"));
}

#[test]
fn malformed_tensor_infos_are_reported() -> TestResult {
    let mut w = GgufWriter::new();
    w.metadata("general.alignment", 48u32);
    let w_bytes = w.to_bytes();
    assert!(
        w_bytes.is_err(),
        "writer refuses a non-power-of-two alignment"
    );

    let tensor_file = |n_dims: u32, dims: &[u64], ty: u32, offset: u64, data: usize| {
        let mut b = header(3, 1, 0);
        push_str(&mut b, "t");
        b.extend_from_slice(&n_dims.to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend(std::iter::repeat_n(0u8, data));
        b
    };
    assert_eq!(err_of(&tensor_file(1, &[4], 0, 0, 16)), "parsed");
    assert!(err_of(&tensor_file(5, &[1; 5], 0, 0, 4)).contains("5 dimensions, ggml has at most 4"));
    assert!(
        err_of(&tensor_file(1, &[4], 0, 0, 15))
            .contains("16 bytes of data at byte 64 run past the end of the 79-byte file")
    );
    assert!(
        err_of(&tensor_file(1, &[4], 0, 8, 64))
            .contains("data offset 8 is not a multiple of the alignment 32")
    );
    assert!(
        err_of(&tensor_file(1, &[33], 3, 0, 64))
            .contains("first dimension 33 is not a multiple of the Q4_1 block size 32")
    );
    assert!(err_of(&tensor_file(2, &[u64::MAX, 2], 0, 0, 0)).contains("element count overflows"));

    let mut b = header(3, 0, 1);
    push_str(&mut b, "general.alignment");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&48u32.to_le_bytes());
    assert!(err_of(&b).contains("general.alignment"), "{}", err_of(&b));
    Ok(())
}

#[test]
fn open_reads_a_file_and_names_it_in_errors() -> TestResult {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let good = dir.join("good.gguf");
    let mut w = GgufWriter::new();
    w.metadata("a", "b")
        .tensor("t", &[2], GgmlType::F32, vec![0; 8]);
    std::fs::write(&good, w.to_bytes()?)?;
    let file = GgufFile::open(&good)?;
    assert_eq!(file.metadata().get_str("a")?, Some("b"));
    assert_eq!(file.source(), good.display().to_string());

    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"nope")?;
    let msg = GgufFile::open(&bad)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        msg.starts_with(&bad.display().to_string()) && msg.contains("not a GGUF file"),
        "{msg}"
    );

    let missing = dir.join("missing.gguf");
    let msg = GgufFile::open(&missing)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("missing.gguf: cannot read"), "{msg}");
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_after_a_header_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..256), t in 0u64..4, k in 0u64..4) {
        let mut b = header(3, t, k);
        b.extend_from_slice(&tail);
        let _ = GgufFile::from_bytes(&b);
    }

    #[test]
    fn string_arrays_round_trip(items in proptest::collection::vec(".{0,12}", 0..20)) {
        let mut w = GgufWriter::new();
        w.metadata("s", MetadataValue::Array(MetadataArray::String(items.clone())));
        let bytes = w.to_bytes().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let file = GgufFile::from_bytes(&bytes).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(file.metadata().get_strings("s").ok().flatten(), Some(&items[..]));
    }
}
