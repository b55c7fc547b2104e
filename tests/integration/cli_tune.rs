//! `mold plan --tune` on emulated devices: each placement worth comparing run by `mold
//! exec`, the measured fastest written with the record, and the refusals.

use crate::util::*;

const EMU4: &str = "sim/machines/cpu-emu-4.yaml";

fn weights(d: &std::path::Path) -> String {
    let w = d.join("w").to_str().unwrap().to_string();
    mold_ok(&["testdata", "flux-tiny", &w, "--quiet"]);
    w
}

/// The record holds the planner's pick and other placements, each measured; the kept one
/// has the shortest request with its measured step; the file written is that placement,
/// with the record under it, runs, and is mold's own (replaced without --force).
#[test]
fn tune_keeps_the_measured_fastest() {
    let d = tempdir("tune-keeps");
    let w = weights(&d);
    let p = d.join("p.yaml");
    let p = p.to_str().unwrap();
    let args = [
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        EMU4,
        "--tune",
        "--tune-steps",
        "3",
        "--tune-rounds",
        "3",
        "--weights",
        &w,
        "-o",
        p,
        "--json",
    ];
    let (out, err) = mold_ok(&args);
    assert!(err.contains("3 rounds"), "{err}");
    assert!(err.contains("tune: measuring"), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["tune"].as_array().expect("a tune record");
    assert!(rows.len() >= 2, "{rows:?}");
    assert_eq!(rows[0]["planner_pick"], true);
    assert_eq!(rows.iter().filter(|r| r["chosen"] == true).count(), 1);
    let request = |r: &serde_json::Value| r["request_s"].as_f64().expect("measured");
    let kept = rows.iter().find(|r| r["chosen"] == true).unwrap();
    let fastest = rows.iter().map(request).fold(f64::INFINITY, f64::min);
    assert_eq!(request(kept), fastest, "{rows:?}");
    assert!(rows
        .iter()
        .all(|r| r["measured_step_s"].as_f64().unwrap() > 0.0));
    let plan = mold_plan::Plan::load(std::path::Path::new(p)).unwrap();
    assert_eq!(
        mold_planner::tune::describe(&plan),
        kept["label"].as_str().unwrap()
    );
    let text = read(std::path::Path::new(p));
    assert!(text.contains("# mold plan --tune"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.contains("(kept")).count(),
        1,
        "{text}"
    );
    let ran = mold_ok(&["exec", p, "--weights", &w, "--steps", "2"]).0;
    assert!(ran.contains("step "), "{ran}");
    // mold's own file: planned over without --force.
    mold_ok(&["plan", "--model", "flux-tiny", "--machine", EMU4, "-o", p]);
}

/// A layout fixed on the command line stays fixed in every placement measured.
#[test]
fn tune_keeps_a_given_layout() {
    let d = tempdir("tune-fixed");
    let w = weights(&d);
    let p = d.join("p.yaml");
    let (out, _) = mold_ok(&[
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        EMU4,
        "--tp",
        "off",
        "--tune",
        "--tune-steps",
        "2",
        "--weights",
        &w,
        "-o",
        p.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = v["tune"]
        .as_array()
        .expect("a tune record: --tp off leaves SP and one GPU");
    for r in rows {
        assert!(!r["label"].as_str().unwrap().contains("TP"), "{r}");
    }
    let plan = mold_plan::Plan::load(&p).unwrap();
    assert!(plan.transformer().unwrap().parts.iter().all(|p| p.tp == 1));
}

/// Refusals name the flag in one line, before anything is planned or written.
#[test]
fn tune_refusals() {
    let d = tempdir("tune-refuse");
    let w = weights(&d);
    let p = d.join("p.yaml");
    let p = p.to_str().unwrap();
    let base = ["plan", "--model", "flux-tiny", "--machine", EMU4, "-o", p];
    let run = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        let e = mold_fails(&a);
        assert!(!std::path::Path::new(p).exists(), "{a:?} wrote a plan");
        e
    };
    let e = run(&["--tune", "--weights", &w, "--objective", "throughput"]);
    assert!(e.contains("--tune") && e.contains("throughput"), "{e}");
    let e = run(&["--tune", "--weights", "/nonexistent/weights"]);
    assert!(e.contains("--weights /nonexistent/weights"), "{e}");
    let e = run(&["--tune", "--weights", &w, "--tune-steps", "1"]);
    assert!(e.contains("--tune-steps 1"), "{e}");
    let e = run(&["--tune", "--weights", &w, "--tune-candidates", "1"]);
    assert!(e.contains("--tune-candidates 1"), "{e}");
    let e = run(&["--tune", "--weights", &w, "--tune-rounds", "0"]);
    assert!(e.contains("--tune-rounds 0"), "{e}");
    let e = run(&["--tune", "--weights", &w, "--tune-timeout", "0"]);
    assert!(e.contains("--tune-timeout 0"), "{e}");
    let e = run(&["--tune-steps", "3"]);
    assert!(e.contains("--tune"), "{e}");
    // A limit no run can keep: every run is stopped, nothing is written.
    let e = run(&["--tune", "--weights", &w, "--tune-timeout", "0.001"]);
    assert!(e.contains("no placement ran"), "{e}");
    assert!(e.contains("stopped after 0.001 s"), "{e}");
    // Weights no placement can run: every candidate fails, nothing is written.
    let empty = d.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let e = run(&["--tune", "--weights", empty.to_str().unwrap()]);
    assert!(e.contains("no placement ran"), "{e}");
}
