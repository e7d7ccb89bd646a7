use std::net::IpAddr;

use super::*;

fn policy(allow: &[&str], deny: &[&str]) -> Policy {
    let spec = PolicySpec {
        allow_out: allow.iter().map(|s| s.to_string()).collect(),
        deny_out: deny.iter().map(|s| s.to_string()).collect(),
    };
    Policy::try_from(spec).expect("test policy parses")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test address parses")
}

fn tcp<'a>(name: Option<&'a str>, addr: &str, port: u16) -> Destination<'a> {
    Destination {
        name,
        ip: ip(addr),
        port,
        protocol: Protocol::Tcp,
    }
}

fn allowed(p: &Policy, name: Option<&str>, addr: &str, port: u16) -> bool {
    p.decide(&tcp(name, addr, port)).is_allowed()
}

fn rule_err(text: &str) -> RuleError {
    text.parse::<Rule>().expect_err("rule should be refused")
}

#[test]
fn policy_empty_denies_everything_by_default() {
    let p = Policy::deny_all();
    let d = p.decide(&tcp(Some("example.org"), "93.184.216.34", 443));
    assert_eq!(d.verdict, Verdict::Deny);
    assert_eq!(d.reason, Reason::NoRule);
    assert_eq!(d.rule(), None);
    assert!(!p.decide_name("example.org").is_allowed());
}

#[test]
fn policy_exact_name_with_port_matches_only_that_port() {
    let p = policy(&["pypi.example.org:443"], &[]);
    let d = p.decide(&tcp(Some("pypi.example.org"), "192.0.2.1", 443));
    assert!(d.is_allowed());
    assert_eq!(d.rule(), Some("pypi.example.org:443"));
    assert!(!allowed(&p, Some("pypi.example.org"), "192.0.2.1", 80));
    assert!(
        !allowed(&p, None, "192.0.2.1", 443),
        "an address alone is not the name"
    );
    assert!(!allowed(&p, Some("other.example.org"), "192.0.2.1", 443));
}

#[test]
fn policy_name_is_case_insensitive_and_ignores_trailing_dot() {
    let p = policy(&["PyPI.Example.ORG."], &[]);
    assert_eq!(p.allow_rules()[0].to_string(), "pypi.example.org");
    assert!(allowed(&p, Some("pypi.example.org"), "192.0.2.1", 443));
    assert!(allowed(&p, Some("PYPI.EXAMPLE.ORG."), "192.0.2.1", 443));
    assert!(p.decide_name("Pypi.Example.Org.").is_allowed());
}

#[test]
fn policy_unicode_rule_matches_punycode_query() {
    let p = policy(&["Bücher.Example"], &[]);
    assert_eq!(p.allow_rules()[0].to_string(), "xn--bcher-kva.example");
    assert!(p.decide_name("xn--bcher-kva.example").is_allowed());
    assert!(p.decide_name("XN--BCHER-KVA.example.").is_allowed());
    // A query arrives from DNS as ASCII: raw UTF-8 never matches a rule.
    assert!(!p.decide_name("bücher.example").is_allowed());
}

#[test]
fn policy_suffix_matches_below_but_not_bare_parent() {
    let p = policy(&["*.debian.org"], &[]);
    assert!(p.decide_name("deb.debian.org").is_allowed());
    assert!(p.decide_name("a.b.debian.org").is_allowed());
    assert!(!p.decide_name("debian.org").is_allowed());
    assert!(!p.decide_name("notdebian.org").is_allowed());
    assert!(!p.decide_name("debian.org.evil.com").is_allowed());
    let both = policy(&["*.debian.org", "debian.org"], &[]);
    assert!(both.decide_name("debian.org").is_allowed());
}

#[test]
fn policy_cidr_v4_matches_addresses_inside() {
    let p = policy(&["10.1.0.0/16"], &[]);
    assert!(allowed(&p, None, "10.1.2.3", 22));
    assert!(allowed(&p, Some("anything.example"), "10.1.255.255", 80));
    assert!(!allowed(&p, None, "10.2.0.1", 22));
    let d = p.decide(&tcp(None, "10.1.0.9", 5));
    assert_eq!(d.rule(), Some("10.1.0.0/16"));
}

