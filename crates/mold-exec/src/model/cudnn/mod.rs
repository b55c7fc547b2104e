//! Attention through cuDNN's fused flash-attention engines, and channels-last 2-D
//! convolutions ([`conv2d_nhwc`], the FLUX autoencoder's), on CUDA builds.
//!
//! On Hopper cuDNN 9's SDPA engines run FLUX's attention at about twice the rate of mold's
//! own FlashAttention-2 style kernel (measured beside PyTorch's SDPA on H200: BENCHMARKS.md).
//! cuDNN is loaded at run time ([`ffi`]); per device mold keeps one cuDNN handle and the
//! finalised plan of every attention shape it has seen ([`graph`]). A shape no engine takes,
//! or a machine without cuDNN, makes [`attention`] answer `Ok(Err(reason))`, the reason kept
//! for the run's report; the caller then runs mold's kernel.

pub mod conv;
mod ffi;
mod graph;

use crate::model::cells::Cells;
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::DevicePtr;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

type CResult<T> = candle_core::Result<T>;

/// A device's cuDNN state: its handle and the plans built on it.
struct DeviceState {
    handle: ffi::Handle,
    /// The GPU's name and compute capability: part of a kept plan's key.
    gpu: String,
    plans: HashMap<graph::Key, Result<Arc<graph::Plan>, String>>,
    convs: HashMap<conv::Key, Result<Arc<conv::Plan>, String>>,
}

// SAFETY: the handle is only used with this state's lock held.
unsafe impl Send for DeviceState {}

/// The device's cuDNN state, made on first use ([`Cells`]: the ranks of a multi-GPU plan
/// create their handles at once; a failed cudnnCreate is tried again on the next call).
fn state(
    ordinal: usize,
    ctx: &candle_core::cuda::cudarc::driver::CudaContext,
) -> Result<Arc<Mutex<DeviceState>>, String> {
    static D: Cells<usize, DeviceState> = Cells::new();
    D.get_or_make(ordinal, || create_state(ordinal, ctx))
}

fn create_state(
    ordinal: usize,
    ctx: &candle_core::cuda::cudarc::driver::CudaContext,
) -> Result<DeviceState, String> {
    let api = ffi::api()?;
    ctx.bind_to_thread()
        .map_err(|e| format!("cuda:{ordinal}: {e}"))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: out-pointer; the device's context is current on this thread.
    let st = unsafe { (api.create)(&mut handle) };
    if st != ffi::STATUS_SUCCESS {
        return Err(api.error(&format!("cudnnCreate on cuda:{ordinal}"), st));
    }
    let (major, minor) = ctx.compute_capability().unwrap_or((0, 0));
    let gpu = format!(
        "{} sm_{major}{minor}",
        ctx.name().unwrap_or_else(|_| format!("cuda:{ordinal}"))
    );
    Ok(DeviceState {
        handle,
        gpu,
        plans: HashMap::new(),
        convs: HashMap::new(),
    })
}

/// cuDNN's entry points and the device's state, locked, its handle queueing on `stream`
/// (candle's) with the stream's context current on this thread: what running a plan needs.
fn on_stream<'a>(
    state: &'a Mutex<DeviceState>,
    stream: &candle_core::cuda::cudarc::driver::CudaStream,
) -> CResult<(&'static ffi::Api, std::sync::MutexGuard<'a, DeviceState>)> {
    let api = ffi::api().map_err(candle_core::Error::msg)?;
    let s = state.lock().unwrap_or_else(|p| p.into_inner());
    stream.context().bind_to_thread().w()?;
    // SAFETY: the handle is this device's, the stream is the one candle queues on.
    let st = unsafe { (api.set_stream)(s.handle, stream.cu_stream().cast()) };
    if st != ffi::STATUS_SUCCESS {
        candle_core::bail!("{}", api.error("cudnnSetStream", st));
    }
    Ok((api, s))
}

/// cuDNN's version, or why it cannot be used on this machine.
pub fn version() -> Result<String, String> {
    ffi::api().map(|a| a.version_string())
}

