//! Scaled-dot-product attention: `softmax(q kᵀ / √d) v` over `(b, heads, L, d)` inputs,
//! returned as `(b, L, heads · d)` — the layout the projection after it needs.
//!
//! On CUDA, for bf16/f16 and head dimensions 64 and 128, a fused kernel computes it
//! without materialising the `L × L` scores and writes the output directly in
//! `(b, L, heads, d)` order: cuDNN's flash-attention engines where libcudnn 9 loads and
//! takes the shape ([`super::cudnn`]), else mold's own FlashAttention-2 style forward
//! (`kernels/flash_attn.cu`, compiled to a fat binary by build.rs). Everywhere else (CPU, f32,
//! other head sizes) the same function runs the unfused composition of candle ops, which
//! is the reference the fused kernels are tested against.
//!
//! `MOLD_KERNELS=candle` forces the unfused path (for comparisons and debugging), `mold`
//! mold's own kernel, `cudnn` requires cuDNN; `fused` makes an unsupported case an error
//! instead of a silent fallback. [`report`] says which ran, and why cuDNN did not.

use super::fp8::Fp8Rows;
use super::mat::Input;
use super::ops::Kernels;
use super::ActivationMeter;
use candle_core::{DType, IndexOp, Tensor, D};
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Attention calls per implementation, and why cuDNN was passed over (process-wide).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttentionReport {
    /// `"cudnn 9.19.0"`, `"mold"`, `"candle"` → calls.
    pub calls: BTreeMap<String, u64>,
    /// Distinct reasons cuDNN did not run a call it was allowed to.
    pub cudnn_refusals: Vec<String>,
}

static REPORT: Mutex<Option<AttentionReport>> = Mutex::new(None);

/// Counts a call of `backend` (none for `None`) and keeps a distinct reason cuDNN passed
/// it over.
fn note_with(backend: Option<&str>, refusal: Option<String>) {
    let mut r = REPORT.lock().unwrap_or_else(|p| p.into_inner());
    let r = r.get_or_insert_with(Default::default);
    if let Some(backend) = backend {
        *r.calls.entry(backend.to_string()).or_default() += 1;
    }
    if let Some(why) = refusal {
        if !r.cudnn_refusals.contains(&why) && r.cudnn_refusals.len() < 8 {
            r.cudnn_refusals.push(why);
        }
    }
}

fn note(backend: &str, refusal: Option<String>) {
    note_with(Some(backend), refusal)
}

/// Which attention implementations ran in this process so far.
pub fn report() -> AttentionReport {
    REPORT
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone()
        .unwrap_or_default()
}

type CResult<T> = candle_core::Result<T>;

/// Whether the fused kernel handles these inputs (device, dtype, head size).
pub fn fused_supported(q: &Tensor) -> bool {
    fused_supported_impl(q)
}

#[cfg(feature = "cuda")]
fn fused_supported_impl(q: &Tensor) -> bool {
    q.device().is_cuda()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && matches!(q.dim(D::Minus1), Ok(64) | Ok(128))
        && q.rank() == 4
}

#[cfg(not(feature = "cuda"))]
fn fused_supported_impl(_q: &Tensor) -> bool {
    false
}

/// Whether cuDNN's FP8 attention can run on `device` (CUDA, Hopper or later, cuDNN
/// loaded); the shape is not checked.
pub fn fp8_attention_available(device: &candle_core::Device) -> bool {
    fp8_available_impl(device)
}

#[cfg(feature = "cuda")]
fn fp8_available_impl(device: &candle_core::Device) -> bool {
    let candle_core::Device::Cuda(dev) = device else {
        return false;
    };
    let (major, _) = dev
        .cuda_stream()
        .context()
        .compute_capability()
        .unwrap_or((0, 0));
    major >= 9 && super::cudnn::version().is_ok()
}

#[cfg(not(feature = "cuda"))]
fn fp8_available_impl(_: &candle_core::Device) -> bool {
    false
}

