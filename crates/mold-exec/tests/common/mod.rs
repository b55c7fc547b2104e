#![allow(dead_code)]
//! Shared helpers: plans built in code, per-test checkpoint directories, reference runs.

use mold_exec::*;
use mold_plan::{
    ByteSize, ComponentPlan, ComponentRole, DeviceId, MachineIdentity, ModelRef, Part, Plan,
    Prediction, Residency, SolverRecord, Workload, PLAN_VERSION,
};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory under cargo's per-target test temp dir.
pub fn tmpdir(name: &str) -> PathBuf {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("mold-exec")
        .join(format!("{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A tiny f32 checkpoint for `seed`.
pub fn tiny_checkpoint(seed: u64) -> Checkpoint {
    let dir = tmpdir(&format!("tiny-{seed}"));
    let path = write_testdata(&FluxConfig::flux_tiny(), &dir, seed, DType::F32).unwrap();
    Checkpoint::open(&path).unwrap()
}

/// A part on `devices` (e.g. `["emu:0", "emu:1"]`) running `blocks` (e.g. `["double 0..2"]`).
pub fn part(devices: &[&str], blocks: &[&str], streamed: bool) -> Part {
    Part {
        blocks: blocks.iter().map(|b| b.parse().unwrap()).collect(),
        devices: devices.iter().map(|d| d.parse().unwrap()).collect(),
        tp: devices.len() as u32,
        sp: 1,
        residency: if streamed {
            Residency::Streamed
        } else {
            Residency::Resident
        },
        stream_buffers: None,
    }
}

/// A part of `tp` tensor-parallel × `sp` sequence-parallel ranks on `devices` (device
/// `i` is tensor-parallel rank `i % tp` of sequence-parallel rank `i / tp`).
pub fn part_par(devices: &[&str], tp: u32, sp: u32, blocks: &[&str], streamed: bool) -> Part {
    Part {
        tp,
        sp,
        ..part(devices, blocks, streamed)
    }
}

pub fn plan_with(parts: Vec<Part>, dtype: mold_plan::DType) -> Plan {
    Plan {
        version: PLAN_VERSION,
        model: ModelRef {
            id: "flux-tiny".into(),
            checkpoint: None,
        },
        workload: Workload {
            width: 64,
            height: 48,
            frames: 1,
            batch: 1,
            steps: 1,
            guidance: Some(3.5),
            cfg_scale: None,
        },
        cfg: None,
        memory_phases: Default::default(),
        machine: MachineIdentity {
            name: "test".into(),
            fingerprint: "0".into(),
            devices: vec![],
        },
        components: vec![ComponentPlan {
            name: "transformer".into(),
            role: ComponentRole::Transformer,
            dtype,
            attention: None,
            parts,
        }],
        replicas: None,
        predicted: Prediction {
            step_time_s: 0.0,
            request_time_s: 0.0,
            encode_time_s: 0.0,
            denoise_time_s: 0.0,
            decode_time_s: 0.0,
            devices: vec![],
            host_pinned: ByteSize(0),
            streamed_per_step: ByteSize(0),
        },
        solver: SolverRecord {
            solver: "test".into(),
            status: "optimal".into(),
            objective: "none".into(),
            objective_value: 0.0,
            strategy: "manual".into(),
            solve_time_ms: 0.0,
        },
    }
}

pub fn plan(parts: Vec<Part>) -> Plan {
    plan_with(parts, mold_plan::DType::F32)
}

/// Inputs for the tiny model: 64×48 pixels (12 image tokens), 7 text tokens, batch 2.
pub fn tiny_inputs(seed: u64) -> FluxInputs {
    random_inputs(&FluxConfig::flux_tiny(), 64, 48, 7, 2, seed).unwrap()
}

/// Runs `plan` and the single-device reference on the same checkpoint and inputs;
/// returns the max relative error.
pub fn error_vs_reference(ckpt: &Checkpoint, plan: &Plan, seed: u64) -> f64 {
    let cfg = FluxConfig::flux_tiny();
    let x = tiny_inputs(seed);
    let reference = Executor::reference(&cfg, ckpt, &DeviceId::Host, DType::F32)
        .unwrap()
        .forward(&x)
        .unwrap();
    let exec = Executor::new(&cfg, plan, ckpt).unwrap();
    let out = exec.forward(&x).unwrap();
    assert_eq!(out.dims(), &[2, 12, 64]);
    // A second call reuses the loaded weights and gives the same answer.
    let again = exec.forward(&x).unwrap();
    assert_eq!(max_relative_error(&again, &out).unwrap(), 0.0);
    max_relative_error(&out, &reference).unwrap()
}

/// Bit-for-bit equality of two tensors: shape, dtype and every value (as f32 bits).
pub fn assert_same(a: &candle_core::Tensor, b: &candle_core::Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}");
    assert_eq!(a.dtype(), b.dtype(), "{what}");
    let bits = |t: &candle_core::Tensor| -> Vec<u32> {
        t.to_dtype(candle_core::DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    assert!(bits(a) == bits(b), "{what}: values differ");
}
