//! How the frozen linear layers are held — the one type for this choice, from the config file
//! (`[model] quantize` + `double_quant`), the command line (`--quantize none|nf4|nf4-dq`), the
//! memory estimate and the loader alike.

use std::fmt;
use std::str::FromStr;

/// The frozen linear layers' storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quantize {
    /// In the compute dtype.
    #[default]
    None,
    /// bitsandbytes NF4, blocksize 64; `double_quant` also quantizes the absmax scales (8-bit,
    /// blocksize 256), saving 0.373 bit/param.
    Nf4 { double_quant: bool },
}

/// The names [`Quantize`] parses and prints.
pub const QUANTIZE_NAMES: [&str; 3] = ["none", "nf4", "nf4-dq"];

impl Quantize {
    /// `Some(double_quant)` for NF4.
    pub fn nf4(self) -> Option<bool> {
        match self {
            Quantize::None => None,
            Quantize::Nf4 { double_quant } => Some(double_quant),
        }
    }
}

impl fmt::Display for Quantize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Quantize::None => "none",
            Quantize::Nf4 {
                double_quant: false,
            } => "nf4",
            Quantize::Nf4 { double_quant: true } => "nf4-dq",
        })
    }
}

/// A name not in [`QUANTIZE_NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not one of none, nf4, nf4-dq")]
pub struct UnknownQuantize(pub String);

impl FromStr for Quantize {
    type Err = UnknownQuantize;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "none" => Ok(Quantize::None),
            "nf4" => Ok(Quantize::Nf4 {
                double_quant: false,
            }),
            "nf4-dq" => Ok(Quantize::Nf4 { double_quant: true }),
            other => Err(UnknownQuantize(other.to_string())),
        }
    }
}

impl serde::Serialize for Quantize {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Quantize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_text_and_serde() {
        for name in QUANTIZE_NAMES {
            let q: Quantize = name.parse().unwrap();
            assert_eq!(q.to_string(), name);
            let json = serde_json::to_string(&q).unwrap();
            assert_eq!(json, format!("\"{name}\""));
            assert_eq!(serde_json::from_str::<Quantize>(&json).unwrap(), q);
        }
        assert_eq!("nf4-dq".parse::<Quantize>().unwrap().nf4(), Some(true));
        assert_eq!(Quantize::None.nf4(), None);
        let e = "int8".parse::<Quantize>().unwrap_err().to_string();
        assert_eq!(e, "`int8` is not one of none, nf4, nf4-dq");
        assert!(serde_json::from_str::<Quantize>("\"fp4\"").is_err());
    }
}
