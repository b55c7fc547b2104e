//! Planner speed: qwen-image on 8x-h100 with every strategy allowed (all four families
//! solved to optimality), and flux-dev on 8x-l40s. Results go in BENCHMARKS.md.

use criterion::{criterion_group, criterion_main, Criterion};
use mold_planner::{plan, Request};
use std::path::Path;

fn request(model: &str, machine: &str) -> Request {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let m = mold_machine::Machine::load(&root.join("sim/machines").join(format!("{machine}.yaml")))
        .unwrap();
    let model = mold_models::find(model).unwrap();
    let w = model.default_workload.clone();
    Request::new(model, m, w)
}

fn bench(c: &mut Criterion) {
    for (model, machine) in [
        ("qwen-image", "8x-h100"),
        ("flux-dev", "8x-l40s"),
        ("flux-dev", "1x-rtx4090"),
    ] {
        let req = request(model, machine);
        let o = plan(&req).unwrap();
        assert_eq!(o.plan.solver.status, "optimal");
        c.bench_function(&format!("plan {model} on {machine} (4 families)"), |b| {
            b.iter(|| plan(std::hint::black_box(&req)).unwrap())
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