/// `softmax(q kᵀ · scale) v` for `(b, h, L, d)` bf16/f16 CUDA tensors (read in place where
/// each row of `d` is contiguous and the other strides aligned, else copied), returned as
/// `(b, L, h, d)`, with which graph ran (`"fused SDPA"` or `"composite SDPA"`); the reason
/// when cuDNN cannot run it here.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> CResult<Result<(Tensor, &'static str), String>> {
    let d = q.dim(3)?;
    attention_with(q, k, v, None, (1.0 / (d as f64).sqrt()) as f32)
}

/// `softmax(q kᵀ · scale + bias) v`, as [`attention`] with an additive bias of q's dtype
/// shared by the batch and the scale given: `(h, Lq, row)` or `(1, Lq, row)` (shared by
/// the heads), or the same with a leading 1, contiguous, of which each row's first `Lk`
/// are read (`row` ≥ `Lk`: rows may be padded to keep them 16-byte aligned). T5's
/// attention (relative-position bias, no scaling) and causal attention (a mask) in one
/// fused kernel.
pub fn attention_biased(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: &Tensor,
    scale: f32,
) -> CResult<Result<(Tensor, &'static str), String>> {
    let (_, h, lq, _) = q.dims4()?;
    let lk = k.dim(2)?;
    let dims = bias.dims();
    let (heads, rows, row) = match dims {
        [a, b, c] | [1, a, b, c] => (*a, *b, *c),
        _ => candle_core::bail!("cudnn-attention: the bias is {dims:?}, not (h, Lq, Lk)"),
    };
    if !(heads == 1 || heads == h) || rows != lq || row < lk {
        candle_core::bail!(
            "cudnn-attention: the bias is {dims:?} for {h} heads, {lq} queries and {lk} keys"
        );
    }
    if bias.dtype() != q.dtype() {
        return Ok(Err(format!(
            "bias dtype {:?} is not q's {:?}",
            bias.dtype(),
            q.dtype()
        )));
    }
    let bias = bias.reshape((1, heads, lq, row))?.contiguous()?;
    let shape = graph::BiasShape {
        heads: heads as i64,
        row: row as i64,
    };
    attention_with(q, k, v, Some((&bias, shape)), scale)
}

fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    bias: Option<(&Tensor, graph::BiasShape)>,
    scale: f32,
) -> CResult<Result<(Tensor, &'static str), String>> {
    let (b, h, lq, d) = q.dims4()?;
    let (_, _, lk, _) = k.dims4()?;
    let dtype = match q.dtype() {
        DType::BF16 => ffi::DATA_BFLOAT16,
        DType::F16 => ffi::DATA_HALF,
        dt => return Ok(Err(format!("dtype {dt:?}"))),
    };
    // q, k and v as they are where their rows are contiguous and 16-byte aligned (the
    // views of a sequence-parallel all-to-all's buffer: `sequence::attention`), else
    // copied to `(b, h, L, d)`.
    let (q, k, v) = (strided(q)?, strided(k)?, strided(v)?);
    let key = graph::Key {
        dtype,
        b: b as i64,
        h: h as i64,
        lq: lq as i64,
        lk: lk as i64,
        d: d as i64,
        q_strides: strides4(&q)?,
        k_strides: strides4(&k)?,
        v_strides: strides4(&v)?,
        bias: bias.map(|(_, s)| s),
    };
    let candle_core::Device::Cuda(dev) = q.device() else {
        return Ok(Err("not a CUDA tensor".into()));
    };
    let (st, plan) = match plan_for(dev, &key, &[graph::Form::Unified, graph::Form::Composite]) {
        Ok(p) => p,
        Err(e) => return Ok(Err(e)),
    };
    let form = match plan.form {
        graph::Form::Unified => "fused SDPA",
        graph::Form::Composite => "composite SDPA",
        graph::Form::Fp8 => "FP8 SDPA",
    };
    let op = CudnnAttn {
        scale,
        strides: [key.q_strides, key.k_strides, key.v_strides],
        plan,
        state: st,
        bias: bias.map(|(t, _)| t.clone()),
    };
    let out = q.apply_op3_no_bwd(&k, &v, &op)?;
    Ok(Ok((out, form)))
}

