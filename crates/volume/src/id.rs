//! The volume id of a dynamically provisioned volume.
//!
//! DeleteVolume receives nothing but the id, so the id carries all DeleteVolume needs: the bucket,
//! the prefix, where the bucket lives and the delete policy. It reads like an S3 path with a query:
//! `bucket/team-a/pvc-1234/?policy=delete&region=eu-west-1`. Fields at their defaults are left out,
//! so ids stay short (under the spec's 128 bytes unless a long endpoint URL or prefix is chosen).

use crate::{validate, DeletePolicy, Endpoint, VolumeError};

/// A parsed volume id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct VolumeId {
    pub bucket: String,
    /// Non-empty and ending in `/`.
    pub prefix: String,
    pub endpoint: Endpoint,
    pub delete_policy: DeletePolicy,
}

const WHAT: &str = "volume id";

fn escape(s: &str, special: &[char]) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c == '%' || special.contains(&c) {
            let mut buf = [0u8; 4];
            for b in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{b:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn unescape(id: &str, s: &str) -> Result<String, VolumeError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| VolumeError::invalid(WHAT, id, "bad %-escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| VolumeError::invalid(WHAT, id, "not UTF-8 once unescaped"))
}

impl VolumeId {
    /// The id's string form.
    pub fn encode(&self) -> String {
        let mut s = format!("{}/{}", self.bucket, escape(&self.prefix, &['?']));
        let mut query = Vec::new();
        if self.delete_policy == DeletePolicy::Delete {
            query.push("policy=delete".to_string());
        }
        if let Some(r) = &self.endpoint.region {
            query.push(format!("region={}", escape(r, &['&', '='])));
        }
        if let Some(e) = &self.endpoint.endpoint_url {
            query.push(format!("endpoint={}", escape(e, &['&', '='])));
        }
        if self.endpoint.force_path_style {
            query.push("pathstyle=1".to_string());
        }
        if !query.is_empty() {
            s.push('?');
            s.push_str(&query.join("&"));
        }
        s
    }

    /// Parses an id made by [`VolumeId::encode`]. Any other string is an error.
    pub fn parse(id: &str) -> Result<Self, VolumeError> {
        let (path, query) = id.split_once('?').unwrap_or((id, ""));
        let (bucket, prefix) = path
            .split_once('/')
            .ok_or_else(|| VolumeError::invalid(WHAT, id, "is not of the form bucket/prefix/"))?;
        validate::bucket_name(WHAT, bucket)?;
        let prefix = unescape(id, prefix)?;
        if validate::prefix(WHAT, &prefix, false)? != prefix {
            return Err(VolumeError::invalid(WHAT, id, "prefix must end with '/'"));
        }
        let mut v = VolumeId {
            bucket: bucket.to_string(),
            prefix,
            endpoint: Endpoint::default(),
            delete_policy: DeletePolicy::Retain,
        };
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            let (k, val) = kv.split_once('=').ok_or_else(|| {
                VolumeError::invalid(WHAT, id, format!("bad field {}", crate::quote(kv)))
            })?;
            let val = unescape(id, val)?;
            match k {
                "policy" if val == "delete" => v.delete_policy = DeletePolicy::Delete,
                "region" => {
                    validate::region(WHAT, &val)?;
                    v.endpoint.region = Some(val);
                }
                "endpoint" => {
                    validate::endpoint_url(WHAT, &val)?;
                    v.endpoint.endpoint_url = Some(val);
                }
                "pathstyle" if val == "1" => v.endpoint.force_path_style = true,
                _ => {
                    return Err(VolumeError::invalid(
                        WHAT,
                        id,
                        format!("unknown field {}", crate::quote(kv)),
                    ))
                }
            }
        }
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn short_and_readable() {
        let v = VolumeId {
            bucket: "data".into(),
            prefix: "k8s/pvc-1/".into(),
            endpoint: Endpoint::default(),
            delete_policy: DeletePolicy::Retain,
        };
        assert_eq!(v.encode(), "data/k8s/pvc-1/");
        assert_eq!(VolumeId::parse("data/k8s/pvc-1/").unwrap(), v);
    }

    #[test]
    fn rejects_foreign_ids() {
        for bad in [
            "",
            "some-vol-id",
            "data/",
            "data//x/",
            "Data/x/",
            "data/x/?policy=wipe",
            "data/x?y/",
            "data/x/?z=1",
        ] {
            assert!(VolumeId::parse(bad).is_err(), "{bad:?}");
        }
    }

    proptest! {
        #[test]
        fn round_trips(
            bucket in "[a-z0-9][a-z0-9-]{1,20}[a-z0-9]",
            segs in proptest::collection::vec("[a-zA-Z0-9 _%?&=+-]{1,12}", 1..4),
            delete in any::<bool>(),
            region in proptest::option::of("[a-z]{2}-[a-z]{4}-[0-9]"),
            endpoint in proptest::option::of("http://[a-z]{1,8}(:[0-9]{2,4})?(/[a-z%=&]{0,6})?"),
            path_style in any::<bool>(),
        ) {
            let prefix = format!("{}/", segs.join("/"));
            prop_assume!(segs.iter().all(|s| s != "." && s != ".."));
            let v = VolumeId {
                bucket,
                prefix,
                endpoint: Endpoint { endpoint_url: endpoint, region, force_path_style: path_style },
                delete_policy: if delete { DeletePolicy::Delete } else { DeletePolicy::Retain },
            };
            prop_assert_eq!(VolumeId::parse(&v.encode()).unwrap(), v);
        }
    }
}
