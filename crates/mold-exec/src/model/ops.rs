//! Element-wise operations of the FLUX blocks, each in two implementations:
//!
//! - **candle**: compositions of candle ops — the reference, and what runs on CPU;
//! - **fused** (CUDA builds, CUDA tensors): mold's kernels from `kernels/elementwise.cu`,
//!   one pass over memory each, f32 arithmetic, one rounding. candle's broadcast kernels
//!   compute each element's source index with 64-bit divisions, which on FLUX-sized
//!   tensors costs several times the memory traffic.
//!
//! [`Kernels`] chooses ([`crate::ExecOptions::kernels`]; `MOLD_KERNELS=auto|fused|mold|cudnn|candle` at the CLI); attention
//! follows the same switch ([`super::attention`]).

use candle_core::{DType, Tensor, D};

type CResult<T> = candle_core::Result<T>;

/// Which implementation of attention and the element-wise operations runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernels {
    /// The fastest kernels that apply: attention through cuDNN where it loads and takes the
    /// shape, else mold's own attention kernel; mold's element-wise kernels; candle's ops
    /// elsewhere.
    Auto,
    /// As `Auto`, but a case no fused kernel handles is an error.
    Fused,
    /// mold's own kernels only — neither cuDNN attention nor cuBLASLt epilogues — and
    /// candle's ops elsewhere.
    Mold,
    /// As `Auto`, but attention must run through cuDNN: a machine or shape it cannot run
    /// is an error.
    Cudnn,
    /// Always candle's ops (the reference `--verify` compares against).
    Candle,
}

impl Kernels {
    /// `auto`, `fused`, `mold`, `cudnn` or `candle`.
    pub fn parse(s: &str) -> Result<Kernels, String> {
        match s.trim() {
            "auto" | "" => Ok(Kernels::Auto),
            "fused" => Ok(Kernels::Fused),
            "mold" => Ok(Kernels::Mold),
            "cudnn" => Ok(Kernels::Cudnn),
            "candle" => Ok(Kernels::Candle),
            other => Err(format!(
                "MOLD_KERNELS={other}: expected auto, fused, mold, cudnn or candle"
            )),
        }
    }

    /// Whether NVIDIA's libraries may run fused work: attention through cuDNN, bias and
    /// GELU in cuBLASLt's matmul epilogue. `mold` and `candle` keep to mold's own kernels
    /// (the state before them, for comparisons in one run).
    pub fn uses_libraries(self) -> bool {
        matches!(self, Kernels::Auto | Kernels::Fused | Kernels::Cudnn)
    }

    /// Whether to take the fused path, given whether it supports the inputs.
    pub(crate) fn use_fused(self, supported: bool, what: &str) -> CResult<bool> {
        match self {
            Kernels::Candle => Ok(false),
            Kernels::Auto | Kernels::Mold | Kernels::Cudnn => Ok(supported),
            Kernels::Fused if supported => Ok(true),
            Kernels::Fused => candle_core::bail!(
                "MOLD_KERNELS=fused: no fused kernel for this {what} (it needs a CUDA build, \
                 a CUDA tensor and a supported shape/dtype); unset MOLD_KERNELS to fall back \
                 to candle's ops"
            ),
        }
    }
}

/// Rows of `(b, l, n)` with unit column stride and uniform row stride; `n` even.
fn rows_ok(x: &Tensor) -> bool {
    if !cfg!(feature = "cuda") || !x.device().is_cuda() || x.rank() != 3 {
        return false;
    }
    let (b, l, n) = match x.dims3() {
        Ok(d) => d,
        Err(_) => return false,
    };
    let s = x.stride();
    n % 2 == 0 && s[2] == 1 && (b == 1 || s[0] == l * s[1]) && (l == 1 || s[1] >= n)
}

/// A per-batch vector `(b, 1, n)` or `(n)` with unit column stride.
fn vec_ok(v: &Tensor, x: &Tensor) -> bool {
    v.dtype() == x.dtype()
        && v.device().same_device(x.device())
        && match v.rank() {
            1 => v.stride()[0] == 1 && v.dim(0).ok() == x.dim(D::Minus1).ok(),
            3 => {
                v.stride()[2] == 1
                    && v.dim(1).ok() == Some(1)
                    && v.dim(0).ok() == x.dim(0).ok()
                    && v.dim(2).ok() == x.dim(2).ok()
            }
            _ => false,
        }
}

/// `x + bias`, then tanh-GELU when `gelu`; `bias` broadcast over the last dimension.
pub fn bias_act(x: &Tensor, bias: Option<&Tensor>, gelu: bool, k: Kernels) -> CResult<Tensor> {
    let supported = rows_ok(x) && bias.is_none_or(|b| b.rank() == 1 && vec_ok(b, x));
    if k.use_fused(supported, "bias/GELU")? {
        return fused::bias_act(x, bias, gelu);
    }
    let y = match bias {
        Some(b) => x.broadcast_add(b)?,
        None => x.clone(),
    };
    if gelu {
        y.gelu()
    } else {
        Ok(y)
    }
}

/// The activation of a gated feed-forward's first half.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// SiLU (Qwen2's and LLaMA's SwiGLU).
    Silu,
    /// tanh-GELU (T5 v1.1's gated-gelu).
    GeluTanh,
}

/// `act(x[…, :n]) · x[…, n:]` for `x` `(…, 2n)`: a gated feed-forward's two halves, as one
/// product computes them side by side, in one pass where mold's kernel runs (CUDA bf16, f16
/// or f32, contiguous, `n` even), else candle's ops on the two halves.
pub fn gated(x: &Tensor, act: Gate, k: Kernels) -> CResult<Tensor> {
    let two = x.dim(D::Minus1)?;
    if two % 2 != 0 {
        candle_core::bail!("gated: the last dimension {two} is not two halves");
    }
    let n = two / 2;
    let supported = cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && x.is_contiguous()
        && n.is_multiple_of(2)
        && x.layout().start_offset().is_multiple_of(2);
    if k.use_fused(supported, "gated activation")? {
        let lead = &x.dims()[..x.rank() - 1];
        let rows: usize = lead.iter().product();
        let mut shape = lead.to_vec();
        shape.push(n);
        return fused::gated(&x.reshape((1, rows, two))?, act)?.reshape(shape);
    }
    let a = x.narrow(D::Minus1, 0, n)?;
    let a = match act {
        Gate::Silu => candle_nn::ops::silu(&a)?,
        Gate::GeluTanh => a.gelu()?,
    };
    a.mul(&x.narrow(D::Minus1, n, n)?)
}

/// The shape of a grouped-query attention: `heads` query heads, `kv` key/value heads (each
/// read by `heads / kv` query heads), head size `d`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupedHeads {
    pub heads: usize,
    pub kv: usize,
    pub d: usize,
}

