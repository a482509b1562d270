//! Validation of bucket names, prefixes, regions and endpoint URLs.

use crate::VolumeError;

/// Checks a bucket name against S3's naming rules: 3–63 characters of lowercase letters, digits,
/// `.` and `-`, starting and ending with a letter or digit, no `..`, not an IPv4 address.
pub fn bucket_name(key: &str, name: &str) -> Result<(), VolumeError> {
    let bad = |reason: &str| {
        Err(VolumeError::invalid(
            "bucket name",
            key,
            format!("{} {reason}", crate::quote(name)),
        ))
    };
    if name.len() < 3 || name.len() > 63 {
        return bad("must be 3 to 63 characters long");
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '.' || *c == '-'))
    {
        return bad(&format!(
            "contains {c:?}: only lowercase letters, digits, '.' and '-' are allowed"
        ));
    }
    let first = name.as_bytes()[0];
    let last = name.as_bytes()[name.len() - 1];
    if !first.is_ascii_alphanumeric() || !last.is_ascii_alphanumeric() {
        return bad("must start and end with a letter or digit");
    }
    if name.contains("..") {
        return bad("must not contain two adjacent periods");
    }
    if name.split('.').count() == 4 && name.split('.').all(|p| p.parse::<u8>().is_ok()) {
        return bad("must not be formatted as an IP address");
    }
    Ok(())
}

/// Normalises a key prefix: no leading `/`, no empty, `.` or `..` segments, ends with `/` unless
/// empty. `allow_empty` is false for dynamically provisioned volumes, whose prefix must be theirs.
pub fn prefix(key: &str, raw: &str, allow_empty: bool) -> Result<String, VolumeError> {
    let bad = |reason: String| Err(VolumeError::invalid("prefix", key, reason));
    let trimmed = raw.strip_suffix('/').unwrap_or(raw);
    if trimmed.is_empty() {
        if allow_empty && raw.is_empty() {
            return Ok(String::new());
        }
        return bad(format!(
            "{} would be the whole bucket; a volume needs a non-empty prefix",
            crate::quote(raw)
        ));
    }
    if raw.starts_with('/') {
        return bad(format!("{} must not start with '/'", crate::quote(raw)));
    }
    for seg in trimmed.split('/') {
        match seg {
            "" => {
                return bad(format!(
                    "{} has an empty path segment ('//')",
                    crate::quote(raw)
                ))
            }
            "." | ".." => return bad(format!("{} has a {seg:?} segment", crate::quote(raw))),
            _ => {}
        }
        if seg.len() > 255 {
            return bad(format!(
                "{} has a segment longer than 255 bytes",
                crate::quote(raw)
            ));
        }
        if seg.contains('\0') {
            return bad(format!("{} contains a NUL byte", crate::quote(raw)));
        }
    }
    // A mount serves keys below the prefix: at least one byte must fit after it.
    if trimmed.len() + 1 >= 1024 {
        return bad(format!(
            "{} leaves no room for a key below it (S3 keys are at most 1024 bytes)",
            crate::quote(raw)
        ));
    }
    Ok(format!("{trimmed}/"))
}

/// A region name: lowercase letters, digits and `-`.
pub fn region(key: &str, r: &str) -> Result<(), VolumeError> {
    if r.is_empty()
        || r.len() > 64
        || !r
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
    {
        return Err(VolumeError::invalid(
            "region",
            key,
            format!("{} is not a region name (like us-east-1)", crate::quote(r)),
        ));
    }
    Ok(())
}

/// The URL as it may appear in an error or a log: user info and query removed, since a mistyped
/// URL can carry credentials or a token there.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, rest)) if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric()) => {
            (s, rest)
        }
        _ => ("", url),
    };
    // User info runs to the last `@`, even past a `/`: a secret access key (AWS's hold `/`) typed
    // into the URL is not a path to show. A path with an `@` in it is shown from after it: wrong,
    // but never a secret. With a `?` or `#` before that `@`, either the query holds an `@` or the
    // user info holds a `?` or `#` (other stores' keys do): nothing past the scheme is shown.
    let (userinfo, rest) = match rest.rsplit_once('@') {
        Some((before, _)) if before.contains(['?', '#']) => {
            let shown = if scheme.is_empty() {
                String::new()
            } else {
                format!("{scheme}:// ")
            };
            return format!("{shown}(credentials/query redacted)");
        }
        Some((_, rest)) => (true, rest),
        None => (false, rest),
    };
    let rest = rest.split(['?', '#']).next().unwrap_or("");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let redacted = userinfo || url.contains(['?', '#']);
    let mut out = if scheme.is_empty() {
        host.to_string()
    } else {
        format!("{scheme}://{host}")
    };
    if !path.is_empty() {
        out.push('/');
        out.push_str(path);
    }
    if redacted {
        out.push_str(" (credentials/query redacted)");
    }
    out
}

