//! Qwen-Image text to image end to end: `mold testdata qwen-image-tiny-pipeline` →
//! `mold plan` → `mold exec --prompt --negative-prompt --cfg` (1 device, a split and
//! tensor parallel), the PNG deterministic, and the refusals.

use crate::util::*;
use std::path::{Path, PathBuf};

fn plan(d: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let p = d.join(format!("{name}.yaml"));
    let mut args = vec![
        "plan",
        "--model",
        "qwen-image-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "-o",
        p.to_str().unwrap(),
    ];
    args.extend(extra);
    mold_ok(&args);
    p
}

/// Runs the pipeline; returns the PNG's bytes, stdout and stderr.
fn generate(plan: &Path, w: &Path, out: &Path, extra: &[&str]) -> (Vec<u8>, String, String) {
    let mut args = vec![
        "exec",
        plan.to_str().unwrap(),
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a red fox in the snow",
        "--seed",
        "7",
        "--steps",
        "3",
        "--out",
        out.to_str().unwrap(),
    ];
    // The settings under test, unless `extra` gives its own.
    for (flag, v) in [("--negative-prompt", "blurry"), ("--cfg", "4.0")] {
        if !extra.contains(&flag) {
            args.extend([flag, v]);
        }
    }
    args.extend(extra);
    let (so, se) = mold_ok(&args);
    (std::fs::read(out).unwrap(), so, se)
}

/// The latents after the last step, from a `--save-io` file.
fn final_latents(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = header["final"]["data_offsets"].as_array().unwrap();
    let (a, b) = (
        off[0].as_u64().unwrap() as usize,
        off[1].as_u64().unwrap() as usize,
    );
    bytes[8 + n + a..8 + n + b]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0f32, f32::max)
}

#[test]
fn qwen_tiny_pipeline_writes_a_deterministic_png() {
    let d = tempdir("qwen-pipeline");
    let w = d.join("w");
    let (out, _) = mold_ok(&["testdata", "qwen-image-tiny-pipeline", w.to_str().unwrap()]);
    for f in [
        "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/model.safetensors.index.json",
        "text_encoder/config.json",
        "tokenizer/vocab.json",
        "tokenizer/merges.txt",
        "tokenizer/tokenizer_config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "vae/config.json",
        "scheduler/scheduler_config.json",
        "model_index.json",
    ] {
        assert!(out.contains(f), "{f}: {out}");
        assert!(w.join(f).is_file(), "{f}");
    }

    // The reference: one device, the two CFG passes one after the other (the planner's
    // default here would run them CFG-parallel on two replicas).
    let one = plan(&d, "one", &["--tp", "off", "--cfg", "serial"]);
    let tp2 = plan(&d, "tp2", &["--tp", "2", "--cfg", "serial"]);
    tensor_parallel_on_two(&tp2);
    let cap: Vec<String> = (0..4).map(|i| format!("emu:{i}=65MiB")).collect();
    let mut split_args = vec!["--tp", "off"];
    for c in &cap {
        split_args.extend(["--max-vram", c.as_str()]);
    }
    let mut serial_split = split_args.clone();
    serial_split.extend(["--cfg", "serial"]);
    let split = plan(&d, "split", &serial_split);
    let sp = mold_plan::Plan::load(&split).unwrap();
    assert!(sp.transformer().unwrap().parts.len() > 1, "{sp:?}");
    // The same split with the two passes as micro-batches through its stages.
    split_args.extend(["--cfg", "pipelined"]);
    let pipelined = plan(&d, "pipelined", &split_args);
    assert_eq!(
        mold_plan::Plan::load(&pipelined).unwrap().cfg_mode(),
        Some(mold_plan::CfgMode::Pipelined)
    );

    let io_one = d.join("one.safetensors");
    let (a, so, se) = generate(
        &one,
        &w,
        &d.join("one.png"),
        &["--save-io", io_one.to_str().unwrap()],
    );
    for s in [
        "load   qwen2.5-vl on",
        "encode qwen2.5-vl:",
        "encode qwen2.5-vl (negative)",
        "free   qwen2.5-vl",
        "step     1/3",
        "step     3/3",
        "decode vae",
    ] {
        assert!(se.contains(s), "{s}: {se}");
    }
    assert!(so.contains("wrote") && so.contains("64x64"), "{so}");

    // The same plan and seed: byte-identical PNGs.
    let (a2, _, _) = generate(&one, &w, &d.join("again.png"), &[]);
    assert!(a == a2, "two runs of the same plan and seed differ");

    // The settings are in the PNG, and the image is not blank.
    let (img, meta) = mold_pipeline::read_png(&d.join("one.png")).unwrap();
    assert_eq!((img.width, img.height), (64, 64));
    assert!(img.data.iter().any(|&v| v != img.data[0]));
    let get = |k: &str| {
        meta.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {k} in {meta:?}"))
    };
    assert_eq!(get("negative_prompt"), "blurry");
    assert_eq!(get("true_cfg_scale"), "4");
    assert_eq!(get("model"), "qwen-image-tiny");

    // Tensor parallel, a block split and pipelined CFG: the 1-device latents within f32
    // rounding.
    let want = final_latents(&io_one);
    for (name, p) in [("tp2", &tp2), ("split", &split), ("pipelined", &pipelined)] {
        let io = d.join(format!("{name}.safetensors"));
        generate(
            p,
            &w,
            &d.join(format!("{name}.png")),
            &["--save-io", io.to_str().unwrap()],
        );
        let err = max_rel(&want, &final_latents(&io));
        assert!(err <= 1e-5, "{name}: max relative error {err}");
    }

    // CFG-parallel: the unconditional pass on a second replica's devices, at the same
    // time; the latents of the plan's first replica run serially.
    let thr = plan(&d, "thr", &["--objective", "throughput", "--clients", "2"]);
    let io_serial = d.join("thr-serial.safetensors");
    let io_par = d.join("thr-par.safetensors");
    generate(
        &thr,
        &w,
        &d.join("thr.png"),
        &["--save-io", io_serial.to_str().unwrap()],
    );
    let (_, _, se) = generate(
        &thr,
        &w,
        &d.join("thr-par.png"),
        &["--cfg-parallel", "--save-io", io_par.to_str().unwrap()],
    );
    assert!(se.contains("load   transformer (unconditional) on"), "{se}");
    let err = max_rel(&final_latents(&io_serial), &final_latents(&io_par));
    assert!(err <= 1e-6, "CFG-parallel: max relative error {err}");
    let e = mold_fails(&[
        "exec",
        one.to_str().unwrap(),
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a fox",
        "--cfg-parallel",
        "--out",
        d.join("refused.png").to_str().unwrap(),
    ]);
    assert!(
        e.contains("--cfg-parallel") && e.contains("--objective throughput"),
        "{e}"
    );

    // The negative prompt and the scale matter; --cfg 1 is one pass a step.
    let (b, _, _) = generate(
        &one,
        &w,
        &d.join("neg.png"),
        &["--negative-prompt", "sharp"],
    );
    assert!(a != b, "another negative prompt, the same image");
    let (c, _, se) = generate(&one, &w, &d.join("nocfg.png"), &["--cfg", "1"]);
    assert!(a != c && !se.contains("(negative)"), "{se}");
}