/// q, k and v for a grouped-query attention from the fused projection `qkv` `(L, ≥ (heads +
/// 2 kv) · d)` (q | k | v): q and k rotated by the rotate-half rotary embedding (`cos`,
/// `sin` `(L, d / 2)`, f32), k and v repeated to the query heads (head `h` reads key/value
/// head `h / (heads / kv)`), as `(3, L, heads, d)`. One pass of mold's kernel where it runs
/// (CUDA, `qkv` rows with unit column stride), else candle's rotary embedding and copies.
pub fn qkv_rope_gqa(
    qkv: &Tensor,
    g: GroupedHeads,
    cos: &Tensor,
    sin: &Tensor,
    k: Kernels,
) -> CResult<Tensor> {
    let GroupedHeads { heads, kv, d } = g;
    let (n, w) = qkv.dims2()?;
    if kv == 0 || !heads.is_multiple_of(kv) || !d.is_multiple_of(2) || w < (heads + 2 * kv) * d {
        candle_core::bail!(
            "qkv_rope_gqa: {heads} heads, {kv} key/value heads of size {d} do not fit rows of {w}"
        );
    }
    if cos.dims() != [n, d / 2] || sin.dims() != [n, d / 2] {
        candle_core::bail!(
            "qkv_rope_gqa: tables {:?} and {:?} for {n} tokens of head size {d}",
            cos.dims(),
            sin.dims()
        );
    }
    let supported = cfg!(feature = "cuda")
        && qkv.device().is_cuda()
        && matches!(qkv.dtype(), DType::BF16 | DType::F16 | DType::F32)
        && qkv.stride()[1] == 1
        && d / 2 <= 1024
        && heads <= 65_535
        && [cos, sin]
            .iter()
            .all(|t| t.dtype() == DType::F32 && t.is_contiguous());
    if k.use_fused(supported, "grouped q/k/v preparation")? {
        return fused::qkv_rope_gqa(qkv, g, cos, sin);
    }
    let (cos, sin) = (cos.to_dtype(qkv.dtype())?, sin.to_dtype(qkv.dtype())?);
    let qk = qkv
        .narrow(1, 0, (heads + kv) * d)?
        .reshape((1, n, heads + kv, d))?
        .contiguous()?;
    let qk = candle_nn::rotary_emb::rope_thd(&qk, &cos, &sin)?;
    let rep = heads / kv;
    let grouped = |t: Tensor| -> CResult<Tensor> {
        t.unsqueeze(3)?
            .expand((1, n, kv, rep, d))?
            .reshape((1, n, heads, d))
    };
    let q = qk.narrow(2, 0, heads)?;
    let kk = grouped(qk.narrow(2, heads, kv)?)?;
    let v = grouped(
        qkv.narrow(1, (heads + kv) * d, kv * d)?
            .reshape((1, n, kv, d))?,
    )?;
    Tensor::cat(&[q, kk, v], 0)
}

/// `x * (1 + scale) + shift`, `scale` and `shift` `(b, 1, n)`.
pub fn modulate(x: &Tensor, scale: &Tensor, shift: &Tensor, k: Kernels) -> CResult<Tensor> {
    let supported = rows_ok(x) && vec_ok(scale, x) && vec_ok(shift, x);
    if k.use_fused(supported, "modulation")? {
        return fused::modulate(x, scale, shift);
    }
    x.broadcast_mul(&(scale + 1.)?)?.broadcast_add(shift)
}

/// `res + gate * (x + bias)`, `gate` `(b, 1, n)`, `bias` `(n)` or none: a row-parallel
/// layer's bias added in the same pass as the gated residual.
pub fn gate_residual(
    res: &Tensor,
    x: &Tensor,
    bias: Option<&Tensor>,
    gate: &Tensor,
    k: Kernels,
) -> CResult<Tensor> {
    let supported = rows_ok(res)
        && rows_ok(x)
        && res.dims() == x.dims()
        && res.dtype() == x.dtype()
        && vec_ok(gate, x)
        && bias.is_none_or(|b| b.rank() == 1 && vec_ok(b, x));
    if k.use_fused(supported, "gated residual")? {
        return fused::gate_residual(res, x, bias, gate);
    }
    let x = match bias {
        Some(b) => x.broadcast_add(b)?,
        None => x.clone(),
    };
    res + gate.broadcast_mul(&x)?
}

/// LayerNorm over the last dimension without affine parameters (BFL's
/// `elementwise_affine=False`), through candle's fused layer-norm kernel (candle-nn's
/// `LayerNorm` takes a slow composed path, with f32 copies, when there is no bias).
pub fn layer_norm(x: &Tensor, eps: f32) -> CResult<Tensor> {
    let h = x.dim(D::Minus1)?;
    let ones = Tensor::ones(h, x.dtype(), x.device())?;
    let zeros = Tensor::zeros(h, x.dtype(), x.device())?;
    candle_nn::ops::layer_norm(&x.contiguous()?, &ones, &zeros, eps)
}

/// `layer_norm(x) * (1 + scale) + shift`, `scale` and `shift` `(b, 1, n)`: one pass over
/// `x` on CUDA (the normalised row is never written out), else [`layer_norm`] then
/// [`modulate`].
pub fn ln_modulate(
    x: &Tensor,
    scale: &Tensor,
    shift: &Tensor,
    eps: f32,
    k: Kernels,
) -> CResult<Tensor> {
    let supported = rows_ok(x)
        && vec_ok(scale, x)
        && vec_ok(shift, x)
        && x.dim(D::Minus1).is_ok_and(|n| n * 4 <= LN_SHARED_MAX);
    if k.use_fused(supported, "LayerNorm + modulation")? {
        return fused::ln_modulate(x, scale, shift, eps);
    }
    modulate(&layer_norm(x, eps)?, scale, shift, k)
}

/// [`ln_modulate`] quantized per token to e4m3 in the same pass, for FP8 products
/// ([`super::fp8::linear_rows`]): the same values and scales as `ln_modulate` followed by a
/// product's own quantization. `None` where the kernel does not run (not CUDA, candle's
/// ops, a dtype other than bf16/f16, rows not a multiple of 16 wide or too wide): the
/// caller then takes [`ln_modulate`].
pub fn ln_modulate_fp8(
    x: &Tensor,
    scale: &Tensor,
    shift: &Tensor,
    eps: f32,
    k: Kernels,
) -> CResult<Option<super::fp8::Fp8Rows>> {
    let supported = rows_ok(x)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && vec_ok(scale, x)
        && vec_ok(shift, x)
        && x.dim(D::Minus1)
            .is_ok_and(|n| n % 16 == 0 && n * 4 <= LN_SHARED_MAX);
    if !supported || !k.use_fused(true, "LayerNorm + modulation")? {
        return Ok(None);
    }
    fused::ln_modulate_fp8(x, scale, shift, eps).map(Some)
}

/// The widest row [`ln_modulate`]'s kernel stages in shared memory (as f32): a block's 48 KiB
/// (static and dynamic together, without opting into more) less the kernels' static
/// reduction buffer. A version holding the row, its scale and shift in registers (all loads
/// issued before the first reduction) measured 2.3 ms a step slower on an H200 (128.6
/// against 126.3 ms, one call).
const LN_SHARED_MAX: usize = 48 * 1024 - 256;

/// One sequence segment for [`qkv_prep_fused`]: the fused projection `(b, len, ≥ 3·heads·d)`
/// (q | k | v first) and the q/k RMSNorm scales `(d)`.
pub struct QkvSegment<'a> {
    pub qkv: &'a Tensor,
    pub q_scale: &'a Tensor,
    pub k_scale: &'a Tensor,
}

