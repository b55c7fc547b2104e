//! `mold sim` as a user runs it, from the repository root.

use crate::util::mold;

fn run(args: &[&str]) -> (i32, String, String) {
    let mut a = vec!["sim"];
    a.extend_from_slice(args);
    let o = mold(&a);
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

const PLAN: &str = "sim/scenarios/plans/flux-dev-one-l40s.yaml";

#[test]
fn simulates_a_plan_on_its_machine() {
    let (code, out, err) = run(&[PLAN]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "machine profile: sim/machines/",
        "cuda:0",
        "bottleneck:",
        "request",
        "vs plan:",
        "fits",
    ] {
        assert!(out.contains(want), "missing {want}: {out}");
    }
}

#[test]
fn json_and_timeline() {
    let svg = std::env::temp_dir().join(format!("mold-sim-{}.svg", std::process::id()));
    let (code, out, err) = run(&[PLAN, "--json", "--timeline", svg.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["fits"], true);
    assert!(v["simulation"]["step_s"].as_f64().unwrap() > 0.0);
    assert!(v["vs_plan"]["step_deviation"].as_f64().unwrap().abs() < 0.02);
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg"));
    assert!(text.trim_end().ends_with("</svg>"));
    for lane in ["compute", "copy", "comm"] {
        assert!(text.contains(&format!(r#"data-lane="{lane}""#)));
    }
    std::fs::remove_file(&svg).ok();
}

#[test]
fn another_machine_needs_force() {
    let (code, out, err) = run(&[PLAN, "--machine", "sim/machines/1x-rtx4090.yaml"]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("the plan was made for machine `2x-l40s`"),
        "{err}"
    );
    assert!(err.contains("--force"), "{err}");
    let (code, out, err) = run(&[PLAN, "--machine", "sim/machines/1x-rtx4090.yaml", "--force"]);
    // Forced: a warning, then the overrun as an error.
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("warning: the plan was made for machine"),
        "{err}"
    );
    assert!(err.contains("error: cuda:0: over budget"), "{err}");
    assert!(out.contains("OVER"), "{out}");
}

#[test]
fn check_walks_plans_and_scenarios() {
    let (code, out, err) = run(&["--check", "plans/", "sim/scenarios/"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("ok   sim/scenarios/split-flux-dev-2x-rtx4090.yaml"),
        "{out}"
    );
    assert!(out.contains(" 0 failed"), "{out}");
    let dir = std::env::temp_dir().join(format!("mold-sim-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("wrong.yaml"),
        format!(
            "machine: sim/machines/1x-rtx4090.yaml\nplan_file: {PLAN}\nforce: true\nexpect: fits\n"
        ),
    )
    .unwrap();
    let (code, out, _) = run(&["--check", dir.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL") && out.contains("expected to fit"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