/// Attention with an explicit implementation choice.
pub fn attention_with(
    kernels: Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meter: &ActivationMeter,
) -> CResult<Tensor> {
    let supported = fused_supported(q);
    let mut refusal = None;
    if supported && kernels.uses_libraries() {
        match cudnn_attention(q, k, v)? {
            Ok((out, version)) => {
                meter.see(&out);
                note(&version, None);
                return out.flatten_from(2);
            }
            Err(why) if kernels == Kernels::Cudnn => candle_core::bail!(
                "MOLD_KERNELS=cudnn: cuDNN cannot run this attention ({why}); unset MOLD_KERNELS to fall back to mold's kernel"
            ),
            Err(why) => refusal = Some(why),
        }
    } else if kernels == Kernels::Cudnn {
        candle_core::bail!(
            "MOLD_KERNELS=cudnn: cuDNN attention needs a CUDA build, a CUDA bf16/f16 tensor and head size 64 or 128; unset MOLD_KERNELS to fall back"
        );
    }
    if kernels.use_fused(supported, "attention (head size 64 or 128, bf16/f16)")? {
        note("mold", refusal);
        fused_attention(q, k, v, meter)
    } else {
        note("candle", refusal);
        unfused_attention(q, k, v, meter)
    }
}

/// `softmax(q kᵀ · scale + bias) v` in cuDNN's fused attention where `kernels` allow
/// libraries and cuDNN takes it: `q`, `k`, `v` `(b, h, L, d)` bf16/f16 on a GPU, `bias`
/// `(h, Lq, row)` of q's dtype (T5's relative-position bias) or `(1, Lq, row)` shared by
/// the heads (a causal mask), of which each row's first `Lk` are read (`row` ≥ `Lk`: rows
/// padded to 16 bytes); the output `(b, Lq, h·d)`.
/// `None` where it does not run here (a CPU build or tensor, another dtype, cuDNN absent or
/// refusing the shape: the reason is kept for the run's report): the caller computes it.
pub fn biased_attention(
    kernels: Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f32,
) -> CResult<Option<Tensor>> {
    if !(fused_supported(q) && kernels.uses_libraries()) {
        return Ok(None);
    }
    match cudnn_biased(q, k, v, bias, scale)? {
        Ok((out, version)) => {
            note(&version, None);
            Ok(Some(out.flatten_from(2)?))
        }
        Err(why) => {
            note("candle", Some(why));
            Ok(None)
        }
    }
}

