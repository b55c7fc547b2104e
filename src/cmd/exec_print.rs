//! What `mold exec` prints: a run's [`Event`]s as they come, and its outcome (a
//! benchmark's measurements and `--verify`, a text-to-image run's last line), as lines,
//! bars and JSON events through the [`Reporter`].

use super::progress::{hex, say, Reporter};
use mold_exec::{Executor, Transformer};
use mold_pipeline::run::Benchable;
use mold_pipeline::sampling::StepTime;
use mold_pipeline::session::bench::{BenchDone, Verified};
use mold_pipeline::session::image::Predicted;
use mold_pipeline::session::Event;
use mold_plan::{ByteSize, Plan};
use serde_json::json;

/// What a run reports on the way, as lines (stderr for LoRAs and warnings, as ever),
/// bars and JSON events; a benchmark's steps are [`run_bench`]'s.
pub fn say_event(rep: &Reporter, e: Event) {
    match e {
        Event::Lora(l) => eprintln!(
            "lora   {} (strength {}) merged at load",
            l.path.display(),
            l.strength
        ),
        Event::Warning(w) => eprintln!("warning: {w}"),
        Event::Progress(p) => rep.pipeline(p),
        Event::Process { launch: l, own } => {
            let local: Vec<String> = own
                .devices()
                .iter()
                .map(|(d, x)| format!("{d} as {x}"))
                .collect();
            let (local_rank, per_node) = own.local_rank();
            let via = match l.launcher {
                mold_exec::dist::Launcher::Mold => String::new(),
                other => format!(", from {other}'s variables"),
            };
            say!(
                rep,
                "process {} of {}: runs {} (node {}, process {local_rank} of {per_node} there; \
                 sees {}; master {}{via})",
                l.rank,
                l.world,
                local.join(", "),
                own.node(),
                own.ordinals(),
                l.master
            );
            rep.event(json!({
                "event": "process",
                "rank": l.rank,
                "world": l.world,
                "node": own.node(),
                "local_rank": local_rank,
                "launcher": l.launcher.to_string(),
                "master": l.master,
                "devices": local,
            }));
        }
        Event::Joined { processes, seconds } => {
            say!(rep, "all {processes} processes joined in {seconds:.2} s");
            rep.event(json!({"event": "joined", "processes": processes, "seconds": seconds}));
        }
        Event::Loading { weights } => rep.spin(format!("loading {}", weights.display())),
        Event::Loaded {
            weights,
            seconds,
            weight_bytes,
            phases,
        } => {
            rep.clear();
            say!(rep, "loaded {} in {seconds:.2} s", weights.display());
            let split: Vec<String> = phases
                .iter()
                .filter(|(_, s)| *s >= 0.005)
                .map(|(what, s)| format!("{what} {s:.2} s"))
                .collect();
            if !split.is_empty() {
                say!(rep, "  load: {}", split.join(", "));
            }
            rep.event(json!({
                "event": "loaded",
                "component": "transformer",
                "weights": weights.display().to_string(),
                "seconds": seconds,
                "weight_bytes": weight_bytes,
                "phases": phases
                    .iter()
                    .map(|(what, s)| json!({"phase": what, "seconds": s}))
                    .collect::<Vec<_>>(),
            }));
        }
        Event::ProcessHandOff {
            part,
            from,
            to,
            path,
        } => {
            say!(
                rep,
                "hand-off after part {part}: process {from} -> process {to} over {path}"
            );
            rep.event(
                json!({"event": "process_hand_off", "part": part, "from": from, "to": to, "path": path}),
            );
        }
        Event::WroteIo { path } => {
            say!(
                rep,
                "wrote {} (the benchmark's inputs and one transformer call's output)",
                path.display()
            );
            rep.event(json!({"event": "wrote", "path": path.display().to_string()}));
        }
        Event::LoadedUncond { seconds } => say!(
            rep,
            "loaded transformer (unconditional) on the second replica in {seconds:.2} s"
        ),
        // A benchmark's steps: `run_bench` prints them beside the plan's prediction.
        Event::Step(_) => {}
    }
}