#[test]
fn policy_bare_address_is_a_single_host() {
    let p = policy(&["192.0.2.7:8080"], &[]);
    assert_eq!(p.allow_rules()[0].to_string(), "192.0.2.7/32:8080");
    assert!(allowed(&p, None, "192.0.2.7", 8080));
    assert!(!allowed(&p, None, "192.0.2.8", 8080));
    assert!(!allowed(&p, None, "192.0.2.7", 8081));
}

#[test]
fn policy_cidr_v6_with_and_without_port() {
    let p = policy(&["2001:db8::/32", "[2001:db9::/32]:443"], &[]);
    assert!(allowed(&p, None, "2001:db8:1::5", 80));
    assert!(allowed(&p, None, "2001:db9::1", 443));
    assert!(!allowed(&p, None, "2001:db9::1", 80));
    assert!(!allowed(&p, None, "2001:dba::1", 443));
    assert_eq!(p.allow_rules()[1].to_string(), "[2001:db9::/32]:443");
}

#[test]
fn policy_ipv4_mapped_v6_address_is_its_v4_address() {
    let p = policy(&["10.1.0.0/16"], &["10.1.9.0/24"]);
    assert!(allowed(&p, None, "::ffff:10.1.2.3", 443));
    assert!(
        !allowed(&p, None, "::ffff:10.1.9.3", 443),
        "deny cannot be dodged by mapping"
    );
    assert!(
        !allowed(&p, None, "::ffff:127.0.0.1", 80),
        "mapped loopback is loopback"
    );
}

#[test]
fn policy_ipv4_mapped_v6_rule_is_a_v4_rule() {
    let p = policy(&["::ffff:10.1.0.0/112"], &[]);
    assert_eq!(p.allow_rules()[0].to_string(), "10.1.0.0/16");
    assert!(allowed(&p, None, "10.1.2.3", 443));
}

#[test]
fn policy_deny_wins_over_allow() {
    let p = policy(
        &["*.example.org", "10.0.0.0/8"],
        &["secret.example.org", "10.9.0.0/16"],
    );
    assert!(allowed(&p, Some("www.example.org"), "192.0.2.1", 443));
    let d = p.decide(&tcp(Some("secret.example.org"), "192.0.2.1", 443));
    assert_eq!(d.verdict, Verdict::Deny);
    assert_eq!(d.reason, Reason::DenyRule("secret.example.org".into()));
    assert!(!p.decide_name("secret.example.org").is_allowed());
    assert!(allowed(&p, None, "10.8.0.1", 443));
    assert!(!allowed(&p, None, "10.9.0.1", 443));
    // An allowed name does not open a denied address.
    assert!(!allowed(&p, Some("www.example.org"), "10.9.1.1", 443));
}

#[test]
fn policy_deny_with_port_still_lets_name_resolve() {
    let p = policy(&["mail.example.org"], &["mail.example.org:25"]);
    assert!(p.decide_name("mail.example.org").is_allowed());
    assert!(!allowed(&p, Some("mail.example.org"), "192.0.2.1", 25));
    assert!(allowed(&p, Some("mail.example.org"), "192.0.2.1", 587));
}

#[test]
fn policy_port_range_and_star_port() {
    let p = policy(&["dev.example:8000-8999", "any.example:*"], &[]);
    assert!(allowed(&p, Some("dev.example"), "192.0.2.1", 8000));
    assert!(allowed(&p, Some("dev.example"), "192.0.2.1", 8999));
    assert!(!allowed(&p, Some("dev.example"), "192.0.2.1", 9000));
    assert!(allowed(&p, Some("any.example"), "192.0.2.1", 1));
    assert_eq!(p.allow_rules()[1].to_string(), "any.example");
}

