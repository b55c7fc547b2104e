//! FP8 products on CUDA: the per-token quantizing kernel (kernels/fp8.cu) and cuBLASLt's
//! FP8 matmul with per-row ("outer vector") scales on both operands, bias and GELU in its
//! epilogue.
//!
//! Layout, column-major as cuBLASLt sees it: `out (n × m) = W (k × n)ᵀ · x (k × m)`, the
//! "TN" layout FP8 products need; A's scales are the weight's (one per output feature),
//! B's the input's (one per token).

use super::{Fp8Rows, Fp8Weight};
use crate::model::cells::Cells;
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda::cudarc::driver::DeviceRepr;
use candle_core::cuda::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp1, Layout, Shape, Storage, Tensor, D};
use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

type CResult<T> = candle_core::Result<T>;

const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/fp8.fatbin"));
const MODULE: &str = "mold_fp8";
const THREADS: u32 = 256;
/// The longest row `mold_fp8_quantize_rows_vec` takes: 8 pieces of 8 values a thread.
const VEC_MAX_K: usize = 8 * 8 * THREADS as usize;
/// cuBLASLt's workspace (NVIDIA recommends 32 MiB on Hopper).
const WORKSPACE: usize = 32 << 20;

fn err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("FP8 {what}: {e:?}"))
}

fn suffix(dt: DType) -> CResult<&'static str> {
    Ok(match dt {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        dt => candle_core::bail!("FP8 products: unsupported compute dtype {dt:?}"),
    })
}

fn lt_type(dt: DType) -> CResult<sys::cudaDataType> {
    Ok(match dt {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        dt => candle_core::bail!("FP8 products: unsupported compute dtype {dt:?}"),
    })
}

/// A cuBLASLt handle and its workspace, one per device and stream.
struct Handle {
    h: sys::cublasLtHandle_t,
    ws: CudaSlice<u8>,
    /// Each product's descriptors and algorithm, made on its first run here.
    prepared: HashMap<ShapeKey, (Product, sys::cublasLtMatmulAlgo_t)>,
    /// The GPU's SMs (0 where it does not say), for [`super::sm_target`].
    sms: i32,
}

// SAFETY: a cuBLASLt handle may be used from any thread, one call at a time (the mutex).
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by lt::create_handle, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.h) };
    }
}

fn handle(dev: &CudaDevice) -> CResult<Arc<Mutex<Handle>>> {
    static H: Cells<(usize, usize), Handle> = Cells::new();
    let stream = dev.cuda_stream();
    let (device, raw) = (stream.context().ordinal(), stream.cu_stream() as usize);
    H.for_stream(device, raw, || {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| err("context", e))?;
        let h = lt::create_handle().map_err(|e| err("cuBLASLt handle", e))?;
        use candle_core::cuda::cudarc::driver::sys::CUdevice_attribute as A;
        let sms = stream
            .context()
            .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(0);
        // SAFETY: a workspace is scratch memory; cuBLASLt writes before it reads.
        match unsafe { stream.alloc::<u8>(WORKSPACE) } {
            Ok(ws) => Ok(Handle {
                h,
                ws,
                prepared: HashMap::new(),
                sms,
            }),
            Err(e) => {
                // SAFETY: just created, not shared.
                let _ = unsafe { lt::destroy_handle(h) };
                Err(err("cuBLASLt workspace", e))
            }
        }
    })
}

/// A product: device, m (tokens), n (output features), k, bias, GELU.
pub(crate) type ProductKey = (usize, usize, usize, usize, bool, bool);

/// Products cuBLASLt refused (a descriptor it does not take, as an older cuBLASLt without
/// outer-vector scales answers, or no algorithm), by device, shape and epilogue: with why.
/// Asked by the first real product of each kind (its scale pointers set: cuBLASLt answers
/// a heuristic query for outer-vector scales only with them).
fn refused() -> &'static Mutex<HashMap<ProductKey, String>> {
    static R: OnceLock<Mutex<HashMap<ProductKey, String>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// `(m, n, k)` of `x Wᵀ`: rows of `x`, the weight's output and input features.
pub(crate) fn shape_of(x: &Tensor, w: &Fp8Weight) -> (usize, usize, usize) {
    let (n, k) = w.dims2().unwrap_or((0, 0));
    (x.elem_count() / k.max(1), n, k)
}

fn epilogue_words(bias: bool, gelu: bool) -> &'static str {
    match (bias, gelu) {
        (true, true) => " and a bias+GELU epilogue",
        (true, false) => " and a bias epilogue",
        (false, true) => " and a GELU epilogue",
        _ => "",
    }
}

/// Whether this device multiplies FP8 through cuBLASLt with per-row scales for this product
/// (`(m, n, k)`) and epilogue: compute capability 8.9 or later, and cuBLASLt not having
/// refused such a product here before. `Err`: why not.
pub(crate) fn device_takes(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    bias: bool,
    gelu: bool,
) -> Result<(), String> {
    let ctx = dev.cuda_stream().context().clone();
    let ord = ctx.ordinal();
    // The capability is asked of the driver once per device, not per product.
    static CAPABLE: OnceLock<Mutex<HashMap<usize, Result<(), String>>>> = OnceLock::new();
    CAPABLE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(ord)
        .or_insert_with(|| match ctx.compute_capability() {
            Ok((major, minor)) if (major, minor) >= (8, 9) => Ok(()),
            Ok((major, minor)) => Err(format!(
                "cuda:{ord} (sm_{major}{minor}) has no FP8 tensor cores (sm_89 and later)"
            )),
            Err(e) => Err(format!("cuda:{ord}: compute capability: {e:?}")),
        })
        .clone()?;
    match refused()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&(ord, m, n, k, bias, gelu))
    {
        Some(why) => Err(why.clone()),
        None => Ok(()),
    }
}

