//! Arrays of token ids read straight from a row's text, without a `serde_json::Value` per id.
//!
//! A `Value` costs 32 bytes an element (and its `Vec` up to twice that while it grows), so a
//! pre-tokenized row of 100 MB (`[1,1,1,...]`, ~50 M ids) took 1.9 GB as a `Value` tree (issue
//! 46). Here the ids stream past a visitor: each is checked as it goes, only the first `keep` are
//! stored (a row is cut or dropped at `max_seq_len` anyway) and the rest are counted. A row then
//! costs its text and `keep` ids, whatever its length.

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::fmt;

/// One field holding token ids, as read.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) enum Field {
    /// The key is not in the row.
    #[default]
    Missing,
    /// `null`.
    Null,
    /// Not an array: what it is ("a string", "an object", ...).
    NotArray(&'static str),
    /// An array: its first `keep` integers, its length, its first element that is not an
    /// integer (described as `found ...` says it) and its first integer that is not a valid id
    /// (outside `0..vocab` and not the field's allowed extra value).
    Array {
        ids: Vec<i64>,
        len: usize,
        not_int: Option<String>,
        out_of_range: Option<i64>,
    },
}

impl Field {
    /// The integers when the array held only integers (all of them when `len <= keep`).
    #[cfg(test)]
    pub(crate) fn ints(&self) -> Option<(&[i64], usize)> {
        match self {
            Field::Array {
                ids,
                len,
                not_int: None,
                ..
            } => Some((ids, *len)),
            _ => None,
        }
    }
}

/// An element of an id array: an integer, or what it is instead.
enum Elem {
    Int(i64),
    /// Past `i64` (a huge positive id): never a valid id; kept as text for the message.
    Other(String),
}

struct ElemVisitor;

impl<'de> Visitor<'de> for ElemVisitor {
    type Value = Elem;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id")
    }
    fn visit_i64<E>(self, v: i64) -> Result<Elem, E> {
        Ok(Elem::Int(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Elem, E> {
        Ok(i64::try_from(v).map_or_else(|_| Elem::Other(v.to_string()), Elem::Int))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Elem, E> {
        Ok(Elem::Other(v.to_string()))
    }
    fn visit_bool<E>(self, v: bool) -> Result<Elem, E> {
        Ok(Elem::Other(v.to_string()))
    }
    fn visit_str<E>(self, _: &str) -> Result<Elem, E> {
        Ok(Elem::Other("a string".into()))
    }
    fn visit_unit<E>(self) -> Result<Elem, E> {
        Ok(Elem::Other("null".into()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Elem, A::Error> {
        while a.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Elem::Other("an array".into()))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Elem, A::Error> {
        while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Elem::Other("an object".into()))
    }
}

impl<'de> serde::Deserialize<'de> for Elem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ElemVisitor)
    }
}

/// Reads one field's value as a [`Field`], storing at most `keep` ids; ids are valid in
/// `0..vocab`, and `extra` too (labels' -100).
#[derive(Clone, Copy)]
struct FieldSeed {
    keep: usize,
    vocab: usize,
    extra: Option<i64>,
}

impl<'de> DeserializeSeed<'de> for FieldSeed {
    type Value = Field;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Field, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for FieldSeed {
    type Value = Field;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Field, A::Error> {
        let (mut ids, mut len, mut not_int, mut out_of_range) = (Vec::new(), 0usize, None, None);
        while let Some(e) = a.next_element::<Elem>()? {
            match e {
                Elem::Int(v) => {
                    let valid = (v >= 0 && (v as u64) < self.vocab as u64) || Some(v) == self.extra;
                    if !valid {
                        out_of_range.get_or_insert(v);
                    }
                    if ids.len() < self.keep {
                        ids.push(v);
                    }
                }
                Elem::Other(what) => {
                    not_int.get_or_insert(what);
                }
            }
            len += 1;
        }
        Ok(Field::Array {
            ids,
            len,
            not_int,
            out_of_range,
        })
    }
    fn visit_unit<E>(self) -> Result<Field, E> {
        Ok(Field::Null)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Field, E> {
        Ok(Field::NotArray("a boolean"))
    }
    fn visit_i64<E>(self, _: i64) -> Result<Field, E> {
        Ok(Field::NotArray("a number"))
    }
    fn visit_u64<E>(self, _: u64) -> Result<Field, E> {
        Ok(Field::NotArray("a number"))
    }
    fn visit_f64<E>(self, _: f64) -> Result<Field, E> {
        Ok(Field::NotArray("a number"))
    }
    fn visit_str<E>(self, _: &str) -> Result<Field, E> {
        Ok(Field::NotArray("a string"))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Field, A::Error> {
        while a.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Field::NotArray("an object"))
    }
}

/// A row's id fields by name (`names[i]` in `fields[i]`), every other key skipped unread; the
/// keys of the row are listed for messages. `Err`: not a JSON object (or not JSON).
struct RowSeed<'a> {
    names: &'a [(&'a str, Option<i64>)],
    keep: usize,
    vocab: usize,
}

/// What [`read_row`] gives: each named field, and every key the row has.
#[derive(Debug)]
pub(crate) struct IdRow {
    pub fields: Vec<Field>,
    pub keys: Vec<String>,
}

impl<'de> Visitor<'de> for RowSeed<'_> {
    type Value = IdRow;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<IdRow, A::Error> {
        let mut row = IdRow {
            fields: vec![Field::Missing; self.names.len()],
            keys: Vec::new(),
        };
        while let Some(k) = a.next_key::<String>()? {
            match self.names.iter().position(|(n, _)| *n == k) {
                Some(i) => {
                    let seed = FieldSeed {
                        keep: self.keep,
                        vocab: self.vocab,
                        extra: self.names[i].1,
                    };
                    row.fields[i] = a.next_value_seed(seed)?
                }
                None => {
                    a.next_value::<IgnoredAny>()?;
                }
            }
            if !row.keys.contains(&k) {
                row.keys.push(k);
            }
        }
        Ok(row)
    }
}

