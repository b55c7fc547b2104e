//! FP8 (e4m3) weights and products.
//!
//! A weight is held as [`Fp8Weight`]: e4m3 values and one f32 scale per output feature
//! (row), `w ≈ q · scale[row]`, quantized per row at load ([`Fp8Weight::quantize`]). A
//! product `x Wᵀ` quantizes its input per token (row) on the fly in the same way and
//! multiplies the two FP8 matrices with f32 accumulation, both scales applied in the
//! product's epilogue, the bias and GELU after them ([`linear`]):
//!
//! - CUDA, GPUs with FP8 tensor cores (sm_89, sm_90 and later) and a cuBLASLt that takes
//!   per-row ("outer vector") scales: one quantizing kernel, then one cuBLASLt FP8 matmul
//!   with the scales, bias and GELU in its epilogue ([`cuda`]).
//! - CUDA elsewhere (A100, RTX 3090, or cuBLASLt without those scales): weight-only FP8:
//!   the weight widened to the compute dtype just before its product, the input not
//!   quantized. FP8 then saves memory, not time.
//! - CPU and the candle reference (`MOLD_KERNELS=candle`): the same arithmetic as the FP8
//!   products, emulated — the input quantized and widened back per token, the weight
//!   widened, an f32 product ([`linear_reference`]). CI proves sharded = unsharded on it.
//!
//! A conditioning vector's product (a block's modulation: shift, scale and gate for every
//! token) keeps its input as given and widens the FP8 weight instead
//! ([`linear_weight_only`]): FP8's error there reaches every token, and an FP8 product of a
//! few rows saves nothing (on FLUX.1-dev, 6.64e-2 → 5.38e-2 against bf16; BENCHMARKS.md).
//!
//! The scale of a token is taken over the features a rank holds: column-parallel and
//! sequence-parallel products see whole tokens and equal the unsharded product exactly;
//! a row-parallel product's ranks each scale their own slice of a token (within FP8's
//! rounding of the unsharded product, not equal to it).

#[cfg(feature = "cuda")]
pub(crate) mod cuda;

use super::ops::Kernels;
pub use crate::options::Fp8Options;
use candle_core::{DType, Device, Tensor, D};
use float8::F8E4M3;
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

type CResult<T> = candle_core::Result<T>;

static PRODUCTS: AtomicU64 = AtomicU64::new(0);
static WEIGHT_ONLY: AtomicU64 = AtomicU64::new(0);
static EMULATED: AtomicU64 = AtomicU64::new(0);
static WHY: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// How this process's FP8 products ran: through FP8 matmuls, weight-only (the weight
/// widened first), or emulated; with the reasons a GPU product fell back to weight-only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub products: u64,
    pub weight_only: u64,
    pub emulated: u64,
    pub weight_only_because: Vec<String>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FP8 products: {} FP8 matmuls (cuBLASLt, per-row scales), {} weight-only, {} emulated",
            self.products, self.weight_only, self.emulated
        )?;
        for w in &self.weight_only_because {
            write!(f, "\n  weight-only because {w}")?;
        }
        Ok(())
    }
}

/// This process's FP8 product counts so far.
pub fn report() -> Report {
    Report {
        products: PRODUCTS.load(Ordering::Relaxed),
        weight_only: WEIGHT_ONLY.load(Ordering::Relaxed),
        emulated: EMULATED.load(Ordering::Relaxed),
        weight_only_because: WHY.lock().unwrap_or_else(|p| p.into_inner()).clone(),
    }
}

#[cfg(feature = "cuda")]
fn weight_only_because(why: String) {
    WEIGHT_ONLY.fetch_add(1, Ordering::Relaxed);
    let mut w = WHY.lock().unwrap_or_else(|p| p.into_inner());
    if !w.contains(&why) && w.len() < 8 {
        w.push(why);
    }
}

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// `(1 / scale, scale)` of a row whose largest magnitude is `amax`: the row is multiplied
/// by the first before rounding to e4m3, the product by the second after. A zero (or
/// non-finite) row keeps 1. The CUDA kernel (kernels/fp8.cu) computes the same, in f32
/// with IEEE division.
pub fn row_scale(amax: f32) -> (f32, f32) {
    if amax > 0.0 && amax.is_finite() {
        (E4M3_MAX / amax, amax / E4M3_MAX)
    } else {
        (1.0, 1.0)
    }
}

