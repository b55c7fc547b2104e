//! A `mold exec` run from options resolved at the CLI edge to its outcome: the binary
//! parses its flags and the environment, calls these and prints what they report.
//!
//! - [`image`]: text to image (`--prompt`), for every family: the request's size and
//!   steps, the family's own flags and the checks before any run ([`image::ImageRun`]),
//!   then loading, encoding, denoising and decoding, and the run report's measured side.
//! - [`bench`]: the transformer alone on random inputs: the checkpoint with its LoRAs, a
//!   multi-process run's rendezvous, the executors, `--save-io`, the steps, the run
//!   report and `--verify`'s single-device reference.
//!
//! What happens on the way reaches the caller as [`Event`]s, in the order it happens
//! (the pipeline's own [`Progress`] among them); nothing here prints.

pub mod bench;
pub mod image;

use crate::sampling::StepTime;
use crate::Progress;
use mold_exec::checkpoint::{Checkpoint, LoraSpec};
use mold_exec::dist::{Launch, LocalDevices};
use std::path::Path;

/// What a run reports as it goes.
#[derive(Debug)]
pub enum Event<'a> {
    /// A LoRA merged into the transformer's checkpoint (applied as its weights load).
    Lora(&'a LoraSpec),
    /// Worth telling the user; the run goes on.
    Warning(&'a str),
    /// Text to image: the pipeline's progress.
    Progress(&'a Progress),
    /// A multi-process run: this process and its devices, before the rendezvous.
    Process {
        launch: &'a Launch,
        own: &'a LocalDevices,
    },
    /// A multi-process run: every process joined, after `seconds`.
    Joined { processes: usize, seconds: f64 },
    /// The transformer's weights at `weights` start loading.
    Loading { weights: &'a Path },
    /// The transformer loaded in `seconds`, `weight_bytes` of weights (on devices and in
    /// host memory).
    Loaded {
        weights: &'a Path,
        seconds: f64,
        weight_bytes: u64,
        /// Where the executor's load went ([`mold_exec::Executor::load_phases`]).
        phases: Vec<(&'static str, f64)>,
    },
    /// A multi-process run: after part `part`, activations go from process `from` to
    /// process `to` over `path`.
    ProcessHandOff {
        part: usize,
        from: usize,
        to: usize,
        path: &'a str,
    },
    /// `--save-io`: the benchmark's inputs and one transformer call's output were written.
    WroteIo { path: &'a Path },
    /// CFG-parallel: the unconditional passes' transformer loaded on the plan's second
    /// replica in `seconds`.
    LoadedUncond { seconds: f64 },
    /// A benchmark step finished.
    Step(StepTime),
}

/// Merges `loras` into `ckpt` (checked now, applied as the weights load), each told to
/// `on` once merged.
pub(crate) fn add_loras(
    ckpt: &mut Checkpoint,
    loras: &[LoraSpec],
    on: &mut dyn FnMut(Event),
) -> crate::Result<()> {
    for l in loras {
        ckpt.add_lora(l)?;
        on(Event::Lora(l));
    }
    Ok(())
}
