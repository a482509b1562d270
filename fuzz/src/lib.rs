//! The bodies of Ferry's fuzz targets, one function per target (`fuzz_targets/<name>.rs` calls
//! it). Each takes the fuzzer's bytes, feeds them to a parser of untrusted input, and asserts what
//! must hold of the result besides "no panic": round trips, and that what comes out is what the
//! rest of Ferry relies on. An assertion that fails is a bug (the fuzzer saves the input).
//!
//! Inputs that stand for several strings are text, one item a line, so that corpora stay readable
//! and seeds are easy to write by hand (`fuzz/corpus/<target>/`).

use std::collections::HashMap;

/// The input as text, or `None` (the parsers below take `&str`: bytes that are not UTF-8 never
/// reach them).
fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// `key=value` lines as a map (a line without `=` is a key with an empty value).
fn map_of<'a>(lines: impl Iterator<Item = &'a str>) -> HashMap<String, String> {
    lines
        .map(|l| l.split_once('=').unwrap_or((l, "")))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `volume_id`: [`ferry_volume::VolumeId::parse`] (DeleteVolume's only input) and `encode`.
///
/// Two inputs in one: the whole text as an id, and its first four lines as the fields of an id
/// (bucket, prefix, region, endpoint) which, when each passes its validator, must survive
/// `encode` → `parse` unchanged.
pub mod volume_id {
    use ferry_volume::{validate, DeletePolicy, Endpoint, VolumeId};

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        if let Ok(id) = VolumeId::parse(s) {
            // What parses re-encodes to an id that parses to the same volume, and encoding is
            // stable from there on.
            let encoded = id.encode();
            let again = VolumeId::parse(&encoded)
                .unwrap_or_else(|e| panic!("{s:?} parsed, its encoding {encoded:?} did not: {e}"));
            assert_eq!(again, id, "{s:?} → {encoded:?}");
            assert_eq!(again.encode(), encoded);
            assert!(id.prefix.ends_with('/') && !id.prefix.starts_with('/'));
        }
        let mut fields = s.split('\n');
        let (bucket, prefix) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""));
        let (region, endpoint) = (fields.next(), fields.next());
        let flags = fields.next().unwrap_or("");
        let valid = validate::bucket_name("b", bucket).is_ok()
            && validate::prefix("p", prefix, false).is_ok_and(|p| p == prefix)
            && region.is_none_or(|r| validate::region("r", r).is_ok())
            && endpoint.is_none_or(|e| validate::endpoint_url("e", e).is_ok());
        if !valid {
            return;
        }
        let id = VolumeId {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            endpoint: Endpoint {
                endpoint_url: endpoint.map(str::to_string),
                region: region.map(str::to_string),
                force_path_style: flags.contains('p'),
            },
            delete_policy: match flags.contains('d') {
                true => DeletePolicy::Delete,
                false => DeletePolicy::Retain,
            },
        };
        let encoded = id.encode();
        match VolumeId::parse(&encoded) {
            Ok(back) => assert_eq!(back, id, "{encoded:?}"),
            Err(e) => panic!("{id:?} encodes to {encoded:?}, which does not parse: {e}"),
        }
    }
}