/// Whether [`linear`] runs `act(x Wᵀ + b)`: bf16/f16 input on a GPU that takes FP8
/// products with this epilogue, contiguous operands on one device, `k` and `n` multiples of
/// 16 (FP8's alignment). `Err`: why not.
pub(crate) fn products_apply(
    x: &Tensor,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> Result<(), String> {
    let (Ok(kx), Ok((n, kw))) = (x.dim(D::Minus1), w.dims2()) else {
        return Err("operand shapes".into());
    };
    let candle_core::Device::Cuda(d) = x.device() else {
        return Err("not on a GPU".into());
    };
    if !matches!(x.dtype(), DType::BF16 | DType::F16) {
        return Err(format!("{:?} activations", x.dtype()));
    }
    if kx != kw || kx % 16 != 0 || n % 16 != 0 {
        return Err(format!(
            "a ({n}, {kw}) weight on {kx} input features: FP8 products need them equal and multiples of 16"
        ));
    }
    if x.elem_count() == 0 || n == 0 {
        return Err("an empty product".into());
    }
    if !x.is_contiguous() || !w.q.is_contiguous() || !w.scale.is_contiguous() {
        return Err("a non-contiguous operand".into());
    }
    if !w.q.device().same_device(x.device()) || !w.scale.device().same_device(x.device()) {
        return Err("the weight is on another device than its input".into());
    }
    if !b.is_none_or(|b| b.dtype() == x.dtype() && b.dims() == [n] && b.is_contiguous()) {
        return Err("the bias's dtype or shape".into());
    }
    device_takes(d, shape_of(x, w), b.is_some(), gelu)
}

/// Whether [`accumulate`] runs `acc += x Wᵀ`: as [`products_apply`], `acc` the contiguous
/// `(…, n)` output of an earlier product over the same rows.
pub(crate) fn accumulate_applies(acc: &Tensor, x: &Tensor, w: &Fp8Weight) -> bool {
    let rows = |t: &Tensor| t.elem_count() / t.dim(D::Minus1).unwrap_or(1).max(1);
    products_apply(x, w, None, false).is_ok()
        && acc.dtype() == x.dtype()
        && acc.is_contiguous()
        && acc.dim(D::Minus1).ok() == w.dims2().ok().map(|(n, _)| n)
        && rows(acc) == rows(x)
        && acc.device().same_device(x.device())
}

/// One product's cuBLASLt descriptors.
struct Product {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
}

impl Drop for Product {
    fn drop(&mut self) {
        // SAFETY: each made once in Product::new.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> CResult<()> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        v as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(|e| err("matmul attribute", e))
}

impl Product {
    /// `out (n × m) = act(scale_w · scale_x · Wᵀx + bias) + beta · out`, with cuBLASLt's
    /// fast accumulation where `fast_accum` and told to use `sm_target` SMs where given
    /// ([`sm_target`]); scale and bias pointers are set by [`run`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn new(
        m: usize,
        n: usize,
        k: usize,
        out: DType,
        bias: bool,
        gelu: bool,
        fast_accum: bool,
        sm_target: Option<i32>,
    ) -> CResult<Product> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(|e| err("matmul descriptor", e))?;
        let mk = |t, r, c, ld| lt::create_matrix_layout(t, r as u64, c as u64, ld as i64);
        let e4m3 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let a = mk(e4m3, k, n, k);
        let b = mk(e4m3, k, m, k);
        let c = mk(lt_type(out)?, n, m, n);
        let (a, b, c) = match (a, b, c) {
            (Ok(a), Ok(b), Ok(c)) => (a, b, c),
            (a, b, c) => {
                for l in [a, b, c].into_iter().flatten() {
                    let _ = lt::destroy_matrix_layout(l);
                }
                let _ = lt::destroy_matmul_desc(desc);
                return Err(err("matrix layout", "cuBLASLt refused a layout"));
            }
        };
        let p = Product { desc, a, b, c };
        // CUBLAS_OP_T, as cudarc's own cuBLASLt wrapper passes it.
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &1i32)?;
        // Outer-vector scales: a vector over op(A)'s rows (the weight's output features)
        // and one over op(B)'s columns (the tokens).
        let outer = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
        let epi = match (bias, gelu) {
            (false, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            (true, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            (true, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        };
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &epi)?;
        if fast_accum {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &1i8)?;
        }
        if let Some(sms) = sm_target {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms)?;
        }
        if bias {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &lt_type(out)?)?;
        }
        Ok(p)
    }
}

