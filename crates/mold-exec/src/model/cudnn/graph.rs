//! cuDNN backend descriptors: a small graph builder (tensors, pointwise, reduction and
//! matmul operations), engine selection (the heuristics' configurations that finalise) and
//! execution, shared by attention and convolution ([`super::conv`]); and the graphs of
//! scaled-dot-product attention (one fused SDPA operation where the library has it, cuDNN ≥
//! 9.13.1; otherwise the composite of two matmuls, a scale and a softmax that cuDNN's fused
//! flash-attention engines recognise, as cudnn-frontend builds them).

use super::ffi::{self, Api, Desc, Handle};
use crate::model::plan_cache::{self, PlanStore};
use std::ffi::c_void;
use std::path::PathBuf;
use std::time::Instant;

type R<T> = Result<T, String>;

/// One backend descriptor, destroyed on drop.
pub struct D {
    api: &'static Api,
    pub raw: Desc,
}

// SAFETY: descriptors are plain heap objects of cuDNN's; a plan is only executed while its
// device's handle lock is held.
unsafe impl Send for D {}
unsafe impl Sync for D {}

impl Drop for D {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
        unsafe { (self.api.destroy_descriptor)(self.raw) };
    }
}

fn check(api: &Api, what: &str, s: ffi::Status) -> R<()> {
    if s == ffi::STATUS_SUCCESS {
        Ok(())
    } else {
        Err(api.error(what, s))
    }
}

impl D {
    pub fn new(api: &'static Api, kind: i32) -> R<D> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: out-pointer to a descriptor.
        check(api, "create descriptor", unsafe {
            (api.create_descriptor)(kind, &mut raw)
        })?;
        Ok(D { api, raw })
    }

    pub(super) fn set_raw(&self, name: i32, ty: i32, n: usize, p: *const c_void) -> R<&Self> {
        // SAFETY: `p` points to `n` elements of the type `ty` names.
        check(self.api, &format!("set attribute {name}"), unsafe {
            (self.api.set_attribute)(self.raw, name, ty, n as i64, p)
        })?;
        Ok(self)
    }

    pub fn i64s(&self, name: i32, v: &[i64]) -> R<&Self> {
        self.set_raw(name, ffi::TYPE_INT64, v.len(), v.as_ptr().cast())
    }

    pub fn enum32(&self, name: i32, ty: i32, v: i32) -> R<&Self> {
        self.set_raw(name, ty, 1, (&v as *const i32).cast())
    }

    pub fn boolean(&self, name: i32, v: bool) -> R<&Self> {
        // cudnnBackendAttributeType CUDNN_TYPE_BOOLEAN is a C `bool`.
        let b = v as u8;
        self.set_raw(name, ffi::TYPE_BOOLEAN, 1, (&b as *const u8).cast())
    }

    pub fn descs(&self, name: i32, v: &[&D]) -> R<&Self> {
        let raws: Vec<Desc> = v.iter().map(|d| d.raw).collect();
        self.set_raw(
            name,
            ffi::TYPE_BACKEND_DESCRIPTOR,
            raws.len(),
            raws.as_ptr().cast(),
        )
    }

    pub fn handle(&self, name: i32, h: Handle) -> R<&Self> {
        self.set_raw(name, ffi::TYPE_HANDLE, 1, (&h as *const Handle).cast())
    }

    pub fn finalize(&self, what: &str) -> R<()> {
        // SAFETY: a created descriptor with its attributes set.
        check(self.api, &format!("finalize {what}"), unsafe {
            (self.api.finalize)(self.raw)
        })
    }
}

