//! Every plan in plans/ is regenerated and compared: a planner change is a reviewed diff.
//! To accept a change: `scripts/regen-plans` and commit plans/.

use crate::util::*;

#[test]
fn shipped_plans_regenerate_identically() {
    let dir = root().join("plans");
    let mut n = 0;
    let mut diffs = Vec::new();
    let tmp = tempdir("regen");
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().into_owned();
        let (model, machine) = name
            .split_once('@')
            .expect("plans are named MODEL@MACHINE.yaml");
        let out = tmp.join(format!("{name}.yaml"));
        let o = mold(&[
            "plan",
            "--model",
            model,
            "--machine",
            &format!("sim/machines/{machine}.yaml"),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        if stable(&read(&out)) != stable(&read(&p)) {
            diffs.push(name);
        }
        n += 1;
    }
    assert!(n >= 25, "expected the shipped plans, found {n}");
    assert!(
        diffs.is_empty(),
        "plans changed (run scripts/regen-plans and review the diff): {diffs:?}"
    );
}

#[test]
fn shipped_plans_cover_models_and_machines() {
    let names: Vec<String> = std::fs::read_dir(root().join("plans"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for model in ["flux-dev", "qwen-image", "ltx-video-13b"] {
        for machine in [
            "1x-rtx4090",
            "2x-rtx4090",
            "2x-l40s",
            "rtx3090+rtx4060ti",
            "2x-h200",
            "4x-h100",
            "8x-h100",
            "8x-l40s",
        ] {
            let f = format!("{model}@{machine}.yaml");
            assert!(names.contains(&f), "missing plans/{f}");
        }
    }
}

/// What a reviewer checks by eye, pinned.
#[test]
fn reviewer_expectations() {
    let plan = |f: &str| mold_plan::Plan::load(&root().join("plans").join(f)).unwrap();
    let t = |p: &mold_plan::Plan| p.transformer().unwrap().clone();
    use mold_plan::Residency::*;
    // flux-dev bf16 + T5 fp16 on 2x-l40s fits without streaming.
    let p = plan("flux-dev@2x-l40s.yaml");
    assert!(t(&p).parts.iter().all(|x| x.residency == Resident));
    assert_eq!(
        p.components.iter().find(|c| c.name == "t5").unwrap().dtype,
        mold_plan::DType::Fp16
    );
    // On 1x-rtx4090 part of the transformer streams.
    let p = plan("flux-dev@1x-rtx4090.yaml");
    assert!(t(&p).parts.iter().any(|x| x.residency == Streamed));
    assert!(t(&p).parts.iter().any(|x| x.residency == Resident));
    assert!(p.predicted.streamed_per_step.0 > 0);
    // On 8x-h100 the latency objective chooses tensor parallel inside NVLink.
    let p = plan("flux-dev@8x-h100.yaml");
    assert!(t(&p).parts.iter().all(|x| x.devices.len() > 1));
    assert_eq!(p.solver.objective, "latency");
}
