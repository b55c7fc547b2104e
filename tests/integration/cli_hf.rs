//! Weights as users have them: `mold testdata flux-tiny-hf` (the Hugging Face repository
//! layout) → `mold plan --model DIR` → `mold exec --prompt` with `--save-io`, `--latents`
//! and `--lora`, the hub cache found without `--weights`, and the refusals.

use crate::util::*;
use std::path::Path;

fn ok(args: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let o = mold_env(args, env);
    assert!(
        o.status.success(),
        "mold {args:?} failed:\n{}\n{}",
        stdout(&o),
        stderr(&o)
    );
    (stdout(&o), stderr(&o))
}

fn refused(args: &[&str], env: &[(&str, &str)]) -> String {
    let o = mold_env(args, env);
    assert!(!o.status.success(), "mold {args:?} succeeded");
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "{e}");
    e
}

/// The image digest a text-to-image run reports.
fn image_digest(stderr: &str) -> String {
    let i = stderr.find("image digest ").expect(stderr) + "image digest ".len();
    stderr[i..i + 16].to_string()
}

fn exec(plan: &Path, extra: &[&str], env: &[(&str, &str)]) -> (String, String) {
    let mut args = vec![
        "exec",
        plan.to_str().unwrap(),
        "--prompt",
        "a red fox in snow",
        "--steps",
        "2",
    ];
    if !extra.contains(&"--seed") {
        args.extend(["--seed", "3"]);
    }
    // Beside the plan, in the test's directory: mold's default `out.png` is in the
    // working directory, the repository.
    let out = plan.with_file_name("out.png");
    if !extra.contains(&"--out") {
        args.extend(["--out", out.to_str().unwrap()]);
    }
    args.extend(extra);
    ok(&args, env)
}

#[test]
fn hugging_face_snapshots_run_from_the_cache_with_io_and_loras() {
    let d = tempdir("hf");
    let snap = d.join("hub/models--black-forest-labs--FLUX.1-dev/snapshots/rev1");
    let s = snap.to_str().unwrap();
    ok(&["testdata", "flux-tiny-hf", s], &[]);
    // Sizes from the snapshot's headers, with the layout's own transformer.
    let plan = d.join("p.yaml");
    let (so, _) = ok(
        &[
            "plan",
            "--model",
            s,
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "--tp",
            "2",
            "-o",
            plan.to_str().unwrap(),
        ],
        &[],
    );
    assert!(so.contains("flux-tiny"), "{so}");

    let io = d.join("io.safetensors");
    let out = d.join("a.png");
    let (_, se) = exec(
        &plan,
        &[
            "--weights",
            s,
            "--out",
            out.to_str().unwrap(),
            "--save-io",
            io.to_str().unwrap(),
        ],
        &[],
    );
    let first = image_digest(&se);
    let h = mold_models::checkpoint::read_header(&io).unwrap();
    for name in [
        "t5",
        "clip",
        "latents",
        "step.0.latents",
        "step.1.velocity",
        "final",
        "image",
    ] {
        assert!(
            h.tensors.contains_key(name),
            "{name} not in {:?}",
            h.tensors.keys()
        );
    }
    // The saved noise fed back with another seed: the same image.
    let (_, se) = exec(
        &plan,
        &[
            "--weights",
            s,
            "--seed",
            "99",
            "--latents",
            io.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(image_digest(&se), first);
    // Without --weights: found in the hub cache HF_HUB_CACHE names (here for flux-tiny
    // under the model's own folder name, as a weights_dirs entry would hold it).
    std::fs::create_dir_all(d.join("w")).unwrap();
    std::os::unix::fs::symlink(&snap, d.join("w/flux-tiny")).unwrap();
    let (_, se) = exec(
        &plan,
        &["--out", out.to_str().unwrap()],
        &[
            ("MOLD_WEIGHTS_DIRS", d.join("w").to_str().unwrap()),
            ("HF_HUB_CACHE", d.join("empty").to_str().unwrap()),
        ],
    );
    assert!(se.contains("no --weights: using"), "{se}");
    assert_eq!(image_digest(&se), first);
    let e = refused(
        &["exec", plan.to_str().unwrap(), "--prompt", "a fox"],
        &[("HF_HUB_CACHE", d.join("empty").to_str().unwrap())],
    );
    assert!(
        e.contains("no --weights, and no weights for flux-tiny in") && e.contains("empty"),
        "{e}"
    );

    // A LoRA (kohya names) changes the image; strength 0 does not.
    let lora = d.join("lora.safetensors");
    let h = 64;
    mold_exec::write_safetensors(
        &lora,
        &[
            mold_exec::TensorSpec {
                name: "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight".into(),
                shape: vec![2, h],
            },
            mold_exec::TensorSpec {
                name: "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight".into(),
                shape: vec![3 * h, 2],
            },
        ],
        5,
        mold_exec::DType::F32,
    )
    .unwrap();
    let l = lora.to_str().unwrap();
    let with = format!("{l}:0.7");
    let (_, se) = exec(&plan, &["--weights", s, "--lora", &with], &[]);
    assert!(se.contains("strength 0.7"), "{se}");
    assert_ne!(image_digest(&se), first);
    let zero = format!("{l}:0");
    let (_, se) = exec(&plan, &["--weights", s, "--lora", &zero], &[]);
    assert_eq!(image_digest(&se), first);

    // Refusals, one line each, before anything loads.
    let e = refused(
        &[
            "exec",
            plan.to_str().unwrap(),
            "--weights",
            s,
            "--latents",
            io.to_str().unwrap(),
        ],
        &[],
    );
    assert!(e.contains("--latents is for text to image"), "{e}");
    let e = refused(
        &[
            "exec",
            plan.to_str().unwrap(),
            "--weights",
            s,
            "--prompt",
            "a fox",
            "--width",
            "128",
            "--latents",
            io.to_str().unwrap(),
        ],
        &[],
    );
    assert!(e.contains("tensor `latents` has shape [1, 16, 64]"), "{e}");
    let e = refused(
        &[
            "exec",
            plan.to_str().unwrap(),
            "--weights",
            s,
            "--lora",
            io.to_str().unwrap(),
        ],
        &[],
    );
    assert!(e.contains("LoRA") && e.contains("tensor `clip`"), "{e}");
    // Without BFL's file the diffusers-format transformer/ gives the same image.
    std::fs::remove_file(snap.join("flux1-dev.safetensors")).unwrap();
    let (_, se) = exec(&plan, &["--weights", s], &[]);
    assert_eq!(image_digest(&se), first);
}
