//! File names from untrusted sources: a model index's `weight_map`, a hub repository's listing, a
//! GGUF's metadata. rtune opens or creates such a file only inside the directory it belongs to, so
//! the name must be one plain path component.

/// `name` if it is one plain file name: not empty, not `.` or `..`, no `/` or `\`, no NUL, not
/// absolute; otherwise why not (for an error that names the entry).
pub fn plain_file_name(name: &str) -> Result<&str, &'static str> {
    if name.is_empty() {
        Err("is empty")
    } else if name == "." || name == ".." {
        Err("is not a file name")
    } else if name.starts_with('/') {
        Err("is an absolute path; only a file name inside the model directory is allowed")
    } else if name.contains('/') || name.contains('\\') {
        Err("contains a path separator; only a file name inside the model directory is allowed")
    } else if name.contains('\0') {
        Err("contains a NUL byte")
    } else {
        Ok(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_names_pass() {
        for ok in ["model-00001-of-00002.safetensors", "a..b", ".hidden"] {
            assert_eq!(plain_file_name(ok), Ok(ok));
        }
        for bad in [
            "",
            ".",
            "..",
            "../outside.safetensors",
            "/etc/passwd",
            "sub/x.safetensors",
            "..\\x",
            "a\0b",
        ] {
            assert!(plain_file_name(bad).is_err(), "{bad:?}");
        }
    }
}
