//! Times Qwen-Image's text encoder (Qwen2.5-VL-7B's language model) as `QwenText` runs it:
//! on mold's layers (`QwenLm`) and as the candle reference (`CandleLm`, what ran before),
//! on random weights of the published size (benches/encoders/qwen runs this beside
//! benches/encoders/torch_qwen_text.py, transformers' model of the same size, in one call).
//!
//! qwen_text_bench [--tokens 64,256,1058] [--iters N] [--layers N] [--dtype bf16|f16]
//!                 [--plans DIR] [--tiny] [--parts] [--check TOL]
//!
//! For each token count: the first run of the process at that length (plans built), the
//! median of `N` warm runs, for mold's layers and the reference; and both outputs against
//! the reference in f32 on the same weights and tokens (relative error, L2:
//! `‖a − b‖ / ‖b‖`). One JSON line each; then which attention ran. `--plans DIR` keeps
//! cuDNN's plans there (as `mold` keeps them in its cache directory): a second process
//! reads them back. `--tiny`: a tiny model on the CPU in f32 (the harness's own check).
//! `--parts` (a GPU): also one layer's pieces timed alone at each (padded) length — the products,
//! the causal attention with its mask as a bias, the same attention unmasked (cuDNN's
//! fused SDPA), the element-wise passes (mold's kernels and candle's ops, with their
//! difference) — on random inputs. `--check TOL`: exit 1 where mold's output is further
//! than `TOL` from the f32 reference, or (with `--parts`) a kernel further than 1e-2 from
//! candle's ops (`scripts/gpu-suite` runs it so when the binary is carried).

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use mold_exec::Kernels;
use mold_pipeline::qwen::lm::{QwenLm, PAD_TOKENS};
use mold_pipeline::qwen::testdata::TextSize;
use mold_pipeline::qwen::text::CandleLm;
use std::collections::HashMap;
use std::time::Instant;