/// Whether [`qkv_prep_fused`] handles these segments.
pub fn qkv_prep_supported(segs: &[QkvSegment], heads: usize) -> bool {
    let Some(first) = segs.first() else {
        return false;
    };
    let d = match first.q_scale.dims1() {
        Ok(d @ (64 | 128)) => d,
        _ => return false,
    };
    segs.iter().all(|s| {
        rows_ok(s.qkv)
            && s.qkv.dtype() == first.qkv.dtype()
            && s.qkv.dim(0).ok() == first.qkv.dim(0).ok()
            && s.qkv.dim(2).is_ok_and(|w| w >= 3 * heads * d)
            && [s.q_scale, s.k_scale].iter().all(|v| {
                v.dims1().ok() == Some(d)
                    && v.stride()[0] == 1
                    && v.dtype() == s.qkv.dtype()
                    && v.device().same_device(s.qkv.device())
            })
    })
}

/// q, k, v for attention in one pass per segment: RMSNorm and RoPE (tables `cos`, `sin`,
/// f32, `(b or 1, L, d/2)`) on q and k, all three transposed to `(b, heads, L, d)` with the
/// segments concatenated along the sequence. Returns `(3, b, heads, L, d)`. Callers check
/// [`qkv_prep_supported`] first (CUDA builds only).
pub fn qkv_prep_fused(
    segs: &[QkvSegment],
    heads: usize,
    cos: &Tensor,
    sin: &Tensor,
    eps: f32,
) -> CResult<Tensor> {
    Ok(fused::qkv_prep(segs, heads, QkvLayout::default(), cos, sin, eps)?.out)
}

/// Partial maxima per tensor [`qkv_prep_fused_amax`] folds each block's largest magnitudes
/// into (`QKV_AMAX_SLOTS` in kernels/elementwise.cu), each the first of
/// [`QKV_AMAX_STRIDE`] floats (one 128-byte line: the blocks' atomics spread over the L2).
pub const QKV_AMAX_SLOTS: usize = 64;
/// Floats from one of [`qkv_prep_fused_amax`]'s partial maxima to the next (the rest 0).
pub const QKV_AMAX_STRIDE: usize = 32;

/// [`qkv_prep_fused`] that also takes the largest magnitude of q, k and v as it writes them:
/// `(3, b, heads, L, d)` and `(3, QKV_AMAX_SLOTS, QKV_AMAX_STRIDE)` f32 partial maxima in
/// `[.., .., 0]`, the rest 0 (each tensor's amax is the largest of its slice), for FP8
/// attention's per-tensor scales without a pass over q, k and v of their own
/// ([`super::attention::fp8_attention`]). The same values as a pass over
/// the written tensors: the maxima are of the values as stored, NaN skipped.
pub fn qkv_prep_fused_amax(
    segs: &[QkvSegment],
    heads: usize,
    cos: &Tensor,
    sin: &Tensor,
    eps: f32,
) -> CResult<(Tensor, Tensor)> {
    let layout = QkvLayout {
        amax: true,
        ..QkvLayout::default()
    };
    let p = fused::qkv_prep(segs, heads, layout, cos, sin, eps)?;
    match p.amax {
        Some(a) => Ok((p.out, a)),
        None => candle_core::bail!("mold qkv-prep: no maxima taken"),
    }
}

/// The fused q/k/v kernel's output layout: `(3, b, heads, L, d)` (the default), or the
/// all-to-all's messages over `groups` ranks, with group `own.0`'s piece written at element
/// `own.1` of a second buffer of `extra` elements instead of its place among them. With
/// `amax`, the values' largest magnitudes are taken as they are written
/// ([`qkv_prep_fused_amax`]).
#[derive(Clone, Copy, Default)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct QkvLayout {
    groups: usize,
    own: Option<(usize, usize)>,
    extra: usize,
    amax: bool,
}

/// What the fused q/k/v kernel wrote: its output, the receive buffer holding the own piece
/// (`QkvLayout::own`) and the partial maxima (`QkvLayout::amax`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Prepared {
    out: Tensor,
    me: Option<Tensor>,
    amax: Option<Tensor>,
}

/// Where [`qkv_prep_fused_groups`] writes the rank's own piece: straight into the buffer
/// the all-to-all receives the other ranks' pieces into, `(total, 3, b, heads_rank, d)`, at
/// token `before` (the tokens of the ranks before it).
#[derive(Clone, Copy, Debug)]
pub struct OwnPiece {
    pub rank: usize,
    pub before: usize,
    pub total: usize,
}

/// [`qkv_prep_fused_groups`]'s result: the messages, message j `(L, 3, b, heads_j, d)`, and
/// with [`OwnPiece`] the receive buffer `(total, 3, b, heads_rank, d)`, whose own piece
/// is already written (message `rank` is that piece, a view of it).
pub struct Messages {
    pub send: Vec<Tensor>,
    pub recv: Option<Tensor>,
    /// The partial maxima of q, k and v over this rank's tokens of every head, as
    /// [`qkv_prep_fused_amax`] takes them, where asked.
    pub amax: Option<Tensor>,
}

/// [`qkv_prep_fused`] writing the messages of a sequence-parallel all-to-all over
/// `groups` ranks instead: piece j holds heads [`super::sequence::split`]`(heads, j,
/// groups)` of q, k and v token-major, `(L, 3, b, heads_j, d)`, each piece contiguous and
/// the pieces one buffer. So no copy puts the messages together, and the pieces received
/// from every rank, one after another, are all tokens of a group of heads. With `own`,
/// the rank's own piece is written where the pieces are received, so it is not copied
/// there either. With `amax`, the values' largest magnitudes are taken as they are
/// written ([`Messages::amax`]).
#[allow(clippy::too_many_arguments)]
pub fn qkv_prep_fused_groups(
    segs: &[QkvSegment],
    heads: usize,
    groups: usize,
    own: Option<OwnPiece>,
    amax: bool,
    cos: &Tensor,
    sin: &Tensor,
    eps: f32,
) -> CResult<Messages> {
    if groups == 0 || groups > heads {
        candle_core::bail!("mold qkv-prep: {heads} heads cannot make {groups} groups");
    }
    let first = segs[0].qkv;
    let b = first.dim(0)?;
    let d = segs[0].q_scale.dims1()?;
    let len: usize = segs.iter().map(|s| s.qkv.dim(1)).sum::<CResult<usize>>()?;
    let row = |j: usize| 3 * b * super::sequence::split(heads, j, groups).len() * d;
    if let Some(o) = own {
        if o.rank >= groups || o.before + len > o.total {
            candle_core::bail!(
                "mold qkv-prep: own piece {o:?} does not fit {len} tokens over {groups} ranks"
            );
        }
    }
    let layout = QkvLayout {
        groups,
        own: own.map(|o| (o.rank, o.before * row(o.rank))),
        extra: own.map_or(0, |o| o.total * row(o.rank)),
        amax,
    };
    let Prepared {
        out: flat,
        me,
        amax,
    } = fused::qkv_prep(segs, heads, layout, cos, sin, eps)?;
    let recv = match (me, own) {
        (Some(t), Some(o)) => {
            let hs = super::sequence::split(heads, o.rank, groups).len();
            Some(t.reshape((o.total, 3, b, hs, d))?)
        }
        _ => None,
    };
    let mut off = 0;
    let send = (0..groups)
        .map(|j| {
            let hs = super::sequence::split(heads, j, groups).len();
            let n = len * row(j);
            let piece = match (&recv, own) {
                (Some(r), Some(o)) if o.rank == j => r.narrow(0, o.before, len)?,
                _ => flat.narrow(0, off, n)?.reshape((len, 3, b, hs, d))?,
            };
            off += n;
            Ok(piece)
        })
        .collect::<CResult<Vec<_>>>()?;
    Ok(Messages { send, recv, amax })
}

