//! Which S3 endpoints a volume may name: the operator's allowlist.
//!
//! A StorageClass parameter, a PV attribute or mount option, or a volume id can name any
//! `endpointUrl`, and the driver signs its requests to it — with its own credentials, a Secret's
//! keys or a pod's role. [`AllowedEndpoints`] is what the operator lets volumes name
//! (`--allowed-endpoints`, env `FERRY_ALLOWED_ENDPOINTS`): by default the AWS S3 endpoints
//! ([`AWS_S3_PATTERNS`]). The driver's own default endpoint (`--endpoint-url`) is always allowed,
//! and so is a volume that names no endpoint.
//!
//! A list is comma-separated; each entry is one of
//! - `*`: any endpoint;
//! - `aws`: the AWS S3 endpoints of every partition ([`AWS_S3_PATTERNS`]);
//! - `scheme://host[:port]`, scheme `http` or `https`. A host label may hold `*`, which matches
//!   any run of characters within that one label (never a `.`): `https://s3.*.amazonaws.com`,
//!   `https://*.example.com`, `https://minio-*.example.com`. The port is a number or `*`; left out,
//!   it is the scheme's own (443, 80). An IPv6 host is written in brackets and matched exactly.
//!
//! A URL is matched by scheme, host and port only (its path does not change where the request
//! goes). A URL whose host is not plain DNS labels or an IP address (percent-escapes, `\`, an
//! empty label) matches no pattern but `*`.

use std::fmt;

use crate::validate::redact_url;
use crate::Endpoint;

/// How the operator changes the list (named in every refusal).
pub const FLAG: &str =
    "--allowed-endpoints (env FERRY_ALLOWED_ENDPOINTS, Helm value s3.allowedEndpoints)";

/// The list entry that stands for [`AWS_S3_PATTERNS`].
pub const AWS_KEYWORD: &str = "aws";

/// The AWS S3 endpoints a volume may name by default: the global endpoint, the legacy
/// `s3-<region>` and `s3-external-1` names, and the regional, dual-stack, FIPS and FIPS
/// dual-stack endpoints of every partition (commercial and GovCloud `amazonaws.com`, China
/// `amazonaws.com.cn`, the European Sovereign Cloud and the ISO partitions), as the AWS SDK's
/// endpoint rules build them for path-style and custom-endpoint requests. Virtual-hosted names
/// (`<bucket>.s3.<region>.amazonaws.com`) are not listed: an endpoint URL names a service, and the
/// SDK puts the bucket in front of it itself.
pub const AWS_S3_PATTERNS: &[&str] = &[
    "https://s3.amazonaws.com",
    "https://s3-*.amazonaws.com",
    "https://s3.*.amazonaws.com",
    "https://s3.dualstack.*.amazonaws.com",
    "https://s3-fips.*.amazonaws.com",
    "https://s3-fips.dualstack.*.amazonaws.com",
    "https://s3.*.amazonaws.com.cn",
    "https://s3.dualstack.*.amazonaws.com.cn",
    "https://s3.*.amazonaws.eu",
    "https://s3.dualstack.*.amazonaws.eu",
    "https://s3-fips.*.amazonaws.eu",
    "https://s3.*.c2s.ic.gov",
    "https://s3-fips.*.c2s.ic.gov",
    "https://s3.*.sc2s.sgov.gov",
    "https://s3-fips.*.sc2s.sgov.gov",
    "https://s3.*.cloud.adc-e.uk",
    "https://s3.*.csp.hci.ic.gov",
];

/// A pattern (or a whole list) the driver cannot use, naming it: a start-up error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allowed endpoint pattern {pattern:?}: {reason}")]
pub struct PatternError {
    pub pattern: String,
    pub reason: String,
}

/// A volume's endpoint that the operator did not allow. Its message names the endpoint (redacted)
/// and how to allow it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "endpoint {endpoint:?} is not allowed: this driver signs requests only to endpoints its operator \
     allows ({allowed}); the operator can add it with {FLAG}"
)]
pub struct EndpointRefused {
    /// The URL as it may appear in a message (user info and query removed).
    pub endpoint: String,
    /// What is allowed, in words.
    pub allowed: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    Http,
    Https,
}

