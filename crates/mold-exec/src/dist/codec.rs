//! Tensors on the wire: [`encode_shaped`] / [`decode_shaped`]. Decoding trusts nothing:
//! every count is checked against the bytes present and every product with
//! `checked_mul`, so a malformed message is refused in one line, never a panic or a huge
//! allocation.

use crate::error::{ExecError, Result};
use candle_core::{DType, Device, Tensor};

/// At most this many tensors in one message.
pub const MAX_TENSORS: usize = 1 << 16;
/// At most this many dimensions per tensor.
pub const MAX_RANK: usize = 8;

fn malformed(why: impl std::fmt::Display) -> ExecError {
    ExecError::Dist(format!(
        "malformed tensor message ({why}): the processes run different builds, or the \
         connection is corrupt"
    ))
}

fn dtype_code(d: DType) -> Result<u8> {
    Ok(match d {
        DType::F32 => 0,
        DType::BF16 => 1,
        DType::F16 => 2,
        DType::F64 => 3,
        DType::U32 => 4,
        DType::I64 => 5,
        DType::U8 => 6,
        other => {
            return Err(ExecError::Dist(format!(
                "cannot send a {other:?} tensor between processes"
            )))
        }
    })
}

/// Flat data of tensors (on the host): dtype and little-endian values.
fn encode_flat(out: &mut Vec<u8>, ts: &[Tensor]) -> Result<()> {
    out.extend_from_slice(&(ts.len() as u32).to_le_bytes());
    for t in ts {
        let t = t.flatten_all()?;
        out.push(dtype_code(t.dtype())?);
        out.push(0);
        out.extend_from_slice(&(t.elem_count() as u64).to_le_bytes());
        macro_rules! put {
            ($ty:ty) => {
                for v in t.to_vec1::<$ty>()? {
                    out.extend_from_slice(&v.to_le_bytes());
                }
            };
        }
        match t.dtype() {
            DType::F32 => put!(f32),
            DType::BF16 => put!(half::bf16),
            DType::F16 => put!(half::f16),
            DType::F64 => put!(f64),
            DType::U32 => put!(u32),
            DType::I64 => put!(i64),
            DType::U8 => put!(u8),
            other => return Err(ExecError::Dist(format!("cannot send a {other:?} tensor"))),
        }
    }
    Ok(())
}

/// Serialises tensors (any device; copied to the host): shapes, then dtype and
/// little-endian data of each.
pub fn encode_shaped(ts: &[&Tensor]) -> Result<Vec<u8>> {
    if ts.len() > MAX_TENSORS {
        return Err(ExecError::Dist(format!(
            "cannot send {} tensors in one message (at most {MAX_TENSORS})",
            ts.len()
        )));
    }
    let host: Vec<Tensor> = ts
        .iter()
        .map(|t| t.to_device(&Device::Cpu))
        .collect::<candle_core::Result<_>>()?;
    let bytes: usize = host
        .iter()
        .map(|t| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let mut out = Vec::with_capacity(bytes + 16 * host.len() + 8);
    out.extend_from_slice(&(host.len() as u32).to_le_bytes());
    for t in &host {
        if t.rank() > MAX_RANK {
            return Err(ExecError::Dist(format!(
                "cannot send a tensor of rank {} (at most {MAX_RANK})",
                t.rank()
            )));
        }
        out.push(t.rank() as u8);
        for d in t.dims() {
            out.extend_from_slice(&(*d as u64).to_le_bytes());
        }
    }
    encode_flat(&mut out, &host)?;
    Ok(out)
}

struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(malformed(format!(
                "needs {n} more bytes, has {}",
                self.0.len()
            )));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        b.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        b.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(b))
    }
    fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| malformed(format!("size {v} does not fit in memory")))
    }
}