/// The input quantized per token: e4m3 values `(m, k)` (as bytes `Q`) and `m` scales.
fn quantize<Q: DeviceRepr>(
    dev: &CudaDevice,
    x: &CudaStorage,
    xl: &Layout,
    m: usize,
    k: usize,
) -> CResult<(CudaSlice<Q>, CudaSlice<f32>)> {
    let dt = x.dtype();
    // Rows of whole 16-byte pieces, 16-byte aligned, that a block's registers hold: read
    // once, 16 bytes at a time (the same values and scales as the plain kernel).
    let vec = k.is_multiple_of(8)
        && k <= VEC_MAX_K
        && (xl.start_offset() * dt.size_in_bytes()).is_multiple_of(16)
        && !super::options().plain_quantize;
    let name = if vec {
        "mold_fp8_quantize_rows_vec"
    } else {
        "mold_fp8_quantize_rows"
    };
    let f = dev
        .get_or_load_custom_fatbin(&format!("{name}_{}", suffix(dt)?), MODULE, FATBIN)?
        .into_cuda_function();
    // SAFETY: the kernel writes every element (`Q` is one byte: u8 or e4m3).
    debug_assert_eq!(std::mem::size_of::<Q>(), 1);
    let mut q = unsafe { dev.alloc::<Q>(m * k)? };
    let mut s = unsafe { dev.alloc::<f32>(m)? };
    let cfg = LaunchConfig {
        grid_dim: (m as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let kk = k as i32;
    let mut b = stream.launch_builder(&f);
    let (xb, xh);
    match dt {
        DType::BF16 => {
            xb = x.as_cuda_slice::<half::bf16>()?.slice(xl.start_offset()..);
            b.arg(&xb)
        }
        _ => {
            xh = x.as_cuda_slice::<half::f16>()?.slice(xl.start_offset()..);
            b.arg(&xh)
        }
    };
    b.arg(&mut q).arg(&mut s).arg(&kk);
    // SAFETY: the arguments match the kernel's signature; sizes as allocated.
    unsafe { b.launch(cfg) }.map_err(|e| err("quantize kernel", e))?;
    Ok((q, s))
}

type DevPtr = candle_core::cuda::cudarc::driver::sys::CUdeviceptr;

/// A product's input: as computed (quantized per token here, first), or quantized ahead:
/// its e4m3 values (the storage the custom op was given, not locked again) and its scales.
#[derive(Clone, Copy)]
enum Input<'a> {
    Dense(&'a CudaStorage, &'a Layout),
    Rows(&'a CudaStorage, &'a Layout, &'a Tensor),
}

/// Runs the product into `out` (`n × m`, column-major).
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    dev: &CudaDevice,
    x: Input,
    m: usize,
    w: &Fp8Weight,
    bias: Option<&Tensor>,
    gelu: bool,
    out: DevPtr,
    out_dt: DType,
    beta: f32,
) -> CResult<()> {
    let (n, k) = w.dims2()?;
    let stream = dev.cuda_stream();
    // The input's e4m3 values and per-token scales, and what keeps them alive.
    let quantized;
    let (rs, rqv, rsv);
    let ((x8_p, _g3), (sx_p, _g4)) = match x {
        Input::Dense(x, xl) => {
            quantized = quantize::<u8>(dev, x, xl, m, k)?;
            (
                quantized.0.device_ptr(&stream),
                quantized.1.device_ptr(&stream),
            )
        }
        Input::Rows(qs, ql, scale) => {
            rs = scale.storage_and_layout();
            let Storage::Cuda(ss) = &*rs.0 else {
                candle_core::bail!("FP8 products: a quantized input's scales are not on the GPU");
            };
            rqv = qs
                .as_cuda_slice::<float8::F8E4M3>()?
                .slice(ql.start_offset()..);
            rsv = ss.as_cuda_slice::<f32>()?.slice(rs.1.start_offset()..);
            (rqv.device_ptr(&stream), rsv.device_ptr(&stream))
        }
    };
    let (qs, ql) = w.q.storage_and_layout();
    let (ss, sl) = w.scale.storage_and_layout();
    let bs = bias.map(|b| b.storage_and_layout());
    let (Storage::Cuda(qs), Storage::Cuda(ss)) = (&*qs, &*ss) else {
        candle_core::bail!("FP8 products: a weight is not on the GPU");
    };
    let wq = qs
        .as_cuda_slice::<float8::F8E4M3>()?
        .slice(ql.start_offset()..);
    let wsc = ss.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
    // Anything cuBLASLt refuses before the launch is remembered for this product, which
    // then runs weight-only ([`super::linear`]).
    let ord = stream.context().ordinal();
    let refuse = |e: candle_core::Error| -> candle_core::Error {
        let why = format!(
            "cuBLASLt on cuda:{ord} offers no FP8 product with per-row scales{} ({m}×{n}×{k}): {e}",
            epilogue_words(bias.is_some(), gelu)
        );
        refused()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((ord, m, n, k, bias.is_some(), gelu), why.clone());
        candle_core::Error::Msg(why)
    };
    let (wq_p, _g1) = wq.device_ptr(&stream);
    let (ws_p, _g2) = wsc.device_ptr(&stream);
    let (bias_b, bias_h);
    let mut _g5 = None;
    let mut bias_p = None;
    if let Some((bstore, bl)) = &bs {
        let Storage::Cuda(bstore) = &**bstore else {
            candle_core::bail!("FP8 products: the bias is not on the GPU");
        };
        bias_p = Some(match out_dt {
            DType::BF16 => {
                bias_b = bstore
                    .as_cuda_slice::<half::bf16>()?
                    .slice(bl.start_offset()..);
                let (p, g) = bias_b.device_ptr(&stream);
                _g5 = Some(g);
                p
            }
            _ => {
                bias_h = bstore
                    .as_cuda_slice::<half::f16>()?
                    .slice(bl.start_offset()..);
                let (p, g) = bias_h.device_ptr(&stream);
                _g5 = Some(g);
                p
            }
        });
    }
    let h = handle(dev)?;
    let mut h = h.lock().unwrap_or_else(|p| p.into_inner());
    let Handle {
        h: lt_handle,
        ws,
        prepared,
        sms,
    } = &mut *h;
    let lt_handle = *lt_handle;
    // This call's operands; cuBLASLt answers a heuristic query for outer-vector scales only
    // with the scale pointers set.
    let point = |p: &Product| -> CResult<()> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        set_desc(p.desc, A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws_p)?;
        set_desc(p.desc, A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sx_p)?;
        if let Some(bp) = bias_p {
            set_desc(p.desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp)?;
        }
        Ok(())
    };
    // Each product's descriptors and algorithm are made once per handle (a step runs a few
    // hundred products of a dozen shapes), not once per product.
    let fast = super::options().fast_accumulation;
    let sm_target = super::sm_target(*sms, super::options().sm_carveout);
    let pk: ShapeKey = (
        m,
        n,
        k,
        out_dt == DType::BF16,
        bias.is_some(),
        gelu,
        fast,
        sm_target,
    );
    if let std::collections::hash_map::Entry::Vacant(e) = prepared.entry(pk) {
        let p =
            Product::new(m, n, k, out_dt, bias.is_some(), gelu, fast, sm_target).map_err(refuse)?;
        point(&p).map_err(refuse)?;
        let algo = choose(lt_handle, &p, pk, &stream).map_err(refuse)?;
        e.insert((p, algo));
    }
    let (p, algo) = &prepared[&pk];
    point(p).map_err(refuse)?;
    let alpha = 1f32;
    let (ws_ptr, _g6) = ws.device_ptr_mut(&stream);
    lt::matmul(
        lt_handle,
        p.desc,
        &alpha as *const f32 as *const c_void,
        &beta as *const f32 as *const c_void,
        wq_p as *const c_void,
        p.a,
        x8_p as *const c_void,
        p.b,
        out as *const c_void,
        p.c,
        out as *mut c_void,
        p.c,
        algo,
        ws_ptr as *mut c_void,
        WORKSPACE,
        stream.cu_stream() as sys::cudaStream_t,
    )
    .map_err(|e| err("cuBLASLt matmul", e))
}

/// A product's shape and epilogue on one device: m, n, k, bf16 output, bias, GELU, fast
/// accumulation, and the SMs cuBLASLt is told to target (where some are left out).
type ShapeKey = (usize, usize, usize, bool, bool, bool, bool, Option<i32>);