/// A benchmark's step `s` of `steps`, beside the plan's prediction: a line (plain), the
/// bar (bars) or an event (`--json`).
pub fn say_step(rep: &Reporter, s: StepTime, steps: u32, predicted: f64) {
    let digest = s.digest.map(hex);
    let latents = digest
        .as_deref()
        .map(|d| format!("   latents {d}"))
        .unwrap_or_default();
    rep.plain(format_args!(
        "step {:>3}/{steps}: {:.4} s   (plan predicted {:.4} s){latents}",
        s.index + 1,
        s.seconds,
        predicted,
    ));
    rep.step(s.index as u32 + 1, steps, s.seconds);
    rep.event(json!({
        "event": "step",
        "index": s.index + 1,
        "steps": steps,
        "seconds": s.seconds,
        "predicted_s": predicted,
        "digest": digest,
    }));
}

/// What a benchmark measured: the median step against the plan's, the attention that
/// ran, the output's digest (the result line), the profile (`MOLD_PROFILE`), each
/// device's memory against the plan's peak, streaming and the hand-offs between GPUs.
pub fn say_bench<M: Benchable>(
    rep: &Reporter,
    plan: &Plan,
    done: &BenchDone<M>,
) -> anyhow::Result<()> {
    let predicted = plan.predicted.step_time_s;
    let (median, over) = step_median(&done.times);
    say!(
        rep,
        "step time: median {median:.4} s over {over}; plan predicted {predicted:.4} s"
    );
    say_attention(rep);
    say_plans(rep);
    say_fp8(rep);
    let digest = mold_exec::digest(&done.out)?;
    rep.result(
        format_args!("output digest: {digest:016x}"),
        json!({
            "event": "result",
            "median_step_s": median,
            "median_over": over,
            "predicted_step_s": predicted,
            "output_digest": hex(digest),
        }),
    );
    let exec = &done.exec;
    if exec.profiling() {
        let measured = done.measured_steps();
        let how = if exec.options().profile_events {
            "MOLD_PROFILE=events: GPU time between CUDA events recorded at each mark, nothing waits"
        } else {
            "MOLD_PROFILE: device synchronised at each mark, so slower than a plain step"
        };
        say!(rep, "\nprofile ({how}), per step:");
        for (dev, phases) in exec.profile_report() {
            let total: f64 = phases.iter().map(|p| p.1).sum();
            say!(
                rep,
                "  {dev}: {:.2} ms in marked phases",
                total / measured * 1e3
            );
            let mut per_phase = Vec::new();
            for (label, secs, n) in phases {
                say!(
                    rep,
                    "    {label:<28} {:>9.2} ms  {:>5.1}%  ({} marks)",
                    secs / measured * 1e3,
                    100.0 * secs / total.max(1e-12),
                    n as f64 / measured
                );
                per_phase.push(json!({
                    "phase": label,
                    "ms_per_step": secs / measured * 1e3,
                    "marks_per_step": n as f64 / measured,
                }));
            }
            rep.event(json!({"event": "profile", "device": dev.to_string(), "phases": per_phase}));
        }
    }
    say!(rep, "\nmemory (accounted from tensor shapes)   weights  stream buffers  largest activation | plan: peak");
    for m in exec.memory_report() {
        let planned = plan
            .predicted
            .devices
            .iter()
            .find(|d| d.device == m.device)
            .map(|d| d.peak);
        rep.event(json!({
            "event": "memory",
            "device": m.device.to_string(),
            "weight_bytes": m.resident_weight_bytes,
            "stream_buffer_bytes": m.stream_buffer_bytes,
            "largest_activation_bytes": m.largest_activation_bytes,
            "modulation_ahead_bytes": m.ahead_bytes,
            "predicted_peak_bytes": planned.map(|b| b.0),
        }));
        let p = planned.map(|b| b.human()).unwrap_or_else(|| "-".into());
        say!(
            rep,
            "  {:<10} {:>28} {:>15} {:>19} | {p}",
            m.device.to_string(),
            ByteSize(m.resident_weight_bytes).human(),
            ByteSize(m.stream_buffer_bytes).human(),
            ByteSize(m.largest_activation_bytes).human(),
        );
    }
    print_streaming(exec, rep);
    for (from, to, peer) in mold_exec::runtime::hand_off_paths() {
        let how = if peer {
            "peer copy (cuDeviceCanAccessPeer)"
        } else {
            "through host memory (no peer access, or --no-peer)"
        };
        say!(rep, "  hand-off cuda:{from} -> cuda:{to}: {how}");
        rep.event(json!({"event": "hand_off", "from": format!("cuda:{from}"), "to": format!("cuda:{to}"), "peer": peer}));
    }
    Ok(())
}