#[cfg(feature = "cuda")]
fn cudnn_biased(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f32,
) -> CResult<Result<(Tensor, String), String>> {
    let version = match super::cudnn::version() {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    Ok(super::cudnn::attention_biased(q, k, v, bias, scale)?
        .map(|(t, form)| (t, format!("cudnn {version} ({form}, biased)"))))
}

#[cfg(not(feature = "cuda"))]
fn cudnn_biased(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: f32,
) -> CResult<Result<(Tensor, String), String>> {
    Ok(Err("a CPU build".into()))
}

/// cuDNN's attention and its version, or why it cannot run here.
#[cfg(feature = "cuda")]
fn cudnn_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> CResult<Result<(Tensor, String), String>> {
    let version = match super::cudnn::version() {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    Ok(super::cudnn::attention(q, k, v)?.map(|(t, form)| (t, format!("cudnn {version} ({form})"))))
}

#[cfg(not(feature = "cuda"))]
fn cudnn_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
) -> CResult<Result<(Tensor, String), String>> {
    Ok(Err("a CPU build".into()))
}

/// Attention with q, k, v and the probabilities in FP8 (`MOLD_FP8_ATTENTION=on`, FP8
/// blocks): on CUDA, where cuDNN's FP8 flash attention takes the shape (Hopper and later,
/// bf16/f16, head size 64 or 128; `kernels` allowing libraries), q, k and v are quantized to
/// e4m3 with one scale each (the largest magnitude of each tensor maps to 448; on the GPU,
/// no copy to the host) and cuDNN runs it; its output, e4m3 on Hopper with v's
/// scale (each output value is an average of v's), is returned as it is, as the rows the
/// output projection's FP8 product takes ([`Input::Fp8`], every token with v's scale: no
/// widening, and no second rounding by the projection's own quantizing pass). Where cuDNN
/// cannot (before Hopper, no engine for the shape, f32, other head sizes, `MOLD_KERNELS`
/// without libraries), attention runs as [`attention_with`] would, the reason kept in
/// [`report`], and the output is [`Input::Dense`]. On the CPU [`fp8_attention_rows_reference`]
/// emulates its precision.
///
/// `amax`: q's, k's and v's largest magnitudes as partial maxima `(3, parts, stride)` f32
/// where the q/k/v preparation took them while writing the three
/// ([`super::ops::qkv_prep_fused_amax`]); then the quantization is one pass, not two.
pub fn fp8_attention(
    kernels: Kernels,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    amax: Option<&Tensor>,
    meter: &ActivationMeter,
) -> CResult<Input> {
    let supported = fused_supported(q);
    let dense = || attention_with(kernels, q, k, v, meter).map(Input::Dense);
    if supported && kernels.uses_libraries() {
        match cudnn_fp8_attention(q, k, v, amax)? {
            Ok((out, backend)) => {
                meter.see(out.rows().values());
                note(&backend, None);
                return Ok(Input::Fp8(out));
            }
            Err(why) => {
                refused(format!("FP8 attention: {why}"));
                return dense();
            }
        }
    }
    if supported {
        refused(format!(
            "FP8 attention: needs cuDNN (MOLD_KERNELS={kernels:?} runs attention without it)"
        ));
        return dense();
    }
    if q.device().is_cuda() {
        // f32, or a head size cuDNN's kernels do not take: the emulation would build the
        // scores on the host.
        refused("FP8 attention: needs bf16/f16 and head size 64 or 128".into());
        return dense();
    }
    note("emulated FP8", None);
    fp8_attention_rows_reference(q, k, v, meter).map(Input::Fp8)
}

/// Keeps a reason cuDNN did not run a call, without counting a call.
fn refused(why: String) {
    note_with(None, Some(why))
}

#[cfg(feature = "cuda")]
fn cudnn_fp8_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    amax: Option<&Tensor>,
) -> CResult<Result<(Fp8Rows, String), String>> {
    let version = match super::cudnn::version() {
        Ok(v) => v,
        Err(e) => return Ok(Err(e)),
    };
    if k.dims() != q.dims() || v.dims() != q.dims() {
        return Ok(Err(format!(
            "q {:?}, k {:?}, v {:?}: FP8 attention here is self-attention",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    // The plan first (Hopper, an engine for this shape): nothing is quantized for a call
    // cuDNN will not run.
    let plan = match super::cudnn::fp8_attention_plan(q)? {
        Ok(p) => p,
        Err(why) => return Ok(Err(why)),
    };
    // Every token's scale is v's descale: the quantizing kernel writes it per token too. It
    // reads q, k and v where they are (under sequence parallelism, strided views of the
    // all-to-all's buffer) and writes them contiguous, as the plan reads them.
    let (qkv, scales, s) = super::fp8::cuda::quantize_qkv(q, k, v, amax)?;
    let o = plan.run(&qkv, &scales)?; // (b, L, h, d) e4m3
    let (b, l, h, d) = o.dims4()?;
    Ok(Ok((
        Fp8Rows::new(o.reshape((b * l, h * d))?, s, &[b, l, h * d], q.dtype())?,
        format!("cudnn {version} (FP8 SDPA)"),
    )))
}

#[cfg(not(feature = "cuda"))]
fn cudnn_fp8_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: Option<&Tensor>,
) -> CResult<Result<(Fp8Rows, String), String>> {
    Ok(Err("a CPU build".into()))
}

/// FP8 attention's precision emulated (in f32 on the host, materialising the `L × L`
/// scores; for tests and the CPU): q, k and v each rounded to e4m3 with one scale per
/// tensor and widened back, exact scores and softmax, the probabilities rounded to e4m3
/// at scale 448 (their largest possible value, 1, maps to 448) and widened back, the
/// product with v rounded to e4m3 with v's scale (as Hopper's kernels write it), widened
/// to q's dtype: [`fp8_attention_rows_reference`]'s rows widened.
pub fn fp8_attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meter: &ActivationMeter,
) -> CResult<Tensor> {
    fp8_attention_rows_reference(q, k, v, meter)?.dequantize()
}

/// FP8 attention's output emulated as [`fp8_attention`] hands it to the projection on
/// Hopper: its e4m3 values `(b · L, heads · d)` on q's device, every token with v's scale
/// (the roundings of [`fp8_attention_reference`]). What cuDNN's kernel rounds, not its
/// bits: it rounds each tile's probabilities before the softmax is normalised.
pub fn fp8_attention_rows_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meter: &ActivationMeter,
) -> CResult<Fp8Rows> {
    use super::fp8::{amax_host, quantize_host};
    let amax = [amax_host(q)?, amax_host(k)?, amax_host(v)?];
    let (q8, k8, v8) = (
        quantize_host(q, amax[0])?,
        quantize_host(k, amax[1])?,
        quantize_host(v, amax[2])?,
    );
    fp8_attention_quantized_reference(&q8, &k8, &v8, amax, q.dtype(), meter)
}

/// [`fp8_attention_rows_reference`] of q, k and v already in e4m3 (`(b, h, L, d)` F8E4M3,
/// views or not), each with the scale its largest magnitude `amax[i]` gives
/// ([`super::fp8::row_scale`]): under sequence parallelism every rank's q, k and v are
/// quantized with the scales the group agreed on and sent in e4m3 (`sequence::start`).
/// The output rows carry v's scale; `dtype` is the activations'.
pub fn fp8_attention_quantized_reference(
    q8: &Tensor,
    k8: &Tensor,
    v8: &Tensor,
    amax: [f32; 3],
    dtype: DType,
    meter: &ActivationMeter,
) -> CResult<Fp8Rows> {
    use super::fp8::{round_e4m3, row_scale, widen_host, E4M3_MAX};
    let dev = q8.device().clone();
    let (q, k, v) = (
        widen_host(q8, row_scale(amax[0]).1)?,
        widen_host(k8, row_scale(amax[1]).1)?,
        widen_host(v8, row_scale(amax[2]).1)?,
    );
    let dim = q.dim(D::Minus1)?;
    let scale = 1.0 / (dim as f64).sqrt();
    let (b, h, lq, _) = q.dims4()?;
    let q = q.flatten_to(1)?;
    let k = k.flatten_to(1)?;
    let v = v.flatten_to(1)?;
    let weights = (q.matmul(&k.t()?)? * scale)?;
    meter.see(&weights);
    let p = candle_nn::ops::softmax_last_dim(&weights)?;
    let dims = p.dims().to_vec();
    let p8: Vec<f32> = p
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| round_e4m3(x * E4M3_MAX).to_f32() / E4M3_MAX)
        .collect();
    let p8 = Tensor::from_vec(p8, dims, p.device())?;
    let out = p8.matmul(&v)?; // (b·h, Lq, d)
                              // The output's scale is v's: each value is an average of v's (as the GPU takes it).
    let (inv, s) = row_scale(amax[2]);
    // (b, Lq, h, d): the tokens' rows.
    let out = out.reshape((b, h, lq, dim))?.transpose(1, 2)?;
    let o8: Vec<_> = out
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| round_e4m3(x * inv))
        .collect();
    let rows = b * lq;
    let o8 = Tensor::from_vec(o8, (rows, h * dim), &candle_core::Device::Cpu)?.to_device(&dev)?;
    let scales =
        Tensor::from_vec(vec![s; rows], rows, &candle_core::Device::Cpu)?.to_device(&dev)?;
    Fp8Rows::new(o8, scales, &[b, lq, h * dim], dtype)
}