/// Tensors `(b, L, w_j)` put side by side along the last dimension, `(b, L, Σ w_j)`: the
/// attention output's head groups after a sequence-parallel all-to-all. On CUDA, where
/// every piece is contiguous and its rows a whole number of 16-byte units, one vectorised
/// copy kernel per piece (candle's `cat` of the same reaches about 1 TB/s on an H200);
/// elsewhere `Tensor::cat`.
pub fn join_columns(pieces: &[Tensor]) -> CResult<Tensor> {
    if let Some(t) = fused::join_columns(pieces)? {
        return Ok(t);
    }
    Tensor::cat(pieces, 2)
}

#[cfg(not(feature = "cuda"))]
mod fused {
    pub fn join_columns(_: &[Tensor]) -> CResult<Option<Tensor>> {
        Ok(None)
    }

    pub fn qkv_prep(
        _: &[super::QkvSegment],
        _: usize,
        _: super::QkvLayout,
        _: &Tensor,
        _: &Tensor,
        _: f32,
    ) -> CResult<super::Prepared> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    use super::CResult;
    use candle_core::Tensor;
    // Never reached: `rows_ok` is false without the `cuda` feature.
    pub fn bias_act(_: &Tensor, _: Option<&Tensor>, _: bool) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn modulate(_: &Tensor, _: &Tensor, _: &Tensor) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn gate_residual(
        _: &Tensor,
        _: &Tensor,
        _: Option<&Tensor>,
        _: &Tensor,
    ) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn ln_modulate(_: &Tensor, _: &Tensor, _: &Tensor, _: f32) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn ln_modulate_fp8(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: f32,
    ) -> CResult<crate::model::fp8::Fp8Rows> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn gated(_: &Tensor, _: super::Gate) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
    pub fn qkv_rope_gqa(
        _: &Tensor,
        _: super::GroupedHeads,
        _: &Tensor,
        _: &Tensor,
    ) -> CResult<Tensor> {
        candle_core::bail!("fused kernels need a CUDA build")
    }
}

/// mold's element-wise kernels as a fat binary (its architectures are every kernel's).
#[cfg(feature = "cuda")]
pub(crate) use fused::FATBIN as KERNELS_FATBIN;

