//! The raw buffers transfers read and write: a contiguous CUDA tensor's address and
//! size, and new uninitialised tensors for a transfer to fill (NCCL's hand-off receives
//! and chunked sums, the copy engines' all-to-alls in [`super::copy_engine`]).

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc;
use candle_core::cuda::CudaDevice;
use candle_core::{CudaStorage, DType, Result, Shape, Storage, Tensor};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

/// The address of a contiguous CUDA tensor's first element and its size in bytes.
///
/// The pointer outlives the storage guard: the caller keeps `t` alive until the transfer
/// that uses it has finished (it waits for it), and nothing writes `t` meanwhile.
pub(crate) fn address(t: &Tensor, stream: &CudaStream) -> Result<(CUdeviceptr, usize)> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        candle_core::bail!("transfer buffer: a tensor is not on a GPU");
    };
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("transfer buffer: not contiguous".into()))?;
    macro_rules! at {
        ($ty:ty) => {{
            let v = cs.as_cuda_slice::<$ty>()?.slice(a..b);
            let (p, _guard) = v.device_ptr(stream);
            (p, (b - a) * std::mem::size_of::<$ty>())
        }};
    }
    Ok(match cs.dtype() {
        DType::BF16 => at!(half::bf16),
        DType::F16 => at!(half::f16),
        DType::F32 => at!(f32),
        DType::F64 => at!(f64),
        DType::U32 => at!(u32),
        DType::I64 => at!(i64),
        DType::U8 => at!(u8),
        DType::F8E4M3 => at!(float8::F8E4M3),
        dt => candle_core::bail!("transfer buffer: unsupported dtype {dt:?}"),
    })
}

/// A new tensor of `shape` and `dtype` on `dev` (not initialised) and its address and
/// size in bytes, for a transfer to fill.
pub(crate) fn uninit(
    dev: &CudaDevice,
    stream: &CudaStream,
    dtype: DType,
    shape: &Shape,
) -> Result<(Tensor, CUdeviceptr, usize)> {
    let n = shape.elem_count();
    macro_rules! mk {
        ($ty:ty) => {{
            // SAFETY: every byte is written by the transfer that fills it (a receive, a
            // sum), which is ordered before anyone reads the tensor.
            let mut s = unsafe { dev.alloc::<$ty>(n) }?;
            let p = {
                let (p, _guard) = s.device_ptr_mut(stream);
                p
            };
            (
                CudaStorage::wrap_cuda_slice(s, dev.clone()),
                p,
                n * std::mem::size_of::<$ty>(),
            )
        }};
    }
    let (storage, p, bytes) = match dtype {
        DType::BF16 => mk!(half::bf16),
        DType::F16 => mk!(half::f16),
        DType::F32 => mk!(f32),
        DType::F64 => mk!(f64),
        DType::U32 => mk!(u32),
        DType::I64 => mk!(i64),
        DType::U8 => mk!(u8),
        DType::F8E4M3 => mk!(float8::F8E4M3),
        dt => candle_core::bail!("transfer buffer: unsupported dtype {dt:?}"),
    };
    let t = Tensor::from_storage(
        Storage::Cuda(storage),
        shape.clone(),
        candle_core::op::BackpropOp::none(),
        false,
    );
    Ok((t, p, bytes))
}
