//! Communication settings, resolved once at the CLI edge ([`CommOptions::from_vars`]) and
//! passed down: nothing below reads the environment.

use crate::error::{ExecError, Result};
use std::time::Duration;

/// Default NCCL watchdog (`MOLD_NCCL_TIMEOUT_S`), seconds.
pub const DEFAULT_NCCL_TIMEOUT_S: f64 = 120.0;
/// Default of `MOLD_DIST_TIMEOUT_S`, seconds.
pub const DEFAULT_DIST_TIMEOUT_S: f64 = 120.0;
/// Default for a connection to the rendezvous to say who it is.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`CommOptions::overlap_chunks`] (`MOLD_OVERLAP_CHUNKS`).
/// 1: measured on 4 × H100 (NVLink), chunked sums made FLUX.1-dev steps slower (TP2 81.8 →
/// 83.9 / 88.0 ms with 2 / 4 chunks, TP4 58.8 → 61.2 / 61.8): NCCL's kernels take SMs from
/// the products they run beside (BENCHMARKS.md).
pub const DEFAULT_OVERLAP_CHUNKS: usize = 1;
/// Default of [`CommOptions::exchange_beside`] (`MOLD_SP_OVERLAP`).
pub const DEFAULT_EXCHANGE_BESIDE: bool = true;
/// The most chunks `MOLD_OVERLAP_CHUNKS` may ask for.
pub const MAX_OVERLAP_CHUNKS: usize = 64;
/// Default of [`CommOptions::pending_per_addr`].
pub const DEFAULT_PENDING_PER_ADDR: usize = 16;
/// The longest any of the `MOLD_*_TIMEOUT_S` variables may ask for: a week, in seconds.
pub const MAX_TIMEOUT_S: f64 = 7.0 * 24.0 * 3600.0;

/// How a one-process group of more than two GPUs with peer access runs sequence
/// parallelism's all-to-alls ([`CommOptions::large_group_copies`]). On 4 × H200 (FLUX.1-dev
/// SP4, 2026-11-28, BENCHMARKS.md) the copy engines did not beat NCCL: 43.3–49.2 ms a step
/// on one copy stream and 47.8–55.4 ms on one per peer, against 44.3–44.8 ms by NCCL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LargeGroupCopies {
    /// NCCL's all-to-all, between the products (the default).
    Off,
    /// The copy engines, each rank's messages one after another on one copy stream.
    OneStream,
    /// The copy engines, each receiver's message on a copy stream of its own.
    PerPeer,
}

/// The shared secret of a multi-process run (`MOLD_DIST_SECRET`). Its `Debug` prints
/// `<redacted>`, so options can be logged; only [`Secret::expose`] gives the text.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret's bytes, for the handshake's proofs.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Secret {
        Secret(s.to_string())
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Secret {
        Secret(s)
    }
}