#[cfg(feature = "cuda")]
mod fused {
    use super::CResult;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, WrapErr};
    use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
    use half::{bf16, f16};

    /// Built for the same architectures as mold's other kernels and candle's (build.rs):
    /// what [`crate::runtime`] checks a GPU against when it opens one.
    pub(crate) const FATBIN: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/elementwise.fatbin"));
    const MODULE: &str = "mold_elementwise";
    const THREADS: u32 = 256;

    fn suffix(dt: DType) -> CResult<&'static str> {
        Ok(match dt {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
        })
    }

    /// rows, n, row stride of a `(b, l, n)` layout.
    fn rows(l: &Layout) -> CResult<(usize, usize, i64)> {
        let (b, len, n) = l.shape().dims3()?;
        let ld = if len > 1 { l.stride()[1] } else { n };
        Ok((b * len, n, ld as i64))
    }

    /// Batch stride of a `(b, 1, n)` or `(n)` vector.
    fn batch_stride(l: &Layout) -> i64 {
        if l.shape().rank() == 3 && l.dims()[0] > 1 {
            l.stride()[0] as i64
        } else {
            0
        }
    }

    fn config(rows: usize, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, (n / 2).div_ceil(THREADS as usize) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> CResult<CudaView<'a, T>> {
        Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
    }

    fn func(
        dev: &CudaDevice,
        name: &str,
        dt: DType,
    ) -> CResult<candle_core::cuda::cudarc::driver::CudaFunction> {
        Ok(dev
            .get_or_load_custom_fatbin(&format!("{name}_{}", suffix(dt)?), MODULE, FATBIN)?
            .into_cuda_function())
    }

    fn out<T: CudaDType + DeviceRepr>(dev: &CudaDevice, len: usize) -> CResult<CudaSlice<T>> {
        // SAFETY: every element is written by the kernel.
        unsafe { dev.alloc::<T>(len) }
    }

    fn cpu_refused() -> CResult<(CpuStorage, Shape)> {
        candle_core::bail!("mold fused kernels run on CUDA only")
    }

    // ---- bias + activation ----------------------------------------------------------

    struct BiasAct {
        gelu: bool,
    }

    impl BiasAct {
        fn name(&self) -> &'static str {
            if self.gelu {
                "mold_bias_gelu"
            } else {
                "mold_bias_add"
            }
        }
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            b: Option<(&CudaStorage, &Layout)>,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let (r, n, ld) = rows(xl)?;
            let f = func(dev, self.name(), x.dtype())?;
            let y = out::<T>(dev, r * n)?;
            let xv = view::<T>(x, xl)?;
            let null: u64 = 0;
            let bv = b.map(|(s, l)| view::<T>(s, l)).transpose()?;
            let n32 = n as i32;
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv);
            match &bv {
                Some(v) => a.arg(v),
                None => a.arg(&null),
            };
            a.arg(&y).arg(&n32).arg(&ld);
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(config(r, n)) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    macro_rules! by_dtype {
        ($dt:expr, $f:ident, $($arg:expr),*) => {
            match $dt {
                DType::BF16 => $f::<bf16>($($arg),*),
                DType::F16 => $f::<f16>($($arg),*),
                DType::F32 => $f::<f32>($($arg),*),
                dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
            }
        };
    }

    impl CustomOp1 for BiasAct {
        fn name(&self) -> &'static str {
            "mold-bias-act"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
            cpu_refused()
        }
        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, None),
                DType::F16 => self.run::<f16>(x, xl, None),
                DType::F32 => self.run::<f32>(x, xl, None),
                dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
            }
        }
    }

    impl CustomOp2 for BiasAct {
        fn name(&self) -> &'static str {
            "mold-bias-act"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            cpu_refused()
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, Some((b, bl))),
                DType::F16 => self.run::<f16>(x, xl, Some((b, bl))),
                DType::F32 => self.run::<f32>(x, xl, Some((b, bl))),
                dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn bias_act(x: &Tensor, bias: Option<&Tensor>, gelu: bool) -> CResult<Tensor> {
        let op = BiasAct { gelu };
        match bias {
            Some(b) => x.apply_op2_no_bwd(b, &op),
            None => x.apply_op1_no_bwd(&op),
        }
    }

    // ---- gated activation -----------------------------------------------------------

    struct Gated {
        act: super::Gate,
    }

    impl Gated {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let (r, two, ld) = rows(xl)?;
            let n = two / 2;
            let name = match self.act {
                super::Gate::Silu => "mold_gated_silu",
                super::Gate::GeluTanh => "mold_gated_gelu",
            };
            let f = func(dev, name, x.dtype())?;
            let y = out::<T>(dev, r * n)?;
            let xv = view::<T>(x, xl)?;
            let n32 = n as i32;
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv).arg(&y).arg(&n32).arg(&ld);
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(config(r, n)) }.w()?;
            let (b, len, _) = xl.shape().dims3()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                Shape::from((b, len, n)),
            ))
        }
    }

    impl CustomOp1 for Gated {
        fn name(&self) -> &'static str {
            "mold-gated"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
            cpu_refused()
        }
        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
            by_dtype!(x.dtype(), run_gated, self, x, xl)
        }
    }

    fn run_gated<T: CudaDType + DeviceRepr>(
        g: &Gated,
        x: &CudaStorage,
        xl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        g.run::<T>(x, xl)
    }

    pub fn gated(x: &Tensor, act: super::Gate) -> CResult<Tensor> {
        x.apply_op1_no_bwd(&Gated { act })
    }

    // ---- grouped q/k/v preparation -----------------------------------------------------

    struct QkvRopeGqa {
        g: super::GroupedHeads,
    }

    fn run_qkv_rope_gqa<T: CudaDType + DeviceRepr>(
        op: &QkvRopeGqa,
        x: &CudaStorage,
        xl: &Layout,
        c: &CudaStorage,
        cl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let super::GroupedHeads { heads, kv, d } = op.g;
        let dev = &x.device;
        let (n, _) = xl.shape().dims2()?;
        let ld = xl.stride()[0] as i64;
        let f = func(dev, "mold_qkv_rope_gqa", x.dtype())?;
        let y = out::<T>(dev, 3 * n * heads * d)?;
        let xv = view::<T>(x, xl)?;
        let cv = view::<f32>(c, cl)?;
        let sv = view::<f32>(s, sl)?;
        let (n32, h32, kv32, d32) = (n as i32, heads as i32, kv as i32, d as i32);
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&xv)
            .arg(&ld)
            .arg(&n32)
            .arg(&h32)
            .arg(&kv32)
            .arg(&d32)
            .arg(&cv)
            .arg(&sv)
            .arg(&y);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, heads as u32, 3),
            block_dim: ((d / 2) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match the kernel; the grid covers the output.
        unsafe { a.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            Shape::from((3, n, heads, d)),
        ))
    }

    impl CustomOp3 for QkvRopeGqa {
        fn name(&self) -> &'static str {
            "mold-qkv-rope-gqa"
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
            cpu_refused()
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            c: &CudaStorage,
            cl: &Layout,
            s: &CudaStorage,
            sl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            by_dtype!(x.dtype(), run_qkv_rope_gqa, self, x, xl, c, cl, s, sl)
        }
    }

    pub fn qkv_rope_gqa(
        qkv: &Tensor,
        g: super::GroupedHeads,
        cos: &Tensor,
        sin: &Tensor,
    ) -> CResult<Tensor> {
        qkv.apply_op3_no_bwd(cos, sin, &QkvRopeGqa { g })
    }

    // ---- modulation -----------------------------------------------------------------

    struct Modulate;

    fn modulate_run<T: CudaDType + DeviceRepr>(
        x: &CudaStorage,
        xl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
        h: &CudaStorage,
        hl: &Layout,
    ) -> CResult<(CudaStorage, Shape)> {
        let dev = &x.device;
        let (r, n, ld) = rows(xl)?;
        let len = xl.dims()[1] as i32;
        let f = func(dev, "mold_modulate", x.dtype())?;
        let y = out::<T>(dev, r * n)?;
        let (xv, sv, hv) = (view::<T>(x, xl)?, view::<T>(s, sl)?, view::<T>(h, hl)?);
        let (n32, ss, hs) = (n as i32, batch_stride(sl), batch_stride(hl));
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&xv)
            .arg(&sv)
            .arg(&hv)
            .arg(&y)
            .arg(&n32)
            .arg(&ld)
            .arg(&len)
            .arg(&ss)
            .arg(&hs);
        // SAFETY: argument order and types match the kernel.
        unsafe { a.launch(config(r, n)) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            xl.shape().clone(),
        ))
    }

    impl CustomOp3 for Modulate {
        fn name(&self) -> &'static str {
            "mold-modulate"
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
            cpu_refused()
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            s: &CudaStorage,
            sl: &Layout,
            h: &CudaStorage,
            hl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            by_dtype!(x.dtype(), modulate_run, x, xl, s, sl, h, hl)
        }
    }

    pub fn modulate(x: &Tensor, scale: &Tensor, shift: &Tensor) -> CResult<Tensor> {
        x.apply_op3_no_bwd(scale, shift, &Modulate)
    }

    // ---- gated residual -------------------------------------------------------------

    fn gate_run<T: CudaDType + DeviceRepr>(
        res: &Tensor,
        x: &Tensor,
        bias: Option<&Tensor>,
        gate: &Tensor,
    ) -> CResult<Tensor> {
        let dev = match x.device() {
            candle_core::Device::Cuda(d) => d.clone(),
            _ => candle_core::bail!("mold gated residual: not a CUDA tensor"),
        };
        let (rs, rl) = res.storage_and_layout();
        let (xs, xl) = x.storage_and_layout();
        let (gs, gl) = gate.storage_and_layout();
        let (r, n, ldx) = rows(xl)?;
        let (_, _, ldr) = rows(rl)?;
        let len = xl.dims()[1] as i32;
        let f = func(&dev, "mold_gate_residual", x.dtype())?;
        let y = out::<T>(&dev, r * n)?;
        let rv = cuda_view::<T>(&rs, rl)?;
        let xv = cuda_view::<T>(&xs, xl)?;
        let gv = cuda_view::<T>(&gs, gl)?;
        let bsl = bias.map(|b| b.storage_and_layout());
        let bv = match &bsl {
            Some((bs, bl)) => Some(cuda_view::<T>(bs, bl)?),
            None => None,
        };
        let null: u64 = 0;
        let (n32, gstride) = (n as i32, batch_stride(gl));
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&rv).arg(&xv);
        match &bv {
            Some(v) => a.arg(v),
            None => a.arg(&null),
        };
        a.arg(&gv)
            .arg(&y)
            .arg(&n32)
            .arg(&ldr)
            .arg(&ldx)
            .arg(&len)
            .arg(&gstride);
        // SAFETY: argument order and types match the kernel.
        unsafe { a.launch(config(r, n)) }.w()?;
        let shape = xl.shape().clone();
        drop((rs, xs, gs, bsl));
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(y, dev)),
            shape,
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    pub fn gate_residual(
        res: &Tensor,
        x: &Tensor,
        bias: Option<&Tensor>,
        gate: &Tensor,
    ) -> CResult<Tensor> {
        match x.dtype() {
            DType::BF16 => gate_run::<bf16>(res, x, bias, gate),
            DType::F16 => gate_run::<f16>(res, x, bias, gate),
            DType::F32 => gate_run::<f32>(res, x, bias, gate),
            dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
        }
    }

    // ---- LayerNorm + modulation -----------------------------------------------------

    struct LnModulate {
        eps: f32,
    }

    impl LnModulate {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            s: &CudaStorage,
            sl: &Layout,
            h: &CudaStorage,
            hl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let (r, n, ld) = rows(xl)?;
            let len = xl.dims()[1] as i32;
            let f = func(dev, "mold_ln_modulate", x.dtype())?;
            let y = out::<T>(dev, r * n)?;
            let (xv, sv, hv) = (view::<T>(x, xl)?, view::<T>(s, sl)?, view::<T>(h, hl)?);
            let (n32, ss, hs) = (n as i32, batch_stride(sl), batch_stride(hl));
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv)
                .arg(&sv)
                .arg(&hv)
                .arg(&y)
                .arg(&n32)
                .arg(&ld)
                .arg(&len)
                .arg(&ss)
                .arg(&hs)
                .arg(&self.eps);
            let cfg = LaunchConfig {
                grid_dim: (r as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: (n * 4) as u32,
            };
            // SAFETY: argument order and types match the kernel; `n * 4` bytes of shared
            // memory hold the row (checked against LN_SHARED_MAX by the caller).
            unsafe { a.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    impl CustomOp3 for LnModulate {
        fn name(&self) -> &'static str {
            "mold-ln-modulate"
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
            cpu_refused()
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            s: &CudaStorage,
            sl: &Layout,
            h: &CudaStorage,
            hl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, s, sl, h, hl),
                DType::F16 => self.run::<f16>(x, xl, s, sl, h, hl),
                DType::F32 => self.run::<f32>(x, xl, s, sl, h, hl),
                dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn ln_modulate(x: &Tensor, scale: &Tensor, shift: &Tensor, eps: f32) -> CResult<Tensor> {
        x.apply_op3_no_bwd(scale, shift, &LnModulate { eps })
    }

    /// `mold_ln_modulate_fp8`: e4m3 values `(rows, n)` and one scale per row, one kernel.
    pub fn ln_modulate_fp8(
        x: &Tensor,
        scale: &Tensor,
        shift: &Tensor,
        eps: f32,
    ) -> CResult<crate::model::fp8::Fp8Rows> {
        use candle_core::{op::BackpropOp, Storage};
        let (xs, xl) = x.storage_and_layout();
        let (ss, sl) = scale.storage_and_layout();
        let (hs, hl) = shift.storage_and_layout();
        let (Storage::Cuda(xs), Storage::Cuda(ss), Storage::Cuda(hs)) = (&*xs, &*ss, &*hs) else {
            candle_core::bail!("mold-ln-modulate-fp8: operands not on the GPU");
        };
        let dev = xs.device.clone();
        let dt = xs.dtype();
        let (r, n, ld) = rows(xl)?;
        let len = xl.dims()[1] as i32;
        let f = func(&dev, "mold_ln_modulate_fp8", dt)?;
        let q = out::<float8::F8E4M3>(&dev, r * n)?;
        let qs = out::<f32>(&dev, r)?;
        let (n32, sst, hst) = (n as i32, batch_stride(sl), batch_stride(hl));
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        let (xb, sb, hb, xh, sh, hh);
        match dt {
            DType::BF16 => {
                (xb, sb, hb) = (
                    view::<bf16>(xs, xl)?,
                    view::<bf16>(ss, sl)?,
                    view::<bf16>(hs, hl)?,
                );
                a.arg(&xb).arg(&sb).arg(&hb)
            }
            DType::F16 => {
                (xh, sh, hh) = (
                    view::<f16>(xs, xl)?,
                    view::<f16>(ss, sl)?,
                    view::<f16>(hs, hl)?,
                );
                a.arg(&xh).arg(&sh).arg(&hh)
            }
            dt => candle_core::bail!("mold-ln-modulate-fp8: unsupported dtype {dt:?}"),
        };
        a.arg(&q)
            .arg(&qs)
            .arg(&n32)
            .arg(&ld)
            .arg(&len)
            .arg(&sst)
            .arg(&hst)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (r as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (n * 4) as u32,
        };
        // SAFETY: argument order and types match the kernel; `n * 4` bytes of shared memory
        // hold the row (checked against LN_SHARED_MAX by the caller); the kernel writes
        // every value and scale.
        unsafe { a.launch(cfg) }.w()?;
        let wrap = |st: CudaStorage, shape: Shape| {
            Tensor::from_storage(Storage::Cuda(st), shape, BackpropOp::none(), false)
        };
        crate::model::fp8::Fp8Rows::new(
            wrap(
                CudaStorage::wrap_cuda_slice(q, dev.clone()),
                Shape::from((r, n)),
            ),
            wrap(CudaStorage::wrap_cuda_slice(qs, dev), Shape::from(r)),
            xl.dims(),
            dt,
        )
    }

    // ---- columns put side by side ---------------------------------------------------

    pub fn join_columns(pieces: &[Tensor]) -> CResult<Option<Tensor>> {
        let Some(first) = pieces.first() else {
            return Ok(None);
        };
        let candle_core::Device::Cuda(dev) = first.device() else {
            return Ok(None);
        };
        let (b, len, _) = first.dims3()?;
        let size = first.dtype().size_in_bytes();
        let fits = |t: &Tensor| {
            t.is_contiguous()
                && t.dtype() == first.dtype()
                && t.device().same_device(first.device())
                && (t.layout().start_offset() * size).is_multiple_of(16)
                && t.dims3()
                    .is_ok_and(|(tb, tl, w)| tb == b && tl == len && (w * size).is_multiple_of(16))
        };
        if pieces.len() < 2 || !pieces.iter().all(fits) {
            return Ok(None);
        }
        let dev = dev.clone();
        match first.dtype() {
            DType::BF16 => join_columns_t::<bf16>(pieces, &dev).map(Some),
            DType::F16 => join_columns_t::<f16>(pieces, &dev).map(Some),
            DType::F32 => join_columns_t::<f32>(pieces, &dev).map(Some),
            // FP8 attention's e4m3 output under sequence parallelism: bytes, moved as they are.
            DType::F8E4M3 => join_columns_t::<float8::F8E4M3>(pieces, &dev).map(Some),
            _ => Ok(None),
        }
    }

    fn join_columns_t<T: CudaDType + DeviceRepr>(
        pieces: &[Tensor],
        dev: &CudaDevice,
    ) -> CResult<Tensor> {
        let (b, len, _) = pieces[0].dims3()?;
        let size = std::mem::size_of::<T>();
        let widths: Vec<usize> = pieces.iter().map(|t| t.dim(2)).collect::<CResult<_>>()?;
        let total: usize = widths.iter().sum();
        let y = out::<T>(dev, b * len * total)?;
        let f = dev
            .get_or_load_custom_fatbin("mold_join_columns", MODULE, FATBIN)?
            .into_cuda_function();
        let stream = dev.cuda_stream();
        let rows = (b * len) as i64;
        let ld = (total * size / 16) as i32;
        let mut col = 0i32;
        for (t, w) in pieces.iter().zip(&widths) {
            let (st, l) = t.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*st else {
                candle_core::bail!("mold join-columns: not a CUDA tensor");
            };
            let src = view::<T>(cs, l)?;
            let w16 = (w * size / 16) as i32;
            let n = rows as usize * w16 as usize;
            if n == 0 {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(THREADS as usize) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut a = stream.launch_builder(&f);
            a.arg(&src).arg(&y).arg(&rows).arg(&w16).arg(&ld).arg(&col);
            // SAFETY: argument order and types match the kernel (which reads and writes
            // 16-byte units); the piece holds rows × w16 units from its 16-byte aligned
            // start, the output rows × ld.
            unsafe { a.launch(cfg) }.w()?;
            col += w16;
        }
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(y, dev.clone())),
            (b, len, total),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    // ---- q/k/v preparation ----------------------------------------------------------

    fn cuda_view<'a, T: CudaDType>(
        st: &'a candle_core::Storage,
        l: &Layout,
    ) -> CResult<CudaView<'a, T>> {
        match st {
            candle_core::Storage::Cuda(c) => view::<T>(c, l),
            _ => candle_core::bail!("mold qkv-prep: a tensor is not on a CUDA device"),
        }
    }

    fn qkv_prep_t<T: CudaDType + DeviceRepr>(
        segs: &[super::QkvSegment],
        heads: usize,
        layout: super::QkvLayout,
        cos: &Tensor,
        sin: &Tensor,
        eps: f32,
    ) -> CResult<super::Prepared> {
        let first = segs[0].qkv;
        let dev = match first.device() {
            candle_core::Device::Cuda(d) => d.clone(),
            _ => candle_core::bail!("mold qkv-prep: not a CUDA tensor"),
        };
        let d = segs[0].q_scale.dims1()?;
        let b = first.dim(0)?;
        let len_tot: usize = segs.iter().map(|s| s.qkv.dim(1)).sum::<CResult<usize>>()?;
        let (cd0, cl, ch) = cos.dims3()?;
        if cl != len_tot || ch != d / 2 || sin.dims() != cos.dims() || (cd0 != 1 && cd0 != b) {
            candle_core::bail!(
                "mold qkv-prep: RoPE tables {:?} do not fit {len_tot} tokens of head size {d}",
                cos.dims()
            );
        }
        let y = out::<T>(&dev, 3 * b * heads * len_tot * d)?;
        // The receive buffer the own piece goes to, where asked.
        let y_me = match layout.own {
            Some(_) => Some(out::<T>(&dev, layout.extra.max(1))?),
            None => None,
        };
        // The partial maxima start at 0 (the kernel folds into them).
        let amax = match layout.amax {
            true => {
                Some(dev.alloc_zeros::<f32>(3 * super::QKV_AMAX_SLOTS * super::QKV_AMAX_STRIDE)?)
            }
            false => None,
        };
        let cs_batch: i64 = if cd0 == 1 {
            0
        } else {
            (len_tot * d / 2) as i64
        };
        let shape = QkvShape {
            heads,
            d,
            b,
            len_tot,
            cs_batch,
            eps,
            groups: layout.groups as i32,
            me: layout.own.map_or(-1, |o| o.0 as i32),
            me_base: layout.own.map_or(0, |o| o.1 as i64),
        };
        let bufs = (&y, y_me.as_ref(), amax.as_ref());
        // Tables in the activations' dtype as given, else in f32 (`_f32tab` kernels).
        if cos.dtype() == first.dtype() && sin.dtype() == first.dtype() {
            let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
            qkv_launch::<T, T>(segs, &shape, &cos, &sin, bufs, &dev, "")?;
        } else {
            let cos = cos.to_dtype(DType::F32)?.contiguous()?;
            let sin = sin.to_dtype(DType::F32)?.contiguous()?;
            let tab = if first.dtype() == DType::F32 {
                ""
            } else {
                "_f32tab"
            };
            qkv_launch::<T, f32>(segs, &shape, &cos, &sin, bufs, &dev, tab)?;
        }
        let shape: candle_core::Shape = if layout.groups == 0 {
            (3, b, heads, len_tot, d).into()
        } else {
            (3 * b * heads * len_tot * d,).into()
        };
        let wrap = |y: CudaSlice<T>, shape: candle_core::Shape| {
            Tensor::from_storage(
                candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(y, dev.clone())),
                shape,
                candle_core::op::BackpropOp::none(),
                false,
            )
        };
        let me = y_me.map(|y| wrap(y, (layout.extra,).into()));
        let amax = amax.map(|a| {
            Tensor::from_storage(
                candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(a, dev.clone())),
                (3, super::QKV_AMAX_SLOTS, super::QKV_AMAX_STRIDE),
                candle_core::op::BackpropOp::none(),
                false,
            )
        });
        Ok(super::Prepared {
            out: wrap(y, shape),
            me,
            amax,
        })
    }

    struct QkvShape {
        heads: usize,
        d: usize,
        b: usize,
        len_tot: usize,
        cs_batch: i64,
        eps: f32,
        /// 0: `(3, b, heads, L, d)`; else the all-to-all's pieces ([`super::qkv_prep_fused_groups`]).
        groups: i32,
        /// The group written at element `me_base` of the second buffer instead of its
        /// place (-1: none).
        me: i32,
        me_base: i64,
    }

    /// One launch per segment, tables of element type `C`.
    fn qkv_launch<T: CudaDType + DeviceRepr, C: CudaDType + DeviceRepr>(
        segs: &[super::QkvSegment],
        sh: &QkvShape,
        cos: &Tensor,
        sin: &Tensor,
        (y, y_me, amax): (
            &CudaSlice<T>,
            Option<&CudaSlice<T>>,
            Option<&CudaSlice<f32>>,
        ),
        dev: &CudaDevice,
        tab: &str,
    ) -> CResult<()> {
        let first = segs[0].qkv;
        let name = format!("mold_qkv_prep_{}_d{}{tab}", suffix(first.dtype())?, sh.d);
        let f = dev
            .get_or_load_custom_fatbin(&name, MODULE, FATBIN)?
            .into_cuda_function();
        let (cs, csl) = cos.storage_and_layout();
        let (sn, snl) = sin.storage_and_layout();
        let cv = cuda_view::<C>(&cs, csl)?;
        let sv = cuda_view::<C>(&sn, snl)?;
        let stream = dev.cuda_stream();
        let mut l_off = 0usize;
        for seg in segs {
            let (st, sl) = seg.qkv.storage_and_layout();
            let (qs, qsl) = seg.q_scale.storage_and_layout();
            let (ks, ksl) = seg.k_scale.storage_and_layout();
            let len = seg.qkv.dim(1)?;
            let ld: i64 = if len > 1 {
                sl.stride()[1] as i64
            } else {
                seg.qkv.dim(2)? as i64
            };
            let xv = cuda_view::<T>(&st, sl)?;
            let qv = cuda_view::<T>(&qs, qsl)?;
            let kv = cuda_view::<T>(&ks, ksl)?;
            let (len32, off32, tot32, h32) =
                (len as i32, l_off as i32, sh.len_tot as i32, sh.heads as i32);
            let warps = len * sh.heads;
            let cfg = LaunchConfig {
                grid_dim: (warps.div_ceil(4) as u32, sh.b as u32, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut a = stream.launch_builder(&f);
            a.arg(&xv)
                .arg(&ld)
                .arg(&len32)
                .arg(&off32)
                .arg(&tot32)
                .arg(&h32)
                .arg(&qv)
                .arg(&kv)
                .arg(&cv)
                .arg(&sv)
                .arg(&sh.cs_batch)
                .arg(y)
                .arg(&sh.eps)
                .arg(&sh.groups)
                .arg(&sh.me)
                .arg(y_me.unwrap_or(y))
                .arg(&sh.me_base);
            // The maxima's buffer, or a null pointer (none taken).
            let null = 0u64;
            match amax {
                Some(m) => a.arg(m),
                None => a.arg(&null),
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            l_off += len;
        }
        Ok(())
    }

    pub fn qkv_prep(
        segs: &[super::QkvSegment],
        heads: usize,
        layout: super::QkvLayout,
        cos: &Tensor,
        sin: &Tensor,
        eps: f32,
    ) -> CResult<super::Prepared> {
        match segs[0].qkv.dtype() {
            DType::BF16 => qkv_prep_t::<bf16>(segs, heads, layout, cos, sin, eps),
            DType::F16 => qkv_prep_t::<f16>(segs, heads, layout, cos, sin, eps),
            DType::F32 => qkv_prep_t::<f32>(segs, heads, layout, cos, sin, eps),
            dt => candle_core::bail!("mold fused kernels: unsupported dtype {dt:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(shape: &[usize]) -> Tensor {
        Tensor::randn(0f32, 1., shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn gated_is_the_activated_first_half_times_the_second() {
        let x = t(&[3, 5, 8]);
        let (a, b) = (x.narrow(2, 0, 4).unwrap(), x.narrow(2, 4, 4).unwrap());
        for (g, act) in [
            (Gate::Silu, candle_nn::ops::silu(&a).unwrap()),
            (Gate::GeluTanh, a.gelu().unwrap()),
        ] {
            let want = act.mul(&b).unwrap();
            let got = gated(&x, g, Kernels::Auto).unwrap();
            assert_eq!(got.dims(), [3, 5, 4]);
            let d = (got - want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{g:?}");
        }
        let e = gated(&t(&[2, 3]), Gate::Silu, Kernels::Auto).unwrap_err();
        assert!(e.to_string().contains("not two halves"), "{e}");
    }

    #[test]
    fn candle_paths_compute_the_formulas() {
        let x = t(&[2, 3, 4]);
        let s = t(&[2, 1, 4]);
        let h = t(&[2, 1, 4]);
        let g = t(&[2, 1, 4]);
        let r = t(&[2, 3, 4]);
        let b = t(&[4]);
        let xv: Vec<Vec<Vec<f32>>> = x.to_vec3().unwrap();
        let sv: Vec<Vec<Vec<f32>>> = s.to_vec3().unwrap();
        let hv: Vec<Vec<Vec<f32>>> = h.to_vec3().unwrap();
        let gv: Vec<Vec<Vec<f32>>> = g.to_vec3().unwrap();
        let rv: Vec<Vec<Vec<f32>>> = r.to_vec3().unwrap();
        let bv: Vec<f32> = b.to_vec1().unwrap();
        let m: Vec<Vec<Vec<f32>>> = modulate(&x, &s, &h, Kernels::Auto)
            .unwrap()
            .to_vec3()
            .unwrap();
        let gr: Vec<Vec<Vec<f32>>> = gate_residual(&r, &x, None, &g, Kernels::Auto)
            .unwrap()
            .to_vec3()
            .unwrap();
        let grb: Vec<Vec<Vec<f32>>> = gate_residual(&r, &x, Some(&b), &g, Kernels::Auto)
            .unwrap()
            .to_vec3()
            .unwrap();
        let lnm: Vec<Vec<Vec<f32>>> = ln_modulate(&x, &s, &h, 1e-6, Kernels::Auto)
            .unwrap()
            .to_vec3()
            .unwrap();
        let ba: Vec<Vec<Vec<f32>>> = bias_act(&x, Some(&b), false, Kernels::Auto)
            .unwrap()
            .to_vec3()
            .unwrap();
        for i in 0..2 {
            for j in 0..3 {
                for c in 0..4 {
                    let want = xv[i][j][c] * (1. + sv[i][0][c]) + hv[i][0][c];
                    assert!((m[i][j][c] - want).abs() < 1e-6);
                    let want = rv[i][j][c] + gv[i][0][c] * xv[i][j][c];
                    assert!((gr[i][j][c] - want).abs() < 1e-6);
                    let want = rv[i][j][c] + gv[i][0][c] * (xv[i][j][c] + bv[c]);
                    assert!((grb[i][j][c] - want).abs() < 1e-5);
                    let row = &xv[i][j];
                    let mean = row.iter().sum::<f32>() / 4.;
                    let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / 4.;
                    let norm = (row[c] - mean) / (var + 1e-6).sqrt();
                    let want = norm * (1. + sv[i][0][c]) + hv[i][0][c];
                    assert!(
                        (lnm[i][j][c] - want).abs() < 1e-4,
                        "{} vs {want}",
                        lnm[i][j][c]
                    );
                    assert!((ba[i][j][c] - (xv[i][j][c] + bv[c])).abs() < 1e-6);
                }
            }
        }
    }

    #[test]
    fn kernels_setting_parses_and_names_bad_values() {
        assert_eq!(Kernels::parse("candle"), Ok(Kernels::Candle));
        assert_eq!(Kernels::parse(" fused"), Ok(Kernels::Fused));
        assert_eq!(Kernels::parse("auto"), Ok(Kernels::Auto));
        assert_eq!(Kernels::parse("mold"), Ok(Kernels::Mold));
        assert_eq!(Kernels::parse("cudnn"), Ok(Kernels::Cudnn));
        // Only auto, fused and cudnn hand work to cuDNN / cuBLASLt.
        let libs: Vec<bool> = [
            Kernels::Auto,
            Kernels::Fused,
            Kernels::Cudnn,
            Kernels::Mold,
            Kernels::Candle,
        ]
        .iter()
        .map(|k| k.uses_libraries())
        .collect();
        assert_eq!(libs, [true, true, true, false, false]);
        let e = Kernels::parse("fast").unwrap_err();
        assert!(
            e.contains("MOLD_KERNELS=fast") && e.contains("auto, fused, mold, cudnn or candle"),
            "{e}"
        );
    }

    #[test]
    fn forced_fused_is_refused_on_cpu() {
        let x = t(&[1, 2, 4]);
        let err = bias_act(&x, None, true, Kernels::Fused).unwrap_err();
        assert!(err.to_string().contains("MOLD_KERNELS=fused"), "{err}");
    }
}
