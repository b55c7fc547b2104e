//! Channels-last 2-D convolution: `(n, h, w, c)` activations, `(k, r, s, c)` (KRSC)
//! filters, the bias and a residual added to the output.
//!
//! On CUDA builds, for bf16/f16 CUDA tensors and unless `MOLD_KERNELS=mold|candle`, it runs
//! through cuDNN's graph API with the additions fused into the convolution's graph
//! ([`super::cudnn::conv2d_nhwc`]); elsewhere — CPU, f32, no cuDNN, a shape no engine takes
//! — candle's `conv2d` on the NCHW view of the same tensors (the reference), with the
//! additions as candle ops. [`Ran`] says which ran and why cuDNN did not.

use super::ops::Kernels;
use candle_core::{DType, Tensor};

type CResult<T> = candle_core::Result<T>;

/// Padding (before and after, per spatial dimension) and stride of a convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConvGeom {
    /// Rows, columns of zeros before the input.
    pub pad_pre: [usize; 2],
    /// Rows, columns of zeros after the input.
    pub pad_post: [usize; 2],
    pub stride: [usize; 2],
}

impl ConvGeom {
    /// Symmetric padding `pad`, stride `stride`.
    pub fn new(pad: usize, stride: usize) -> ConvGeom {
        ConvGeom {
            pad_pre: [pad, pad],
            pad_post: [pad, pad],
            stride: [stride, stride],
        }
    }

    /// Output size of an `h`×`w` input under an `r`×`s` filter; `None` when the filter
    /// does not fit or a stride is zero.
    pub fn output(&self, h: usize, w: usize, r: usize, s: usize) -> Option<(usize, usize)> {
        let one = |len: usize, pre: usize, post: usize, f: usize, st: usize| {
            let padded = len + pre + post;
            (st > 0 && padded >= f).then(|| (padded - f) / st + 1)
        };
        Some((
            one(h, self.pad_pre[0], self.pad_post[0], r, self.stride[0])?,
            one(w, self.pad_pre[1], self.pad_post[1], s, self.stride[1])?,
        ))
    }
}

/// What cuDNN's graph adds to the convolution's output, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Fusion {
    /// The bare convolution.
    None,
    /// `+ bias` (per output channel).
    Bias,
    /// `+ bias + residual` (a tensor of the output's shape).
    BiasResidual,
}

impl Fusion {
    /// The graphs to try for `self`, most fused first.
    pub fn fallbacks(self) -> &'static [Fusion] {
        match self {
            Fusion::BiasResidual => &[Fusion::BiasResidual, Fusion::Bias, Fusion::None],
            Fusion::Bias => &[Fusion::Bias, Fusion::None],
            Fusion::None => &[Fusion::None],
        }
    }
}

/// Which implementation ran a convolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ran {
    /// cuDNN, with this much of the epilogue in its graph.
    Cudnn(Fusion),
    /// candle's `conv2d`; why cuDNN did not run it where it was allowed to.
    Candle(Option<String>),
}

/// How [`conv2d_nhwc`] may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvOptions {
    pub kernels: Kernels,
    /// Time cuDNN's engine configurations on a shape's first call and keep the fastest
    /// (else the heuristics' first choice).
    pub tune: bool,
}

/// `conv(x, w) + bias + residual` over channels-last tensors: `x` `(n, h, w, c)`, `w`
/// `(k, r, s, c)`, `bias` `(k)`, `residual` `(n, p, q, k)`; the output is `(n, p, q, k)`.
pub fn conv2d_nhwc(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    geom: ConvGeom,
    opts: ConvOptions,
) -> CResult<(Tensor, Ran)> {
    // No reason where cuDNN was never in question: `MOLD_KERNELS=mold|candle`, a CPU tensor.
    let why = if !opts.kernels.uses_libraries() || !x.device().is_cuda() {
        None
    } else if !matches!(x.dtype(), DType::BF16 | DType::F16) {
        Some(format!("dtype {:?}", x.dtype()))
    } else {
        match cudnn(x, w, bias, residual, geom, opts.tune)? {
            Ok((y, f)) => return Ok((y, Ran::Cudnn(f))),
            Err(e) => Some(e),
        }
    };
    if matches!(opts.kernels, Kernels::Cudnn | Kernels::Fused) {
        candle_core::bail!(
            "MOLD_KERNELS={}: cuDNN cannot run this convolution ({}); unset MOLD_KERNELS to \
             fall back to candle's",
            format!("{:?}", opts.kernels).to_lowercase(),
            why.as_deref().unwrap_or("a CPU tensor")
        );
    }
    Ok((
        conv2d_nhwc_candle(x, w, bias, residual, geom)?,
        Ran::Candle(why),
    ))
}

