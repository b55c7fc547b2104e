//! Text to image end to end: `mold testdata flux-tiny-pipeline` → `mold plan` →
//! `mold exec --prompt` on emulated devices, and the pipeline's refusals.

use crate::util::*;
use std::path::{Path, PathBuf};

/// `mold plan --model flux-tiny --machine cpu-emu-4` with `extra`, written to `d/name.yaml`.
fn plan(d: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let p = d.join(format!("{name}.yaml"));
    let mut args = vec![
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "-o",
        p.to_str().unwrap(),
    ];
    args.extend(extra);
    mold_ok(&args);
    p
}

/// Runs the pipeline (seed 42 unless `extra` gives one); returns the PNG's bytes and the
/// command's stdout and stderr.
fn generate(plan: &Path, w: &Path, out: &Path, extra: &[&str]) -> (Vec<u8>, String, String) {
    let seed = if extra.contains(&"--seed") {
        vec![]
    } else {
        vec!["--seed", "42"]
    };
    let mut args = vec![
        "exec",
        plan.to_str().unwrap(),
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a red fox in snow",
        "--steps",
        "3",
        "--guidance",
        "3.5",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend(seed);
    args.extend(extra);
    let (so, se) = mold_ok(&args);
    (std::fs::read(out).unwrap(), so, se)
}

/// Two PNGs of the same size compared value by value: (values that differ, the largest
/// difference, values in all).
fn pixel_diff(a: &Path, b: &Path) -> (usize, u8, usize) {
    let (ia, _) = mold_pipeline::read_png(a).unwrap();
    let (ib, _) = mold_pipeline::read_png(b).unwrap();
    assert_eq!((ia.width, ia.height), (ib.width, ib.height));
    let diff: Vec<u8> = ia
        .data
        .iter()
        .zip(&ib.data)
        .map(|(x, y)| x.abs_diff(*y))
        .collect();
    let n = diff.iter().filter(|&&x| x > 0).count();
    (n, diff.iter().copied().max().unwrap_or(0), diff.len())
}

#[test]
fn text_to_image_is_deterministic_and_placement_independent() {
    let d = tempdir("pipeline-e2e");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);

    let one = plan(&d, "one", &["--tp", "off"]);
    // Budgets of 65 MiB (64 MiB headroom) force the planner to split the transformer over
    // the four devices and put the VAE on the host.
    let cap: Vec<String> = (0..4).map(|i| format!("emu:{i}=65MiB")).collect();
    let mut split_args = vec!["--tp", "off"];
    for c in &cap {
        split_args.extend(["--max-vram", c.as_str()]);
    }
    let split = plan(&d, "split", &split_args);
    let tp2 = plan(&d, "tp2", &["--tp", "2"]);
    let sp = mold_plan::Plan::load(&split).unwrap();
    assert!(sp.transformer().unwrap().parts.len() > 1, "{sp:?}");
    let tp = mold_plan::Plan::load(&tp2).unwrap();
    assert!(
        tp.transformer()
            .unwrap()
            .parts
            .iter()
            .any(|p| p.devices.len() == 2),
        "{tp:?}"
    );

    let (a, so, se) = generate(&one, &w, &d.join("one.png"), &[]);
    // Progress for every stage on stderr, a summary line beside the plan on stdout.
    for s in [
        "load   t5 on emu:0",
        "encode t5",
        "encode clip",
        "free   t5",
        "step     1/3",
        "step     3/3",
        "decode vae",
    ] {
        assert!(se.contains(s), "{s}: {se}");
    }
    assert!(so.contains("wrote") && so.contains("64x64"), "{so}");
    assert!(
        so.contains("done in")
            && so.contains("median step")
            && so.contains("(plan ")
            && so.contains("peak memory")
            && so.contains("emu:0"),
        "{so}"
    );

    // The same plan and seed: byte-identical PNGs.
    let (a2, _, _) = generate(&one, &w, &d.join("one-again.png"), &[]);
    assert!(a == a2, "two runs of the same plan and seed differ");

    // Split over four devices with the VAE on the host: the very same image.
    let (b, _, se) = generate(&split, &w, &d.join("split.png"), &[]);
    assert!(se.contains("vae on host"), "{se}");
    assert!(
        a == b,
        "the split plan's image differs from the 1-device plan's"
    );

    // Tensor parallel: the same image. Row-parallel layers sum partial products in
    // another order than one device does, so the f32 latents differ by ~1e-7; a pixel
    // lying on a rounding boundary may flip by one level (none does here today, on
    // x86-64); allow that, and nothing more.
    let (c, _, _) = generate(&tp2, &w, &d.join("tp2.png"), &[]);
    let (ia, meta) = mold_pipeline::read_png(&d.join("one.png")).unwrap();
    let (n, max, len) = pixel_diff(&d.join("one.png"), &d.join("tp2.png"));
    assert!(
        max <= 1 && n * 1000 <= len,
        "tensor parallel changes {n} of {len} values (max {max})"
    );
    if n == 0 {
        assert!(a == c, "same pixels, same metadata: the files must match");
    }

    // The image is not blank, and the settings are in the PNG.
    assert!(ia.data.iter().any(|&v| v != ia.data[0]));
    let get = |k: &str| {
        meta.iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {k} in {meta:?}"))
    };
    assert_eq!(get("prompt"), "a red fox in snow");
    assert_eq!(get("seed"), "42");
    assert_eq!(get("steps"), "3");
    assert_eq!(get("guidance"), "3.5");
    assert_eq!(get("model"), "flux-tiny");

    // Another seed, or another prompt: another image.
    let (e, _, _) = generate(&one, &w, &d.join("seed.png"), &["--seed", "7"]);
    assert!(e != a);
    let o = mold_ok(&[
        "exec",
        one.to_str().unwrap(),
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a blue cat",
        "--seed",
        "42",
        "--steps",
        "3",
        "--out",
        d.join("cat.png").to_str().unwrap(),
    ]);
    assert!(o.0.contains("wrote"));
    let (icat, _) = mold_pipeline::read_png(&d.join("cat.png")).unwrap();
    assert!(icat.data != ia.data);

    // Another size: re-checked by the simulator, then made.
    let (_, so, se) = generate(
        &one,
        &w,
        &d.join("wide.png"),
        &["--width", "96", "--height", "48"],
    );
    assert!(se.contains("simulator re-checked"), "{se}");
    assert!(so.contains("96x48") && so.contains("(sim "), "{so}");
    let (iw, _) = mold_pipeline::read_png(&d.join("wide.png")).unwrap();
    assert_eq!((iw.width, iw.height), (96, 48));
}

