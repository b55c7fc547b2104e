//! `mold exec --report` then `mold sim --compare`, end to end on emulated devices: text to
//! image and the transformer alone (profiled), and the refusals of `--compare`.

use crate::util::*;
use std::path::Path;

fn plan(d: &Path, name: &str, extra: &[&str]) -> String {
    let p = d.join(format!("{name}.yaml")).to_str().unwrap().to_string();
    let mut args = vec![
        "plan",
        "--model",
        "flux-tiny",
        "--machine",
        "sim/machines/cpu-emu-4.yaml",
        "-o",
        &p,
    ];
    args.extend(extra);
    mold_ok(&args);
    p
}

fn json(p: &Path) -> serde_json::Value {
    serde_json::from_str(&read(p)).unwrap()
}

fn row<'a>(v: &'a serde_json::Value, phase: &str) -> &'a serde_json::Value {
    v["phases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["phase"] == phase)
        .unwrap_or_else(|| panic!("no row {phase}: {v:#}"))
}

fn of_kind<'a>(v: &'a serde_json::Value, kind: &str) -> Vec<&'a serde_json::Value> {
    v["phases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == kind)
        .collect()
}

#[test]
fn a_pipeline_run_reports_and_sim_compares_it() {
    let d = tempdir("report-pipeline");
    let w = d.join("wp");
    mold_ok(&["testdata", "flux-tiny-pipeline", w.to_str().unwrap()]);
    let p = plan(&d, "tp2", &["--tp", "2"]);
    let run = d.join("run.json");
    let (so, _) = mold_ok(&[
        "exec",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--prompt",
        "a red fox in snow",
        "--steps",
        "3",
        "--out",
        d.join("fox.png").to_str().unwrap(),
        "--report",
        run.to_str().unwrap(),
    ]);
    let last = so.lines().last().unwrap();
    assert!(last.starts_with("report: step "), "{so}");
    assert!(
        last.contains("measured vs") && last.contains("predicted ("),
        "{last}"
    );
    assert!(last.contains("largest deviation: "), "{last}");
    assert!(
        last.ends_with(&format!("wrote {}", run.display())),
        "{last}"
    );

    let v = json(&run);
    assert_eq!(v["version"], 1);
    assert_eq!(v["run"]["kind"], "pipeline");
    assert_eq!(v["run"]["steps"], 3);
    assert_eq!(v["plan"]["model"], "flux-tiny");
    for phase in [
        "encode: t5",
        "encode: clip",
        "encode",
        "step",
        "denoise",
        "decode",
        "request",
        "load",
    ] {
        let r = row(&v, phase);
        assert!(r["predicted_s"].as_f64().unwrap() >= 0.0, "{phase}: {r}");
        assert!(r["measured_s"].as_f64().unwrap() > 0.0, "{phase}: {r}");
    }
    // Per-part phases are predicted; without MOLD_PROFILE they are not measured.
    let part = row(&v, "part 1: blocks");
    assert!(part["predicted_s"].as_f64().unwrap() > 0.0);
    assert!(part["measured_s"].is_null());
    // The tensor-parallel part's all-reduces.
    let coll = of_kind(&v, "collective");
    assert!(!coll.is_empty(), "{v:#}");
    assert!(coll
        .iter()
        .all(|r| r["predicted_s"].as_f64().unwrap() > 0.0));
    // Emulated devices: the accounted figures, labelled as such.
    let mem = v["memory"].as_array().unwrap();
    assert!(!mem.is_empty());
    for m in mem {
        assert_eq!(m["measured"]["source"], "accounted", "{m}");
        assert_eq!(
            m["measured"]["peak_bytes"], m["accounted_peak_bytes"],
            "{m}"
        );
    }
    assert!(mem
        .iter()
        .any(|m| m["predicted_peak_bytes"].as_u64().is_some()));

    let (table, _) = mold_ok(&["sim", &p, "--compare", run.to_str().unwrap()]);
    for want in [
        "run of flux-tiny on cpu-emu-4: text to image, 3 steps",
        "encode: t5",
        "part 1: blocks (per step)",
        "decode",
        "(accounted)",
        "largest deviation: ",
        "MOLD_PROFILE=1",
    ] {
        assert!(table.contains(want), "{want}: {table}");
    }
    let (j, _) = mold_ok(&["sim", &p, "--compare", run.to_str().unwrap(), "--json"]);
    let j: serde_json::Value = serde_json::from_str(&j).unwrap();
    assert_eq!(j["report"], v);
    assert!(j["largest_deviation"]["phase"].is_string());

    // Another plan, a malformed or missing report: one line each, exit 1.
    let other = plan(&d, "one", &["--tp", "off"]);
    let e = mold_fails(&["sim", &other, "--compare", run.to_str().unwrap()]);
    assert!(
        e.contains("plan.fingerprint: the report is of another plan"),
        "{e}"
    );
    assert!(e.contains("one.yaml"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    let bad = d.join("bad.json");
    std::fs::write(&bad, read(&run).replace("\"version\": 1", "\"version\": 9")).unwrap();
    let e = mold_fails(&["sim", &p, "--compare", bad.to_str().unwrap()]);
    assert!(
        e.contains("run report version 9, this mold reads version 1"),
        "{e}"
    );
    assert_eq!(e.lines().count(), 1, "{e}");
    std::fs::write(&bad, "{\"version\": 1, \"plan\": 3}").unwrap();
    let e = mold_fails(&["sim", &p, "--compare", bad.to_str().unwrap()]);
    assert!(e.contains("not a mold run report"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    let e = mold_fails(&[
        "sim",
        &p,
        "--compare",
        d.join("none.json").to_str().unwrap(),
    ]);
    assert!(
        e.contains("--compare") && e.contains("cannot read it"),
        "{e}"
    );
}

#[test]
fn a_profiled_transformer_run_measures_each_part() {
    let d = tempdir("report-bench");
    let w = d.join("w");
    mold_ok(&["testdata", "flux-tiny", w.to_str().unwrap()]);
    // Two parts (the double blocks on one device, the single blocks SP2 × TP2), one with
    // collectives.
    let p = plan(&d, "sp2", &["--sp", "2"]);
    let run = d.join("bench.json");
    let args = [
        "exec",
        p.as_str(),
        "--weights",
        w.to_str().unwrap(),
        "--steps",
        "3",
        "--report",
        run.to_str().unwrap(),
    ];
    let o = mold_env(&args, &[("MOLD_PROFILE", "1")]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("report: step "), "{}", stdout(&o));
    let v = json(&run);
    assert_eq!(v["run"]["kind"], "transformer");
    assert_eq!(v["run"]["profiled"], true);
    let parts = of_kind(&v, "compute");
    let coll = of_kind(&v, "collective");
    assert!(parts.len() >= 2 && !coll.is_empty(), "{v:#}");
    let whole = [row(&v, "step"), row(&v, "denoise"), row(&v, "load")];
    for r in parts.iter().chain(&coll).chain(&whole) {
        assert!(r["predicted_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["measured_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(v["phases"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["phase"] != "decode" && r["phase"] != "encode"));
    let (table, _) = mold_ok(&["sim", &p, "--compare", run.to_str().unwrap()]);
    assert!(table.contains("transformer only, 3 steps"), "{table}");
    assert!(table.contains("measured with MOLD_PROFILE"), "{table}");

    // A report nowhere to go is refused before anything loads.
    let e = mold_fails(&[
        "exec",
        &p,
        "--weights",
        w.to_str().unwrap(),
        "--report",
        d.join("no/such/dir/r.json").to_str().unwrap(),
    ]);
    assert!(e.contains("--report") && e.contains("no directory"), "{e}");
    assert!(!e.contains("loaded"), "{e}");
}