/// `v` rounded to e4m3 (nearest even, saturated at ±448; NaN stays NaN), as the CUDA
/// kernel does: float8's conversion, bit for bit ([`tests`]), without its detour through
/// f64.
pub fn round_e4m3(v: f32) -> F8E4M3 {
    if v.is_nan() {
        return F8E4M3::from_bits(0x7f | (((v.to_bits() >> 31) as u8) << 7));
    }
    let v = v.clamp(-E4M3_MAX, E4M3_MAX);
    let bits = v.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = bits & 0x7fff_ffff;
    // The smallest normal e4m3 value, 2⁻⁶: f32 exponent field 121.
    let q = if a >= 121 << 23 {
        let mut e = (a >> 23) as i32 - 127 + 7;
        let mant = a & 0x7f_ffff;
        let mut r = mant >> 20;
        let rem = mant & 0xf_ffff;
        if rem > 0x8_0000 || (rem == 0x8_0000 && r & 1 == 1) {
            r += 1;
        }
        if r == 8 {
            r = 0;
            e += 1;
        }
        ((e as u32) << 3 | r) as u8
    } else {
        // Subnormal: multiples of 2⁻⁹ (exact: a power-of-two scale), ties to even; 8
        // steps is the smallest normal's encoding (exponent 1, mantissa 0).
        (f32::from_bits(a) * 512.0).round_ties_even() as u8
    };
    F8E4M3::from_bits(sign | q)
}

/// Rows of `k` f32 values quantized row by row: the e4m3 values and one scale per row.
fn quantize_slice(x: &[f32], k: usize) -> (Vec<F8E4M3>, Vec<f32>) {
    let rows = x.len().checked_div(k).unwrap_or(0);
    let mut q = vec![F8E4M3::from_bits(0); x.len()];
    let mut s = vec![1f32; rows];
    quantize_into(x, k, &mut q, &mut s, |v| *v);
    (q, s)
}

/// Rows of `k` values of `x` quantized into `q` with their scales in `s`, rows in parallel.
fn quantize_into<T: Sync>(
    x: &[T],
    k: usize,
    q: &mut [F8E4M3],
    s: &mut [f32],
    f: impl Fn(&T) -> f32 + Sync,
) {
    if k == 0 {
        return;
    }
    q.par_chunks_mut(k)
        .zip(s.par_iter_mut())
        .zip(x.par_chunks(k))
        .for_each(|((qr, sr), xr)| {
            let amax = xr.iter().fold(0f32, |m, v| m.max(f(v).abs()));
            let (inv, scale) = row_scale(amax);
            for (o, v) in qr.iter_mut().zip(xr) {
                *o = round_e4m3(f(v) * inv);
            }
            *sr = scale;
        });
}

/// A product's weight in FP8: `q` `(n, k)` e4m3, `scale` `(n)` f32, `w ≈ q · scale[row]`.
#[derive(Clone, Debug)]
pub struct Fp8Weight {
    q: Tensor,
    scale: Tensor,
}

impl Fp8Weight {
    /// Quantizes an `(n, k)` weight per output feature (row), on the host, rows in
    /// parallel, read in the weight's own dtype (no widened copy).
    pub fn quantize(w: &Tensor) -> CResult<Fp8Weight> {
        use candle_core::{CpuStorage, Storage};
        let (n, k) = w.dims2()?;
        let w = w.to_device(&Device::Cpu)?.contiguous()?;
        let mut q = vec![F8E4M3::from_bits(0); n * k];
        let mut s = vec![1f32; n];
        {
            // The host tensor's own values, no copy.
            let (st, l) = w.storage_and_layout();
            let at = l.start_offset();
            match &*st {
                Storage::Cpu(CpuStorage::BF16(v)) => {
                    quantize_into(&v[at..at + n * k], k, &mut q, &mut s, |v| v.to_f32())
                }
                Storage::Cpu(CpuStorage::F16(v)) => {
                    quantize_into(&v[at..at + n * k], k, &mut q, &mut s, |v| v.to_f32())
                }
                Storage::Cpu(CpuStorage::F32(v)) => {
                    quantize_into(&v[at..at + n * k], k, &mut q, &mut s, |v| *v)
                }
                _ => candle_core::bail!(
                    "FP8 quantization of a {:?} weight: give it in bf16, f16 or f32",
                    w.dtype()
                ),
            }
        }
        Ok(Fp8Weight {
            q: Tensor::from_vec(q, (n, k), &Device::Cpu)?,
            scale: Tensor::from_vec(s, n, &Device::Cpu)?,
        })
    }