impl Scheme {
    fn parse(s: &str) -> Option<Scheme> {
        match s.to_ascii_lowercase().as_str() {
            "http" => Some(Scheme::Http),
            "https" => Some(Scheme::Https),
            _ => None,
        }
    }

    fn default_port(self) -> u16 {
        match self {
            Scheme::Http => 80,
            Scheme::Https => 443,
        }
    }
}

/// A host: DNS labels, an IPv4 address's four octets (canonical decimal; in a pattern, octets
/// with `*`), or a bracketed IPv6 address. Lowercase. An IPv4 pattern matches only IPv4 hosts, and
/// a name pattern only names: `10.*.*.*` never allows `10.x.attacker.com`.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Host {
    Labels(Vec<String>),
    Ipv4(Vec<String>),
    Ipv6(String),
}

/// Whether a host's last label makes it an IPv4 address to resolvers (`inet_aton`, the URL
/// standard): digits, or a hex number (`0x0a`).
fn numeric_label(l: &str) -> bool {
    !l.is_empty() && (l.chars().all(|c| c.is_ascii_digit()) || l.starts_with("0x"))
}

/// The octets of a canonical dotted-quad IPv4 address (`10.0.0.1`); `None` for any other form
/// (`010.0.0.1`, `0x0a.0.0.1`, `167772161`, `10.1`), which resolvers read as other addresses.
fn ipv4(labels: &[String]) -> Option<Vec<String>> {
    (labels.len() == 4
        && labels
            .iter()
            .all(|l| l.parse::<u8>().is_ok() && (l == "0" || !l.starts_with('0')) && l.len() <= 3))
    .then(|| labels.to_vec())
}

/// Where a URL's requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    scheme: Scheme,
    host: Host,
    port: u16,
}

fn label_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_'
}

/// Splits `scheme://authority[/...]` into the scheme and the authority, lowercased.
fn split_url(url: &str) -> Option<(Scheme, String, &str)> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = Scheme::parse(scheme)?;
    let (authority, path) = match rest.find('/') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    Some((scheme, authority.to_ascii_lowercase(), path))
}

/// Splits an authority into host and port text (the port without its `:`); `None` when something
/// follows a bracketed IPv6 host that is not a port.
fn split_port(authority: &str) -> Option<(&str, Option<&str>)> {
    if authority.starts_with('[') {
        let Some(i) = authority.find(']') else {
            return Some((authority, None));
        };
        let (host, rest) = authority.split_at(i + 1);
        match rest {
            "" => Some((host, None)),
            _ => Some((host, Some(rest.strip_prefix(':')?))),
        }
    } else {
        Some(match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        })
    }
}

fn ipv6(host: &str) -> Option<String> {
    let inner = host.strip_prefix('[')?.strip_suffix(']')?;
    (!inner.is_empty()
        && inner
            .chars()
            .all(|c| c.is_ascii_hexdigit() || c == ':' || c == '.'))
    .then(|| inner.to_string())
}

impl Target {
    /// The target of an endpoint URL; `None` when its host is anything but plain labels or an IP.
    fn parse(url: &str) -> Option<Target> {
        let (scheme, authority, _path) = split_url(url)?;
        let (host, port) = split_port(&authority)?;
        let port = match port {
            None => scheme.default_port(),
            Some(p) if !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()) => p.parse().ok()?,
            Some(_) => return None,
        };
        let host = if host.starts_with('[') {
            Host::Ipv6(ipv6(host)?)
        } else {
            let labels: Vec<String> = host.split('.').map(str::to_string).collect();
            if labels
                .iter()
                .any(|l| l.is_empty() || !l.chars().all(label_char))
            {
                return None;
            }
            if labels.last().is_some_and(|l| numeric_label(l)) {
                Host::Ipv4(ipv4(&labels)?)
            } else {
                Host::Labels(labels)
            }
        };
        Some(Target { scheme, host, port })
    }
}