/// The device's cuDNN state and its plan for `key`: kept from an earlier call, or built
/// from the first of `forms` an engine takes (the reasons of every refusal otherwise; a
/// refusal is kept too, so a shape is tried once per process).
fn plan_for(
    dev: &candle_core::cuda::CudaDevice,
    key: &graph::Key,
    forms: &[graph::Form],
) -> Result<(Arc<Mutex<DeviceState>>, Arc<graph::Plan>), String> {
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let st = state(ordinal, stream.context())?;
    let plan = {
        let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
        let handle = s.handle;
        let gpu = s.gpu.clone();
        let entry = s.plans.entry(key.clone()).or_insert_with(|| {
            // cuDNN builds on the calling thread's current context: this device's (one
            // thread may drive several GPUs, as a decode in row bands does).
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| format!("cuda:{ordinal}: {e}"))?;
            let api = ffi::api()?;
            let mut errors = Vec::new();
            for &form in forms {
                match graph::build(api, handle, key, form, &gpu) {
                    Ok(p) => return Ok(Arc::new(p)),
                    Err(e) => errors.push(e),
                }
            }
            Err(errors.join("; "))
        });
        entry.clone()?
    };
    Ok((st, plan))
}

/// How the e4m3 q, k and v [`Fp8Attention::run`] takes lie in their one buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Layout {
    /// `(3, b, h, L, d)` contiguous, as `quantize_qkv` writes them.
    Heads,
    /// `(L, 3, b, h, d)`: the sequence-parallel all-to-all's receive buffer of e4m3
    /// messages, read in place (`sequence::start`).
    Tokens,
}

/// cuDNN's FP8 attention for self-attention over `q` `(b, h, L, d)` (bf16/f16, on a GPU):
/// the plan, found (or built, or refused) before anything is quantized. The reason when
/// cuDNN cannot run it here (before Hopper, another dtype, or no engine).
pub fn fp8_attention_plan(q: &Tensor) -> CResult<Result<Fp8Attention, String>> {
    let (b, h, l, d) = q.dims4()?;
    fp8_attention_plan_for((b, h, l, d), q.dtype(), q.device(), Fp8Layout::Heads)
}

/// [`fp8_attention_plan`] for q, k and v `(b, h, L, d)` of activations in `dtype` on
/// `device`, their e4m3 values laid out as `layout` says.
pub fn fp8_attention_plan_for(
    (b, h, l, d): (usize, usize, usize, usize),
    dtype: DType,
    device: &candle_core::Device,
    layout: Fp8Layout,
) -> CResult<Result<Fp8Attention, String>> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Ok(Err(format!("dtype {dtype:?}")));
    }
    let candle_core::Device::Cuda(dev) = device else {
        return Ok(Err("not a CUDA tensor".into()));
    };
    let (major, minor) = dev
        .cuda_stream()
        .context()
        .compute_capability()
        .unwrap_or((0, 0));
    if major < 9 {
        return Ok(Err(format!(
            "FP8 attention needs Hopper (sm_90) or later, this GPU is sm_{major}{minor}"
        )));
    }
    let (b, h, l, d) = (b as i64, h as i64, l as i64, d as i64);
    let st4 = match layout {
        Fp8Layout::Heads => [h * l * d, l * d, d, 1],
        Fp8Layout::Tokens => [h * d, d, 3 * b * h * d, 1],
    };
    let key = graph::Key {
        dtype: ffi::DATA_FP8_E4M3,
        b,
        h,
        lq: l,
        lk: l,
        d,
        q_strides: st4,
        k_strides: st4,
        v_strides: st4,
        bias: None,
    };
    Ok(match plan_for(dev, &key, &[graph::Form::Fp8]) {
        Ok((state, plan)) => Ok(Fp8Attention {
            dims: [b as usize, h as usize, l as usize, d as usize],
            op: CudnnAttnFp8 {
                scale: (1.0 / (d as f64).sqrt()) as f32,
                plan,
                state,
                layout,
            },
        }),
        Err(e) => Err(e),
    })
}

/// A plan of cuDNN's FP8 attention for one shape ([`fp8_attention_plan`]).
pub struct Fp8Attention {
    dims: [usize; 4],
    op: CudnnAttnFp8,
}