/// `storage_class`: CreateVolume's StorageClass `parameters` ([`ferry_volume::StorageClassParams`])
/// with the prefix template in them, its expansion, and the existing-prefix PVC annotation.
///
/// Input: `key=value` lines (the parameters, which also carry csi-provisioner's
/// `csi.storage.k8s.io/pvc/name` etc. the template reads); a line `!name` sets the volume name
/// (default `pvc-1`), a line `@prefix` an existing-prefix annotation to check.
pub mod storage_class {
    use ferry_volume::params::{ExistingPrefixPolicy, Template};
    use ferry_volume::{keys, validate, DeletePolicy, StorageClassParams};

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        let mut name = "pvc-1";
        let mut existing = Vec::new();
        let mut lines = Vec::new();
        for l in s.split('\n') {
            if let Some(n) = l.strip_prefix('!') {
                name = n;
            } else if let Some(p) = l.strip_prefix('@') {
                existing.push(p);
            } else {
                lines.push(l);
            }
        }
        // The first line alone as a template too: the parser without the map around it.
        if let Ok(t) = Template::parse(lines.first().copied().unwrap_or("")) {
            let _ = t.is_unique_per_volume();
        }
        let params = super::map_of(lines.into_iter());
        let Ok(sc) = StorageClassParams::parse(&params) else {
            return;
        };
        assert!(sc.base_prefix.is_empty() || sc.base_prefix.ends_with('/'));
        let ctx = sc.node_context();
        assert!(ctx
            .keys()
            .all(|k| params.contains_key(k) || k == "authenticationSource"));
        // The existing-prefix opt-in is the controller's: the node never sees it.
        assert!(!ctx.contains_key(keys::EXISTING_PREFIX));
        if let Ok(prefix) = sc.volume_prefix(name, &params) {
            // The prefix a volume gets is a valid, normalised prefix below the base prefix.
            assert!(prefix.ends_with('/') && prefix.starts_with(&sc.base_prefix));
            assert!(prefix.len() > sc.base_prefix.len(), "{prefix:?}");
            assert_eq!(
                validate::prefix("p", &prefix, false).ok().as_ref(),
                Some(&prefix)
            );
        }
        for e in existing {
            if let Ok(p) = sc.existing_prefix(e) {
                assert!(p.ends_with('/') && p.starts_with(&sc.base_prefix) && p != sc.base_prefix);
                // Only a class that opted in, and never one that deletes the data with the PVC.
                assert_eq!(sc.existing_prefix_policy, ExistingPrefixPolicy::Allow);
                assert_eq!(
                    params.get(keys::EXISTING_PREFIX).map(String::as_str),
                    Some("allow")
                );
                assert_eq!(sc.delete_policy, DeletePolicy::Retain);
            }
        }
    }
}

/// `publish`: NodePublishVolume's volume context and the PV's mount options
/// ([`ferry_volume::VolumeSpec::from_publish`]: mount-s3 option strings, Mountpoint v2 attributes,
/// `MetadataTtl`), then the notices a migrated volume gets.
///
/// Input: lines; `@…` is one mount-flags entry (what `mountOptions` lists), any other line a
/// `key=value` of the volume context.
pub mod publish {
    use ferry_volume::{MetadataTtl, MountOptions, NodeCache, VolumeSpec};

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        let (flags, ctx): (Vec<&str>, Vec<&str>) = s.split('\n').partition(|l| l.starts_with('@'));
        let flags: Vec<&str> = flags.iter().map(|f| &f[1..]).collect();
        let _ = s.parse::<MetadataTtl>();
        let options = MountOptions::parse(&flags);
        let context = super::map_of(ctx.into_iter());
        let Ok(spec) = VolumeSpec::from_publish(&context, &flags) else {
            return;
        };
        // The options are the mount flags' (publishing only adds the attributes' share).
        assert!(
            options.is_ok(),
            "from_publish took flags MountOptions refuses"
        );
        assert!(spec.prefix.is_empty() || spec.prefix.ends_with('/'));
        assert!(!spec.prefix.starts_with('/'));
        assert!(!spec.bucket.is_empty());
        for node_cache in [NodeCache::Off, NodeCache::On { max_size: 1 << 30 }] {
            for n in spec.migration_notices(node_cache) {
                let _ = n.to_string();
            }
        }
    }
}

/// `endpoints`: the node and controller's allowed-endpoint lists ([`ferry_volume::AllowedEndpoints`])
/// and endpoint URLs as a StorageClass or PV gives them (`validate::endpoint_url`, `redact_url`).
///
/// Input: the first line is the pattern list, each further line a URL.
pub mod endpoints {
    use ferry_volume::allowed::EndpointPattern;
    use ferry_volume::{validate, AllowedEndpoints, Endpoint};

