//! FP8's error block by block ([`mold_exec::block_errors`]): every block of FLUX.1-dev or
//! Qwen-Image with its products in FP8 against the same block dense on the dense model's
//! activations, the error the FP8 model carries after each block, and the output's, one
//! transformer call on random inputs, bf16 activations.
//!
//!   fp8_block_errors MODEL WEIGHTS [WIDTHxHEIGHT] [TEXT_TOKENS] [SEED]
//!     MODEL: flux-dev | flux-schnell | qwen-image (or a tiny one); WEIGHTS: as `mold exec
//!     --weights` takes them (`mold testdata MODEL W`). Defaults: 1024x1024 (Qwen-Image
//!     1328x1328), 512 text tokens, seed 1. On the first CUDA GPU where there is one.
//!
//! Prints one line per block (`kind index own carried`) and `output E`. The FP8 products run
//! as `mold exec` runs them, `MOLD_FP8_*` included ([`mold_exec::Fp8Options::from_vars`]).
use candle_core::{DType, Device};
use mold_exec::block_errors::{fp8_block_errors, BlockErrors};
use mold_exec::{Checkpoint, Kernels, QwenConfig};

fn main() {
    if let Err(e) = run() {
        eprintln!("fp8_block_errors: {e}");
        std::process::exit(2);
    }
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, weights, rest @ ..] = args.as_slice() else {
        return Err(
            "usage: fp8_block_errors MODEL WEIGHTS [WIDTHxHEIGHT] [TEXT_TOKENS] [SEED]".into(),
        );
    };
    let qwen = model.starts_with("qwen-image");
    let (w, h) = match rest.first() {
        Some(s) => {
            let (w, h) = s
                .split_once('x')
                .ok_or_else(|| format!("size {s}: give WIDTHxHEIGHT, e.g. 1024x1024"))?;
            let p = |v: &str| {
                v.parse::<u32>()
                    .map_err(|_| format!("size {s}: not a number"))
            };
            (p(w)?, p(h)?)
        }
        None if qwen => (1328, 1328),
        None => (1024, 1024),
    };
    let num = |i: usize, d: u64| -> Result<u64, String> {
        rest.get(i).map_or(Ok(d), |v| {
            v.parse().map_err(|_| format!("{v}: not a number"))
        })
    };
    let (txt, seed) = (num(1, 512)? as usize, num(2, 1)?);
    let fp8 = mold_exec::Fp8Options::from_vars(|k| std::env::var(k).ok())?;
    mold_exec::model::fp8::configure(fp8);
    let fp8_attention = fp8.attention.unwrap_or(false);
    let dev = Device::cuda_if_available(0).map_err(|e| e.to_string())?;
    let ckpt = Checkpoint::open(std::path::Path::new(weights)).map_err(|e| e.to_string())?;
    let dtype = if dev.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let t = std::time::Instant::now();
    let e: BlockErrors = if qwen {
        let cfg = match model.as_str() {
            "qwen-image" => QwenConfig::qwen_image(),
            "qwen-image-tiny" => QwenConfig::qwen_image_tiny(),
            m => return Err(format!("{m}: not a model this measures")),
        };
        let inputs = mold_exec::model::qwen::random_inputs(&cfg, w, h, txt, 1, seed)
            .map_err(|e| e.to_string())?;
        fp8_block_errors(
            &cfg,
            &ckpt,
            &inputs,
            &dev,
            dtype,
            Kernels::Auto,
            fp8_attention,
        )
    } else {
        let cfg = mold_exec::FluxConfig::by_name(model)
            .ok_or_else(|| format!("{model}: not a model this measures"))?;
        let inputs =
            mold_exec::random_inputs(&cfg, w, h, txt, 1, seed).map_err(|e| e.to_string())?;
        fp8_block_errors(
            &cfg,
            &ckpt,
            &inputs,
            &dev,
            dtype,
            Kernels::Auto,
            fp8_attention,
        )
    }
    .map_err(|e| e.to_string())?;
    println!(
        "# {model} {w}x{h}, {txt} text tokens, seed {seed}, {dtype:?} activations, {:.1} s",
        t.elapsed().as_secs_f64()
    );
    println!("# block own carried");
    for b in &e.blocks {
        println!(
            "{} {} {:.3e} {:.3e}",
            b.block.kind, b.block.index, b.own, b.carried
        );
    }
    println!("output {:.3e}", e.output);
    let a = mold_exec::attention_report();
    println!(
        "# attention {:?}; cuDNN not used: {:?}",
        a.calls, a.cudnn_refusals
    );
    Ok(())
}
