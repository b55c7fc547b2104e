//! Built-in models. Every count below is derived from the published architecture
//! configs; `tests.rs` pins the totals against the published checkpoint sizes
//! (../shared/models.md).

use crate::*;

/// A dual-stream block (FLUX double, MMDiT joint, Qwen-Image): per stream q/k/v + out
/// projection (4h²) and an MLP of `mlp` (2·h·mlp), plus a 6h modulation linear per
/// stream (sharded under tensor parallel, like the rest) and the q/k norm scales.
fn dual_stream(name: &str, count: u32, h: u64, heads: u32, head_dim: u32, mlp: u64) -> BlockKind {
    let per_stream = (3 * h * h + 3 * h) + (h * h + h) + (h * mlp + mlp) + (mlp * h + h);
    BlockKind {
        name: name.into(),
        count,
        hidden: h,
        heads,
        head_dim,
        mlp_hidden: mlp,
        img_params: per_stream,
        txt_params: per_stream,
        joint_params: 0,
        per_sample_params: 2 * (6 * h * h + 6 * h),
        replicated_params: 4 * head_dim as u64,
        attention: Attention::Joint,
        allreduces: 2,
        streams: 2,
        checkpoint_bytes: None,
        checkpoint_dtype: None,
    }
}

/// FLUX single-stream block: fused linear1 [3h + mlp] × h, linear2 (h + mlp) × h,
/// modulation 3h (sharded under tensor parallel), q/k norm scales.
fn flux_single(count: u32, h: u64, heads: u32, head_dim: u32, mlp: u64) -> BlockKind {
    BlockKind {
        name: "single".into(),
        count,
        hidden: h,
        heads,
        head_dim,
        mlp_hidden: mlp,
        img_params: 0,
        txt_params: 0,
        joint_params: (h * (3 * h + mlp) + 3 * h + mlp) + ((h + mlp) * h + h),
        per_sample_params: 3 * h * h + 3 * h,
        replicated_params: 2 * head_dim as u64,
        attention: Attention::Joint,
        allreduces: 1,
        streams: 1,
        checkpoint_bytes: None,
        checkpoint_dtype: None,
    }
}

/// A pre-norm DiT layer with attention (4h²) and a SwiGLU MLP (3·h·mlp) over one token
/// set (Z-Image), with a small adaLN of `adaln` params.
#[allow(clippy::too_many_arguments)] // one argument per architecture dimension
fn swiglu_layer(
    name: &str,
    count: u32,
    h: u64,
    heads: u32,
    head_dim: u32,
    mlp: u64,
    attention: Attention,
    adaln: u64,
) -> BlockKind {
    let p = 4 * h * h + 3 * h * mlp;
    let (img, txt, joint) = match attention {
        Attention::Image => (p, 0, 0),
        Attention::Text => (0, p, 0),
        _ => (0, 0, p),
    };
    BlockKind {
        name: name.into(),
        count,
        hidden: h,
        heads,
        head_dim,
        mlp_hidden: mlp,
        img_params: img,
        txt_params: txt,
        joint_params: joint,
        per_sample_params: 0,
        replicated_params: adaln + 4 * h,
        attention,
        allreduces: 2,
        streams: 1,
        checkpoint_bytes: None,
        checkpoint_dtype: None,
    }
}

/// LTX-Video block: self-attention (4h²), cross-attention to text (q, out on video
/// tokens; k, v on text tokens), GELU MLP (2·h·mlp), a 6h scale-shift table.
fn ltx_block(count: u32, h: u64, heads: u32, head_dim: u32, mlp: u64) -> BlockKind {
    BlockKind {
        name: "block".into(),
        count,
        hidden: h,
        heads,
        head_dim,
        mlp_hidden: mlp,
        img_params: (4 * h * h + 4 * h) + (2 * h * h + 2 * h) + (2 * h * mlp + mlp + h),
        txt_params: 2 * h * h + 2 * h,
        joint_params: 0,
        per_sample_params: 0,
        replicated_params: 6 * h + 4 * h,
        attention: Attention::ImageCrossText,
        allreduces: 3,
        streams: 1,
        checkpoint_bytes: None,
        checkpoint_dtype: None,
    }
}

fn linear(i: u64, o: u64) -> u64 {
    i * o + o
}

/// FLUX stem: img_in, txt_in, time_in, vector_in, guidance_in, final layer.
fn flux_stem(h: u64, in_ch: u64, ctx: u64, vec: u64, guidance: bool) -> u64 {
    let mlp_emb = |i: u64| linear(i, h) + linear(h, h);
    linear(in_ch, h)
        + linear(ctx, h)
        + mlp_emb(256)
        + mlp_emb(vec)
        + if guidance { mlp_emb(256) } else { 0 }
        + linear(h, 2 * h)
        + linear(h, in_ch)
}