/// FP8 attention over q, k and v sent in e4m3 (sequence parallelism,
/// `sequence::start`): `all` the all-to-all's receive buffer `(L, 3, b, h, d)` of e4m3
/// values, read in place, quantized with the scales `scales` gives. Returns the output
/// `(b, L, h · d)` in e4m3 with v's scale (every token's, [`Fp8Scales::v_descale`]). On CUDA
/// cuDNN's FP8 attention (an error where it cannot run: the group chose this path because
/// every rank's GPU takes it); on the CPU [`fp8_attention_quantized_reference`].
pub fn fp8_attention_tokens(
    all: &Tensor,
    scales: &Fp8Scales,
    dtype: DType,
    meter: &ActivationMeter,
) -> CResult<Tensor> {
    let (l, _, b, h, d) = all.dims5()?;
    // (b, h, L, d) views of the (L, 3, b, h, d) buffer.
    let part = |i: usize| all.i((.., i))?.permute((1, 2, 0, 3));
    let out = match scales {
        Fp8Scales::Host(amax) => {
            let rows = fp8_attention_quantized_reference(
                &part(0)?,
                &part(1)?,
                &part(2)?,
                *amax,
                dtype,
                meter,
            )?;
            note("emulated FP8", None);
            rows.rows().values().reshape((b, l, h * d))?
        }
        Fp8Scales::Device { scales, .. } => {
            let out = cudnn_fp8_tokens(all, scales, (b, h, l, d), dtype)?;
            meter.see(&out);
            out
        }
    };
    Ok(out)
}

