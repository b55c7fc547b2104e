//! `mold exec`'s run options, resolved at the edge: flags first, then the environment.
//! The libraries below get a [`mold_exec::ExecOptions`] and read no environment.

use anyhow::{anyhow, Result};
use mold_exec::{ExecOptions, Fault, Fp8Options, Kernels, Streaming};
use std::collections::BTreeMap;

/// A snapshot of the `MOLD_*` environment and the launchers' variables (torchrun's,
/// Slurm's: [`mold_exec::dist::LAUNCH_VARS`]); tests build one by hand. Its `Debug`
/// prints `MOLD_DIST_SECRET` as `<redacted>`.
#[derive(Clone, Default)]
pub struct EnvVars(BTreeMap<String, String>);

/// Variables whose values `Debug` does not show.
const SECRET_VARS: &[&str] = &["MOLD_DIST_SECRET"];

impl std::fmt::Debug for EnvVars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(k, v)| {
                let v = if SECRET_VARS.contains(&k.as_str()) {
                    "<redacted>"
                } else {
                    v.as_str()
                };
                (k, v)
            }))
            .finish()
    }
}

impl EnvVars {
    /// This process's `MOLD_*` variables and the launch variables mold reads.
    pub fn process() -> EnvVars {
        EnvVars(
            std::env::vars()
                .filter(|(k, _)| {
                    k.starts_with("MOLD_") || mold_exec::dist::LAUNCH_VARS.contains(&k.as_str())
                })
                .collect(),
        )
    }

    #[cfg(test)]
    pub fn of(pairs: &[(&str, &str)]) -> EnvVars {
        EnvVars(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    /// A variable's value, when it is set and not blank.
    pub fn get(&self, k: &str) -> Option<String> {
        self.0.get(k).filter(|v| !v.trim().is_empty()).cloned()
    }
}

/// `m` on one line: control characters (a value's newline) escaped.
fn one_line(m: &str) -> String {
    m.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The executor's options: `--streaming` else `MOLD_STREAMING` (default pinned),
/// `MOLD_KERNELS` (auto|fused|mold|cudnn|candle), `MOLD_PROFILE` (non-empty, not 0; `events`: GPU time by CUDA events), `MOLD_FAULT`
/// (DEVICE@BLOCK[:KIND]), `MOLD_HOST_MEMORY` (a size), `MOLD_LOAD` (staged|host),
/// `MOLD_MODULATION_AHEAD` (on|off), `MOLD_FP8_*` ([`Fp8Options::from_vars`]), `--deterministic` else
/// `MOLD_DETERMINISTIC` (non-empty, not 0), and the communication options. A malformed
/// value is an error naming the variable.
pub fn exec_options(
    streaming: Option<Streaming>,
    deterministic: bool,
    env: &EnvVars,
    comm: mold_exec::comm::CommOptions,
) -> Result<ExecOptions> {
    let streaming = match (streaming, env.get("MOLD_STREAMING")) {
        (Some(s), _) => s,
        (None, Some(v)) => {
            Streaming::parse(&v).map_err(|m| anyhow!("MOLD_STREAMING: {}", one_line(&m)))?
        }
        (None, None) => Streaming::default(),
    };
    let kernels = match env.get("MOLD_KERNELS") {
        Some(v) => Kernels::parse(&v).map_err(|m| anyhow!("{}", one_line(&m)))?,
        None => Kernels::Auto,
    };
    let profiling = env.get("MOLD_PROFILE").is_some_and(|v| v.trim() != "0");
    // `events`: GPU phases timed by CUDA events, nothing waits at the marks.
    let profile_events = env
        .get("MOLD_PROFILE")
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("events"));
    let deterministic = deterministic
        || env
            .get("MOLD_DETERMINISTIC")
            .is_some_and(|v| v.trim() != "0");
    let fault = match env.get("MOLD_FAULT") {
        Some(v) => Some(Fault::parse(&v).map_err(|m| anyhow!("{}", one_line(&m)))?),
        None => None,
    };
    let host_memory = match env.get("MOLD_HOST_MEMORY") {
        Some(v) => {
            let b: mold_plan::ByteSize = v
                .trim()
                .parse()
                .map_err(|e| anyhow!("MOLD_HOST_MEMORY={v:?}: {e} (write a size such as 64GiB)"))?;
            Some(b.0)
        }
        None => None,
    };
    let staged_load = match env.get("MOLD_LOAD") {
        None => true,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "staged" => true,
            "host" => false,
            _ => {
                return Err(anyhow!(
                    "MOLD_LOAD={}: use staged (the default: weights copied to the GPU through page-locked buffers) or host (read on the host, uploaded from pageable memory)",
                    one_line(&format!("{v:?}"))
                ))
            }
        },
    };
    let modulation_ahead = match env.get("MOLD_MODULATION_AHEAD") {
        None => true,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "on" | "1" => true,
            "off" | "0" => false,
            _ => {
                return Err(anyhow!(
                    "MOLD_MODULATION_AHEAD={}: give on (the default: each block's modulation computed for a window of steps at once) or off (every step's alone)",
                    one_line(&format!("{v:?}"))
                ))
            }
        },
    };
    let fp8 = Fp8Options::from_vars(|k| env.get(k)).map_err(|m| anyhow!("{}", one_line(&m)))?;
    Ok(ExecOptions {
        streaming,
        kernels,
        profiling,
        profile_events,
        fault,
        host_memory,
        comm,
        deterministic,
        // `mold exec --no-peer` turns it off (not an environment setting: it goes with
        // the NCCL setting the flag makes, `common::no_peer_access`).
        peer_copies: true,
        staged_load,
        modulation_ahead,
        fp8,
    })
}