fn t5_xxl() -> ComponentSpec {
    ComponentSpec {
        name: "t5".into(),
        role: ComponentRole::Encoder,
        description: "T5-XXL v1.1 encoder (24 layers, d_model 4096, d_ff 10240)".into(),
        // 24 × (4 · 4096² attention + 3 · 4096 · 10240 gated FFN) + 32128 × 4096 embeddings.
        params: 24 * (4 * 4096 * 4096 + 3 * 4096 * 10240) + 32128 * 4096,
        default_dtype: DType::Fp16,
        work: Workkind::TextEncoder {
            hidden: 4096,
            mlp_hidden: 10240,
            heads: 64,
        },
    }
}

fn clip_l() -> ComponentSpec {
    ComponentSpec {
        name: "clip".into(),
        role: ComponentRole::Encoder,
        description: "CLIP ViT-L/14 text model (12 layers, width 768)".into(),
        params: 12 * (4 * 768 * 768 + 2 * 768 * 3072) + 49408 * 768 + 77 * 768 + 768 * 768,
        default_dtype: DType::Bf16,
        work: Workkind::TextEncoder {
            hidden: 768,
            mlp_hidden: 3072,
            heads: 12,
        },
    }
}

fn clip_g() -> ComponentSpec {
    ComponentSpec {
        name: "clip_g".into(),
        role: ComponentRole::Encoder,
        description: "OpenCLIP bigG/14 text model (32 layers, width 1280)".into(),
        params: 32 * (4 * 1280 * 1280 + 2 * 1280 * 5120) + 49408 * 1280 + 77 * 1280 + 1280 * 1280,
        default_dtype: DType::Fp16,
        work: Workkind::TextEncoder {
            hidden: 1280,
            mlp_hidden: 5120,
            heads: 20,
        },
    }
}

/// A decoder-only LM used as a text encoder: `layers` × (attention with GQA + SwiGLU).
#[allow(clippy::too_many_arguments)] // one argument per architecture dimension
fn lm_encoder(
    name: &str,
    description: &str,
    layers: u64,
    h: u64,
    kv: u64,
    mlp: u64,
    vocab: u64,
    extra: u64,
    heads: u32,
) -> ComponentSpec {
    ComponentSpec {
        name: name.into(),
        role: ComponentRole::Encoder,
        description: description.into(),
        params: layers * (2 * h * h + 2 * h * kv + 3 * h * mlp) + vocab * h + extra,
        default_dtype: DType::Bf16,
        work: Workkind::TextEncoder {
            hidden: h,
            mlp_hidden: mlp,
            heads,
        },
    }
}

/// FLUX autoencoder decoder (16 latent channels, 8× down, 128 channels at full size).
fn flux_vae(params: u64, dtype: DType, description: &str) -> ComponentSpec {
    ComponentSpec {
        name: "vae".into(),
        role: ComponentRole::Vae,
        description: description.into(),
        params,
        default_dtype: dtype,
        // Per output pixel: ~1.8 MFLOP at each of the four resolutions (3×3 convs,
        // channels 128/256/512/512) plus up-sampling convs.
        work: Workkind::VaeDecoder {
            flops_per_pixel: 7.0e6,
            top_channels: 128,
            // Group norms of FLUX's decoder: 2 in each of the mid block's two resnet blocks,
            // its attention's, 2 in each of 4 levels × 3 resnet blocks, norm_out.
            band_exchanges: Some(30),
        },
    }
}

fn image_workload(steps: u32, guidance: Option<f64>, cfg: Option<f64>) -> Workload {
    Workload {
        width: 1024,
        height: 1024,
        frames: 1,
        batch: 1,
        steps,
        guidance,
        cfg_scale: cfg,
    }
}