/// Reads the id arrays `names` of the JSON object `text` (each name with the value it allows
/// besides `0..vocab`), keeping at most `keep` ids of each. Errors: "not valid JSON: ..." or "a
/// row must be a JSON object".
pub(crate) fn read_row(
    text: &str,
    names: &[(&str, Option<i64>)],
    vocab: usize,
    keep: usize,
) -> Result<IdRow, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let row = match de.deserialize_any(RowSeed { names, keep, vocab }) {
        Ok(row) => row,
        Err(e) if e.is_data() => return Err("a row must be a JSON object".into()),
        Err(e) => return Err(format!("not valid JSON: {e}")),
    };
    de.end().map_err(|e| format!("not valid JSON: {e}"))?;
    Ok(row)
}

/// The keys of the JSON object `text`, its values skipped unread (what format detection needs).
pub(crate) fn keys(text: &str) -> Result<Vec<String>, String> {
    read_row(text, &[], 0, 0).map(|r| r.keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_stream_past_with_a_cap_and_describe_what_is_not_an_id() {
        let r = read_row(
            r#"{"a":[1,2,3,-100,9],"b":"x","c":[1,"s",2],"skip":{"deep":[[1]]},"d":null}"#,
            &[
                ("a", None),
                ("b", None),
                ("c", None),
                ("d", None),
                ("e", None),
            ],
            9,
            2,
        )
        .unwrap();
        assert_eq!(r.fields[0].ints(), Some((&[1i64, 2][..], 5)));
        // Checked past the cap: the first id outside 0..9 (with no extra value allowed).
        assert!(matches!(
            r.fields[0],
            Field::Array {
                out_of_range: Some(-100),
                ..
            }
        ));
        let labels = read_row(r#"{"l":[-100,1]}"#, &[("l", Some(-100))], 9, 1).unwrap();
        assert!(matches!(
            labels.fields[0],
            Field::Array {
                out_of_range: None,
                len: 2,
                ..
            }
        ));
        assert_eq!(r.fields[1], Field::NotArray("a string"));
        assert!(
            matches!(&r.fields[2], Field::Array { not_int: Some(w), len: 3, .. } if w == "a string")
        );
        assert_eq!(
            (&r.fields[3], &r.fields[4]),
            (&Field::Null, &Field::Missing)
        );
        assert_eq!(r.keys, ["a", "b", "c", "skip", "d"]);
        assert_eq!(
            read_row("[1]", &[], 0, 0).unwrap_err(),
            "a row must be a JSON object"
        );
        assert!(read_row("{\"a\":[1,", &[("a", None)], 9, 9)
            .unwrap_err()
            .starts_with("not valid JSON: "));
        assert!(read_row("{} x", &[], 9, 9)
            .unwrap_err()
            .starts_with("not valid JSON: "));
        assert_eq!(
            keys(r#"{"input_ids":[1],"x":2}"#).unwrap(),
            ["input_ids", "x"]
        );
    }
}
