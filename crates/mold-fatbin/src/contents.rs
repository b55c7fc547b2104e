//! What a CUDA fat binary holds, read from its bytes: a 16-byte header (magic
//! `0xBA55ED50`, version, header size, size of what follows), then images, each a header
//! (kind: 1 PTX, 2 machine code; its header size; its payload size; the architecture at
//! byte 28) and its payload. The layout is nvcc's `fatbinary` output as CUDA 13 writes it.

use std::fmt;

const MAGIC: u32 = 0xBA55_ED50;

/// One image of a fat binary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Image {
    pub kind: ImageKind,
    /// The compute capability without the dot (90 for sm_90).
    pub arch: u32,
}

/// Machine code runs as it is on its architecture; PTX is compiled by the driver for the
/// GPU it meets (its architecture or a newer one), on first use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ImageKind {
    Sass,
    Ptx,
}

/// A fat binary's images, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Contents(pub Vec<Image>);

/// Bytes that are not a fat binary nvcc wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FatbinError {
    NotAFatbin,
    Truncated { at: usize },
    UnknownImageKind { kind: u16, at: usize },
}

impl fmt::Display for FatbinError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FatbinError::NotAFatbin => f.write_str("not a CUDA fat binary (no 0xBA55ED50 magic)"),
            FatbinError::Truncated { at } => {
                write!(f, "the fat binary ends inside its image at byte {at}")
            }
            FatbinError::UnknownImageKind { kind, at } => {
                write!(
                    f,
                    "the fat binary's image at byte {at} is of unknown kind {kind}"
                )
            }
        }
    }
}

impl std::error::Error for FatbinError {}

fn u16_at(b: &[u8], at: usize) -> Result<u16, FatbinError> {
    b.get(at..at + 2)
        .map(|s| u16::from_le_bytes([s[0], s[1]]))
        .ok_or(FatbinError::Truncated { at })
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, FatbinError> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
        .ok_or(FatbinError::Truncated { at })
}

fn u64_at(b: &[u8], at: usize) -> Result<u64, FatbinError> {
    Ok(u64::from(u32_at(b, at)?) | (u64::from(u32_at(b, at + 4)?) << 32))
}

/// The images of the fat binary `bytes`.
pub fn contents(bytes: &[u8]) -> Result<Contents, FatbinError> {
    if u32_at(bytes, 0).ok() != Some(MAGIC) {
        return Err(FatbinError::NotAFatbin);
    }
    let header = usize::from(u16_at(bytes, 6)?);
    let size = u64_at(bytes, 8)?;
    let end = header
        .checked_add(usize::try_from(size).map_err(|_| FatbinError::Truncated { at: 8 })?)
        .filter(|&e| e <= bytes.len())
        .ok_or(FatbinError::Truncated { at: bytes.len() })?;
    let mut images = Vec::new();
    let mut at = header;
    while at < end {
        let kind = match u16_at(bytes, at)? {
            1 => ImageKind::Ptx,
            2 => ImageKind::Sass,
            kind => return Err(FatbinError::UnknownImageKind { kind, at }),
        };
        let head = u32_at(bytes, at + 4)? as usize;
        let payload =
            usize::try_from(u64_at(bytes, at + 8)?).map_err(|_| FatbinError::Truncated { at })?;
        let arch = u32_at(bytes, at + 28)?;
        images.push(Image { kind, arch });
        at = at
            .checked_add(head)
            .and_then(|a| a.checked_add(payload))
            .filter(|&a| a <= end && head >= 32)
            .ok_or(FatbinError::Truncated { at })?;
    }
    Ok(Contents(images))
}

impl Contents {
    /// The architectures with machine code, ascending.
    pub fn sass(&self) -> Vec<u32> {
        self.of(ImageKind::Sass)
    }

    /// The architectures with PTX, ascending.
    pub fn ptx(&self) -> Vec<u32> {
        self.of(ImageKind::Ptx)
    }

    fn of(&self, kind: ImageKind) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .0
            .iter()
            .filter(|i| i.kind == kind)
            .map(|i| i.arch)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// How a GPU of compute capability `cap` would get this code: machine code as it is
    /// (`Some(Sass)`), PTX the driver compiles first (`Some(Ptx)`: the newest PTX not above
    /// `cap`), or not at all (`None`). Machine code of sm_XY runs on sm_XZ with Z ≥ Y only
    /// within one major version; here only an exact match counts, as nvcc emits none other.
    pub fn runs_on(&self, cap: u32) -> Option<ImageKind> {
        if self.sass().contains(&cap) {
            Some(ImageKind::Sass)
        } else if self.ptx().iter().any(|&p| p <= cap) {
            Some(ImageKind::Ptx)
        } else {
            None
        }
    }
}

impl Contents {
    /// [`Contents::runs_on`] as a check for a GPU of compute capability `cap` (90 for
    /// sm_90): how it gets this code, or one line saying it gets none and how to rebuild.
    pub fn check(&self, cap: u32) -> Result<ImageKind, String> {
        self.runs_on(cap).ok_or_else(|| {
            let mut archs = self.sass();
            archs.push(cap);
            archs.sort_unstable();
            archs.dedup();
            let list: Vec<String> = archs.iter().map(u32::to_string).collect();
            format!(
                "this build's GPU kernels have no code for sm_{cap} ({self}); rebuild with \
                 MOLD_CUDA_ARCHS={} scripts/build-cuda",
                list.join(",")
            )
        })
    }
}

