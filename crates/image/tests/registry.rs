//! Pulling from a real registry: Debian's `docker-registry` (the CNCF
//! distribution registry), started here on loopback with its storage in a
//! temporary directory; images pushed to it with `oci-client`. Needs root
//! (unpacking keeps owners), as `make test` runs.

use std::path::Path;

use forkbox_image::local_registry::LocalRegistry;
use forkbox_image::{pull, Digest, Progress, PullError, Registry, Store};
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference, RegistryOperation};

mod common;
use common::*;

/// Pushes an image of `layers` (uncompressed tars, pushed gzip'd) as
/// `reference`; returns its id (the configuration's digest).
async fn push(reference: &str, layers: &[Vec<u8>]) -> Digest {
    push_as(reference, layers, &RegistryAuth::Anonymous).await
}

async fn push_as(reference: &str, layers: &[Vec<u8>], auth: &RegistryAuth) -> Digest {
    let client = Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..Default::default()
    });
    let image: Reference = reference.parse().expect("reference");
    client
        .auth(&image, auth, RegistryOperation::Push)
        .await
        .expect("auth");
    let diff_ids: Vec<Digest> = layers.iter().map(|l| Digest::of(l)).collect();
    let cfg = config(&diff_ids);
    let id = Digest::of(&cfg);
    client
        .push_blob(&image, cfg.clone(), &id.to_string())
        .await
        .expect("push config");
    let mut descriptors = Vec::new();
    for l in layers {
        let blob = gzip(l);
        let d = Digest::of(&blob);
        client
            .push_blob(&image, blob.clone(), &d.to_string())
            .await
            .expect("push layer");
        descriptors.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
            "digest": d.to_string(), "size": blob.len()}));
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": id.to_string(), "size": cfg.len()},
        "layers": descriptors,
    });
    client
        .push_manifest_raw(
            &image,
            serde_json::to_vec(&manifest).expect("manifest"),
            "application/vnd.oci.image.manifest.v1+json"
                .parse()
                .expect("header"),
        )
        .await
        .expect("push manifest");
    id
}

fn plain() -> Registry {
    Registry {
        auth: None,
        plain_http: true,
    }
}

/// Pulls `reference`, noting each download step: (layer, bytes, total).
async fn pull_counting(
    store: &Store,
    reference: &str,
) -> Result<(forkbox_image::Imported, Vec<(usize, u64, u64)>), PullError> {
    let mut events = Vec::new();
    let pulled = pull(store, reference, &plain(), &mut |p| {
        if let Progress::Fetched {
            index,
            bytes,
            total,
            ..
        } = p
        {
            events.push((index, bytes, total));
        }
    })
    .await?;
    Ok((pulled, events))
}

/// Bytes downloaded per layer index, from the pull's progress.
fn fetched(events: &[(usize, u64, u64)]) -> Vec<(usize, u64)> {
    let mut last: Vec<(usize, u64)> = Vec::new();
    for &(index, bytes, _) in events {
        match last.iter_mut().find(|(i, _)| *i == index) {
            Some(e) => e.1 = bytes,
            None => last.push((index, bytes)),
        }
    }
    last
}