/// A tensor of the graph: `uid`, dims, strides (elements), data type.
pub(super) fn tensor(
    api: &'static Api,
    uid: i64,
    dims: [i64; 4],
    strides: [i64; 4],
    dtype: i32,
    virt: bool,
    by_value: bool,
) -> R<D> {
    let t = D::new(api, ffi::TENSOR_DESCRIPTOR)?;
    t.enum32(ffi::ATTR_TENSOR_DATA_TYPE, ffi::TYPE_DATA_TYPE, dtype)?
        .i64s(ffi::ATTR_TENSOR_DIMENSIONS, &dims)?
        .i64s(ffi::ATTR_TENSOR_STRIDES, &strides)?
        .i64s(ffi::ATTR_TENSOR_UNIQUE_ID, &[uid])?
        .i64s(ffi::ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?
        .boolean(ffi::ATTR_TENSOR_IS_VIRTUAL, virt)?
        .boolean(ffi::ATTR_TENSOR_IS_BY_VALUE, by_value)?;
    t.finalize("tensor")?;
    Ok(t)
}

/// The unique ids of the graph's real tensors (the variant pack's order).
pub const UID_Q: i64 = 1;
pub const UID_K: i64 = 2;
pub const UID_V: i64 = 3;
pub const UID_O: i64 = 4;
pub const UID_SCALE: i64 = 5;
pub const UID_BIAS: i64 = 6;
// FP8 attention's scales (device scalars) and its outputs
// besides O: the probabilities' and the output's largest magnitudes, the softmax statistics.
pub const UID_DESCALE_Q: i64 = 7;
pub const UID_DESCALE_K: i64 = 8;
pub const UID_DESCALE_V: i64 = 9;
pub const UID_DESCALE_S: i64 = 10;
pub const UID_SCALE_S: i64 = 11;
pub const UID_SCALE_O: i64 = 12;
pub const UID_AMAX_S: i64 = 13;
pub const UID_AMAX_O: i64 = 14;
pub const UID_STATS: i64 = 15;

/// What a plan is for: shapes and element strides of q, k, v (`b, h, L, d`) and of the
/// output, which is written as `(b, L, h, d)` (strides `[L·h·d, d, h·d, 1]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    pub dtype: i32,
    pub b: i64,
    pub h: i64,
    pub lq: i64,
    pub lk: i64,
    pub d: i64,
    pub q_strides: [i64; 4],
    pub k_strides: [i64; 4],
    pub v_strides: [i64; 4],
    /// An additive bias of the scaled scores, shared by the batch: T5's relative-position
    /// bias, a causal mask. Only the composite graph takes one.
    pub bias: Option<BiasShape>,
}

/// How a bias is laid out: `(1, heads, Lq, row)` contiguous, `heads` 1 (shared by every
/// head) or the attention's, of which each row's first `Lk` are read (`row` ≥ `Lk`: a row
/// padded to keep rows 16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BiasShape {
    pub heads: i64,
    pub row: i64,
}

impl Key {
    fn o_strides(&self) -> [i64; 4] {
        [self.lq * self.h * self.d, self.d, self.h * self.d, 1]
    }
}

/// Which graph a plan runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// One `OPERATION_SDPA_FWD` (cuDNN ≥ 9.13.1).
    Unified,
    /// Matmul, scale, softmax (max, sub, exp, sum, div; log-sum-exp statistics), matmul.
    Composite,
    /// The composite in FP8, as cudnn-frontend builds its FP8 attention: e4m3 q, k and v
    /// descaled after the first matmul, the probabilities scaled into e4m3 for the second,
    /// which is descaled into the output; the largest magnitudes of the probabilities and
    /// the output, and the softmax statistics, written beside it (Hopper and later). Its
    /// key's dtype is e4m3: q, k, v and the output (Hopper's FP8 kernels write FP8 only).
    Fp8,
}

/// A finalised execution plan, with what it was built from kept alive.
pub struct Plan {
    _parts: Vec<D>,
    pub plan: D,
    pub workspace: usize,
    pub form: Form,
}

/// A tensor's layout in the graph: `[dims, strides]` (elements).
type Layout4 = [[i64; 4]; 2];

/// Descriptors of a graph under construction, kept alive until the plan is built; ops and
/// tensors are referred to by their index in `keep`.
pub(super) struct Builder {
    pub(super) api: &'static Api,
    pub(super) keep: Vec<D>,
    next_uid: i64,
}

impl Builder {
    /// Virtual tensors get unique ids from 101 on (real ones use small ids).
    pub(super) fn new(api: &'static Api) -> Builder {
        Builder {
            api,
            keep: Vec::new(),
            next_uid: 100,
        }
    }

    pub(super) fn virt(&mut self, dims: [i64; 4], strides: [i64; 4], dtype: i32) -> R<usize> {
        self.next_uid += 1;
        let t = tensor(self.api, self.next_uid, dims, strides, dtype, true, false)?;
        self.keep.push(t);
        Ok(self.keep.len() - 1)
    }

    pub(super) fn push(&mut self, d: D) -> usize {
        self.keep.push(d);
        self.keep.len() - 1
    }

