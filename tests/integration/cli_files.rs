//! Nothing a user owns is lost or written through: `mold testdata` refuses a directory
//! that holds anything unless forced, and forced never writes through a symlink; every
//! output file (`plan -o`, `exec --out/--save-io/--report`, `devices --save`,
//! `sim --timeline`) replaces only a file mold wrote and nobody changed since, unless
//! forced; shard names of an index stay inside its folder.

use crate::util::*;
use std::path::Path;

/// `mold plan --model flux-tiny --machine cpu-emu-4 -o OUT` with `extra`.
fn plan_args<'a>(out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "-o",
        out,
    ];
    a.extend_from_slice(extra);
    a
}

/// A refusal is one line naming the file and the flag that would replace it.
fn one_line_naming(e: &str, path: &Path, flag: &str) {
    let e = e.trim_end();
    assert!(!e.contains('\n'), "not one line: {e}");
    assert!(!e.contains("panicked"), "{e}");
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains(flag), "{e}");
}

#[cfg(unix)]
#[test]
fn testdata_into_a_snapshot_of_symlinks_never_writes_their_targets() {
    let d = tempdir("files-symlink");
    let blob = d.join("blobs/ae-blob");
    std::fs::create_dir_all(blob.parent().unwrap()).unwrap();
    std::fs::write(&blob, "the user's real autoencoder").unwrap();
    let snap = d.join("snapshots/rev1");
    std::fs::create_dir_all(&snap).unwrap();
    let link = snap.join("ae.safetensors");
    std::os::unix::fs::symlink(&blob, &link).unwrap();
    let s = snap.to_str().unwrap();

    // Not empty: refused, nothing written.
    let e = mold_fails(&["testdata", "flux-tiny-hf", s]);
    one_line_naming(&e, &snap, "--force");
    assert!(e.contains("not empty"), "{e}");
    assert_eq!(std::fs::read_dir(&snap).unwrap().count(), 1);

    // Forced: the link is replaced by a file of its own; its target is untouched, and
    // the report says which link was replaced.
    let (so, _) = mold_ok(&["testdata", "flux-tiny-hf", s, "--force"]);
    assert_eq!(read(&blob), "the user's real autoencoder");
    let m = std::fs::symlink_metadata(&link).unwrap();
    assert!(m.is_file() && !m.file_type().is_symlink());
    assert!(
        so.contains(&format!(
            "wrote {} (replaced a symlink to {}, which is untouched)",
            link.display(),
            blob.display()
        )),
        "{so}"
    );
    // The snapshot is whole: its headers read.
    mold_models::checkpoint::read_header(&link).unwrap();
    // No temporary file is left behind.
    let tmp: Vec<_> = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(tmp.is_empty(), "{tmp:?}");
}

#[test]
fn testdata_refuses_a_directory_holding_a_real_checkpoint() {
    let d = tempdir("files-nonempty");
    let own = d.join("flux1-dev.safetensors");
    std::fs::write(&own, "the user's flux1-dev").unwrap();
    for name in ["flux-tiny-pipeline", "flux-tiny", "qwen-image-tiny"] {
        let e = mold_fails(&["testdata", name, d.to_str().unwrap()]);
        one_line_naming(&e, &d, "--force");
        assert!(e.contains("`flux1-dev.safetensors`"), "{e}");
        assert_eq!(read(&own), "the user's flux1-dev");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 1, "{name}");
    }
    // A new directory (or an empty one) needs no --force.
    let new = d.join("new");
    mold_ok(&["testdata", "flux-tiny", new.to_str().unwrap()]);
    assert!(new.join("flux-transformer.safetensors").is_file());
}

#[test]
fn plan_replaces_its_own_unchanged_plan_and_never_an_edited_one() {
    let d = tempdir("files-plan");
    let p = d.join("plan.yaml");
    let ps = p.to_str().unwrap();
    mold_ok(&plan_args(ps, &[]));
    let first = read(&p);
    assert!(
        first.starts_with("# written by mold") && first.contains("mold-sha256:"),
        "{first}"
    );
    mold_plan::Plan::load(&p).unwrap();
    // mold's own, unchanged: replaced without --force.
    mold_ok(&plan_args(ps, &["--steps", "3"]));
    assert_eq!(mold_plan::Plan::load(&p).unwrap().workload.steps, 3);

    // Reviewed and edited by hand: refused, left as it was.
    let edited = read(&p).replace("steps: 3", "steps: 5");
    assert_ne!(edited, read(&p));
    std::fs::write(&p, &edited).unwrap();
    let e = mold_fails(&plan_args(ps, &[]));
    one_line_naming(&e, &p, "--force");
    assert!(
        e.contains("is not a plan mold wrote, or was edited since"),
        "{e}"
    );
    assert_eq!(read(&p), edited);
    // A file that is no plan at all: refused too.
    let notes = d.join("notes.txt");
    std::fs::write(&notes, "my notes").unwrap();
    mold_fails(&plan_args(notes.to_str().unwrap(), &[]));
    assert_eq!(read(&notes), "my notes");
    // --force replaces it.
    mold_ok(&plan_args(ps, &["--force"]));
    assert_eq!(mold_plan::Plan::load(&p).unwrap().workload.steps, 4);
}