    /// Whether `url` carries anything past the host that a log must not show: a user-info part or a
    /// query (credentials or a token typed into the wrong field).
    fn assert_redacted(url: &str) {
        let shown = validate::redact_url(url);
        let shown = shown
            .strip_suffix(" (credentials/query redacted)")
            .unwrap_or(&shown);
        assert!(
            !shown.contains(['@', '?', '#']),
            "redact_url({url:?}) shows {shown:?}"
        );
    }

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        let mut lines = s.split('\n');
        let list = lines.next().unwrap_or("");
        let urls: Vec<&str> = lines.collect();
        for entry in list.split(',').map(str::trim) {
            // A pattern prints as itself.
            if let Ok(p) = EndpointPattern::parse(entry) {
                assert_eq!(EndpointPattern::parse(&p.to_string()).as_ref(), Ok(&p));
            }
        }
        let allowed = AllowedEndpoints::parse(list);
        // One pattern more never permits less.
        let wider = AllowedEndpoints::parse(&format!("{list},https://extra.example.com"));
        assert_eq!(allowed.is_ok(), wider.is_ok());
        for u in urls.iter().copied().chain(std::iter::once(list)) {
            assert_redacted(u);
            // A valid endpoint URL (with no wildcard or comma of its own) as the only pattern
            // permits itself.
            if !u.contains(['*', ',']) && validate::endpoint_url("e", u).is_ok() {
                if let Ok(own) = AllowedEndpoints::parse(u) {
                    assert!(own.permits(u), "{u:?} as a pattern does not permit itself");
                }
            }
            let (Ok(a), Ok(w)) = (&allowed, &wider) else {
                continue;
            };
            let permitted = a.permits(u);
            assert!(
                !permitted || w.permits(u),
                "{list:?} permits {u:?}, with one more pattern not"
            );
            let endpoint = Endpoint {
                endpoint_url: Some(u.to_string()),
                ..Default::default()
            };
            match a.check(&endpoint) {
                Ok(()) => assert!(permitted),
                Err(e) => {
                    assert!(!permitted, "permits and check disagree on {u:?}");
                    let _ = e.to_string();
                }
            }
        }
    }
}

/// `listing`: S3 keys and common prefixes of LIST pages → a directory's names
/// ([`ferry_fs::names::ListingBuilder`]), and the kernel's names → keys.
///
/// Input: the first line is the listed directory's prefix; then `k<key>` (an object), `p<prefix>`
/// (a common prefix) and `-` (the next page) lines.
pub mod listing {
    use std::collections::BTreeSet;
    use std::ffi::OsStr;

    use ferry_fs::names::{self, Kind, ListingBuilder, NAME_MAX};
    use ferry_store::ObjectInfo;

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        let mut lines = s.split('\n');
        let dir = lines.next().unwrap_or("");
        let mut b = ListingBuilder::new(dir);
        let (mut objects, mut prefixes) = (Vec::new(), Vec::new());
        let mut seen = 0usize;
        let flush = |b: &mut ListingBuilder, o: &mut Vec<ObjectInfo>, p: &mut Vec<String>| {
            b.add_page(o, p);
            o.clear();
            p.clear();
        };
        for l in lines {
            if let Some(k) = l.strip_prefix('k') {
                seen += 1;
                objects.push(ObjectInfo {
                    key: k.to_string(),
                    size: k.len() as u64,
                    etag: Some("\"e\"".into()),
                    last_modified: None,
                });
            } else if let Some(p) = l.strip_prefix('p') {
                seen += 1;
                prefixes.push(p.to_string());
            } else if l == "-" {
                flush(&mut b, &mut objects, &mut prefixes);
            }
        }
        flush(&mut b, &mut objects, &mut prefixes);
        let listing = b.finish();
        let mut names = BTreeSet::new();
        for e in &listing.entries {
            // Every name is one the kernel can be given: a single valid segment.
            assert!(names::invalid_segment(&e.name).is_none(), "{:?}", e.name);
            assert!(
                !e.name.contains('/') && !e.name.contains('\0'),
                "{:?}",
                e.name
            );
            assert!(e.name.len() <= NAME_MAX && e.name != "." && e.name != "..");
            assert_eq!(
                names::lookup_name(OsStr::new(&e.name)).ok(),
                Some(e.name.as_str())
            );
            // …and one a process could create, unless it holds a control character (shown, but
            // refused in new names).
            assert!(
                names::new_name(OsStr::new(&e.name)).is_ok()
                    || e.name.chars().any(char::is_control),
                "{:?}",
                e.name
            );
            // One entry per name ("directory wins" leaves no file beside a directory).
            assert!(names.insert(e.name.clone()), "{:?} listed twice", e.name);
            assert_eq!(e.kind == Kind::File, e.meta.is_some());
            // A name maps back to a key (or prefix) under the listed directory.
            let key = match e.kind {
                Kind::File => format!("{dir}{}", e.name),
                Kind::Dir => format!("{dir}{}/", e.name),
            };
            assert!(key.starts_with(dir));
        }
        assert!(listing.entries.windows(2).all(|w| w[0].name < w[1].name));
        // Nothing listed disappears without a word: an entry, hidden (with a reason) or the marker.
        if seen > 0 {
            assert!(
                !listing.entries.is_empty() || !listing.hidden.is_empty() || listing.has_marker
            );
        }
    }
}