#[tokio::test(flavor = "current_thread")]
async fn pull_from_a_registry_stores_each_blob_once_and_names_the_image() {
    let registry = LocalRegistry::start().expect("a registry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let (base, top) = (base_layer(), top_layer());
    let other = layer(&[E::File("etc/other", 0o644, 0, b"other\n")]);
    let a = format!("{}/tasks/a:v1", registry.addr);
    let b = format!("{}/tasks/b:v1", registry.addr);
    let a_id = push(&a, &[base.clone(), top.clone()]).await;
    let b_id = push(&b, &[base.clone(), other.clone()]).await;

    let (pulled, events) = pull_counting(&store, &a).await.expect("pull a");
    assert_eq!(
        (pulled.image.id.clone(), pulled.unpacked),
        (a_id.clone(), 2)
    );
    assert_eq!(store.resolve(&a).expect("named").id, a_id);
    assert_eq!(pulled.image.config.user.as_deref(), Some("1000:1000"));
    assert_eq!(pulled.image.layers[1].diff_id, Digest::of(&top));
    assert_eq!(
        fetched(&events),
        vec![(0, gzip(&base).len() as u64), (1, gzip(&top).len() as u64)]
    );

    // The second image shares the base: only its own layer comes.
    let (pulled, events) = pull_counting(&store, &b).await.expect("pull b");
    assert_eq!((pulled.image.id, pulled.unpacked), (b_id, 1));
    assert_eq!(fetched(&events), vec![(1, gzip(&other).len() as u64)]);
    assert_eq!(
        std::fs::read_dir(store.root().join("layers"))
            .expect("layers")
            .count(),
        3
    );

    // Pulled again: nothing downloaded, nothing unpacked.
    let (again, events) = pull_counting(&store, &a).await.expect("pull a again");
    assert_eq!((again.unpacked, events.len()), (0, 0));
}

#[tokio::test(flavor = "current_thread")]
async fn pull_of_a_missing_tag_or_registry_says_so_and_stores_nothing() {
    let registry = LocalRegistry::start().expect("a registry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    let missing = format!("{}/tasks/none:v1", registry.addr);
    let err = pull(&store, &missing, &plain(), &mut |_| {})
        .await
        .expect_err("no such tag");
    assert!(matches!(err, PullError::Registry { .. }), "{err:?}");
    assert!(format!("{err:#?}").contains("tasks/none"), "{err:#?}");
    let err = pull(&store, "not a reference!", &plain(), &mut |_| {})
        .await
        .expect_err("bad ref");
    assert!(matches!(err, PullError::Reference(_)), "{err:?}");
    drop(registry);
    let err = pull(&store, &missing, &plain(), &mut |_| {})
        .await
        .expect_err("gone");
    assert!(matches!(err, PullError::Registry { .. }), "{err:?}");
    assert!(store.ids().expect("ids").is_empty());
    assert_eq!(
        std::fs::read_dir(store.root().join("blobs/sha256"))
            .expect("blobs")
            .count(),
        0
    );
}

/// A registry that asks for basic auth: a pull with the right user and
/// password stores the image; anonymous or with a wrong password it is
/// refused, saying so, and stores nothing.
#[tokio::test(flavor = "current_thread")]
async fn pull_from_a_registry_with_basic_auth_needs_the_right_password() {
    let registry = LocalRegistry::start_with_basic("trainer", "s3cret").expect("a registry");
    let reference = format!("{}/tasks/private:v1", registry.addr);
    let basic = RegistryAuth::Basic("trainer".into(), "s3cret".into());
    let id = push_as(&reference, &[base_layer()], &basic).await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    for auth in [None, Some(("trainer".to_owned(), "wrong".to_owned()))] {
        let registry = Registry {
            auth: auth.clone(),
            plain_http: true,
        };
        let err = pull(&store, &reference, &registry, &mut |_| {})
            .await
            .expect_err("refused");
        assert!(
            matches!(err, PullError::Registry { .. }),
            "{auth:?}: {err:?}"
        );
        let said = format!("{err:#?}");
        assert!(
            said.contains("401") || said.to_lowercase().contains("unauthorized"),
            "{auth:?}: {said}"
        );
        assert!(store.ids().expect("ids").is_empty());
    }
    let registry = Registry {
        auth: Some(("trainer".into(), "s3cret".into())),
        plain_http: true,
    };
    let pulled = pull(&store, &reference, &registry, &mut |_| {})
        .await
        .expect("pulled with the password");
    assert_eq!(pulled.image.id, id);
}

/// Writes `bytes` where a stopped download of `blob` leaves its part.
fn leave_partial(store: &Store, blob: &Digest, bytes: &[u8]) {
    let path = store
        .root()
        .join("tmp")
        .join(format!("partial-{}", blob.hex()));
    std::fs::write(path, bytes).expect("partial");
}

fn partial_exists(store: &Store, blob: &Digest) -> bool {
    Path::new(
        &store
            .root()
            .join("tmp")
            .join(format!("partial-{}", blob.hex())),
    )
    .exists()
}

#[tokio::test(flavor = "current_thread")]
async fn pull_resumes_a_stopped_download_and_drops_a_wrong_one() {
    let registry = LocalRegistry::start().expect("a registry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    // A layer big enough that half of it is worth resuming: incompressible.
    let mut noise = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in noise.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let big = layer(&[E::File("data/noise", 0o644, 0, &noise)]);
    let blob = gzip(&big);
    let blob_digest = Digest::of(&blob);
    let reference = format!("{}/tasks/big:v1", registry.addr);
    push(&reference, &[big]).await;

    // Half of the blob, as a stopped pull leaves it: only the rest comes.
    let half = blob.len() / 2;
    leave_partial(&store, &blob_digest, &blob[..half]);
    let mut first = None;
    pull(&store, &reference, &plain(), &mut |p| {
        if let Progress::Fetched { bytes, .. } = p {
            first.get_or_insert(bytes);
        }
    })
    .await
    .expect("resumed pull");
    let first = first.expect("some bytes came");
    assert!(
        first > half as u64,
        "the download started over: first count {first}, half {half}"
    );
    assert!(!partial_exists(&store, &blob_digest));
    assert!(store.blob_path(&blob_digest).exists());

    // A part that is not the blob's: the pull fails on the digest, keeps
    // nothing of it, and the next pull starts over and succeeds.
    let tmp2 = tempfile::tempdir().expect("tempdir");
    let store2 = Store::open(&tmp2.path().join("store")).expect("store");
    leave_partial(&store2, &blob_digest, &vec![0u8; half]);
    let err = pull(&store2, &reference, &plain(), &mut |_| {})
        .await
        .expect_err("wrong part");
    assert!(format!("{err:?}").contains("DigestMismatch"), "{err:?}");
    assert!(!partial_exists(&store2, &blob_digest));
    assert!(!store2.blob_path(&blob_digest).exists());
    pull(&store2, &reference, &plain(), &mut |_| {})
        .await
        .expect("started over");
}

/// A fake snapshot: a state file and a sparse memory file of `mib` MiB
/// with data at a few places.
fn snapshot(dir: &Path, mib: u64) -> Vec<u8> {
    use std::io::{Seek, SeekFrom, Write};
    std::fs::create_dir_all(dir).expect("dir");
    std::fs::write(
        dir.join("state.json"),
        br#"{"hardware":{"layers":[],"disks":[]}}"#,
    )
    .expect("state");
    let mut memory = std::fs::File::create(dir.join("memory")).expect("memory");
    memory.set_len(mib << 20).expect("size");
    for (at, byte) in [(0u64, 1u8), (3 << 20, 7), ((mib << 20) - 4096, 9)] {
        memory.seek(SeekFrom::Start(at)).expect("seek");
        memory.write_all(&[byte; 4096]).expect("write");
    }
    std::fs::read(dir.join("memory")).expect("read")
}

fn collect() -> (
    forkbox_image::artifact::OnTransfer,
    std::sync::Arc<std::sync::Mutex<Vec<artifact::Transfer>>>,
) {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let into = seen.clone();
    (
        std::sync::Arc::new(move |t| into.lock().expect("lock").push(t)),
        seen,
    )
}

use forkbox_image::artifact;

/// A template pushed with its image travels whole: another store pulls
/// its record, state, memory (sparse again) and image; a second push
/// sends only what the registry lacks; an image is not a template.
#[tokio::test(flavor = "current_thread")]
async fn a_template_pushed_with_its_image_is_pulled_whole_into_another_store() {
    let registry = LocalRegistry::start().expect("a registry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let ours = Store::open(&tmp.path().join("ours")).expect("store");
    let image_ref = format!("{}/tasks/a:v1", registry.addr);
    let image_id = push(&image_ref, &[base_layer(), top_layer()]).await;
    let (image, _) = pull_counting(&ours, &image_ref).await.expect("pull image");
    let memory = snapshot(&tmp.path().join("snap"), 16);
    let snap = tmp.path().join("snap");

    let packed = artifact::pack_memory(
        std::fs::File::open(snap.join("memory")).expect("open"),
        tmp.path(),
    )
    .expect("pack");
    assert!(
        packed.bytes < 1 << 20,
        "16 MiB, mostly zeros, packs to {} bytes",
        packed.bytes
    );
    let target = format!("{}/templates/a:v1", registry.addr);
    let state = snap.join("state.json");
    let push = || artifact::TemplatePush {
        config: br#"{"name":"a"}"#.to_vec(),
        state: &state,
        memory: &packed,
        image: Some((&ours, &image.image)),
    };
    let (on, _) = collect();
    let first = artifact::push_template(&target, &plain(), push(), on)
        .await
        .expect("push");
    let layers: u64 = image.image.layers.iter().map(|l| l.size).sum();
    let config = std::fs::metadata(ours.blob_path(&image.image.id))
        .expect("config")
        .len();
    assert_eq!(
        first.present,
        layers + config,
        "the image's configuration and layers mounted from tasks/a"
    );
    let (on, seen) = collect();
    let again = format!("{}/templates/a:v2", registry.addr);
    let second = artifact::push_template(&again, &plain(), push(), on)
        .await
        .expect("push again");
    assert_eq!(second.digest, first.digest, "the same artifact");
    assert!(seen.lock().expect("lock").iter().all(|t| t.present));
    assert_eq!(
        second.present + second.sent,
        first.present + first.sent,
        "only the record and manifest sent again"
    );

    let theirs = Store::open(&tmp.path().join("theirs")).expect("store");
    // A pull that stopped halfway through the memory resumes there.
    let packed_bytes = std::fs::read(packed.path()).expect("packed");
    leave_partial(
        &theirs,
        &packed.digest,
        &packed_bytes[..packed_bytes.len() / 2],
    );
    let (on, seen) = collect();
    let pulled = artifact::pull_template(Some(&theirs), &again, &plain(), tmp.path(), on)
        .await
        .expect("pull");
    let first_memory = seen
        .lock()
        .expect("lock")
        .iter()
        .find(|t| t.what == "memory")
        .map(|t| t.bytes);
    assert!(
        first_memory.is_some_and(|b| b >= packed_bytes.len() as u64 / 2),
        "resumed at half: {first_memory:?}"
    );
    assert_eq!(pulled.config, br#"{"name":"a"}"#);
    assert_eq!(pulled.digest, first.digest);
    assert_eq!(
        pulled.state,
        std::fs::read(snap.join("state.json")).expect("state")
    );
    let got = pulled.image.expect("the image came");
    assert_eq!(got.id, image_id);
    assert!(theirs.layer_path(&got.layers[1].diff_id).exists());
    assert!(seen
        .lock()
        .expect("lock")
        .iter()
        .any(|t| t.what == "memory"));

    let out = tmp.path().join("memory.out");
    let bytes = artifact::unpack_memory(pulled.memory.path(), &out, 16 << 20).expect("unpack");
    assert_eq!(bytes, 16 << 20);
    assert!(
        std::fs::read(&out).expect("read") == memory,
        "the memory comes back byte for byte"
    );
    let allocated =
        std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&out).expect("meta")) * 512;
    assert!(
        allocated < 1 << 20,
        "sparse again: {allocated} bytes allocated"
    );

    // More memory than the guest has is refused.
    let small = tmp.path().join("memory.small");
    let err = artifact::unpack_memory(pulled.memory.path(), &small, 8 << 20).expect_err("too big");
    assert!(err.to_string().contains("more than"), "{err}");
    // Unpacked, the memory blob leaves the store.
    let blob = pulled.memory.path().to_owned();
    assert_eq!(blob, theirs.blob_path(&packed.digest));
    pulled.memory.unpacked();
    assert!(!blob.exists());

    // An image is not a template.
    let (on, _) = collect();
    let err = artifact::pull_template(Some(&theirs), &image_ref, &plain(), tmp.path(), on)
        .await
        .err()
        .expect("not a template");
    assert!(matches!(err, PullError::NotATemplate { .. }), "{err}");
}

/// A token server for a registry's bearer auth, on loopback: it grants
/// `user`:`password` what each scope asks, in an ES256 JWT whose `x5c`
/// holds its self-signed certificate (the registry trusts that
/// certificate); anyone else gets a 401.
struct TokenServer {
    realm: String,
    cert_pem: String,
}

impl TokenServer {
    fn start(user: &'static str, password: &'static str) -> Self {
        use base64::Engine;
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["forkbox-test".into()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        let x5c = base64::engine::general_purpose::STANDARD.encode(cert.der());
        let rng = ring::rand::SystemRandom::new();
        let signer = ring::signature::EcdsaKeyPair::from_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING,
            &key.serialize_der(),
            &rng,
        )
        .expect("signer");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let realm = format!("http://{}/token", listener.local_addr().expect("addr"));
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let head = read_head(&mut conn);
                let granted = head
                    .lines()
                    .any(|l| l.eq_ignore_ascii_case(&format!("authorization: basic {basic}")));
                let reply = if granted {
                    let token = jwt(&head, user, &x5c, &signer, &rng);
                    let body = serde_json::json!({"token": token, "access_token": token, "expires_in": 300})
                        .to_string();
                    format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
                } else {
                    "HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        .into()
                };
                let _ = std::io::Write::write_all(&mut conn, reply.as_bytes());
            }
        });
        Self {
            realm,
            cert_pem: cert.pem(),
        }
    }
}