/// How collectives and the multi-process transport behave.
#[derive(Clone, Debug, PartialEq)]
pub struct CommOptions {
    /// NCCL watchdog: the longest an NCCL group's creation or one of its all-reduces may
    /// take before the group is aborted; `None` turns the watchdog off (a hang is then not
    /// detected). `MOLD_NCCL_TIMEOUT_S` (0 = off), default [`DEFAULT_NCCL_TIMEOUT_S`].
    pub nccl_timeout: Option<Duration>,
    /// The longest a process waits for another (rendezvous, a hand-off, a host-staged
    /// all-reduce, a write to a process that stopped reading). `MOLD_DIST_TIMEOUT_S`,
    /// default [`DEFAULT_DIST_TIMEOUT_S`].
    pub dist_timeout: Duration,
    /// The longest a new connection to a process's rendezvous listener may take, from
    /// its accept to the end of its handshake, before it is dropped (capped by
    /// `dist_timeout`): one deadline for the whole handshake, not for each read.
    pub handshake_timeout: Duration,
    /// The most connections from one IP address whose handshake is read at once; more
    /// are dropped unread (a process whose connection is dropped connects again).
    pub pending_per_addr: usize,
    /// The secret every process of a multi-process run proves it knows (an HMAC over
    /// fresh nonces, both ways; the secret itself never travels). `MOLD_DIST_SECRET`,
    /// default none, which only a loopback `MOLD_MASTER_ADDR` allows.
    pub secret: Option<Secret>,
    /// Token chunks a tensor-parallel group splits each row-parallel product into, so
    /// each chunk's all-reduce runs beside the next chunk's product ([`super::Comm::
    /// overlap_chunks`]); 1 sums once after the whole product. `MOLD_OVERLAP_CHUNKS`,
    /// default [`DEFAULT_OVERLAP_CHUNKS`].
    pub overlap_chunks: usize,
    /// A one-process group of two GPUs with peer access (of more, see
    /// [`CommOptions::large_group_copies`]) runs its all-to-alls by the copy engines on a
    /// stream of its own, beside the products the model queues while they
    /// move (FLUX's single blocks: the MLP products under both of sequence parallelism's
    /// all-to-alls; [`super::Comm::all_to_all_start`]), instead of NCCL's on the compute
    /// stream. Off, or without peer access (`--no-peer` turns it off), NCCL's.
    /// `MOLD_SP_OVERLAP=on|off`, default [`DEFAULT_EXCHANGE_BESIDE`].
    pub exchange_beside: bool,
    /// Times each copy-engine all-to-all with CUDA events and prints, per forward pass and
    /// rank, where its time went (`MOLD_SP_TRACE=1`; for measuring, default off).
    pub trace_exchanges: bool,
    /// Whether groups of more than two run their all-to-alls by the copy engines too
    /// (with [`CommOptions::exchange_beside`]), and on how many copy streams.
    /// `MOLD_SP_COPY_LARGE=off|one|per-peer`, default off.
    pub large_group_copies: LargeGroupCopies,
    /// Token-split tensor parallelism (Megatron's sequence parallelism inside a
    /// tensor-parallel group) in FLUX's and Qwen-Image's blocks: each rank keeps 1/N of the
    /// text and of the image tokens between products and runs the norms, modulation and
    /// gated residuals on them alone; all-gathers before the column-parallel products and
    /// a reduce-scatter after each row-parallel one replace the all-reduce
    /// ([`crate::model::token_split`]).
    /// `MOLD_TP_TOKEN_SPLIT=on|off`, default off (not yet measured on GPUs).
    pub token_split: bool,
    /// A one-process run starts its NCCL communicators while the weights load (true), or
    /// once they are loaded (false: the load's `waiting for the communicators` phase is
    /// then their whole start). `MOLD_COMM_WARM=during|after`, default during.
    pub warm_during_load: bool,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            nccl_timeout: Some(Duration::from_secs_f64(DEFAULT_NCCL_TIMEOUT_S)),
            dist_timeout: Duration::from_secs_f64(DEFAULT_DIST_TIMEOUT_S),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            pending_per_addr: DEFAULT_PENDING_PER_ADDR,
            secret: None,
            overlap_chunks: DEFAULT_OVERLAP_CHUNKS,
            exchange_beside: DEFAULT_EXCHANGE_BESIDE,
            trace_exchanges: false,
            large_group_copies: LargeGroupCopies::Off,
            token_split: false,
            warm_during_load: true,
        }
    }
}