impl Fp8Attention {
    /// `softmax(q kᵀ / √d) v` ([`graph::Form::Fp8`]): `qkv` the e4m3 values of q, k and v
    /// in one contiguous buffer laid out as the plan's [`Fp8Layout`] (`(3, b, h, L, d)` or
    /// `(L, 3, b, h, d)`) and `scales` their scales as [`crate::model::fp8`]'s
    /// `quantize_qkv` writes them; the output `(b, L, h, d)` in e4m3 scaled by v's factor
    /// (`scales[20]`; its descale is v's, `scales[8]`) — Hopper's FP8 attention kernels write
    /// FP8 only.
    pub fn run(&self, qkv: &Tensor, scales: &Tensor) -> CResult<Tensor> {
        let [b, h, l, d] = self.dims;
        let want: [usize; 5] = match self.op.layout {
            Fp8Layout::Heads => [3, b, h, l, d],
            Fp8Layout::Tokens => [l, 3, b, h, d],
        };
        if qkv.dims() != want || !qkv.is_contiguous() || qkv.dtype() != DType::F8E4M3 {
            candle_core::bail!(
                "cudnn-attention: FP8 q, k, v are {:?} {:?}, the plan's {want:?} e4m3",
                qkv.dims(),
                qkv.dtype()
            );
        }
        qkv.apply_op2_no_bwd(scales, &self.op)
    }
}

struct CudnnAttnFp8 {
    scale: f32,
    plan: Arc<graph::Plan>,
    state: Arc<Mutex<DeviceState>>,
    layout: Fp8Layout,
}

impl candle_core::CustomOp2 for CudnnAttnFp8 {
    fn name(&self) -> &'static str {
        "cudnn-attention-fp8"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("cudnn-attention-fp8 runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        qkv: &CudaStorage,
        ql: &Layout,
        scales: &CudaStorage,
        sl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let (b, h, l, d) = match (self.layout, ql.shape().dims5()?) {
            (Fp8Layout::Heads, (_, b, h, l, d)) => (b, h, l, d),
            (Fp8Layout::Tokens, (l, _, b, h, d)) => (b, h, l, d),
        };
        let n = b * h * l * d;
        // From q's first value to k's and to v's.
        let step = match self.layout {
            Fp8Layout::Heads => n,
            Fp8Layout::Tokens => b * h * d,
        } as u64;
        if !ql.is_contiguous() || !sl.is_contiguous() || sl.shape().elem_count() < 21 {
            candle_core::bail!(
                "cudnn-attention-fp8: q/k/v or scales not as quantize_qkv writes them"
            );
        }
        let dev = &qkv.device;
        let stream = dev.cuda_stream();
        let values = qkv
            .as_cuda_slice::<float8::F8E4M3>()?
            .slice(ql.start_offset()..);
        let sc = scales.as_cuda_slice::<f32>()?.slice(sl.start_offset()..);
        // SAFETY: the plan writes every output element, both amax values and the statistics.
        let out = unsafe { dev.alloc::<float8::F8E4M3>(n)? };
        let amax = unsafe { dev.alloc::<f32>(8)? };
        let stats = unsafe { dev.alloc::<f32>(b * h * l)? };
        let ws = dev.alloc_zeros::<u8>(self.plan.workspace.max(1))?;
        {
            let (pqkv, _g) = values.device_ptr(&stream);
            let (ps, _gs) = sc.device_ptr(&stream);
            let (po, _go) = out.device_ptr(&stream);
            let (pa, _ga) = amax.device_ptr(&stream);
            let (pst, _gst) = stats.device_ptr(&stream);
            let (pw, _gw) = ws.device_ptr(&stream);
            let ptrs = [pqkv, pqkv + step, pqkv + 2 * step, po];
            for (what, p) in [
                ("q", pqkv),
                ("k", pqkv + step),
                ("v", pqkv + 2 * step),
                ("output", po),
                ("scales", ps),
            ] {
                if p % 16 != 0 {
                    candle_core::bail!("cudnn-attention-fp8: {what} is not 16-byte aligned");
                }
            }
            let (api, s) = on_stream(&self.state, &stream)?;
            graph::execute_fp8(
                api,
                s.handle,
                &self.plan,
                ptrs,
                if self.plan.workspace > 0 { pw } else { 0 },
                &self.scale,
                &graph::Fp8Buffers {
                    scales: ps,
                    amax: pa,
                    stats: pst,
                },
            )
            .map_err(candle_core::Error::msg)?;
        }
        drop((ws, amax, stats));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((b, l, h, d)),
        ))
    }
}

