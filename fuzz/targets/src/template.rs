//! forkboxd's template specs, the body of `POST /templates` (and what the
//! CLI makes of a template file).
//!
//! Input: JSON. What must hold: a spec that parses serialises to JSON that
//! parses back to the same spec; validating it, making its boot spec and
//! its readiness script never panic; a valid one has the VMM's shape
//! limits and a name that is safe as a path component.

use std::time::Duration;

use forkboxd::template::{quote, TemplateError, TemplateSpec};

pub fn template_spec(data: &[u8]) {
    let Ok(spec) = serde_json::from_slice::<TemplateSpec>(data) else {
        return;
    };
    let json = serde_json::to_vec(&spec).expect("a spec serialises");
    let again: TemplateSpec = serde_json::from_slice(&json).unwrap_or_else(|e| {
        panic!(
            "{} does not parse back: {e}",
            String::from_utf8_lossy(&json)
        )
    });
    assert_eq!(again, spec);
    if let Some(ready) = &spec.ready {
        let _ = ready.script();
    }
    for cmd in &spec.setup {
        let q = quote(cmd);
        assert!(q.starts_with('\'') && q.ends_with('\''));
    }
    let _ = spec.has_recipe();
    if spec.validate().is_ok() {
        assert!((1..=8).contains(&spec.vcpus), "{} vCPUs", spec.vcpus);
        assert!(
            (128..=16384).contains(&spec.memory_mib),
            "{} MiB",
            spec.memory_mib
        );
        assert!(!spec.name.contains('/') && spec.name != "." && spec.name != "..");
        // Without an image store, only a built-in image boots; a stored
        // image's name is unknown, and said so.
        match spec.root_image(None, None) {
            Ok(image) => {
                let boot = spec.boot_spec(Duration::from_secs(1), &image);
                assert!(spec.builtin_image().is_some(), "{}", spec.image);
                assert_eq!(boot.vcpus, spec.vcpus);
            }
            Err(e) => {
                assert!(spec.builtin_image().is_none(), "{e}");
                assert!(matches!(e, TemplateError::UnknownImage(_)), "{e}");
            }
        }
    }
}
