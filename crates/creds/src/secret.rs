//! Values that must never be printed: [`Secret`], and [`StaticKeys`] read from a Kubernetes
//! Secret.

use std::collections::{BTreeSet, HashMap};
use std::fmt;

use crate::CredsError;

/// A credential (token, key, password): `Debug` shows `<redacted>`, no `Display`, read only
/// through [`Secret::expose`].
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself: pass it on, never log it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Secret keys for the access key id, in the order they are looked up: Ferry's own names first,
/// then the names Mountpoint's S3 CSI driver uses (`key_id`, `access_key`), so its Secrets work
/// unchanged.
pub const ACCESS_KEY_ID_KEYS: [&str; 2] = ["accessKeyId", "key_id"];
/// Secret keys for the secret access key.
pub const SECRET_ACCESS_KEY_KEYS: [&str; 2] = ["secretAccessKey", "access_key"];
/// Secret keys for an optional session token.
pub const SESSION_TOKEN_KEYS: [&str; 2] = ["sessionToken", "session_token"];

/// Static S3 keys for one volume (MinIO, Ceph RGW, R2, or an AWS user), from the CSI request's
/// `secrets` (node-publish or provisioner Secret). The access key id is an identifier and may be
/// shown; the rest never is.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct StaticKeys {
    pub access_key_id: String,
    pub secret_access_key: Secret,
    pub session_token: Option<Secret>,
}

impl fmt::Debug for StaticKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticKeys")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &self.secret_access_key)
            .field("session_token", &self.session_token)
            .finish()
    }
}

fn lookup<'a>(
    secrets: &'a HashMap<String, String>,
    names: &[&'static str],
) -> Result<Option<&'a str>, CredsError> {
    let found: Vec<_> = names
        .iter()
        .filter_map(|n| secrets.get(*n).map(|v| (*n, v.as_str())))
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [(_, v)] => Ok(Some(v)),
        [(a, _), (b, _), ..] => Err(CredsError::Invalid(format!(
            "the Secret sets both {a:?} and {b:?}: keep one"
        ))),
    }
}

impl StaticKeys {
    /// Reads the keys from a CSI request's secrets. No secrets at all = `None` (use the driver's
    /// credentials). Secrets without an access key id and secret access key are an error naming
    /// the keys that were found (names only, never values); other keys are ignored.
    pub fn from_secrets(secrets: &HashMap<String, String>) -> Result<Option<Self>, CredsError> {
        if secrets.is_empty() {
            return Ok(None);
        }
        let id = lookup(secrets, &ACCESS_KEY_ID_KEYS)?;
        let key = lookup(secrets, &SECRET_ACCESS_KEY_KEYS)?;
        let token = lookup(secrets, &SESSION_TOKEN_KEYS)?;
        match (id, key) {
            (Some(id), Some(key)) if !id.is_empty() && !key.is_empty() => Ok(Some(StaticKeys {
                access_key_id: id.to_string(),
                secret_access_key: Secret::new(key),
                session_token: token.filter(|t| !t.is_empty()).map(Secret::new),
            })),
            _ => {
                let names: BTreeSet<_> = secrets.keys().map(String::as_str).collect();
                Err(CredsError::Invalid(format!(
                    "the volume's Secret must set {} and {} (or {} and {}); it has keys {:?}",
                    ACCESS_KEY_ID_KEYS[0],
                    SECRET_ACCESS_KEY_KEYS[0],
                    ACCESS_KEY_ID_KEYS[1],
                    SECRET_ACCESS_KEY_KEYS[1],
                    names
                )))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> HashMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn ferry_and_mountpoint_names() {
        let k = StaticKeys::from_secrets(&map(&[
            ("accessKeyId", "AKIDEXAMPLE"),
            ("secretAccessKey", "sekrit-value"),
            ("sessionToken", "session-value"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(k.access_key_id, "AKIDEXAMPLE");
        assert_eq!(k.secret_access_key.expose(), "sekrit-value");
        assert_eq!(k.session_token.unwrap().expose(), "session-value");
        let k = StaticKeys::from_secrets(&map(&[
            ("key_id", "AKIDEXAMPLE"),
            ("access_key", "sekrit-value"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(k.access_key_id, "AKIDEXAMPLE");
        assert!(k.session_token.is_none());
        assert_eq!(StaticKeys::from_secrets(&HashMap::new()).unwrap(), None);
    }

    #[test]
    fn incomplete_secrets_name_keys_not_values() {
        let e = StaticKeys::from_secrets(&map(&[("accessKeyID", "AKID"), ("pw", "sekrit-value")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("accessKeyId") && e.contains("\"pw\""), "{e}");
        assert!(!e.contains("sekrit-value") && !e.contains("AKID\""), "{e}");
        let e = StaticKeys::from_secrets(&map(&[
            ("accessKeyId", "a"),
            ("key_id", "b"),
            ("secretAccessKey", "sekrit-value"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("key_id"), "{e}");
    }

    #[test]
    fn debug_redacts() {
        let k = StaticKeys {
            access_key_id: "AKIDEXAMPLE".into(),
            secret_access_key: Secret::new("sekrit-value"),
            session_token: Some(Secret::new("session-value")),
        };
        let s = format!("{k:?} {:?} {:#?}", Secret::new("sekrit-value"), k);
        assert!(s.contains("AKIDEXAMPLE"));
        assert!(
            !s.contains("sekrit-value") && !s.contains("session-value"),
            "{s}"
        );
    }
}