struct Args {
    tokens: Vec<usize>,
    iters: usize,
    layers: usize,
    dtype: DType,
    tiny: bool,
    plans: Option<std::path::PathBuf>,
    parts: bool,
    check: Option<f64>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        tokens: vec![64, 256, 1058],
        iters: 20,
        layers: TextSize::QWEN25_VL_7B.layers,
        dtype: DType::BF16,
        tiny: false,
        plans: None,
        parts: false,
        check: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        match k.as_str() {
            "--tokens" => {
                a.tokens = val()?
                    .split(',')
                    .map(|t| t.trim().parse().map_err(|e| format!("--tokens {t}: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--layers" => a.layers = val()?.parse().map_err(|e| format!("--layers: {e}"))?,
            "--dtype" => {
                a.dtype = match val()?.as_str() {
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    d => return Err(format!("--dtype {d}: expected bf16 or f16")),
                }
            }
            "--tiny" => a.tiny = true,
            "--parts" => a.parts = true,
            "--check" => a.check = Some(val()?.parse().map_err(|e| format!("--check: {e}"))?),
            "--plans" => a.plans = Some(val()?.into()),
            _ => return Err(format!("unknown argument {k} (see the file's header)")),
        }
    }
    if a.tiny && a.parts {
        return Err("--parts times cuDNN's and mold's kernels: a GPU, not --tiny".into());
    }
    if a.tokens.is_empty() || a.tokens.contains(&0) || a.layers == 0 {
        return Err("--tokens needs positive counts and --layers a positive number".into());
    }
    Ok(a)
}

/// `‖a − b‖ / ‖b‖`, in f32.
fn rel(a: &Tensor, b: &Tensor) -> candle_core::Result<f64> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let d = (&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let n = b.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok((d / n).sqrt())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse()?;
    if let Some(dir) = &args.plans {
        mold_exec::model::plan_cache::install(mold_exec::model::plan_cache::PlanSettings {
            dir: Some(dir.clone()),
        });
    }
    let (dev, base) = if args.tiny {
        (Device::Cpu, TextSize::tiny(64))
    } else {
        (Device::new_cuda(0)?, TextSize::QWEN25_VL_7B)
    };
    let dtype = if args.tiny { DType::F32 } else { args.dtype };
    let size = TextSize {
        layers: if args.tiny { base.layers } else { args.layers },
        ..base
    };
    let cfg = size.text_config();
    // Random weights (as transformers initialises: normal, std 0.02; norms at 1 plus a
    // little noise, so that each channel differs), f32 on the GPU.
    let mut f32s: HashMap<String, Tensor> = HashMap::new();
    for spec in size.tensor_specs() {
        let Some(name) = spec.name.strip_prefix("model.") else {
            continue; // lm_head
        };
        let t = if name.ends_with("norm.weight") {
            (Tensor::randn(0f32, 0.1, spec.shape.as_slice(), &dev)? + 1.0)?
        } else {
            Tensor::randn(0f32, 0.02, spec.shape.as_slice(), &dev)?
        };
        f32s.insert(name.to_string(), t);
    }
    let low: HashMap<String, Tensor> = f32s
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?)))
        .collect::<candle_core::Result<_>>()?;
    let reference32 = CandleLm::new(VarBuilder::from_tensors(f32s, DType::F32, &dev), &cfg)?;
    let vb = VarBuilder::from_tensors(low, dtype, &dev);
    let t = Instant::now();
    let mold = QwenLm::new(vb.clone(), &cfg, Kernels::Auto)?;
    dev.synchronize()?;
    let load_s = t.elapsed().as_secs_f64();
    let candle = CandleLm::new(vb, &cfg)?;
    println!(
        "{}",
        serde_json::json!({"layers": size.layers, "dtype": format!("{dtype:?}"),
            "mold_build_s": load_s})
    );
    let mut failed: Vec<String> = Vec::new();
    for &n in &args.tokens {
        let ids: Vec<u32> = (0..n as u32)
            .map(|i| (i * 7919 + 13) % size.vocab as u32)
            .collect();
        let want = reference32.forward(&ids)?;
        let mut row = serde_json::Map::new();
        row.insert("tokens".into(), n.into());
        for (name, run) in [
            (
                "mold",
                &(|| mold.forward(&ids)) as &dyn Fn() -> candle_core::Result<Tensor>,
            ),
            ("candle", &|| {
                candle.forward(&ids).map_err(candle_core::Error::wrap)
            }),
        ] {
            dev.synchronize()?;
            let t = Instant::now();
            let out = run()?;
            dev.synchronize()?;
            let first = t.elapsed().as_secs_f64();
            let warm = mold_exec::calibrate::median_time(&dev, 2, args.iters, run)?;
            row.insert(format!("{name}_first_ms"), (first * 1e3).into());
            row.insert(format!("{name}_ms"), (warm * 1e3).into());
            row.insert(format!("{name}_vs_f32"), rel(&out, &want)?.into());
        }
        if let Some(tol) = args.check {
            let e = row["mold_vs_f32"].as_f64().unwrap_or(f64::INFINITY);
            if e.is_nan() || e > tol {
                failed.push(format!(
                    "{n} tokens: mold against f32 {e:.3e} (tolerance {tol:.1e})"
                ));
            }
        }
        println!("{}", serde_json::Value::Object(row));
        if args.parts {
            let n_run = n.div_ceil(PAD_TOKENS) * PAD_TOKENS;
            let p = parts(&size, n_run, dtype, &dev, args.iters)?;
            if args.check.is_some() {
                for (k, v) in p.iter().filter(|(k, _)| k.ends_with("_vs_candle")) {
                    let e = v.as_f64().unwrap_or(f64::INFINITY);
                    if e.is_nan() || e > 1e-2 {
                        failed.push(format!("{n} tokens: {k} {e:.3e} (tolerance 1e-2)"));
                    }
                }
            }
        }
    }
    let r = mold_exec::model::attention::report();
    println!(
        "{}",
        serde_json::json!({"attention": r.calls, "cudnn_refusals": r.cudnn_refusals})
    );
    if !failed.is_empty() {
        eprintln!("check failed: {}", failed.join("; "));
        std::process::exit(1);
    }
    Ok(())
}