fn flux(id: &str, guidance: bool) -> ModelSpec {
    let a = if guidance {
        crate::arch::FLUX_DEV
    } else {
        crate::arch::FLUX_SCHNELL
    };
    let (h, heads, hd, mlp) = (a.hidden, a.heads, a.head_dim, a.mlp_hidden);
    ModelSpec {
        id: id.into(),
        description: format!(
            "FLUX.1-{} (Black Forest Labs): 19 double-stream + 38 single-stream blocks, hidden 3072",
            if guidance { "dev" } else { "schnell" }
        ),
        components: vec![
            t5_xxl(),
            clip_l(),
            flux_vae(83_819_683, DType::Bf16, "FLUX autoencoder (ae.safetensors)"),
        ],
        transformer: TransformerSpec {
            kinds: vec![
                dual_stream("double", a.depth, h, heads, hd, mlp),
                flux_single(a.depth_single, h, heads, hd, mlp),
            ],
            stem_params: flux_stem(h, a.in_channels, a.context_in_dim, a.vec_in_dim, a.guidance_embed),
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::Bf16,
            modulation_ahead: true,
        },
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        text_tokens: if guidance { 512 } else { 256 },
        video: false,
        default_workload: if guidance {
            image_workload(28, Some(3.5), None)
        } else {
            image_workload(4, None, None)
        },
    }
}

/// `flux-tiny`: the FLUX architecture at hidden 64 (4 heads × 16), 2 double + 3 single
/// blocks, for tests; the executor's `FluxConfig::flux_tiny` has the same shape.
fn flux_tiny() -> ModelSpec {
    let a = crate::arch::FLUX_TINY;
    let (h, heads, hd, mlp) = (a.hidden, a.heads, a.head_dim, a.mlp_hidden);
    ModelSpec {
        id: "flux-tiny".into(),
        description: "FLUX architecture at hidden 64: 2 double + 3 single blocks (tests)".into(),
        components: vec![
            ComponentSpec {
                name: "t5".into(),
                role: ComponentRole::Encoder,
                description: "tiny T5 encoder (2 layers, d_model 32)".into(),
                params: 2 * (4 * 32 * 32 + 3 * 32 * 64) + 1000 * 32,
                default_dtype: DType::F32,
                work: Workkind::TextEncoder {
                    hidden: 32,
                    mlp_hidden: 64,
                    heads: 4,
                },
            },
            ComponentSpec {
                name: "clip".into(),
                role: ComponentRole::Encoder,
                description: "tiny CLIP text model (2 layers, width 16)".into(),
                params: 2 * (4 * 16 * 16 + 2 * 16 * 64) + 1000 * 16 + 77 * 16,
                default_dtype: DType::F32,
                work: Workkind::TextEncoder {
                    hidden: 16,
                    mlp_hidden: 64,
                    heads: 2,
                },
            },
            ComponentSpec {
                name: "vae".into(),
                role: ComponentRole::Vae,
                description: "tiny FLUX-style autoencoder decoder".into(),
                params: 200_000,
                default_dtype: DType::F32,
                work: Workkind::VaeDecoder {
                    flops_per_pixel: 2.0e5,
                    top_channels: 8,
                    // AeConfig::tiny: 5 in the mid block, 2 in each of 4 × 2 resnet blocks, norm_out.
                    band_exchanges: Some(22),
                },
            },
        ],
        transformer: TransformerSpec {
            kinds: vec![
                dual_stream("double", a.depth, h, heads, hd, mlp),
                flux_single(a.depth_single, h, heads, hd, mlp),
            ],
            stem_params: flux_stem(
                h,
                a.in_channels,
                a.context_in_dim,
                a.vec_in_dim,
                a.guidance_embed,
            ),
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::F32,
            modulation_ahead: true,
        },
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        text_tokens: 8,
        video: false,
        default_workload: Workload {
            width: 64,
            height: 64,
            frames: 1,
            batch: 1,
            steps: 4,
            guidance: Some(3.5),
            cfg_scale: None,
        },
    }
}

/// A Qwen-Image transformer from its architecture: dual-stream blocks, and a stem of
/// `img_in`, `txt_norm` (RMSNorm scale) + `txt_in`, the timestep embedder, `norm_out`
/// (adaLN, shift and scale) and `proj_out`.
fn qwen_transformer(a: &crate::arch::QwenArch, dtype: DType) -> TransformerSpec {
    let h = a.hidden;
    let out = (a.patch * a.patch) as u64 * a.out_channels;
    TransformerSpec {
        kinds: vec![dual_stream(
            "block",
            a.depth,
            h,
            a.heads,
            a.head_dim,
            a.mlp_hidden,
        )],
        stem_params: linear(a.in_channels, h)
            + linear(a.joint_attention_dim, h)
            + a.joint_attention_dim
            + linear(256, h)
            + linear(h, h)
            + linear(h, 2 * h)
            + linear(h, out),
        stem_checkpoint_bytes: None,
        checkpoint_dtype: None,
        default_dtype: dtype,
        modulation_ahead: false,
    }
}

