//! This process's place among the processes of one run, from the variables the CLI reads
//! ([`Launch::from_vars`]): mold's own (`MOLD_RANK`, `MOLD_WORLD_SIZE`,
//! `MOLD_MASTER_ADDR`), torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) or Slurm's (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first
//! host of `SLURM_JOB_NODELIST`).
//!
//! # Precedence
//!
//! Each quantity comes from the first convention that sets it: `MOLD_*`, then torchrun,
//! then Slurm. torchrun's variables, when present, describe the process and Slurm's are
//! not read (torchrun started under `srun` is one task per node, not one per process).
//! A `MOLD_*` rank or world size that disagrees with the launcher's is an error naming
//! both; so is a rank outside `0..world` and a local rank above the rank.
//! `MOLD_MASTER_ADDR` overrides the launcher's address (to choose an interface or a port).
//!
//! # Where process 0 listens
//!
//! - `MOLD_MASTER_ADDR`: `host[:port]`, port [`DEFAULT_PORT`] when absent.
//! - torchrun: `MASTER_ADDR`, at `MASTER_PORT` + 1 when `TORCHELASTIC_USE_AGENT_STORE` is
//!   true (torchrun's own store listens at `MASTER_PORT` then), else at `MASTER_PORT`
//!   ([`DEFAULT_PORT`] when unset).
//! - Slurm: the first host of `SLURM_JOB_NODELIST` (bracket forms such as `node[01-04,07]`
//!   expanded), at [`DEFAULT_PORT`] + `SLURM_JOB_ID` mod 1000, so two jobs sharing a node
//!   do not collide.
//!
//! # The shared secret
//!
//! A master address other than a loopback one (`127.0.0.0/8`, `::1`, `localhost`) needs
//! `MOLD_DIST_SECRET` ([`Launch::check_secret`]): every process of the run proves it
//! knows it. mold never starts the processes itself, so it has no secret of its own to
//! hand them: the launcher's environment sets it.

mod nodelist;

use crate::comm::CommOptions;
use crate::error::{ExecError, Result};
use std::net::IpAddr;

pub use nodelist::expand as expand_nodelist;

/// Port of `MOLD_MASTER_ADDR` when it names only a host.
pub const DEFAULT_PORT: u16 = 29517;

/// Every variable [`Launch::from_vars`] may read (the CLI passes these, and only these,
/// besides `MOLD_*`).
pub const LAUNCH_VARS: &[&str] = &[
    "MOLD_RANK",
    "MOLD_WORLD_SIZE",
    "MOLD_MASTER_ADDR",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
];

/// The convention that gave a process its rank and world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `MOLD_RANK`, `MOLD_WORLD_SIZE` alone.
    Mold,
    /// torchrun's `RANK`, `WORLD_SIZE` (`MOLD_*` may repeat them).
    Torchrun,
    /// Slurm's `SLURM_PROCID`, `SLURM_NTASKS` (`MOLD_*` may repeat them).
    Slurm,
}

impl Launcher {
    /// The variables of this convention: (rank, world size, local rank).
    pub fn vars(self) -> (&'static str, &'static str, Option<&'static str>) {
        match self {
            Launcher::Mold => ("MOLD_RANK", "MOLD_WORLD_SIZE", None),
            Launcher::Torchrun => ("RANK", "WORLD_SIZE", Some("LOCAL_RANK")),
            Launcher::Slurm => ("SLURM_PROCID", "SLURM_NTASKS", Some("SLURM_LOCALID")),
        }
    }
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Mold => "MOLD_*",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "Slurm",
        })
    }
}

/// This process's place among the processes of one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// This process, `0..world`.
    pub rank: usize,
    /// The number of processes.
    pub world: usize,
    /// `host:port` where process 0 listens.
    pub master: String,
    /// This process's index among the processes of its node (`LOCAL_RANK`,
    /// `SLURM_LOCALID`), when the launcher gives it.
    pub local_rank: Option<usize>,
    /// Where the rank and world size came from.
    pub launcher: Launcher,
}