/// `creds`: kubelet's service-account tokens (`csi.storage.k8s.io/serviceAccount.tokens`), a
/// volume's Secret, and the EKS Pod Identity agent's answer.
///
/// Input: the first byte picks the parser, the rest is its input (`key=value` lines for the Secret).
pub mod creds {
    use std::collections::HashMap;

    use ferry_creds::{parse_tokens, Secret, ServiceAccountToken, StaticKeys};

    /// `msg` is `prefix` and then only words and numbers (a serde error's category, line and
    /// column): nothing of the input.
    fn only_position(msg: &str, prefix: &str) -> bool {
        msg.strip_prefix(prefix).is_some_and(|rest| {
            rest.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == ' ' || c == ')')
        })
    }

    pub fn run(data: &[u8]) {
        let Some((&which, rest)) = data.split_first() else {
            return;
        };
        match which % 3 {
            0 => {
                let Some(s) = super::text(rest) else { return };
                match parse_tokens(s) {
                    Ok(tokens) => {
                        for t in tokens.values() {
                            // What a token shows does not depend on the token.
                            let other = ServiceAccountToken {
                                token: Secret::new("other"),
                                expires: t.expires,
                            };
                            assert_eq!(format!("{t:?}"), format!("{other:?}"));
                        }
                    }
                    Err(e) => {
                        let msg = e.to_string();
                        let prefix = "csi.storage.k8s.io/serviceAccount.tokens is not the JSON kubelet sends (";
                        assert!(only_position(&msg, prefix), "{msg:?}");
                    }
                }
            }
            1 => {
                if let Err(e) = ferry_creds::fuzzing::agent_credentials(rest) {
                    // Says where the answer is malformed, or which expiration it could not
                    // read; never a key or token.
                    if only_position(&e, "its answer is not the credentials JSON (") {
                        return;
                    }
                    assert!(
                        e.starts_with("its Expiration \"") && e.ends_with("\" is not RFC 3339"),
                        "{e:?}"
                    );
                    // (serde reads a struct from an array too; `Value` refuses what the struct
                    // skips, a lone surrogate in an unknown field.)
                    let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else {
                        return;
                    };
                    if let Some(expiration) = v["Expiration"].as_str().or(v[3].as_str()) {
                        assert_eq!(e, format!("its Expiration {expiration:?} is not RFC 3339"));
                    }
                }
            }
            _ => {
                let Some(s) = super::text(rest) else { return };
                let secrets = super::map_of(s.split('\n').filter(|l| !l.is_empty()));
                // The same keys with other values (empty where they were empty).
                let others: HashMap<String, String> = secrets
                    .iter()
                    .map(|(k, v)| (k.clone(), if v.is_empty() { "" } else { "v" }.to_string()))
                    .collect();
                let (got, other) = (
                    StaticKeys::from_secrets(&secrets),
                    StaticKeys::from_secrets(&others),
                );
                match (&got, &other) {
                    (Ok(Some(k)), Ok(Some(o))) => {
                        assert!(!k.access_key_id.is_empty());
                        assert!(!k.secret_access_key.expose().is_empty());
                        // What the keys show depends on the key id alone.
                        let mut o = o.clone();
                        o.access_key_id = k.access_key_id.clone();
                        assert_eq!(format!("{k:?}"), format!("{o:?}"));
                    }
                    (Ok(None), Ok(None)) => assert!(secrets.is_empty()),
                    // An error names keys, never a value: it is the same for other values.
                    (Err(e), Err(o)) => assert_eq!(e, o),
                    _ => panic!("{got:?} but with other values {other:?}"),
                }
            }
        }
    }
}