/// The algorithm for product `pk` on `stream`'s device: cuBLASLt's heuristic, asked once per
/// device and shape in a process. (For these products — FP8 with outer-vector scales — the
/// heuristic offered one candidate for each of FLUX.1-dev's shapes on an H200: a build that
/// timed up to eight on first use found none to compare; BENCHMARKS.md.)
unsafe fn choose(
    h: sys::cublasLtHandle_t,
    p: &Product,
    pk: ShapeKey,
    stream: &Arc<CudaStream>,
) -> CResult<sys::cublasLtMatmulAlgo_t> {
    type Key = (usize, ShapeKey);
    static ALGOS: OnceLock<Mutex<HashMap<Key, sys::cublasLtMatmulAlgo_t>>> = OnceLock::new();
    let key = (stream.context().ordinal(), pk);
    let algos = ALGOS.get_or_init(Default::default);
    if let Some(a) = algos.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return Ok(*a);
    }
    let pref = lt::create_matmul_pref().map_err(|e| err("matmul preference", e))?;
    let size = WORKSPACE;
    let r = lt::set_matmul_pref_attribute(
        pref,
        sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &size as *const usize as *const c_void,
        std::mem::size_of::<usize>(),
    )
    .and_then(|_| lt::get_matmul_algo_heuristic(h, p.desc, p.a, p.b, p.c, p.c, pref));
    let _ = lt::destroy_matmul_pref(pref);
    let algo = r.map_err(|e| err("no cuBLASLt algorithm", e))?.algo;
    algos
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, algo);
    Ok(algo)
}

/// `act(x Wᵀ + b)` through an FP8 product ([`products_apply`] checked by the caller).
pub(crate) fn linear(x: &Tensor, w: &Fp8Weight, b: Option<&Tensor>, gelu: bool) -> CResult<Tensor> {
    x.apply_op1_no_bwd(&Linear {
        w: w.clone(),
        b: b.cloned(),
        gelu,
    })
}

struct Linear {
    w: Fp8Weight,
    b: Option<Tensor>,
    gelu: bool,
}

/// The `(m, n)` product `act(x Wᵀ + b)` into a new buffer of `T` (the output dtype).
fn product_new<T: CudaDType + DeviceRepr + candle_core::WithDType>(
    dev: &CudaDevice,
    x: Input,
    m: usize,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> CResult<CudaStorage> {
    let n = w.dims2()?.0;
    // SAFETY: the product writes every element (beta = 0).
    let mut out = unsafe { dev.alloc::<T>(m * n)? };
    let stream = dev.cuda_stream();
    {
        let (p, _g) = out.device_ptr_mut(&stream);
        // SAFETY: sizes as allocated; operands checked by products_apply / rows_apply.
        unsafe { run(dev, x, m, w, b, gelu, p, T::DTYPE, 0.0)? };
    }
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

impl CustomOp1 for Linear {
    fn name(&self) -> &'static str {
        "mold-fp8-linear"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("mold-fp8-linear runs on CUDA only")
    }
    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
        let (n, k) = self.w.dims2()?;
        let dims = xl.shape().dims();
        if dims.last() != Some(&k) || !xl.is_contiguous() {
            candle_core::bail!("mold-fp8-linear: operands do not agree");
        }
        let m = xl.shape().elem_count() / k.max(1);
        let dev = x.device.clone();
        let dt = x.dtype();
        let mut shape = dims.to_vec();
        if let Some(l) = shape.last_mut() {
            *l = n;
        }
        let (w, b, x) = (&self.w, self.b.as_ref(), Input::Dense(x, xl));
        let storage = match dt {
            DType::BF16 => product_new::<half::bf16>(&dev, x, m, w, b, self.gelu)?,
            DType::F16 => product_new::<half::f16>(&dev, x, m, w, b, self.gelu)?,
            dt => candle_core::bail!("mold-fp8-linear: unsupported dtype {dt:?}"),
        };
        Ok((storage, Shape::from(shape)))
    }
}

