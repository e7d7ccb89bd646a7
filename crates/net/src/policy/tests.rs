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
    let denied = policy(&["host.forkbox.internal:8080"], &["*.internal"]);
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

fn internal_denial(p: &Policy, name: Option<&str>, addr: &str) -> Decision {
    let d = p.decide(&tcp(name, addr, 443));
    assert!(
        matches!(d.reason, Reason::InternalAddress { .. }),
        "{addr}: {d:?}"
    );
    d
}

const INTERNAL: &[&str] = &[
    "10.0.0.1",
    "10.255.255.255",
    "172.16.0.1",
    "172.31.255.255",
    "192.168.0.1",
    "192.168.255.255",
    "100.64.0.1",
    "100.127.255.254",
    "168.63.129.16",
    "::ffff:10.1.2.3",
    "::ffff:172.20.0.1",
    "::ffff:192.168.1.1",
    "::ffff:100.100.100.100",
    "::ffff:168.63.129.16",
    "fc00::1",
    "fd12:3456::1",
    "64:ff9b::a00:1",
    "2002:a00:1::1",
];

#[test]
fn policy_name_rule_or_star_never_opens_internal_addresses() {
    let p = policy(&["*", "*.example.org", "a.example.org"], &[]);
    for addr in INTERNAL {
        internal_denial(&p, Some("a.example.org"), addr);
        internal_denial(&p, Some("b.example.org"), addr);
        internal_denial(&p, None, addr);
    }
    // Just outside the ranges: the rules apply as ever.
    for addr in [
        "11.0.0.1",
        "172.15.255.255",
        "172.32.0.1",
        "192.169.0.1",
        "100.63.255.255",
        "100.128.0.1",
        "168.63.129.17",
        "2001:db8::1",
    ] {
        assert!(allowed(&p, Some("a.example.org"), addr, 443), "{addr}");
    }
}

#[test]
fn policy_internal_denial_names_the_range_and_the_rule() {
    let p = policy(&["pypi.example.org:443"], &[]);
    let d = internal_denial(&p, Some("pypi.example.org"), "10.1.2.3");
    assert_eq!(d.verdict, Verdict::Deny);
    assert_eq!(d.rule(), Some("pypi.example.org:443"));
    let why = d.explain().expect("explained");
    assert!(
        why.contains("10.0.0.0/8") && why.contains("private"),
        "{why}"
    );
    assert!(why.contains("pypi.example.org:443"), "{why}");
    // No rule at all: plain default deny, not an internal denial.
    let d = p.decide(&tcp(Some("other.example.org"), "10.1.2.3", 443));
    assert_eq!(d.reason, Reason::NoRule);
}

#[test]
fn policy_cidr_rule_inside_the_range_opens_internal_addresses() {
    for (rule, addr) in [
        ("10.0.0.0/8", "10.9.8.7"),
        ("10.1.0.0/16", "10.1.2.3"),
        ("10.1.2.3", "::ffff:10.1.2.3"),
        ("172.20.0.0/16:443", "172.20.1.1"),
        ("192.168.1.0/24", "192.168.1.9"),
        ("100.64.0.0/10", "100.100.0.1"),
        ("168.63.129.16", "168.63.129.16"),
        ("fd00::/8", "fd12::1"),
    ] {
        let p = policy(&[rule], &[]);
        let d = p.decide(&tcp(None, addr, 443));
        assert!(d.is_allowed(), "{rule} {addr}: {d:?}");
        // With a name too: the CIDR rule is what opens it.
        assert!(allowed(&p, Some("x.example.org"), addr, 443), "{rule}");
    }
    // A CIDR wider than the range is not an explicit opening of it.
    for (rule, addr) in [
        ("0.0.0.0/0", "10.1.2.3"),
        ("8.0.0.0/6", "10.1.2.3"),
        ("172.0.0.0/8", "172.16.0.1"),
        ("168.63.0.0/16", "168.63.129.16"),
        ("::/0", "fd00::1"),
        ("::ffff:0.0.0.0/96", "10.1.2.3"),
    ] {
        let p = policy(&[rule], &[]);
        internal_denial(&p, None, addr);
    }
    // Deny rules still win inside an opened range.
    let p = policy(&["10.0.0.0/8"], &["10.9.0.0/16"]);
    let d = p.decide(&tcp(None, "10.9.1.1", 443));
    assert_eq!(d.reason, Reason::DenyRule("10.9.0.0/16".into()));
    // A port-limited CIDR opens only its ports.
    let p = policy(&["10.1.0.0/16:443"], &[]);
    assert!(!allowed(&p, None, "10.1.2.3", 22));
}

