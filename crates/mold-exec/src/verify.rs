//! Comparing outputs: the relative error `--verify` checks, and a digest that says
//! whether two runs produced the same values exactly.

use crate::error::{ExecError, Result};
use candle_core::{DType, Device, Tensor};

/// Max relative error of `a` against the reference `b`:
/// `max_i |a_i - b_i| / max(max_i |b_i|, 1e-12)`, computed in f32 on the host. It is
/// relative to the reference's largest magnitude (not element-wise), so elements near
/// zero do not blow it up. A NaN or infinite value in either tensor is an error, never a
/// pass: candle's `max` skips NaN, so a broken output could otherwise compare as close.
pub fn max_relative_error(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        return Err(ExecError::Input(format!(
            "cannot compare shapes {:?} and {:?}",
            a.shape(),
            b.shape()
        )));
    }
    let host = |t: &Tensor| -> Result<Vec<f32>> {
        Ok(t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let (a, b) = (host(a)?, host(b)?);
    for (which, v) in [("the output", &a), ("the reference", &b)] {
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            let bad = v.iter().filter(|x| !x.is_finite()).count();
            return Err(ExecError::NonFinite {
                which,
                index: i,
                value: v[i],
                count: bad,
                total: v.len(),
            });
        }
    }
    let mut diff = 0f64;
    let mut scale = 0f64;
    for (x, y) in a.iter().zip(&b) {
        diff = diff.max((*x as f64 - *y as f64).abs());
        scale = scale.max((*y as f64).abs());
    }
    Ok(diff / scale.max(1e-12))
}

/// 64-bit FNV-1a.
pub fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// FNV-1a over a tensor's values as f32 bits: equal digests, equal outputs (printed so
/// that runs on different placements or process counts can be compared exactly).
pub fn digest(t: &Tensor) -> Result<u64> {
    let v = t
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(fnv1a(v.iter().flat_map(|x| x.to_bits().to_le_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    #[test]
    fn relative_to_the_references_largest_magnitude() {
        let e = max_relative_error(&t(&[1.0, 2.0, 4.1]), &t(&[1.0, 2.0, 4.0])).unwrap();
        assert!((e - 0.025).abs() < 1e-6, "{e}");
        assert_eq!(max_relative_error(&t(&[]), &t(&[])).unwrap(), 0.0);
    }

    #[test]
    fn nan_or_inf_in_either_tensor_is_refused() {
        for (a, b) in [
            (t(&[1.0, f32::NAN]), t(&[1.0, 2.0])),
            (t(&[1.0, 2.0]), t(&[f32::NAN, 2.0])),
            (t(&[f32::INFINITY, 2.0]), t(&[1.0, 2.0])),
            (t(&[f32::NAN, f32::NAN]), t(&[f32::NAN, f32::NAN])),
        ] {
            let e = max_relative_error(&a, &b).unwrap_err().to_string();
            assert!(e.contains("not finite"), "{e}");
        }
    }

    #[test]
    fn digest_tells_values_apart() {
        assert_eq!(
            digest(&t(&[1.0, 2.0])).unwrap(),
            digest(&t(&[1.0, 2.0])).unwrap()
        );
        assert_ne!(
            digest(&t(&[1.0, 2.0])).unwrap(),
            digest(&t(&[2.0, 1.0])).unwrap()
        );
        assert_eq!(fnv1a(*b""), 0xcbf2_9ce4_8422_2325);
    }
}
