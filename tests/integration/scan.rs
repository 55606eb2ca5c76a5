//! `rtune data scan` finds every planted secret and piece of personal data, names file, line and
//! kind without printing the value, and finds nothing in clean data. The planted values are
//! assembled at run time from fragments so that no secret-shaped string sits in the repository.

use crate::common::{fixture, rtune};

#[test]
fn planted_secrets_and_pii_are_all_found() {
    let tmp = tempfile::tempdir().unwrap();
    let filler = "Lorem ipsum dolor sit amet";
    let planted: Vec<(String, &str)> = vec![
        (
            ["AKIA", "Q7ZKX2MPL4", "RT6WNB"].concat(),
            "AWS access key id",
        ),
        (
            ["ghp_", "a1B2c3D4e5F6g7H8i9J0", "k1L2m3N4o5P6q7R8s9T0"].concat(),
            "GitHub token",
        ),
        (
            ["sk-", "proj-", "Xy9Kp2Lm4Nq7Rs1Tv3Wz5Ab8Cd"].concat(),
            "OpenAI API key",
        ),
        (
            ["sk-ant-", "api03-", "Zq8Wm3Kp9Lr2Tn5Vb7Xc1Yd4"].concat(),
            "Anthropic API key",
        ),
        (
            ["hf_", "QwErTyUiOpAsDfGhJkLzXcVbNm12345678"].concat(),
            "Hugging Face token",
        ),
        (
            ["xox", "b-", "1234567890-0987654321-AbCdEfGhIjKl"].concat(),
            "Slack token",
        ),
        (
            ["AIza", "SyD3f8Kq2Lm9Np4Rs7Tu1Vw6Xy0Za5Bc8Qe"].concat(),
            "Google API key",
        ),
        (
            ["sk_", "live_", "4eC39HqLyjWDarjtT1zdp7dc"].concat(),
            "Stripe key",
        ),
        (
            ["-----BEGIN ", "RSA PRIVATE", " KEY-----\\nMIIEowIBAAKCAQEA"].concat(),
            "private key",
        ),
        (
            [
                "eyJhbGciOiJIUzI1NiJ9",
                ".eyJzdWIiOiIxMjM0NTY3ODkwIn0",
                ".dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
            ]
            .concat(),
            "JSON web token",
        ),
        (
            ["Zk3", "9QpX7vL2mN8rT4wB6yH1cJ5dF0gSaE3uI9oP"].concat(),
            "high-entropy string (possible secret)",
        ),
        (["jane.", "doe@", "example.org"].concat(), "e-mail address"),
        (["+44 20 ", "7946 0958"].concat(), "phone number"),
        (["(415) ", "555-0132"].concat(), "phone number"),
        (["4539 5787 ", "6362 1486"].concat(), "payment card number"),
    ];
    let mut jsonl = String::new();
    for (i, (secret, _)) in planted.iter().enumerate() {
        // A clean line between planted ones: findings must name the right line.
        jsonl += &format!("{{\"text\": \"{filler} {i}\"}}\n{{\"text\": \"note: {secret} end\"}}\n");
    }
    let data = tmp.path().join("planted.jsonl");
    std::fs::write(&data, &jsonl).unwrap();
    let cfg = tmp.path().join("scan.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\npath = \"unused\"\n[data]\ntrain = \"{}\"\n",
            data.display()
        ),
    )
    .unwrap();
    let o = rtune(&["data", "scan", "--config", cfg.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let out = String::from_utf8(o.stdout).unwrap();
    for (i, (secret, kind)) in planted.iter().enumerate() {
        let want = format!("{}:{}: {kind}", data.display(), 2 * i + 2);
        assert!(out.lines().any(|l| l == want), "missing `{want}` in\n{out}");
        assert!(!out.contains(secret.as_str()), "the report prints a secret");
    }
    for i in 0..planted.len() {
        assert!(
            !out.contains(&format!("{}:{}:", data.display(), 2 * i + 1)),
            "clean line {} flagged:\n{out}",
            2 * i + 1
        );
    }
    // The shipped data sets are clean.
    for clean in ["fixtures/smoke.jsonl", "parity/README.md"] {
        std::fs::write(
            &cfg,
            format!(
                "[model]\npath = \"unused\"\n[data]\ntrain = \"{}\"\n",
                fixture(clean).display()
            ),
        )
        .unwrap();
        let o = rtune(&["data", "scan", "--config", cfg.to_str().unwrap()]);
        assert!(
            o.status.success(),
            "{clean}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert!(o.stdout.is_empty());
    }
}
