//! A product's weight `(n, k)`: dense in the compute dtype, or FP8 with one scale per output
//! feature ([`super::fp8`]). Column- and row-parallel layers hold these; each product
//! dispatches on the kind.

use super::fp8::{self, Fp8Rows, Fp8Weight};
use super::gemm;
use super::layers::TensorMap;
use super::ops::Kernels;
use candle_core::Tensor;

type CResult<T> = candle_core::Result<T>;

/// A product's input: as computed, or quantized per token ahead for FP8 products (by the
/// norm before them, [`super::ops::ln_modulate_fp8`]; by FP8 attention, whose e4m3 output
/// goes to the output projection as it is, [`super::attention::fp8_attention`]).
#[derive(Clone, Debug)]
pub enum Input {
    Dense(Tensor),
    Fp8(Fp8Rows),
}

impl Input {
    /// The activation's shape.
    pub fn dims(&self) -> &[usize] {
        match self {
            Input::Dense(t) => t.dims(),
            Input::Fp8(x) => x.dims(),
        }
    }

    /// Tokens `start..start + len` of a `(b, L, k)` input: a view of the rows where they
    /// are contiguous (one sample, or the whole sequence); otherwise widened first.
    pub fn narrow_tokens(&self, start: usize, len: usize) -> CResult<Input> {
        match self {
            Input::Dense(t) => Ok(Input::Dense(t.narrow(1, start, len)?)),
            Input::Fp8(x) => match x.narrow_tokens(start, len)? {
                Some(n) => Ok(Input::Fp8(n)),
                None => Ok(Input::Dense(x.dequantize()?.narrow(1, start, len)?)),
            },
        }
    }

    /// In the activations' dtype (an input quantized ahead widened back).
    pub fn widen(self) -> CResult<Tensor> {
        match self {
            Input::Dense(t) => Ok(t),
            Input::Fp8(x) => x.dequantize(),
        }
    }

    /// A tensor that stands for it in marks and meters (the e4m3 values of one quantized
    /// ahead).
    pub fn tensor(&self) -> &Tensor {
        match self {
            Input::Dense(t) => t,
            Input::Fp8(x) => x.rows().values(),
        }
    }
}

#[derive(Clone, Debug)]
pub enum Mat {
    Dense(Tensor),
    Fp8(Fp8Weight),
}

impl Mat {
    /// Whether the weight is held in FP8.
    pub fn is_fp8(&self) -> bool {
        matches!(self, Mat::Fp8(_))
    }
    /// Output features.
    pub fn rows(&self) -> CResult<usize> {
        match self {
            Mat::Dense(w) => w.dim(0),
            Mat::Fp8(w) => Ok(w.dims2()?.0),
        }
    }

    /// Output features `start..start + len`.
    pub fn narrow_rows(&self, start: usize, len: usize) -> CResult<Mat> {
        Ok(match self {
            Mat::Dense(w) => Mat::Dense(w.narrow(0, start, len)?),
            Mat::Fp8(w) => Mat::Fp8(w.narrow_rows(start, len)?),
        })
    }

    /// The weights' output features one after another (all dense or all FP8).
    pub fn cat_rows(parts: &[Mat]) -> CResult<Mat> {
        let dense: Option<Vec<&Tensor>> = parts
            .iter()
            .map(|m| match m {
                Mat::Dense(w) => Some(w),
                Mat::Fp8(_) => None,
            })
            .collect();
        if let Some(ws) = dense {
            return Ok(Mat::Dense(Tensor::cat(&ws, 0)?));
        }
        let fp8: Option<Vec<&Fp8Weight>> = parts
            .iter()
            .map(|m| match m {
                Mat::Fp8(w) => Some(w),
                Mat::Dense(_) => None,
            })
            .collect();
        let Some(ws) = fp8 else {
            candle_core::bail!("stacking dense and FP8 weights");
        };
        let q: Vec<&Tensor> = ws.iter().map(|w| w.values()).collect();
        let s: Vec<&Tensor> = ws.iter().map(|w| w.scales()).collect();
        Ok(Mat::Fp8(Fp8Weight::from_parts(
            Tensor::cat(&q, 0)?,
            Tensor::cat(&s, 0)?,
        )?))
    }

    /// Input features `start..start + len` (copied contiguous).
    pub fn narrow_cols(&self, start: usize, len: usize) -> CResult<Mat> {
        Ok(match self {
            Mat::Dense(w) => Mat::Dense(w.narrow(1, start, len)?.contiguous()?),
            Mat::Fp8(w) => Mat::Fp8(w.narrow_cols(start, len)?),
        })
    }