/// Whether `text` matches `glob`, where `*` matches any run of characters.
fn glob(glob: &str, text: &str) -> bool {
    let (g, t) = (glob.as_bytes(), text.as_bytes());
    let (mut gi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if gi < g.len() && g[gi] == b'*' {
            star = Some((gi, ti));
            gi += 1;
        } else if gi < g.len() && g[gi] == t[ti] {
            gi += 1;
            ti += 1;
        } else if let Some((sg, st)) = star {
            gi = sg + 1;
            ti = st + 1;
            star = Some((sg, st + 1));
        } else {
            return false;
        }
    }
    g[gi..].iter().all(|&c| c == b'*')
}

/// One `scheme://host[:port]` pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointPattern {
    text: String,
    scheme: Scheme,
    host: Host,
    /// `None`: any port.
    port: Option<u16>,
}

impl EndpointPattern {
    /// Parses one `scheme://host[:port]` pattern.
    pub fn parse(pattern: &str) -> Result<Self, PatternError> {
        let bad = |reason: &str| PatternError {
            pattern: pattern.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, authority, path) = split_url(pattern).ok_or_else(|| {
            bad("must be *, aws, or start with http:// or https:// (like https://*.example.com:9000)")
        })?;
        if !(path.is_empty() || path == "/") {
            return Err(bad(
                "names a path: a pattern is scheme://host[:port] (the path of a URL is not matched)",
            ));
        }
        if authority.contains(['@', '?', '#']) || authority.chars().any(char::is_whitespace) {
            return Err(bad(
                "must not contain credentials, a query, a fragment or a space",
            ));
        }
        let (host, port) =
            split_port(&authority).ok_or_else(|| bad("has an invalid IPv6 address or port"))?;
        let port = match port {
            None => Some(scheme.default_port()),
            Some("*") => None,
            Some(p) => match p.parse::<u16>() {
                Ok(n) if n > 0 && p.chars().all(|c| c.is_ascii_digit()) => Some(n),
                _ => return Err(bad("has an invalid port (a number from 1 to 65535, or *)")),
            },
        };
        let host = if host.starts_with('[') {
            Host::Ipv6(ipv6(host).ok_or_else(|| {
                bad("has an invalid IPv6 address (hex digits and ':' in brackets, no wildcard)")
            })?)
        } else {
            if host.is_empty() {
                return Err(bad("has no host"));
            }
            let labels: Vec<String> = host.split('.').map(str::to_string).collect();
            if let Some(l) = labels
                .iter()
                .find(|l| l.is_empty() || !l.chars().all(|c| label_char(c) || c == '*'))
            {
                return Err(bad(&format!(
                    "host label {l:?} is not letters, digits, '-', '_' and '*'"
                )));
            }
            let octet = |l: &String| l.chars().all(|c| c.is_ascii_digit() || c == '*');
            if labels.iter().all(octet) {
                let fixed = |l: &String| !l.contains('*');
                if labels.len() != 4 || (labels.iter().all(fixed) && ipv4(&labels).is_none()) {
                    return Err(bad(
                        "has an invalid IPv4 address (four decimal octets, each a number or *)",
                    ));
                }
                Host::Ipv4(labels)
            } else if labels.last().is_some_and(|l| numeric_label(l)) {
                return Err(bad(
                    "ends in a numeric label: name an IPv4 address as four decimal octets",
                ));
            } else {
                Host::Labels(labels)
            }
        };
        Ok(EndpointPattern {
            text: pattern.to_string(),
            scheme,
            host,
            port,
        })
    }

    /// The pattern that allows exactly the target of `url` (the driver's default endpoint).
    fn exact(url: &str) -> Option<Self> {
        let t = Target::parse(url)?;
        Some(EndpointPattern {
            text: redact_url(url),
            scheme: t.scheme,
            host: t.host,
            port: Some(t.port),
        })
    }

