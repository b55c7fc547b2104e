//! Failure injection, for tests and the GPU suite: a rank that errors, panics, hangs or
//! exits at a given block ([`crate::ExecOptions::fault`]).

use crate::model::BlockRef;
use mold_plan::DeviceId;

/// A fault injected on purpose (`MOLD_FAULT=DEVICE@BLOCK[:KIND]`, e.g. `cuda:1@single 3`
/// or `emu:1@double 0:panic`), to test that a failing rank brings its group down cleanly:
/// when the rank on DEVICE reaches BLOCK it returns an error (`error`, the default),
/// panics (`panic`), or stops making progress (`hang`, CUDA devices only: NCCL's watchdog
/// ends it).
#[derive(Clone, Debug, PartialEq)]
pub struct Fault {
    pub device: DeviceId,
    /// The block's kind (`double`, `single`, …) and index.
    pub block_kind: String,
    pub block_index: usize,
    pub kind: FaultKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    Error,
    Panic,
    Hang,
    /// The process exits at once (status 3), as a crash would: no clean-up, no message
    /// to the other processes.
    Exit,
}

impl Fault {
    /// Parses `DEVICE@BLOCK[:KIND]`; BLOCK is a block kind and index, e.g. `double 0`, `single 3`.
    pub fn parse(s: &str) -> std::result::Result<Fault, String> {
        let usage = "MOLD_FAULT must be DEVICE@BLOCK[:error|panic|hang|exit], e.g. cuda:1@single 3";
        let (dev, rest) = s.split_once('@').ok_or(usage)?;
        let device: DeviceId = dev
            .trim()
            .parse()
            .map_err(|e| format!("{usage}: device: {e}"))?;
        let (block, kind) = match rest.rsplit_once(':') {
            Some((b, k)) => (b, k.trim()),
            None => (rest, "error"),
        };
        let kind = match kind {
            "error" => FaultKind::Error,
            "panic" => FaultKind::Panic,
            "hang" => FaultKind::Hang,
            "exit" => FaultKind::Exit,
            k => return Err(format!("{usage}: unknown kind '{k}'")),
        };
        let mut it = block.split_whitespace();
        let (block_kind, block_index) =
            match (it.next(), it.next().map(str::parse::<usize>), it.next()) {
                (Some(k), Some(Ok(i)), None) => (k.to_string(), i),
                _ => return Err(format!("{usage}: block '{}'", block.trim())),
            };
        Ok(Fault {
            device,
            block_kind,
            block_index,
            kind,
        })
    }

    pub(crate) fn trigger(&self, device: &DeviceId, block: BlockRef) -> candle_core::Result<()> {
        if *device != self.device
            || block.kind != self.block_kind
            || block.index != self.block_index
        {
            return Ok(());
        }
        match self.kind {
            FaultKind::Error => {
                candle_core::bail!("injected fault (MOLD_FAULT) on {device} at block {block}")
            }
            FaultKind::Panic => panic!("injected panic (MOLD_FAULT) on {device} at block {block}"),
            // Only NCCL groups have a watchdog that ends a hang; elsewhere it would hang
            // the test for good.
            FaultKind::Hang if !matches!(device, DeviceId::Cuda(_)) => candle_core::bail!(
                "MOLD_FAULT: `hang` needs a CUDA device (NCCL's watchdog ends it); {device} \
                 has no watchdog: use `error` or `panic`"
            ),
            FaultKind::Exit => {
                eprintln!(
                    "injected exit (MOLD_FAULT) on {device} at block {block}: exiting with status 3"
                );
                std::process::exit(3)
            }
            FaultKind::Hang => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
        }
    }
}
