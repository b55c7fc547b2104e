//! Which GPU architectures a build carries code for.

use std::fmt;

/// Machine code for the A100 (sm_80), the RTX 3090 and A10/A40 (sm_86), the RTX 4090 and
/// L40S (sm_89) and the H100/H200 (sm_90), and PTX of sm_90 for anything newer. CUDA 13
/// compiles nothing older than sm_75.
pub const DEFAULT_ARCHS: &str = "80,86,89,90";

/// The architectures of one build: machine code for each of `sass`, and PTX of the
/// newest of them, which the driver compiles for GPUs newer than all of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Archs {
    sass: Vec<u32>,
}

/// A bad `MOLD_CUDA_ARCHS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchsError(String);

impl fmt::Display for ArchsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ArchsError {}

impl Archs {
    /// Parses a comma-separated list of compute capabilities without the dot (`80,86,89,90`;
    /// `sm_90` and `9.0` are taken too). Sorted, duplicates dropped.
    pub fn parse(s: &str) -> Result<Archs, ArchsError> {
        let mut sass = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let digits = part
                .trim_start_matches("sm_")
                .trim_start_matches("compute_")
                .replace('.', "");
            let cap: u32 = digits.parse().map_err(|_| {
                ArchsError(format!(
                    "MOLD_CUDA_ARCHS: `{part}` is not a compute capability; write them like \
                     {DEFAULT_ARCHS}"
                ))
            })?;
            if !(75..=121).contains(&cap) {
                return Err(ArchsError(format!(
                    "MOLD_CUDA_ARCHS: sm_{cap} is outside what CUDA 13 compiles (75 to 121); \
                     write them like {DEFAULT_ARCHS}"
                )));
            }
            sass.push(cap);
        }
        if sass.is_empty() {
            return Err(ArchsError(format!(
                "MOLD_CUDA_ARCHS is empty; write the GPUs' compute capabilities like {DEFAULT_ARCHS}"
            )));
        }
        sass.sort_unstable();
        sass.dedup();
        Ok(Archs { sass })
    }

    /// `MOLD_CUDA_ARCHS` where set, else [`DEFAULT_ARCHS`].
    pub fn from_env() -> Result<Archs, ArchsError> {
        match std::env::var("MOLD_CUDA_ARCHS") {
            Ok(s) => Archs::parse(&s),
            Err(_) => Archs::parse(DEFAULT_ARCHS),
        }
    }

    /// The architectures that get machine code, ascending.
    pub fn sass(&self) -> &[u32] {
        &self.sass
    }

    /// The architecture whose PTX is carried: the newest.
    pub fn ptx(&self) -> u32 {
        *self.sass.last().expect("parse never returns an empty list")
    }

    /// nvcc's `-gencode` arguments for these architectures.
    pub fn gencode(&self) -> Vec<String> {
        let ptx = self.ptx();
        self.sass
            .iter()
            .map(|&a| {
                if a == ptx {
                    format!("-gencode=arch=compute_{a},code=[sm_{a},compute_{a}]")
                } else {
                    format!("-gencode=arch=compute_{a},code=sm_{a}")
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_covers_ampere_ada_and_hopper() {
        let a = Archs::parse(DEFAULT_ARCHS).unwrap();
        assert_eq!(a.sass(), &[80, 86, 89, 90]);
        assert_eq!(a.ptx(), 90);
        assert_eq!(
            a.gencode(),
            vec![
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_86,code=sm_86",
                "-gencode=arch=compute_89,code=sm_89",
                "-gencode=arch=compute_90,code=[sm_90,compute_90]",
            ]
        );
    }

    #[test]
    fn spellings_are_sorted_and_deduplicated() {
        let a = Archs::parse(" sm_90, 8.9,89 ,80").unwrap();
        assert_eq!(a.sass(), &[80, 89, 90]);
    }

    #[test]
    fn bad_lists_are_refused_naming_the_variable() {
        for bad in ["", " , ", "ninety", "sm_61", "80,x", "90,130"] {
            let e = Archs::parse(bad).unwrap_err().to_string();
            assert!(e.starts_with("MOLD_CUDA_ARCHS"), "{bad}: {e}");
            assert!(e.contains(DEFAULT_ARCHS), "{bad}: {e}");
        }
    }
}