/// cuDNN's version where [`conv2d_nhwc`] can use it, else why not (no CUDA build, no
/// libcudnn 9).
pub fn cudnn_version() -> Result<String, String> {
    #[cfg(feature = "cuda")]
    return super::cudnn::version();
    #[cfg(not(feature = "cuda"))]
    Err("a build without CUDA".into())
}

#[cfg(feature = "cuda")]
fn cudnn(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    geom: ConvGeom,
    tune: bool,
) -> CResult<Result<(Tensor, Fusion), String>> {
    super::cudnn::conv2d_nhwc(x, w, bias, residual, geom, tune)
}

#[cfg(not(feature = "cuda"))]
fn cudnn(
    _: &Tensor,
    _: &Tensor,
    _: Option<&Tensor>,
    _: Option<&Tensor>,
    _: ConvGeom,
    _: bool,
) -> CResult<Result<(Tensor, Fusion), String>> {
    Ok(Err("a build without CUDA".into()))
}

/// The most elements candle's CUDA convolution may unfold its input into at once. candle
/// unfolds the input of a convolution (im2col) into an `(h_out · w_out, c · r · s)` buffer
/// and sizes the kernel launch from that count cast to `u32`: past 2^32 elements the launch
/// covers part of the buffer and the output is wrong (Qwen-Image's 2048² decode: the
/// up-sampler's 192-channel 3×3 convolution at full resolution unfolds into 7.2·10^9).
pub const UNFOLD_LIMIT: usize = 1 << 31;

/// candle's `conv2d` of `x` `(n, c, h, w)` with `kernel` `(k, c, r, s)`, zero padding `pad`
/// on every side, stride 1; on CUDA, where the unfolded input would pass [`UNFOLD_LIMIT`]
/// elements, in bands of output rows, each band reading its rows and the filter's reach
/// beyond them (zeros past the image's edges), the bands joined.
pub fn conv2d_nchw(x: &Tensor, kernel: &Tensor, pad: usize) -> CResult<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let (_, _, r, s) = kernel.dims4()?;
    let out = |len: usize, k: usize| {
        (len + 2 * pad + 1)
            .checked_sub(k)
            .filter(|&o| k > 0 && o > 0)
    };
    let (Some(h_out), Some(w_out)) = (out(h, r), out(wd, s)) else {
        candle_core::bail!("conv2d: a {r}x{s} filter does not fit a {h}x{wd} input");
    };
    let per_row = n * w_out * c * r * s;
    if !x.device().is_cuda() || h_out * per_row <= UNFOLD_LIMIT {
        return x.conv2d(kernel, pad, 1, 1, 1);
    }
    conv2d_nchw_bands(
        x,
        kernel,
        pad,
        (UNFOLD_LIMIT / per_row.max(1)).max(1),
        h_out,
    )
}