/// The scales of q, k and v sent in e4m3 under sequence parallelism, one per tensor,
/// agreed by the group (`sequence::start`).
#[derive(Clone, Debug)]
pub enum Fp8Scales {
    /// On the GPU: the [`super::fp8`] `QKV_SCALES` floats cuDNN's FP8 attention takes
    /// (q's, k's, v's descales, ...), and v's descale once per row of the rank's output.
    Device { scales: Tensor, v_tokens: Tensor },
    /// On the host (the CPU emulation): q's, k's and v's largest magnitudes.
    Host([f32; 3]),
}

impl Fp8Scales {
    /// v's descale for each of `rows` rows of the attention output, on `device`.
    pub fn v_descale(&self, rows: usize, device: &candle_core::Device) -> CResult<Tensor> {
        match self {
            Fp8Scales::Device { v_tokens, .. } => {
                if v_tokens.dims() != [rows] {
                    candle_core::bail!(
                        "FP8 attention: {:?} token scales for {rows} rows",
                        v_tokens.dims()
                    );
                }
                Ok(v_tokens.clone())
            }
            Fp8Scales::Host(amax) => {
                let s = super::fp8::row_scale(amax[2]).1;
                Tensor::from_vec(vec![s; rows], rows, &candle_core::Device::Cpu)?.to_device(device)
            }
        }
    }
}

#[cfg(feature = "cuda")]
fn cudnn_fp8_tokens(
    all: &Tensor,
    scales: &Tensor,
    dims: (usize, usize, usize, usize),
    dtype: DType,
) -> CResult<Tensor> {
    use super::cudnn::{fp8_attention_plan_for, Fp8Layout};
    let version = super::cudnn::version().map_err(candle_core::Error::msg)?;
    let plan =
        fp8_attention_plan_for(dims, dtype, all.device(), Fp8Layout::Tokens)?.map_err(|why| {
            candle_core::Error::Msg(format!(
                "FP8 attention on q, k and v sent in e4m3: cuDNN cannot run it here ({why}); \
                 plan without `attention: fp8` (`mold plan` without --fp8-attention)"
            ))
        })?;
    let o = plan.run(all, scales)?; // (b, L, h, d) e4m3
    note(&format!("cudnn {version} (FP8 SDPA)"), None);
    let (b, h, l, d) = dims;
    o.reshape((b, l, h * d))
}