    pub(super) fn pointwise(
        &mut self,
        mode: i32,
        x: usize,
        b: Option<usize>,
        y: usize,
    ) -> R<usize> {
        let pw = D::new(self.api, ffi::POINTWISE_DESCRIPTOR)?;
        pw.enum32(ffi::ATTR_POINTWISE_MODE, ffi::TYPE_POINTWISE_MODE, mode)?
            .enum32(
                ffi::ATTR_POINTWISE_MATH_PREC,
                ffi::TYPE_DATA_TYPE,
                ffi::DATA_FLOAT,
            )?;
        pw.finalize("pointwise")?;
        let op = D::new(self.api, ffi::OPERATION_POINTWISE_DESCRIPTOR)?;
        op.descs(ffi::ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[&pw])?
            .descs(ffi::ATTR_OPERATION_POINTWISE_XDESC, &[&self.keep[x]])?;
        if let Some(b) = b {
            op.descs(ffi::ATTR_OPERATION_POINTWISE_BDESC, &[&self.keep[b]])?;
        }
        op.descs(ffi::ATTR_OPERATION_POINTWISE_YDESC, &[&self.keep[y]])?;
        op.finalize("pointwise operation")?;
        self.push(pw);
        Ok(self.push(op))
    }

    fn reduction(&mut self, mode: i32, x: usize, y: usize) -> R<usize> {
        let r = D::new(self.api, ffi::REDUCTION_DESCRIPTOR)?;
        r.enum32(
            ffi::ATTR_REDUCTION_COMP_TYPE,
            ffi::TYPE_DATA_TYPE,
            ffi::DATA_FLOAT,
        )?
        .enum32(
            ffi::ATTR_REDUCTION_OPERATOR,
            ffi::TYPE_REDUCTION_OPERATOR_TYPE,
            mode,
        )?;
        r.finalize("reduction")?;
        let op = D::new(self.api, ffi::OPERATION_REDUCTION_DESCRIPTOR)?;
        op.descs(ffi::ATTR_OPERATION_REDUCTION_XDESC, &[&self.keep[x]])?
            .descs(ffi::ATTR_OPERATION_REDUCTION_YDESC, &[&self.keep[y]])?
            .descs(ffi::ATTR_OPERATION_REDUCTION_DESC, &[&r])?;
        op.finalize("reduction operation")?;
        self.push(r);
        Ok(self.push(op))
    }

    /// The softmax of the scores `s` over its last dimension as cudnn-frontend composes it
    /// for flash attention — max, subtract, exp, sum, the log-sum-exp statistics (into
    /// `stats`, else a virtual tensor), divide — its ops appended to `ops`; returns the
    /// probabilities, virtual, of dtype `p_dtype`. `[dims, strides]` of the scores and of a
    /// row's reductions.
    fn softmax(
        &mut self,
        ops: &mut Vec<usize>,
        s: usize,
        [sdims, sstr]: Layout4,
        [rdims, rstr]: Layout4,
        stats: Option<usize>,
        p_dtype: i32,
    ) -> R<usize> {
        let f = ffi::DATA_FLOAT;
        let max = self.virt(rdims, rstr, f)?;
        ops.push(self.reduction(ffi::REDUCE_MAX, s, max)?);
        let sub = self.virt(sdims, sstr, f)?;
        ops.push(self.pointwise(ffi::POINTWISE_SUB, s, Some(max), sub)?);
        let exp = self.virt(sdims, sstr, f)?;
        ops.push(self.pointwise(ffi::POINTWISE_EXP, sub, None, exp)?);
        let sum = self.virt(rdims, rstr, f)?;
        ops.push(self.reduction(ffi::REDUCE_ADD, exp, sum)?);
        let log = self.virt(rdims, rstr, f)?;
        ops.push(self.pointwise(ffi::POINTWISE_LOG, sum, None, log)?);
        let stats = match stats {
            Some(t) => t,
            None => self.virt(rdims, rstr, f)?,
        };
        ops.push(self.pointwise(ffi::POINTWISE_ADD, max, Some(log), stats)?);
        let p = self.virt(sdims, sstr, p_dtype)?;
        ops.push(self.pointwise(ffi::POINTWISE_DIV, exp, Some(sum), p)?);
        Ok(p)
    }