    /// Quantizes an `(n, k)` bf16 or f16 weight held by a GPU on that GPU, per output
    /// feature, to the same values and scales as [`Fp8Weight::quantize`].
    #[cfg(feature = "cuda")]
    pub fn quantize_on_gpu(w: &Tensor) -> CResult<Fp8Weight> {
        cuda::quantize_weight(w)
    }

    /// The columns `cols` (pieces side by side, in order) of an `(n, k)` bf16 or f16 weight
    /// held by a GPU, quantized on that GPU with each whole row's scale: the same values and
    /// scales as [`Fp8Weight::quantize`] of the whole rows, then those columns.
    #[cfg(feature = "cuda")]
    pub fn quantize_cols_on_gpu(w: &Tensor, cols: &[std::ops::Range<usize>]) -> CResult<Fp8Weight> {
        cuda::quantize_weight_cols(w, cols)
    }

    /// From e4m3 values and per-row scales (checked: `q` `(n, k)` F8E4M3, `scale` `(n)` F32).
    pub fn from_parts(q: Tensor, scale: Tensor) -> CResult<Fp8Weight> {
        let (n, _) = q.dims2()?;
        if q.dtype() != DType::F8E4M3 || scale.dtype() != DType::F32 || scale.dims() != [n] {
            candle_core::bail!(
                "an FP8 weight is (n, k) f8e4m3 with (n) f32 scales, not {:?} {:?} with {:?} {:?}",
                q.dims(),
                q.dtype(),
                scale.dims(),
                scale.dtype()
            );
        }
        Ok(Fp8Weight { q, scale })
    }

    /// The e4m3 values, `(n, k)`.
    pub fn values(&self) -> &Tensor {
        &self.q
    }
    /// One scale per output feature, `(n)`.
    pub fn scales(&self) -> &Tensor {
        &self.scale
    }
    pub fn dims2(&self) -> CResult<(usize, usize)> {
        self.q.dims2()
    }

    /// Output features `start..start + len` (a view: rows are contiguous).
    pub fn narrow_rows(&self, start: usize, len: usize) -> CResult<Fp8Weight> {
        Ok(Fp8Weight {
            q: self.q.narrow(0, start, len)?,
            scale: self.scale.narrow(0, start, len)?,
        })
    }

    /// Input features `start..start + len`, copied contiguous; each row keeps its scale.
    pub fn narrow_cols(&self, start: usize, len: usize) -> CResult<Fp8Weight> {
        Ok(Fp8Weight {
            q: self.q.narrow(1, start, len)?.contiguous()?,
            scale: self.scale.clone(),
        })
    }

    /// `w ≈ q · scale[row]` in `dtype` (a kernel on CUDA, exact in f32 on the host).
    pub fn dequantize(&self, dtype: DType) -> CResult<Tensor> {
        #[cfg(feature = "cuda")]
        if self.q.device().is_cuda() && matches!(dtype, DType::BF16 | DType::F16) {
            return cuda::dequantize(self, dtype);
        }
        self.q
            .to_dtype(DType::F32)?
            .broadcast_mul(&self.scale.to_dtype(DType::F32)?.unsqueeze(1)?)?
            .to_dtype(dtype)
    }

    /// The weight with every tensor passed through `f` (values first, then scales).
    pub fn map(&self, f: &mut dyn FnMut(&Tensor) -> CResult<Tensor>) -> CResult<Fp8Weight> {
        Ok(Fp8Weight {
            q: f(&self.q)?,
            scale: f(&self.scale)?,
        })
    }

    pub fn bytes(&self) -> u64 {
        (self.q.elem_count() + self.scale.elem_count() * 4) as u64
    }
}

/// An activation `(…, k)` quantized per token (row) where it was computed, for the FP8
/// products it feeds: `rows` holds its e4m3 values `(m, k)` and one f32 scale per token, as
/// a product's own quantizing pass would have written them. The LayerNorm + modulation
/// kernel writes it ([`super::ops::ln_modulate_fp8`]): each product after a norm then skips
/// its quantizing pass, and the two products of FLUX's single-block `linear1` share one.
#[derive(Clone, Debug)]
pub struct Fp8Rows {
    rows: Fp8Weight,
    dims: Vec<usize>,
    dtype: DType,
}