/// `t` `(b, h, L, d)` itself where cuDNN reads it in place (each row of `d` contiguous,
/// the other strides positive and, like the start, multiples of 8 elements: 16 bytes),
/// else a contiguous copy.
fn strided(t: &Tensor) -> CResult<Tensor> {
    let st = t.stride();
    let aligned = st.len() == 4
        && st[3] == 1
        && st[..3].iter().all(|s| *s > 0 && s.is_multiple_of(8))
        && t.layout().start_offset().is_multiple_of(8);
    if aligned {
        Ok(t.clone())
    } else {
        t.contiguous()
    }
}

/// The strides of a 4-D tensor, as cuDNN takes them.
fn strides4(t: &Tensor) -> CResult<[i64; 4]> {
    match t.stride() {
        [a, b, c, d] => Ok([*a as i64, *b as i64, *c as i64, *d as i64]),
        s => candle_core::bail!("cudnn-attention: strides {s:?} are not 4-D"),
    }
}

struct CudnnAttn {
    scale: f32,
    /// q's, k's and v's strides, as the plan was built for.
    strides: [[i64; 4]; 3],
    plan: Arc<graph::Plan>,
    state: Arc<Mutex<DeviceState>>,
    /// `(1, h or 1, Lq, row)`, contiguous, q's dtype, on q's device.
    bias: Option<Tensor>,
}

impl CustomOp3 for CudnnAttn {
    fn name(&self) -> &'static str {
        "cudnn-attention"
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
        candle_core::bail!("cudnn-attention runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        match q.dtype() {
            DType::BF16 => self.run::<half::bf16>(q, ql, k, kl, v, vl),
            DType::F16 => self.run::<half::f16>(q, ql, k, kl, v, vl),
            dt => candle_core::bail!("cudnn-attention: unsupported dtype {dt:?}"),
        }
    }
}

impl CudnnAttn {
    fn run<T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let (b, h, lq, d) = ql.shape().dims4()?;
        for (n, l, want) in [
            ("q", ql, self.strides[0]),
            ("k", kl, self.strides[1]),
            ("v", vl, self.strides[2]),
        ] {
            let got: Vec<i64> = l.stride().iter().map(|&s| s as i64).collect();
            if got != want {
                candle_core::bail!("cudnn-attention: {n}'s strides {got:?}, the plan's {want:?}");
            }
        }
        let dev = &q.device;
        let stream = dev.cuda_stream();
        let qs = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let ks = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let vs = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        // SAFETY: the plan writes every output element.
        let out = unsafe { dev.alloc::<T>(b * lq * h * d)? };
        let ws = dev.alloc_zeros::<u8>(self.plan.workspace.max(1))?;
        {
            let (pq, _gq) = qs.device_ptr(&stream);
            let (pk, _gk) = ks.device_ptr(&stream);
            let (pv, _gv) = vs.device_ptr(&stream);
            let (po, _go) = out.device_ptr(&stream);
            let (pw, _gw) = ws.device_ptr(&stream);
            for (n, p) in [("q", pq), ("k", pk), ("v", pv), ("output", po)] {
                if p % 16 != 0 {
                    candle_core::bail!("cudnn-attention: {n} is not 16-byte aligned");
                }
            }
            let (api, s) = on_stream(&self.state, &stream)?;
            let bias_ptr = match &self.bias {
                Some(t) => {
                    let (bs, bl) = t.storage_and_layout();
                    let candle_core::Storage::Cuda(bs) = &*bs else {
                        candle_core::bail!("cudnn-attention: the bias is not on the GPU");
                    };
                    let sl = bs.as_cuda_slice::<T>()?.slice(bl.start_offset()..);
                    let (p, _g) = sl.device_ptr(&stream);
                    if p % 16 != 0 {
                        candle_core::bail!("cudnn-attention: the bias is not 16-byte aligned");
                    }
                    Some(p)
                }
                None => None,
            };
            graph::execute(
                api,
                s.handle,
                &self.plan,
                [pq, pk, pv, po],
                if self.plan.workspace > 0 { pw } else { 0 },
                &self.scale,
                bias_ptr,
            )
            .map_err(candle_core::Error::msg)?;
        }
        drop(ws);
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((b, lq, h, d)),
        ))
    }
}

