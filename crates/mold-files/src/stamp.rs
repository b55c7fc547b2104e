//! The stamp that tells a file mold wrote, and nobody changed since, from any other:
//! `mold-sha256:` and the sha256 (64 lowercase hex digits) of the file's bytes with those
//! 64 digits read as `0`s (and, in a PNG, the CRC of the chunk holding them recomputed
//! over the `0`s). Any edit of the file — a value, a comment, a byte — breaks it.
//!
//! Where the stamp goes is the format's business ([`Stamp`]): a comment line in YAML
//! (the first) or SVG (the second; a comment is no field: the plan schema is
//! unchanged), a `__metadata__`
//! value of a safetensors file, a tEXt chunk of a PNG.

use sha2::{Digest, Sha256};

/// The stamp's marker, before its 64 hex digits.
pub const MARK: &str = "mold-sha256:";

/// The stamp as a writer puts it into content it stamps itself ([`Stamp::Embedded`],
/// [`Stamp::Png`]): the marker and 64 `0`s, replaced by [`stamp`].
pub const PLACEHOLDER: &str =
    "mold-sha256:0000000000000000000000000000000000000000000000000000000000000000";

const DIGITS: usize = 64;

/// Where a format carries the stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stamp {
    /// A first line `# written by mold … mold-sha256:…` (YAML), added by [`stamp`].
    HashComment,
    /// A second line `<!-- written by mold … mold-sha256:… -->` (SVG: inside the root
    /// element, so the file still starts with `<svg`), added by [`stamp`].
    XmlComment,
    /// The content holds [`PLACEHOLDER`] itself, where its format allows any text (a
    /// safetensors file's `__metadata__`); the first occurrence is the stamp.
    Embedded,
    /// A PNG holding [`PLACEHOLDER`] as the text of a tEXt chunk: the chunk's CRC is
    /// recomputed after the digits are written.
    Png,
}

const LINE: &str = "written by mold, which replaces this file only while it is unchanged:";

/// `content` with its stamp: for the comment kinds a first line is added; for the others
/// the content's [`PLACEHOLDER`] is filled in. `None` when `content` has no placeholder
/// where its kind needs one (a writer's mistake, never the user's input).
pub fn stamp(kind: Stamp, content: &[u8]) -> Option<Vec<u8>> {
    let mut out = match kind {
        Stamp::HashComment => [format!("# {LINE} {PLACEHOLDER}\n").as_bytes(), content].concat(),
        Stamp::XmlComment => {
            let cut = content
                .iter()
                .position(|&b| b == b'\n')
                .map_or(content.len(), |i| i + 1);
            let (first, rest) = content.split_at(cut);
            let sep: &[u8] = if first.ends_with(b"\n") { b"" } else { b"\n" };
            let line = format!("<!-- {LINE} {PLACEHOLDER} -->\n");
            [first, sep, line.as_bytes(), rest].concat()
        }
        Stamp::Embedded | Stamp::Png => content.to_vec(),
    };
    let at = find(kind, &out)?;
    if out[at..at + DIGITS].iter().any(|&b| b != b'0') {
        return None;
    }
    if kind == Stamp::Png {
        fix_png_crc(&mut out, at)?;
    }
    let hex = digest(&out);
    out[at..at + DIGITS].copy_from_slice(hex.as_bytes());
    if kind == Stamp::Png {
        fix_png_crc(&mut out, at)?;
    }
    Some(out)
}

/// Whether `bytes` carry a stamp of `kind` that matches them: mold wrote them and nothing
/// changed since. Any input at all is answered (never a panic).
pub fn is_unchanged(kind: Stamp, bytes: &[u8]) -> bool {
    let Some(at) = find(kind, bytes) else {
        return false;
    };
    let found = &bytes[at..at + DIGITS];
    if !found
        .iter()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
    {
        return false;
    }
    let mut zeroed = bytes.to_vec();
    zeroed[at..at + DIGITS].fill(b'0');
    if kind == Stamp::Png && fix_png_crc(&mut zeroed, at).is_none() {
        return false;
    }
    digest(&zeroed).as_bytes() == found
}