/// What `mold exec` would run with here, for `mold info`: each option's value and where it
/// comes from (`MOLD_…` or `default`; flags, when given to `mold exec`, win over both). A
/// malformed variable is shown as such (exec refuses it).
pub fn describe(env: &EnvVars) -> Vec<(String, String, String)> {
    let opts = mold_exec::comm::CommOptions::from_vars(|k| env.get(k))
        .map_err(|e| e.to_string())
        .and_then(|c| exec_options(None, false, env, c).map_err(|e| e.to_string()));
    let src = |k: &str| {
        if env.get(k).is_some() {
            k.to_string()
        } else {
            "default".to_string()
        }
    };
    let o = match opts {
        Ok(o) => o,
        Err(e) => return vec![("error".into(), e, "environment".into())],
    };
    let secs = |d: Option<std::time::Duration>| match d {
        Some(d) => format!("{} s", d.as_secs_f64()),
        None => "off".into(),
    };
    vec![
        (
            "streaming".into(),
            o.streaming.to_string(),
            src("MOLD_STREAMING"),
        ),
        (
            "kernels".into(),
            format!("{:?}", o.kernels).to_lowercase(),
            src("MOLD_KERNELS"),
        ),
        (
            "profile".into(),
            o.profiling.to_string(),
            src("MOLD_PROFILE"),
        ),
        (
            "load".into(),
            if o.staged_load { "staged" } else { "host" }.into(),
            src("MOLD_LOAD"),
        ),
        (
            "modulation_ahead".into(),
            if o.modulation_ahead { "on" } else { "off" }.into(),
            src("MOLD_MODULATION_AHEAD"),
        ),
        (
            "fp8_fuse".into(),
            if o.fp8.quantize_in_norm { "on" } else { "off" }.into(),
            src("MOLD_FP8_FUSE"),
        ),
        (
            "fp8_fast_accum".into(),
            if o.fp8.fast_accumulation { "on" } else { "off" }.into(),
            src("MOLD_FP8_FAST_ACCUM"),
        ),
        (
            "fp8_quantize".into(),
            if o.fp8.plain_quantize {
                "plain"
            } else {
                "pieces"
            }
            .into(),
            src("MOLD_FP8_QUANTIZE"),
        ),
        (
            "fp8_attention".into(),
            match o.fp8.attention {
                None => "as the plan says",
                Some(true) => "on",
                Some(false) => "off",
            }
            .into(),
            src("MOLD_FP8_ATTENTION"),
        ),
        (
            "fp8_sm_carveout".into(),
            match o.fp8.sm_carveout {
                0 => "none".into(),
                n => format!("{n} SMs left beside the products"),
            },
            src("MOLD_FP8_SM_CARVEOUT"),
        ),
        (
            "fp8_exchange".into(),
            if o.fp8.exchange_e4m3 {
                "e4m3 (FP8 attention's q, k, v and output under sequence parallelism)"
            } else {
                "wide (in the activations' dtype)"
            }
            .into(),
            src("MOLD_FP8_EXCHANGE"),
        ),
        (
            "deterministic".into(),
            o.deterministic.to_string(),
            src("MOLD_DETERMINISTIC"),
        ),
        (
            "fault".into(),
            o.fault
                .map(|f| format!("{}@{} {}", f.device, f.block_kind, f.block_index))
                .unwrap_or_else(|| "none".into()),
            src("MOLD_FAULT"),
        ),
        (
            "host_memory".into(),
            o.host_memory
                .map(|b| mold_plan::ByteSize(b).human())
                .unwrap_or_else(|| "what the host reports".into()),
            src("MOLD_HOST_MEMORY"),
        ),
        (
            "nccl_timeout".into(),
            secs(o.comm.nccl_timeout),
            src("MOLD_NCCL_TIMEOUT_S"),
        ),
        (
            "dist_timeout".into(),
            secs(Some(o.comm.dist_timeout)),
            src("MOLD_DIST_TIMEOUT_S"),
        ),
        (
            "dist_secret".into(),
            if o.comm.secret.is_some() {
                "set"
            } else {
                "none"
            }
            .into(),
            src("MOLD_DIST_SECRET"),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(streaming: Option<Streaming>, env: &[(&str, &str)]) -> Result<ExecOptions> {
        exec_options(streaming, false, &EnvVars::of(env), Default::default())
    }

    #[test]
    fn defaults_without_environment() {
        let o = opts(None, &[]).unwrap();
        assert_eq!(o.streaming, Streaming::Pinned);
        assert_eq!(o.kernels, Kernels::Auto);
        assert!(!o.profiling && o.fault.is_none() && o.host_memory.is_none());
    }

    #[test]
    fn flag_beats_environment_and_each_variable_is_read() {
        let env = [
            ("MOLD_STREAMING", "sync"),
            ("MOLD_KERNELS", "candle"),
            ("MOLD_PROFILE", "1"),
            ("MOLD_FAULT", "emu:1@single 2:panic"),
            ("MOLD_HOST_MEMORY", "2GiB"),
        ];
        let o = opts(None, &env).unwrap();
        assert_eq!(o.streaming, Streaming::Sync);
        assert_eq!(o.kernels, Kernels::Candle);
        assert!(o.profiling);
        let f = o.fault.unwrap();
        assert_eq!((f.block_kind.as_str(), f.block_index), ("single", 2));
        assert_eq!(o.host_memory, Some(2 << 30));
        assert!(o.staged_load);
        assert!(!opts(None, &[("MOLD_LOAD", " Host")]).unwrap().staged_load);
        assert!(opts(None, &[("MOLD_LOAD", "staged")]).unwrap().staged_load);
        assert!(o.modulation_ahead);
        assert!(
            !opts(None, &[("MOLD_MODULATION_AHEAD", "off")])
                .unwrap()
                .modulation_ahead
        );
        assert!(
            opts(None, &[("MOLD_MODULATION_AHEAD", " 1")])
                .unwrap()
                .modulation_ahead
        );
        assert_eq!(o.fp8, Fp8Options::default());
        assert!(o.fp8.quantize_in_norm && o.fp8.fast_accumulation && !o.fp8.plain_quantize);
        let f = opts(
            None,
            &[
                ("MOLD_FP8_FUSE", "off"),
                ("MOLD_FP8_FAST_ACCUM", " 0"),
                ("MOLD_FP8_QUANTIZE", "Plain"),
                ("MOLD_FP8_ATTENTION", "ON"),
            ],
        )
        .unwrap()
        .fp8;
        assert!(!f.quantize_in_norm && !f.fast_accumulation && f.plain_quantize);
        assert_eq!(f.attention, Some(true));
        assert_eq!(opts(None, &[]).unwrap().fp8.attention, None);
        assert_eq!(opts(None, &[]).unwrap().fp8.sm_carveout, 0);
        assert!(opts(None, &[]).unwrap().fp8.exchange_e4m3);
        assert!(
            !opts(None, &[("MOLD_FP8_EXCHANGE", "Wide")])
                .unwrap()
                .fp8
                .exchange_e4m3
        );
        let e = opts(None, &[("MOLD_FP8_EXCHANGE", "bf16")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("MOLD_FP8_EXCHANGE") && e.contains("e4m3") && e.contains("wide"),
            "{e}"
        );
        assert_eq!(
            opts(None, &[("MOLD_FP8_SM_CARVEOUT", " 16")])
                .unwrap()
                .fp8
                .sm_carveout,
            16
        );
        for bad in ["-1", "2000", "many"] {
            let e = opts(None, &[("MOLD_FP8_SM_CARVEOUT", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("MOLD_FP8_SM_CARVEOUT") && e.contains("0 (the default) to 1024"),
                "{e}"
            );
        }
        assert_eq!(
            opts(None, &[("MOLD_FP8_ATTENTION", "off")])
                .unwrap()
                .fp8
                .attention,
            Some(false)
        );
        let o = opts(Some(Streaming::Pageable), &env).unwrap();
        assert_eq!(o.streaming, Streaming::Pageable);
        assert!(!opts(None, &[("MOLD_PROFILE", "0")]).unwrap().profiling);
        assert!(!o.profile_events);
        let ev = opts(None, &[("MOLD_PROFILE", " Events")]).unwrap();
        assert!(ev.profiling && ev.profile_events);
        assert!(!opts(None, &[]).unwrap().deterministic);
        assert!(
            opts(None, &[("MOLD_DETERMINISTIC", "1")])
                .unwrap()
                .deterministic
        );
        assert!(
            !opts(None, &[("MOLD_DETERMINISTIC", "0")])
                .unwrap()
                .deterministic
        );
    }

    #[test]
    fn describe_names_each_source() {
        let d = describe(&EnvVars::of(&[("MOLD_KERNELS", "candle")]));
        let k = d.iter().find(|(n, _, _)| n == "kernels").unwrap();
        assert_eq!((k.1.as_str(), k.2.as_str()), ("candle", "MOLD_KERNELS"));
        let s = d.iter().find(|(n, _, _)| n == "streaming").unwrap();
        assert_eq!((s.1.as_str(), s.2.as_str()), ("pinned", "default"));
        let bad = describe(&EnvVars::of(&[("MOLD_KERNELS", "fast")]));
        assert!(bad[0].1.contains("MOLD_KERNELS"), "{bad:?}");
    }

    #[test]
    fn the_secret_is_never_shown() {
        let env = EnvVars::of(&[("MOLD_DIST_SECRET", "hunter2"), ("MOLD_KERNELS", "candle")]);
        let d = describe(&env);
        let s = d.iter().find(|(n, _, _)| n == "dist_secret").unwrap();
        assert_eq!((s.1.as_str(), s.2.as_str()), ("set", "MOLD_DIST_SECRET"));
        let comm = mold_exec::comm::CommOptions::from_vars(|k| env.get(k)).unwrap();
        let o = exec_options(None, false, &env, comm).unwrap();
        let shown = format!("{d:?} {env:?} {o:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(format!("{env:?}").contains("\"MOLD_DIST_SECRET\": \"<redacted>\""));
        assert!(format!("{env:?}").contains("\"MOLD_KERNELS\": \"candle\""));
    }

    #[test]
    fn timeouts_out_of_range_are_one_line_naming_them() {
        // `Duration::from_secs_f64` panicked on 1e20.
        for v in ["1e20", "inf", "nan", "-1"] {
            for k in ["MOLD_NCCL_TIMEOUT_S", "MOLD_DIST_TIMEOUT_S"] {
                let d = describe(&EnvVars::of(&[(k, v)]));
                assert_eq!(d[0].0, "error", "{k}={v}: {d:?}");
                assert!(d[0].1.contains(&format!("{k}=\"{v}\"")), "{d:?}");
                assert_eq!(d[0].1.lines().count(), 1, "{d:?}");
            }
        }
    }

    #[test]
    fn bad_values_name_their_variable() {
        for (k, v) in [
            ("MOLD_STREAMING", "fast"),
            ("MOLD_KERNELS", "fast"),
            ("MOLD_FAULT", "emu:1"),
            ("MOLD_HOST_MEMORY", "lots"),
            ("MOLD_HOST_MEMORY", "1\nXB"),
            ("MOLD_LOAD", "fast"),
            ("MOLD_LOAD", "a\nb"),
            ("MOLD_MODULATION_AHEAD", "yes"),
            ("MOLD_MODULATION_AHEAD", "a\nb"),
            ("MOLD_FP8_FUSE", "false"),
            ("MOLD_FP8_FAST_ACCUM", "fast"),
            ("MOLD_FP8_QUANTIZE", "a\nb"),
            ("MOLD_FP8_ATTENTION", "fp8"),
            ("MOLD_FP8_SM_CARVEOUT", "a\nb"),
            ("MOLD_STREAMING", "a\nb"),
            ("MOLD_KERNELS", "a\nb"),
            ("MOLD_FAULT", "a\nb"),
        ] {
            let e = opts(None, &[(k, v)]).unwrap_err().to_string();
            assert!(e.contains(k), "{k}: {e}");
            assert_eq!(e.lines().count(), 1, "{e}");
        }
    }
}