/// Seconds from the variable `var` (its text `v`): a finite number above 0 and at most
/// [`MAX_TIMEOUT_S`], or 0 where `zero` says what 0 does (then `None`). Anything else —
/// NaN, infinite, negative, too large, not a number — is refused in one line naming
/// `var`. Every `*_TIMEOUT_S` variable goes through here (no `Duration::from_secs_f64`
/// on unchecked input: it panics on values too large for a `Duration`).
pub fn timeout_secs(var: &str, v: &str, zero: Option<&str>) -> Result<Option<Duration>> {
    let refuse = || {
        let lo = match zero {
            Some(what) => format!("0 ({what}) or more"),
            None => "more than 0".to_string(),
        };
        ExecError::Launch(format!(
            "{var}={v:?}: give seconds, {lo}, at most {MAX_TIMEOUT_S:.0} (a week)"
        ))
    };
    let s: f64 = v.trim().parse().map_err(|_| refuse())?;
    if s == 0.0 && zero.is_some() {
        return Ok(None);
    }
    if !(s.is_finite() && s > 0.0 && s <= MAX_TIMEOUT_S) {
        return Err(refuse());
    }
    // In range, so `from_secs_f64` cannot panic; `try_` keeps that true if the bound moves.
    Duration::try_from_secs_f64(s)
        .map(Some)
        .map_err(|_| refuse())
}

/// An on/off variable `var` (its text `v`): `on` or `1`, `off` or `0`; anything else is
/// refused in one line naming `var`, what it switches (`what`) and its default.
fn switch(var: &str, v: &str, what: &str, default: bool) -> Result<bool> {
    match v.trim() {
        "on" | "1" => Ok(true),
        "off" | "0" => Ok(false),
        _ => Err(ExecError::Launch(format!(
            "{var}={v:?}: give on or off{what}, or unset it (default {})",
            if default { "on" } else { "off" }
        ))),
    }
}