    /// What the composite graphs (bf16/f16 and FP8) share before the first matmul: Kᵀ, its
    /// B operand, pushed as a view of K (uid [`UID_K`], `key`'s dtype) with dims
    /// `(b, h, d, Lk)` and K's strides with the last two swapped; then `[dims, strides]` of
    /// the scores `(b, h, Lq, Lk)` and of a row's reductions `(b, h, Lq, 1)`, both compact.
    fn scores_of(&mut self, key: &Key) -> R<(usize, Layout4, Layout4)> {
        let (b, h, lq, lk, d) = (key.b, key.h, key.lq, key.lk, key.d);
        let ks = key.k_strides;
        let kt = self.push(tensor(
            self.api,
            UID_K,
            [b, h, d, lk],
            [ks[0], ks[1], ks[3], ks[2]],
            key.dtype,
            false,
            false,
        )?);
        let scores = [[b, h, lq, lk], [h * lq * lk, lq * lk, lk, 1]];
        let rows = [[b, h, lq, 1], [h * lq, lq, 1, 1]];
        Ok((kt, scores, rows))
    }

    fn matmul(&mut self, a: usize, b: usize, c: usize) -> R<usize> {
        let m = D::new(self.api, ffi::MATMUL_DESCRIPTOR)?;
        m.enum32(
            ffi::ATTR_MATMUL_COMP_TYPE,
            ffi::TYPE_DATA_TYPE,
            ffi::DATA_FLOAT,
        )?;
        m.finalize("matmul")?;
        let op = D::new(self.api, ffi::OPERATION_MATMUL_DESCRIPTOR)?;
        op.descs(ffi::ATTR_OPERATION_MATMUL_ADESC, &[&self.keep[a]])?
            .descs(ffi::ATTR_OPERATION_MATMUL_BDESC, &[&self.keep[b]])?
            .descs(ffi::ATTR_OPERATION_MATMUL_CDESC, &[&self.keep[c]])?
            .descs(ffi::ATTR_OPERATION_MATMUL_DESC, &[&m])?;
        op.finalize("matmul operation")?;
        self.push(m);
        Ok(self.push(op))
    }
}