/// Whether [`linear_rows`] runs `act(x Wᵀ + b)` for an input quantized ahead: as
/// [`products_apply`] for the activation it was quantized from.
pub(crate) fn rows_apply(
    x: &Fp8Rows,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> Result<(), String> {
    let (Ok((m, kx)), Ok((n, kw))) = (x.rows.dims2(), w.dims2()) else {
        return Err("operand shapes".into());
    };
    let candle_core::Device::Cuda(d) = x.rows.q.device() else {
        return Err("not on a GPU".into());
    };
    if !matches!(x.dtype, DType::BF16 | DType::F16) {
        return Err(format!("{:?} activations", x.dtype));
    }
    if kx != kw || kx % 16 != 0 || n % 16 != 0 || m == 0 || n == 0 {
        return Err(format!(
            "a ({n}, {kw}) weight on {kx} input features: FP8 products need them equal and multiples of 16"
        ));
    }
    if !x.rows.q.is_contiguous() || !x.rows.scale.is_contiguous() {
        return Err("a non-contiguous operand".into());
    }
    if !w.q.is_contiguous() || !w.scale.is_contiguous() {
        return Err("a non-contiguous operand".into());
    }
    if !w.q.device().same_device(x.rows.q.device())
        || !w.scale.device().same_device(x.rows.q.device())
        || !x.rows.scale.device().same_device(x.rows.q.device())
    {
        return Err("the weight is on another device than its input".into());
    }
    if !b.is_none_or(|b| b.dtype() == x.dtype && b.dims() == [n] && b.is_contiguous()) {
        return Err("the bias's dtype or shape".into());
    }
    device_takes(d, (m, n, kx), b.is_some(), gelu)
}

/// `act(x Wᵀ + b)` of an input quantized ahead ([`rows_apply`] checked by the caller),
/// shaped as the activation it was quantized from, in its dtype.
pub(crate) fn linear_rows(
    x: &Fp8Rows,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> CResult<Tensor> {
    x.rows.q.apply_op1_no_bwd(&LinearRows {
        x: x.clone(),
        w: w.clone(),
        b: b.cloned(),
        gelu,
    })
}

struct LinearRows {
    x: Fp8Rows,
    w: Fp8Weight,
    b: Option<Tensor>,
    gelu: bool,
}

impl CustomOp1 for LinearRows {
    fn name(&self) -> &'static str {
        "mold-fp8-linear-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("mold-fp8-linear-rows runs on CUDA only")
    }
    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> CResult<(CudaStorage, Shape)> {
        let (m, k) = self.x.rows.dims2()?;
        if ql.dims() != [m, k] || !ql.is_contiguous() {
            candle_core::bail!("mold-fp8-linear-rows: operands do not agree");
        }
        let n = self.w.dims2()?.0;
        let dev = q.device.clone();
        let mut shape = self.x.dims.clone();
        if let Some(l) = shape.last_mut() {
            *l = n;
        }
        let x = Input::Rows(q, ql, &self.x.rows.scale);
        let (w, b) = (&self.w, self.b.as_ref());
        let storage = match self.x.dtype {
            DType::BF16 => product_new::<half::bf16>(&dev, x, m, w, b, self.gelu)?,
            DType::F16 => product_new::<half::f16>(&dev, x, m, w, b, self.gelu)?,
            dt => candle_core::bail!("mold-fp8-linear-rows: unsupported dtype {dt:?}"),
        };
        Ok((storage, Shape::from(shape)))
    }
}

/// `acc += x Wᵀ` in place, through an FP8 product with beta = 1.
pub(crate) fn accumulate(acc: &Tensor, x: &Tensor, w: &Fp8Weight) -> CResult<()> {
    acc.inplace_op1(&Accumulate {
        x: x.clone(),
        w: w.clone(),
    })
}

struct Accumulate {
    x: Tensor,
    w: Fp8Weight,
}

impl InplaceOp1 for Accumulate {
    fn name(&self) -> &'static str {
        "mold-fp8-accumulate"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> CResult<()> {
        candle_core::bail!("mold-fp8-accumulate runs on CUDA only")
    }
    fn cuda_fwd(&self, acc: &mut CudaStorage, al: &Layout) -> CResult<()> {
        let (n, k) = self.w.dims2()?;
        let (xs, xl) = self.x.storage_and_layout();
        let Storage::Cuda(xs) = &*xs else {
            candle_core::bail!("mold-fp8-accumulate: the input is not on the GPU");
        };
        let m = xl.shape().elem_count() / k.max(1);
        if al.shape().elem_count() != m * n || !al.is_contiguous() || !xl.is_contiguous() {
            candle_core::bail!("mold-fp8-accumulate: operands do not agree");
        }
        let dev = xs.device.clone();
        let stream = dev.cuda_stream();
        let dt = acc.dtype();
        let start = al.start_offset();
        // SAFETY (both): C and D are the same buffer with equal layouts (allowed).
        match dt {
            DType::BF16 => {
                let mut o = acc
                    .as_cuda_slice_mut::<half::bf16>()?
                    .slice_mut(start..start + m * n);
                let (p, _g) = o.device_ptr_mut(&stream);
                unsafe {
                    run(
                        &dev,
                        Input::Dense(xs, xl),
                        m,
                        &self.w,
                        None,
                        false,
                        p,
                        dt,
                        1.0,
                    )
                }
            }
            DType::F16 => {
                let mut o = acc
                    .as_cuda_slice_mut::<half::f16>()?
                    .slice_mut(start..start + m * n);
                let (p, _g) = o.device_ptr_mut(&stream);
                unsafe {
                    run(
                        &dev,
                        Input::Dense(xs, xl),
                        m,
                        &self.w,
                        None,
                        false,
                        p,
                        dt,
                        1.0,
                    )
                }
            }
            dt => candle_core::bail!("mold-fp8-accumulate: unsupported dtype {dt:?}"),
        }
    }
}

/// An `(n, k)` bf16/f16 weight on a GPU quantized per output feature (row) there: the same
/// values and scales as [`Fp8Weight::quantize`] on the host (`scripts/gpu-suite` compares
/// the two loads' outputs). [`quantize_weight_cols`] over every column.
pub(crate) fn quantize_weight(w: &Tensor) -> CResult<Fp8Weight> {
    let (_, k) = w.dims2()?;
    quantize_weight_cols(w, std::slice::from_ref(&(0..k)))
}

/// The columns `cols` of an `(n, k)` bf16/f16 weight on a GPU (pieces side by side, in
/// order), quantized there with each whole row's scale: what quantizing the whole rows then
/// cutting those columns would give (a row-parallel share of a product), without copying FP8
/// columns (candle's build has no FP8 strided copy). One kernel launch per piece.
pub(crate) fn quantize_weight_cols(w: &Tensor, cols: &[Range<usize>]) -> CResult<Fp8Weight> {
    let (n, k) = w.dims2()?;
    let kout: usize = cols.iter().map(|c| c.len()).sum();
    if n == 0 || k == 0 || kout == 0 || cols.iter().any(|c| c.start >= c.end || c.end > k) {
        candle_core::bail!("FP8 quantization on the GPU: columns {cols:?} of an ({n}, {k}) weight");
    }
    if k > i32::MAX as usize {
        candle_core::bail!("FP8 quantization on the GPU: rows of {k} values");
    }
    let w = w.contiguous()?;
    let (st, l) = w.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        candle_core::bail!("FP8 quantization on the GPU: the weight is not on a GPU");
    };
    let dt = cs.dtype();
    let dev = cs.device.clone();
    let f = dev
        .get_or_load_custom_fatbin(
            &format!("mold_fp8_quantize_cols_{}", suffix(dt)?),
            MODULE,
            FATBIN,
        )?
        .into_cuda_function();
    // SAFETY: the pieces together write every column of every row.
    let mut q = unsafe { dev.alloc::<float8::F8E4M3>(n * kout)? };
    let mut s = unsafe { dev.alloc::<f32>(n)? };
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let stream = dev.cuda_stream();
    let (mut xb, mut xh) = (None, None);
    match dt {
        DType::BF16 => xb = Some(cs.as_cuda_slice::<half::bf16>()?.slice(l.start_offset()..)),
        _ => xh = Some(cs.as_cuda_slice::<half::f16>()?.slice(l.start_offset()..)),
    }
    let mut out_col = 0usize;
    for c in cols {
        let (kk, c0, len, oc, ko) = (
            k as i32,
            c.start as i32,
            c.len() as i32,
            out_col as i32,
            kout as i32,
        );
        let mut b = stream.launch_builder(&f);
        match (&xb, &xh) {
            (Some(v), _) => b.arg(v),
            (_, Some(v)) => b.arg(v),
            _ => candle_core::bail!("FP8 quantization on the GPU: no input view"),
        };
        b.arg(&mut q)
            .arg(&mut s)
            .arg(&kk)
            .arg(&c0)
            .arg(&len)
            .arg(&oc)
            .arg(&ko);
        // SAFETY: the arguments match the kernel's signature; sizes as allocated.
        unsafe { b.launch(cfg) }.map_err(|e| err("quantize kernel", e))?;
        out_col += c.len();
    }
    drop(st);
    let wrap = |storage: CudaStorage, shape: Shape| {
        Tensor::from_storage(
            Storage::Cuda(storage),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        )
    };
    Fp8Weight::from_parts(
        wrap(
            CudaStorage::wrap_cuda_slice(q, dev.clone()),
            Shape::from((n, kout)),
        ),
        wrap(CudaStorage::wrap_cuda_slice(s, dev), Shape::from(n)),
    )
}

