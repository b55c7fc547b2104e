//! Attention through cuDNN's fused flash-attention engines (CUDA builds).
//!
//! On Hopper cuDNN 9's SDPA engines run FLUX's attention at about twice the rate of mold's
//! own FlashAttention-2 style kernel (measured beside PyTorch's SDPA on H200: BENCHMARKS.md).
//! cuDNN is loaded at run time ([`ffi`]); per device mold keeps one cuDNN handle and the
//! finalised plan of every attention shape it has seen ([`graph`]). A shape no engine takes,
//! or a machine without cuDNN, makes [`attention`] answer `Ok(Err(reason))`, the reason kept
//! for the run's report; the caller then runs mold's kernel.

mod ffi;
mod graph;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::DevicePtr;
use candle_core::cuda::{CudaStorage, WrapErr};
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

type CResult<T> = candle_core::Result<T>;

/// A device's cuDNN state: its handle and the plans built on it.
struct DeviceState {
    handle: ffi::Handle,
    plans: HashMap<graph::Key, Result<Arc<graph::Plan>, String>>,
}

// SAFETY: the handle is only used with this state's lock held.
unsafe impl Send for DeviceState {}

fn devices() -> &'static Mutex<HashMap<usize, Arc<Mutex<DeviceState>>>> {
    static D: OnceLock<Mutex<HashMap<usize, Arc<Mutex<DeviceState>>>>> = OnceLock::new();
    D.get_or_init(Default::default)
}

fn state(
    ordinal: usize,
    ctx: &candle_core::cuda::cudarc::driver::CudaContext,
) -> Result<Arc<Mutex<DeviceState>>, String> {
    let mut all = devices().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = all.get(&ordinal) {
        return Ok(s.clone());
    }
    let api = ffi::api()?;
    ctx.bind_to_thread()
        .map_err(|e| format!("cuda:{ordinal}: {e}"))?;
    let mut handle = std::ptr::null_mut();
    // SAFETY: out-pointer; the device's context is current on this thread.
    let st = unsafe { (api.create)(&mut handle) };
    if st != ffi::STATUS_SUCCESS {
        return Err(api.error(&format!("cudnnCreate on cuda:{ordinal}"), st));
    }
    let s = Arc::new(Mutex::new(DeviceState {
        handle,
        plans: HashMap::new(),
    }));
    all.insert(ordinal, s.clone());
    Ok(s)
}

/// cuDNN's version, or why it cannot be used on this machine.
pub fn version() -> Result<String, String> {
    ffi::api().map(|a| a.version_string())
}

/// `softmax(q kᵀ · scale) v` for contiguous `(b, h, L, d)` bf16/f16 CUDA tensors, returned as
/// `(b, L, h, d)`, with which graph ran (`"fused SDPA"` or `"composite SDPA"`); the reason
/// when cuDNN cannot run it here.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> CResult<Result<(Tensor, &'static str), String>> {
    let (b, h, lq, d) = q.dims4()?;
    let (_, _, lk, _) = k.dims4()?;
    let dtype = match q.dtype() {
        DType::BF16 => ffi::DATA_BFLOAT16,
        DType::F16 => ffi::DATA_HALF,
        dt => return Ok(Err(format!("dtype {dt:?}"))),
    };
    let contiguous =
        |h: usize, l: usize, d: usize| [(h * l * d) as i64, (l * d) as i64, d as i64, 1];
    let key = graph::Key {
        dtype,
        b: b as i64,
        h: h as i64,
        lq: lq as i64,
        lk: lk as i64,
        d: d as i64,
        q_strides: contiguous(h, lq, d),
        k_strides: contiguous(h, lk, d),
        v_strides: contiguous(h, lk, d),
    };
    let candle_core::Device::Cuda(dev) = q.device() else {
        return Ok(Err("not a CUDA tensor".into()));
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
        let entry = s.plans.entry(key.clone()).or_insert_with(|| {
            let api = ffi::api()?;
            let mut errors = Vec::new();
            for form in [graph::Form::Unified, graph::Form::Composite] {
                match graph::build(api, handle, &key, form) {
                    Ok(p) => return Ok(Arc::new(p)),
                    Err(e) => errors.push(e),
                }
            }
            Err(errors.join("; "))
        });
        match entry {
            Ok(p) => p.clone(),
            Err(e) => return Ok(Err(e.clone())),
        }
    };
    let form = match plan.form {
        graph::Form::Unified => "fused SDPA",
        graph::Form::Composite => "composite SDPA",
    };
    let op = CudnnAttn {
        scale: (1.0 / (d as f64).sqrt()) as f32,
        plan,
        state: st,
    };
    let out = q
        .contiguous()?
        .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
    Ok(Ok((out, form)))
}

struct CudnnAttn {
    scale: f32,
    plan: Arc<graph::Plan>,
    state: Arc<Mutex<DeviceState>>,
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
        for (n, l) in [("q", ql), ("k", kl), ("v", vl)] {
            if !l.is_contiguous() {
                candle_core::bail!("cudnn-attention: {n} is not contiguous");
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
            let api = ffi::api().map_err(candle_core::Error::msg)?;
            let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            stream.context().bind_to_thread().w()?;
            // SAFETY: the handle is this device's, the stream is the one candle queues on.
            let st = unsafe { (api.set_stream)(s.handle, stream.cu_stream().cast()) };
            if st != ffi::STATUS_SUCCESS {
                candle_core::bail!("{}", api.error("cudnnSetStream", st));
            }
            graph::execute(
                api,
                s.handle,
                &self.plan,
                [pq, pk, pv, po],
                if self.plan.workspace > 0 { pw } else { 0 },
                &self.scale,
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
