//! Byte sizes as people write them: `24GiB`, `23.8 GB`, `512MiB`, `1073741824`.

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// A number of bytes. Parses integers and strings with a decimal (`kB`, `MB`, `GB`,
/// `TB`) or binary (`KiB`, `MiB`, `GiB`, `TiB`) unit; serializes exactly, in the largest
/// binary unit that divides it, so a plan written and read back is unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const ZERO: ByteSize = ByteSize(0);

    pub fn bytes(self) -> u64 {
        self.0
    }
    pub fn gib(self) -> f64 {
        self.0 as f64 / GIB as f64
    }
    pub fn gb(self) -> f64 {
        self.0 as f64 / 1e9
    }
    /// Rounded up to a whole MiB: how predictions are recorded, so plans stay readable.
    pub fn ceil_mib(self) -> ByteSize {
        ByteSize(self.0.div_ceil(MIB) * MIB)
    }
    /// Human form with two decimals in GiB/MiB, for summaries (not exact).
    pub fn human(self) -> String {
        if self.0 >= GIB {
            format!("{:.2} GiB", self.gib())
        } else if self.0 >= MIB {
            format!("{:.1} MiB", self.0 as f64 / MIB as f64)
        } else {
            format!("{} B", self.0)
        }
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b == 0 {
            return write!(f, "0");
        }
        for (unit, name) in [
            (1u64 << 40, "TiB"),
            (GIB, "GiB"),
            (MIB, "MiB"),
            (KIB, "KiB"),
        ] {
            if b.is_multiple_of(unit) {
                return write!(f, "{}{}", b / unit, name);
            }
        }
        write!(f, "{b}")
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteSizeError(pub String);

impl fmt::Display for ByteSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` is not a size: write a number of bytes or a number with a unit, e.g. 24GiB, 23.8GB, 512MiB",
            // Escaped: the message stays one line whatever the input holds.
            self.0.escape_debug()
        )
    }
}
impl std::error::Error for ByteSizeError {}

impl FromStr for ByteSize {
    type Err = ByteSizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        let err = || ByteSizeError(s.to_string());
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        if num.is_empty() {
            return Err(err());
        }
        let unit = unit.trim();
        let mult: f64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "k" | "kb" => 1e3,
            "m" | "mb" => 1e6,
            "g" | "gb" => 1e9,
            "t" | "tb" => 1e12,
            "kib" => KIB as f64,
            "mib" => MIB as f64,
            "gib" => GIB as f64,
            "tib" => (1u64 << 40) as f64,
            _ => return Err(err()),
        };
        if !num.contains('.') {
            let n: u64 = num.parse().map_err(|_| err())?;
            return n.checked_mul(mult as u64).map(ByteSize).ok_or_else(err);
        }
        let n: f64 = num.parse().map_err(|_| err())?;
        let v = n * mult;
        if !v.is_finite() || v < 0.0 || v > u64::MAX as f64 {
            return Err(err());
        }
        Ok(ByteSize(v.round() as u64))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 != 0 && self.0.is_multiple_of(KIB) {
            s.serialize_str(&self.to_string())
        } else {
            s.serialize_u64(self.0)
        }
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(
                    f,
                    "a size: bytes, or a number with a unit such as 24GiB or 23.8GB"
                )
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative ({v})")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<ByteSize, E> {
                if v.is_finite() && v >= 0.0 {
                    Ok(ByteSize(v.round() as u64))
                } else {
                    Err(E::custom(format!("`{v}` is not a size")))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!("24GiB".parse::<ByteSize>().unwrap().0, 24 * GIB);
        assert_eq!("23.8 GB".parse::<ByteSize>().unwrap().0, 23_800_000_000);
        assert_eq!("512MiB".parse::<ByteSize>().unwrap().0, 512 * MIB);
        assert_eq!("1000".parse::<ByteSize>().unwrap().0, 1000);
        assert!("ten GB".parse::<ByteSize>().is_err());
        assert!("10 GX".parse::<ByteSize>().is_err());
        assert!("".parse::<ByteSize>().is_err());
        // Control characters are escaped: one line whatever the input.
        let e = "1\nXB".parse::<ByteSize>().unwrap_err().to_string();
        assert!(e.starts_with("`1\\nXB` is not a size"), "{e}");
    }

    #[test]
    fn display_round_trips() {
        for b in [
            0,
            1,
            1023,
            KIB,
            3 * MIB,
            24 * GIB,
            23_800_000_000,
            GIB + MIB,
        ] {
            let s = ByteSize(b).to_string();
            assert_eq!(s.parse::<ByteSize>().unwrap().0, b, "{s}");
        }
        assert_eq!(ByteSize(24 * GIB).to_string(), "24GiB");
    }
}
