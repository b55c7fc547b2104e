//! The model catalogue: what mold knows about each diffusion model's components.
//!
//! Parameter counts are derived from the architecture configs (hidden size, heads, MLP
//! width, block counts), not copied from file sizes, so that per-block weights, FLOPs and
//! activations follow from the same numbers. Each model also says what it supports
//! ([`Limits`]: largest side, frames, batch); [`ModelSpec::check_workload`] refuses
//! anything else, so the byte and FLOP products below stay far inside `u64` (they
//! saturate rather than wrap if called on an unchecked workload). `checkpoint` refines the
//! weight bytes from a safetensors header when the user gives one.

pub mod arch;
mod catalogue;
pub mod checkpoint;
pub mod diffusers;
pub mod snapshot;

pub use catalogue::builtin;
use mold_plan::{ComponentRole, DType, Workload};
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("unknown model `{id}`: known models are {known}")]
    Unknown { id: String, known: String },
    #[error("{field}: {message}")]
    Workload { field: String, message: String },
    #[error("{path}: {message}")]
    Checkpoint { path: String, message: String },
}

/// How a block's attention is wired, which decides its attention FLOPs and scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// One attention over the concatenated text and image tokens (FLUX, MMDiT).
    Joint,
    /// Self-attention over image tokens only.
    Image,
    /// Self-attention over text tokens only.
    Text,
    /// Self-attention over image tokens, then cross-attention image→text (LTX-Video).
    ImageCrossText,
}

/// One kind of transformer block (FLUX has `double` and `single`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BlockKind {
    pub name: String,
    pub count: u32,
    pub hidden: u64,
    pub heads: u32,
    pub head_dim: u32,
    pub mlp_hidden: u64,
    /// Linear weights applied to each image token (sharded under tensor parallel).
    pub img_params: u64,
    /// Linear weights applied to each text token (sharded under tensor parallel).
    pub txt_params: u64,
    /// Linear weights applied to every token of the concatenated stream (sharded).
    pub joint_params: u64,
    /// Linear weights applied once per sample to the conditioning vector (the adaLN
    /// modulation, `hidden → outputs` with bias): sharded by output under tensor
    /// parallel, each rank computing a slice of the outputs, which one all-gather per
    /// block puts back together ([`Self::allgathers`]).
    pub per_sample_params: u64,
    /// Weights every rank of a tensor-parallel group holds in full: norm scales and
    /// small per-sample vectors (scale-shift tables).
    pub replicated_params: u64,
    pub attention: Attention,
    /// Row-parallel projections per block: all-reduces per block under tensor parallel.
    pub allreduces: u32,
    /// Residual streams carried through the block (2 for dual-stream, 1 for single).
    pub streams: u32,
    /// Exact bytes of one block from a checkpoint header (largest block of this kind),
    /// replacing the dtype-derived figure when set.
    pub checkpoint_bytes: Option<u64>,
    /// The dtype those bytes are in (the checkpoint's dominant one): a plan in another
    /// dtype holds them recast to its own (an FP8 checkpoint computed in bf16 takes twice
    /// its bytes).
    pub checkpoint_dtype: Option<DType>,
}

/// `bytes` stored in `from`, held in `to`: scaled by the ratio of their sizes (rounded up).
fn recast(bytes: u64, from: Option<DType>, to: DType) -> u64 {
    const N: u64 = 1 << 20;
    match from {
        Some(f) if f != to && f.weight_bytes(N) > 0 => {
            ((bytes as u128 * to.weight_bytes(N) as u128).div_ceil(f.weight_bytes(N) as u128))
                .min(u64::MAX as u128) as u64
        }
        _ => bytes,
    }
}