impl fmt::Display for Contents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |v: Vec<u32>, p: &str| {
            v.iter()
                .map(|a| format!("{p}{a}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        match (self.sass().is_empty(), self.ptx().is_empty()) {
            (false, false) => write!(
                f,
                "machine code for {}; PTX for {}",
                list(self.sass(), "sm_"),
                list(self.ptx(), "compute_")
            ),
            (false, true) => write!(f, "machine code for {}; no PTX", list(self.sass(), "sm_")),
            (true, false) => write!(
                f,
                "no machine code; PTX for {}",
                list(self.ptx(), "compute_")
            ),
            (true, true) => f.write_str("no code"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fat binary laid out as nvcc writes one: `images` as (kind, arch, payload bytes).
    fn fatbin(images: &[(u16, u32, usize)]) -> Vec<u8> {
        let mut body = Vec::new();
        for &(kind, arch, payload) in images {
            let head: u32 = if kind == 1 { 80 } else { 64 };
            let mut h = vec![0u8; head as usize];
            h[0..2].copy_from_slice(&kind.to_le_bytes());
            h[2..4].copy_from_slice(&257u16.to_le_bytes());
            h[4..8].copy_from_slice(&head.to_le_bytes());
            h[8..16].copy_from_slice(&(payload as u64).to_le_bytes());
            h[28..32].copy_from_slice(&arch.to_le_bytes());
            body.extend(h);
            body.extend(std::iter::repeat_n(0xAB, payload));
        }
        let mut b = Vec::new();
        b.extend(MAGIC.to_le_bytes());
        b.extend(1u16.to_le_bytes());
        b.extend(16u16.to_le_bytes());
        b.extend((body.len() as u64).to_le_bytes());
        b.extend(body);
        b
    }

    #[test]
    fn lists_machine_code_and_ptx() {
        let b = fatbin(&[
            (2, 80, 100),
            (2, 86, 7),
            (2, 89, 3),
            (2, 90, 5),
            (1, 90, 11),
        ]);
        let c = contents(&b).unwrap();
        assert_eq!(c.sass(), vec![80, 86, 89, 90]);
        assert_eq!(c.ptx(), vec![90]);
        assert_eq!(
            c.to_string(),
            "machine code for sm_80, sm_86, sm_89, sm_90; PTX for compute_90"
        );
        assert_eq!(c.runs_on(90), Some(ImageKind::Sass));
        assert_eq!(c.runs_on(89), Some(ImageKind::Sass));
        assert_eq!(
            c.runs_on(100),
            Some(ImageKind::Ptx),
            "a newer GPU compiles the PTX"
        );
        assert_eq!(c.runs_on(87), None, "no machine code and no PTX old enough");
        assert_eq!(c.runs_on(75), None);
    }

    #[test]
    fn a_gpu_without_code_is_refused_naming_the_rebuild() {
        let c = contents(&fatbin(&[
            (2, 80, 1),
            (2, 86, 1),
            (2, 89, 1),
            (2, 90, 1),
            (1, 90, 1),
        ]))
        .unwrap();
        assert_eq!(c.check(86), Ok(ImageKind::Sass));
        assert_eq!(c.check(120), Ok(ImageKind::Ptx));
        assert_eq!(
            c.check(75).unwrap_err(),
            "this build's GPU kernels have no code for sm_75 (machine code for sm_80, sm_86, \
             sm_89, sm_90; PTX for compute_90); rebuild with MOLD_CUDA_ARCHS=75,80,86,89,90 \
             scripts/build-cuda"
        );
    }

    #[test]
    fn a_ptx_only_binary_needs_the_driver() {
        let c = contents(&fatbin(&[(1, 80, 40)])).unwrap();
        assert!(c.sass().is_empty());
        assert_eq!(c.to_string(), "no machine code; PTX for compute_80");
        assert_eq!(c.runs_on(90), Some(ImageKind::Ptx));
    }

    #[test]
    fn broken_bytes_are_errors_not_panics() {
        let good = fatbin(&[(2, 80, 100), (1, 90, 11)]);
        assert_eq!(contents(b"// placeholder"), Err(FatbinError::NotAFatbin));
        assert_eq!(contents(&[]), Err(FatbinError::NotAFatbin));
        for cut in [4, 12, 17, 40, 100, good.len() - 1] {
            assert!(contents(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = good.clone();
        bad[16] = 7;
        assert_eq!(
            contents(&bad),
            Err(FatbinError::UnknownImageKind { kind: 7, at: 16 })
        );
        // An image header that claims less than its fixed part cannot loop forever.
        let mut zero = good;
        zero[20..24].copy_from_slice(&0u32.to_le_bytes());
        zero[24..32].copy_from_slice(&0u64.to_le_bytes());
        assert!(contents(&zero).is_err());
    }
}