/// `s3`: what an S3 server sends back: a ListObjectsV2 answer through the SDK's deserializer and
/// Ferry's page checks (keys URL-decoded, cut-off answers refused), an error body as the raw GET
/// path reads it, and a `Content-Range`.
///
/// Input: the first byte picks the parser and (for LIST) the status and delimiter, the rest is the
/// body or header value.
pub mod s3 {
    use ferry_s3::fuzzing;

    const PREFIX: &str = "dir/";

    pub fn run(data: &[u8]) {
        let Some((&which, body)) = data.split_first() else {
            return;
        };
        match which % 4 {
            0 | 1 => {
                let status = match which / 4 % 4 {
                    0 | 1 => 200,
                    2 => 404,
                    _ => 503,
                };
                let delimiter = (which % 4 == 0).then_some("/");
                let Ok(page) = fuzzing::list_response(status, body, PREFIX, delimiter) else {
                    return;
                };
                // A body cut short is never read as a shorter listing: what it gives, if anything,
                // is the whole body's page.
                let cut = body.len() * usize::from(which / 16) / 16;
                if let Ok(short) = fuzzing::list_response(status, &body[..cut], PREFIX, delimiter) {
                    assert_eq!(short, page, "a body cut at {cut} of {}", body.len());
                }
                // A page is only taken from a whole answer: every common prefix is one segment
                // below the listed prefix, and a truncated page says where to go on.
                if let Some(d) = delimiter {
                    for p in &page.common_prefixes {
                        let seg = p.strip_prefix(PREFIX).and_then(|r| r.strip_suffix(d));
                        assert!(seg.is_some_and(|s| !s.contains(d)), "{p:?}");
                    }
                }
                // Through to the names the directory shows.
                let mut b = ferry_fs::names::ListingBuilder::new(PREFIX);
                b.add_page(&page.objects, &page.common_prefixes);
                for e in b.finish().entries {
                    assert!(
                        ferry_fs::names::invalid_segment(&e.name).is_none()
                            && !e.name.contains('/')
                    );
                }
            }
            2 => {
                let (code, message, request_id) = fuzzing::error_body(body);
                for f in [code, message, request_id].into_iter().flatten() {
                    assert!(!f.is_empty() && f.trim() == f, "{f:?}");
                }
            }
            _ => {
                let Some(s) = super::text(body) else { return };
                if let Some((first, last, total)) = fuzzing::content_range(s) {
                    assert!(first <= last);
                    assert!(total.is_none_or(|t| last < t), "{s:?}");
                }
                if let Some(d) = fuzzing::url_decode(s) {
                    assert!(!d.contains('+') || s.contains("%2B") || s.contains("%2b"));
                }
            }
        }
    }
}

/// `journal`: a mount's journal ([`ferry_fs::journal::replay_bytes`]), the state a successor
/// process rebuilds a live mount from after a crash. What replays must come back unchanged from
/// the journal a successor writes of it (`write_snapshot`).
pub mod journal {
    use std::io::{Seek, SeekFrom};
    use std::os::fd::FromRawFd;

    use ferry_fs::journal::{self, JournaledHandle, Recovered};

