//! Softmax over the last dimension of long rows (the FLUX autoencoder's mid attention: one
//! head of 512 channels over all 16384 pixels of a 1024² image, beyond cuDNN's fused
//! attention). On CUDA, for contiguous bf16/f16 rows of a multiple of 8, mold's kernel
//! (`kernels/softmax.cu`: a row per block, read and written once up to 32768 elements —
//! 256 threads × 8 elements × 16 vectors in registers — and read twice beyond); elsewhere
//! candle's `softmax_last_dim`.

use super::ops::Kernels;
use candle_core::{DType, Tensor, D};

type CResult<T> = candle_core::Result<T>;

/// `softmax(x)` over the last dimension.
pub fn softmax_last_dim(x: &Tensor, k: Kernels) -> CResult<Tensor> {
    let n = x.dim(D::Minus1)?;
    let supported = cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && x.is_contiguous()
        && (x.layout().start_offset() * x.dtype().size_in_bytes()).is_multiple_of(16)
        && n.is_multiple_of(8)
        && n > 0
        && n <= i32::MAX as usize;
    if k.use_fused(supported, "softmax")? {
        return cuda::softmax(x);
    }
    candle_nn::ops::softmax_last_dim(x)
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::CResult;
    use candle_core::Tensor;
    // Never reached: `supported` is false without the `cuda` feature.
    pub fn softmax(_: &Tensor) -> CResult<Tensor> {
        candle_core::bail!("mold's softmax kernel needs a CUDA build")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::CResult;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaDType, CudaStorage, WrapErr};
    use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor, D};
    use half::{bf16, f16};

    const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/softmax.fatbin"));
    const MODULE: &str = "mold_softmax";

    struct Softmax;

    impl Softmax {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let n = xl.shape().dim(D::Minus1)?;
            let rows = xl.shape().elem_count() / n;
            let suffix = match x.dtype() {
                DType::BF16 => "bf16",
                _ => "f16",
            };
            let name = match [1, 2, 4, 8, 16].into_iter().find(|v| 256 * 8 * v >= n) {
                Some(vpt) => format!("mold_softmax_v{vpt}_{suffix}"),
                None => format!("mold_softmax_long_{suffix}"),
            };
            let f = dev
                .get_or_load_custom_fatbin(&name, MODULE, FATBIN)?
                .into_cuda_function();
            // SAFETY: every element of every row is written.
            let y = unsafe { dev.alloc::<T>(rows * n)? };
            let xv = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
            let n32 = n as i32;
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv).arg(&y).arg(&n32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    impl CustomOp1 for Softmax {
        fn name(&self) -> &'static str {
            "mold-softmax"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's softmax kernel runs on CUDA only")
        }
        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl),
                DType::F16 => self.run::<f16>(x, xl),
                dt => candle_core::bail!("mold softmax: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn softmax(x: &Tensor) -> CResult<Tensor> {
        x.apply_op1_no_bwd(&Softmax)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// On the CPU it is candle's softmax (what the CUDA kernel is checked against on GPUs).
    #[test]
    fn cpu_softmax_is_candles() {
        let x = Tensor::arange(0f32, 48., &Device::Cpu)
            .unwrap()
            .reshape((3, 16))
            .unwrap();
        let got = softmax_last_dim(&x, Kernels::Auto).unwrap();
        let want = candle_nn::ops::softmax_last_dim(&x).unwrap();
        let d = (got - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(d, 0.0);
    }
}