/// [`conv2d_nchw`] in bands of `rows` output rows.
fn conv2d_nchw_bands(
    x: &Tensor,
    kernel: &Tensor,
    pad: usize,
    rows: usize,
    h_out: usize,
) -> CResult<Tensor> {
    let (n, c, h, wd) = x.dims4()?;
    let r = kernel.dim(2)?;
    let mut out = Vec::with_capacity(h_out.div_ceil(rows));
    let mut a = 0;
    while a < h_out {
        let b = (a + rows).min(h_out);
        // Output rows a..b read padded input rows a..b + r - 1, input rows a - pad ..
        let (lo, hi) = (
            a as isize - pad as isize,
            (b + r - 1) as isize - pad as isize,
        );
        let (from, to) = (lo.max(0) as usize, (hi.min(h as isize)).max(0) as usize);
        let (above, below) = ((-lo).max(0) as usize, (hi - h as isize).max(0) as usize);
        let mut band = x.narrow(2, from, to - from)?;
        if above + below > 0 {
            let zeros = |k: usize| Tensor::zeros((n, c, k, wd), x.dtype(), x.device());
            let mut parts = Vec::with_capacity(3);
            if above > 0 {
                parts.push(zeros(above)?);
            }
            parts.push(band);
            if below > 0 {
                parts.push(zeros(below)?);
            }
            band = Tensor::cat(&parts, 2)?;
        }
        let band = band.pad_with_zeros(3, pad, pad)?.contiguous()?;
        out.push(band.conv2d(kernel, 0, 1, 1, 1)?);
        a = b;
    }
    Tensor::cat(&out, 2)
}