    /// An anonymous in-memory file, as production's journals are.
    fn memfd() -> std::fs::File {
        // SAFETY: memfd_create takes a NUL-terminated name and flags; the fd it returns is new
        // and ours.
        let fd = unsafe { libc::memfd_create(c"journal".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    /// The parts of a recovered state that a round trip keeps: inodes but the root, and handles
    /// (write handles come back failed, which their journaled form does not show).
    fn essence(
        r: &Recovered,
    ) -> (
        Vec<(u64, String, String, bool)>,
        Vec<(u64, JournaledHandle)>,
    ) {
        let inodes = r
            .inodes
            .iter()
            .filter(|i| i.inode.ino != 1)
            .map(|i| {
                (
                    i.inode.ino,
                    i.inode.name.clone(),
                    i.inode.path.clone(),
                    i.attached,
                )
            })
            .collect();
        (inodes, r.handles.clone())
    }

    /// `data` with every whole record's CRC made right: mutations inside a record then reach
    /// its JSON instead of stopping at the CRC check.
    fn with_crcs(data: &[u8]) -> Vec<u8> {
        let mut out = data.to_vec();
        let mut at = 12;
        while at + 8 <= out.len() {
            let len = u32::from_le_bytes(out[at..at + 4].try_into().expect("4 bytes")) as usize;
            let Some(end) = (at + 8).checked_add(len).filter(|e| *e <= out.len()) else {
                break;
            };
            let crc = crc_fast::crc32_iscsi(&out[at + 8..end]);
            out[at + 4..at + 8].copy_from_slice(&crc.to_le_bytes());
            at = end;
        }
        out
    }

    /// Input: a flag byte (odd: fix every record's CRC first), then a journal file.
    pub fn run(data: &[u8]) {
        let Some((&flag, data)) = data.split_first() else {
            return;
        };
        let fixed;
        let data = match flag % 2 {
            1 => {
                fixed = with_crcs(data);
                &fixed[..]
            }
            _ => data,
        };
        let Ok(rec) = journal::replay_bytes(data) else {
            return;
        };
        let snap = journal::recovered_snapshot(&rec);
        let mut file = memfd();
        journal::write_snapshot(
            file.try_clone().expect("dup"),
            &snap,
            rec.header.extra.clone(),
        )
        .expect("writing a journal to a memfd");
        file.seek(SeekFrom::Start(0)).expect("seek");
        let again = journal::replay(&mut file)
            .unwrap_or_else(|e| panic!("a recovered state's own journal does not replay: {e}"));
        assert_eq!(again.header, rec.header);
        assert_eq!(essence(&again), essence(&rec));
    }
}

/// `handover`: the messages that cross the node's unix sockets and what they carry: the fd holder's
/// frames and requests/replies ([`ferry_holder::fdpass::recv`], [`ferry_holder::decode`]), the
/// blob it keeps for a mount ([`ferry_node::keeper::Kept`]), the handover state one `ferry-node`
/// sends its successor ([`ferry_node::handover::State`]), and the NodePublishVolume request both
/// carry, which the successor decodes and publishes again.
///
/// Input: the first byte picks framed (the rest is written to a socket and read as one frame),
/// bare (the rest is a frame's payload) or a publish request (protobuf).
pub mod handover {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use base64::Engine;
    use ferry_csi::{capability, pb};
    use ferry_holder::{decode, encode, fdpass, Reply, Request};
    use ferry_node::handover::{Answer, Hello, State};
    use ferry_node::keeper::Kept;
    use ferry_volume::VolumeSpec;

    /// What `adopt` and `recover` do with a mount's request before they serve it.
    fn publish_request(bytes: &[u8]) {
        let Ok(req) = <pb::NodePublishVolumeRequest as prost::Message>::decode(bytes) else {
            return;
        };
        let Some(cap) = &req.volume_capability else {
            return;
        };
        if capability::check(cap).is_ok() {
            let _ = VolumeSpec::from_publish(&req.volume_context, capability::mount_flags(cap));
        }
    }

    fn payload(p: &[u8]) {
        if let Ok(r) = decode::<Request>(p) {
            // A request that decodes re-encodes to itself.
            assert_eq!(decode::<Request>(&encode(&r)).ok().as_ref(), Some(&r));
            if let Request::Deposit { key, blob } = &r {
                let _ = ferry_holder::check_deposit(key, blob, 1);
            }
        }
        if let Ok(r) = decode::<Reply>(p) {
            assert_eq!(decode::<Reply>(&encode(&r)).ok().as_ref(), Some(&r));
        }
        if let Ok(state) = serde_json::from_slice::<State>(p) {
            for m in &state.mounts {
                let _ = m.kernel.has_resend();
                publish_request(&m.request);
            }
        }
        if let Ok(kept) = serde_json::from_slice::<Kept>(p) {
            if let Ok(request) = base64::engine::general_purpose::STANDARD.decode(&kept.request) {
                publish_request(&request);
            }
        }
        let _ = serde_json::from_slice::<Hello>(p);
        let _ = serde_json::from_slice::<Answer>(p);
    }

    pub fn run(data: &[u8]) {
        let Some((&which, rest)) = data.split_first() else {
            return;
        };
        match which % 3 {
            0 => payload(rest),
            1 => {
                let (mut tx, rx) = UnixStream::pair().expect("socketpair");
                // Inputs are far below a socket's buffer (`-max_len`): one write, then EOF.
                tx.write_all(rest).expect("write");
                drop(tx);
                if let Ok((p, fds)) = fdpass::recv(&rx) {
                    assert!(fds.is_empty(), "fds out of nowhere");
                    assert!(p.len() + fdpass::HEADER_LEN <= rest.len());
                    payload(&p);
                }
            }
            _ => publish_request(rest),
        }
    }
}

/// `node_paths`: the paths the node plugin is handed or reads back: kubelet's target path
/// (`targetpath::check`, `pod_uid`), `/proc/self/mountinfo` lines (other mounts' paths, escaped
/// by the kernel), and the mount source Ferry writes there and reads back (`fs_name`).
///
/// Input: the first line is a target path (below the root `/var/lib/kubelet`), the second a
/// bucket and prefix (`bucket/prefix`), the rest mountinfo text.
pub mod node_paths {
    use std::path::{Component, Path};

    use ferry_fs::config::{decode_fs_name, fs_name};
    use ferry_fs::mountinfo;
    use ferry_node::targetpath;

    /// A path as the kernel writes it into mountinfo (`show_path`: space, tab, newline and
    /// backslash as octal escapes).
    fn escape(path: &str) -> String {
        let mut out = String::with_capacity(path.len());
        for c in path.chars() {
            match c {
                ' ' | '\t' | '\n' | '\\' => out.push_str(&format!("\\{:03o}", c as u32)),
                c => out.push(c),
            }
        }
        out
    }

    pub fn run(data: &[u8]) {
        let Some(s) = super::text(data) else { return };
        let mut lines = s.splitn(3, '\n');
        let (target, source, rest) = (
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
            lines.next().unwrap_or(""),
        );
        let root = Path::new("/var/lib/kubelet");
        if let Ok(p) = targetpath::check(root, target) {
            // Strictly below the root, with nothing that climbs out of it.
            assert!(p.starts_with(root) && p != root, "{p:?}");
            assert!(p
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_))));
            if let Some(uid) = targetpath::pod_uid(root, &p) {
                assert!(!uid.contains('/'));
            }
        }
        // Ferry's source survives the trip through mountinfo.
        let (bucket, prefix) = source.split_once('/').unwrap_or((source, ""));
        let name = fs_name(bucket, prefix);
        let path = if prefix.is_empty() { bucket } else { source };
        assert_eq!(decode_fs_name(&name).as_deref(), Some(path), "{name:?}");
        for e in mountinfo::parse(rest) {
            let _ = e.is_ferry();
        }
        // So does a mount point (an absolute path, so never the ` - ` separator's `-`): written as
        // the kernel writes it, read back the same.
        if target.starts_with('/') && !target.contains('\0') {
            let line = format!(
                "36 35 0:57 / {} rw,nosuid,nodev - fuse.ferry {} rw\n",
                escape(target),
                escape(&name)
            );
            let entries = mountinfo::parse(&line);
            assert_eq!(entries.len(), 1, "{line:?}");
            assert_eq!(entries[0].mount_point, target, "{line:?}");
            assert_eq!(entries[0].source, name);
            assert_eq!(entries[0].dev, (0, 57));
            assert!(entries[0].is_ferry());
        }
    }
}