/// Builds the graph of `form` for `key` and finalises the first engine configuration the
/// heuristics (mode A, then the fallback list) offer that the library accepts.
pub fn build(api: &'static Api, handle: Handle, key: &Key, form: Form, gpu: &str) -> R<Plan> {
    let mut g = Builder::new(api);
    let (b, h, lq, lk, d) = (key.b, key.h, key.lq, key.lk, key.d);
    let dt = key.dtype;
    if (dt == ffi::DATA_FP8_E4M3) != (form == Form::Fp8) {
        return Err(format!("the {form:?} graph is not for this attention"));
    }
    let q = g.push(tensor(
        api,
        UID_Q,
        [b, h, lq, d],
        key.q_strides,
        dt,
        false,
        false,
    )?);
    let scale = g.push(tensor(
        api,
        UID_SCALE,
        [1, 1, 1, 1],
        [1, 1, 1, 1],
        ffi::DATA_FLOAT,
        false,
        true,
    )?);
    let o = g.push(tensor(
        api,
        UID_O,
        [b, h, lq, d],
        key.o_strides(),
        dt,
        false,
        false,
    )?);
    let v = g.push(tensor(
        api,
        UID_V,
        [b, h, lk, d],
        key.v_strides,
        dt,
        false,
        false,
    )?);
    let mut ops = Vec::new();
    let bias = match key.bias {
        Some(BiasShape { heads, row }) => Some(g.push(tensor(
            api,
            UID_BIAS,
            [1, heads, lq, lk],
            [heads * lq * row, lq * row, row, 1],
            dt,
            false,
            false,
        )?)),
        None => None,
    };
    match form {
        Form::Unified if bias.is_some() => {
            return Err("the fused SDPA operation is built without a bias here".into());
        }
        Form::Unified => {
            let k = g.push(tensor(
                api,
                UID_K,
                [b, h, lk, d],
                key.k_strides,
                dt,
                false,
                false,
            )?);
            let op = D::new(api, ffi::OPERATION_SDPA_FWD_DESCRIPTOR)?;
            op.descs(ffi::ATTR_OPERATION_SDPA_FWD_QDESC, &[&g.keep[q]])?
                .descs(ffi::ATTR_OPERATION_SDPA_FWD_KDESC, &[&g.keep[k]])?
                .descs(ffi::ATTR_OPERATION_SDPA_FWD_VDESC, &[&g.keep[v]])?
                .descs(ffi::ATTR_OPERATION_SDPA_FWD_ODESC, &[&g.keep[o]])?
                .descs(ffi::ATTR_OPERATION_SDPA_FWD_SCALEDESC, &[&g.keep[scale]])?;
            op.finalize("SDPA operation")?;
            ops.push(g.push(op));
        }
        Form::Composite => {
            let (kt, [sdims, sstr], [rdims, rstr]) = g.scores_of(key)?;
            let f = ffi::DATA_FLOAT;
            let s = g.virt(sdims, sstr, f)?;
            ops.push(g.matmul(q, kt, s)?);
            let mut scaled = g.virt(sdims, sstr, f)?;
            ops.push(g.pointwise(ffi::POINTWISE_MUL, s, Some(scale), scaled)?);
            if let Some(bias) = bias {
                let biased = g.virt(sdims, sstr, f)?;
                ops.push(g.pointwise(ffi::POINTWISE_ADD, scaled, Some(bias), biased)?);
                scaled = biased;
            }
            // The probabilities in the input type: the second matmul's A operand.
            let p = g.softmax(&mut ops, scaled, [sdims, sstr], [rdims, rstr], None, dt)?;
            ops.push(g.matmul(p, v, o)?);
        }
        Form::Fp8 => {
            if bias.is_some() {
                return Err("FP8 attention is built without a bias here".into());
            }
            let (kt, [sdims, sstr], [rdims, rstr]) = g.scores_of(key)?;
            let f = ffi::DATA_FLOAT;
            let mut scalar = |uid: i64, by_value: bool| -> R<usize> {
                Ok(g.push(tensor(
                    api,
                    uid,
                    [1, 1, 1, 1],
                    [1, 1, 1, 1],
                    f,
                    false,
                    by_value,
                )?))
            };
            let dq = scalar(UID_DESCALE_Q, false)?;
            let dk = scalar(UID_DESCALE_K, false)?;
            let dv = scalar(UID_DESCALE_V, false)?;
            let ds = scalar(UID_DESCALE_S, false)?;
            let ss = scalar(UID_SCALE_S, false)?;
            let so = scalar(UID_SCALE_O, false)?;
            let amax_s = scalar(UID_AMAX_S, false)?;
            let amax_o = scalar(UID_AMAX_O, false)?;
            let stats = g.push(tensor(api, UID_STATS, rdims, rstr, f, false, false)?);
            let s0 = g.virt(sdims, sstr, f)?;
            ops.push(g.matmul(q, kt, s0)?);
            // Scaled, then q's and k's descales: cudnn-frontend's order.
            let mut s = s0;
            for by in [scale, dq, dk] {
                let y = g.virt(sdims, sstr, f)?;
                ops.push(g.pointwise(ffi::POINTWISE_MUL, s, Some(by), y)?);
                s = y;
            }
            let p = g.softmax(&mut ops, s, [sdims, sstr], [rdims, rstr], Some(stats), f)?;
            ops.push(g.reduction(ffi::REDUCE_AMAX, p, amax_s)?);
            // The probabilities scaled into e4m3: the second matmul's A operand.
            let p8 = g.virt(sdims, sstr, dt)?;
            ops.push(g.pointwise(ffi::POINTWISE_MUL, p, Some(ss), p8)?);
            // The second product and its scalings compact in (b, h, L, d), as cudnn-frontend
            // infers virtual tensors; only the output is written token-major.
            let odims = [b, h, lq, d];
            let ostr = [h * lq * d, lq * d, d, 1];
            let o1 = g.virt(odims, ostr, f)?;
            ops.push(g.matmul(p8, v, o1)?);
            let o2 = g.virt(odims, ostr, f)?;
            ops.push(g.pointwise(ffi::POINTWISE_MUL, o1, Some(ds), o2)?);
            let o3 = g.virt(odims, ostr, f)?;
            ops.push(g.pointwise(ffi::POINTWISE_MUL, o2, Some(dv), o3)?);
            ops.push(g.pointwise(ffi::POINTWISE_MUL, o3, Some(so), o)?);
            ops.push(g.reduction(ffi::REDUCE_AMAX, o3, amax_o)?);
        }
    }
    let keep = plan_cache::settings().dir.as_ref().map(|d| {
        PlanStore::new(d).path(
            &api.version_string(),
            gpu,
            &format!("sdpa {form:?} {key:?}"),
        )
    });
    let mut f = finalise(api, handle, g, &ops, 1, keep)
        .map_err(|e| format!("no cuDNN engine runs this attention ({form:?} graph): {e}"))?;
    let (plan, workspace) = f.plans.remove(0);
    Ok(Plan {
        _parts: f.parts,
        plan,
        workspace,
        form,
    })
}

