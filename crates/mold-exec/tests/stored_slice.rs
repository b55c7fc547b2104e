//! The bytes a staged load copies to the GPU ([`Checkpoint::stored_slice`]) are the slice
//! the host path reads ([`Checkpoint::read_slice`]) for any rows and columns, in every dtype
//! a checkpoint stores; an FP8 tensor (scaled on the host) is left to the host path.

mod common;

use candle_core::{DType, Device, Tensor};
use common::assert_same;
use mold_exec::checkpoint::Checkpoint;
use proptest::prelude::*;
use std::collections::HashMap;
use std::ops::Range;

fn ranges(n: usize, cuts: &[usize]) -> Vec<Range<usize>> {
    // Sorted cut points in 0..=n, taken pairwise: ranges in order, some empty.
    let mut c: Vec<usize> = cuts.iter().map(|x| x % (n + 1)).collect();
    c.sort_unstable();
    c.chunks(2)
        .filter(|p| p.len() == 2)
        .map(|p| p[0]..p[1])
        .collect()
}

fn checkpoint(dir: &std::path::Path, rows: usize, cols: usize, dtype: DType) -> Checkpoint {
    let v: Vec<f32> = (0..rows * cols).map(|i| i as f32 * 0.25 - 3.0).collect();
    let w = Tensor::from_vec(v, (rows, cols), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let b = Tensor::arange(0f32, rows as f32, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let path = dir.join("w.safetensors");
    let t: HashMap<String, Tensor> = [("w".to_string(), w), ("b".to_string(), b)].into();
    candle_core::safetensors::save(&t, &path).unwrap();
    Checkpoint::open(&path).unwrap()
}

fn staged_bytes(
    ck: &Checkpoint,
    name: &str,
    rows: Option<&[Range<usize>]>,
    cols: Option<&[Range<usize>]>,
) -> Tensor {
    let sel = ck
        .stored_slice(name, rows, cols)
        .unwrap()
        .expect("a plain slice");
    let bytes: Vec<u8> = sel.pieces.concat();
    assert_eq!(bytes.len(), sel.len());
    Tensor::from_raw_buffer(&bytes, sel.dtype, &sel.shape, &Device::Cpu).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn staged_bytes_are_the_host_slice(
        rows in 1usize..12,
        cols in 1usize..12,
        dt in 0usize..3,
        row_cuts in proptest::collection::vec(0usize..64, 0..6),
        col_cuts in proptest::collection::vec(0usize..64, 0..6),
        whole_rows in any::<bool>(),
        whole_cols in any::<bool>(),
    ) {
        let dtype = [DType::BF16, DType::F16, DType::F32][dt];
        let dir = tempfile::tempdir().unwrap();
        let ck = checkpoint(dir.path(), rows, cols, dtype);
        let r = ranges(rows, &row_cuts);
        let c = ranges(cols, &col_cuts);
        let r = (!whole_rows).then_some(r.as_slice());
        let c = (!whole_cols).then_some(c.as_slice());
        assert_same(&staged_bytes(&ck, "w", r, c), &ck.read_slice("w", r, c, dtype).unwrap(), "w");
        assert_same(&staged_bytes(&ck, "b", r, None), &ck.read_slice("b", r, None, dtype).unwrap(), "b");
    }
}

/// Out-of-bounds rows are refused as the host path refuses them; an FP8 tensor and a
/// tensor the checkpoint lacks are not staged.
#[test]
fn refusals_and_host_only_tensors() {
    let past_the_end = std::slice::from_ref(&(2..5));
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(dir.path(), 4, 3, DType::BF16);
    let e = ck
        .stored_slice("w", Some(past_the_end), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("out of bounds"), "{e}");
    assert!(ck
        .read_slice("w", Some(past_the_end), None, DType::BF16)
        .is_err());
    assert!(ck.stored_slice("nope", None, None).unwrap().is_none());
    let q = Tensor::ones((4, 3), DType::F32, &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    let path = dir.path().join("q.safetensors");
    let t: HashMap<String, Tensor> = [("q".to_string(), q)].into();
    candle_core::safetensors::save(&t, &path).unwrap();
    let ck = Checkpoint::open(&path).unwrap();
    assert!(ck.stored_slice("q", None, None).unwrap().is_none());
}