/// `cache_files`: the node cache's files as a previous process (or a failing disk) left them: a
/// block file ([`ferry_cache::block::decode`], [`ferry_cache::block::read_range_with`]) and a
/// whole object's sidecar ([`ferry_cache::object::decode_meta`]). A block's data sits at offset 0
/// of its file, so whatever a part read serves must be the file's own bytes there; and what Ferry
/// writes of the input's bytes reads back as them, whole and in parts.
pub mod cache_files {
    use ferry_cache::block::{self, BlockKey, CHUNK};
    use ferry_cache::object::{decode_meta, ObjectKey};

    fn key() -> BlockKey {
        BlockKey {
            endpoint: "http://127.0.0.1:7070".into(),
            bucket: "data".into(),
            key: "train/shard-0001.tar".into(),
            etag: "\"9b2cf535f27731c974343645a3985328\"".into(),
            index: 3,
        }
    }

    /// Parts of `len` bytes picked by `seed`: the first and last byte, all of it, and a range
    /// across a piece boundary.
    fn parts(len: u64, seed: &[u8]) -> Vec<std::ops::Range<u64>> {
        if len == 0 {
            return Vec::new();
        }
        let pick = |i: usize| {
            let b = seed.get(i).copied().unwrap_or(0) as u64;
            b * len / 256
        };
        let (a, b) = (pick(0), pick(1));
        let mut out = vec![0..1, len - 1..len, 0..len, a.min(b)..a.max(b) + 1];
        if len > CHUNK {
            out.push(CHUNK - 1..CHUNK + 1);
        }
        out
    }