/// One layer's pieces at `n` tokens, each timed alone (median of `iters`), one JSON line;
/// the line's fields returned.
fn parts(
    size: &TextSize,
    n: usize,
    dtype: DType,
    dev: &Device,
    iters: usize,
) -> candle_core::Result<serde_json::Map<String, serde_json::Value>> {
    use mold_exec::model::{attention, gemm, ops};
    let (h, heads, kvh) = (size.hidden, size.heads, size.kv_heads);
    let d = h / heads;
    let (kv, m) = (kvh * d, size.intermediate);
    let r = |shape: &[usize]| Tensor::randn(0f32, 0.02, shape, dev)?.to_dtype(dtype);
    let x = (r(&[n, h])? * 50.0)?;
    let (wqkv, bqkv, wo, wgu, wdown) = (
        r(&[h + 2 * kv, h])?,
        r(&[h + 2 * kv])?,
        r(&[h, h])?,
        r(&[2 * m, h])?,
        r(&[h, m])?,
    );
    let qkv_lin = candle_nn::Linear::new(wqkv.clone(), None);
    let a = (r(&[n, m])? * 50.0)?;
    let gu = (r(&[n, 2 * m])? * 50.0)?;
    let ln = (r(&[h])? + 1.0)?;
    let q = (r(&[1, heads, n, d])? * 50.0)?;
    let k = (r(&[1, heads, n, d])? * 50.0)?;
    let v = (r(&[1, heads, n, d])? * 50.0)?;
    let row = n.div_ceil(8) * 8;
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| (0..row).map(move |j| if j > i { -3.0e38 } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (1, n, row), dev)?.to_dtype(dtype)?;
    let cos = Tensor::randn(0f32, 1.0, (n, d / 2), dev)?;
    let sin = Tensor::randn(0f32, 1.0, (n, d / 2), dev)?;
    let qkv = gemm::linear(&x, &qkv_lin, &bqkv, false, Kernels::Auto)?;
    let meter = mold_exec::model::ActivationMeter::default();
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = serde_json::Map::new();
    out.insert("parts_tokens".into(), n.into());
    let mut time = |name: &str, f: &mut dyn FnMut() -> candle_core::Result<Tensor>| {
        let s = mold_exec::calibrate::median_time(dev, 2, iters, f)?;
        out.insert(format!("{name}_ms"), (s * 1e3).into());
        Ok::<(), candle_core::Error>(())
    };
    time("qkv_product", &mut || {
        gemm::linear(&x, &qkv_lin, &bqkv, false, Kernels::Auto)
    })?;
    time("o_product", &mut || gemm::matmul(&x, &wo))?;
    time("gate_up_product", &mut || gemm::matmul(&x, &wgu))?;
    time("down_product", &mut || gemm::matmul(&a, &wdown))?;
    time("attention_causal_bias", &mut || {
        attention::biased_attention(Kernels::Auto, &q, &k, &v, &mask, scale)?
            .ok_or_else(|| candle_core::Error::Msg("cuDNN did not run it".into()))
    })?;
    time("attention_unmasked", &mut || {
        attention::attention_with(Kernels::Auto, &q, &k, &v, &meter)
    })?;
    let g = ops::GroupedHeads { heads, kv: kvh, d };
    time("qkv_prep_candle", &mut || {
        ops::qkv_rope_gqa(&qkv, g, &cos, &sin, Kernels::Candle)
    })?;
    time("qkv_prep_fused", &mut || {
        ops::qkv_rope_gqa(&qkv, g, &cos, &sin, Kernels::Auto)
    })?;
    time("silu_mul_candle", &mut || {
        candle_nn::ops::silu(&gu.narrow(1, 0, m)?)?.mul(&gu.narrow(1, m, m)?)
    })?;
    time("silu_mul_gated", &mut || {
        ops::gated(&gu, ops::Gate::Silu, Kernels::Auto)
    })?;
    time("rms_norm", &mut || candle_nn::ops::rms_norm(&x, &ln, 1e-6))?;
    // The gated kernel against candle's ops on the same input, both activations.
    for (name, g) in [("silu", ops::Gate::Silu), ("gelu", ops::Gate::GeluTanh)] {
        let fast = ops::gated(&gu, g, Kernels::Auto)?;
        let slow = ops::gated(&gu, g, Kernels::Candle)?;
        out.insert(format!("gated_{name}_vs_candle"), rel(&fast, &slow)?.into());
    }
    let fast = ops::qkv_rope_gqa(&qkv, g, &cos, &sin, Kernels::Auto)?;
    let slow = ops::qkv_rope_gqa(&qkv, g, &cos, &sin, Kernels::Candle)?;
    out.insert("qkv_prep_vs_candle".into(), rel(&fast, &slow)?.into());
    println!("{}", serde_json::Value::Object(out.clone()));
    Ok(out)
}
