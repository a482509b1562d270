//! What both binaries need when they read Kubernetes objects (the controller its PVCs, the node
//! its ServiceAccounts): names that stay one URL path segment, and API errors as a user reads them.

/// How long one read of a Kubernetes object may take, whole (kube's own `read_timeout` bounds
/// each read of the socket, not the request).
pub const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Settings both binaries give their Kubernetes client: a read timeout per socket read that is
/// reset by each write (an idle pooled connection then keeps its whole timeout for the next
/// request, as kube's docs advise).
pub fn tune(config: &mut kube::Config) {
    config.read_timeout = Some(REQUEST_TIMEOUT);
    config.reset_reader_on_write = true;
}

/// A namespace or object name that stays one URL path segment (kube puts names into paths as
/// they are).
pub fn is_path_segment(s: &str) -> bool {
    !(s.is_empty() || s == "." || s == ".." || s.contains(['/', '?', '#', '%']))
}

/// A Kubernetes API error as a user reads it: the API server's status, reason and message, or the
/// transport failure with its causes ("connection refused" is not hidden behind "client error").
pub fn describe(e: &kube::Error) -> String {
    if let kube::Error::Api(s) = e {
        return format!("HTTP {} {}: {}", s.code, s.reason, s.message);
    }
    // kube's variants print their source too: the chain leaves repeats out.
    ferry_store::error_chain(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_one_path_segment() {
        assert!(is_path_segment("ok-name.1"));
        for bad in ["", "a/b", "a?b", "..", ".", "a%2F", "a#b"] {
            assert!(!is_path_segment(bad), "{bad}");
        }
    }
}