impl BlockKind {
    /// Weights divided among the ranks of a tensor-parallel group: the per-token linears
    /// and the per-sample (modulation) linears.
    pub fn sharded_params(&self) -> u64 {
        self.img_params + self.txt_params + self.joint_params + self.per_sample_params
    }
    pub fn params(&self) -> u64 {
        self.sharded_params() + self.replicated_params
    }
    /// Weight bytes of one block on one device of a tensor-parallel group of `tp`.
    pub fn weight_bytes(&self, dtype: DType, tp: u32) -> u64 {
        let tp = tp.max(1) as u64;
        match self.checkpoint_bytes {
            Some(total) => {
                let total = recast(total, self.checkpoint_dtype, dtype);
                // Same split between sharded and replicated weights as the architecture.
                let rep = (total as u128 * self.replicated_params as u128)
                    .checked_div(self.params() as u128)
                    .unwrap_or(0);
                let shard = (total as u128 - rep).div_ceil(tp as u128);
                (rep + shard) as u64
            }
            None => {
                dtype.weight_bytes(self.sharded_params().div_ceil(tp))
                    + dtype.weight_bytes(self.replicated_params)
            }
        }
    }
    /// FLOPs of one block for `batch` samples on one rank of a group of `tp`.
    pub fn flops(&self, t: Tokens, batch: u64, tp: u32) -> f64 {
        let tp = tp.max(1) as f64;
        let f = self.flop_parts(t);
        batch as f64 * ((f.token_linear + f.attention + f.per_sample) / tp + f.replicated)
    }
    /// FLOPs of one block for one sample, by how a parallel layout divides them.
    pub fn flop_parts(&self, t: Tokens) -> FlopParts {
        let (ti, tt) = (t.img as f64, t.txt as f64);
        let hd = self.heads as f64 * self.head_dim as f64;
        FlopParts {
            token_linear: 2.0
                * (self.img_params as f64 * ti
                    + self.txt_params as f64 * tt
                    + self.joint_params as f64 * (ti + tt)),
            attention: 4.0
                * hd
                * match self.attention {
                    Attention::Joint => (ti + tt) * (ti + tt),
                    Attention::Image => ti * ti,
                    Attention::Text => tt * tt,
                    Attention::ImageCrossText => ti * ti + ti * tt,
                },
            per_sample: 2.0 * self.per_sample_params as f64,
            replicated: 2.0 * self.replicated_params as f64,
        }
    }
    /// Tokens this block's residual stream carries (what sequence parallelism splits).
    pub fn stream_token_count(&self, t: Tokens) -> u64 {
        self.stream_tokens(t)
    }
    /// Output features of the per-sample linears: they map the `hidden`-wide
    /// conditioning vector (with bias), so `per_sample_params = outputs · (hidden + 1)`.
    fn per_sample_outputs(&self) -> u64 {
        self.per_sample_params / (self.hidden + 1)
    }
    /// All-gathers per block under tensor parallel: one for the per-sample outputs (a
    /// dual-stream block gathers both streams' together), none without them.
    pub fn allgathers(&self) -> u32 {
        u32::from(self.per_sample_params > 0)
    }
    /// Bytes one all-gather of the per-sample outputs yields on each rank: every
    /// sample's full output vector.
    pub fn per_sample_bytes(&self, batch: u64, act: u64) -> u64 {
        batch
            .saturating_mul(self.per_sample_outputs())
            .saturating_mul(act)
    }
    /// Tokens this block's residual stream carries.
    fn stream_tokens(&self, t: Tokens) -> u64 {
        match self.attention {
            Attention::Joint => t.img.saturating_add(t.txt),
            Attention::Image | Attention::ImageCrossText => t.img,
            Attention::Text => t.txt,
        }
    }
    /// (query tokens, key tokens) of the largest attention in the block.
    pub fn attention_shape(&self, t: Tokens) -> (u64, u64) {
        match self.attention {
            Attention::Joint => {
                let all = t.img.saturating_add(t.txt);
                (all, all)
            }
            Attention::Image | Attention::ImageCrossText => (t.img, t.img),
            Attention::Text => (t.txt, t.txt),
        }
    }
    /// Peak live activation bytes while one block runs on one rank of a group of `tp`:
    /// the residual and its modulated copy, q/k/v and attention output shards, the MLP
    /// hidden shard, and — when attention is not fused — the f32 scores and softmax.
    /// The executor's blocks drop each intermediate after its last use so that they stay
    /// within it (`mold-exec`'s test `block_memory`); a block that kept them all to its
    /// end held about 1.8× this (FLUX on an H200, `benches/peak-trace`).
    pub fn activation_bytes(&self, t: Tokens, batch: u64, act: u64, tp: u32, fused: bool) -> u64 {
        let tp = tp.max(1) as u64;
        let tok = self.stream_tokens(t);
        let h = self.hidden;
        let per_token = 2 * h + (4 * h).div_ceil(tp) + self.mlp_hidden.div_ceil(tp);
        let mut bytes = product(&[batch, tok, per_token, act]);
        if !fused {
            let (q, k) = self.attention_shape(t);
            let heads = (self.heads as u64).div_ceil(tp);
            bytes = bytes.saturating_add(product(&[2, batch, heads, q, k, 4]));
        }
        bytes
    }
    /// Bytes of the hidden state handed between parts or all-reduced once.
    pub fn hidden_bytes(&self, t: Tokens, batch: u64, act: u64) -> u64 {
        product(&[batch, self.stream_tokens(t), self.hidden, act])
    }
}