fn launch_err(m: String) -> ExecError {
    ExecError::Launch(m)
}

/// One variable's value: its name and text, when set and not blank.
type Var = Option<(&'static str, String)>;

/// A whole number from `var`, or an error naming it with `what` it should be.
fn number((name, v): &(&'static str, String), what: &str) -> Result<usize> {
    v.trim()
        .parse::<usize>()
        .map_err(|_| launch_err(format!("{name}={v:?}: give {what}")))
}

/// The value `mold` (a `MOLD_*` variable) and `other` (the launcher's) agree on, or the
/// error naming both.
fn agree(
    mold: Var,
    other: Var,
    what: &str,
    launcher: Option<Launcher>,
) -> Result<Option<(&'static str, usize)>> {
    let m = mold
        .map(|v| number(&v, what).map(|n| (v.0, n)))
        .transpose()?;
    let o = other
        .map(|v| number(&v, what).map(|n| (v.0, n)))
        .transpose()?;
    match (m, o) {
        (Some((mn, m)), Some((on, o))) if m != o => {
            let l = launcher.map(|l| format!(" ({l})")).unwrap_or_default();
            Err(launch_err(format!(
                "{mn}={m} but {on}={o}{l}: they disagree; unset {mn} (the launcher's value is \
                 used) or make them equal"
            )))
        }
        (Some(m), _) => Ok(Some(m)),
        (None, o) => Ok(o),
    }
}

/// `host:port`, with brackets around an IPv6 host.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes")
}

impl Launch {
    /// Reads the launch variables ([`LAUNCH_VARS`]) through `get` (the CLI passes the
    /// process environment). `None` when none is set, or when the world is one process;
    /// an error naming the variable(s) when they are incomplete, wrong or disagree.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        let var = |k: &'static str| -> Var {
            get(k)
                .filter(|v| !v.trim().is_empty())
                .map(|v| (k, v.trim().to_string()))
        };
        let (m_rank, m_world, m_master) = (
            var("MOLD_RANK"),
            var("MOLD_WORLD_SIZE"),
            var("MOLD_MASTER_ADDR"),
        );
        let launcher = if var("RANK").is_some() || var("WORLD_SIZE").is_some() {
            Some(Launcher::Torchrun)
        } else if var("SLURM_PROCID").is_some() || var("SLURM_NTASKS").is_some() {
            Some(Launcher::Slurm)
        } else {
            None
        };
        let mold_any = m_rank.is_some() || m_world.is_some() || m_master.is_some();
        if !mold_any && launcher.is_none() {
            return Ok(None);
        }
        let (l_rank, l_world, l_local) = match launcher {
            Some(l) => {
                let (r, w, lr) = l.vars();
                (var(r), var(w), lr.and_then(var))
            }
            None => (None, None, None),
        };
        let (rank_var, world_var, _) = launcher.unwrap_or(Launcher::Mold).vars();
        let world = match agree(
            m_world,
            l_world,
            "the number of processes (1 or more)",
            launcher,
        )? {
            Some((name, 0)) => {
                return Err(launch_err(format!(
                    "{name}=0: give the number of processes (1 or more)"
                )))
            }
            Some(w) => w,
            None if launcher.is_none() => {
                return Err(launch_err(
                    "MOLD_WORLD_SIZE is not set (MOLD_RANK or MOLD_MASTER_ADDR is): set it to \
                     the number of processes, the same in every process"
                        .into(),
                ))
            }
            None => {
                return Err(launch_err(format!(
                    "{world_var} is not set ({rank_var} is): set it to the number of \
                     processes, the same in every process"
                )))
            }
        };
        let rank = match agree(
            m_rank,
            l_rank,
            &format!(
                "a whole number below {}={} (0..{})",
                world.0, world.1, world.1
            ),
            launcher,
        )? {
            None if world.1 == 1 => ("", 0),
            None => {
                return Err(launch_err(format!(
                    "{rank_var} is not set: give each of the {} processes its own rank, 0..{}",
                    world.1, world.1
                )))
            }
            Some((name, r)) if r >= world.1 => {
                return Err(launch_err(format!(
                    "{name}={r} with {}={}: a rank is a whole number below the world size \
                     (0..{})",
                    world.0, world.1, world.1
                )))
            }
            Some(r) => r,
        };
        if world.1 == 1 {
            return Ok(None);
        }
        let local_rank = match &l_local {
            None => None,
            Some(v) => {
                let lr = number(v, "this process's index among those of its node")?;
                if lr > rank.1 {
                    return Err(launch_err(format!(
                        "{}={lr} with {}={}: a process's index on its node cannot exceed its \
                         rank",
                        v.0, rank.0, rank.1
                    )));
                }
                Some(lr)
            }
        };
        let master = match (m_master, launcher) {
            (Some((_, m)), _) => mold_master(&m)?,
            (None, Some(Launcher::Torchrun)) => torchrun_master(&var)?,
            (None, Some(Launcher::Slurm)) => slurm_master(&var)?,
            (None, _) => {
                return Err(launch_err(
                    "MOLD_MASTER_ADDR is not set: give host:port where process 0 listens \
                     (the same in every process), e.g. node0:29517"
                        .into(),
                ))
            }
        };
        Ok(Some(Launch {
            rank: rank.1,
            world: world.1,
            master,
            local_rank,
            launcher: launcher.unwrap_or(Launcher::Mold),
        }))
    }

    /// The variable that gave the world size (`MOLD_WORLD_SIZE`, `WORLD_SIZE`,
    /// `SLURM_NTASKS`), for messages.
    pub fn world_var(&self) -> &'static str {
        self.launcher.vars().1
    }

    /// Whether process 0 listens on a loopback address only ([`is_loopback_host`]): a run
    /// on one host, which other hosts cannot reach.
    pub fn master_is_loopback(&self) -> bool {
        is_loopback_host(&self.master)
    }

    /// Refuses, in one line naming `MOLD_DIST_SECRET`, a run whose master address is not
    /// a loopback one without a shared secret: processes on other hosts must prove they
    /// belong to the run. [`crate::dist::Mesh::connect`] checks it first; the CLI may
    /// check earlier.
    pub fn check_secret(&self, opts: &CommOptions) -> Result<()> {
        if opts.secret.is_some() || self.master_is_loopback() {
            return Ok(());
        }
        Err(launch_err(format!(
            "the master address {:?} is not a loopback address, and MOLD_DIST_SECRET is not \
             set: set MOLD_DIST_SECRET to the same long random string in every process (e.g. \
             `openssl rand -hex 32`), or give a loopback MOLD_MASTER_ADDR (127.0.0.1) for a \
             run on one host",
            self.master
        )))
    }
}