/// `--vae-bands 4`: the VAE decodes in four row bands, one on each emulated device (the
/// plan says so), and the image is the one-device decode's: the bands run the channels-last
/// decoder (candle's convolutions here) where one device runs candle-transformers', equal in
/// f32 to ~1e-6, so a pixel on a rounding boundary may move one level and no more.
#[test]
fn a_vae_decoded_in_row_bands_makes_the_same_image() {
    let d = tempdir("pipeline-bands");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);
    let one = plan(&d, "one", &["--tp", "off", "--vae-bands", "off"]);
    let four = plan(&d, "four", &["--tp", "off", "--vae-bands", "4"]);
    let p = mold_plan::Plan::load(&four).unwrap();
    let vae = p.components.iter().find(|c| c.name == "vae").unwrap();
    assert_eq!(
        (vae.parts[0].devices.len(), vae.parts[0].sp),
        (4, 4),
        "{vae:?}"
    );
    let text = std::fs::read_to_string(&four).unwrap();
    assert!(text.contains("sp: 4"), "{text}");
    generate(&one, &w, &d.join("one.png"), &[]);
    let (_, _, se) = generate(&four, &w, &d.join("four.png"), &[]);
    assert!(se.contains("vae on emu:0,emu:1,emu:2,emu:3"), "{se}");
    let (n, max, len) = pixel_diff(&d.join("one.png"), &d.join("four.png"));
    assert!(
        max <= 1 && n * 100 <= len,
        "the banded decode changes {n} of {len} values (max {max})"
    );
    // More bands than the machine has GPUs: refused naming the flag, before any weight loads.
    let e = mold_fails(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--vae-bands",
        "5",
    ]);
    assert!(
        e.contains("--vae-bands 5") && e.contains("at most 4"),
        "{e}"
    );
    let e = mold_fails(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--vae-bands",
        "x",
    ]);
    assert!(e.contains("--vae-bands"), "{e}");
}

#[test]
fn pipeline_refusals_name_the_problem() {
    let d = tempdir("pipeline-refuse");
    let w = d.join("w");
    let ws = w.to_str().unwrap();
    mold_ok(&["testdata", "flux-tiny-pipeline", ws]);
    let p = plan(&d, "p", &["--tp", "2"]);
    let ps = p.to_str().unwrap();

    // A size FLUX cannot make: refused with the nearest valid sizes, before anything
    // else (the weights path does not even exist).
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        "/nonexistent/weights",
        "--prompt",
        "x",
        "--width",
        "1000",
        "--height",
        "64",
    ]);
    assert!(
        e.contains("1000") && e.contains("992 or 1008") && e.contains("1008x64"),
        "{e}"
    );

    // Missing files: every one is named, relative to the directory.
    let broken = d.join("broken");
    mold_ok(&["testdata", "flux-tiny-pipeline", broken.to_str().unwrap()]);
    std::fs::remove_file(broken.join("clip/tokenizer.json")).unwrap();
    std::fs::remove_file(broken.join("ae.safetensors")).unwrap();
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        broken.to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(
        e.contains("clip/tokenizer.json") && e.contains("ae.safetensors") && e.contains("README"),
        "{e}"
    );
    assert!(!e.contains("t5/"), "only what is missing: {e}");

    // A T5 of the wrong width for the transformer.
    let bad = d.join("bad");
    mold_ok(&["testdata", "flux-tiny-pipeline", bad.to_str().unwrap()]);
    let cfg = bad.join("t5/config.json");
    let text = read(&cfg).replace("\"d_model\": 32", "\"d_model\": 48");
    std::fs::write(&cfg, text).unwrap();
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        bad.to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    assert!(
        e.contains("t5/config.json") && e.contains("48") && e.contains("context_in_dim"),
        "{e}"
    );

    // Another size that does not fit the machine: the simulator refuses it first.
    let small = d.join("cpu-emu-4.yaml");
    let profile =
        read(&root().join("sim/machines/cpu-emu-4.yaml")).replace("budget: 4GiB", "budget: 70MiB");
    std::fs::write(&small, profile).unwrap();
    let e = mold_fails(&[
        "exec",
        ps,
        "--weights",
        ws,
        "--prompt",
        "x",
        "--machine",
        small.to_str().unwrap(),
        "--width",
        "1024",
        "--height",
        "1024",
    ]);
    assert!(
        e.contains("cannot fit at 1024x1024") && e.contains("64x64"),
        "{e}"
    );

    // Pipeline flags without --prompt, and --verify with it.
    let e = mold_fails(&["exec", ps, "--weights", ws, "--width", "64"]);
    assert!(e.contains("--width") && e.contains("--prompt"), "{e}");
    let e = mold_fails(&["exec", ps, "--weights", ws, "--prompt", "x", "--verify"]);
    assert!(e.contains("--verify"), "{e}");
}
