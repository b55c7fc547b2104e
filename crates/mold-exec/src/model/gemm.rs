//! `x Wᵀ + b`, optionally followed by tanh-GELU, with the bias and the activation applied in
//! the matrix multiply's epilogue (cuBLASLt, CUDA builds) instead of a separate pass that
//! reads and writes the whole output again. Elsewhere — CPU, f32, shapes cuBLASLt's
//! epilogue does not take, `MOLD_KERNELS=mold|candle` — candle's matmul followed by
//! [`bias_act`] (the reference `--verify` compares against).

use super::ops::{bias_act, Kernels};
use candle_core::{Tensor, D};

type CResult<T> = candle_core::Result<T>;

/// `act(x Wᵀ + b)` for `x` `(…, k)`, `w` `(n, k)` (held without bias in `lin`), `b` `(n)`.
pub fn linear(
    x: &Tensor,
    lin: &candle_nn::Linear,
    b: &Tensor,
    gelu: bool,
    k: Kernels,
) -> CResult<Tensor> {
    let w = lin.weight();
    if k.uses_libraries() && epilogue_applies(x, w, b) {
        #[cfg(feature = "cuda")]
        return cuda::linear(x, w, b, gelu);
    }
    use candle_core::Module;
    bias_act(&lin.forward(x)?, Some(b), gelu, k)
}

/// `x Wᵀ` for `x` `(…, k)` and `w` `(n, k)`: candle's matmul (cuBLAS on CUDA).
pub fn matmul(x: &Tensor, w: &Tensor) -> CResult<Tensor> {
    match x.rank() {
        2 => x.matmul(&w.t()?),
        _ => {
            let (lead, k) = x.dims().split_at(x.rank() - 1);
            let out = x.reshape(((), k[0]))?.matmul(&w.t()?)?;
            let mut shape = lead.to_vec();
            shape.push(w.dim(0)?);
            out.reshape(shape)
        }
    }
}

/// `acc + x Wᵀ` (a residual and a product): on CUDA with the libraries allowed the product
/// is accumulated into `acc` in cuBLASLt (beta = 1), so the sum is never written twice;
/// `acc` is consumed and must not share its storage with another live tensor. Elsewhere
/// [`matmul`] then an add.
pub fn add_matmul(acc: Tensor, x: &Tensor, w: &Tensor, k: Kernels) -> CResult<Tensor> {
    if k.uses_libraries() && accumulate_applies(&acc, x, w) {
        accumulate(&acc, x, w)?;
        return Ok(acc);
    }
    acc + matmul(x, w)?
}

/// Whether cuBLASLt's epilogue runs this: CUDA bf16/f16, contiguous operands, sizes that
/// keep every row 16-byte aligned.
pub(crate) fn epilogue_applies(x: &Tensor, w: &Tensor, b: &Tensor) -> bool {
    matmul_applies(x, w)
        && b.dtype() == x.dtype()
        && w.dim(0).is_ok_and(|n| b.dims() == [n])
        && b.is_contiguous()
}

/// `x Wᵀ` in cuBLASLt: CUDA bf16/f16, contiguous operands, rows 16-byte aligned.
fn matmul_applies(x: &Tensor, w: &Tensor) -> bool {
    if !cfg!(feature = "cuda") || !x.device().is_cuda() {
        return false;
    }
    let half = matches!(
        x.dtype(),
        candle_core::DType::BF16 | candle_core::DType::F16
    );
    let (Ok(kx), Ok((n, kw))) = (x.dim(D::Minus1), w.dims2()) else {
        return false;
    };
    half && w.dtype() == x.dtype()
        && kx == kw
        && kx % 8 == 0
        && n % 8 == 0
        && x.is_contiguous()
        && w.is_contiguous()
}

/// Whether [`accumulate`] runs `acc += x Wᵀ` in cuBLASLt: as [`matmul_applies`], `acc`
/// the contiguous `(…, n)` output of an earlier product over the same rows.
pub(crate) fn accumulate_applies(acc: &Tensor, x: &Tensor, w: &Tensor) -> bool {
    let rows = |t: &Tensor| -> Option<usize> {
        t.dims()
            .split_last()
            .map(|(_, r)| r.iter().product::<usize>())
    };
    matmul_applies(x, w)
        && acc.dtype() == x.dtype()
        && acc.is_contiguous()
        && acc.dim(D::Minus1).ok() == w.dim(0).ok()
        && rows(acc) == rows(x)
        && acc.device().same_device(x.device())
}