/// [`conv2d_nhwc`] through candle's `conv2d` on the NCHW views (the reference).
pub fn conv2d_nhwc_candle(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    residual: Option<&Tensor>,
    geom: ConvGeom,
) -> CResult<Tensor> {
    let (_, h, wd, c) = x.dims4()?;
    let (_, r, s, wc) = w.dims4()?;
    if wc != c {
        candle_core::bail!("conv2d_nhwc: the input has {c} channels, the filters {wc}");
    }
    if geom.output(h, wd, r, s).is_none() {
        candle_core::bail!("conv2d_nhwc: a {r}x{s} filter does not fit a {h}x{wd} input");
    }
    if geom.stride[0] != geom.stride[1] {
        candle_core::bail!("conv2d_nhwc: candle's conv2d takes one stride for both dimensions");
    }
    let mut xc = x.permute((0, 3, 1, 2))?;
    let symmetric = geom.pad_pre[0] == geom.pad_post[0]
        && geom.pad_pre[1] == geom.pad_post[1]
        && geom.pad_pre[0] == geom.pad_pre[1];
    let pad = if symmetric {
        geom.pad_pre[0]
    } else {
        xc = xc
            .pad_with_zeros(2, geom.pad_pre[0], geom.pad_post[0])?
            .pad_with_zeros(3, geom.pad_pre[1], geom.pad_post[1])?;
        0
    };
    let kernel = w.permute((0, 3, 1, 2))?.contiguous()?;
    let xc = xc.contiguous()?;
    let y = if geom.stride[0] == 1 {
        conv2d_nchw(&xc, &kernel, pad)?
    } else {
        xc.conv2d(&kernel, pad, geom.stride[0], 1, 1)?
    };
    let y = y.permute((0, 2, 3, 1))?.contiguous()?;
    let y = match bias {
        Some(b) => y.broadcast_add(b)?,
        None => y,
    };
    match residual {
        Some(z) => y + z,
        None => Ok(y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A convolution in bands of output rows (with the filter's reach read from the
    /// neighbouring rows, zeros past the edges) equals it whole, for 1×1 and 3×3 filters,
    /// with and without padding, bands of one row to more than the image.
    #[test]
    fn a_convolution_in_row_bands_equals_it_whole() {
        let x = rand(&[2, 3, 7, 5], 1);
        for (r, pad) in [(3, 1), (3, 0), (1, 0), (5, 2)] {
            let k = rand(&[4, 3, r, r], 2);
            let whole = x.conv2d(&k, pad, 1, 1, 1).unwrap();
            let h_out = whole.dim(2).unwrap();
            for rows in [1, 2, 3, h_out, h_out + 4] {
                let got = conv2d_nchw_bands(&x, &k, pad, rows, h_out).unwrap();
                assert_eq!(got.dims(), whole.dims());
                let d = (got - &whole)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(d <= 1e-5, "{r}x{r} pad {pad}, {rows} rows a band: {d}");
            }
        }
        // On the host the whole convolution runs, and a filter that does not fit, or an
        // empty one, is refused.
        assert!(conv2d_nchw(&x, &rand(&[4, 3, 9, 9], 3), 0).is_err());
        let empty = Tensor::zeros((4, 3, 0, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(conv2d_nchw(&x, &empty, 1).is_err());
        let y = conv2d_nchw(&x, &rand(&[4, 3, 3, 3], 4), 1).unwrap();
        assert_eq!(y.dims(), [2, 4, 7, 5]);
    }

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| (((i as u64 + 3) * 2_654_435_761 + seed * 97) % 1_000) as f32 / 500.0 - 1.0)
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn output_sizes() {
        let g = ConvGeom::new(1, 1);
        assert_eq!(g.output(128, 64, 3, 3), Some((128, 64)));
        assert_eq!(ConvGeom::new(0, 1).output(7, 7, 1, 1), Some((7, 7)));
        assert_eq!(ConvGeom::new(0, 2).output(8, 8, 3, 3), Some((3, 3)));
        let asym = ConvGeom {
            pad_pre: [1, 0],
            pad_post: [0, 1],
            stride: [1, 1],
        };
        assert_eq!(asym.output(5, 5, 2, 2), Some((5, 5)));
        assert_eq!(ConvGeom::new(0, 1).output(2, 2, 3, 3), None);
        assert_eq!(ConvGeom::new(1, 0).output(2, 2, 3, 3), None);
    }

    #[test]
    fn fallbacks_go_from_most_to_least_fused() {
        assert_eq!(
            Fusion::BiasResidual.fallbacks(),
            &[Fusion::BiasResidual, Fusion::Bias, Fusion::None]
        );
        assert_eq!(Fusion::None.fallbacks(), &[Fusion::None]);
    }

    /// The channels-last convolution (3×3 pad 1, 1×1, asymmetric padding) with bias and
    /// residual equals candle's NCHW conv2d plus the additions; on the CPU it says candle ran.
    #[test]
    fn nhwc_conv_matches_nchw() {
        let x = rand(&[2, 8, 6, 5], 1); // NCHW
        let opts = ConvOptions {
            kernels: Kernels::Auto,
            tune: false,
        };
        for (r, geom) in [
            (3, ConvGeom::new(1, 1)),
            (1, ConvGeom::new(0, 1)),
            (
                2,
                ConvGeom {
                    pad_pre: [1, 0],
                    pad_post: [0, 1],
                    stride: [1, 1],
                },
            ),
        ] {
            let w = rand(&[16, 8, r, r], 2); // KCRS
            let b = rand(&[16], 3);
            let xp = if r == 2 {
                x.pad_with_zeros(2, 1, 0)
                    .unwrap()
                    .pad_with_zeros(3, 0, 1)
                    .unwrap()
            } else {
                x.clone()
            };
            let pad = if r == 3 { 1 } else { 0 };
            let conv = xp.conv2d(&w, pad, 1, 1, 1).unwrap();
            let res = rand(conv.dims(), 4);
            let want = (conv
                .broadcast_add(&b.reshape((1, 16, 1, 1)).unwrap())
                .unwrap()
                + &res)
                .unwrap();
            let nhwc = |t: &Tensor| t.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
            let (got, ran) = conv2d_nhwc(
                &nhwc(&x),
                &nhwc(&w),
                Some(&b),
                Some(&nhwc(&res)),
                geom,
                opts,
            )
            .unwrap();
            assert_eq!(ran, Ran::Candle(None));
            let d = (got - nhwc(&want))
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-5, "{r}x{r}: max difference {d}");
        }
    }

    #[test]
    fn strict_kernels_refuse_the_candle_fallback() {
        let x = rand(&[1, 4, 4, 8], 1);
        let w = rand(&[8, 1, 1, 8], 2);
        let opts = ConvOptions {
            kernels: Kernels::Cudnn,
            tune: false,
        };
        let e = conv2d_nhwc(&x, &w, None, None, ConvGeom::new(0, 1), opts).unwrap_err();
        assert!(e.to_string().contains("MOLD_KERNELS=cudnn"), "{e}");
    }
}