/// `--verify`'s outcome (the result line, or which process made the comparison); the
/// exit code: 1 above the tolerance.
pub fn say_verified(rep: &Reporter, v: &Verified) -> i32 {
    match v {
        Verified::ElsewhereBy(first) => {
            say!(rep, "\nverify: done by the process that runs {first}");
            rep.event(json!({"event": "verify", "done_by": first.to_string()}));
            0
        }
        Verified::Compared {
            error,
            tolerance,
            device: first,
            f32,
        } => {
            let (err, tol, f32) = (*error, *tolerance, *f32);
            let precision = if f32 { "f32" } else { "the plan's dtype" };
            rep.result(
                format_args!("\nverify: max relative error {err:.3e} against the single-device reference on {first}, candle ops in {precision} (tolerance {tol:.0e})"),
                json!({
                    "event": "verify",
                    "reference_dtype": if f32 { "f32" } else { "plan" },
                    "max_relative_error": err,
                    "tolerance": tol,
                    "reference_device": first.to_string(),
                    "passed": err <= tol,
                }),
            );
            if err > tol {
                eprintln!("error: max relative error {err:.3e} is above the tolerance {tol:.0e}");
                return 1;
            }
            0
        }
    }
}

/// One line per device that streams: mode, buffers, host memory, copies.
pub fn print_streaming<M: Transformer>(exec: &Executor<M>, rep: &Reporter) {
    for m in exec.memory_report() {
        if m.stream_buffers == 0 {
            continue;
        }
        let host = if m.host_pinned {
            "page-locked"
        } else {
            "pageable"
        };
        let report = exec
            .streaming_report()
            .into_iter()
            .find(|(d, _)| d == &m.device)
            .map(|(_, r)| r);
        rep.event(json!({
            "event": "streaming",
            "device": m.device.to_string(),
            "mode": exec.streaming().to_string(),
            "host_bytes": m.host_weight_bytes,
            "host_pinned": m.host_pinned,
            "stream_buffers": m.stream_buffers,
            "stream_buffer_bytes": m.stream_buffer_bytes,
            "block_copies": report.as_ref().map(|r| r.copies),
            "ring_fills": report.as_ref().map(|r| r.restarts),
        }));
        let ring = report
            .map(|r| format!(", {} block copies, {} ring fill(s)", r.copies, r.restarts))
            .unwrap_or_default();
        say!(
            rep,
            "  {:<10} streams ({}): {} in {host} host memory, {} stream buffer(s) ({} on the device){ring}",
            m.device.to_string(),
            exec.streaming(),
            ByteSize(m.host_weight_bytes).human(),
            m.stream_buffers,
            ByteSize(m.stream_buffer_bytes).human(),
        );
    }
}

/// Seconds for people: `1.23 s`, `45.6 ms`, `0.030 ms`.
fn secs(x: f64) -> String {
    if x >= 1.0 {
        format!("{x:.2} s")
    } else if x >= 1e-3 {
        format!("{:.1} ms", x * 1e3)
    } else {
        format!("{:.3} ms", x * 1e3)
    }
}