    /// `act(x Wᵀ + b)`: the bias (and GELU) in the product's epilogue where the libraries
    /// run it.
    pub fn linear(&self, x: &Tensor, b: &Tensor, gelu: bool, k: Kernels) -> CResult<Tensor> {
        match self {
            Mat::Dense(w) => gemm::linear(x, &candle_nn::Linear::new(w.clone(), None), b, gelu, k),
            Mat::Fp8(w) => fp8::linear(x, w, Some(b), gelu, k),
        }
    }

    /// [`Mat::linear`] of an [`Input`]: an input quantized ahead goes to the FP8 product
    /// as it is ([`fp8::linear_rows`]; widened back for a dense weight).
    pub fn linear_in(&self, x: &Input, b: &Tensor, gelu: bool, k: Kernels) -> CResult<Tensor> {
        match (self, x) {
            (_, Input::Dense(x)) => self.linear(x, b, gelu, k),
            (Mat::Fp8(w), Input::Fp8(x)) => fp8::linear_rows(x, w, Some(b), gelu, k),
            (Mat::Dense(_), Input::Fp8(x)) => self.linear(&x.dequantize()?, b, gelu, k),
        }
    }

    /// Whether the products `(bias, gelu)` of this weight take an input like `x` quantized
    /// ahead ([`fp8::takes_rows`]; never for a dense weight).
    pub fn takes_rows(&self, x: &Tensor, products: &[(Option<&Tensor>, bool)], k: Kernels) -> bool {
        match self {
            Mat::Dense(_) => false,
            Mat::Fp8(w) => fp8::takes_rows(x, w, products, k),
        }
    }

    /// `x Wᵀ + b` for a conditioning vector: an FP8 weight widened, its input kept in its
    /// own precision ([`fp8::linear_weight_only`]).
    pub fn linear_vec(&self, x: &Tensor, b: &Tensor, k: Kernels) -> CResult<Tensor> {
        match self {
            Mat::Dense(_) => self.linear(x, b, false, k),
            Mat::Fp8(w) => fp8::linear_weight_only(x, w, b, k),
        }
    }

    /// [`Mat::matmul`] of an [`Input`]: an input quantized ahead goes to the FP8 product as
    /// it is ([`fp8::linear_rows`]; widened back for a dense weight).
    pub fn matmul_in(&self, x: &Input, k: Kernels) -> CResult<Tensor> {
        match (self, x) {
            (_, Input::Dense(x)) => self.matmul(x, k),
            (Mat::Fp8(w), Input::Fp8(x)) => fp8::linear_rows(x, w, None, false, k),
            (Mat::Dense(_), Input::Fp8(x)) => self.matmul(&x.dequantize()?, k),
        }
    }

    /// [`Mat::add_matmul`] of an [`Input`] (an input quantized ahead: its product, then the
    /// sum).
    pub fn add_matmul_in(&self, acc: Tensor, x: &Input, k: Kernels) -> CResult<Tensor> {
        match (self, x) {
            (_, Input::Dense(x)) => self.add_matmul(acc, x, k),
            (Mat::Fp8(w), Input::Fp8(x)) => acc + fp8::linear_rows(x, w, None, false, k)?,
            (Mat::Dense(_), Input::Fp8(x)) => self.add_matmul(acc, &x.dequantize()?, k),
        }
    }

    /// `x Wᵀ`.
    pub fn matmul(&self, x: &Tensor, k: Kernels) -> CResult<Tensor> {
        match self {
            Mat::Dense(w) => gemm::matmul(x, w),
            Mat::Fp8(w) => fp8::linear(x, w, None, false, k),
        }
    }

    /// `acc + x Wᵀ`, accumulated in the product where the libraries run it (`acc` consumed;
    /// it must not share storage with another live tensor).
    pub fn add_matmul(&self, acc: Tensor, x: &Tensor, k: Kernels) -> CResult<Tensor> {
        match self {
            Mat::Dense(w) => gemm::add_matmul(acc, x, w, k),
            Mat::Fp8(w) => fp8::add_linear(acc, x, w, k),
        }
    }

    pub fn map_tensors(&self, f: &mut TensorMap) -> CResult<Mat> {
        Ok(match self {
            Mat::Dense(w) => Mat::Dense(f(w)?),
            Mat::Fp8(w) => Mat::Fp8(w.map(f)?),
        })
    }

    pub fn bytes(&self) -> u64 {
        match self {
            Mat::Dense(w) => (w.elem_count() * w.dtype().size_in_bytes()) as u64,
            Mat::Fp8(w) => w.bytes(),
        }
    }
}
