//! "Did you mean" for unknown keys and enum values: the closest allowed name by edit distance
//! (Damerau-Levenshtein, from `strsim`), offered only when it is close enough to be a typo.

/// The allowed name closest to `given`, if it is within a third of the longer name's length
/// (at least 1 edit): `learnin_rate` → `lr`? no (9 edits); `lerning_rate` → `learning_rate`.
/// A prefix match also counts (`lr_rate` → `lr`), since users abbreviate and extend names.
pub fn closest<'a>(given: &str, allowed: &[&'a str]) -> Option<&'a str> {
    let given_l = given.to_ascii_lowercase();
    let mut best: Option<(usize, &'a str)> = None;
    for &name in allowed {
        let d = strsim::damerau_levenshtein(&given_l, &name.to_ascii_lowercase());
        let limit = (given.len().max(name.len()) / 3).max(1);
        let prefix = name.len() >= 2 && (given_l.starts_with(name) || name.starts_with(&given_l));
        if (d <= limit || prefix) && best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, name));
        }
    }
    best.map(|(_, n)| n)
}

/// "`x` is not one of a, b, c" plus " (did you mean `b`?)" when one is close.
pub fn not_one_of(given: &str, allowed: &[&str]) -> String {
    let mut m = format!("`{given}` is not one of {}", allowed.join(", "));
    if let Some(s) = closest(given, allowed) {
        m.push_str(&format!(" (did you mean `{s}`?)"));
    }
    m
}

/// Rewrites serde's "unknown field `x`, expected one of `a`, `b`" (or "expected `a`") found at
/// `path` (serde_path_to_error's: `train.x`, or the table `train`; `.` at the top level) into
/// "unknown key `train.x`" with a suggestion; any other message is returned as `None`.
pub fn unknown_field(path: &str, message: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (field, rest) = rest.split_once('`')?;
    let allowed: Vec<&str> = rest
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| !s.is_empty())
        .collect();
    let path = path.trim_matches('.');
    let section = match path.rsplit_once('.') {
        Some((table, last)) if last == field => table,
        _ if path == field => "",
        _ => path,
    };
    let full = if section.is_empty() {
        field.to_string()
    } else {
        format!("{section}.{field}")
    };
    let mut m = format!("unknown key `{full}`");
    if let Some(s) = closest(field, &allowed) {
        m.push_str(&format!(" (did you mean `{s}`?)"));
    } else if section.is_empty() {
        m.push_str(&format!(" (sections: {})", allowed.join(", ")));
    }
    Some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_only_close_names() {
        let keys = ["seed", "steps", "lr", "learning_rate_decay", "warmup_steps"];
        assert_eq!(closest("lr_rate", &keys), Some("lr"));
        assert_eq!(closest("stpes", &keys), Some("steps"));
        assert_eq!(closest("warmup_step", &keys), Some("warmup_steps"));
        assert_eq!(closest("zzz", &keys), None);
        assert_eq!(
            closest("cosin", &["constant", "linear", "cosine"]),
            Some("cosine")
        );
    }

    #[test]
    fn rewrites_serde_unknown_field() {
        let m = "unknown field `lr_rate`, expected one of `seed`, `steps`, `lr`";
        assert_eq!(
            unknown_field("train.lr_rate", m).as_deref(),
            Some("unknown key `train.lr_rate` (did you mean `lr`?)")
        );
        let m = "unknown field `trian`, expected one of `model`, `lora`, `data`, `train`, `output`";
        assert_eq!(
            unknown_field("trian", m).as_deref(),
            Some("unknown key `trian` (did you mean `train`?)")
        );
        let m = "unknown field `qqq`, expected `path`";
        assert_eq!(
            unknown_field("model", m).as_deref(),
            Some("unknown key `model.qqq`")
        );
        assert_eq!(unknown_field("x", "invalid type: string"), None);
    }

    #[test]
    fn not_one_of_lists_and_suggests() {
        assert_eq!(
            not_one_of("cosin", &["constant", "linear", "cosine"]),
            "`cosin` is not one of constant, linear, cosine (did you mean `cosine`?)"
        );
        assert_eq!(not_one_of("x", &["a1", "b2"]), "`x` is not one of a1, b2");
    }
}