impl CommOptions {
    /// Reads `MOLD_NCCL_TIMEOUT_S`, `MOLD_DIST_TIMEOUT_S` and `MOLD_DIST_SECRET` through
    /// `get` (the CLI passes `|k| std::env::var(k).ok()`); unset ones keep their defaults.
    /// A bad value is refused in one line naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<CommOptions> {
        let mut o = CommOptions::default();
        if let Some(v) = get("MOLD_NCCL_TIMEOUT_S") {
            o.nccl_timeout = timeout_secs(
                "MOLD_NCCL_TIMEOUT_S",
                &v,
                Some("turns the NCCL watchdog off"),
            )?;
        }
        if let Some(v) = get("MOLD_DIST_TIMEOUT_S") {
            if let Some(d) = timeout_secs("MOLD_DIST_TIMEOUT_S", &v, None)? {
                o.dist_timeout = d;
            }
        }
        if let Some(v) = get("MOLD_DIST_SECRET") {
            if v.is_empty() || v.len() > crate::dist::MAX_SECRET_BYTES {
                return Err(ExecError::Launch(format!(
                    "MOLD_DIST_SECRET: give 1 to {} bytes (the same in every process), or unset it",
                    crate::dist::MAX_SECRET_BYTES
                )));
            }
            o.secret = Some(Secret(v));
        }
        if let Some(v) = get("MOLD_OVERLAP_CHUNKS") {
            o.overlap_chunks = match v.trim().parse::<usize>() {
                Ok(n) if (1..=MAX_OVERLAP_CHUNKS).contains(&n) => n,
                _ => {
                    return Err(ExecError::Launch(format!(
                        "MOLD_OVERLAP_CHUNKS={v:?}: give a whole number from 1 (no overlap) \
                         to {MAX_OVERLAP_CHUNKS}, or unset it (default {DEFAULT_OVERLAP_CHUNKS})"
                    )))
                }
            };
        }
        if let Some(v) = get("MOLD_SP_OVERLAP") {
            o.exchange_beside = switch(
                "MOLD_SP_OVERLAP",
                &v,
                " (sequence parallelism's all-to-alls beside the products, or between them)",
                DEFAULT_EXCHANGE_BESIDE,
            )?;
        }
        if let Some(v) = get("MOLD_SP_TRACE") {
            o.trace_exchanges = switch("MOLD_SP_TRACE", &v, "", false)?;
        }
        if let Some(v) = get("MOLD_SP_COPY_LARGE") {
            o.large_group_copies = match v.trim() {
                "off" => LargeGroupCopies::Off,
                "one" => LargeGroupCopies::OneStream,
                "per-peer" => LargeGroupCopies::PerPeer,
                _ => {
                    return Err(ExecError::Launch(format!(
                        "MOLD_SP_COPY_LARGE={v:?}: give off, one or per-peer (groups of more \
                         than two GPUs exchange by NCCL, or by the copy engines on one copy \
                         stream, or on one per peer), or unset it (default off)"
                    )))
                }
            };
        }
        if let Some(v) = get("MOLD_TP_TOKEN_SPLIT") {
            o.token_split = switch("MOLD_TP_TOKEN_SPLIT", &v, "", false)?;
        }
        if let Some(v) = get("MOLD_COMM_WARM") {
            o.warm_during_load = match v.trim() {
                "during" => true,
                "after" => false,
                _ => {
                    return Err(ExecError::Launch(format!(
                        "MOLD_COMM_WARM={v:?}: give during or after (when a one-process run \
                         starts its communicators: while the weights load, or once they are \
                         loaded), or unset it (default during)"
                    )))
                }
            };
        }
        Ok(o)
    }

    /// How long a new connection has for its handshake.
    pub(crate) fn handshake_limit(&self) -> Duration {
        self.handshake_timeout.min(self.dist_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn from(pairs: &[(&str, &str)]) -> Result<CommOptions> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        CommOptions::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn options_from_variables() {
        assert_eq!(from(&[]).unwrap(), CommOptions::default());
        let o = from(&[
            ("MOLD_NCCL_TIMEOUT_S", "0"),
            ("MOLD_DIST_TIMEOUT_S", "2.5"),
            ("MOLD_DIST_SECRET", "s3"),
        ])
        .unwrap();
        assert_eq!(o.nccl_timeout, None);
        assert_eq!(o.dist_timeout, Duration::from_millis(2500));
        assert_eq!(o.secret.as_ref().map(Secret::expose), Some("s3"));
        let o = from(&[("MOLD_NCCL_TIMEOUT_S", " 1.5 ")]).unwrap();
        assert_eq!(o.nccl_timeout, Some(Duration::from_millis(1500)));
        let msg = |p: &[(&str, &str)]| from(p).unwrap_err().to_string();
        assert!(msg(&[("MOLD_NCCL_TIMEOUT_S", "x")]).contains("MOLD_NCCL_TIMEOUT_S=\"x\""));
        assert!(msg(&[("MOLD_NCCL_TIMEOUT_S", "-1")]).contains("give seconds"));
        assert!(msg(&[("MOLD_DIST_TIMEOUT_S", "0")]).contains("MOLD_DIST_TIMEOUT_S=\"0\""));
        assert!(msg(&[("MOLD_DIST_TIMEOUT_S", "inf")]).contains("more than 0"));
        // A week is the most either takes.
        let o = from(&[
            ("MOLD_DIST_TIMEOUT_S", "604800"),
            ("MOLD_NCCL_TIMEOUT_S", "604800"),
        ]);
        assert_eq!(o.unwrap().dist_timeout, Duration::from_secs(604_800));
        assert!(msg(&[("MOLD_DIST_SECRET", "")]).contains("MOLD_DIST_SECRET"));
        assert_eq!(
            from(&[("MOLD_OVERLAP_CHUNKS", " 2")])
                .unwrap()
                .overlap_chunks,
            2
        );
        for (v, on) in [("on", true), (" 1", true), ("off", false), ("0 ", false)] {
            assert_eq!(from(&[("MOLD_TP_TOKEN_SPLIT", v)]).unwrap().token_split, on);
        }
        for bad in ["yes", "2", ""] {
            let m = msg(&[("MOLD_TP_TOKEN_SPLIT", bad)]);
            assert!(
                m.contains("MOLD_TP_TOKEN_SPLIT") && m.contains("on or off"),
                "{m}"
            );
        }
        for (v, on) in [("on", true), (" 1", true), ("off", false), ("0 ", false)] {
            assert_eq!(from(&[("MOLD_SP_OVERLAP", v)]).unwrap().exchange_beside, on);
        }
        for (v, on) in [("1", true), ("on", true), ("0", false), (" off", false)] {
            assert_eq!(from(&[("MOLD_SP_TRACE", v)]).unwrap().trace_exchanges, on);
        }
        let m = msg(&[("MOLD_SP_TRACE", "2")]);
        assert!(
            m.contains("MOLD_SP_TRACE=\"2\"") && m.contains("on or off"),
            "{m}"
        );
        for (v, s) in [
            ("off", LargeGroupCopies::Off),
            (" one", LargeGroupCopies::OneStream),
            ("per-peer", LargeGroupCopies::PerPeer),
        ] {
            let got = from(&[("MOLD_SP_COPY_LARGE", v)]).unwrap();
            assert_eq!(got.large_group_copies, s);
        }
        let m = msg(&[("MOLD_SP_COPY_LARGE", "two")]);
        assert!(
            m.contains("MOLD_SP_COPY_LARGE=\"two\"") && m.contains("off, one or per-peer"),
            "{m}"
        );
        let m = msg(&[("MOLD_SP_OVERLAP", "yes")]);
        assert!(
            m.contains("MOLD_SP_OVERLAP=\"yes\"") && m.contains("on or off"),
            "{m}"
        );
        for (v, during) in [("during", true), (" after", false)] {
            assert_eq!(
                from(&[("MOLD_COMM_WARM", v)]).unwrap().warm_during_load,
                during
            );
        }
        let m = msg(&[("MOLD_COMM_WARM", "later")]);
        assert!(
            m.contains("MOLD_COMM_WARM") && m.contains("during or after"),
            "{m}"
        );
        for bad in ["0", "65", "-1", "x", "1.5", ""] {
            let m = msg(&[("MOLD_OVERLAP_CHUNKS", bad)]);
            assert!(
                m.contains("MOLD_OVERLAP_CHUNKS") && m.contains("1 (no overlap)"),
                "{m}"
            );
        }
        let long = "x".repeat(crate::dist::MAX_SECRET_BYTES + 1);
        assert!(msg(&[("MOLD_DIST_SECRET", &long)]).contains("bytes"));
    }

    #[test]
    fn timeouts_out_of_range_are_refused_in_one_line_naming_them() {
        // 1e20 s is more than a `Duration` holds: `from_secs_f64` panicked on it.
        for var in ["MOLD_NCCL_TIMEOUT_S", "MOLD_DIST_TIMEOUT_S"] {
            for v in [
                "1e20", "inf", "-inf", "nan", "NaN", "-1", "-0.5", "604801", "1e308", "x", "", " ",
                "0x10",
            ] {
                let e = from(&[(var, v)]).unwrap_err().to_string();
                assert!(e.contains(&format!("{var}={v:?}")), "{var}={v}: {e}");
                assert!(e.contains("give seconds") && !e.contains('\n'), "{e}");
            }
        }
        // 0 turns the watchdog off, but is no distributed timeout.
        assert_eq!(
            from(&[("MOLD_NCCL_TIMEOUT_S", "0")]).unwrap().nccl_timeout,
            None
        );
        assert!(from(&[("MOLD_DIST_TIMEOUT_S", "0")]).is_err());
        assert_eq!(
            timeout_secs("X", "1e-3", None).unwrap(),
            Some(Duration::from_millis(1))
        );
    }

    #[test]
    fn debug_redacts_the_secret() {
        let o = from(&[("MOLD_DIST_SECRET", "hunter2-very-secret")]).unwrap();
        let d = format!("{o:?} {:?} {o:#?}", o.secret);
        assert!(!d.contains("hunter2"), "{d}");
        assert!(d.contains("secret: Some(<redacted>)"), "{d}");
    }
}