/// A text-to-image run's last line (and `done` event): each stage's time beside the
/// prediction, and each device's accounted peak beside its predicted one.
pub fn say_done(rep: &Reporter, out: &mold_pipeline::Output, predicted: &Predicted) {
    let t = &out.timings;
    let median = {
        let mut s = t.step_s.clone();
        s.sort_by(f64::total_cmp);
        s[s.len() / 2]
    };
    let src = predicted.source;
    let mut peaks = Vec::new();
    let mut peak_events = Vec::new();
    for p in &out.peaks {
        let want = predicted
            .peaks
            .iter()
            .find(|(d, _)| d == &p.device)
            .map(|(_, b)| *b);
        peak_events.push(json!({
            "device": p.device.to_string(),
            "peak_bytes": p.peak_bytes,
            "predicted_bytes": want,
        }));
        let want = want
            .map(|b| ByteSize(b).human())
            .unwrap_or_else(|| "-".into());
        peaks.push(format!(
            "{} {} ({src} {want})",
            p.device,
            ByteSize(p.peak_bytes).human()
        ));
    }
    rep.event(json!({
        "event": "done",
        "total_s": t.total_s,
        "load_s": t.load_s,
        "encode_s": t.encode_s,
        "denoise_s": t.denoise_s,
        "decode_s": t.decode_s,
        "median_step_s": median,
        "predicted": {
            "source": src,
            "step_s": predicted.step_s,
            "encode_s": predicted.encode_s,
            "decode_s": predicted.decode_s,
        },
        "peaks": peak_events,
    }));
    say!(
        rep,
        "done in {}: load {} | encode {} ({src} {}) | denoise {}, median step {} ({src} {}) | decode {} ({src} {}) | peak memory, accounted: {}",
        secs(t.total_s),
        secs(t.load_s),
        secs(t.encode_s),
        secs(predicted.encode_s),
        secs(t.denoise_s),
        secs(median),
        secs(predicted.step_s),
        secs(t.decode_s),
        secs(predicted.decode_s),
        peaks.join(", ")
    );
    say_plans(rep);
    say_fp8(rep);
}

/// How FP8 products ran (FP8 matmuls, weight-only and why, emulated); nothing where the
/// plan has none.
fn say_fp8(rep: &Reporter) {
    let r = mold_exec::model::fp8::report();
    if r.products + r.weight_only + r.emulated == 0 {
        return;
    }
    say!(rep, "{r}");
    rep.event(json!({"event": "fp8_products", "fp8_matmuls": r.products,
        "weight_only": r.weight_only, "emulated": r.emulated,
        "weight_only_because": r.weight_only_because}));
}

/// Which attention implementations ran (cuDNN, mold's kernel, candle's ops) and, where
/// cuDNN was allowed but passed over, why.
fn say_attention(rep: &Reporter) {
    let r = mold_exec::attention_report();
    if r.calls.is_empty() {
        return;
    }
    let calls: Vec<String> = r
        .calls
        .iter()
        .map(|(k, n)| format!("{k} ({n} calls)"))
        .collect();
    say!(rep, "attention: {}", calls.join(", "));
    for why in &r.cudnn_refusals {
        say!(rep, "  cuDNN not used: {why}");
    }
    rep.event(json!({"event": "attention", "calls": r.calls, "cudnn_refusals": r.cudnn_refusals}));
}

/// How this process's cuDNN plans came: built (runtime-compiled or not) or read back from
/// the cache directory; nothing where cuDNN built none.
fn say_plans(rep: &Reporter) {
    let c = mold_exec::model::plan_cache::counts();
    if c.built + c.kept == 0 {
        return;
    }
    say!(rep, "{c}");
    rep.event(
        json!({"event": "cudnn_plans", "built": c.built, "runtime_compiled": c.runtime_compiled,
        "read_back": c.kept, "seconds": c.seconds, "not_kept": c.store_failures}),
    );
}

/// Median step time, leaving out the first step (kernel loading, allocator warm-up)
/// when there are later ones; with the description of what it covers.
fn step_median(times: &[f64]) -> (f64, String) {
    let (rest, what) = if times.len() > 1 {
        (
            &times[1..],
            format!("steps 2..{} (step 1 is warm-up)", times.len()),
        )
    } else {
        (times, format!("{} step", times.len()))
    };
    let mut v = rest.to_vec();
    v.sort_by(f64::total_cmp);
    (v.get(v.len() / 2).copied().unwrap_or(0.0), what)
}

#[cfg(test)]
mod tests {
    use super::step_median;

    #[test]
    fn step_median_leaves_out_the_warm_up_step() {
        let (m, what) = step_median(&[9.0, 0.3, 0.1, 0.2]);
        assert_eq!(m, 0.2);
        assert!(what.contains("steps 2..4"), "{what}");
        assert_eq!(step_median(&[0.5]).0, 0.5);
        assert_eq!(step_median(&[]).0, 0.0);
    }
}
