//! Slurm host lists (`SLURM_JOB_NODELIST`): `a1,b2`, `node[01-04,07]`,
//! `rack[1-2]-gpu[1-4]` (each bracket group a set of numbers or ranges, zero-padded to
//! the width of the range's first number; several groups in one name multiply).

use std::fmt::Write;

/// The most bracket groups one host name may hold.
const MAX_GROUPS: usize = 16;

/// A piece of a host name pattern.
#[derive(Debug)]
enum Piece {
    Text(String),
    /// Ranges `lo..=hi`, each printed zero-padded to `width` digits.
    Numbers(Vec<(u64, u64, usize)>),
}

/// Splits `list` at the commas outside brackets.
fn items(list: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("a `[` inside brackets at byte {i}")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("a `]` without its `[` at byte {i}")),
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("a `[` is never closed".into());
    }
    out.push(&list[start..]);
    Ok(out)
}

/// One range of a bracket group: `7` or `01-04`.
fn range(r: &str) -> Result<(u64, u64, usize), String> {
    let (lo, hi) = r.split_once('-').unwrap_or((r, r));
    let num = |s: &str| -> Result<u64, String> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "`{}` in brackets: expected a number or a range such as 01-04",
                r.escape_debug()
            ));
        }
        s.parse::<u64>()
            .map_err(|_| format!("`{}` in brackets is too large", s.escape_debug()))
    };
    let (l, h) = (num(lo)?, num(hi)?);
    if l > h {
        return Err(format!("the range `{}` runs backwards", r.escape_debug()));
    }
    Ok((l, h, lo.len()))
}

/// One host name pattern: text and bracket groups.
fn pattern(item: &str) -> Result<Vec<Piece>, String> {
    if item.trim().is_empty() {
        return Err("an empty host name (two commas in a row, or one at an end)".into());
    }
    let mut pieces = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            pieces.push(Piece::Text(rest[..open].to_string()));
        }
        // `items` checked that every `[` closes.
        let close = open + rest[open..].find(']').ok_or("a `[` is never closed")?;
        let ranges = rest[open + 1..close]
            .split(',')
            .map(range)
            .collect::<Result<Vec<_>, _>>()?;
        pieces.push(Piece::Numbers(ranges));
        if pieces.len() > 2 * MAX_GROUPS {
            return Err(format!(
                "more than {MAX_GROUPS} bracket groups in one host name"
            ));
        }
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        pieces.push(Piece::Text(rest.to_string()));
    }
    Ok(pieces)
}

/// Appends the hosts of `pieces` after `prefix` to `out`, until `out` holds `limit`.
fn expand_into(pieces: &[Piece], prefix: &mut String, out: &mut Vec<String>, limit: usize) {
    if out.len() >= limit {
        return;
    }
    let Some((first, rest)) = pieces.split_first() else {
        out.push(prefix.clone());
        return;
    };
    let n = prefix.len();
    match first {
        Piece::Text(t) => {
            prefix.push_str(t);
            expand_into(rest, prefix, out, limit);
            prefix.truncate(n);
        }
        Piece::Numbers(ranges) => {
            for &(lo, hi, width) in ranges {
                for v in lo..=hi {
                    if out.len() >= limit {
                        return;
                    }
                    let _ = write!(prefix, "{v:0width$}");
                    expand_into(rest, prefix, out, limit);
                    prefix.truncate(n);
                }
            }
        }
    }
}

/// The first `limit` hosts of a Slurm host list, in order (`node[01-02],gpu7` →
/// `node01, node02, gpu7`); why the list is malformed otherwise.
pub fn expand(list: &str, limit: usize) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for item in items(list.trim())? {
        let pieces = pattern(item.trim())?;
        expand_into(&pieces, &mut String::new(), &mut out, limit);
        if out.len() >= limit {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn all(list: &str) -> Vec<String> {
        expand(list, usize::MAX).unwrap()
    }

    #[test]
    fn plain_names_ranges_and_groups() {
        assert_eq!(all("a1,b2"), ["a1", "b2"]);
        assert_eq!(
            all("node[01-04,07]"),
            ["node01", "node02", "node03", "node04", "node07"]
        );
        assert_eq!(all("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(all("gpu[1-2]-ib,login"), ["gpu1-ib", "gpu2-ib", "login"]);
        assert_eq!(all("r[1-2]n[0-1]"), ["r1n0", "r1n1", "r2n0", "r2n1"]);
        assert_eq!(all("n[1-3],m[5,7]"), ["n1", "n2", "n3", "m5", "m7"]);
        assert_eq!(all("10.0.0.1"), ["10.0.0.1"]);
        // Only what is asked for is expanded: a huge range costs nothing.
        assert_eq!(
            expand("n[0-18446744073709551615]", 2).unwrap(),
            ["n0", "n1"]
        );
        assert_eq!(expand("a,b[1-3]", 1).unwrap(), ["a"]);
    }

    #[test]
    fn malformed_lists_say_what_is_wrong() {
        for (list, why) in [
            ("node[01-04", "never closed"),
            ("node01]", "without its `[`"),
            ("n[[1]]", "inside brackets"),
            ("n[4-1]", "backwards"),
            ("n[a-b]", "expected a number"),
            ("n[]", "expected a number"),
            ("a,,b", "empty host name"),
            ("n[99999999999999999999]", "too large"),
        ] {
            let e = expand(list, 10).unwrap_err();
            assert!(e.contains(why), "{list}: {e}");
        }
        let many = "n[1]".repeat(MAX_GROUPS + 1);
        assert!(expand(&many, 1).unwrap_err().contains("bracket groups"));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Hosts written in bracket form expand back to themselves, and the first host
        /// alone is the first of the whole list.
        #[test]
        fn bracket_forms_expand_to_the_hosts_they_compress(
            groups in prop::collection::vec(
                ("[a-z]{1,5}", prop::collection::btree_set(0u64..300, 1..6), 1usize..4),
                1..4,
            )
        ) {
            let mut want = Vec::new();
            let mut parts = Vec::new();
            for (prefix, nums, width) in &groups {
                let nums: Vec<u64> = nums.iter().copied().collect();
                // Runs of consecutive numbers as `lo-hi`.
                let mut ranges = Vec::new();
                let mut i = 0;
                while i < nums.len() {
                    let mut j = i;
                    while j + 1 < nums.len() && nums[j + 1] == nums[j] + 1 {
                        j += 1;
                    }
                    let f = |v: u64| format!("{v:0width$}", width = *width);
                    ranges.push(if i == j { f(nums[i]) } else { format!("{}-{}", f(nums[i]), f(nums[j])) });
                    i = j + 1;
                }
                // A number wider than the padding sets the width of its range by itself.
                for v in &nums {
                    let lo = ranges.iter().find(|r| {
                        let (l, h) = r.split_once('-').unwrap_or((r, r));
                        (l.parse::<u64>().unwrap()..=h.parse::<u64>().unwrap()).contains(v)
                    }).unwrap();
                    let w = lo.split_once('-').map(|(l, _)| l).unwrap_or(lo).len();
                    want.push(format!("{prefix}{v:0w$}"));
                }
                parts.push(format!("{prefix}[{}]", ranges.join(",")));
            }
            let list = parts.join(",");
            prop_assert_eq!(all(&list), want.clone());
            prop_assert_eq!(expand(&list, 1).unwrap(), vec![want[0].clone()]);
        }

        /// No input panics; each is hosts or a reason.
        #[test]
        fn any_text_is_hosts_or_a_reason(list in "[a-z0-9,\\[\\]\\-]{0,40}") {
            let _ = expand(&list, 100);
        }
    }
}