fn digest(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Where the stamp's 64 digits start: after the first marker (in the first line of YAML,
/// the second of SVG), if 64 bytes follow it.
fn find(kind: Stamp, bytes: &[u8]) -> Option<usize> {
    let line_end = |from: usize| {
        bytes[from..]
            .iter()
            .position(|&b| b == b'\n')
            .map_or(bytes.len(), |i| from + i)
    };
    let (start, end, opener): (usize, usize, &[u8]) = match kind {
        Stamp::HashComment => (0, line_end(0), b"# "),
        Stamp::XmlComment => {
            let second = (line_end(0) + 1).min(bytes.len());
            (second, line_end(second), b"<!-- ")
        }
        Stamp::Embedded | Stamp::Png => (0, bytes.len(), b""),
    };
    let region = &bytes[start..end];
    if !region.starts_with(opener) {
        return None;
    }
    let m = MARK.as_bytes();
    let at = region.windows(m.len()).position(|w| w == m)? + m.len();
    (at + DIGITS <= region.len()).then_some(start + at)
}

/// Recomputes the CRC of the PNG chunk whose data holds byte `at`; `None` when `bytes`
/// is no PNG or no chunk holds it.
fn fix_png_crc(bytes: &mut [u8], at: usize) -> Option<()> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    if !bytes.starts_with(SIGNATURE) {
        return None;
    }
    let mut pos = SIGNATURE.len();
    loop {
        let len = u32::from_be_bytes(bytes.get(pos..pos + 4)?.try_into().ok()?) as usize;
        let data = pos.checked_add(8)?;
        let end = data.checked_add(len)?;
        let crc_end = end.checked_add(4)?;
        if crc_end > bytes.len() {
            return None;
        }
        if (data..end).contains(&at) {
            // The stamp's digits must lie inside the chunk's data, and the chunk be tEXt.
            if at + DIGITS > end || &bytes[pos + 4..data] != b"tEXt" {
                return None;
            }
            let crc = crc32fast::hash(&bytes[pos + 4..end]);
            bytes[end..crc_end].copy_from_slice(&crc.to_be_bytes());
            return Some(());
        }
        pos = crc_end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PNG's chunks, as a writer lays them out: `(type, data)` each, CRCs computed.
    fn png(chunks: &[(&[u8; 4], &[u8])]) -> Vec<u8> {
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        for (t, d) in chunks {
            out.extend_from_slice(&(d.len() as u32).to_be_bytes());
            let start = out.len();
            out.extend_from_slice(*t);
            out.extend_from_slice(d);
            let crc = crc32fast::hash(&out[start..]);
            out.extend_from_slice(&crc.to_be_bytes());
        }
        out
    }

    fn png_with_placeholder() -> Vec<u8> {
        let text = [b"mold\0".as_slice(), PLACEHOLDER.as_bytes()].concat();
        png(&[
            (b"IHDR", &[0, 0, 0, 1, 0, 0, 0, 1, 8, 2, 0, 0, 0]),
            (b"tEXt", b"prompt\0a fox"),
            (b"tEXt", &text),
            (b"IDAT", &[1, 2, 3]),
            (b"IEND", &[]),
        ])
    }

    /// Every chunk's CRC matches its type and data.
    fn crcs_ok(bytes: &[u8]) -> bool {
        let mut pos = 8;
        while pos < bytes.len() {
            let len = u32::from_be_bytes(bytes[pos..pos + 4].try_into().unwrap()) as usize;
            let end = pos + 8 + len;
            let crc = u32::from_be_bytes(bytes[end..end + 4].try_into().unwrap());
            if crc != crc32fast::hash(&bytes[pos + 4..end]) {
                return false;
            }
            pos = end + 4;
        }
        true
    }

    #[test]
    fn a_stamped_file_is_unchanged_and_any_edit_breaks_it() {
        for (kind, content) in [
            (Stamp::HashComment, b"version: 4\nsteps: 28\n".to_vec()),
            (
                Stamp::XmlComment,
                b"<svg width=\"10\">\n<rect/>\n</svg>\n".to_vec(),
            ),
            (
                Stamp::Embedded,
                format!("{{\"__metadata__\":{{\"mold\":\"{PLACEHOLDER}\"}}}}steps28").into_bytes(),
            ),
            (Stamp::Png, png_with_placeholder()),
        ] {
            let s = stamp(kind, &content).unwrap();
            assert!(is_unchanged(kind, &s), "{kind:?}");
            assert!(!is_unchanged(kind, &content), "{kind:?}: unstamped");
            // An edit anywhere (here: the last byte but one) breaks the stamp.
            let mut e = s.clone();
            let i = e.len() - 2;
            e[i] ^= 1;
            assert!(!is_unchanged(kind, &e), "{kind:?}: edited");
            // So does a line or a comment added in front.
            let added = [b"# reviewed\n".as_slice(), &s].concat();
            assert!(!is_unchanged(kind, &added), "{kind:?}: comment added");
        }
    }

    #[test]
    fn an_svg_keeps_its_root_element_first() {
        let s = stamp(Stamp::XmlComment, b"<svg>\n<rect/>\n</svg>\n").unwrap();
        let s = String::from_utf8(s).unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "<svg>");
        assert!(lines[1].starts_with("<!-- written by mold") && lines[1].ends_with(" -->"));
        assert_eq!(lines[2..], ["<rect/>", "</svg>"]);
        // One line of content: the comment follows it.
        let one = stamp(Stamp::XmlComment, b"<svg/>").unwrap();
        assert!(one.starts_with(b"<svg/>\n<!-- written by mold"));
        assert!(is_unchanged(Stamp::XmlComment, &one));
    }

    #[test]
    fn a_stamped_png_keeps_valid_crcs() {
        let s = stamp(Stamp::Png, &png_with_placeholder()).unwrap();
        assert!(crcs_ok(&s));
        assert!(!s
            .windows(PLACEHOLDER.len())
            .any(|w| w == PLACEHOLDER.as_bytes()));
    }

    #[test]
    fn a_hand_edited_value_with_the_old_stamp_is_not_unchanged() {
        let s = stamp(Stamp::HashComment, b"steps: 28\n").unwrap();
        let edited = String::from_utf8(s).unwrap().replace("28", "20");
        assert!(!is_unchanged(Stamp::HashComment, edited.as_bytes()));
    }

    #[test]
    fn content_without_a_placeholder_is_not_stamped() {
        assert!(stamp(Stamp::Embedded, b"no stamp here").is_none());
        assert!(stamp(Stamp::Png, b"\x89PNG\r\n\x1a\nmold-sha256:").is_none());
        // The placeholder outside any chunk of a PNG.
        let p = [b"\x89PNG\r\n\x1a\n".as_slice(), PLACEHOLDER.as_bytes()].concat();
        assert!(stamp(Stamp::Png, &p).is_none());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let s = stamp(Stamp::Png, &png_with_placeholder()).unwrap();
        // Every truncation and a run of corruptions of a stamped PNG and YAML.
        let y = stamp(Stamp::HashComment, b"a: 1\n").unwrap();
        for kind in [
            Stamp::Png,
            Stamp::HashComment,
            Stamp::XmlComment,
            Stamp::Embedded,
        ] {
            for base in [&s, &y] {
                for n in 0..base.len() {
                    let _ = is_unchanged(kind, &base[..n]);
                    let mut c = base.to_vec();
                    c[n] = 0xff;
                    let _ = is_unchanged(kind, &c);
                }
            }
        }
        // A chunk length pointing far past the end.
        let mut big = s.clone();
        big[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(!is_unchanged(Stamp::Png, &big));
    }
}