    fn matches(&self, t: &Target) -> bool {
        if self.scheme != t.scheme || self.port.is_some_and(|p| p != t.port) {
            return false;
        }
        match (&self.host, &t.host) {
            (Host::Labels(p), Host::Labels(h)) | (Host::Ipv4(p), Host::Ipv4(h)) => {
                p.len() == h.len() && p.iter().zip(h).all(|(p, h)| glob(p, h))
            }
            (Host::Ipv6(p), Host::Ipv6(h)) => p == h,
            _ => false,
        }
    }
}

impl fmt::Display for EndpointPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The endpoints volumes may name. The default is the AWS S3 endpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllowedEndpoints {
    any: bool,
    /// [`AWS_S3_PATTERNS`], parsed, when the list names `aws`; else empty.
    aws: Vec<EndpointPattern>,
    /// The operator's own patterns.
    patterns: Vec<EndpointPattern>,
    /// The driver's own default endpoint, always allowed.
    default: Option<EndpointPattern>,
}

fn aws_patterns() -> Vec<EndpointPattern> {
    AWS_S3_PATTERNS
        .iter()
        .map(|p| EndpointPattern::parse(p).expect("the AWS patterns parse"))
        .collect()
}

impl Default for AllowedEndpoints {
    fn default() -> Self {
        AllowedEndpoints {
            any: false,
            aws: aws_patterns(),
            patterns: Vec::new(),
            default: None,
        }
    }
}

impl AllowedEndpoints {
    /// Parses a comma-separated list of patterns (`*`, `aws`, `scheme://host[:port]`); the first
    /// malformed one is the error. An empty list is an error too (name `aws` for the default).
    pub fn parse(list: &str) -> Result<Self, PatternError> {
        if list.trim().is_empty() {
            return Err(PatternError {
                pattern: list.to_string(),
                reason: format!(
                    "the list is empty: name at least one pattern ({AWS_KEYWORD} for the AWS S3 \
                     endpoints, * for any)"
                ),
            });
        }
        let mut allowed = AllowedEndpoints {
            any: false,
            aws: Vec::new(),
            patterns: Vec::new(),
            default: None,
        };
        for entry in list.split(',').map(str::trim) {
            match entry {
                "" => {
                    return Err(PatternError {
                        pattern: list.to_string(),
                        reason: "has an empty entry (two commas, or one at an end)".to_string(),
                    })
                }
                "*" => allowed.any = true,
                e if e.eq_ignore_ascii_case(AWS_KEYWORD) => allowed.aws = aws_patterns(),
                e => allowed.patterns.push(EndpointPattern::parse(e)?),
            }
        }
        Ok(allowed)
    }

    /// Any endpoint at all (`*`).
    pub fn any() -> Self {
        AllowedEndpoints {
            any: true,
            aws: Vec::new(),
            patterns: Vec::new(),
            default: None,
        }
    }

    /// Also allows the driver's own default endpoint (its `--endpoint-url`): a volume that names
    /// the endpoint it would get anyway is allowed whatever the list says.
    pub fn with_default_endpoint(mut self, url: Option<&str>) -> Self {
        self.default = url.and_then(EndpointPattern::exact);
        self
    }

    /// Whether requests may be signed to `url`.
    pub fn permits(&self, url: &str) -> bool {
        if self.any {
            return true;
        }
        let Some(target) = Target::parse(url) else {
            return false;
        };
        self.default
            .iter()
            .chain(&self.aws)
            .chain(&self.patterns)
            .any(|p| p.matches(&target))
    }

    /// Refuses a volume's endpoint the operator did not allow. A volume without an endpoint URL
    /// uses the driver's default (or AWS's regional endpoint for its region) and is always allowed.
    pub fn check(&self, endpoint: &Endpoint) -> Result<(), EndpointRefused> {
        match &endpoint.endpoint_url {
            None => Ok(()),
            Some(url) if self.permits(url) => Ok(()),
            Some(url) => Err(EndpointRefused {
                endpoint: redact_url(url),
                allowed: self.to_string(),
            }),
        }
    }
}