/// A bf16 VAE planned on emulated devices decodes (in f32 on the host: candle's CPU
/// products have no bf16) instead of failing after the denoising, and says which decoder
/// ran and why not the channels-last one.
#[test]
fn a_bf16_vae_on_the_host_decodes() {
    let d = tempdir("qwen-bf16-vae");
    let w = d.join("w");
    mold_ok(&["testdata", "qwen-image-tiny-pipeline", w.to_str().unwrap()]);
    let p = plan(&d, "bf16vae", &["--tp", "off", "--dtype", "vae=bf16"]);
    let text = std::fs::read_to_string(&p).unwrap();
    assert!(text.contains("dtype: bf16"), "{text}");
    let (png, so, se) = generate(&p, &w, &d.join("bf16vae.png"), &["--cfg", "1"]);
    assert!(so.contains("wrote") && !png.is_empty(), "{so}");
    assert!(
        se.contains(
            "vae: candle's channels-first decoder (channels-last not used: not a CUDA device)"
        ),
        "{se}"
    );
}

#[test]
fn qwen_pipeline_refusals_name_the_problem() {
    let d = tempdir("qwen-pipeline-refuse");
    let w = d.join("w");
    let ws = w.to_str().unwrap();
    mold_ok(&["testdata", "qwen-image-tiny-pipeline", ws]);
    let p = plan(&d, "p", &[]);
    let ps = p.to_str().unwrap();
    // An --out of its own: a refusal that regressed must not write the working directory.
    let out = d.join("refused.png");
    let base = [
        "exec",
        ps,
        "--weights",
        ws,
        "--prompt",
        "a fox",
        "--out",
        out.to_str().unwrap(),
    ];
    let fails = |extra: &[&str]| {
        let mut args = base.to_vec();
        args.extend(extra);
        let e = mold_fails(&args);
        assert_eq!(e.trim().lines().count(), 1, "{e}");
        e
    };
    let e = fails(&["--cfg", "0.5"]);
    assert!(e.contains("--cfg 0.5") && e.contains(">= 1"), "{e}");
    let e = fails(&["--guidance", "3.5"]);
    assert!(e.contains("--guidance") && e.contains("--cfg"), "{e}");

    // A CFG-parallel plan's two replicas are one request's passes: mold serve, which
    // serves each replica apart, refuses it before anything loads.
    let par = plan(&d, "par", &["--cfg", "parallel"]);
    let e = mold_fails(&["serve", "--plan", par.to_str().unwrap(), "--weights", ws]);
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    assert!(
        e.contains("par.yaml") && e.contains("cfg.mode is parallel") && e.contains("--cfg serial"),
        "{e}"
    );

    // Without --prompt, the pipeline's flags are refused.
    let e = mold_fails(&["exec", ps, "--weights", ws, "--negative-prompt", "x"]);
    assert!(e.contains("--negative-prompt is for text to image"), "{e}");

    // A directory missing the VAE and the tokenizer: every missing file in one line,
    // before anything loads.
    std::fs::remove_dir_all(w.join("vae")).unwrap();
    std::fs::remove_file(w.join("tokenizer/merges.txt")).unwrap();
    let e = fails(&[]);
    assert!(
        e.contains("vae/config.json")
            && e.contains("vae/diffusion_pytorch_model.safetensors")
            && e.contains("tokenizer/merges.txt")
            && e.contains("qwen-image-tiny-pipeline"),
        "{e}"
    );
}
