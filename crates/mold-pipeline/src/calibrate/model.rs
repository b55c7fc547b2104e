//! A model's operation tables measured kind of device by kind of device, and added to
//! the profile (`mold devices --calibrate --model M`): what is measured in which order.

use super::components::{components_timed, record_first_use, time_components, FirstUseRun};
use super::{CalibrateError, Host};
use mold_exec::calibrate::{measure_ops, OpBench, OpTarget, Timing};
use mold_exec::comm::CommOptions;
use mold_exec::Kernels;
use mold_machine::inventory;
use mold_machine::{ComponentPoint, Machine, OpTables};
use mold_models::ModelSpec;
use mold_plan::{ByteSize, DType, DeviceId, Workload};

/// A model to measure, its options resolved by the CLI.
#[derive(Clone, Debug)]
pub struct ModelCalibration {
    /// The model as named (`--model`).
    pub model: String,
    /// Its catalogue entry.
    pub spec: ModelSpec,
    /// The dtype to measure in (checked with [`mold_exec::compute_dtype`]).
    pub dtype: DType,
    /// Workloads measured beside half, the same and twice the default side (`--size`),
    /// each checked against the model.
    pub extra: Vec<Workload>,
    /// How an operation on one device is timed (`--timing`); `None`: [`op_timing`]'s
    /// default for the devices.
    pub timing: Option<Timing>,
    /// Which attention and element-wise implementations run (`MOLD_KERNELS`).
    pub kernels: Kernels,
    /// The collectives' options (the NCCL watchdog).
    pub comm: CommOptions,
}

/// Refuses a model whose blocks mold does not price by operation, in one line.
pub fn check_model(spec: &ModelSpec) -> Result<(), String> {
    let tokens = spec.tokens(&spec.default_workload);
    match spec
        .transformer
        .kinds
        .iter()
        .find(|k| mold_cost::ops::block_ops(k, tokens, 1, 1, 1, 2).is_none())
    {
        Some(k) => Err(format!(
            "its `{}` blocks have no operation breakdown (mold prices FLUX's double and \
             single blocks by operation): calibrate a FLUX model",
            k.name
        )),
        None => Ok(()),
    }
}

/// How operations are timed: as `named`, else mixed on GPUs and alone on emulated
/// devices (the CPU's clocks do not settle under a GPU's power limit, and tests stay
/// fast).
pub fn op_timing(named: Option<Timing>, devices: &[DeviceId]) -> Timing {
    match named {
        Some(t) => t,
        None if devices.iter().all(|d| matches!(d, DeviceId::Cuda(_))) => Timing::MIXED,
        None => Timing::Alone,
    }
}

/// The devices of `m` on its first device's node (the one this process reaches) by kind
/// (device name), kinds in the order their first device appears: each kind gets its own
/// operation tables (the cost model looks tables up by device name, so other nodes'
/// devices of the same name share them).
pub fn device_kinds(m: &Machine) -> Vec<Vec<DeviceId>> {
    let Some(node) = m.devices.first().map(|d| &d.node) else {
        return Vec::new();
    };
    let mut kinds: Vec<Vec<DeviceId>> = Vec::new();
    for d in m.devices.iter().filter(|d| &d.node == node) {
        let same = |k: &&mut Vec<DeviceId>| m.device(&k[0]).is_some_and(|f| f.name == d.name);
        match kinds.iter_mut().find(|k| same(k)) {
            Some(k) => k.push(d.id.clone()),
            None => kinds.push(vec![d.id.clone()]),
        }
    }
    kinds
}

/// `t` into `m` (in place of any table of the same model, dtype and devices), noted in
/// its calibration as measured by mold `mold_version` on `date`.
pub fn add_tables(m: &mut Machine, t: OpTables, timing: Timing, date: &str, mold_version: &str) {
    let note = format!(
        "Operation tables for {} {} on {} measured by mold {} on {} (`mold devices \
         --calibrate --model {}`: {} matrix products, {} attention shapes, element-wise \
         kernels, {} collective sizes, {} text-encoder and VAE runs{}; operations timed {}, \
         collectives 8 at a time back to back on the stream, encoders and the decoder each \
         run alone).",
        t.model,
        t.dtype,
        t.device,
        mold_version,
        date,
        t.model,
        t.gemm.len(),
        t.attention.len(),
        t.collectives.all_reduce.len()
            + t.collectives.all_gather.len()
            + t.collectives.all_to_all.len(),
        t.components.len(),
        if t.library_bytes.is_some() {
            ", the CUDA libraries' device memory in fresh processes"
        } else {
            ""
        },
        timing.describe()
    );
    let notes = &mut m.calibration.notes;
    if !notes.is_empty() {
        notes.push(' ');
    }
    notes.push_str(&note);
    m.set_op_tables(t);
}