/// In words, for messages and the start-up log.
impl fmt::Display for AllowedEndpoints {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.any {
            return f.write_str("any endpoint");
        }
        let mut parts = Vec::new();
        if let Some(d) = &self.default {
            parts.push(format!("the driver's default endpoint {d}"));
        }
        if !self.aws.is_empty() {
            parts.push("the AWS S3 endpoints".to_string());
        }
        // An operator's pattern that is the default endpoint itself is said once.
        parts.extend(
            self.patterns
                .iter()
                .filter(|p| self.default.as_ref().is_none_or(|d| d.text != p.text))
                .map(|p| p.text.clone()),
        );
        if parts.is_empty() {
            return f.write_str("no endpoint but the driver's default");
        }
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn list(s: &str) -> AllowedEndpoints {
        AllowedEndpoints::parse(s).unwrap()
    }

    /// The default endpoint also in the operator's list is named once in messages.
    #[test]
    fn the_default_endpoint_is_named_once() {
        let a = list("http://127.0.0.1:7072,https://s3.example.com")
            .with_default_endpoint(Some("http://127.0.0.1:7072"));
        let text = a.to_string();
        assert_eq!(text.matches("127.0.0.1:7072").count(), 1, "{text}");
        assert!(text.contains("https://s3.example.com"), "{text}");
    }

    #[test]
    fn the_default_allows_the_aws_s3_endpoints_of_every_partition() {
        let aws = AllowedEndpoints::default();
        for ok in [
            "https://s3.amazonaws.com",
            "https://S3.AmazonAWS.com/",
            "https://s3.amazonaws.com:443",
            "https://s3.eu-west-1.amazonaws.com",
            "https://s3-us-west-2.amazonaws.com",
            "https://s3-external-1.amazonaws.com",
            "https://s3.dualstack.ap-south-1.amazonaws.com",
            "https://s3-fips.us-gov-west-1.amazonaws.com",
            "https://s3-fips.dualstack.us-east-2.amazonaws.com",
            "https://s3.cn-north-1.amazonaws.com.cn",
            "https://s3.dualstack.cn-northwest-1.amazonaws.com.cn",
            "https://s3.eusc-de-east-1.amazonaws.eu",
            "https://s3.us-iso-east-1.c2s.ic.gov",
            "https://s3.us-isob-east-1.sc2s.sgov.gov",
        ] {
            assert!(aws.permits(ok), "{ok}");
        }
        for refused in [
            // Plain http, another port, or not S3's host name.
            "http://s3.amazonaws.com",
            "https://s3.amazonaws.com:8443",
            "https://s3.amazonaws.com.evil.example",
            "https://evil.example/s3.amazonaws.com",
            "https://s3.amazonaws.com@evil.example",
            "https://evil.example#.s3.amazonaws.com",
            "https://evil.example\\.s3.amazonaws.com",
            "https://s3%2eamazonaws.com",
            // Hosts under amazonaws.com that anyone can own: API Gateway, load balancers, EC2.
            "https://abc123.execute-api.us-east-1.amazonaws.com",
            "https://my-lb-1234.us-east-1.elb.amazonaws.com",
            "https://ec2-1-2-3-4.compute-1.amazonaws.com",
            // A bucket's own host: the bucket is a volume parameter, not part of the endpoint.
            "https://attacker.s3.us-east-1.amazonaws.com",
            "https://127.0.0.1:9000",
            "http://169.254.169.254",
        ] {
            assert!(!aws.permits(refused), "{refused}");
        }
    }