/// Inverse of [`encode_shaped`]: the tensors, on the host.
pub fn decode_shaped(b: &[u8]) -> Result<Vec<Tensor>> {
    let mut c = Cursor(b);
    let n = c.u32()? as usize;
    // Each tensor takes at least 1 (rank) + 10 (dtype, pad, count) bytes.
    if n > MAX_TENSORS || n.saturating_mul(11) > b.len() {
        return Err(malformed(format!("{n} tensors in {} bytes", b.len())));
    }
    let mut shapes = Vec::with_capacity(n);
    for _ in 0..n {
        let rank = c.u8()? as usize;
        if rank > MAX_RANK {
            return Err(malformed(format!("rank {rank} (at most {MAX_RANK})")));
        }
        let mut dims = Vec::with_capacity(rank);
        for _ in 0..rank {
            dims.push(c.usize()?);
        }
        shapes.push(dims);
    }
    let m = c.u32()? as usize;
    if m != n {
        return Err(malformed(format!("{n} shapes but {m} tensors")));
    }
    let mut out = Vec::with_capacity(n);
    for dims in shapes {
        let code = c.u8()?;
        c.u8()?;
        let count = c.usize()?;
        let elems = dims
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .ok_or_else(|| malformed(format!("shape {dims:?} has too many elements")))?;
        if count != elems {
            return Err(malformed(format!(
                "shape {dims:?} has {elems} elements, the data {count}"
            )));
        }
        macro_rules! get {
            ($ty:ty, $w:expr) => {{
                let len = count
                    .checked_mul($w)
                    .ok_or_else(|| malformed(format!("{count} elements do not fit in memory")))?;
                let raw = c.take(len)?;
                let v: Vec<$ty> = raw
                    .chunks_exact($w)
                    .map(|ch| {
                        let mut a = [0u8; $w];
                        a.copy_from_slice(ch);
                        <$ty>::from_le_bytes(a)
                    })
                    .collect();
                Tensor::from_vec(v, dims.as_slice(), &Device::Cpu)?
            }};
        }
        out.push(match code {
            0 => get!(f32, 4),
            1 => get!(half::bf16, 2),
            2 => get!(half::f16, 2),
            3 => get!(f64, 8),
            4 => get!(u32, 4),
            5 => get!(i64, 8),
            6 => get!(u8, 1),
            _ => return Err(malformed(format!("unknown dtype code {code}"))),
        });
    }
    if !c.0.is_empty() {
        return Err(malformed(format!("{} bytes left over", c.0.len())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn tensors_round_trip_with_shape_and_dtype() {
        let a = Tensor::arange(0f32, 6.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = a.to_dtype(DType::BF16).unwrap();
        let c = Tensor::new(&[7u32], &Device::Cpu).unwrap();
        let back = decode_shaped(&encode_shaped(&[&a, &b, &c]).unwrap()).unwrap();
        assert_eq!(
            back[0].to_vec2::<f32>().unwrap(),
            a.to_vec2::<f32>().unwrap()
        );
        assert_eq!(back[1].dtype(), DType::BF16);
        assert_eq!(back[1].dims(), &[2, 3]);
        assert_eq!(back[2].to_vec1::<u32>().unwrap(), vec![7]);
    }

    /// A message of one tensor with the given dims, element count and no data.
    fn header(dims: &[u64], count: u64) -> Vec<u8> {
        let mut b = 1u32.to_le_bytes().to_vec();
        b.push(dims.len() as u8);
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&[0, 0]);
        b.extend_from_slice(&count.to_le_bytes());
        b
    }

    #[test]
    fn overflowing_or_lying_sizes_are_refused_in_one_line() {
        let cases: Vec<(Vec<u8>, &str)> = vec![
            // dims whose product overflows (wrapping would make it 0 or small).
            (header(&[1 << 32, 1 << 32, 4], 0), "too many elements"),
            // A product that fits but bytes (count × 4) overflow.
            (header(&[1 << 62], 1 << 62), "do not fit in memory"),
            // Plausible sizes without the data behind them.
            (header(&[1 << 20, 1 << 10], 1 << 30), "more bytes"),
            (header(&[2, 3], 7), "has 6 elements, the data 7"),
            // A huge tensor count with no bytes behind it.
            (u32::MAX.to_le_bytes().to_vec(), "tensors in 4 bytes"),
            ([vec![1, 0, 0, 0, 200], vec![0; 20]].concat(), "rank 200"),
        ];
        for (bytes, want) in cases {
            let e = decode_shaped(&bytes).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(!e.contains('\n'), "{e}");
        }
        let mut ok = encode_shaped(&[&Tensor::new(&[1f32], &Device::Cpu).unwrap()]).unwrap();
        ok.push(0);
        assert!(decode_shaped(&ok)
            .unwrap_err()
            .to_string()
            .contains("left over"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_shaped(&bytes);
        }

        #[test]
        fn a_corrupted_message_is_refused_or_decodes(
            vals in proptest::collection::vec(-1e3f32..1e3, 1..24),
            flip in any::<(usize, u8)>(),
        ) {
            let t = Tensor::new(vals.as_slice(), &Device::Cpu).unwrap();
            let mut b = encode_shaped(&[&t]).unwrap();
            let back = decode_shaped(&b).unwrap();
            prop_assert_eq!(back[0].to_vec1::<f32>().unwrap(), vals);
            let i = flip.0 % b.len();
            b[i] ^= flip.1 | 1;
            let _ = decode_shaped(&b);
        }
    }
}