/// Measures `req`'s operations on each kind of device in `m` (on its first device;
/// collectives over the first 2, 4, … of that kind), at the shapes the cost model looks
/// up for the model's default size at half, the same and twice its side: one table per
/// kind, in the order [`device_kinds`] gives.
pub(super) fn measure_model(
    req: &ModelCalibration,
    m: &Machine,
    host: &mut dyn Host,
) -> Result<Vec<(OpTables, Timing)>, CalibrateError> {
    check_model(&req.spec)
        .map_err(|e| CalibrateError::Refused(format!("model {}: {e}", req.model)))?;
    let kinds = device_kinds(m);
    if kinds.is_empty() {
        return Err(CalibrateError::Refused(
            "the machine profile has no device".into(),
        ));
    }
    let mut tables = Vec::new();
    for devices in &kinds {
        let first = m.device(&devices[0]).ok_or_else(|| {
            CalibrateError::Refused(format!("{}: not a device of the profile", devices[0]))
        })?;
        if kinds.len() > 1 {
            host.say(&format!(
                "calibrating {} ({} of this kind: {})",
                first.name,
                devices.len(),
                devices
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        tables.push(measure_kind(req, first, devices, host)?);
    }
    Ok(tables)
}

/// [`measure_model`] for one kind of device: `devices`, `first` of them; the tables and
/// how they were timed.
fn measure_kind(
    req: &ModelCalibration,
    first: &mold_machine::Device,
    devices: &[DeviceId],
    host: &mut dyn Host,
) -> Result<(OpTables, Timing), CalibrateError> {
    let (model, spec, dtype) = (req.model.as_str(), &req.spec, req.dtype);
    let timing = op_timing(req.timing, devices);
    let sizes: Vec<u32> = inventory::allreduce_group_sizes(devices.len())
        .into_iter()
        .map(|n| n as u32)
        .collect();
    let mut shapes_req =
        mold_cost::ops::ShapeRequest::default_for(spec, devices.len() as u32, sizes);
    shapes_req.workloads.extend(req.extra.iter().cloned());
    let shapes = mold_cost::ops::calibration_shapes(spec, dtype, &shapes_req);
    let bench = OpBench {
        kernels: req.kernels,
        comm: req.comm.clone(),
        timing,
        ..Default::default()
    };
    let mut t = measure_ops(
        &OpTarget {
            model,
            dtype,
            device_name: &first.name,
            devices,
        },
        &shapes,
        &bench,
        &mut |s| host.say(&format!("calibrating: {s}")),
    )?;
    if components_timed(model) {
        // The text encoders, and the VAE at half, the same and twice the default side.
        let (w, h) = (spec.default_workload.width, spec.default_workload.height);
        let mut sizes = vec![(w / 2, h / 2), (w, h), (w * 2, h * 2)];
        sizes.extend(req.extra.iter().map(|x| (x.width, x.height)));
        sizes.sort_by_key(|&(w, h)| (u64::from(w) * u64::from(h), w));
        sizes.dedup();
        let dev = mold_exec::runtime::DeviceMap::new(false)
            .get(&first.id)
            .map_err(|e| CalibrateError::Device {
                device: first.id.to_string(),
                message: e.to_string(),
            })?;
        let vae = crate::flux::vae::VaeOptions::with_kernels(req.kernels);
        t.components = time_components(model, &dev, &sizes, &Default::default(), vae, &mut |s| {
            host.say(&format!("calibrating: {s} on {}", first.id))
        })?;
        // This process has run its products by now: first use needs fresh ones.
        measure_first_use(model, &first.id, &sizes, &mut t.components, host);
        t.sort();
    }
    if matches!(first.id, DeviceId::Cuda(_)) {
        // In fresh processes: this one has loaded every library by now.
        t.library_bytes = measure_libraries(model, dtype, &first.id, host);
    }
    let first_use = t
        .components
        .iter()
        .filter_map(|p| {
            let unit = if p.component == "vae" { "px" } else { "tokens" };
            p.first_use_seconds
                .map(|f| format!("{} ({} {unit}) {:.1} ms", p.component, p.size, f * 1e3))
        })
        .collect::<Vec<_>>();
    host.say(&format!(
        "operation tables: {model} {dtype} on {}: {} matrix products, {} attention shapes, \
         element-wise {:.1} GB/s, {} encoder and decoder runs{}{}",
        first.name,
        t.gemm.len(),
        t.attention.len(),
        t.elementwise_gbps,
        t.components.len(),
        match t.library_bytes {
            Some(b) => format!("; CUDA libraries' device memory {}", b.human()),
            None => String::new(),
        },
        if first_use.is_empty() {
            String::new()
        } else {
            format!("; first use in a fresh process: {}", first_use.join(", "))
        }
    ));
    Ok((t, timing))
}

/// Fresh processes [`measure_first_use`] runs at least: first use varies from process
/// to process by a third, so its mean needs a few.
pub(super) const FIRST_USE_PROCESSES: usize = 5;

/// Each component's first run in a fresh process on `device`, into `points`'
/// `first_use_seconds`: fresh processes ([`Host::first_use`]), each running the text
/// encoders and then the decoder, as a one-shot `mold exec` does — one per decoder size,
/// and at least [`FIRST_USE_PROCESSES`], taking the sizes in turn; each point gets the
/// mean of its runs ([`record_first_use`]). A process that cannot start or fails is said
/// in one line and the calibration goes on without its figures.
fn measure_first_use(
    model: &str,
    device: &DeviceId,
    sizes: &[(u32, u32)],
    points: &mut [ComponentPoint],
    host: &mut dyn Host,
) {
    let mut runs: Vec<FirstUseRun> = Vec::new();
    let n = sizes.len().max(FIRST_USE_PROCESSES);
    for &(w, h) in sizes.iter().cycle().take(n) {
        host.say(&format!(
            "calibrating: first use of the encoders and the vae decoding {w}x{h} in a fresh \
             process on {device}"
        ));
        match host.first_use(model, device, (w, h)) {
            Ok(r) => runs.extend(r),
            Err(e) => host.say(&format!(
                "calibrating: first use in a fresh process not measured ({w}x{h} on \
                 {device}): {e}"
            )),
        }
    }
    record_first_use(points, &runs);
}

/// Fresh processes [`measure_libraries`] runs: their median is kept.
pub(super) const FOOTPRINT_PROCESSES: usize = 3;

/// The CUDA libraries' device memory on `device` (a GPU) with `model`'s blocks run in
/// `dtype`: fresh processes ([`Host::footprint`]), [`FOOTPRINT_PROCESSES`] of them, the
/// median kept (the upper one of two), rounded up to MiB. A process that cannot start or
/// fails is said in one line and the calibration goes on; `None` where none succeeded.
fn measure_libraries(
    model: &str,
    dtype: DType,
    device: &DeviceId,
    host: &mut dyn Host,
) -> Option<ByteSize> {
    let mut bytes = Vec::new();
    for i in 1..=FOOTPRINT_PROCESSES {
        host.say(&format!(
            "calibrating: the CUDA libraries' device memory in a fresh process on {device} \
             ({i} of {FOOTPRINT_PROCESSES})"
        ));
        match host.footprint(model, dtype, device) {
            Ok(f) => bytes.push(f.library_bytes),
            Err(e) => host.say(&format!(
                "calibrating: the CUDA libraries' device memory not measured ({device}): {e}"
            )),
        }
    }
    median_bytes(bytes)
}

/// The median of `bytes` (the upper of the middle two for an even count), rounded up to
/// MiB; `None` for none.
fn median_bytes(mut bytes: Vec<u64>) -> Option<ByteSize> {
    bytes.sort_unstable();
    bytes.get(bytes.len() / 2).map(|&b| ByteSize(b).ceil_mib())
}

#[cfg(test)]
mod tests {
    use super::super::{calibrate, Calibration};
    use super::*;
    use mold_exec::calibrate::Footprint;
    use std::path::Path;

    fn profile(name: &str) -> Machine {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../sim/machines");
        Machine::load(&root.join(format!("{name}.yaml"))).unwrap()
    }

    /// A host that records what it is told and answers the fresh processes from a list:
    /// `Ok` runs or footprints in turn, an error where the list has none left.
    #[derive(Default)]
    struct Fake {
        said: Vec<String>,
        first_use: Vec<(String, DeviceId, (u32, u32))>,
        runs: Vec<Vec<FirstUseRun>>,
        footprints: Vec<u64>,
        footprint_calls: usize,
    }

    impl Host for Fake {
        fn say(&mut self, line: &str) {
            self.said.push(line.to_string());
        }
        fn first_use(
            &mut self,
            model: &str,
            device: &DeviceId,
            size: (u32, u32),
        ) -> Result<Vec<FirstUseRun>, String> {
            self.first_use
                .push((model.to_string(), device.clone(), size));
            self.runs
                .pop()
                .ok_or_else(|| "the child failed".to_string())
        }
        fn footprint(
            &mut self,
            _model: &str,
            _dtype: DType,
            device: &DeviceId,
        ) -> Result<Footprint, String> {
            self.footprint_calls += 1;
            let b = self.footprints.pop().ok_or("no allocator")?;
            Ok(Footprint {
                device: device.clone(),
                library_bytes: b,
                used_bytes: b,
                pool_reserved_bytes: None,
                pool_live_bytes: None,
                operations: 1,
            })
        }
    }

    fn tiny(timing: Option<Timing>) -> ModelCalibration {
        let spec = mold_models::find("flux-tiny").unwrap();
        ModelCalibration {
            model: "flux-tiny".into(),
            dtype: DType::F32,
            spec,
            extra: Vec::new(),
            timing,
            kernels: Kernels::Auto,
            comm: CommOptions::default(),
        }
    }

    /// Calibration by operation measures each kind of GPU this process reaches once:
    /// a mixed box gives two kinds, a two-node box only its first node's devices.
    #[test]
    fn device_kinds_are_the_local_nodes_kinds() {
        let mixed = device_kinds(&profile("rtx3090+rtx4060ti"));
        assert_eq!(mixed.len(), 2, "{mixed:?}");
        assert!(mixed.iter().all(|k| k.len() == 1), "{mixed:?}");
        let two_nodes = profile("2x8-h100-ib");
        let kinds = device_kinds(&two_nodes);
        assert_eq!(kinds.len(), 1, "{kinds:?}");
        assert_eq!(kinds[0].len(), 8, "{kinds:?}");
        let first_node = &two_nodes.devices[0].node;
        assert!(kinds[0]
            .iter()
            .all(|d| &two_nodes.device(d).unwrap().node == first_node));
        assert_eq!(device_kinds(&profile("cpu-emu-4"))[0].len(), 4);
    }

    /// GPUs are timed inside their blocks unless told otherwise; emulated devices alone.
    #[test]
    fn operations_on_gpus_are_timed_in_their_mix_by_default() {
        let gpus = [DeviceId::Cuda(0), DeviceId::Cuda(1)];
        let emu = [DeviceId::Emu(0)];
        assert_eq!(op_timing(None, &gpus), Timing::MIXED);
        assert_eq!(op_timing(None, &emu), Timing::Alone);
        assert_eq!(op_timing(Some(Timing::SUSTAINED), &gpus), Timing::SUSTAINED);
        assert_eq!(op_timing(Some(Timing::Alone), &gpus), Timing::Alone);
        assert_eq!(op_timing(Some(Timing::MIXED), &emu), Timing::MIXED);
    }

    /// flux-tiny on one emulated device: one table, added to the profile with its note;
    /// first use asked of five fresh processes (three decoder sizes, taken in turn), a
    /// failed one said in one line and the others' runs recorded; no footprint off GPUs.
    #[test]
    fn a_model_is_measured_in_order_into_the_profile() {
        let mut m = profile("cpu-emu-4");
        m.devices.truncate(1);
        m.links.peer.clear();
        let run = |component: &str, size: u64| FirstUseRun {
            component: component.into(),
            size,
            cold_seconds: 0.5,
            warm_seconds: 0.25,
        };
        let mut host = Fake {
            // Four processes answer (popped from the end), the fifth fails.
            runs: (0..4).map(|_| vec![run("vae", 64 * 64)]).collect(),
            ..Fake::default()
        };
        let done = calibrate(
            &mut m,
            Calibration {
                devices: None,
                model: Some(tiny(None)),
                date: "2030-01-02".into(),
                mold_version: "9.9.9".into(),
            },
            &mut host,
        )
        .unwrap();
        assert_eq!(done.tables.len(), 1);
        let (t, timing) = &done.tables[0];
        assert_eq!(*timing, Timing::Alone);
        assert_eq!(m.ops, vec![t.clone()]);
        assert!(
            m.calibration
                .notes
                .contains("measured by mold 9.9.9 on 2030-01-02"),
            "{}",
            m.calibration.notes
        );
        let sizes: Vec<(u32, u32)> = host.first_use.iter().map(|c| c.2).collect();
        assert_eq!(sizes.len(), FIRST_USE_PROCESSES, "{sizes:?}");
        assert_eq!(sizes[0], sizes[3], "{sizes:?}");
        assert_ne!(sizes[0], sizes[1], "{sizes:?}");
        assert!(host.first_use.iter().all(|c| c.0 == "flux-tiny"));
        let vae = t
            .components
            .iter()
            .find(|p| p.component == "vae" && p.size == 64 * 64)
            .unwrap();
        assert_eq!(vae.first_use_seconds, Some(0.25));
        let failed: Vec<&String> = host
            .said
            .iter()
            .filter(|s| s.contains("not measured") && s.contains("the child failed"))
            .collect();
        assert_eq!(failed.len(), 1, "{:?}", host.said);
        assert_eq!(host.footprint_calls, 0);
        assert!(
            host.said
                .last()
                .unwrap()
                .starts_with("operation tables: flux-tiny f32"),
            "{:?}",
            host.said
        );
        assert!(host
            .said
            .iter()
            .all(|s| s.starts_with("calibrating: ") || s.starts_with("operation tables: ")));
    }

    /// qwen-image-tiny: its language model and decoder measured into the table, and the cost
    /// model then prices its encode (both prompts of true CFG) and decode from them.
    #[test]
    fn qwen_image_encode_and_decode_are_priced_from_their_runs() {
        let mut m = profile("cpu-emu-4");
        m.devices.truncate(1);
        m.links.peer.clear();
        let mut host = Fake::default();
        let spec = mold_models::find("qwen-image-tiny").unwrap();
        let done = calibrate(
            &mut m,
            Calibration {
                devices: None,
                model: Some(ModelCalibration {
                    model: "qwen-image-tiny".into(),
                    spec: spec.clone(),
                    ..tiny(None)
                }),
                date: "2030-01-02".into(),
                mold_version: "9.9.9".into(),
            },
            &mut host,
        )
        .unwrap();
        let t = &done.tables[0].0;
        let point = |c: &str| t.components.iter().find(|p| p.component == c).unwrap();
        let text = point("qwen2.5-vl");
        assert_eq!(text.size, spec.text_tokens as u64);
        let w = spec.default_workload.clone();
        let ctx = mold_cost::Ctx::new(&spec, &m, &w);
        let on = m.devices[0].id.clone();
        let c = spec.component("qwen2.5-vl").unwrap();
        let e = ctx.component_estimate(c, &on, c.default_dtype).unwrap();
        let prompts = w.effective_batch() as f64;
        assert!(prompts >= 2.0, "true CFG encodes two prompts: {prompts}");
        assert!((e.seconds - text.seconds * prompts).abs() < 1e-12, "{e:?}");
        let vae = spec.component("vae").unwrap();
        assert!(ctx
            .component_estimate(vae, &on, vae.default_dtype)
            .is_some());
    }

    /// What cannot be calibrated is refused before anything is measured.
    #[test]
    fn what_cannot_be_calibrated_is_refused_before_measuring() {
        let mut host = Fake::default();
        let mut empty = profile("cpu-emu-4");
        empty.devices.clear();
        let req = || Calibration {
            devices: None,
            model: Some(tiny(None)),
            date: String::new(),
            mold_version: String::new(),
        };
        let e = calibrate(&mut empty, req(), &mut host).unwrap_err();
        assert_eq!(e.to_string(), "the machine profile has no device");
        let mut m = profile("cpu-emu-4");
        let mut c = req();
        let mut other = tiny(None);
        other.spec.transformer.kinds[0].streams = 3;
        c.model = Some(other);
        let e = calibrate(&mut m, c, &mut host).unwrap_err().to_string();
        assert!(e.starts_with("model flux-tiny: its `"), "{e}");
        assert!(check_model(&mold_models::find("flux-tiny").unwrap()).is_ok());
        assert!(host.said.is_empty(), "{:?}", host.said);
    }

    /// The libraries' memory is the median of the processes that answered (the upper
    /// of two), rounded up to MiB; none answering gives none, each failure said.
    #[test]
    fn the_libraries_memory_is_the_median_of_fresh_processes() {
        let dev = DeviceId::Cuda(0);
        let mut host = Fake {
            footprints: vec![300 << 20, (100 << 20) + 1, 200 << 20],
            ..Fake::default()
        };
        let b = measure_libraries("flux-tiny", DType::Bf16, &dev, &mut host);
        assert_eq!(b, Some(ByteSize(200 << 20)));
        assert_eq!(host.footprint_calls, FOOTPRINT_PROCESSES);
        let mut host = Fake {
            footprints: vec![(100 << 20) + 1, 50 << 20],
            ..Fake::default()
        };
        let b = measure_libraries("flux-tiny", DType::Bf16, &dev, &mut host);
        assert_eq!(b, Some(ByteSize(101 << 20)));
        let failed = host.said.iter().filter(|s| s.contains("no allocator"));
        assert_eq!(failed.count(), 1, "{:?}", host.said);
        let mut host = Fake::default();
        assert_eq!(
            measure_libraries("flux-tiny", DType::Bf16, &dev, &mut host),
            None
        );
        assert_eq!(median_bytes(Vec::new()), None);
    }
}