fn qwen_image() -> ModelSpec {
    let qwen25vl = lm_encoder(
        "qwen2.5-vl",
        "Qwen2.5-VL-7B (28 layers, hidden 3584, GQA 4 KV heads) with its vision tower",
        28,
        3584,
        512,
        18944,
        152064,
        // untied lm head and the 675M vision tower are part of the published checkpoint
        152064 * 3584 + 675_000_000,
        28,
    );
    ModelSpec {
        id: "qwen-image".into(),
        description: "Qwen-Image (Alibaba): 60 dual-stream MMDiT blocks, hidden 3072".into(),
        components: vec![
            qwen25vl,
            ComponentSpec {
                name: "vae".into(),
                role: ComponentRole::Vae,
                description: "Qwen-Image VAE (Wan-2.1 style, 16 channels, 8× down)".into(),
                params: 126_900_000,
                default_dtype: DType::Bf16,
                work: Workkind::VaeDecoder {
                    flops_per_pixel: 9.0e6,
                    top_channels: 96,
                    band_exchanges: None,
                },
            },
        ],
        transformer: qwen_transformer(&crate::arch::QWEN_IMAGE, DType::Bf16),
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        text_tokens: 512,
        video: false,
        default_workload: image_workload(50, None, Some(4.0)),
    }
}

/// `qwen-image-tiny`: Qwen-Image's structure at hidden 64 (4 heads × 16), 3 blocks, for
/// tests; the executor's `QwenConfig::qwen_image_tiny` has the same shape.
fn qwen_image_tiny() -> ModelSpec {
    let a = crate::arch::QWEN_IMAGE_TINY;
    let text = a.joint_attention_dim;
    ModelSpec {
        id: "qwen-image-tiny".into(),
        description: "Qwen-Image architecture at hidden 64: 3 dual-stream blocks (tests)".into(),
        components: vec![
            // f32 like the rest of the tiny model (its test data is f32): the parity
            // script compares it with diffusers in f32.
            ComponentSpec {
                default_dtype: DType::F32,
                ..lm_encoder(
                    "qwen2.5-vl",
                    "tiny Qwen2.5-VL-style language model (2 layers, hidden 32)",
                    2,
                    text,
                    text,
                    2 * text,
                    1000,
                    0,
                    4,
                )
            },
            ComponentSpec {
                name: "vae".into(),
                role: ComponentRole::Vae,
                description: "tiny Qwen-Image-style VAE decoder".into(),
                params: 200_000,
                default_dtype: DType::F32,
                work: Workkind::VaeDecoder {
                    flops_per_pixel: 2.0e5,
                    top_channels: 8,
                    band_exchanges: None,
                },
            },
        ],
        transformer: qwen_transformer(&a, DType::F32),
        latent: LatentSpec {
            channels: a.out_channels as u32,
            spatial_down: 8,
            temporal_down: 1,
            patch: a.patch,
        },
        text_tokens: 8,
        video: false,
        default_workload: Workload {
            width: 64,
            height: 64,
            frames: 1,
            batch: 1,
            steps: 4,
            guidance: None,
            cfg_scale: Some(4.0),
        },
    }
}

fn sd35_large() -> ModelSpec {
    let (h, heads, hd) = (2432, 38, 64);
    ModelSpec {
        id: "sd3.5-large".into(),
        description: "Stable Diffusion 3.5 Large: 38 MMDiT joint blocks, hidden 2432".into(),
        components: vec![
            clip_l(),
            clip_g(),
            t5_xxl(),
            flux_vae(83_653_863, DType::Bf16, "SD3 16-channel autoencoder"),
        ],
        transformer: TransformerSpec {
            kinds: vec![dual_stream("joint", 38, h, heads, hd, 4 * h)],
            stem_params: 16 * 4 * h
                + h
                + 192 * 192 * h
                + linear(4096, h)
                + linear(256, h)
                + linear(h, h)
                + linear(2048, h)
                + linear(h, h)
                + linear(h, 2 * h)
                + linear(h, 64),
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::Bf16,
            modulation_ahead: false,
        },
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        // 77 CLIP tokens + 256 T5 tokens.
        text_tokens: 333,
        video: false,
        default_workload: image_workload(28, None, Some(3.5)),
    }
}

