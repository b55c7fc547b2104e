//! Typed communication failures, and the run-wide abort signal.
//!
//! [`Comm`](super::Comm) methods return `candle_core::Result` (model code chains them with
//! tensor ops); a [`CommError`] travels inside as `candle_core::Error::Io` (an
//! `std::io::Error` whose kind says which failure it is) and [`CommError::of`] finds it
//! again, so the executor chooses the root cause of a failed group by type
//! ([`root_cause`]), not by message text.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why a collective failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum CommError {
    /// This rank stopped because another rank of its group, or another process of the
    /// run, failed first; `cause` is that failure as far as this rank knows it.
    #[error("{rank}: another rank of the tensor-parallel group failed ({cause})")]
    PeerAborted { rank: String, cause: String },
    /// A wait ran past its limit (`why` names the setting and the likely reasons).
    #[error("{rank}: {what} timed out after {:.1} s ({why})", waited.as_secs_f64())]
    Timeout {
        rank: String,
        what: String,
        waited: Duration,
        why: String,
    },
    /// This rank's own failure: a backend error, a bad tensor, a broken message.
    #[error("{0}")]
    Local(String),
}

impl CommError {
    /// The [`CommError`] inside a candle error made from one (through `Context`,
    /// `WithBacktrace` and `WithPath` wrappers), if any.
    pub fn of(e: &candle_core::Error) -> Option<&CommError> {
        use candle_core::Error as E;
        match e {
            E::Io(io) => io.get_ref()?.downcast_ref::<CommError>(),
            E::Cuda(b) => b.downcast_ref::<CommError>(),
            E::WrappedContext { wrapped, .. } => wrapped.downcast_ref::<CommError>(),
            E::Context { inner, .. }
            | E::WithBacktrace { inner, .. }
            | E::WithPath { inner, .. } => CommError::of(inner),
            _ => None,
        }
    }

    /// Whether `e` is a [`CommError::PeerAborted`]: the rank stopped because of another.
    pub fn is_peer_aborted(e: &candle_core::Error) -> bool {
        matches!(CommError::of(e), Some(CommError::PeerAborted { .. }))
    }

    /// The failure itself, without the "another rank failed" wrapping of a
    /// [`CommError::PeerAborted`] (which would nest when passed on).
    pub fn cause(&self) -> String {
        match self {
            CommError::PeerAborted { cause, .. } => cause.clone(),
            other => other.to_string(),
        }
    }
}

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        let kind = match &e {
            CommError::PeerAborted { .. } => std::io::ErrorKind::ConnectionAborted,
            CommError::Timeout { .. } => std::io::ErrorKind::TimedOut,
            CommError::Local(_) => std::io::ErrorKind::Other,
        };
        candle_core::Error::Io(std::io::Error::new(kind, e))
    }
}

/// The root cause among the results of a group's ranks: the first error that is not a
/// [`CommError::PeerAborted`] (the rank that failed first, not the ranks it released),
/// else the first error; with its position. `None` when every rank succeeded.
pub fn root_cause<'a, T: 'a>(
    results: impl IntoIterator<Item = &'a candle_core::Result<T>>,
) -> Option<(usize, &'a candle_core::Error)> {
    let errors: Vec<(usize, &candle_core::Error)> = results
        .into_iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().err().map(|e| (i, e)))
        .collect();
    errors
        .iter()
        .find(|(_, e)| !CommError::is_peer_aborted(e))
        .or(errors.first())
        .copied()
}

/// The first failure of a run, shared by its mesh and its communicators: NCCL's watchdog
/// polls it, so a rank waiting on a collective stops as soon as any process failed.
/// Cloning shares it.
#[derive(Clone, Debug, Default)]
pub struct AbortSignal(Arc<Mutex<Option<String>>>);

impl AbortSignal {
    pub fn new() -> AbortSignal {
        AbortSignal::default()
    }

    /// Records `why` unless a failure is already recorded; true when this one is first.
    pub fn raise(&self, why: &str) -> bool {
        let mut f = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let first = f.is_none();
        if first {
            *f = Some(why.to_string());
        }
        first
    }

    /// The recorded failure, if any.
    pub fn reason(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_typed_error_is_found_through_candle_wrappers() {
        let e: candle_core::Error = CommError::Timeout {
            rank: "rank 0".into(),
            what: "the all-reduce".into(),
            waited: Duration::from_secs(2),
            why: "MOLD_NCCL_TIMEOUT_S".into(),
        }
        .into();
        assert_eq!(
            e.to_string(),
            "rank 0: the all-reduce timed out after 2.0 s (MOLD_NCCL_TIMEOUT_S)"
        );
        let wrapped = e.context("block 3").bt().with_path("x");
        assert!(matches!(
            CommError::of(&wrapped),
            Some(CommError::Timeout { .. })
        ));
        assert_eq!(
            CommError::of(&candle_core::Error::Msg("another rank".into())),
            None
        );
        let peer: candle_core::Error = CommError::PeerAborted {
            rank: "rank 1".into(),
            cause: "rank 0 failed".into(),
        }
        .into();
        assert!(CommError::is_peer_aborted(&peer.context("x")));
    }

    #[test]
    fn root_cause_prefers_the_rank_that_failed_first() {
        let peer = || -> candle_core::Result<()> {
            Err(CommError::PeerAborted {
                rank: "r".into(),
                cause: "c".into(),
            }
            .into())
        };
        let all_ok: Vec<candle_core::Result<()>> = vec![Ok(()), Ok(())];
        assert!(root_cause(&all_ok).is_none());
        let rs = vec![
            Ok(()),
            peer(),
            Err(candle_core::Error::Msg("oom".into())),
            peer(),
        ];
        let (i, e) = root_cause(&rs).unwrap();
        assert_eq!((i, e.to_string()), (2, "oom".to_string()));
        // Only released ranks: the first of them.
        let rs = vec![Ok(()), peer(), peer()];
        assert_eq!(root_cause(&rs).unwrap().0, 1);
    }

    #[test]
    fn the_first_raise_wins() {
        let a = AbortSignal::new();
        let b = a.clone();
        assert_eq!(a.reason(), None);
        assert!(b.raise("process 1 failed"));
        assert!(!a.raise("later"));
        assert_eq!(a.reason().as_deref(), Some("process 1 failed"));
    }
}