/// A graph's finalised execution plans (each with its workspace bytes), the heuristics'
/// order, and the descriptors they were built from.
pub(super) struct Finalised {
    pub(super) parts: Vec<D>,
    pub(super) plans: Vec<(D, usize)>,
}

/// Makes the operation graph of `ops` (indices into `g`) and finalises up to `want` of the
/// engine configurations the heuristics offer (mode A, then the fallback list), best
/// first; an error when none finalises.
///
/// With `keep` (the file a single plan is kept in, [`plan_cache::PlanStore::path`]), a plan
/// kept there by an earlier process is read back instead of built, and a built one is kept
/// there where cuDNN can serialise it.
pub(super) fn finalise(
    api: &'static Api,
    handle: Handle,
    g: Builder,
    ops: &[usize],
    want: usize,
    keep: Option<PathBuf>,
) -> R<Finalised> {
    let start = Instant::now();
    let keep = keep.filter(|_| want == 1);
    if let Some(path) = &keep {
        if let Some(json) = PlanStore::load(path) {
            if let Ok(plan) = deserialize(api, handle, &json) {
                let ws = workspace_size(api, &plan)?;
                plan_cache::record(true, false, start.elapsed().as_secs_f64());
                return Ok(Finalised {
                    parts: g.keep,
                    plans: vec![(plan, ws)],
                });
            }
        }
    }
    let graph = D::new(api, ffi::OPERATIONGRAPH_DESCRIPTOR)?;
    let op_refs: Vec<&D> = ops.iter().map(|&i| &g.keep[i]).collect();
    graph
        .descs(ffi::ATTR_OPERATIONGRAPH_OPS, &op_refs)?
        .handle(ffi::ATTR_OPERATIONGRAPH_HANDLE, handle)?;
    graph.finalize("operation graph")?;
    let mut parts = g.keep;
    let mut plans = Vec::new();
    let mut errors = Vec::new();
    let mut first_rtc = None;
    'modes: for mode in [ffi::HEUR_MODE_A, ffi::HEUR_MODE_FALLBACK] {
        match engine_configs(api, &graph, mode) {
            Ok(cfgs) => {
                for cfg in cfgs {
                    let plan = D::new(api, ffi::EXECUTION_PLAN_DESCRIPTOR)?;
                    plan.handle(ffi::ATTR_EXECUTION_PLAN_HANDLE, handle)?
                        .descs(ffi::ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[&cfg])?;
                    match plan.finalize("execution plan") {
                        Ok(()) => {
                            let ws = workspace_size(api, &plan)?;
                            if first_rtc.is_none() {
                                first_rtc = Some(runtime_compiled(api, &cfg));
                            }
                            parts.push(cfg);
                            plans.push((plan, ws));
                            if plans.len() >= want {
                                break 'modes;
                            }
                        }
                        Err(e) => errors.push(e),
                    }
                }
            }
            Err(e) => errors.push(e),
        }
        // The fallback list only where mode A gave nothing that finalised.
        if !plans.is_empty() {
            break;
        }
    }
    if plans.is_empty() {
        return Err(errors
            .last()
            .cloned()
            .unwrap_or_else(|| "the heuristics offered none".into()));
    }
    parts.push(graph);
    plan_cache::record(
        false,
        first_rtc.unwrap_or(false),
        start.elapsed().as_secs_f64(),
    );
    if let Some(path) = &keep {
        if let Some(json) = serialize(api, &plans[0].0) {
            if PlanStore::store(path, &json).is_err() {
                plan_cache::record_store_failure();
            }
        }
    }
    Ok(Finalised { parts, plans })
}

/// A finalised plan's workspace bytes.
fn workspace_size(api: &'static Api, plan: &D) -> R<usize> {
    let mut ws = [0i64];
    let mut n = 0i64;
    // SAFETY: one INT64 out.
    let st = unsafe {
        (api.get_attribute)(
            plan.raw,
            ffi::ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
            ffi::TYPE_INT64,
            1,
            &mut n,
            ws.as_mut_ptr().cast(),
        )
    };
    check(api, "workspace size", st)?;
    Ok(ws[0].max(0) as usize)
}