#[test]
fn policy_star_allows_all_but_special_and_host_internal() {
    let p = policy(&["*:443"], &[]);
    assert!(allowed(&p, None, "192.0.2.1", 443));
    assert!(p.decide_name("whatever.example").is_allowed());
    assert!(!allowed(&p, None, "192.0.2.1", 80));
    assert!(!p.decide_name(HOST_INTERNAL).is_allowed());
    assert!(!allowed(&p, Some(HOST_INTERNAL), "10.0.2.2", 443));
}

#[test]
fn policy_host_internal_only_by_exact_rule() {
    let wild = policy(&["*.forkbox.internal", "*.internal", "10.0.0.0/8"], &[]);
    assert!(!wild.decide_name(HOST_INTERNAL).is_allowed());
    assert!(!allowed(&wild, Some(HOST_INTERNAL), "10.0.2.2", 8080));
    let exact = policy(&["host.forkbox.internal:8080"], &[]);
    assert!(exact.decide_name("HOST.forkbox.internal.").is_allowed());
    assert!(allowed(&exact, Some(HOST_INTERNAL), "10.0.2.2", 8080));
    assert!(!allowed(&exact, Some(HOST_INTERNAL), "10.0.2.2", 8081));
    let denied = policy(&["host.forkbox.internal"], &["*.internal"]);
    assert!(
        !allowed(&denied, Some(HOST_INTERNAL), "10.0.2.2", 8080),
        "deny wildcards reach it"
    );
}

#[test]
fn policy_special_addresses_denied_even_when_listed() {
    let p = policy(
        &["127.0.0.0/8", "169.254.0.0/16", "0.0.0.0/0", "::/0", "*"],
        &[],
    );
    for addr in [
        "127.0.0.1",
        "169.254.169.254",
        "0.0.0.0",
        "224.0.0.1",
        "255.255.255.255",
        "::1",
        "::",
        "fe80::1",
        "ff02::1",
    ] {
        let d = p.decide(&tcp(Some("x.example"), addr, 80));
        assert_eq!(d.reason, Reason::SpecialAddress, "{addr}");
    }
    assert!(allowed(&p, None, "192.0.2.1", 80));
}

#[test]
fn policy_udp_is_denied_whatever_the_rules() {
    let p = policy(&["*"], &[]);
    let d = p.decide(&Destination {
        name: None,
        ip: ip("192.0.2.1"),
        port: 53,
        protocol: Protocol::Udp,
    });
    assert_eq!(d.reason, Reason::UdpNotAllowed);
}

#[test]
fn policy_dns_protocol_decides_by_name() {
    let p = policy(&["a.example"], &[]);
    let dns = |name| Destination {
        name,
        ip: ip("0.0.0.0"),
        port: 0,
        protocol: Protocol::Dns,
    };
    assert!(p.decide(&dns(Some("a.example"))).is_allowed());
    assert!(!p.decide(&dns(Some("b.example"))).is_allowed());
    assert!(!p.decide(&dns(None)).is_allowed());
}

#[test]
fn policy_odd_query_names_match_nothing() {
    let p = policy(&["*"], &[]);
    for name in [
        "",
        ".",
        "a..b",
        "a b.example",
        "x\u{0}.example",
        &"a".repeat(300),
    ] {
        assert!(!p.decide_name(name).is_allowed(), "{name:?}");
    }
}

#[test]
fn policy_json_round_trip_in_sdk_spelling() {
    let json = r#"{"allow_out": ["pypi.example.org:443", "*.Debian.org", "10.1.0.0/16"],
                   "deny_out": ["[2001:db8::/32]:22"]}"#;
    let p = Policy::from_json(json).expect("parses");
    let back = serde_json::to_value(&p).expect("serialises");
    assert_eq!(
        back,
        serde_json::json!({
            "allow_out": ["pypi.example.org:443", "*.debian.org", "10.1.0.0/16"],
            "deny_out": ["[2001:db8::/32]:22"],
        })
    );
    let again: Policy = serde_json::from_value(back).expect("parses again");
    assert_eq!(again, p);
    assert_eq!(Policy::from_json("{}").expect("empty"), Policy::deny_all());
}