#[test]
fn sim_timeline_replaces_only_its_own() {
    let d = tempdir("files-sim");
    let p = d.join("p.yaml");
    mold_ok(&plan_args(p.to_str().unwrap(), &[]));
    let svg = d.join("t.svg");
    std::fs::write(&svg, "<svg>mine</svg>").unwrap();
    let sim = |extra: &[&str]| {
        let mut a = vec![
            "sim",
            p.to_str().unwrap(),
            "--timeline",
            svg.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        mold(&a)
    };
    let o = sim(&[]);
    assert!(!o.status.success());
    one_line_naming(&stderr(&o), &svg, "--overwrite");
    assert_eq!(read(&svg), "<svg>mine</svg>");
    assert!(sim(&["--overwrite"]).status.success());
    let first = read(&svg);
    assert!(first.starts_with("<svg"), "{first}");
    assert!(
        first
            .lines()
            .nth(1)
            .unwrap()
            .starts_with("<!-- written by mold"),
        "{first}"
    );
    // mold's own: replaced without --overwrite.
    assert!(sim(&[]).status.success(), "{}", stderr(&sim(&[])));
}

#[test]
fn devices_save_refuses_a_foreign_file_before_measuring() {
    let d = tempdir("files-devices");
    let save = d.join("box.yaml");
    std::fs::write(&save, "name: my hand-written profile\n").unwrap();
    let e = mold_fails(&[
        "devices",
        "--calibrate",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--save",
        save.to_str().unwrap(),
    ]);
    one_line_naming(&e, &save, "--force");
    assert!(e.contains("is not a machine profile mold wrote"), "{e}");
    assert_eq!(read(&save), "name: my hand-written profile\n");
}

#[test]
fn exec_outputs_replace_only_files_mold_wrote() {
    let d = tempdir("files-exec");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);
    let p = d.join("p.yaml");
    mold_ok(&plan_args(p.to_str().unwrap(), &[]));
    let ps = p.to_str().unwrap();
    let ws = w.to_str().unwrap();
    let foreign = |name: &str| {
        let f = d.join(name);
        std::fs::write(&f, "the user's own file").unwrap();
        f
    };
    let unchanged = |f: &Path| assert_eq!(read(f), "the user's own file");

    // The transformer alone: --report and --save-io.
    let run = |extra: &[&str]| {
        let mut a = vec!["exec", ps, "--weights", ws, "--steps", "1"];
        a.extend_from_slice(extra);
        mold(&a)
    };
    let report = foreign("run.json");
    let o = run(&["--report", report.to_str().unwrap()]);
    assert!(!o.status.success());
    one_line_naming(&stderr(&o), &report, "--overwrite");
    assert!(
        stderr(&o).contains("is not a run report mold wrote"),
        "{}",
        stderr(&o)
    );
    unchanged(&report);
    let io = foreign("io.safetensors");
    let o = run(&["--save-io", io.to_str().unwrap()]);
    assert!(!o.status.success());
    one_line_naming(&stderr(&o), &io, "--overwrite");
    assert!(
        stderr(&o).contains("is not an I/O file mold wrote, or was edited since"),
        "{}",
        stderr(&o)
    );
    unchanged(&io);
    // --overwrite replaces both; then they are mold's, replaced without it.
    let both = [
        "--report",
        report.to_str().unwrap(),
        "--save-io",
        io.to_str().unwrap(),
    ];
    let o = run(&[&both[..], &["--overwrite"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let first_io = std::fs::read(&io).unwrap();
    let o = run(&both);
    assert!(o.status.success(), "{}", stderr(&o));
    mold_models::checkpoint::read_header(&io).unwrap();
    assert!(read(&report).contains("\"phases\""));
    assert_eq!(std::fs::read(&io).unwrap().len(), first_io.len());

    // Text to image: --out.
    let png = foreign("fox.png");
    let gen = |extra: &[&str]| {
        let mut a = vec![
            "exec",
            ps,
            "--weights",
            ws,
            "--prompt",
            "a red fox",
            "--steps",
            "1",
            "--out",
            png.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        mold(&a)
    };
    let o = gen(&[]);
    assert!(!o.status.success());
    one_line_naming(&stderr(&o), &png, "--overwrite");
    assert!(
        stderr(&o).contains("is not an image mold wrote"),
        "{}",
        stderr(&o)
    );
    unchanged(&png);
    let o = gen(&["--overwrite"]);
    assert!(o.status.success(), "{}", stderr(&o));
    mold_pipeline::read_png(&png).unwrap();
    let o = gen(&["--seed", "9"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // Changed by another program: refused again.
    let mut bytes = std::fs::read(&png).unwrap();
    let n = bytes.len();
    bytes[n - 20] ^= 1;
    std::fs::write(&png, &bytes).unwrap();
    let o = gen(&[]);
    assert!(!o.status.success());
    assert_eq!(std::fs::read(&png).unwrap(), bytes);
}

/// A safetensors index whose `weight_map` names `shard`, beside a real shard.
fn index_naming(d: &Path, file: &str, shard: &str) -> std::path::PathBuf {
    let index = d.join(file);
    let body = serde_json::json!({"metadata": {}, "weight_map": {"a.weight": "ok.safetensors", "b.weight": shard}});
    std::fs::write(&index, body.to_string()).unwrap();
    index
}

#[test]
fn shard_names_outside_the_index_s_folder_are_refused_naming_the_index() {
    let d = tempdir("files-shards");
    mold_exec::write_safetensors(
        &d.join("ok.safetensors"),
        &[mold_exec::TensorSpec {
            name: "a.weight".into(),
            shape: vec![2, 2],
        }],
        1,
        mold_exec::DType::F32,
    )
    .unwrap();
    for bad in [
        "../secret.safetensors",
        "sub/x.safetensors",
        "/etc/passwd",
        "..",
        "",
    ] {
        let index = index_naming(&d, "model.safetensors.index.json", bad);
        let e = mold_models::checkpoint::read_header(&index)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&index.display().to_string()), "{e}");
        assert!(e.contains(&format!("{bad:?}")), "{e}");
        assert!(!e.contains('\n'), "{e}");
        // The executor's reader (mold-models' underneath) and the CLI say the same.
        let e = mold_fails(&[
            "plan",
            "--model",
            index.to_str().unwrap(),
            "--model-id",
            "flux-tiny",
            "--machine",
            "sim/machines/cpu-emu-4.yaml",
            "-o",
            d.join("p.yaml").to_str().unwrap(),
        ]);
        assert!(e.contains(&format!("{bad:?}")), "{e}");
        assert!(e.contains("plain file name beside the index"), "{e}");
    }
    // Qwen-Image's text-encoder index is read by the pipeline's own reader.
    let q = d.join("qwen");
    mold_ok(&["testdata", "qwen-image-tiny-pipeline", q.to_str().unwrap()]);
    let index = q.join("text_encoder/model.safetensors.index.json");
    {
        let text = read(&index);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let first = v["weight_map"]
            .as_object()
            .unwrap()
            .values()
            .next()
            .unwrap()
            .as_str()
            .unwrap()
            .to_string();
        std::fs::write(&index, text.replace(&first, "../../secret.safetensors")).unwrap();
        let e = mold_pipeline::qwen::QwenLayout::locate(&q)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&index.display().to_string()), "{e}");
        assert!(e.contains("\"../../secret.safetensors\""), "{e}");
    }
}

/// `plan -o -` writes the plan to standard output, stamped as a file would be (so `mold
/// sim` takes it as saved), and the summary to standard error; no file named `-` appears.
/// With `--json`, which writes to standard output too, it is refused in one line.
#[test]
fn plan_to_standard_output() {
    let stray = root().join("-");
    let _ = std::fs::remove_file(&stray);
    let (out, err) = mold_ok(&plan_args("-", &[]));
    assert!(!stray.exists(), "a file named - was written");
    assert!(
        out.starts_with("# written by mold") && out.contains(mold_files::MARK),
        "{out}"
    );
    assert!(
        out.contains("version:") && out.contains("flux-tiny"),
        "{out}"
    );
    assert!(!out.contains("plan written to") && !err.contains("plan written to"));
    assert!(err.contains("flux-tiny"), "{err}");
    let d = tempdir("files-stdout");
    let saved = d.join("plan.yaml");
    std::fs::write(&saved, &out).unwrap();
    mold_ok(&["sim", saved.to_str().unwrap()]);
    let e = mold_fails(&plan_args("-", &["--json"]));
    let e = e.trim_end();
    assert!(
        !e.contains('\n') && e.contains("-o -") && e.contains("--json"),
        "{e}"
    );
    assert!(!stray.exists());
}