/// `acc += x Wᵀ` in place (cuBLASLt with beta = 1, so the sum is never written twice).
/// Callers check [`accumulate_applies`]; without CUDA this is an error.
pub(crate) fn accumulate(acc: &Tensor, x: &Tensor, w: &Tensor) -> CResult<()> {
    #[cfg(feature = "cuda")]
    return acc.inplace_op3(x, w, &cuda::Accumulate);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (acc, x, w);
        candle_core::bail!("accumulating matmul needs a CUDA build")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::model::cells::Cells;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::cublaslt::{Activation, CudaBlasLT, Matmul, MatmulConfig};
    use candle_core::cuda::{CudaDType, CudaStorage};
    use candle_core::{CpuStorage, CustomOp3, DType, InplaceOp3, Layout, Shape, Tensor};
    use std::sync::{Arc, Mutex};

    type CResult<T> = candle_core::Result<T>;

    /// One cuBLASLt handle (and its workspace) per device and stream (per thread on a
    /// per-thread stream: [`Cells::for_stream`]). The map's lock only
    /// finds the key's cell: handles are created outside it, so the ranks of a multi-GPU plan
    /// create theirs at once rather than one after another.
    fn handle(dev: &candle_core::CudaDevice) -> CResult<Arc<Mutex<CudaBlasLT>>> {
        // A failure (e.g. no memory for the workspace) is tried again on the next call.
        static H: Cells<(usize, usize), CudaBlasLT> = Cells::new();
        let stream = dev.cuda_stream();
        let (device, raw) = (stream.context().ordinal(), stream.cu_stream() as usize);
        H.for_stream(device, raw, || {
            CudaBlasLT::new(stream.clone())
                .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt: {e:?}")))
        })
    }

    pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor, gelu: bool) -> CResult<Tensor> {
        x.apply_op3_no_bwd(w, b, &Epilogue { gelu })
    }

    struct Epilogue {
        gelu: bool,
    }

    impl CustomOp3 for Epilogue {
        fn name(&self) -> &'static str {
            "mold-linear-epilogue"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold-linear-epilogue runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<half::bf16>(x, xl, w, wl, b, bl),
                DType::F16 => self.run::<half::f16>(x, xl, w, wl, b, bl),
                dt => candle_core::bail!("mold-linear-epilogue: unsupported dtype {dt:?}"),
            }
        }
    }

    impl Epilogue {
        fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)>
        where
            CudaBlasLT: Matmul<T>,
        {
            let dims = xl.shape().dims();
            let k = *dims.last().unwrap_or(&0);
            let (n, kw) = wl.shape().dims2()?;
            if k != kw || !xl.is_contiguous() || !wl.is_contiguous() || !bl.is_contiguous() {
                candle_core::bail!("mold-linear-epilogue: operands do not agree");
            }
            let m = xl.shape().elem_count() / k.max(1);
            let dev = &x.device;
            let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
            let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
            let bs = b.as_cuda_slice::<T>()?.slice(bl.start_offset()..);
            // SAFETY: the matmul writes every element (beta = 0).
            let mut out = unsafe { dev.alloc::<T>(m * n)? };
            // Column-major view: out (n × m) = Wᵀ-as-stored (k × n)ᵀ · x (k × m).
            let cfg = MatmulConfig {
                transa: true,
                transb: false,
                transc: false,
                m: n as u64,
                n: m as u64,
                k: k as u64,
                alpha: 1.0,
                lda: k as i64,
                ldb: k as i64,
                beta: 0.0,
                ldc: n as i64,
                stride_a: None,
                stride_b: None,
                stride_c: None,
                stride_bias: None,
                batch_size: None,
            };
            let act = self.gelu.then_some(Activation::Gelu);
            let h = handle(dev)?;
            let h = h.lock().unwrap_or_else(|p| p.into_inner());
            // SAFETY: sizes and leading dimensions match the slices above.
            unsafe { h.matmul(cfg, &ws, &xs, &mut out, Some(&bs), act.as_ref()) }
                .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt matmul: {e:?}")))?;
            let mut shape = dims.to_vec();
            if let Some(l) = shape.last_mut() {
                *l = n;
            }
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from(shape),
            ))
        }
    }

    /// `acc += x Wᵀ` (beta = 1).
    pub(super) struct Accumulate;

    impl InplaceOp3 for Accumulate {
        fn name(&self) -> &'static str {
            "mold-linear-accumulate"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<()> {
            candle_core::bail!("mold-linear-accumulate runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            acc: &mut CudaStorage,
            al: &Layout,
            x: &CudaStorage,
            xl: &Layout,
            w: &CudaStorage,
            wl: &Layout,
        ) -> CResult<()> {
            match x.dtype() {
                DType::BF16 => accumulate::<half::bf16>(acc, al, x, xl, w, wl),
                DType::F16 => accumulate::<half::f16>(acc, al, x, xl, w, wl),
                dt => candle_core::bail!("mold-linear-accumulate: unsupported dtype {dt:?}"),
            }
        }
    }

    fn accumulate<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        acc: &mut CudaStorage,
        al: &Layout,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> CResult<()>
    where
        CudaBlasLT: Matmul<T>,
    {
        let k = *xl.shape().dims().last().unwrap_or(&0);
        let (n, kw) = wl.shape().dims2()?;
        let m = xl.shape().elem_count() / k.max(1);
        if k != kw
            || al.shape().elem_count() != m * n
            || !al.is_contiguous()
            || !xl.is_contiguous()
            || !wl.is_contiguous()
        {
            candle_core::bail!("mold-linear-accumulate: operands do not agree");
        }
        let dev = x.device.clone();
        let xs = x.as_cuda_slice::<T>()?.slice(xl.start_offset()..);
        let ws = w.as_cuda_slice::<T>()?.slice(wl.start_offset()..);
        let start = al.start_offset();
        let mut out = acc
            .as_cuda_slice_mut::<T>()?
            .slice_mut(start..start + m * n);
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: n as u64,
            n: m as u64,
            k: k as u64,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 1.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        let h = handle(&dev)?;
        let h = h.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: sizes and leading dimensions match the slices above; C and D are the
        // same buffer, which cuBLASLt allows when their layouts are equal.
        unsafe { h.matmul(cfg, &ws, &xs, &mut out, None, None) }
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt matmul: {e:?}")))
    }
}