/// One block's FLOPs for one sample, by kind of work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FlopParts {
    /// Per-token linears (split by tokens and by output columns).
    pub token_linear: f64,
    /// Attention scores and their product with values (split by heads).
    pub attention: f64,
    /// Per-sample (modulation) linears (split by output columns).
    pub per_sample: f64,
    /// Small vectors every rank applies in full.
    pub replicated: f64,
}

/// The product of `factors`, saturating at `u64::MAX`: a size too large to count never
/// fits anything, where a wrapped one might.
pub fn product(factors: &[u64]) -> u64 {
    factors.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

/// Token counts of one sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Tokens {
    pub img: u64,
    pub txt: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TransformerSpec {
    /// Block kinds in execution order.
    pub kinds: Vec<BlockKind>,
    /// Embeddings and final layer (input/output projections, timestep, guidance, vector
    /// embeddings): replicated on the devices that run them.
    pub stem_params: u64,
    /// Exact stem bytes from a checkpoint header.
    pub stem_checkpoint_bytes: Option<u64>,
    /// The dtype of the checkpoint those bytes come from ([`BlockKind::checkpoint_dtype`]).
    pub checkpoint_dtype: Option<DType>,
    pub default_dtype: DType,
    /// The executor computes the blocks' per-sample (modulation) linears for a window of
    /// up to [`MODULATION_AHEAD_STEPS`] steps at once and keeps the outputs between the
    /// steps ([`modulation_windows`]); `false`: every step computes its own.
    pub modulation_ahead: bool,
}

/// Steps whose per-sample (modulation) outputs one product computes ahead: a window.
pub const MODULATION_AHEAD_STEPS: u32 = 16;

/// The windows a request of `steps` steps computes its modulation in, each its number of
/// steps (`16, 12` for 28 steps).
pub fn modulation_windows(steps: u32) -> Vec<u64> {
    let w = MODULATION_AHEAD_STEPS;
    (0..steps.div_ceil(w))
        .map(|i| (steps - i * w).min(w) as u64)
        .collect()
}

impl TransformerSpec {
    pub fn kind(&self, name: &str) -> Option<(usize, &BlockKind)> {
        self.kinds.iter().enumerate().find(|(_, k)| k.name == name)
    }
    /// The windows (steps each) a request of `steps` steps computes the blocks'
    /// per-sample products in where the executor computes them ahead
    /// ([`modulation_windows`]); empty where every step computes its own.
    pub fn modulation_windows(&self, steps: u32) -> Vec<u64> {
        if self.modulation_ahead {
            modulation_windows(steps)
        } else {
            Vec::new()
        }
    }
    pub fn total_blocks(&self) -> u32 {
        self.kinds.iter().map(|k| k.count).sum()
    }
    pub fn stem_bytes(&self, dtype: DType) -> u64 {
        self.stem_checkpoint_bytes
            .map(|b| recast(b, self.checkpoint_dtype, dtype))
            .unwrap_or_else(|| dtype.weight_bytes(self.stem_params))
    }
    pub fn weight_bytes(&self, dtype: DType) -> u64 {
        self.kinds.iter().fold(self.stem_bytes(dtype), |sum, k| {
            sum.saturating_add((k.count as u64).saturating_mul(k.weight_bytes(dtype, 1)))
        })
    }
    pub fn params(&self) -> u64 {
        self.stem_params
            + self
                .kinds
                .iter()
                .map(|k| k.count as u64 * k.params())
                .sum::<u64>()
    }
    /// Tensor-parallel degrees every block kind can be split into (heads divisible).
    pub fn tp_divides(&self, degree: u32) -> bool {
        self.kinds.iter().all(|k| k.heads % degree == 0)
    }
    pub fn heads(&self) -> u32 {
        self.kinds.iter().map(|k| k.heads).min().unwrap_or(1)
    }
}

/// What an encoder or VAE costs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Workkind {
    /// A text encoder over the prompt tokens: FLOPs 2·params per token.
    TextEncoder {
        hidden: u64,
        mlp_hidden: u64,
        heads: u32,
    },
    /// A VAE decoder: FLOPs and activation per output pixel (per frame).
    VaeDecoder {
        flops_per_pixel: f64,
        /// Channels of the full-resolution feature maps.
        top_channels: u64,
        /// Where mold can decode the image in row bands over several devices: the
        /// decoder's group norms, each an exchange between the bands (their statistics,
        /// and the edge rows the next convolution reads). `None`: one device only.
        #[serde(skip_serializing_if = "Option::is_none")]
        band_exchanges: Option<u32>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ComponentSpec {
    pub name: String,
    pub role: ComponentRole,
    pub description: String,
    pub params: u64,
    pub default_dtype: DType,
    pub work: Workkind,
}

impl ComponentSpec {
    pub fn weight_bytes(&self, dtype: DType) -> u64 {
        dtype.weight_bytes(self.params)
    }
    /// FLOPs of one request through this component.
    pub fn flops(&self, model: &ModelSpec, w: &Workload) -> f64 {
        let b = w.effective_batch() as f64;
        match &self.work {
            Workkind::TextEncoder { .. } => 2.0 * self.params as f64 * model.text_tokens as f64 * b,
            Workkind::VaeDecoder {
                flops_per_pixel, ..
            } => {
                flops_per_pixel
                    * w.width as f64
                    * w.height as f64
                    * w.frames as f64
                    * w.batch as f64
            }
        }
    }
    /// Peak activation bytes while this component runs.
    pub fn activation_bytes(&self, model: &ModelSpec, w: &Workload, act: u64) -> u64 {
        match &self.work {
            Workkind::TextEncoder {
                hidden,
                mlp_hidden,
                heads,
            } => {
                let t = model.text_tokens as u64;
                let b = w.effective_batch();
                product(&[b, t, 4 * hidden + mlp_hidden, act]).saturating_add(product(&[
                    2,
                    b,
                    *heads as u64,
                    t,
                    t,
                    4,
                ]))
            }
            Workkind::VaeDecoder { top_channels, .. } => {
                // About six full-resolution feature maps live at once (resnet input,
                // two conv outputs, group-norm temporaries, skip). Video VAEs decode one
                // latent frame (temporal_down output frames) at a time.
                let frames = (w.frames as u64).min(model.latent.temporal_down as u64);
                product(&[
                    6,
                    *top_channels,
                    w.width as u64,
                    w.height as u64,
                    frames,
                    w.batch as u64,
                    act,
                ])
            }
        }
    }
}

/// What a model supports: every workload outside these is refused, naming the range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Largest width and height in pixels (a multiple of the model's pixels per latent
    /// patch, the step widths and heights go in).
    pub max_side: u32,
    /// Most frames per sample: 1 for image models.
    pub max_frames: u32,
    /// Most samples per request.
    pub max_batch: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LatentSpec {
    pub channels: u32,
    /// Spatial downsampling of the VAE.
    pub spatial_down: u32,
    /// Temporal downsampling (video models), 1 for images.
    pub temporal_down: u32,
    /// Patch size of the transformer's patchify.
    pub patch: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelSpec {
    pub id: String,
    pub description: String,
    /// Text encoders and VAE (the transformer is in `transformer`).
    pub components: Vec<ComponentSpec>,
    pub transformer: TransformerSpec,
    pub latent: LatentSpec,
    /// Prompt tokens the transformer attends to (padding length where the pipeline pads).
    pub text_tokens: u32,
    pub video: bool,
    pub default_workload: Workload,
}

impl ModelSpec {
    pub fn component(&self, name: &str) -> Option<&ComponentSpec> {
        self.components.iter().find(|c| c.name == name)
    }

    /// Image (or video) tokens and text tokens for one sample of the workload.
    pub fn tokens(&self, w: &Workload) -> Tokens {
        let s = self.size_step().max(1) as u64;
        let frames = if self.video {
            (w.frames as u64).saturating_sub(1) / self.latent.temporal_down.max(1) as u64 + 1
        } else {
            1
        };
        Tokens {
            img: product(&[frames, w.width as u64 / s, w.height as u64 / s]),
            txt: self.text_tokens as u64,
        }
    }

    /// Pixels per latent patch along a side: widths and heights are multiples of it.
    pub(crate) fn size_step(&self) -> u32 {
        self.latent.spatial_down.saturating_mul(self.latent.patch)
    }

    /// What this model supports: the catalogue's figures, or, for a model the catalogue
    /// does not list, 2048 pixels a side, 64 samples and (video) 257 frames.
    pub fn limits(&self) -> Limits {
        catalogue::limits(&self.id).unwrap_or_else(|| {
            let step = self.size_step().max(1);
            Limits {
                max_side: (2048 / step).max(1) * step,
                max_frames: if self.video { 257 } else { 1 },
                max_batch: catalogue::MAX_BATCH,
            }
        })
    }

    /// Refuses sizes the model cannot run, naming the field and the valid range (and the
    /// nearest valid sizes).
    pub fn check_workload(&self, w: &Workload) -> Result<(), ModelError> {
        let bad = |field: &str, message: String| ModelError::Workload {
            field: format!("workload.{field}"),
            message,
        };
        let lim = self.limits();
        let m = self.size_step().max(1);
        let id = &self.id;
        for (field, v) in [("width", w.width), ("height", w.height)] {
            let range = format!("{m} to {} in steps of {m}", lim.max_side);
            if v > lim.max_side {
                return Err(bad(
                    field,
                    format!("{v} is more than {id} supports: use {range}"),
                ));
            }
            if v == 0 || v % m != 0 {
                let lo = (v / m) * m;
                let hi = lo + m;
                // v ≤ max_side, a multiple of m, so hi ≤ max_side too.
                let near = if lo == 0 {
                    format!("{hi}")
                } else {
                    format!("{lo} or {hi}")
                };
                return Err(bad(
                    field,
                    format!("{v} is not a multiple of {m}, which {id} needs: use {near} ({range})"),
                ));
            }
        }
        if self.video {
            let t = self.latent.temporal_down.max(1);
            let range = format!("{t}·k + 1 frames, from 1 to {}", lim.max_frames);
            if w.frames > lim.max_frames {
                return Err(bad(
                    "frames",
                    format!(
                        "{} frames is more than {id} supports: use {range}",
                        w.frames
                    ),
                ));
            }
            if w.frames == 0 || !(w.frames - 1).is_multiple_of(t) {
                let lo = (w.frames.saturating_sub(1) / t) * t + 1;
                return Err(bad(
                    "frames",
                    format!(
                        "{} frames: {id} needs {range}: use {lo} or {}",
                        w.frames,
                        lo + t
                    ),
                ));
            }
        } else if w.frames != 1 {
            return Err(bad(
                "frames",
                format!("{}: {id} makes images: frames must be 1", w.frames),
            ));
        }
        if w.batch == 0 || w.batch > lim.max_batch {
            return Err(bad(
                "batch",
                format!(
                    "{}: {id} runs batches of 1 to {} samples",
                    w.batch, lim.max_batch
                ),
            ));
        }
        if w.steps == 0 {
            return Err(bad("steps", "0: use at least 1 step".into()));
        }
        for (field, v) in [("guidance", w.guidance), ("cfg_scale", w.cfg_scale)] {
            if let Some(x) = v.filter(|x| !(x.is_finite() && *x >= 0.0)) {
                return Err(bad(field, format!("{x}: give a finite number ≥ 0")));
            }
        }
        Ok(())
    }
}

/// Looks a model up in the built-in catalogue.
pub fn find(id: &str) -> Result<ModelSpec, ModelError> {
    builtin()
        .into_iter()
        .find(|m| m.id == id)
        .ok_or_else(|| ModelError::Unknown {
            id: id.to_string(),
            known: builtin()
                .iter()
                .map(|m| m.id.clone())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

#[cfg(test)]
mod tests;
