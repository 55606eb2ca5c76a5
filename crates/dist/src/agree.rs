//! The start-up agreement check: every rank's resolved settings (config, model and data
//! checksums) must equal rank 0's, or the run is refused on every rank, naming the first rank that
//! differs and the setting. Ranks that trained on different data or settings would average
//! gradients of different problems without any visible error.
//!
//! Each rank's map goes through one all-gather as `key \x1f value \x1e` records (keys and values
//! never hold those separators: they are config keys, paths, numbers and hex digests).

use std::collections::BTreeMap;

use crate::World;

/// A rank whose settings differ from rank 0's.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "rank {rank} (of {size}) does not run what rank 0 runs: {key} is {theirs} on rank {rank}, \
     {ours} on rank 0; every rank must have the same config, model and data"
)]
pub struct Disagreement {
    pub rank: usize,
    pub size: usize,
    pub key: String,
    /// Rank 0's value (`(unset)` when it has none).
    pub ours: String,
    /// The differing rank's value.
    pub theirs: String,
}

fn encode(map: &BTreeMap<String, String>) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in map {
        out.extend_from_slice(k.as_bytes());
        out.push(0x1f);
        out.extend_from_slice(v.as_bytes());
        out.push(0x1e);
    }
    out
}

fn decode(bytes: &[u8]) -> BTreeMap<String, String> {
    bytes
        .split(|&b| b == 0x1e)
        .filter(|r| !r.is_empty())
        .map(|r| {
            let cut = r.iter().position(|&b| b == 0x1f).unwrap_or(r.len());
            let v = r.get(cut + 1..).unwrap_or_default();
            (
                String::from_utf8_lossy(&r[..cut]).into_owned(),
                String::from_utf8_lossy(v).into_owned(),
            )
        })
        .collect()
}

/// The first rank (and key, in key order) whose map differs from rank 0's, among `maps` in rank
/// order.
pub fn first_difference(maps: &[BTreeMap<String, String>]) -> Option<Disagreement> {
    let (root, rest) = maps.split_first()?;
    let unset = String::from("(unset)");
    rest.iter().enumerate().find_map(|(i, m)| {
        let key = root
            .keys()
            .chain(m.keys())
            .filter(|k| root.get(*k) != m.get(*k))
            .min()?;
        Some(Disagreement {
            rank: i + 1,
            size: maps.len(),
            key: key.clone(),
            ours: root.get(key).unwrap_or(&unset).clone(),
            theirs: m.get(key).unwrap_or(&unset).clone(),
        })
    })
}

/// Compares every rank's `mine` with rank 0's (one all-gather; every rank gets the same verdict).
pub fn check_agreement(world: &World, mine: &BTreeMap<String, String>) -> Result<(), Disagreement> {
    if !world.is_distributed() {
        return Ok(());
    }
    let maps: Vec<_> = world
        .all_gather("the start-up settings check", &encode(mine))
        .iter()
        .map(|b| decode(b))
        .collect();
    first_difference(&maps).map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn maps_round_trip_through_the_wire_format() {
        let m = map(&[
            ("data.train[0] sha256", "ab12"),
            ("train.lr", "0.0002"),
            ("empty", ""),
        ]);
        assert_eq!(decode(&encode(&m)), m);
    }

    /// The first differing rank and, within it, the first differing key are named with both values.
    #[test]
    fn the_first_differing_rank_and_key_are_named() {
        let a = map(&[("data.train[0] sha256", "aaaa"), ("train.lr", "0.1")]);
        let b = map(&[("data.train[0] sha256", "bbbb"), ("train.lr", "0.1")]);
        let c = map(&[("train.lr", "0.1")]);
        assert_eq!(first_difference(&[a.clone(), a.clone(), a.clone()]), None);
        let d = first_difference(&[a.clone(), a.clone(), b, c]).unwrap();
        assert_eq!(
            (d.rank, d.size, d.key.as_str()),
            (2, 4, "data.train[0] sha256")
        );
        assert_eq!(
            d.to_string(),
            "rank 2 (of 4) does not run what rank 0 runs: data.train[0] sha256 is bbbb on rank 2, \
             aaaa on rank 0; every rank must have the same config, model and data"
        );
        let d = first_difference(&[a.clone(), map(&[("train.lr", "0.1")])]).unwrap();
        assert_eq!((d.ours.as_str(), d.theirs.as_str()), ("aaaa", "(unset)"));
    }
}
