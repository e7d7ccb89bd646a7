//! The CLI's template files (`forkbox template bake NAME --file F`).
//!
//! Input: TOML text. What must hold beyond "no panic": a file that parses
//! and names no other template becomes a JSON body that forkboxd parses
//! as its own template spec (unless its egress rules are bad, which the
//! daemon refuses with a 400 and the same words as a policy anywhere),
//! with the same name, image, setup commands, environment and protected
//! paths: the CLI never sends what the daemon reads differently.

use forkbox::template_file::TemplateFile;
use forkbox_net::policy::Policy;
use forkboxd::template::TemplateSpec;

pub fn template_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(file) = TemplateFile::parse(text) else {
        return;
    };
    let Ok(spec) = file.into_spec("fuzz") else {
        return;
    };
    let json = serde_json::to_vec(&spec).expect("a template file's spec serialises");
    let rules_ok = spec
        .network
        .clone()
        .is_none_or(|n| Policy::try_from(n).is_ok());
    let daemons = match serde_json::from_slice::<TemplateSpec>(&json) {
        Ok(d) => d,
        Err(_) if !rules_ok => return,
        Err(e) => panic!(
            "forkboxd does not read what the CLI sends, {}: {e}",
            String::from_utf8_lossy(&json)
        ),
    };
    assert!(
        rules_ok,
        "forkboxd took bad egress rules: {:?}",
        spec.network
    );
    assert_eq!(daemons.name, spec.name);
    assert_eq!(daemons.image, spec.image);
    assert_eq!(daemons.setup, spec.setup);
    assert_eq!(daemons.envs, spec.envs);
    assert_eq!(daemons.protect, spec.protect);
    assert_eq!(daemons.run_image_cmd, spec.run_image_cmd);
}