    /// A part read of `file` as block `key` with `len` bytes of data.
    fn read(
        file: &[u8],
        key: &BlockKey,
        len: u64,
        within: std::ops::Range<u64>,
    ) -> Option<Vec<u8>> {
        let at = |buf: &mut [u8], at: u64| -> std::io::Result<()> {
            let start = usize::try_from(at).map_err(|_| std::io::ErrorKind::UnexpectedEof)?;
            let src = file
                .get(start..start.saturating_add(buf.len()))
                .ok_or(std::io::ErrorKind::UnexpectedEof)?;
            buf.copy_from_slice(src);
            Ok(())
        };
        match block::read_range_with(at, key, len, within) {
            Ok(Some(bytes)) => Some(bytes.to_vec()),
            _ => None,
        }
    }

    pub fn run(data: &[u8]) {
        let k = key();
        // The input as a block file.
        let whole = block::decode(&k, bytes::Bytes::copy_from_slice(data));
        let lens = match &whole {
            Ok(d) => vec![d.len() as u64],
            Err(_) => vec![data.len() as u64 / 2, data.len().saturating_sub(300) as u64],
        };
        if let Ok(d) = &whole {
            assert_eq!(
                &data[..d.len()],
                &d[..],
                "decoded data is not the file's first bytes"
            );
        }
        for len in lens {
            for within in parts(len, data) {
                if let Some(got) = read(data, &k, len, within.clone()) {
                    assert_eq!(
                        &got[..],
                        &data[within.start as usize..within.end as usize],
                        "a part read served bytes that are not the file's"
                    );
                }
            }
        }
        // The input as a sidecar.
        let obj = ObjectKey {
            endpoint: k.endpoint.clone(),
            bucket: k.bucket.clone(),
            key: k.key.clone(),
            etag: k.etag.clone(),
        };
        if let Ok(meta) = decode_meta(&obj, data) {
            assert!(
                meta.chunk > 0 && meta.block_size % meta.chunk == 0,
                "{meta:?}"
            );
            assert_eq!(meta.crcs.len() as u64, meta.size.div_ceil(meta.chunk));
        }
        // The input as a block's data: written as Ferry writes it, read back whole and in parts.
        let file = block::encode(&k, data);
        let back = block::decode(&k, bytes::Bytes::from(file.clone())).expect("own block file");
        assert_eq!(&back[..], data);
        for within in parts(data.len() as u64, data) {
            let got = read(&file, &k, data.len() as u64, within.clone()).expect("own part");
            assert_eq!(&got[..], &data[within.start as usize..within.end as usize]);
        }
    }
}