impl Fp8Rows {
    /// From e4m3 values `(m, k)`, `m` scales, the activation's shape (`m · k` values, `k`
    /// last) and its dtype (the dtype its products return).
    pub fn new(q: Tensor, scale: Tensor, dims: &[usize], dtype: DType) -> CResult<Fp8Rows> {
        let rows = Fp8Weight::from_parts(q, scale)?;
        let (m, k) = rows.dims2()?;
        if dims.last() != Some(&k) || dims.iter().product::<usize>() != m * k {
            candle_core::bail!("FP8 rows ({m}, {k}) of an activation shaped {dims:?}");
        }
        Ok(Fp8Rows {
            rows,
            dims: dims.to_vec(),
            dtype,
        })
    }

    /// The e4m3 values `(m, k)` and the per-token scales `(m)`.
    pub fn rows(&self) -> &Fp8Weight {
        &self.rows
    }

    /// The activation's shape.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// Tokens `start..start + len` of a `(b, L, k)` activation, as a view of its rows where
    /// they are contiguous (`b` = 1, or all `L` tokens); `None` where they are not.
    pub fn narrow_tokens(&self, start: usize, len: usize) -> CResult<Option<Fp8Rows>> {
        let [b, l, k] = self.dims[..] else {
            candle_core::bail!("tokens of an activation shaped {:?}", self.dims);
        };
        if start + len > l {
            candle_core::bail!("tokens {start}..{} of {l}", start + len);
        }
        if b != 1 && len != l {
            return Ok(None);
        }
        Ok(Some(Fp8Rows {
            rows: self.rows.narrow_rows(start * b, len * b)?,
            dims: vec![b, len, k],
            dtype: self.dtype,
        }))
    }

    /// `q · scale[token]` in the activation's dtype and shape.
    pub fn dequantize(&self) -> CResult<Tensor> {
        self.rows
            .dequantize(self.dtype)?
            .reshape(self.dims.as_slice())
    }
}

static QUANTIZE_IN_NORM: AtomicBool = AtomicBool::new(true);
static FAST_ACCUMULATION: AtomicBool = AtomicBool::new(true);
static PLAIN_QUANTIZE: AtomicBool = AtomicBool::new(false);
static SM_CARVEOUT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
static EXCHANGE_E4M3: AtomicBool = AtomicBool::new(true);

/// Sets how this process's FP8 products run (the executor applies its
/// [`crate::options::Fp8Options`]; until then, their defaults).
pub fn configure(o: Fp8Options) {
    QUANTIZE_IN_NORM.store(o.quantize_in_norm, Ordering::Relaxed);
    FAST_ACCUMULATION.store(o.fast_accumulation, Ordering::Relaxed);
    PLAIN_QUANTIZE.store(o.plain_quantize, Ordering::Relaxed);
    SM_CARVEOUT.store(o.sm_carveout, Ordering::Relaxed);
    EXCHANGE_E4M3.store(o.exchange_e4m3, Ordering::Relaxed);
}

/// How this process's FP8 products run now ([`configure`]).
pub fn options() -> Fp8Options {
    Fp8Options {
        quantize_in_norm: QUANTIZE_IN_NORM.load(Ordering::Relaxed),
        fast_accumulation: FAST_ACCUMULATION.load(Ordering::Relaxed),
        plain_quantize: PLAIN_QUANTIZE.load(Ordering::Relaxed),
        attention: None,
        sm_carveout: SM_CARVEOUT.load(Ordering::Relaxed),
        exchange_e4m3: EXCHANGE_E4M3.load(Ordering::Relaxed),
    }
}

/// Whether the products `(b, gelu)` of `w` on an input like `x` (same shape, dtype and
/// device) run as FP8 products that take an input quantized ahead ([`linear_rows`]):
/// CUDA, mold's kernels, a GPU and shapes cuBLASLt takes.
pub fn takes_rows(
    x: &Tensor,
    w: &Fp8Weight,
    products: &[(Option<&Tensor>, bool)],
    k: Kernels,
) -> bool {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && k.uses_libraries() && options().quantize_in_norm {
        return products.iter().all(|&(b, gelu)| {
            cuda::products_apply(x, w, b, gelu).is_ok()
                || (gelu && cuda::products_apply(x, w, b, false).is_ok())
        });
    }
    let _ = (x, w, products, k);
    false
}

