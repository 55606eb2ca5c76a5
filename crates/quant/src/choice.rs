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
    /// blocksize 256), saving 0.373 bit/param. `experts` (`[model] quantize_experts`, off by
    /// default as bitsandbytes, which quantizes `nn.Linear`s only) also holds a mixture of
    /// experts' 3-D stacks in NF4, each expert's `(out, in)` matrix as bitsandbytes would quantize
    /// it alone (`rtune_experts::moe::stack`).
    Nf4 { double_quant: bool, experts: bool },
}

/// The names [`Quantize`] parses and prints.
pub const QUANTIZE_NAMES: [&str; 3] = ["none", "nf4", "nf4-dq"];
/// After `nf4` or `nf4-dq` in the printed name: the expert stacks are NF4 too (`nf4+experts`).
pub const EXPERTS_SUFFIX: &str = "+experts";

impl Quantize {
    /// `Some(double_quant)` for NF4.
    pub fn nf4(self) -> Option<bool> {
        match self {
            Quantize::None => None,
            Quantize::Nf4 { double_quant, .. } => Some(double_quant),
        }
    }

    /// NF4 linear layers, the expert stacks as computed (`experts: false`).
    pub const fn linears(double_quant: bool) -> Quantize {
        Quantize::Nf4 {
            double_quant,
            experts: false,
        }
    }

    /// Whether a mixture of experts' stacks are held in NF4 too.
    pub fn experts(self) -> bool {
        matches!(self, Quantize::Nf4 { experts: true, .. })
    }
}

impl fmt::Display for Quantize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (name, experts) = match *self {
            Quantize::None => ("none", false),
            Quantize::Nf4 {
                double_quant,
                experts,
            } => (if double_quant { "nf4-dq" } else { "nf4" }, experts),
        };
        f.write_str(name)?;
        match experts {
            true => f.write_str(EXPERTS_SUFFIX),
            false => Ok(()),
        }
    }
}

/// A name not in [`QUANTIZE_NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not one of none, nf4, nf4-dq")]
pub struct UnknownQuantize(pub String);

impl FromStr for Quantize {
    type Err = UnknownQuantize;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (base, experts) = match s.strip_suffix(EXPERTS_SUFFIX) {
            Some(base) if base != "none" => (base, true),
            _ => (s, false),
        };
        match base {
            "none" => Ok(Quantize::None),
            "nf4" | "nf4-dq" => Ok(Quantize::Nf4 {
                double_quant: base == "nf4-dq",
                experts,
            }),
            _ => Err(UnknownQuantize(s.to_string())),
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
        // The expert stacks in NF4 too: printed and parsed with the suffix, refused on `none`.
        for name in ["nf4+experts", "nf4-dq+experts"] {
            let q: Quantize = name.parse().unwrap();
            assert!(q.experts());
            assert_eq!(q.to_string(), name);
        }
        assert!(!"nf4".parse::<Quantize>().unwrap().experts());
        assert!("none+experts".parse::<Quantize>().is_err());
    }
}