/// An endpoint URL: `http://` or `https://`, a host, an optional port, no query or credentials.
pub fn endpoint_url(key: &str, url: &str) -> Result<(), VolumeError> {
    let shown = redact_url(url);
    let bad = |reason: &str| {
        Err(VolumeError::invalid(
            "endpoint URL",
            key,
            format!("{} {reason}", crate::quote(&shown)),
        ))
    };
    let rest = match url.split_once("://") {
        Some(("http" | "https", rest)) => rest,
        _ => return bad("must start with http:// or https://"),
    };
    // Before the host is split off: a secret key with a `/` makes `AKID:a/b@host` look like a
    // host and a path.
    if rest.contains('@') {
        return bad("must not carry credentials");
    }
    let authority = rest.split('/').next().unwrap_or("");
    if authority.is_empty() {
        return bad("has no host");
    }
    // Whitespace and control characters too: a URL is one token, and one that reaches a log
    // line must not be able to break it.
    if url.contains(['?', '#']) || url.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("must not contain a query, fragment, whitespace or control character");
    }
    if let Some((_, port)) = authority.rsplit_once(':') {
        if !authority.ends_with(']') && port.parse::<u16>().is_err() {
            return bad("has an invalid port");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_names() {
        for ok in ["abc", "my-bucket.data", "a1b", &"a".repeat(63)] {
            bucket_name("bucketName", ok).unwrap();
        }
        for bad in [
            "ab",
            &"a".repeat(64),
            "My-Bucket",
            "my_bucket",
            "-abc",
            "abc-",
            "a..b",
            "192.168.1.1",
            "a/b",
            "",
        ] {
            let e = bucket_name("bucketName", bad).unwrap_err();
            assert!(e.to_string().contains("bucketName"), "{e}");
        }
    }

    #[test]
    fn prefixes() {
        assert_eq!(prefix("p", "a/b", false).unwrap(), "a/b/");
        assert_eq!(prefix("p", "a/b/", false).unwrap(), "a/b/");
        assert_eq!(prefix("p", "", true).unwrap(), "");
        for bad in ["", "/", "/a", "a//b", "a/./b", "a/..", "..", "./"] {
            assert!(prefix("p", bad, false).is_err(), "{bad:?}");
        }
        assert!(prefix("p", "/", true).is_err());
        assert!(prefix("p", &"x".repeat(256), false).is_err());
        // Room for at least one key byte below the prefix: 1023 bytes with the '/' at most.
        let long = vec!["x".repeat(200); 6].join("/");
        assert_eq!(prefix("p", &long[..1022], false).unwrap().len(), 1023);
        assert!(prefix("p", &long[..1023], false).is_err());
        // Any other character is the user's choice: the mount's fs_name encodes it.
        for ok in ["my data", "a,b", "a=b\\c", "é/ü", "tab\there"] {
            assert!(prefix("p", ok, false).is_ok(), "{ok:?}");
        }
    }

    #[test]
    fn endpoints_and_regions() {
        for ok in [
            "http://127.0.0.1:9000",
            "https://s3.example.com",
            "https://s3.example.com/base",
            "http://[::1]:9000",
        ] {
            endpoint_url("e", ok).unwrap();
        }
        for bad in [
            "s3.example.com",
            "ftp://x",
            "http://",
            "http://u:p@x",
            "http://x:99999",
            "http://x/?a=b",
            // Found by fuzzing: only a space was refused.
            "https://s3.example.com\t",
            "https://s3.example.com\n",
            "https://s3.example.com/a\u{85}b",
        ] {
            assert!(endpoint_url("e", bad).is_err(), "{bad}");
        }
        let e = endpoint_url(
            "e",
            "https://AKIAEXAMPLE:s3cr3t@s3.example.com/x?X-Amz-Signature=abc",
        )
        .unwrap_err();
        assert!(
            !e.to_string().contains("s3cr3t") && !e.to_string().contains("abc"),
            "{e}"
        );
        assert!(!e.to_string().contains("AKIAEXAMPLE"), "{e}");
        // A secret key with a `/` (the endpoints fuzz target): the user info still ends at the `@`.
        for url in [
            "https://AKID:wJalr/XUtnFEMI@s3.example.com",
            "https://AKID:wJalr/XUtn@FEMI@s3.example.com/x",
            "AKID:a/b@s3.example.com",
            "AKID:s@cret://s3.example.com",
            "https://AKID:ab#cd@s3.example.com",
            "https://AKID:ab?cd@s3.example.com/x",
        ] {
            let shown = redact_url(url);
            assert!(
                !shown.contains("AKID") && !shown.contains('@'),
                "{url} shows {shown}"
            );
            let e = endpoint_url("e", url).unwrap_err().to_string();
            assert!(!e.contains("AKID") && !e.contains("wJalr"), "{e}");
        }
        // A query holding an `@` (the fuzz review): the query is never shown from after it.
        for url in [
            "https://h/?u=a@b&sig=SECRET",
            "https://h/x#f@y?sig=SECRET",
            "h?sig=SECRET@x",
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains("SECRET"), "{url} shows {shown}");
            let e = endpoint_url("e", url).unwrap_err().to_string();
            assert!(!e.contains("SECRET"), "{e}");
        }
        let e = endpoint_url("e", "https://AKID:a/b@h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("must not carry credentials"), "{e}");
        region("r", "eu-west-1").unwrap();
        assert!(region("r", "EU_WEST").is_err());
    }
}