/// `act(x Wᵀ + b)` for an input quantized ahead: one FP8 product on CUDA (the GELU in mold's
/// pass after where cuBLASLt has no GELU epilogue for it); where no FP8 product runs, the
/// input widened back and [`linear`]'s paths. That fallback is not bit for bit what the
/// unquantized input would give (a weight-only product then multiplies the widened e4m3
/// values, not the bf16 ones): it is taken only where cuBLASLt refuses a shape on its first
/// product, which [`takes_rows`] answers from then on. Off the GPU the product is emulated
/// on the rows as they are ([`linear_rows_reference`]).
pub fn linear_rows(
    x: &Fp8Rows,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
    k: Kernels,
) -> CResult<Tensor> {
    if !x.rows.q.device().is_cuda() {
        return linear_rows_reference(x, w, b, gelu);
    }
    #[cfg(feature = "cuda")]
    if k.uses_libraries() {
        for epilogue_gelu in [gelu, false] {
            if cuda::rows_apply(x, w, b, epilogue_gelu).is_ok() {
                match cuda::linear_rows(x, w, b, epilogue_gelu) {
                    Ok(y) => {
                        PRODUCTS.fetch_add(1, Ordering::Relaxed);
                        return if gelu && !epilogue_gelu {
                            super::ops::bias_act(&y, None, true, k)
                        } else {
                            Ok(y)
                        };
                    }
                    // Not a refusal cuBLASLt's first answer recorded: a failure.
                    Err(e) if cuda::rows_apply(x, w, b, epilogue_gelu).is_ok() => return Err(e),
                    Err(_) => {}
                }
            }
            if !gelu {
                break;
            }
        }
    }
    linear(&x.dequantize()?, w, b, gelu, k)
}

/// `x` quantized to e4m3 per row (last dimension) and widened back to f32: what an FP8
/// product sees of its input (the CPU emulation of kernels/fp8.cu).
pub fn fake_quantize_rows(x: &Tensor) -> CResult<Tensor> {
    let k = x.dim(D::Minus1)?;
    let data = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let (q, s) = quantize_slice(&data, k);
    let out: Vec<f32> = q
        .par_chunks(k.max(1))
        .zip(s.par_iter())
        .flat_map_iter(|(row, sc)| row.iter().map(move |v| v.to_f32() * sc))
        .collect();
    Tensor::from_vec(out, x.dims(), &Device::Cpu)?.to_device(x.device())
}

/// `x` rounded to e4m3 with one scale for the whole tensor (its largest magnitude maps to
/// 448) and widened back, in f32 on the host, returned in f32 on `x`'s device: what FP8
/// attention sees of q, k and v (the CPU emulation of kernels/fp8.cu's `quantize3`).
pub fn fake_quantize_tensor(x: &Tensor) -> CResult<Tensor> {
    let amax = amax_host(x)?;
    widen_host(&quantize_host(x, amax)?, row_scale(amax).1)
}

/// The largest magnitude of `x`'s values (NaN skipped), on the host: FP8 attention's amax
/// of q, k or v in the CPU emulation.
pub fn amax_host(x: &Tensor) -> CResult<f32> {
    let data = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(data.iter().fold(0f32, |m, v| m.max(v.abs())))
}

/// `x` rounded to e4m3 with the scale `amax` gives ([`row_scale`]), on the host, returned
/// as F8E4M3 on `x`'s device: what [`fake_quantize_tensor`] widens back.
pub fn quantize_host(x: &Tensor, amax: f32) -> CResult<Tensor> {
    quantize_thirds_host(&x.unsqueeze(0)?, [amax; 3])?.squeeze(0)
}

/// `x` `(a, 3, ..)` rounded to e4m3 with a scale per index of dimension 1 (q's, k's and
/// v's, from their largest magnitudes `amax`, [`row_scale`]), on the host, returned as
/// F8E4M3 on `x`'s device: the CPU emulation of kernels/fp8.cu's `quantize_thirds` (the q/k/v
/// all-to-all's messages).
pub fn quantize_thirds_host(x: &Tensor, amax: [f32; 3]) -> CResult<Tensor> {
    let dims = x.dims().to_vec();
    if dims.len() < 2 {
        candle_core::bail!("quantizing thirds of a tensor shaped {dims:?}");
    }
    let inner: usize = dims[2..].iter().product();
    let data = x
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let inv = amax.map(|a| row_scale(a).0);
    let q: Vec<F8E4M3> = data
        .par_iter()
        .enumerate()
        .map(|(e, v)| round_e4m3(v * inv[(e / inner.max(1)) % 3]))
        .collect();
    Tensor::from_vec(q, dims, &Device::Cpu)?.to_device(x.device())
}