#[test]
fn policy_host_own_addresses_open_only_by_exact_cidr() {
    let host: Vec<IpAddr> = vec![ip("203.0.113.5"), ip("2001:db8::5")];
    let decide =
        |p: &Policy, addr: &str| p.decide_on_host(&tcp(Some("a.example.org"), addr, 443), &host);
    let wide = policy(
        &["*", "a.example.org", "203.0.113.0/24", "2001:db8::/32"],
        &[],
    );
    for addr in ["203.0.113.5", "::ffff:203.0.113.5", "2001:db8::5"] {
        let d = decide(&wide, addr);
        assert!(
            matches!(
                d.reason,
                Reason::InternalAddress {
                    internal: Internal::HostAddress(_),
                    ..
                }
            ),
            "{addr}: {d:?}"
        );
        assert!(d
            .explain()
            .expect("explained")
            .contains("address of this host"));
    }
    assert!(
        decide(&wide, "203.0.113.6").is_allowed(),
        "a neighbour is no host address"
    );
    let exact = policy(&["203.0.113.5:443"], &[]);
    assert!(decide(&exact, "203.0.113.5").is_allowed());
    // A host address inside a private range needs the exact rule too.
    let host = [ip("10.0.0.5")];
    let p = policy(&["10.0.0.0/8"], &[]);
    assert!(p
        .decide_on_host(&tcp(None, "10.0.0.6", 443), &host)
        .is_allowed());
    assert!(!p
        .decide_on_host(&tcp(None, "10.0.0.5", 443), &host)
        .is_allowed());
}

#[test]
fn policy_special_addresses_stay_closed_to_explicit_cidrs_and_mapped_forms() {
    let p = policy(
        &[
            "169.254.169.254",
            "127.0.0.0/8",
            "::ffff:169.254.0.0/112",
            "fe80::/10",
        ],
        &[],
    );
    for addr in [
        "169.254.169.254",
        "::ffff:169.254.169.254",
        "127.0.0.1",
        "::ffff:127.0.0.2",
        "::ffff:0.0.0.0",
        "::ffff:255.255.255.255",
        "::ffff:224.0.0.1",
        "fe80::1",
    ] {
        let d = p.decide(&tcp(Some("a.example.org"), addr, 80));
        assert_eq!(d.reason, Reason::SpecialAddress, "{addr}");
    }
}

#[test]
fn rule_host_internal_allow_needs_exactly_one_port() {
    for text in [
        "host.forkbox.internal",
        "HOST.forkbox.internal.",
        "host.forkbox.internal:*",
        "host.forkbox.internal:8000-8999",
        "host.forkbox.internal:1-65535",
    ] {
        let spec = PolicySpec {
            allow_out: vec![text.into()],
            deny_out: vec![],
        };
        let err = Policy::try_from(spec).expect_err(text);
        let PolicyError::BadRule { cause, .. } = &err;
        assert_eq!(*cause, RuleError::HostInternalNeedsPort, "{text}");
        let why = std::error::Error::source(&err).expect("cause").to_string();
        assert!(why.contains("host.forkbox.internal:8080"), "{why}");
    }
    let p = policy(&["host.forkbox.internal:8080"], &["host.forkbox.internal"]);
    assert!(
        !allowed(&p, Some(HOST_INTERNAL), "10.0.2.2", 8080),
        "a port-less deny rule is fine"
    );
    assert!(Policy::from_json(r#"{"allow_out":["host.forkbox.internal:1"]}"#).is_ok());
}

#[test]
fn rule_single_label_name_refused_suffix_of_one_label_kept() {
    for text in ["foo", "foo.", "Foo:443", "localhost"] {
        assert!(
            matches!(rule_err(text), RuleError::SingleLabel { .. }),
            "{text}"
        );
    }
    assert!(rule_err("foo").to_string().contains("foo.example.com"));
    let p = policy(&["*.internal"], &[]);
    assert!(p.decide_name("svc.internal").is_allowed());
}

#[test]
fn policy_single_label_query_denied_with_its_reason() {
    let p = policy(&["*"], &[]);
    for name in ["foo", "foo.", "FOO"] {
        let d = p.decide_name(name);
        assert_eq!(d.reason, Reason::SingleLabelName, "{name}");
        assert!(d.explain().is_some());
    }
    assert!(p.decide_name("foo.example").is_allowed());
}
