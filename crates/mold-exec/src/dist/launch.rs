//! This process's place among the processes of one run: `MOLD_RANK`, `MOLD_WORLD_SIZE`,
//! `MOLD_MASTER_ADDR`, parsed from values the CLI reads ([`Launch::from_vars`]).

use crate::error::{ExecError, Result};

/// Port of `MOLD_MASTER_ADDR` when it names only a host.
pub const DEFAULT_PORT: u16 = 29517;

/// This process's place among the processes of one run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// `MOLD_RANK`.
    pub rank: usize,
    /// `MOLD_WORLD_SIZE`.
    pub world: usize,
    /// `MOLD_MASTER_ADDR`, with the port filled in.
    pub master: String,
}

fn launch_err(m: String) -> ExecError {
    ExecError::Launch(m)
}

impl Launch {
    /// Reads `MOLD_RANK`, `MOLD_WORLD_SIZE` and `MOLD_MASTER_ADDR` through `get` (the CLI
    /// passes `|k| std::env::var(k).ok()`). `None` when none is set (one process); an
    /// error naming the variable when they are incomplete or wrong.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
        Launch::parse(
            get("MOLD_RANK").as_deref(),
            get("MOLD_WORLD_SIZE").as_deref(),
            get("MOLD_MASTER_ADDR").as_deref(),
        )
    }

    /// [`Launch::from_vars`] on given values.
    pub fn parse(
        rank: Option<&str>,
        world: Option<&str>,
        master: Option<&str>,
    ) -> Result<Option<Launch>> {
        if rank.is_none() && world.is_none() && master.is_none() {
            return Ok(None);
        }
        let world = match world {
            None => {
                return Err(launch_err(
                    "MOLD_WORLD_SIZE is not set (MOLD_RANK or MOLD_MASTER_ADDR is): set it to \
                     the number of processes, the same in every process"
                        .into(),
                ))
            }
            Some(w) => match w.trim().parse::<usize>() {
                Ok(n) if n >= 1 => n,
                _ => {
                    return Err(launch_err(format!(
                        "MOLD_WORLD_SIZE={w:?}: give the number of processes (1 or more)"
                    )))
                }
            },
        };
        let rank = match rank {
            None if world == 1 => 0,
            None => {
                return Err(launch_err(format!(
                    "MOLD_RANK is not set: give each of the {world} processes its own rank, \
                     0..{world}"
                )))
            }
            Some(r) => match r.trim().parse::<usize>() {
                Ok(n) if n < world => n,
                _ => {
                    return Err(launch_err(format!(
                        "MOLD_RANK={r:?}: must be a whole number below MOLD_WORLD_SIZE={world} \
                         (0..{world})"
                    )))
                }
            },
        };
        if world == 1 {
            return Ok(None);
        }
        let master = match master.map(str::trim) {
            None | Some("") => {
                return Err(launch_err(
                    "MOLD_MASTER_ADDR is not set: give host:port where process 0 listens \
                     (the same in every process), e.g. node0:29517"
                        .into(),
                ))
            }
            Some(m) => m,
        };
        let master = match master.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && !h.ends_with(':') => match p.parse::<u16>() {
                Ok(_) => master.to_string(),
                Err(_) => {
                    return Err(launch_err(format!(
                        "MOLD_MASTER_ADDR={master:?}: the port `{p}` is not a number 1..65535"
                    )))
                }
            },
            _ => format!("{master}:{DEFAULT_PORT}"),
        };
        Ok(Some(Launch {
            rank,
            world,
            master,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_from_variables() {
        assert_eq!(Launch::parse(None, None, None).unwrap(), None);
        assert_eq!(Launch::parse(None, Some("1"), None).unwrap(), None);
        let l = Launch::parse(Some("1"), Some("2"), Some("node0"))
            .unwrap()
            .unwrap();
        assert_eq!(
            l,
            Launch {
                rank: 1,
                world: 2,
                master: format!("node0:{DEFAULT_PORT}")
            }
        );
        let l = Launch::parse(Some("0"), Some("2"), Some("10.0.0.1:4000"))
            .unwrap()
            .unwrap();
        assert_eq!(l.master, "10.0.0.1:4000");
        let msg = |r, w, m| Launch::parse(r, w, m).unwrap_err().to_string();
        assert!(msg(Some("0"), None, Some("h")).contains("MOLD_WORLD_SIZE is not set"));
        assert!(msg(None, Some("2"), Some("h")).contains("MOLD_RANK is not set"));
        assert!(msg(Some("2"), Some("2"), Some("h")).contains("MOLD_RANK=\"2\""));
        assert!(msg(Some("0"), Some("2"), None).contains("MOLD_MASTER_ADDR is not set"));
        assert!(msg(Some("0"), Some("x"), Some("h")).contains("MOLD_WORLD_SIZE=\"x\""));
        assert!(msg(Some("0"), Some("2"), Some("h:port")).contains("not a number"));
    }

    #[test]
    fn launch_from_a_lookup() {
        let vars = [
            ("MOLD_RANK", "1"),
            ("MOLD_WORLD_SIZE", "2"),
            ("MOLD_MASTER_ADDR", "h:9"),
        ];
        let get = |k: &str| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        };
        let l = Launch::from_vars(get).unwrap().unwrap();
        assert_eq!((l.rank, l.world, l.master.as_str()), (1, 2, "h:9"));
        assert_eq!(Launch::from_vars(|_| None).unwrap(), None);
    }
}