/// Whether the engine of `cfg` compiles its kernel at run time (its behaviour notes); false
/// where the library does not say.
fn runtime_compiled(api: &'static Api, cfg: &D) -> bool {
    let Ok(engine) = D::new(api, ffi::ENGINE_DESCRIPTOR) else {
        return false;
    };
    let mut raw = engine.raw;
    let mut n = 0i64;
    // SAFETY: one descriptor out, created above for cuDNN to fill.
    let st = unsafe {
        (api.get_attribute)(
            cfg.raw,
            ffi::ATTR_ENGINECFG_ENGINE,
            ffi::TYPE_BACKEND_DESCRIPTOR,
            1,
            &mut n,
            (&mut raw as *mut Desc).cast(),
        )
    };
    if st != ffi::STATUS_SUCCESS {
        return false;
    }
    let mut notes = [-1i32; 16];
    let mut got = 0i64;
    // SAFETY: up to 16 enum values out.
    let st = unsafe {
        (api.get_attribute)(
            engine.raw,
            ffi::ATTR_ENGINE_BEHAVIOR_NOTE,
            ffi::TYPE_BEHAVIOR_NOTE,
            notes.len() as i64,
            &mut got,
            notes.as_mut_ptr().cast(),
        )
    };
    st == ffi::STATUS_SUCCESS
        && notes[..got.clamp(0, notes.len() as i64) as usize]
            .contains(&ffi::BEHAVIOR_NOTE_RUNTIME_COMPILATION)
}

/// `plan` in cuDNN's serialised form, where the library serialises its engine.
fn serialize(api: &'static Api, plan: &D) -> Option<Vec<u8>> {
    let mut count = 0i64;
    // SAFETY: asks for the length only.
    let st = unsafe {
        (api.get_attribute)(
            plan.raw,
            ffi::ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            ffi::TYPE_CHAR,
            0,
            &mut count,
            std::ptr::null_mut(),
        )
    };
    if st != ffi::STATUS_SUCCESS || count <= 0 || count > (64 << 20) {
        return None;
    }
    let mut buf = vec![0u8; count as usize];
    let mut got = 0i64;
    // SAFETY: `count` chars out.
    let st = unsafe {
        (api.get_attribute)(
            plan.raw,
            ffi::ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
            ffi::TYPE_CHAR,
            count,
            &mut got,
            buf.as_mut_ptr().cast(),
        )
    };
    if st != ffi::STATUS_SUCCESS {
        return None;
    }
    buf.truncate(got.clamp(0, count) as usize);
    while buf.last() == Some(&0) {
        buf.pop();
    }
    (!buf.is_empty()).then_some(buf)
}

/// A plan read back from its serialised form `json` on `handle`.
fn deserialize(api: &'static Api, handle: Handle, json: &[u8]) -> R<D> {
    let plan = D::new(api, ffi::EXECUTION_PLAN_DESCRIPTOR)?;
    plan.handle(ffi::ATTR_EXECUTION_PLAN_HANDLE, handle)?;
    // cuDNN reads a NUL-terminated string.
    let mut text = json.to_vec();
    text.push(0);
    plan.set_raw(
        ffi::ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
        ffi::TYPE_CHAR,
        text.len(),
        text.as_ptr().cast(),
    )?;
    plan.finalize("execution plan read back")?;
    Ok(plan)
}

