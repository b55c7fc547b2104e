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

/// How collectives and the multi-process transport behave.
#[derive(Clone, Debug, PartialEq)]
pub struct CommOptions {
    /// NCCL watchdog: the longest an NCCL group's creation or one of its all-reduces may
    /// take before the group is aborted; `None` turns the watchdog off (a hang is then not
    /// detected). `MOLD_NCCL_TIMEOUT_S` (0 = off), default [`DEFAULT_NCCL_TIMEOUT_S`].
    pub nccl_timeout: Option<Duration>,
    /// The longest a process waits for another (rendezvous, a hand-off, a host-staged
    /// all-reduce). `MOLD_DIST_TIMEOUT_S`, default [`DEFAULT_DIST_TIMEOUT_S`].
    pub dist_timeout: Duration,
    /// The longest a new connection to a process's rendezvous listener may take to send
    /// its handshake before it is dropped (capped by `dist_timeout`).
    pub handshake_timeout: Duration,
    /// A secret every process of a multi-process run presents in its handshake; a
    /// connection without it is dropped. `MOLD_DIST_SECRET`, default none. It keeps stray
    /// and foreign connections out; it is sent as is, so it is no defence against someone
    /// who can read the traffic (keep the run on a private network).
    pub secret: Option<String>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            nccl_timeout: Some(Duration::from_secs_f64(DEFAULT_NCCL_TIMEOUT_S)),
            dist_timeout: Duration::from_secs_f64(DEFAULT_DIST_TIMEOUT_S),
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            secret: None,
        }
    }
}

impl CommOptions {
    /// Reads `MOLD_NCCL_TIMEOUT_S`, `MOLD_DIST_TIMEOUT_S` and `MOLD_DIST_SECRET` through
    /// `get` (the CLI passes `|k| std::env::var(k).ok()`); unset ones keep their defaults.
    /// A bad value is refused naming the variable.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<CommOptions> {
        let mut o = CommOptions::default();
        if let Some(v) = get("MOLD_NCCL_TIMEOUT_S") {
            o.nccl_timeout = match v.trim().parse::<f64>() {
                Ok(0.0) => None,
                Ok(s) if s.is_finite() && s > 0.0 => Some(Duration::from_secs_f64(s)),
                _ => {
                    return Err(ExecError::Launch(format!(
                        "MOLD_NCCL_TIMEOUT_S={v:?}: give seconds (0 turns the NCCL watchdog off)"
                    )))
                }
            };
        }
        if let Some(v) = get("MOLD_DIST_TIMEOUT_S") {
            o.dist_timeout = match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => Duration::from_secs_f64(s),
                _ => {
                    return Err(ExecError::Launch(format!(
                        "MOLD_DIST_TIMEOUT_S={v:?}: give seconds, more than 0"
                    )))
                }
            };
        }
        if let Some(v) = get("MOLD_DIST_SECRET") {
            if v.is_empty() || v.len() > crate::dist::MAX_SECRET_BYTES {
                return Err(ExecError::Launch(format!(
                    "MOLD_DIST_SECRET: give 1 to {} bytes (the same in every process), or unset it",
                    crate::dist::MAX_SECRET_BYTES
                )));
            }
            o.secret = Some(v);
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
        assert_eq!(o.secret.as_deref(), Some("s3"));
        let o = from(&[("MOLD_NCCL_TIMEOUT_S", " 1.5 ")]).unwrap();
        assert_eq!(o.nccl_timeout, Some(Duration::from_millis(1500)));
        let msg = |p: &[(&str, &str)]| from(p).unwrap_err().to_string();
        assert!(msg(&[("MOLD_NCCL_TIMEOUT_S", "x")]).contains("MOLD_NCCL_TIMEOUT_S=\"x\""));
        assert!(msg(&[("MOLD_NCCL_TIMEOUT_S", "-1")]).contains("give seconds"));
        assert!(msg(&[("MOLD_DIST_TIMEOUT_S", "0")]).contains("MOLD_DIST_TIMEOUT_S=\"0\""));
        assert!(msg(&[("MOLD_DIST_TIMEOUT_S", "inf")]).contains("more than 0"));
        assert!(msg(&[("MOLD_DIST_SECRET", "")]).contains("MOLD_DIST_SECRET"));
        let long = "x".repeat(crate::dist::MAX_SECRET_BYTES + 1);
        assert!(msg(&[("MOLD_DIST_SECRET", &long)]).contains("bytes"));
    }
}
