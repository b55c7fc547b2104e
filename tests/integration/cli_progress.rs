//! `--json` and `--quiet` on `mold testdata` and `mold exec` (emulated devices): every
//! JSON line parses and the events count the work; quiet prints the result line alone.
//! (Not on a terminal, the plain lines stay as they were: the other tests parse them.)

use crate::util::*;
use serde_json::Value;
use std::path::Path;

/// Each stdout line as a JSON object with an `event`.
fn events(out: &str) -> Vec<Value> {
    out.lines()
        .map(|l| {
            let v: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v["event"].is_string(), "no event: {l}");
            v
        })
        .collect()
}

fn of<'a>(evs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    evs.iter().filter(|e| e["event"] == kind).collect()
}

/// A tiny pipeline (written with `--json`) and a flux-tiny plan, TP 2 over emulated
/// devices: (weights, plan).
fn setup(d: &Path) -> (String, String) {
    let w = d.join("w").to_str().unwrap().to_string();
    let (so, _) = mold_ok(&["testdata", "flux-tiny-pipeline", &w, "--json"]);
    let evs = events(&so);
    assert!(
        of(&evs, "wrote").iter().any(|e| e["path"]
            .as_str()
            .unwrap()
            .ends_with("t5/model.safetensors")),
        "{so}"
    );
    assert_eq!(evs.last().unwrap()["event"], "done", "{so}");
    let p = d.join("p.yaml").to_str().unwrap().to_string();
    mold_ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "--tp",
        "2",
        "-o",
        &p,
    ]);
    (w, p)
}

#[test]
fn json_events_parse_and_count_the_steps() {
    let d = tempdir("progress-json");
    let (w, p) = setup(&d);
    let png = d.join("fox.png").to_str().unwrap().to_string();
    let (so, _) = mold_ok(&[
        "exec",
        &p,
        "--weights",
        &w,
        "--prompt",
        "a fox",
        "--steps",
        "3",
        "--out",
        &png,
        "--json",
    ]);
    let evs = events(&so);
    let steps = of(&evs, "step");
    let idx: Vec<u64> = steps.iter().map(|s| s["index"].as_u64().unwrap()).collect();
    assert_eq!(idx, [1, 2, 3], "{so}");
    assert!(steps
        .iter()
        .all(|s| s["steps"] == 3 && s["seconds"].is_f64()));
    let loaded: Vec<&str> = of(&evs, "loaded")
        .iter()
        .map(|e| e["component"].as_str().unwrap())
        .collect();
    for c in ["t5", "clip", "transformer", "vae"] {
        assert!(loaded.contains(&c), "{c} not loaded: {so}");
        assert!(
            of(&evs, "loading").iter().any(|e| e["component"] == c),
            "{so}"
        );
    }
    assert!(of(&evs, "loaded")
        .iter()
        .all(|e| e["weight_bytes"].as_u64() > Some(0)));
    assert_eq!(of(&evs, "wrote")[0]["path"], png.as_str());
    let done = evs.last().unwrap();
    assert_eq!(done["event"], "done", "{so}");
    assert!(
        done["peaks"].as_array().is_some_and(|p| !p.is_empty()),
        "{done}"
    );

    // The transformer alone: its steps, and the digest the plain output prints.
    let args = ["exec", &p, "--weights", &w, "--steps", "2"];
    let plain = mold_ok(&args).0;
    let want = plain
        .lines()
        .find_map(|l| l.strip_prefix("output digest: "))
        .unwrap();
    let mut json_args = args.to_vec();
    json_args.push("--json");
    let (so, _) = mold_ok(&json_args);
    let evs = events(&so);
    assert_eq!(of(&evs, "step").len(), 2, "{so}");
    assert_eq!(of(&evs, "result")[0]["output_digest"], want, "{so}");
    assert!(!of(&evs, "memory").is_empty(), "{so}");
}

#[test]
fn quiet_prints_the_result_line_alone() {
    let d = tempdir("progress-quiet");
    // Not `w`: `setup` writes there (testdata refuses a directory that holds anything).
    let w = d.join("quiet-w").to_str().unwrap().to_string();
    let (so, se) = mold_ok(&["testdata", "flux-tiny-pipeline", &w, "--quiet"]);
    assert_eq!(so.lines().count(), 1, "{so}");
    assert!(so.starts_with("tiny FLUX pipeline (seed 0)"), "{so}");
    assert!(se.is_empty(), "{se}");
    let (_, p) = setup(&d);
    let png = d.join("q.png").to_str().unwrap().to_string();
    let (so, se) = mold_ok(&[
        "exec",
        &p,
        "--weights",
        &w,
        "--prompt",
        "a fox",
        "--steps",
        "2",
        "--out",
        &png,
        "--quiet",
    ]);
    assert_eq!(so.lines().collect::<Vec<_>>().len(), 1, "{so}");
    assert!(so.starts_with(&format!("wrote {png} (")), "{so}");
    assert!(!se.contains("step") && !se.contains("load"), "{se}");
    let (so, _) = mold_ok(&["exec", &p, "--weights", &w, "--steps", "2", "--quiet"]);
    assert_eq!(so.lines().count(), 1, "{so}");
    assert!(so.starts_with("output digest: "), "{so}");
    // One or the other.
    let e = mold_fails(&["exec", &p, "--weights", &w, "--quiet", "--json"]);
    assert!(e.contains("--quiet") && e.contains("--json"), "{e}");
}
