//! A chat template from an untrusted model (`tokenizer_config.json`'s `chat_template`) compiled and
//! rendered over a fixed two-message conversation: it must return (a render or an error) — never
//! panic, hang (minijinja fuel) or allocate without bound (the output cap).
#![no_main]
use libfuzzer_sys::fuzz_target;
use rtune_data::{ChatTemplate, Conversation};

fuzz_target!(|data: &[u8]| {
    let source = String::from_utf8_lossy(data);
    let specials = [
        ("bos_token".to_string(), "<s>".to_string()),
        ("eos_token".to_string(), "</s>".to_string()),
    ];
    let Ok(t) = ChatTemplate::new(source.as_ref(), "fuzz", &specials) else {
        return;
    };
    let conv = Conversation::from_json(
        r#"{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}"#,
    )
    .expect("fixed conversation");
    let _ = conv.render(&t, 2, false);
});
