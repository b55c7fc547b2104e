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
//! # Who runs what ([`LocalDevices`], [`Ownership`])
//!
//! The CLI resolves, before the rendezvous, which plan devices this process runs and how
//! it opens them ([`LocalDevices::resolve`], from the plan's devices, the machine
//! profile's nodes, the launch and `CUDA_VISIBLE_DEVICES`): the nodes that hold the
//! transformer's devices get the same number of processes each, numbered node by node;
//! each node's sorted devices are cut into one contiguous share per process there; and a
//! process opens its devices at their places on its node (the node's first GPU is
//! `cuda:0`), or as `cuda:0, cuda:1, …` when it sees exactly its share's GPUs
//! (`CUDA_VISIBLE_DEVICES`). `local.rs` has the rule in full.
//!
//! # Transport ([`Mesh`])
//!
//! Process 0 listens at `MOLD_MASTER_ADDR` (that address only); the others connect, open
//! with a handshake (magic, protocol version, a nonce), say who they are and what they run
//! (a fingerprint of the plan and the arguments: processes that disagree are refused,
//! naming the difference), prove both ways that they know the shared secret
//! `MOLD_DIST_SECRET` (an HMAC over both ends' nonces: the secret never travels; `auth.rs`)
//! and get the address of every other process back, so each pair of processes shares one
//! TCP connection. The secret may be left unset only when the master address is a
//! loopback one ([`Launch::check_secret`]). A connection that fails the handshake, or has
//! not finished it within one deadline from its accept, is logged and dropped; at most a
//! few connections from one address are read at once; the rendezvous goes on, and a
//! process whose connection was dropped connects again. A reader thread per connection
//! files incoming messages by sender and tag; frames and tensor messages are bounded and
//! checked ([`wire`], [`codec`]). Mesh sockets have TCP keep-alive and a write timeout
//! (`MOLD_DIST_TIMEOUT_S`): a process that stopped reading, or a host that vanished, ends
//! the run rather than hanging it.
//!
//! - Activations handed from a part in one process to a part in another go through a
//!   [`crate::comm::HandOff`]: NCCL send/recv between the two GPUs (with the `nccl`
//!   feature), else TCP staged through host memory. The last part's output goes to every
//!   process over TCP, so that all of them run the same sampler.
//! - A tensor-parallel group that spans processes all-reduces through NCCL on GPUs (the
//!   `ncclUniqueId` travels over the mesh) and through [`crate::comm::TcpComm`] otherwise
//!   ([`crate::comm::cross_process_group`]).
//! - A process that fails tells the others (an abort message naming it) before it exits;
//!   one that dies closes its connections. Either way every other process stops waiting
//!   at once (the mesh's [`crate::comm::AbortSignal`] stops its NCCL groups too), aborts
//!   its communicators and exits non-zero naming the process at fault. Waits are bounded
//!   by `MOLD_DIST_TIMEOUT_S` (default 120 s).

mod auth;
pub mod codec;
mod launch;
mod local;
mod mesh;
mod ownership;
mod rendezvous;
pub mod wire;

#[cfg(test)]
mod tests;

pub use codec::{decode_shaped, encode_shaped};
pub use launch::{expand_nodelist, is_loopback_host, Launch, Launcher, DEFAULT_PORT, LAUNCH_VARS};
pub use local::{LocalDevices, Ordinals, Visible};
pub use mesh::Mesh;
pub use ownership::Ownership;
pub use wire::{MAX_FRAME_BYTES, MAX_HANDSHAKE_BYTES, MAX_SECRET_BYTES, PROTOCOL_VERSION};

/// Moved to [`crate::comm::TcpComm`]; re-exported here until callers switch.
pub use crate::comm::TcpComm;
