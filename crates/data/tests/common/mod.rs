//! What the chat golden tests share.

use serde_json::Value;

/// A JSON array of integers as `T`s (ids, masks), panicking on anything else.
pub fn ints<T: TryFrom<i64>>(v: &Value) -> Vec<T>
where
    T::Error: std::fmt::Debug,
{
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| T::try_from(x.as_i64().unwrap()).unwrap())
        .collect()
}
