//! Reading one rank's resident blocks: from the checkpoint to its device (through
//! page-locked buffers where the weights allow, [`crate::staging`]), several blocks read at
//! once ([`load_ahead`]), each uploaded block copied on to the ranks that hold the same shard
//! ([`CopyOut`]). A part's reading ranks (a tensor-parallel group's shards) run this at the
//! same time, each on its own thread, so a four-way group reads its four quarters together
//! instead of one after another.

use super::copy_out::CopyOut;
use super::load_ahead;
use crate::error::{ExecError, Result};
use crate::model::{BlockRef, Shard, Transformer, WeightSource, Weights};
use crate::options::ExecOptions;
use crate::runtime::{CheckpointSource, ShapeSource, StagedSource};
use crate::staging::Stager;
use candle_core::Device;
use mold_plan::DeviceId;

/// What one reading rank loaded.
pub(super) struct ResidentRead<B> {
    /// Its blocks, on its device, in step order.
    pub blocks: Vec<B>,
    /// The copies for each of its followers, in the order given.
    pub copies: Vec<Vec<B>>,
    /// Seconds spent reading and uploading (the copies' wait after it excluded).
    pub read_s: f64,
}

/// Reads the blocks `steps` of `shard` onto `device` (this process's `id`), copying each on
/// to `followers`' devices as it is uploaded. `share`: how many ranks read at once, which
/// divides the reading threads and their host memory among them.
#[allow(clippy::too_many_arguments)]
pub(super) fn read_resident<M: Transformer>(
    model: &M,
    host: CheckpointSource<'_>,
    steps: &[BlockRef],
    shard: Shard,
    device: &Device,
    id: &DeviceId,
    followers: &[(usize, Device)],
    opts: &ExecOptions,
    share: usize,
) -> Result<ResidentRead<M::Block>> {
    let CheckpointSource { ckpt, dtype, fp8 } = host;
    let t = std::time::Instant::now();
    // One line: candle's error may carry a captured backtrace after it.
    let device_error = |what: &str, e: candle_core::Error| ExecError::Device {
        device: id.to_string(),
        message: format!(
            "{what}: {}",
            e.to_string().lines().next().unwrap_or("failed")
        ),
    };
    // Blocks are read on several threads, as many as the largest (its size from the shapes
    // alone) allows, and uploaded here in order.
    let shapes = ShapeSource { ckpt, dtype, fp8 };
    let mut largest = 0;
    for step in steps {
        largest = largest.max(model.load_block(&shapes, *step, shard)?.bytes());
    }
    let readers = load_ahead::readers_shared(largest, share);
    // Resident blocks on a GPU go from the mapped files to the device through page-locked
    // buffers; the rest are read on the host.
    let stager = if opts.staged_load {
        Stager::new(device)?
    } else {
        None
    };
    let staged = stager.as_ref().map(|stager| StagedSource { host, stager });
    let block_src: &(dyn WeightSource + Sync) = match &staged {
        Some(s) => s,
        None => &host,
    };
    let mut blocks = Vec::with_capacity(steps.len());
    let (copies, read_s) = std::thread::scope(|scope| {
        let out = CopyOut::start(scope, followers, opts.peer_copies);
        let read = load_ahead::in_order(
            steps.len(),
            readers,
            readers,
            |i| {
                let b = model.load_block(block_src, steps[i], shard)?;
                if staged.is_some() {
                    // A staged block's tensors are on the device already, and the model's
                    // own work on them (a cast, a concatenation) was queued on this reader
                    // thread's stream: done before another thread's stream reads them.
                    device
                        .synchronize()
                        .map_err(|e| device_error("loading a block", e))?;
                }
                Ok::<_, ExecError>(b)
            },
            |_, b| {
                let on = b.to_device(device)?;
                if !followers.is_empty() {
                    // Tensors read on the host (every one without staging; an FP8 product,
                    // a LoRA merge or diffusers' names with it) were uploaded just now on this
                    // thread's stream: complete before another thread copies them.
                    device
                        .synchronize()
                        .map_err(|e| device_error("loading a block", e))?;
                    out.send(&on);
                }
                blocks.push(on);
                Ok(())
            },
        );
        let read_s = t.elapsed().as_secs_f64();
        // Copies still running are waited for here, also after an error.
        let copies = out.finish();
        read?;
        Ok::<_, ExecError>((copies?, read_s))
    })?;
    // Uploads from host memory were queued on this thread's stream of the device; the ranks
    // run on other threads.
    device
        .synchronize()
        .map_err(|e| device_error("loading its blocks", e))?;
    Ok(ResidentRead {
        blocks,
        copies,
        read_s,
    })
}