/// Whether `addr` (`host:port`, `[v6]:port`, or a bare host) names a loopback address:
/// an IP literal in `127.0.0.0/8` or `::1` (an IPv4-mapped one too), or `localhost`.
/// Other names count as not loopback (nothing is resolved here).
pub fn is_loopback_host(addr: &str) -> bool {
    let host = if let Some(rest) = addr.strip_prefix('[') {
        rest.split_once(']').map(|(h, _)| h).unwrap_or(rest)
    } else if addr.matches(':').count() > 1 {
        // A bare IPv6 address.
        addr
    } else {
        addr.rsplit_once(':').map(|(h, _)| h).unwrap_or(addr)
    };
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) => ip.is_loopback(),
        Ok(IpAddr::V6(ip)) => {
            ip.is_loopback() || ip.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    }
}

/// A host name or address from `var` (its whole value `v`), as a connection may use it:
/// not empty, without blanks or control characters; an IPv6 address in brackets.
fn check_host(var: &str, v: &str, host: &str) -> Result<()> {
    if host.is_empty() || host.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(launch_err(format!(
            "{var}={v:?}: `{}` is not a host name or address",
            host.escape_debug()
        )));
    }
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    if host.contains([':', '[', ']'])
        && bare.is_none_or(|h| h.parse::<std::net::Ipv6Addr>().is_err())
    {
        return Err(launch_err(format!(
            "{var}={v:?}: `{}` is not a host name or address (an IPv6 address goes in \
             brackets, [::1]:29517)",
            host.escape_debug()
        )));
    }
    Ok(())
}

