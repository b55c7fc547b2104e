//! Qwen-Image's transformer end to end: `mold testdata qwen-image-tiny` → `mold plan` →
//! `mold exec --verify` (tensor and sequence parallel), `--save-io` for the parity
//! script, and the refusals.

use crate::util::*;

#[test]
fn qwen_tiny_testdata_plan_exec_verify() {
    let d = tempdir("qwen-e2e");
    let w = d.join("w");
    let w = w.to_str().unwrap();
    let (out, _) = mold_ok(&["testdata", "qwen-image-tiny", w, "--shard-size", "500KB"]);
    assert!(
        out.contains("diffusion_pytorch_model-00001-of-")
            && out.contains("diffusion_pytorch_model.safetensors.index.json"),
        "{out}"
    );
    // The benchmark runs a step's two CFG passes as the plan's CFG mode says (a split
    // for pipelined CFG: every device capped below the whole transformer).
    let cap: Vec<String> = (0..4).map(|i| format!("emu:{i}=65MiB")).collect();
    let mut pipelined = vec!["--tp", "off", "--cfg", "pipelined"];
    for c in &cap {
        pipelined.extend(["--max-vram", c.as_str()]);
    }
    for (name, extra) in [
        ("tp2", vec!["--tp", "2", "--cfg", "serial"]),
        ("sp2", vec!["--sp", "2", "--cfg", "serial"]),
        ("one", vec!["--tp", "off", "--cfg", "serial"]),
        ("parallel", vec!["--tp", "off", "--cfg", "parallel"]),
        ("pipelined", pipelined),
    ] {
        let p = d.join(format!("{name}.yaml"));
        let p = p.to_str().unwrap();
        let mut args = vec![
            "plan",
            "--model",
            "qwen-image-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "-o",
            p,
        ];
        args.extend(extra);
        mold_ok(&args);
        if name == "tp2" {
            tensor_parallel_on_two(std::path::Path::new(p));
        }
        let (s, _) = mold_ok(&["exec", p, "--weights", w, "--steps", "2", "--verify"]);
        assert!(s.contains("max relative error"), "{name}: {s}");
        // CFG-parallel: the second replica holds the unconditional pass's transformer.
        assert_eq!(
            s.contains("loaded transformer (unconditional)"),
            name == "parallel",
            "{name}: {s}"
        );
    }
    let tp2 = read(&d.join("tp2.yaml"));
    assert!(tp2.contains("tp: 2") && tp2.contains("block 0..3"), "{tp2}");

    // --save-io without --prompt: the benchmark's inputs under diffusers' argument names
    // and one call's output, for benches/parity/qwen_diffusers.py.
    let io = d.join("io.safetensors");
    let p = d.join("tp2.yaml");
    mold_ok(&[
        "exec",
        p.to_str().unwrap(),
        "--weights",
        w,
        "--steps",
        "1",
        "--save-io",
        io.to_str().unwrap(),
    ]);
    let bytes = std::fs::read(&io).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8_lossy(&bytes[8..8 + n]);
    for name in [
        "hidden_states",
        "encoder_hidden_states",
        "timestep",
        "img_shapes",
        "output",
    ] {
        assert!(header.contains(&format!("\"{name}\"")), "{name}: {header}");
    }

    // FLUX weights for a Qwen-Image plan: refused before loading, naming the tensor.
    let f = d.join("flux");
    mold_ok(&["testdata", "flux-tiny", f.to_str().unwrap()]);
    let e = mold_fails(&[
        "exec",
        p.to_str().unwrap(),
        "--weights",
        f.to_str().unwrap(),
    ]);
    assert!(e.contains("lacks tensor `txt_norm.weight`"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
}
