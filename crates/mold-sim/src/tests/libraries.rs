//! The CUDA libraries' measured device memory (`library_bytes` of a profile's operation
//! table) in the memory timeline: allocated at load on every device the plan uses, so
//! the simulated peaks rise by what the cost model adds to its own.

use crate::engine::LIBRARIES;
use crate::*;
use mold_machine::OpTables;
use mold_plan::{ByteSize, Plan, MIB};

const LIB: u64 = 200 * MIB;

fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `m` with a table for `plan`'s model and transformer dtype on each of its kinds of
/// device (an existing one kept, its times unchanged), `library_bytes` set to `library`.
fn with_libraries(plan: &Plan, m: &Machine, library: Option<u64>) -> Machine {
    let dtype = plan.transformer().unwrap().dtype;
    let mut out = m.clone();
    let mut names: Vec<String> = m.devices.iter().map(|d| d.name.clone()).collect();
    names.dedup();
    for name in names {
        let mut t = match out.op_tables(&plan.model.id, dtype, &name) {
            Some(t) => t.clone(),
            None => serde_yaml_ng::from_str::<OpTables>(&format!(
                "{{model: {}, dtype: {dtype}, device: {name:?}, elementwise_gbps: 1000}}",
                plan.model.id
            ))
            .unwrap(),
        };
        t.library_bytes = library.map(ByteSize);
        out.set_op_tables(t);
    }
    out.validate("with-libraries").unwrap();
    out
}

/// Every shipped plan (one device and many, resident and one-shot, true CFG serial and
/// parallel, components on other devices): with the libraries measured, each device the
/// plan uses peaks exactly `LIB` higher in the cost model and in the simulation (the
/// planner's accounting and the refined one), the libraries live at its peak; the
/// devices it leaves alone stay at 0.
#[test]
fn the_simulation_adds_the_libraries_where_the_cost_model_does() {
    let mut files: Vec<_> = std::fs::read_dir(root().join("plans"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 10, "{files:?}");
    let mut unused = 0;
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        let plan = Plan::load(f).unwrap();
        let m = Machine::load(
            &root()
                .join("sim/machines")
                .join(format!("{}.yaml", plan.machine.name)),
        )
        .unwrap();
        let (model, _) = prepare(&plan, &m, false).unwrap();
        let base = with_libraries(&plan, &m, None);
        let lib = with_libraries(&plan, &m, Some(LIB));
        let eval_base = mold_cost::evaluate(&plan, &model, &base);
        let eval_lib = mold_cost::evaluate(&plan, &model, &lib);
        for opts in [SimOptions::planner(), SimOptions::default()] {
            let sim_base = simulate_with(&plan, &model, &base, opts).unwrap();
            let sim_lib = simulate_with(&plan, &model, &lib, opts).unwrap();
            for (i, d) in eval_base.devices.iter().enumerate() {
                let used = d.peak > 0;
                let want = if used { LIB } else { 0 };
                let what = format!("{name} {} ({opts:?})", d.device);
                assert_eq!(eval_lib.devices[i].peak, d.peak + want, "{what}");
                assert_eq!(eval_lib.devices[i].libraries, want, "{what}");
                let (sb, sl) = (&sim_base.devices[i], &sim_lib.devices[i]);
                assert_eq!(sl.peak, sb.peak + want, "{what}");
                assert_eq!(
                    sl.peak_live.iter().any(|l| l.what == LIBRARIES),
                    used,
                    "{what}: {:?}",
                    sl.peak_live
                );
                if !used {
                    unused += 1;
                    assert_eq!(sl.peak, 0, "{what}");
                }
            }
        }
    }
    // Some plans leave devices of their machine unused.
    assert!(unused > 0);
}

/// A profile whose tables lack the field simulates exactly as one without tables'
/// memory: the allocation is not there at all.
#[test]
fn without_the_figure_nothing_is_allocated() {
    let f = root().join("plans/flux-dev@2x-h200.yaml");
    let plan = Plan::load(&f).unwrap();
    let m = Machine::load(&root().join("sim/machines/2x-h200.yaml")).unwrap();
    let (model, _) = prepare(&plan, &m, false).unwrap();
    let r = simulate(&plan, &model, &with_libraries(&plan, &m, None)).unwrap();
    let plain = simulate(&plan, &model, &m).unwrap();
    for (a, b) in r.devices.iter().zip(&plain.devices) {
        assert_eq!(a.peak, b.peak);
        assert!(a.peak_live.iter().all(|l| l.what != LIBRARIES));
    }
}