/// `conv(x, w) + bias + residual` (each addition where given) for channels-last bf16/f16
/// CUDA tensors: `x` `(n, h, w, c)`, `w` `(k, r, s, c)` (KRSC), `bias` `(k)`, `residual`
/// `(n, p, q, k)`, all contiguous; the output is `(n, p, q, k)`. The additions run in the
/// convolution's graph where an engine takes them (the [`conv::Fusion`] returned says how
/// far), else as candle ops after it. `tune` times the engine configurations that
/// finalise on the first call of a shape and keeps the fastest. The reason when cuDNN
/// cannot run it here.
pub fn conv2d_nhwc(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    geom: conv::ConvGeom,
    tune: bool,
) -> CResult<Result<(Tensor, conv::Fusion), String>> {
    let candle_core::Device::Cuda(dev) = x.device() else {
        return Ok(Err("not a CUDA tensor".into()));
    };
    let dtype = match x.dtype() {
        DType::BF16 => ffi::DATA_BFLOAT16,
        DType::F16 => ffi::DATA_HALF,
        dt => return Ok(Err(format!("dtype {dt:?}"))),
    };
    let (n, h, wd, c) = x.dims4()?;
    let (k, r, s, wc) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d_nhwc: the input has {c} channels, the filters {wc}");
    }
    let Some((p, q)) = geom.output(h, wd, r, s) else {
        candle_core::bail!("conv2d_nhwc: a {r}x{s} filter does not fit a {h}x{wd} input");
    };
    let mut operands = vec![("input", x), ("filters", w)];
    if let Some(b) = bias {
        if b.dims() != [k] {
            candle_core::bail!("conv2d_nhwc: bias {:?} for {k} filters", b.dims());
        }
        operands.push(("bias", b));
    }
    if let Some(z) = residual {
        if z.dims() != [n, p, q, k] {
            candle_core::bail!(
                "conv2d_nhwc: residual {:?} for an output ({n}, {p}, {q}, {k})",
                z.dims()
            );
        }
        operands.push(("residual", z));
    }
    for (name, t) in &operands {
        if t.dtype() != x.dtype() || !t.device().same_device(x.device()) {
            candle_core::bail!("conv2d_nhwc: {name} is not on the input's device and dtype");
        }
        if !t.is_contiguous() || (t.layout().start_offset() * t.dtype().size_in_bytes()) % 16 != 0 {
            return Ok(Err(format!("{name} is not contiguous and 16-byte aligned")));
        }
    }
    let fusion = match (bias, residual) {
        (Some(_), Some(_)) => conv::Fusion::BiasResidual,
        (Some(_), None) => conv::Fusion::Bias,
        (None, _) => conv::Fusion::None,
    };
    let key = conv::Key {
        dtype,
        n,
        c,
        h,
        w: wd,
        k,
        r,
        s,
        geom,
        fusion,
        tune,
    };
    let stream = dev.cuda_stream();
    let ordinal = stream.context().ordinal();
    let st = match state(ordinal, stream.context()) {
        Ok(s) => s,
        Err(e) => return Ok(Err(e)),
    };
    let plan = {
        let mut s = st.lock().unwrap_or_else(|p| p.into_inner());
        let handle = s.handle;
        let gpu = s.gpu.clone();
        let entry = s.convs.entry(key.clone()).or_insert_with(|| {
            // Built on this device's context, whichever the thread had current.
            stream
                .context()
                .bind_to_thread()
                .map_err(|e| format!("cuda:{ordinal}: {e}"))?;
            conv::build(ffi::api()?, handle, &key, &gpu).map(Arc::new)
        });
        match entry {
            Ok(p) => p.clone(),
            Err(e) => return Ok(Err(e.clone())),
        }
    };
    let b = bias.filter(|_| plan.fusion >= conv::Fusion::Bias);
    let z = residual.filter(|_| plan.fusion >= conv::Fusion::BiasResidual);
    let y = match x.dtype() {
        DType::BF16 => run_conv::<half::bf16>(&plan, &st, dev, x, w, b, z, (n, p, q, k))?,
        _ => run_conv::<half::f16>(&plan, &st, dev, x, w, b, z, (n, p, q, k))?,
    };
    // What the graph left out.
    let y = match (bias, plan.fusion) {
        (Some(b), conv::Fusion::None) => y.broadcast_add(b)?,
        _ => y,
    };
    let y = match (residual, plan.fusion) {
        (Some(z), f) if f < conv::Fusion::BiasResidual => (y + z)?,
        _ => y,
    };
    Ok(Ok((y, plan.fusion)))
}