/// `q · scale[row]` in `dtype` (bf16/f16), one kernel.
pub(crate) fn dequantize(w: &Fp8Weight, dtype: DType) -> CResult<Tensor> {
    let (n, k) = w.dims2()?;
    let q = w.q.contiguous()?;
    let s = w.scale.contiguous()?;
    q.apply_op1_no_bwd(&Dequantize {
        scale: s,
        dtype,
        n,
        k,
    })
}

struct Dequantize {
    scale: Tensor,
    dtype: DType,
    n: usize,
    k: usize,
}

impl CustomOp1 for Dequantize {
    fn name(&self) -> &'static str {
        "mold-fp8-dequantize"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("mold-fp8-dequantize runs on CUDA only")
    }
    fn cuda_fwd(&self, q: &CudaStorage, ql: &Layout) -> CResult<(CudaStorage, Shape)> {
        let (n, k) = (self.n, self.k);
        let dev = q.device.clone();
        let (ss, sl) = self.scale.storage_and_layout();
        let Storage::Cuda(ss) = &*ss else {
            candle_core::bail!("FP8 dequantize: the scales are not on the GPU");
        };
        // Eight values a thread where every row's 8-value pieces are 8-byte aligned.
        let vec = k.is_multiple_of(8)
            && ql.start_offset().is_multiple_of(8)
            && !super::options().plain_quantize;
        let (name, per) = if vec {
            ("mold_fp8_dequantize_rows_vec", 8)
        } else {
            ("mold_fp8_dequantize_rows", 1)
        };
        let f = dev
            .get_or_load_custom_fatbin(&format!("{name}_{}", suffix(self.dtype)?), MODULE, FATBIN)?
            .into_cuda_function();
        let cfg = LaunchConfig {
            grid_dim: (n as u32, ((k / per) as u32).div_ceil(THREADS), 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let qv = q
            .as_cuda_slice::<float8::F8E4M3>()?
            .slice(ql.start_offset()..);
        let sv = ss.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        let kk = k as i32;
        let storage = match self.dtype {
            DType::BF16 => launch::<half::bf16>(&dev, &f, cfg, (&qv, &sv), n * k, kk)?,
            _ => launch::<half::f16>(&dev, &f, cfg, (&qv, &sv), n * k, kk)?,
        };
        Ok((storage, Shape::from((n, k))))
    }
}

/// Runs the dequantizing kernel `f` into a new buffer of `len` values of `T`.
fn launch<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    f: &candle_core::cuda::cudarc::driver::CudaFunction,
    cfg: LaunchConfig,
    (q, s): (
        &candle_core::cuda::cudarc::driver::CudaView<'_, float8::F8E4M3>,
        &candle_core::cuda::cudarc::driver::CudaView<'_, f32>,
    ),
    len: usize,
    k: i32,
) -> CResult<CudaStorage> {
    // SAFETY: the kernel writes every element.
    let mut out = unsafe { dev.alloc::<T>(len)? };
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(f);
    b.arg(q).arg(s).arg(&mut out).arg(&k);
    // SAFETY: the arguments match the kernel's signature.
    unsafe { b.launch(cfg) }.map_err(|e| err("dequantize kernel", e))?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// Blocks of the per-tensor amax pass: their partial maxima are what every block of the
/// quantizing pass reads (a few hundred floats), enough to fill the GPU.
const AMAX_BLOCKS: u32 = 264;

/// q, k and v (each `(b, h, L, d)` bf16/f16 on one GPU, contiguous or views with one set of
/// strides whose rows of `d` values are contiguous, read in place: under sequence
/// parallelism the all-to-all's `(L, 3, b, h, d)` buffer) quantized to e4m3 with
/// one scale per tensor for cuDNN's FP8 attention: the values `(3, b, h, L, d)` and
/// [`QKV_SCALES`] f32 scales, one every 16 bytes — q's, k's and v's descales (amax / 448),
/// then the probabilities' descale 1 / 448 and scale 448 — and v's descale once per token,
/// `(b · L)` f32 (the attention output's per-token scales, the value at index 8), all
/// written on the GPU (no copy to or from the host). Two passes: each tensor's amax, then
/// its values; with `amax`, the tensors' partial maxima `(3, parts, stride)` f32 (each
/// slot's maximum in `[.., .., 0]`) taken as they were written
/// ([`crate::model::ops::qkv_prep_fused_amax`]), only the second.
pub(crate) fn quantize_qkv(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    amax: Option<&Tensor>,
) -> CResult<(Tensor, Tensor, Tensor)> {
    use candle_core::op::BackpropOp;
    let dims = q.dims().to_vec();
    let n = q.elem_count();
    // The attention output's tokens: (b, h, L, d) has b · L.
    let (batch, _, len, _) = q.dims4()?;
    let tokens = batch * len;
    for (name, t) in [("k", k), ("v", v)] {
        if t.dims() != dims.as_slice() || t.dtype() != q.dtype() {
            candle_core::bail!(
                "FP8 attention: {name} is {:?} {:?}, q {dims:?} {:?}",
                t.dims(),
                t.dtype(),
                q.dtype()
            );
        }
    }
    if !n.is_multiple_of(8) || n >= i64::MAX as usize {
        candle_core::bail!("FP8 attention: {n} values a tensor, not a multiple of 8");
    }
    // Views the passes cannot read in place (other strides, rows not contiguous, pieces not
    // 16-byte aligned) are copied first, contiguous from offset 0.
    let copied;
    let (q, k, v) = if super::views_in_place([q.layout(), k.layout(), v.layout()]) {
        (q, k, v)
    } else {
        copied = [
            q.force_contiguous()?,
            k.force_contiguous()?,
            v.force_contiguous()?,
        ];
        (&copied[0], &copied[1], &copied[2])
    };
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cuda(qs), Storage::Cuda(ks), Storage::Cuda(vs)) = (&*qs, &*ks, &*vs) else {
        candle_core::bail!("FP8 attention: q, k and v are not on the GPU");
    };
    let strides = ql.stride().to_vec();
    let dense = ql.is_contiguous() && kl.is_contiguous() && vl.is_contiguous();
    let dim_d = dims[3];
    let (h32, l32, dp32) = (dims[1] as u32, dims[2] as u32, (dim_d / 8) as u32);
    if batch * dims[1] * dims[2] > u32::MAX as usize {
        candle_core::bail!("FP8 attention: {:?} has more rows than 2^32", dims);
    }
    let (sb, sh, sl) = (strides[0] as i64, strides[1] as i64, strides[2] as i64);
    let dense = i32::from(dense);
    let dev = qs.device.clone();
    let dt = qs.dtype();
    let load = |name: &str| -> CResult<_> {
        Ok(dev
            .get_or_load_custom_fatbin(&format!("{name}_{}", suffix(dt)?), MODULE, FATBIN)?
            .into_cuda_function())
    };
    let (fa, fq) = (load("mold_fp8_amax3")?, load("mold_fp8_quantize3")?);
    // The partial maxima given, `(3, parts, stride)` f32 on this GPU.
    let (parts, pstride) = match amax {
        None => (AMAX_BLOCKS as i32, 1i32),
        Some(a) => {
            let (three, parts, stride) = a.dims3()?;
            if three != 3 || a.dtype() != DType::F32 || !a.is_contiguous() || parts * stride == 0 {
                candle_core::bail!(
                    "FP8 attention: maxima {:?} {:?}, want (3, parts, stride) f32",
                    a.dims(),
                    a.dtype()
                );
            }
            (parts as i32, stride as i32)
        }
    };
    let held = amax.map(|a| a.storage_and_layout());
    let given = match &held {
        None => None,
        Some((st, l)) => match &**st {
            Storage::Cuda(c) => Some(c.as_cuda_slice::<f32>()?.slice(l.start_offset()..)),
            _ => candle_core::bail!("FP8 attention: the maxima are not on the GPU"),
        },
    };
    // SAFETY: quantize3 writes every value, every token's scale and the six scales it
    // returns (the padding between them is zeroed, never read).
    let mut values = unsafe { dev.alloc::<float8::F8E4M3>(3 * n)? };
    let mut v_tokens = unsafe { dev.alloc::<f32>(tokens)? };
    let mut scales = dev.alloc_zeros::<f32>(QKV_SCALES)?;
    let stream = dev.cuda_stream();
    let (n64, tokens64) = (n as i64, tokens as i64);
    let grid = |x: u32| LaunchConfig {
        grid_dim: (x, 3, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let pieces = (n / 8).div_ceil(THREADS as usize).clamp(1, 4 * 132 * 4) as u32;
    macro_rules! run {
        ($t:ty) => {{
            let x0 = qs.as_cuda_slice::<$t>()?.slice(ql.start_offset()..);
            let x1 = ks.as_cuda_slice::<$t>()?.slice(kl.start_offset()..);
            let x2 = vs.as_cuda_slice::<$t>()?.slice(vl.start_offset()..);
            // The partial maxima amax3 writes, where none are given.
            let partial;
            let mut b = stream.launch_builder(&fq);
            b.arg(&x0).arg(&x1).arg(&x2).arg(&n64);
            b.arg(&dense).arg(&h32).arg(&l32).arg(&dp32);
            b.arg(&sb).arg(&sh).arg(&sl);
            match &given {
                Some(g) => b.arg(g),
                None => {
                    // SAFETY: amax3 writes every partial.
                    let mut p = unsafe { dev.alloc::<f32>(3 * AMAX_BLOCKS as usize)? };
                    let mut a = stream.launch_builder(&fa);
                    a.arg(&x0).arg(&x1).arg(&x2).arg(&n64);
                    a.arg(&dense).arg(&h32).arg(&l32).arg(&dp32);
                    a.arg(&sb).arg(&sh).arg(&sl).arg(&mut p);
                    // SAFETY: the arguments match the kernel; each tensor holds n values.
                    unsafe { a.launch(grid(AMAX_BLOCKS)) }.map_err(|e| err("amax kernel", e))?;
                    partial = p;
                    b.arg(&partial)
                }
            };
            b.arg(&parts)
                .arg(&pstride)
                .arg(&mut values)
                .arg(&mut scales)
                .arg(&tokens64)
                .arg(&mut v_tokens);
            // SAFETY: as above; `values` holds the three tensors' 3n values, `v_tokens` the
            // b · L tokens' scales.
            unsafe { b.launch(grid(pieces)) }.map_err(|e| err("quantize kernel", e))?;
        }};
    }
    match dt {
        DType::BF16 => run!(half::bf16),
        DType::F16 => run!(half::f16),
        dt => candle_core::bail!("FP8 attention: unsupported dtype {dt:?}"),
    }
    let wrap = |st: CudaStorage, shape: Shape| {
        Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
    };
    let mut shape = vec![3];
    shape.extend_from_slice(&dims);
    Ok((
        wrap(
            CudaStorage::wrap_cuda_slice(values, dev.clone()),
            Shape::from(shape),
        ),
        wrap(
            CudaStorage::wrap_cuda_slice(scales, dev.clone()),
            Shape::from(QKV_SCALES),
        ),
        wrap(
            CudaStorage::wrap_cuda_slice(v_tokens, dev.clone()),
            Shape::from(tokens),
        ),
    ))
}

/// The f32 scales [`quantize_qkv`] writes: six values, one every 16 bytes — q's, k's and
/// v's descales, the probabilities' descale and scale, and the attention output's scale
/// (v's factor 448 / amax: the output's values are averages of v's, so its descale is v's).
pub(crate) const QKV_SCALES: usize = 24;

/// What [`quantize_messages`] returns: the e4m3 messages to send (message `me` a view of
/// `recv`), the receive buffer with this rank's own piece in place, the [`QKV_SCALES`]
/// scales cuDNN's FP8 attention takes, and v's descale once per row of this rank's
/// attention output (its per-token scales once the heads come back).
pub(crate) struct QuantizedMessages {
    pub send: Vec<Tensor>,
    pub recv: Tensor,
    pub scales: Tensor,
    pub v_tokens: Tensor,
}

/// The q/k/v all-to-all's messages in e4m3 (sequence parallelism, FP8 attention): message j
/// `(L_me, 3, b, heads_j, d)` bf16/f16, contiguous, each of q, k and v scaled by 448 / its
/// amax, amax the largest of `maxima` `(3, parts, stride)` f32 (every rank's partial
/// maxima one after another, so every rank takes the same scales, and the same as one GPU
/// would over the whole tensors: `quantize_qkv`'s factors given the same maxima). Message
/// `me` is written straight into the receive buffer `(total, 3, b, heads_me, d)` e4m3 at
/// token `before`, the others into buffers of their own. `tokens`: the rows of this rank's
/// attention output once its heads come back (b · L_me).
pub(crate) fn quantize_messages(
    send: &[Tensor],
    me: usize,
    (before, total): (usize, usize),
    maxima: &Tensor,
    tokens: usize,
) -> CResult<QuantizedMessages> {
    use candle_core::op::BackpropOp;
    let own = send
        .get(me)
        .ok_or_else(|| err("messages", format!("no message {me} of {}", send.len())))?;
    let dt = own.dtype();
    let (l, three, b, hs, d) = own.dims5()?;
    if three != 3 || before + l > total {
        candle_core::bail!(
            "FP8 q/k/v messages: message {me} is {:?}, tokens {before}.. of {total}",
            own.dims()
        );
    }
    let (y3, parts, pstride) = maxima.dims3()?;
    if y3 != 3 || maxima.dtype() != DType::F32 || !maxima.is_contiguous() || parts * pstride == 0 {
        candle_core::bail!(
            "FP8 q/k/v messages: maxima {:?} {:?}, want (3, parts, stride) f32",
            maxima.dims(),
            maxima.dtype()
        );
    }
    let dev = match own.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => candle_core::bail!("FP8 q/k/v messages: not on a GPU"),
    };
    let f = dev
        .get_or_load_custom_fatbin(
            &format!("mold_fp8_quantize_thirds_{}", suffix(dt)?),
            MODULE,
            FATBIN,
        )?
        .into_cuda_function();
    let (ms, ml) = maxima.storage_and_layout();
    let Storage::Cuda(mc) = &*ms else {
        candle_core::bail!("FP8 q/k/v messages: the maxima are not on the GPU");
    };
    let mv = mc.as_cuda_slice::<f32>()?.slice(ml.start_offset()..);
    let row = 3 * b * hs * d;
    // SAFETY: every value of the receive buffer is written: the own piece here, the others'
    // by the all-to-all; every scale the kernel returns and every token's scale by it.
    let mut recv = unsafe { dev.alloc::<float8::F8E4M3>(total * row)? };
    let mut scales = dev.alloc_zeros::<f32>(QKV_SCALES)?;
    let mut v_tokens = unsafe { dev.alloc::<f32>(tokens.max(1))? };
    let stream = dev.cuda_stream();
    let (parts, pstride) = (parts as i32, pstride as i32);
    let wrap = |st: CudaStorage, shape: Shape| {
        Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
    };
    let mut out: Vec<Option<Tensor>> = Vec::with_capacity(send.len());
    for (j, m) in send.iter().enumerate() {
        let (lj, t3, bj, hj, dj) = m.dims5()?;
        let n = m.elem_count();
        let inner = bj * hj * dj;
        if lj != l || t3 != 3 || bj != b || dj != d || m.dtype() != dt || !m.is_contiguous() {
            candle_core::bail!(
                "FP8 q/k/v messages: message {j} is {:?} {:?}, message {me} {:?} {dt:?}",
                m.dims(),
                m.dtype(),
                own.dims()
            );
        }
        if !inner.is_multiple_of(8) || n >= i64::MAX as usize {
            candle_core::bail!("FP8 q/k/v messages: {inner} values a token's third, not 8·k");
        }
        let (xs, xl) = m.storage_and_layout();
        let Storage::Cuda(xc) = &*xs else {
            candle_core::bail!("FP8 q/k/v messages: message {j} is not on the GPU");
        };
        let (n64, inner64) = (n as i64, inner as i64);
        let pieces = (n / 8).div_ceil(THREADS as usize).clamp(1, 4 * 132 * 4) as u32;
        let cfg = LaunchConfig {
            grid_dim: (pieces, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let tokens64 = tokens as i64;
        let null = 0u64;
        // SAFETY (both arms): the arguments match the kernel's signature; `dst` holds the
        // message's n values; `scales` and `v_tokens` hold QKV_SCALES and `tokens` floats.
        macro_rules! go {
            ($t:ty, $dst:expr, $own:expr) => {{
                let x = xc.as_cuda_slice::<$t>()?.slice(xl.start_offset()..);
                let mut a = stream.launch_builder(&f);
                a.arg(&x).arg(&n64).arg(&inner64).arg(&mv);
                a.arg(&parts).arg(&pstride).arg($dst);
                if $own {
                    a.arg(&mut scales).arg(&tokens64).arg(&mut v_tokens);
                } else {
                    a.arg(&null).arg(&tokens64).arg(&null);
                }
                unsafe { a.launch(cfg) }.map_err(|e| err("message kernel", e))?;
            }};
        }
        if j == me {
            let mut dst = recv.slice_mut(before * row..(before + l) * row);
            match dt {
                DType::BF16 => go!(half::bf16, &mut dst, true),
                _ => go!(half::f16, &mut dst, true),
            }
            out.push(None);
        } else {
            // SAFETY: the kernel writes all n values.
            let mut dst = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
            match dt {
                DType::BF16 => go!(half::bf16, &mut dst, false),
                _ => go!(half::f16, &mut dst, false),
            }
            out.push(Some(wrap(
                CudaStorage::wrap_cuda_slice(dst, dev.clone()),
                m.shape().clone(),
            )));
        }
    }
    let recv = wrap(
        CudaStorage::wrap_cuda_slice(recv, dev.clone()),
        Shape::from((total, 3, b, hs, d)),
    );
    let mine = recv.narrow(0, before, l)?;
    let send = out
        .into_iter()
        .map(|t| t.unwrap_or_else(|| mine.clone()))
        .collect();
    Ok(QuantizedMessages {
        send,
        recv,
        scales: wrap(
            CudaStorage::wrap_cuda_slice(scales, dev.clone()),
            Shape::from(QKV_SCALES),
        ),
        v_tokens: wrap(
            CudaStorage::wrap_cuda_slice(v_tokens, dev.clone()),
            Shape::from(tokens.max(1)),
        )
        .narrow(0, 0, tokens)?,
    })
}