/// The engine configurations the heuristics offer for `graph`, best first.
fn engine_configs(api: &'static Api, graph: &D, mode: i32) -> R<Vec<D>> {
    let heur = D::new(api, ffi::ENGINEHEUR_DESCRIPTOR)?;
    heur.descs(ffi::ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?
        .enum32(ffi::ATTR_ENGINEHEUR_MODE, ffi::TYPE_HEUR_MODE, mode)?;
    heur.finalize("engine heuristics")?;
    let mut count = 0i64;
    // SAFETY: asks for the count only.
    let st = unsafe {
        (api.get_attribute)(
            heur.raw,
            ffi::ATTR_ENGINEHEUR_RESULTS,
            ffi::TYPE_BACKEND_DESCRIPTOR,
            0,
            &mut count,
            std::ptr::null_mut(),
        )
    };
    check(api, "engine heuristics results", st)?;
    let count = count.clamp(0, 64) as usize;
    let cfgs: Vec<D> = (0..count)
        .map(|_| D::new(api, ffi::ENGINECFG_DESCRIPTOR))
        .collect::<R<_>>()?;
    let mut raws: Vec<Desc> = cfgs.iter().map(|c| c.raw).collect();
    let mut got = 0i64;
    // SAFETY: `count` created engine-config descriptors to fill.
    let st = unsafe {
        (api.get_attribute)(
            heur.raw,
            ffi::ATTR_ENGINEHEUR_RESULTS,
            ffi::TYPE_BACKEND_DESCRIPTOR,
            count as i64,
            &mut got,
            raws.as_mut_ptr().cast(),
        )
    };
    check(api, "engine heuristics results", st)?;
    let mut cfgs = cfgs;
    cfgs.truncate(got.clamp(0, count as i64) as usize);
    Ok(cfgs)
}

/// Runs `plan` with the given device pointers (q, k, v, o, workspace), the host scale and,
/// for a plan built with a bias, the bias's device pointer.
pub fn execute(
    api: &'static Api,
    handle: Handle,
    plan: &Plan,
    ptrs: [u64; 4],
    workspace: u64,
    scale: &f32,
    bias: Option<u64>,
) -> R<()> {
    let mut uids = vec![UID_Q, UID_K, UID_V, UID_O, UID_SCALE];
    let mut data: Vec<*mut c_void> = vec![
        ptrs[0] as *mut c_void,
        ptrs[1] as *mut c_void,
        ptrs[2] as *mut c_void,
        ptrs[3] as *mut c_void,
        (scale as *const f32) as *mut c_void,
    ];
    if let Some(b) = bias {
        uids.push(UID_BIAS);
        data.push(b as *mut c_void);
    }
    run(
        api,
        handle,
        &plan.plan,
        &uids,
        &data,
        workspace,
        "execute attention",
    )
}

/// Where an FP8 attention's tensors are besides q, k, v, the output and the workspace.
pub struct Fp8Buffers {
    /// [`crate::model::fp8`]'s q/k/v scales: q's, k's and v's descales, the probabilities'
    /// descale and scale, the output's scale, one f32 every 16 bytes from here.
    pub scales: u64,
    /// Two f32 16 bytes apart: the probabilities' and the output's largest magnitudes.
    pub amax: u64,
    /// `(b, h, Lq)` f32: the softmax statistics.
    pub stats: u64,
}

/// Runs an FP8 plan ([`Form::Fp8`]): `ptrs` q, k, v and the output (all e4m3).
pub fn execute_fp8(
    api: &'static Api,
    handle: Handle,
    plan: &Plan,
    ptrs: [u64; 4],
    workspace: u64,
    scale: &f32,
    bufs: &Fp8Buffers,
) -> R<()> {
    let uids = [
        UID_Q,
        UID_K,
        UID_V,
        UID_O,
        UID_SCALE,
        UID_DESCALE_Q,
        UID_DESCALE_K,
        UID_DESCALE_V,
        UID_DESCALE_S,
        UID_SCALE_S,
        UID_SCALE_O,
        UID_AMAX_S,
        UID_AMAX_O,
        UID_STATS,
    ];
    let at = |p: u64| p as *mut c_void;
    let data = [
        at(ptrs[0]),
        at(ptrs[1]),
        at(ptrs[2]),
        at(ptrs[3]),
        (scale as *const f32) as *mut c_void,
        at(bufs.scales),
        at(bufs.scales + 16),
        at(bufs.scales + 32),
        at(bufs.scales + 48),
        at(bufs.scales + 64),
        at(bufs.scales + 80),
        at(bufs.amax),
        at(bufs.amax + 16),
        at(bufs.stats),
    ];
    run(
        api,
        handle,
        &plan.plan,
        &uids,
        &data,
        workspace,
        "execute FP8 attention",
    )
}

/// Runs a finalised plan on the tensors `uids` at `data` (device pointers, or host pointers
/// for by-value tensors) with `workspace` (0: none).
pub(super) fn run(
    api: &'static Api,
    handle: Handle,
    plan: &D,
    uids: &[i64],
    data: &[*mut c_void],
    workspace: u64,
    what: &str,
) -> R<()> {
    let pack = D::new(api, ffi::VARIANT_PACK_DESCRIPTOR)?;
    pack.i64s(ffi::ATTR_VARIANT_PACK_UNIQUE_IDS, uids)?;
    pack.set_raw(
        ffi::ATTR_VARIANT_PACK_DATA_POINTERS,
        ffi::TYPE_VOID_PTR,
        data.len(),
        data.as_ptr().cast(),
    )?;
    let ws = workspace as *mut c_void;
    pack.set_raw(
        ffi::ATTR_VARIANT_PACK_WORKSPACE,
        ffi::TYPE_VOID_PTR,
        1,
        (&ws as *const *mut c_void).cast(),
    )?;
    pack.finalize("variant pack")?;
    // SAFETY: a finalised plan and pack on the handle it was built with.
    check(api, what, unsafe {
        (api.execute)(handle, plan.raw, pack.raw)
    })
}