#[test]
fn policy_json_bad_rule_names_list_index_and_cause() {
    let err =
        Policy::from_json(r#"{"allow_out": ["ok.example", "bad:99999"]}"#).expect_err("bad port");
    let msg = err.to_string();
    assert!(msg.contains("allow_out[1]"), "{msg}");
    assert!(msg.contains("bad:99999"), "{msg}");
    let spec = PolicySpec {
        allow_out: vec![],
        deny_out: vec!["10.1.2.3/16".into()],
    };
    let err = Policy::try_from(spec).expect_err("host bits");
    let PolicyError::BadRule {
        list, index, cause, ..
    } = &err;
    assert_eq!((*list, *index), (RuleList::DenyOut, 0));
    assert!(matches!(cause, RuleError::HostBitsSet { prefix: 16, .. }));
    assert!(std::error::Error::source(&err)
        .expect("cause attached")
        .to_string()
        .contains("did you mean 10.1.0.0/16"));
}

#[test]
fn policy_json_unknown_field_refused() {
    assert!(Policy::from_json(r#"{"allow": ["x.example"]}"#).is_err());
}

#[test]
fn rule_bad_texts_refused_with_reason() {
    assert_eq!(rule_err(""), RuleError::Empty);
    assert_eq!(rule_err("   "), RuleError::Empty);
    assert_eq!(rule_err(":443"), RuleError::Empty);
    assert!(matches!(rule_err("x.example:0"), RuleError::BadPort(_)));
    assert!(matches!(rule_err("x.example:65536"), RuleError::BadPort(_)));
    assert!(matches!(rule_err("x.example:+80"), RuleError::BadPort(_)));
    assert!(matches!(rule_err("x.example:90-80"), RuleError::BadPort(_)));
    assert!(matches!(rule_err("x.example:"), RuleError::BadPort(_)));
    assert!(matches!(rule_err("10.0.0.0/33"), RuleError::BadNetwork(_)));
    assert!(matches!(rule_err("10.0.0.0/"), RuleError::BadNetwork(_)));
    assert!(matches!(rule_err("10.0.0/8"), RuleError::BadNetwork(_)));
    assert!(matches!(
        rule_err("2001:db8::/129"),
        RuleError::BadNetwork(_)
    ));
    assert!(matches!(
        rule_err("[2001:db8::/32]443"),
        RuleError::BadNetwork(_)
    ));
    assert_eq!(rule_err("[2001:db8::"), RuleError::UnclosedBracket);
    assert!(matches!(
        rule_err("10.1.2.3/8"),
        RuleError::HostBitsSet { .. }
    ));
    assert_eq!(rule_err("a.*.example"), RuleError::BadWildcard);
    assert_eq!(rule_err("*example.org"), RuleError::BadWildcard);
    assert!(matches!(rule_err("10.1.2.300"), RuleError::BadName { .. }));
    assert!(matches!(rule_err("a..example"), RuleError::BadName { .. }));
    assert!(matches!(rule_err("a b.example"), RuleError::BadName { .. }));
    assert!(matches!(rule_err("x.example.."), RuleError::BadName { .. }));
    let long_label = format!("{}.example", "a".repeat(64));
    assert!(matches!(rule_err(&long_label), RuleError::BadName { .. }));
}

#[test]
fn rule_display_parses_back_to_same_rule() {
    for text in [
        "*",
        "*:443",
        "x.example",
        "*.x.example:80-90",
        "10.0.0.0/8",
        "10.0.0.0/8:22",
        "2001:db8::/32",
        "[2001:db8::/32]:443",
        "host.forkbox.internal:8080",
    ] {
        let r: Rule = text.parse().expect("parses");
        let again: Rule = r.to_string().parse().expect("normal form parses");
        assert_eq!(again, r, "{text}");
    }
}

#[test]
fn rule_zero_prefix_matches_every_address_of_its_family() {
    let p = policy(&["0.0.0.0/0"], &[]);
    assert!(allowed(&p, None, "192.0.2.1", 80));
    assert!(!allowed(&p, None, "2001:db8::1", 80));
}