/// A request's head, as sent.
fn read_head(conn: &mut std::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 16 << 10 {
        match std::io::Read::read(conn, &mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// `%XX` decoded.
fn unescape(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The token for the scopes the request line asks for.
fn jwt(
    head: &str,
    user: &str,
    x5c: &str,
    signer: &ring::signature::EcdsaKeyPair,
    rng: &ring::rand::SystemRandom,
) -> String {
    use base64::Engine;
    let url = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let target = head.split_whitespace().nth(1).unwrap_or("");
    let query = target.split_once('?').map_or("", |(_, q)| q);
    let access: Vec<serde_json::Value> = query
        .split('&')
        .filter_map(|kv| kv.strip_prefix("scope="))
        .map(unescape)
        .filter_map(|scope| {
            // repository:NAME:ACTIONS (NAME may hold no colon here).
            let mut parts = scope.splitn(3, ':');
            let (kind, name, actions) = (parts.next()?, parts.next()?, parts.next()?);
            Some(serde_json::json!({"type": kind, "name": name,
                "actions": actions.split(',').collect::<Vec<_>>()}))
        })
        .collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let header = serde_json::json!({"typ": "JWT", "alg": "ES256", "x5c": [x5c]});
    let claims = serde_json::json!({"iss": "forkbox-test", "sub": user, "aud": "forkbox-test",
        "exp": now + 300, "nbf": now - 10, "iat": now, "jti": format!("t{now}"), "access": access});
    let signing = format!(
        "{}.{}",
        url.encode(header.to_string()),
        url.encode(claims.to_string())
    );
    let sig = signer.sign(rng, signing.as_bytes()).expect("sign");
    format!("{signing}.{}", url.encode(sig.as_ref()))
}

/// A registry that asks for bearer tokens: the right user gets one and
/// pulls; anyone else is refused by the token server, and nothing is
/// stored.
#[tokio::test(flavor = "current_thread")]
async fn pull_from_a_registry_with_bearer_tokens_needs_the_right_user() {
    let tokens = TokenServer::start("trainer", "s3cret");
    let registry =
        LocalRegistry::start_with_token(&tokens.realm, &tokens.cert_pem).expect("a registry");
    let reference = format!("{}/tasks/tok:v1", registry.addr);
    let auth = RegistryAuth::Basic("trainer".into(), "s3cret".into());
    let id = push_as(&reference, &[base_layer()], &auth).await;

    let tmp = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&tmp.path().join("store")).expect("store");
    for who in [None, Some(("trainer", "wrong"))] {
        let registry = Registry {
            auth: who.map(|(u, p)| (u.to_owned(), p.to_owned())),
            plain_http: true,
        };
        let e = pull(&store, &reference, &registry, &mut |_| {})
            .await
            .expect_err("no token for them");
        assert!(matches!(e, PullError::Registry { .. }), "{who:?}: {e:?}");
        assert!(store.resolve(&reference).is_err(), "nothing stored");
    }
    let registry = Registry {
        auth: Some(("trainer".into(), "s3cret".into())),
        plain_http: true,
    };
    let pulled = pull(&store, &reference, &registry, &mut |_| {})
        .await
        .expect("the right user pulls");
    assert_eq!(pulled.image.id, id);
}

/// A stored image pushed to another repository is pulled whole by
/// another store, with the same id. Its layers are mounted from the
/// repository it was pulled from, not sent. Two images of one base
/// imported from files: the first pushed sends all, the second, pushed
/// to another repository, mounts the base from the first's (its push
/// named it so) and sends only its own layer.
#[tokio::test(flavor = "current_thread")]
async fn an_image_pushed_from_the_store_is_pulled_whole_elsewhere() {
    let registry = LocalRegistry::start().expect("a registry");
    let tmp = tempfile::tempdir().expect("tempdir");
    let ours = Store::open(&tmp.path().join("ours")).expect("store");
    let from = format!("{}/tasks/a:v1", registry.addr);
    let id = push(&from, &[base_layer(), top_layer()]).await;
    let (image, _) = pull_counting(&ours, &from).await.expect("pull");
    let layers: u64 = image.image.layers.iter().map(|l| l.size).sum();
    let to = format!("{}/mirror/a:v1", registry.addr);
    let (on, _) = collect();
    let pushed = artifact::push_image(&ours, &image.image, &to, &plain(), on)
        .await
        .expect("push");
    assert_eq!(pushed.present, layers, "mounted from tasks/a, not sent");
    assert_eq!(ours.resolve(&to).expect("named by its push").id, id);
    let theirs = Store::open(&tmp.path().join("theirs")).expect("store");
    let (got, _) = pull_counting(&theirs, &to)
        .await
        .expect("pull the pushed one");
    assert_eq!((got.image.id, got.unpacked), (id, 2));

    let other = layer(&[E::File("etc/other", 0o644, 0, b"other\n")]);
    let mut from_files = Vec::new();
    for (name, top) in [("c", top_layer()), ("b", other)] {
        let archive = tmp.path().join(format!("{name}.tar"));
        docker_archive(&archive, &[base_layer(), top], &format!("local/{name}:1"));
        let image = forkbox_image::import(&ours, &archive, None, &mut |_| {})
            .expect("import")
            .image;
        let to = format!("{}/files/{name}:v1", registry.addr);
        let (on, _) = collect();
        let pushed = artifact::push_image(&ours, &image, &to, &plain(), on)
            .await
            .expect("push");
        from_files.push((pushed.present, image));
    }
    assert_eq!(from_files[0].0, 0, "nothing to mount from");
    let (present, b) = &from_files[1];
    assert_eq!(*present, b.layers[0].size, "the base mounted, not sent");
    let third = format!("{}/files/b:v1", registry.addr);
    let theirs = Store::open(&tmp.path().join("third")).expect("store");
    let (got, _) = pull_counting(&theirs, &third).await.expect("pull b");
    assert_eq!(got.image.id, b.id);
}
