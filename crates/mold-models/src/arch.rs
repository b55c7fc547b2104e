//! Architecture hyper-parameters of the families mold executes: the one definition the
//! catalogue's sizes (here) and the executor's model config (`mold-exec`) are both built
//! from, so the planner and the executor cannot disagree about a model's shape.

/// FLUX (BFL `FluxParams`): FLUX.1 dev/schnell and the tiny test model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FluxArch {
    /// Channels of a packed latent token (16 latent channels × 2×2 patch = 64).
    pub in_channels: u64,
    pub hidden: u64,
    pub heads: u32,
    pub head_dim: u32,
    /// MLP width (`hidden * mlp_ratio`).
    pub mlp_hidden: u64,
    /// Double-stream blocks, then single-stream blocks.
    pub depth: u32,
    pub depth_single: u32,
    /// Width of the text-encoder (T5) tokens.
    pub context_in_dim: u64,
    /// Width of the pooled vector (CLIP).
    pub vec_in_dim: u64,
    /// RoPE dimensions per position axis (sum to `head_dim`).
    pub axes_dim: [u32; 3],
    pub theta: f64,
    /// Whether the model has a distilled-guidance embedder (`guidance_in`).
    pub guidance_embed: bool,
}

/// FLUX.1 \[dev\] (12B, guidance distilled).
pub const FLUX_DEV: FluxArch = FluxArch {
    in_channels: 64,
    hidden: 3072,
    heads: 24,
    head_dim: 128,
    mlp_hidden: 4 * 3072,
    depth: 19,
    depth_single: 38,
    context_in_dim: 4096,
    vec_in_dim: 768,
    axes_dim: [16, 56, 56],
    theta: 10_000.0,
    guidance_embed: true,
};

/// FLUX.1 \[schnell\]: dev's shapes without the guidance embedder.
pub const FLUX_SCHNELL: FluxArch = FluxArch {
    guidance_embed: false,
    ..FLUX_DEV
};

/// FLUX's structure at hidden 64 (4 heads × 16), 2 double + 3 single blocks, for tests.
pub const FLUX_TINY: FluxArch = FluxArch {
    in_channels: 64,
    hidden: 64,
    heads: 4,
    head_dim: 16,
    mlp_hidden: 256,
    depth: 2,
    depth_single: 3,
    context_in_dim: 32,
    vec_in_dim: 16,
    axes_dim: [4, 6, 6],
    theta: 10_000.0,
    guidance_embed: true,
};

/// The FLUX architecture of a catalogue id (`flux-dev`, `flux-schnell`, `flux-tiny`).
pub fn flux(id: &str) -> Option<FluxArch> {
    match id {
        "flux-dev" => Some(FLUX_DEV),
        "flux-schnell" => Some(FLUX_SCHNELL),
        "flux-tiny" => Some(FLUX_TINY),
        _ => None,
    }
}

/// Qwen-Image (diffusers `QwenImageTransformer2DModel`): dual-stream MMDiT blocks over
/// packed latent tokens and the text encoder's hidden states.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QwenArch {
    /// Channels of a packed latent token (16 latent channels × 2×2 patch = 64).
    pub in_channels: u64,
    /// Latent channels out of the model before packing (`proj_out` writes
    /// `patch² · out_channels` per token).
    pub out_channels: u64,
    pub patch: u32,
    /// Inner dimension (`heads · head_dim`).
    pub hidden: u64,
    pub heads: u32,
    pub head_dim: u32,
    /// Width of the feed-forward layers (diffusers' `FeedForward`: 4 × `hidden`).
    pub mlp_hidden: u64,
    /// Dual-stream blocks (`num_layers`).
    pub depth: u32,
    /// Width of the text encoder's hidden states (`joint_attention_dim`).
    pub joint_attention_dim: u64,
    /// RoPE dimensions per axis (frame, height, width); they sum to `head_dim`.
    pub axes_dim: [u32; 3],
    pub theta: f64,
}

/// Qwen-Image (20B): 60 blocks, 24 heads × 128, text from Qwen2.5-VL-7B (3584 wide).
pub const QWEN_IMAGE: QwenArch = QwenArch {
    in_channels: 64,
    out_channels: 16,
    patch: 2,
    hidden: 3072,
    heads: 24,
    head_dim: 128,
    mlp_hidden: 4 * 3072,
    depth: 60,
    joint_attention_dim: 3584,
    axes_dim: [16, 56, 56],
    theta: 10_000.0,
};

/// Qwen-Image's structure at hidden 64 (4 heads × 16), 3 blocks, for tests.
pub const QWEN_IMAGE_TINY: QwenArch = QwenArch {
    in_channels: 64,
    out_channels: 16,
    patch: 2,
    hidden: 64,
    heads: 4,
    head_dim: 16,
    mlp_hidden: 4 * 64,
    depth: 3,
    joint_attention_dim: 32,
    axes_dim: [4, 6, 6],
    theta: 10_000.0,
};

/// The Qwen-Image architecture of a catalogue id (`qwen-image`, `qwen-image-tiny`).
pub fn qwen(id: &str) -> Option<QwenArch> {
    match id {
        "qwen-image" => Some(QWEN_IMAGE),
        "qwen-image-tiny" => Some(QWEN_IMAGE_TINY),
        _ => None,
    }
}