#[cfg(not(feature = "cuda"))]
fn cudnn_fp8_tokens(
    _: &Tensor,
    _: &Tensor,
    _: (usize, usize, usize, usize),
    _: DType,
) -> CResult<Tensor> {
    candle_core::bail!("FP8 attention on the GPU: a CPU build")
}

/// The composition of candle ops (materialises the `L × L` scores).
pub fn unfused_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    meter: &ActivationMeter,
) -> CResult<Tensor> {
    let dim = q.dim(D::Minus1)?;
    let scale = 1.0 / (dim as f64).sqrt();
    let mut batch_dims = q.dims().to_vec();
    batch_dims.pop();
    batch_dims.pop();
    let q = q.flatten_to(batch_dims.len() - 1)?;
    let k = k.flatten_to(batch_dims.len() - 1)?;
    let v = v.flatten_to(batch_dims.len() - 1)?;
    let weights = (q.matmul(&k.t()?)? * scale)?;
    meter.see(&weights);
    let scores = candle_nn::ops::softmax_last_dim(&weights)?.matmul(&v)?;
    batch_dims.push(scores.dim(D::Minus2)?);
    batch_dims.push(scores.dim(D::Minus1)?);
    scores.reshape(batch_dims)?.transpose(1, 2)?.flatten_from(2)
}

#[cfg(feature = "cuda")]
fn fused_attention(q: &Tensor, k: &Tensor, v: &Tensor, meter: &ActivationMeter) -> CResult<Tensor> {
    let (_, _, _, d) = q.dims4()?;
    let scale_log2 = (1.0 / (d as f64).sqrt() * std::f64::consts::LOG2_E) as f32;
    let out = q.contiguous()?.apply_op3_no_bwd(
        &k.contiguous()?,
        &v.contiguous()?,
        &cuda::FlashAttn { scale_log2 },
    )?;
    meter.see(&out);
    out.flatten_from(2)
}

