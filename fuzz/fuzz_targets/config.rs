//! The config parser and validator on arbitrary text: an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let path = Path::new("fuzz.toml");
        if let Ok(file) = rtune_config::ConfigFile::parse(text, path, &[]) {
            let _ = file.validate(path);
        }
        // Overrides take the same path through the parser.
        let _ = rtune_config::ConfigFile::parse(
            "[model]\npath='m'\n[data]\ntrain='d'\n",
            path,
            &[text.to_string()],
        );
    }
});