/// `MOLD_MASTER_ADDR`: `host[:port]` (`[v6]:port`, or a bare IPv6 address).
fn mold_master(master: &str) -> Result<String> {
    const VAR: &str = "MOLD_MASTER_ADDR";
    if master.parse::<std::net::Ipv6Addr>().is_ok() {
        return Ok(host_port(master, DEFAULT_PORT));
    }
    let (host, port) = match master.rsplit_once(':') {
        // `[v6]` alone: its colons are not a port's.
        Some(_) if master.starts_with('[') && master.ends_with(']') => (master, DEFAULT_PORT),
        Some((h, p)) => match p.parse::<u16>() {
            Ok(n) if n > 0 => (h, n),
            _ => {
                return Err(launch_err(format!(
                    "{VAR}={master:?}: the port `{}` is not a number 1..65535",
                    p.escape_debug()
                )))
            }
        },
        None => (master, DEFAULT_PORT),
    };
    check_host(VAR, master, host)?;
    Ok(format!("{host}:{port}"))
}

/// torchrun: `MASTER_ADDR`, at `MASTER_PORT` (+ 1 when torchrun's agent store holds it).
fn torchrun_master(var: &impl Fn(&'static str) -> Var) -> Result<String> {
    let Some((_, host)) = var("MASTER_ADDR") else {
        return Err(launch_err(
            "MASTER_ADDR is not set (RANK or WORLD_SIZE is, as torchrun sets them): set it to \
             the address of the node of rank 0, or set MOLD_MASTER_ADDR=host:port"
                .into(),
        ));
    };
    let host = match host.parse::<std::net::Ipv6Addr>() {
        Ok(_) => host,
        Err(_) => {
            check_host("MASTER_ADDR", &host, &host)?;
            host
        }
    };
    let port = match var("MASTER_PORT") {
        None => DEFAULT_PORT,
        Some((_, p)) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(launch_err(format!(
                    "MASTER_PORT={p:?}: give a port number 1..65535"
                )))
            }
        },
    };
    let agent_store = var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|(_, v)| truthy(&v));
    let port = if agent_store {
        port.checked_add(1).ok_or_else(|| {
            launch_err(
                "MASTER_PORT=65535: torchrun's store listens there and mold listens at the \
                 next port; choose a lower --master-port"
                    .into(),
            )
        })?
    } else {
        port
    };
    Ok(host_port(&host, port))
}

/// Slurm: the first host of `SLURM_JOB_NODELIST`, at [`DEFAULT_PORT`] + job id mod 1000.
fn slurm_master(var: &impl Fn(&'static str) -> Var) -> Result<String> {
    let Some((_, list)) = var("SLURM_JOB_NODELIST") else {
        return Err(launch_err(
            "SLURM_JOB_NODELIST is not set (SLURM_PROCID or SLURM_NTASKS is): start mold with \
             srun inside an allocation, or set MOLD_MASTER_ADDR=host:port"
                .into(),
        ));
    };
    let host = nodelist::expand(&list, 1)
        .map_err(|why| launch_err(format!("SLURM_JOB_NODELIST={list:?}: {why}")))?
        .pop()
        .ok_or_else(|| launch_err(format!("SLURM_JOB_NODELIST={list:?}: names no host")))?;
    check_host("SLURM_JOB_NODELIST", &list, &host)?;
    let offset = match var("SLURM_JOB_ID") {
        None => 0,
        Some((_, id)) => match id.parse::<u64>() {
            Ok(n) => (n % 1000) as u16,
            Err(_) => {
                return Err(launch_err(format!(
                    "SLURM_JOB_ID={id:?}: expected the job's number"
                )))
            }
        },
    };
    Ok(host_port(&host, DEFAULT_PORT + offset))
}

#[cfg(test)]
mod tests;