    /// An IPv4 pattern matches only canonical IPv4 addresses, never a name with numeric-looking
    /// labels, and an address in a form resolvers read otherwise (octal, hex, fewer parts) is
    /// refused whatever the list says.
    #[test]
    fn ipv4_patterns_match_addresses_only() {
        let l = list("http://10.*.*.*:9000, http://192.168.1.5:9000");
        for ok in [
            "http://10.0.0.1:9000",
            "http://10.255.3.4:9000",
            "http://192.168.1.5:9000",
        ] {
            assert!(l.permits(ok), "{ok}");
        }
        for refused in [
            "http://10.x.attacker.com:9000",
            "http://10.1.attacker.com:9000",
            "http://10.0.0.attacker:9000",
            "http://010.0.0.1:9000",
            "http://0x0a.0.0.1:9000",
            "http://10.0.1:9000",
            "http://167772161:9000",
            "http://192.168.001.5:9000",
            "http://10.0.0.256:9000",
        ] {
            assert!(!l.permits(refused), "{refused}");
        }
        let any = list("*");
        assert!(any.permits("http://10.x.attacker.com:9000"), "* allows any");
        for bad in [
            "http://10.0.0:9000",
            "http://010.0.0.1",
            "http://host.123",
            "http://1.2.3.4.5",
        ] {
            assert!(AllowedEndpoints::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn patterns_match_by_scheme_label_and_port() {
        let l = list("https://*.example.com:9000, http://minio-*.lan:*, https://[::1]:9000,aws");
        assert!(l.permits("https://a.example.com:9000"));
        assert!(l.permits("https://a.example.com:9000/base/path"));
        assert!(
            !l.permits("https://example.com:9000"),
            "* is one label, never none"
        );
        assert!(
            !l.permits("https://a.b.example.com:9000"),
            "* never crosses a dot"
        );
        assert!(
            !l.permits("https://a.example.com"),
            "the port is part of the pattern"
        );
        assert!(!l.permits("http://a.example.com:9000"), "so is the scheme");
        assert!(l.permits("http://minio-1.lan"));
        assert!(l.permits("http://minio-eu.lan:12345"));
        assert!(!l.permits("http://minio.lan:80"));
        assert!(l.permits("https://[::1]:9000"));
        assert!(!l.permits("https://[::2]:9000"));
        assert!(l.permits("https://s3.us-east-1.amazonaws.com"));
        let any = list(" * ");
        assert!(any.permits("http://anything.example:1"));
        assert_eq!(any.to_string(), "any endpoint");
    }

    #[test]
    fn the_default_endpoint_is_always_allowed() {
        let l =
            list("https://*.example.com").with_default_endpoint(Some("http://127.0.0.1:9000/base"));
        assert!(l.permits("http://127.0.0.1:9000"));
        assert!(l.permits("http://127.0.0.1:9000/"));
        assert!(!l.permits("http://127.0.0.1:9001"));
        assert!(!l.permits("https://s3.amazonaws.com"), "aws was not listed");
        assert_eq!(
            l.to_string(),
            "the driver's default endpoint http://127.0.0.1:9000/base, https://*.example.com"
        );
    }

    #[test]
    fn a_refusal_names_the_endpoint_redacted_and_the_flag() {
        let l = AllowedEndpoints::default();
        let none = Endpoint::default();
        l.check(&none).unwrap();
        let e = l
            .check(&Endpoint {
                endpoint_url: Some("https://user:s3cr3t@evil.example/x?token=abc".into()),
                ..Default::default()
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("https://evil.example/x"), "{e}");
        assert!(
            e.contains("--allowed-endpoints") && e.contains("FERRY_ALLOWED_ENDPOINTS"),
            "{e}"
        );
        assert!(e.contains("the AWS S3 endpoints"), "{e}");
        assert!(!e.contains("s3cr3t") && !e.contains("abc"), "{e}");
    }

    #[test]
    fn malformed_patterns_are_named() {
        for (bad, why) in [
            ("", "empty"),
            ("aws,", "empty entry"),
            ("s3.example.com", "http://"),
            ("ftp://x", "http://"),
            ("https://x/path", "path"),
            ("https://u@x", "credentials"),
            ("https://x:99999", "port"),
            ("https://x:0", "port"),
            ("https://x:a*", "port"),
            ("https://", "no host"),
            ("https://a..b", "label"),
            ("https://a%2eb", "label"),
            ("https://[::1*]", "IPv6"),
            ("https://[::1]x", "IPv6"),
        ] {
            let e = AllowedEndpoints::parse(bad).unwrap_err();
            assert!(e.to_string().contains(why), "{bad:?}: {e}");
            if !bad.is_empty() && bad != "aws," {
                assert_eq!(e.pattern, bad, "{e}");
            }
        }
    }

    #[test]
    fn every_default_pattern_parses() {
        assert_eq!(aws_patterns().len(), AWS_S3_PATTERNS.len());
        assert_eq!(
            AllowedEndpoints::default().to_string(),
            "the AWS S3 endpoints"
        );
        let l = list("https://minio.lan,aws,AWS");
        assert_eq!(l.aws, aws_patterns());
        assert_eq!(l.to_string(), "the AWS S3 endpoints, https://minio.lan");
    }

    #[test]
    fn globs() {
        assert!(glob("*", "abc"));
        assert!(glob("s3-*", "s3-us-west-2"));
        assert!(!glob("s3-*", "s3"));
        assert!(glob("a*c*e", "abcde"));
        assert!(!glob("a*c*e", "abcd"));
        assert!(glob("abc", "abc") && !glob("abc", "abd"));
    }

    /// A DNS label starting with a letter (a host whose last label is numeric is an IPv4 form).
    fn label() -> impl Strategy<Value = String> {
        "[a-z][a-z0-9-]{0,10}"
    }

    proptest! {
        /// A pattern without wildcards allows exactly its own host: never a host with a label put
        /// in front or behind, never another port or scheme.
        #[test]
        fn an_exact_pattern_allows_only_its_own_host(
            labels in proptest::collection::vec(label(), 1..5),
            extra in label(),
            port in 1u16..,
            other_port in 1u16..,
        ) {
            let host = labels.join(".");
            let l = list(&format!("https://{host}:{port}"));
            let url = |scheme: &str, host: &str, port: u16| format!("{scheme}://{host}:{port}");
            let before = format!("{extra}.{host}");
            let behind = format!("{host}.{extra}");
            prop_assert!(l.permits(&url("https", &host, port)));
            prop_assert!(l.permits(&(url("HTTPS", &host.to_uppercase(), port) + "/some/path")));
            prop_assert!(!l.permits(&url("https", &before, port)));
            prop_assert!(!l.permits(&url("https", &behind, port)));
            prop_assert!(!l.permits(&url("http", &host, port)));
            prop_assume!(port != other_port);
            prop_assert!(!l.permits(&url("https", &host, other_port)));
        }

        /// The default list against a model of it: https on 443 to `s3` or `s3.dualstack`, a plain
        /// region label, and an AWS domain — and nothing near it (other services under
        /// amazonaws.com, look-alike domains, odd characters, another scheme or port).
        #[test]
        fn the_default_allows_exactly_the_aws_s3_names(
            service in prop::sample::select(vec![
                "s3", "s3.dualstack", "execute-api", "elb", "s3.evil", "evil.s3", "s3x",
            ]),
            region in "[a-z0-9-]{1,12}|[a-z.]{1,6}|[a-z]{0,3}[%@:\\\\/#?][a-z]{0,3}",
            domain in prop::sample::select(vec![
                "amazonaws.com", "amazonaws.com.cn", "amazonaws.eu",
                "amazonaws.com.evil.example", "evil-amazonaws.com", "example.com", "com",
            ]),
            scheme in prop::sample::select(vec!["https", "http", "HTTPS"]),
            port in prop::sample::select(vec!["", ":443", ":8443", ":80"]),
        ) {
            let url = format!("{scheme}://{service}.{region}.{domain}{port}/");
            let plain = region
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
            let expected = scheme.eq_ignore_ascii_case("https")
                && (port.is_empty() || port == ":443")
                && plain
                && ["s3", "s3.dualstack"].contains(&service)
                && ["amazonaws.com", "amazonaws.com.cn", "amazonaws.eu"].contains(&domain);
            prop_assert_eq!(AllowedEndpoints::default().permits(&url), expected, "{}", url);
        }
    }
}