fn view<'a, T: candle_core::cuda::CudaDType>(
    s: &'a candle_core::Storage,
    l: &Layout,
) -> CResult<candle_core::cuda::cudarc::driver::CudaView<'a, T>> {
    let candle_core::Storage::Cuda(c) = s else {
        candle_core::bail!("conv2d_nhwc: not a CUDA tensor");
    };
    Ok(c.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// Runs `plan` (tuning it first where no configuration is chosen yet) into a new
/// `(n, p, q, k)` tensor.
#[allow(clippy::too_many_arguments)]
fn run_conv<T: candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    plan: &conv::Plan,
    st: &Mutex<DeviceState>,
    dev: &candle_core::cuda::CudaDevice,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    z: Option<&Tensor>,
    (n, p, q, k): (usize, usize, usize, usize),
) -> CResult<Tensor> {
    let stream = dev.cuda_stream();
    let (xs, xl) = x.storage_and_layout();
    let (wst, wl) = w.storage_and_layout();
    let bs = b.map(|b| b.storage_and_layout());
    let zs = z.map(|z| z.storage_and_layout());
    let xv = view::<T>(&xs, xl)?;
    let wv = view::<T>(&wst, wl)?;
    let bv = bs.as_ref().map(|(s, l)| view::<T>(s, l)).transpose()?;
    let zv = zs.as_ref().map(|(s, l)| view::<T>(s, l)).transpose()?;
    // SAFETY: the plan writes every output element.
    let out = unsafe { dev.alloc::<T>(n * p * q * k)? };
    let ws_bytes = match plan.chosen() {
        Some(i) => plan.candidate(i).1,
        None => plan.max_workspace(),
    };
    // SAFETY: scratch space for cuDNN, never read before written.
    let ws = unsafe { dev.alloc::<u8>(ws_bytes.max(1))? };
    {
        let (px, _gx) = xv.device_ptr(&stream);
        let (pw, _gw) = wv.device_ptr(&stream);
        let bp = bv.as_ref().map(|v| v.device_ptr(&stream));
        let zp = zv.as_ref().map(|v| v.device_ptr(&stream));
        let (py, _gy) = out.device_ptr(&stream);
        let (pws, _gws) = ws.device_ptr(&stream);
        let ptrs = conv::Ptrs {
            x: px,
            w: pw,
            b: bp.as_ref().map_or(0, |p| p.0),
            z: zp.as_ref().map_or(0, |p| p.0),
            y: py,
        };
        for (name, v) in [("input", px), ("filters", pw), ("output", py)] {
            if v % 16 != 0 {
                candle_core::bail!("conv2d_nhwc: {name} is not 16-byte aligned");
            }
        }
        let (api, s) = on_stream(st, &stream)?;
        let exec = |i: usize| {
            let (d, need) = plan.candidate(i);
            conv::execute(
                api,
                s.handle,
                d,
                plan.fusion,
                &ptrs,
                if need > 0 { pws } else { 0 },
            )
        };
        if plan.chosen().is_none() {
            // Time each configuration on this call's data: one warm-up run, then three.
            let mut best: Option<(f64, usize)> = None;
            for i in 0..plan.candidates() {
                if exec(i).is_err() {
                    continue;
                }
                stream.synchronize().w()?;
                let t = std::time::Instant::now();
                let ok = (0..3).all(|_| exec(i).is_ok());
                stream.synchronize().w()?;
                let secs = t.elapsed().as_secs_f64();
                if ok && best.is_none_or(|(b, _)| secs < b) {
                    best = Some((secs, i));
                }
            }
            let Some((_, i)) = best else {
                candle_core::bail!("conv2d_nhwc: no engine configuration ran");
            };
            plan.choose(i);
        }
        let Some(i) = plan.chosen() else {
            candle_core::bail!("conv2d_nhwc: no engine configuration chosen");
        };
        exec(i).map_err(candle_core::Error::msg)?;
    }
    drop(ws);
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone())),
        (n, p, q, k),
        candle_core::op::BackpropOp::none(),
        false,
    ))
}