/// e4m3 values (F8E4M3, any layout) times `descale`, in f32 on the host, returned on their
/// device.
pub fn widen_host(q: &Tensor, descale: f32) -> CResult<Tensor> {
    let dims = q.dims().to_vec();
    let data = q
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<F8E4M3>()?;
    let out: Vec<f32> = data.par_iter().map(|v| v.to_f32() * descale).collect();
    Tensor::from_vec(out, dims, &Device::Cpu)?.to_device(q.device())
}

/// `act(x Wᵀ + b)` emulated: the input quantized per token and widened back, the weight
/// widened, an f32 product, the bias and tanh-GELU in f32, rounded once to `x`'s dtype.
pub fn linear_reference(
    x: &Tensor,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> CResult<Tensor> {
    let xq = fake_quantize_rows(x)?;
    widened_product(&xq, w, b, gelu, x.dtype())
}

/// [`linear_reference`] of an input quantized ahead: its rows widened as they are (no
/// second rounding), then the same f32 product, in the activation's dtype and shape.
pub fn linear_rows_reference(
    x: &Fp8Rows,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
) -> CResult<Tensor> {
    let xq = x.rows.dequantize(DType::F32)?.reshape(x.dims())?;
    widened_product(&xq, w, b, gelu, x.dtype)
}

/// `act(x Wᵀ + b)` in f32 of an f32 input, the weight widened, rounded once to `dtype`.
fn widened_product(
    xq: &Tensor,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
    dtype: DType,
) -> CResult<Tensor> {
    let wd = w.dequantize(DType::F32)?.to_device(xq.device())?;
    let mut y = super::gemm::matmul(xq, &wd)?;
    if let Some(b) = b {
        y = y.broadcast_add(&b.to_dtype(DType::F32)?)?;
    }
    if gelu {
        y = y.gelu()?;
    }
    y.to_dtype(dtype)
}

/// `act(x Wᵀ + b)` for `x` `(…, k)` and an FP8 weight `(n, k)`: FP8 products where the GPU
/// and cuBLASLt take them, weight-only FP8 on other GPUs, the emulation elsewhere (module
/// docs).
pub fn linear(
    x: &Tensor,
    w: &Fp8Weight,
    b: Option<&Tensor>,
    gelu: bool,
    k: Kernels,
) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && k.uses_libraries() {
        // FP8 products take whole rows (a narrowed view of a batch is not contiguous).
        let x = &x.contiguous()?;
        // The first product of each shape and epilogue asks cuBLASLt for an algorithm; a
        // refusal is remembered (products_apply says why from then on) and falls back below.
        let shape = cuda::shape_of(x, w);
        let refused_now = |e: candle_core::Error, bias: bool, gelu: bool| match x.device() {
            candle_core::Device::Cuda(d) => match cuda::device_takes(d, shape, bias, gelu) {
                Err(why) => Ok(why),
                Ok(()) => Err(e),
            },
            _ => Err(e),
        };
        let mut why = match cuda::products_apply(x, w, b, gelu) {
            Ok(()) => match cuda::linear(x, w, b, gelu) {
                Ok(y) => {
                    PRODUCTS.fetch_add(1, Ordering::Relaxed);
                    return Ok(y);
                }
                Err(e) => refused_now(e, b.is_some(), gelu)?,
            },
            Err(why) => why,
        };
        // cuBLASLt without a GELU epilogue for these products: the bias in it, the GELU in
        // mold's pass after.
        if gelu && cuda::products_apply(x, w, b, false).is_ok() {
            match cuda::linear(x, w, b, false) {
                Ok(y) => {
                    PRODUCTS.fetch_add(1, Ordering::Relaxed);
                    return super::ops::bias_act(&y, None, true, k);
                }
                Err(e) => why = refused_now(e, b.is_some(), false)?,
            }
        }
        weight_only_because(why);
        let dense = candle_nn::Linear::new(w.dequantize(x.dtype())?, None);
        return match b {
            Some(b) => super::gemm::linear(x, &dense, b, gelu, k),
            None if !gelu => super::gemm::matmul(x, dense.weight()),
            None => super::gemm::matmul(x, dense.weight())?.gelu(),
        };
    }
    let _ = k;
    EMULATED.fetch_add(1, Ordering::Relaxed);
    linear_reference(x, w, b, gelu)
}

