//! A diffusers-format FLUX transformer presented under BFL's names: each BFL tensor is
//! the concatenation, along rows, of row ranges of diffusers tensors
//! ([`mold_models::diffusers`] has the map). A request for some rows of a BFL tensor —
//! a tensor-parallel rank's share of a fused `qkv`, say — becomes reads of exactly the
//! matching rows of the diffusers tensors, so nothing is concatenated whole first.

use crate::error::{ExecError, Result};
use std::collections::BTreeMap;
use std::ops::Range;

/// One piece of a BFL tensor: rows `rows` of stored tensor `source`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub source: String,
    pub rows: Range<usize>,
}

/// The pieces of every BFL tensor, in row order.
#[derive(Clone, Debug, Default)]
pub struct Adapter {
    map: BTreeMap<String, Vec<Piece>>,
}

/// Reads that make a slice: from each source, these row ranges, in order.
pub type Reads = Vec<(String, Vec<Range<usize>>)>;

impl Adapter {
    pub fn new(pieces: &mold_models::diffusers::Pieces) -> Adapter {
        Adapter {
            map: pieces
                .iter()
                .map(|(bfl, ps)| {
                    let ps = ps
                        .iter()
                        .map(|p| Piece {
                            source: p.source.clone(),
                            rows: p.rows.start as usize..p.rows.end as usize,
                        })
                        .collect();
                    (bfl.clone(), ps)
                })
                .collect(),
        }
    }

    /// The reads that give rows `rows` (in the order given) of BFL tensor `name`.
    pub fn sources(&self, name: &str, rows: &[Range<usize>]) -> Result<Reads> {
        let pieces = self.map.get(name).ok_or_else(|| {
            ExecError::Input(format!(
                "tensor `{name}` is not one the diffusers adapter serves"
            ))
        })?;
        Ok(sources(pieces, rows))
    }
}

/// [`Adapter::sources`] over explicit pieces: each requested range is cut where pieces
/// meet; reads from the same source that follow each other are merged into one read
/// of several ranges.
pub fn sources(pieces: &[Piece], rows: &[Range<usize>]) -> Reads {
    let mut out: Reads = Vec::new();
    for r in rows {
        let mut at = 0;
        for p in pieces {
            let len = p.rows.len();
            let (a, b) = (r.start.max(at), r.end.min(at + len));
            if a < b {
                let src = p.rows.start + (a - at)..p.rows.start + (b - at);
                match out.last_mut() {
                    Some((s, ranges)) if *s == p.source => match ranges.last_mut() {
                        Some(last) if last.end == src.start => last.end = src.end,
                        _ => ranges.push(src),
                    },
                    _ => out.push((p.source.clone(), vec![src])),
                }
            }
            at += len;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Pieces of 1–6 rows of up to 3 sources (a source may appear twice, as
    /// `norm_out.linear` does), and requested ranges inside their total.
    fn case() -> impl Strategy<Value = (Vec<Piece>, Vec<Range<usize>>)> {
        prop::collection::vec((0usize..3, 0usize..4, 1usize..7), 1..5).prop_flat_map(|ps| {
            let pieces: Vec<Piece> = ps
                .iter()
                .map(|&(s, start, len)| Piece {
                    source: format!("s{s}"),
                    rows: start..start + len,
                })
                .collect();
            let total: usize = pieces.iter().map(|p| p.rows.len()).sum();
            let ranges = prop::collection::vec((0..total, 0..total), 1..4).prop_map(|v| {
                v.into_iter()
                    .map(|(a, b)| a.min(b)..a.max(b) + 1)
                    .collect::<Vec<_>>()
            });
            (Just(pieces), ranges)
        })
    }

    proptest! {
        /// Reading the computed ranges of the sources gives exactly the requested rows of
        /// the concatenation, in order.
        #[test]
        fn slices_of_the_concatenation((pieces, rows) in case()) {
            let concat: Vec<(String, usize)> = pieces
                .iter()
                .flat_map(|p| p.rows.clone().map(move |r| (p.source.clone(), r)))
                .collect();
            let want: Vec<(String, usize)> = rows
                .iter()
                .flat_map(|r| concat[r.clone()].iter().cloned())
                .collect();
            let got: Vec<(String, usize)> = sources(&pieces, &rows)
                .into_iter()
                .flat_map(|(s, ranges)| {
                    ranges
                        .into_iter()
                        .flat_map(move |r| r.map({ let s = s.clone(); move |i| (s.clone(), i) }))
                })
                .collect();
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn the_swapped_halves_are_read_back_in_bfl_order() {
        // final_layer.adaLN_modulation.1 (shift, scale) from norm_out.linear (scale, shift).
        let h = 4;
        let pieces = vec![
            Piece {
                source: "norm_out.linear.weight".into(),
                rows: h..2 * h,
            },
            Piece {
                source: "norm_out.linear.weight".into(),
                rows: 0..h,
            },
        ];
        let got = sources(&pieces, std::slice::from_ref(&(0..2 * h)));
        assert_eq!(
            got,
            vec![("norm_out.linear.weight".to_string(), vec![h..2 * h, 0..h])]
        );
        // A rank's rows 2..6 straddle the two halves.
        let got = sources(&pieces, std::slice::from_ref(&(2..6)));
        assert_eq!(
            got,
            vec![("norm_out.linear.weight".to_string(), vec![6..8, 0..2])]
        );
    }
}
