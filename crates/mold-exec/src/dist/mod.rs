//! Several processes: one `mold exec` per node (or per GPU), each running the ranks of its
//! own devices.
//!
//! # Launch ([`Launch`])
//!
//! Every process is started with the same arguments and three variables:
//! `MOLD_WORLD_SIZE` (processes), `MOLD_RANK` (this one, `0..MOLD_WORLD_SIZE`) and
//! `MOLD_MASTER_ADDR` (`host:port` where process 0 listens; the port defaults to
//! [`DEFAULT_PORT`]). No launcher is needed: processes may start in any order within the
//! timeout. torchrun's and Slurm's variables work too, with `MOLD_*` first ([`Launcher`];
//! `launch.rs` says how they combine). The CLI reads the variables and passes them in
//! ([`Launch::from_vars`], [`crate::comm::CommOptions::from_vars`]).
//!
//! # Who runs what ([`Ownership`])
//!
//! The devices of the plan's transformer, sorted, are cut into `MOLD_WORLD_SIZE`
//! contiguous shares as equal as possible; process `p` owns share `p` and loads and runs
//! only the ranks on those devices. A process sees its own GPUs as `cuda:0, cuda:1, …` in
//! the order of its share (as on a node of its own; on one shared host give each process
//! its GPUs with `CUDA_VISIBLE_DEVICES`).
//!
//! # Transport ([`Mesh`])
//!
//! Process 0 listens at `MOLD_MASTER_ADDR` (that address only); the others connect, open
//! with a handshake (magic, protocol version, the optional shared secret
//! `MOLD_DIST_SECRET`), say who they are and what they run (a fingerprint of the plan and
//! the arguments: processes that disagree are refused, naming the difference), and get the
//! address of every other process back, so each pair of processes shares one TCP
//! connection. A connection that fails the handshake is logged and dropped; the
//! rendezvous goes on. A reader thread per connection files incoming messages by sender
//! and tag; frames and tensor messages are bounded and checked ([`wire`], [`codec`]).
//!
//! - Activations handed from a part in one process to a part in another travel over TCP,
//!   staged through host memory, and so does the last part's output, which goes to every
//!   process so that all of them run the same sampler.
//! - A tensor-parallel group that spans processes all-reduces through NCCL on GPUs (the
//!   `ncclUniqueId` travels over the mesh) and through [`crate::comm::TcpComm`] otherwise
//!   ([`crate::comm::cross_process_group`]).
//! - A process that fails tells the others (an abort message naming it) before it exits;
//!   one that dies closes its connections. Either way every other process stops waiting
//!   at once (the mesh's [`crate::comm::AbortSignal`] stops its NCCL groups too), aborts
//!   its communicators and exits non-zero naming the process at fault. Waits are bounded
//!   by `MOLD_DIST_TIMEOUT_S` (default 120 s).

pub mod codec;
mod launch;
mod mesh;
mod ownership;
mod rendezvous;
pub mod wire;

#[cfg(test)]
mod tests;

pub use codec::{decode_shaped, encode_shaped};
pub use launch::{expand_nodelist, Launch, Launcher, DEFAULT_PORT, LAUNCH_VARS};
pub use mesh::Mesh;
pub use ownership::Ownership;
pub use wire::{MAX_FRAME_BYTES, MAX_HANDSHAKE_BYTES, MAX_SECRET_BYTES, PROTOCOL_VERSION};

/// Moved to [`crate::comm::TcpComm`]; re-exported here until callers switch.
pub use crate::comm::TcpComm;