/// `x Wᵀ + b` with the FP8 weight widened to `x`'s dtype and `x` itself not quantized:
/// for products whose input precision reaches every token, the conditioning vector's
/// (the modulation's shift, scale and gate), where the issue asks for bf16 and an FP8
/// product would save nothing (a few rows, run once per window of steps). On CUDA the
/// weight is widened by a kernel and multiplied by cuBLASLt, the bias in its epilogue;
/// elsewhere an f32 product of the dequantized weight, rounded once to `x`'s dtype.
pub fn linear_weight_only(x: &Tensor, w: &Fp8Weight, b: &Tensor, k: Kernels) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && matches!(x.dtype(), DType::BF16 | DType::F16) {
        let dense = candle_nn::Linear::new(w.dequantize(x.dtype())?, None);
        return super::gemm::linear(x, &dense, b, false, k);
    }
    let _ = k;
    let wd = w.dequantize(DType::F32)?.to_device(x.device())?;
    super::gemm::matmul(&x.to_dtype(DType::F32)?, &wd)?
        .broadcast_add(&b.to_dtype(DType::F32)?)?
        .to_dtype(x.dtype())
}

/// `acc + x Wᵀ` with an FP8 weight: accumulated in the product on CUDA (beta = 1, `acc`
/// consumed; it must not share storage), else a product and an add.
pub fn add_linear(acc: Tensor, x: &Tensor, w: &Fp8Weight, k: Kernels) -> CResult<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && k.uses_libraries() {
        // FP8 products take whole rows (a narrowed view of a batch is not contiguous).
        let x = &x.contiguous()?;
        if cuda::accumulate_applies(&acc, x, w) {
            match cuda::accumulate(&acc, x, w) {
                Ok(()) => {
                    PRODUCTS.fetch_add(1, Ordering::Relaxed);
                    return Ok(acc);
                }
                // Refused by cuBLASLt (remembered): `acc` is unchanged; product and add.
                Err(e) => match x.device() {
                    candle_core::Device::Cuda(d)
                        if cuda::device_takes(d, cuda::shape_of(x, w), false, false).is_err() => {}
                    _ => return Err(e),
                },
            }
        }
        return acc + linear(x, w, None, false, k)?;
    }
    acc + linear(x, w, None, false, k)?
}

/// Whether the GPU's q/k/v quantizing pass (`cuda::quantize_qkv`) reads q, k and v (`(b, h, L, d)`, 2-byte values) where they are:
/// one set of strides, each row of `d` values contiguous and every 8-value piece 16-byte
/// aligned (so are the views of the sequence parallel all-to-all's `(L, 3, b, h, d)`
/// buffer); or all three contiguous from a 16-byte boundary.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn views_in_place(layouts: [&candle_core::Layout; 3]) -> bool {
    // A dimension of one value is never stepped along: its stride does not matter (candle
    // leaves any there, and calls such a tensor contiguous).
    let steps = |l: &candle_core::Layout| -> Vec<usize> {
        l.stride()
            .iter()
            .zip(l.dims())
            .map(|(&s, &n)| if n == 1 { 0 } else { s })
            .collect()
    };
    let [ql, ..] = layouts;
    let aligned = |l: &candle_core::Layout| (l.start_offset() * 2).is_multiple_of(16);
    if layouts
        .iter()
        .all(|l| l.is_contiguous() && aligned(l) && l.dims() == ql.dims())
    {
        return true;
    }
    let st = steps(ql);
    st.len() == 4
        && ql.stride()[3] == 1
        && ql.dims()[3].is_multiple_of(8)
        && st[..3].iter().all(|s| s.is_multiple_of(8))
        && layouts
            .iter()
            .all(|l| l.dims() == ql.dims() && steps(l) == st && aligned(l))
}

/// The SMs a GPU of `sms` SMs has its products target when `carveout` of them are left to
/// the work beside them ([`crate::Fp8Options::sm_carveout`]): `sms` less `carveout`, at least
/// one; `None` for none left out (cuBLASLt's own choice) or where the GPU does not say.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn sm_target(sms: i32, carveout: u32) -> Option<i32> {
    (carveout > 0 && sms > 0).then(|| sms.saturating_sub(carveout as i32).max(1))
}

#[cfg(test)]
mod tests;