#[cfg(not(feature = "cuda"))]
fn fused_attention(q: &Tensor, k: &Tensor, v: &Tensor, meter: &ActivationMeter) -> CResult<Tensor> {
    unfused_attention(q, k, v, meter)
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute_enum;
    use candle_core::cuda::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
    use candle_core::cuda::{CudaDType, CudaStorage, WrapErr};
    use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape};
    use half::{bf16, f16};

    const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/flash_attn.fatbin"));
    const MODULE: &str = "mold_flash_attn";
    /// Must match kernels/flash_attn.cu.
    const BLOCK_M: usize = 128;
    const BLOCK_N: usize = 64;
    const THREADS: u32 = 256;

    pub struct FlashAttn {
        pub scale_log2: f32,
    }

    impl CustomOp3 for FlashAttn {
        fn name(&self) -> &'static str {
            "mold-flash-attention"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> candle_core::Result<(CpuStorage, Shape)> {
            candle_core::bail!("mold-flash-attention runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            q: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            match q.dtype() {
                DType::BF16 => self.launch::<bf16>("bf16", q, ql, k, kl, v, vl),
                DType::F16 => self.launch::<f16>("f16", q, ql, k, kl, v, vl),
                dt => candle_core::bail!("mold-flash-attention: unsupported dtype {dt:?}"),
            }
        }
    }

    impl FlashAttn {
        #[allow(clippy::too_many_arguments)]
        fn launch<T: CudaDType + DeviceRepr>(
            &self,
            tname: &str,
            q: &CudaStorage,
            ql: &Layout,
            k: &CudaStorage,
            kl: &Layout,
            v: &CudaStorage,
            vl: &Layout,
        ) -> candle_core::Result<(CudaStorage, Shape)> {
            let (b, h, lq, d) = ql.shape().dims4()?;
            let (kb, kh, lk, kd) = kl.shape().dims4()?;
            if (kb, kh, kd) != (b, h, d) || vl.shape() != kl.shape() {
                candle_core::bail!(
                    "mold-flash-attention: q {:?}, k {:?}, v {:?} do not agree",
                    ql.shape(),
                    kl.shape(),
                    vl.shape()
                );
            }
            for (n, l) in [("q", ql), ("k", kl), ("v", vl)] {
                if !l.is_contiguous() {
                    candle_core::bail!("mold-flash-attention: {n} is not contiguous");
                }
            }
            let dev = &q.device;
            let func = dev
                .get_or_load_custom_fatbin(&format!("mold_flash_fwd_{tname}_d{d}"), MODULE, FATBIN)?
                .into_cuda_function();
            let smem = (BLOCK_M + 4 * BLOCK_N) * d * 2;
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .w()?;
            let qs = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
            let ks = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
            let vs = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
            // SAFETY: every element is written by the kernel (rows < lq, all d).
            let out = unsafe { dev.alloc::<T>(b * lq * h * d)? };
            let cfg = LaunchConfig {
                grid_dim: (lq.div_ceil(BLOCK_M) as u32, h as u32, b as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            let (hi, lqi, lki) = (h as i32, lq as i32, lk as i32);
            let stream = dev.cuda_stream();
            let mut args = stream.launch_builder(&func);
            args.arg(&qs)
                .arg(&ks)
                .arg(&vs)
                .arg(&out)
                .arg(&hi)
                .arg(&lqi)
                .arg(&lki)
                .arg(&self.scale_log2);
            // SAFETY: argument types and order match the kernel's signature.
            unsafe { args.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from((b, lq, h, d)),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn unfused_matches_naive_softmax() {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (1, 2, 5, 4), &dev).unwrap();
        let k = Tensor::randn(0f32, 1., (1, 2, 7, 4), &dev).unwrap();
        let v = Tensor::randn(0f32, 1., (1, 2, 7, 4), &dev).unwrap();
        let meter = ActivationMeter::default();
        let out = attention_with(Kernels::Auto, &q, &k, &v, &meter).unwrap();
        assert_eq!(out.dims(), &[1, 5, 8]);
        // Row (h=1, i=3) by hand.
        let qv: Vec<f32> = q
            .get(0)
            .unwrap()
            .get(1)
            .unwrap()
            .get(3)
            .unwrap()
            .to_vec1()
            .unwrap();
        let kv: Vec<Vec<f32>> = k.get(0).unwrap().get(1).unwrap().to_vec2().unwrap();
        let vv: Vec<Vec<f32>> = v.get(0).unwrap().get(1).unwrap().to_vec2().unwrap();
        let s: Vec<f32> = kv
            .iter()
            .map(|kr| kr.iter().zip(&qv).map(|(a, b)| a * b).sum::<f32>() / 2.0)
            .collect();
        let m = s.iter().cloned().fold(f32::MIN, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        let want: Vec<f32> = (0..4)
            .map(|c| e.iter().zip(&vv).map(|(p, vr)| p * vr[c]).sum::<f32>() / z)
            .collect();
        let got: Vec<f32> = out.get(0).unwrap().get(3).unwrap().to_vec1().unwrap();
        for c in 0..4 {
            assert!((got[4 + c] - want[c]).abs() < 1e-5, "{got:?} vs {want:?}");
        }
        assert_eq!(meter.largest(), 2 * 5 * 7 * 4);
    }

    /// FP8 attention's emulation rounds q, k, v and the probabilities to e4m3: close to the
    /// exact attention (FP8's few percent) but not equal to it; and it is what
    /// [`fp8_attention`] runs where cuDNN does not (CPU, f32), counted in the report.
    #[test]
    fn fp8_attention_is_attention_within_fp8_s_rounding() {
        let dev = Device::Cpu;
        // Fixed inputs in [-1, 1) (a 64-bit LCG), v 4× wider than q and k.
        let make = |seed: u64, scale: f32| {
            let mut s = seed;
            let v: Vec<f32> = (0..2 * 3 * 33 * 16)
                .map(|_| {
                    s = s
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
                })
                .collect();
            Tensor::from_vec(v, (2, 3, 33, 16), &dev).unwrap()
        };
        let (q, k, v) = (make(1, 1.0), make(2, 1.0), make(3, 4.0));
        let meter = ActivationMeter::default();
        let exact = unfused_attention(&q, &k, &v, &meter).unwrap();
        let emulated = fp8_attention_reference(&q, &k, &v, &meter).unwrap();
        assert_eq!(emulated.dims(), exact.dims());
        let err = crate::verify::max_relative_error(&emulated, &exact).unwrap();
        // e4m3 keeps 3 bits of mantissa: each operand, the probabilities and the output
        // within 6.25 % (the output rounded last, with v's scale): a few percent of the
        // largest value, not the O(1) of a wrong computation, and not 0.
        assert!(
            err > 1e-3 && err < 0.1,
            "FP8 attention against exact: {err}"
        );
        let before = report().calls.get("emulated FP8").copied().unwrap_or(0);
        let ran = fp8_attention(Kernels::Auto, &q, &k, &v, None, &meter).unwrap();
        // Its e4m3 rows, as the projection after it takes them.
        assert!(matches!(ran, Input::Fp8(_)));
        assert_eq!(
            crate::verify::max_relative_error(&ran.widen().unwrap(), &emulated).unwrap(),
            0.0
        );
        assert!(report().calls["emulated FP8"] > before);
    }

    /// One scale for a whole tensor: every value rounds to the e4m3 step of its own
    /// magnitude, the largest exactly to ±448 · scale.
    #[test]
    fn a_tensor_quantizes_with_one_scale() {
        let x = Tensor::new(&[[3.0f32, -0.1, 1e-3], [0.37, 2.9, -3.5]], &Device::Cpu).unwrap();
        let got: Vec<Vec<f32>> = crate::model::fp8::fake_quantize_tensor(&x)
            .unwrap()
            .to_vec2()
            .unwrap();
        let s = 3.5f32 / 448.0;
        assert_eq!(got[1][2], -3.5);
        for (g, want) in got
            .iter()
            .flatten()
            .zip([3.0f32, -0.1, 1e-3, 0.37, 2.9, -3.5])
        {
            let step = crate::model::fp8::round_e4m3(want / s).to_f32() * s;
            assert_eq!(*g, step);
            assert!(
                (g - want).abs() <= want.abs() / 16.0 + s / 512.0,
                "{g} vs {want}"
            );
        }
    }

    #[test]
    fn forced_fused_is_refused_where_unsupported() {
        let q = Tensor::zeros((1, 1, 3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let meter = ActivationMeter::default();
        let err = attention_with(Kernels::Fused, &q, &q, &q, &meter).unwrap_err();
        assert!(err.to_string().contains("MOLD_KERNELS=fused"), "{err}");
        let err = attention_with(Kernels::Cudnn, &q, &q, &q, &meter).unwrap_err();
        assert!(err.to_string().contains("MOLD_KERNELS=cudnn"), "{err}");
    }

    #[test]
    fn the_report_counts_what_ran() {
        let q = Tensor::zeros((1, 1, 3, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let meter = ActivationMeter::default();
        let before = report().calls.get("candle").copied().unwrap_or(0);
        attention_with(Kernels::Mold, &q, &q, &q, &meter).unwrap();
        attention_with(Kernels::Auto, &q, &q, &q, &meter).unwrap();
        // Other tests may run attention concurrently: at least our two calls were counted.
        assert!(report().calls["candle"] >= before + 2);
    }
}