fn z_image_turbo() -> ModelSpec {
    let (h, heads, hd, mlp) = (3840, 30, 128, 10240);
    let adaln = linear(256, 4 * h);
    ModelSpec {
        id: "z-image-turbo".into(),
        description: "Z-Image-Turbo (Tongyi): single-stream DiT, 2 noise + 2 context refiners + 30 layers, hidden 3840".into(),
        components: vec![
            lm_encoder(
                "qwen3",
                "Qwen3-4B (36 layers, hidden 2560, GQA 8 KV heads)",
                36,
                2560,
                1024,
                9728,
                151936,
                // q and o project to 32 heads × 128 = 4096, wider than the 2560 hidden size
                36 * 2 * 2560 * (4096 - 2560),
                32,
            ),
            flux_vae(83_819_683, DType::Bf16, "FLUX autoencoder"),
        ],
        transformer: TransformerSpec {
            kinds: vec![
                swiglu_layer("noise_refiner", 2, h, heads, hd, mlp, Attention::Image, adaln),
                swiglu_layer("context_refiner", 2, h, heads, hd, mlp, Attention::Text, 0),
                swiglu_layer("layer", 30, h, heads, hd, mlp, Attention::Joint, adaln),
            ],
            stem_params: linear(64, h) + linear(2560, h) + linear(256, 1024) + linear(1024, 256)
                + linear(h, h)
                + linear(h, 64),
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::Bf16,
            modulation_ahead: false,
        },
        latent: LatentSpec {
            channels: 16,
            spatial_down: 8,
            temporal_down: 1,
            patch: 2,
        },
        text_tokens: 512,
        video: false,
        default_workload: image_workload(8, None, None),
    }
}

fn ltx(id: &str, blocks: u32, h: u64, heads: u32, hd: u32) -> ModelSpec {
    ModelSpec {
        id: id.into(),
        description: format!(
            "LTX-Video (Lightricks): {blocks} blocks, hidden {h}, cross-attention to T5"
        ),
        components: vec![
            t5_xxl(),
            ComponentSpec {
                name: "vae".into(),
                role: ComponentRole::Vae,
                description: "LTX video VAE (128 channels, 32× spatial, 8× temporal), sized from the published file".into(),
                params: 1_245_000_000,
                default_dtype: DType::Bf16,
                work: Workkind::VaeDecoder {
                    flops_per_pixel: 2.0e6,
                    top_channels: 128,
                    band_exchanges: None,
                },
            },
        ],
        transformer: TransformerSpec {
            kinds: vec![ltx_block(blocks, h, heads, hd, 4 * h)],
            stem_params: linear(128, h)
                + linear(256, h)
                + linear(h, 6 * h)
                + linear(4096, h)
                + linear(h, h)
                + linear(h, 128),
            stem_checkpoint_bytes: None,
            checkpoint_dtype: None,
            default_dtype: DType::Bf16,
            modulation_ahead: false,
        },
        latent: LatentSpec {
            channels: 128,
            spatial_down: 32,
            temporal_down: 8,
            patch: 1,
        },
        text_tokens: 128,
        video: true,
        default_workload: Workload {
            width: 768,
            height: 512,
            frames: 121,
            batch: 1,
            steps: 30,
            guidance: None,
            cfg_scale: Some(3.0),
        },
    }
}

/// Most samples one request may batch, for every model.
pub(crate) const MAX_BATCH: u32 = 64;

/// What each built-in model supports ([`ModelSpec::limits`]).
///
/// - FLUX (and flux-tiny, its architecture), Qwen-Image, Z-Image: 2048 pixels a side —
///   a 128 × 128 latent patch grid (16 384 image tokens), the largest their RoPE
///   position ranges are used at;
/// - SD3.5 Large: 3072, its learned position table's 192 × 192 patches (`stem_params`);
/// - LTX-Video: 1280 a side and 257 frames (8·k + 1), the largest video the published
///   pipeline makes.
pub(crate) fn limits(id: &str) -> Option<Limits> {
    let image = |max_side| Limits {
        max_side,
        max_frames: 1,
        max_batch: MAX_BATCH,
    };
    Some(match id {
        "flux-dev" | "flux-schnell" | "flux-tiny" | "qwen-image" | "qwen-image-tiny"
        | "z-image-turbo" => image(2048),
        "sd3.5-large" => image(3072),
        "ltx-video-2b" | "ltx-video-13b" => Limits {
            max_side: 1280,
            max_frames: 257,
            max_batch: MAX_BATCH,
        },
        _ => return None,
    })
}

/// Every built-in model.
pub fn builtin() -> Vec<ModelSpec> {
    vec![
        flux("flux-dev", true),
        flux("flux-schnell", false),
        qwen_image(),
        sd35_large(),
        z_image_turbo(),
        ltx("ltx-video-2b", 28, 2048, 32, 64),
        ltx("ltx-video-13b", 48, 4096, 32, 128),
        flux_tiny(),
        qwen_image_tiny(),
    ]
}
