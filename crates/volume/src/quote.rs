//! [`quote`]: how an error message shows a value that came from the user (a volume id, a target
//! path, a parameter or attribute and its value): Debug-quoted, and cut to a length a log line and
//! a Kubernetes event can carry, saying how long the whole value was. Secrets are never quoted.

use std::fmt;

/// Characters of a value an error message shows before cutting it: room for a whole kubelet
/// target path (`<root>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount`, about 130 bytes, whose
/// PV name is what tells an operator which volume failed) and a long volume id, while a
/// Kubernetes event (1 KiB) still has room for the rest of the message.
pub const QUOTE_MAX_CHARS: usize = 256;

/// A value as an error message shows it; see [`quote`].
#[derive(Clone, Copy)]
pub struct Quoted<'a>(&'a str);

/// `"value"` (Debug-escaped) when the value has at most [`QUOTE_MAX_CHARS`] characters, else its
/// first ones, an ellipsis and its length: `"aaaa…" (1048576 bytes)`.
pub fn quote(value: &str) -> Quoted<'_> {
    Quoted(value)
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.char_indices().nth(QUOTE_MAX_CHARS) {
            None => write!(f, "{:?}", self.0),
            Some((cut, _)) => {
                let head = format!("{:?}", &self.0[..cut]);
                // The head's closing quote goes after the ellipsis.
                write!(f, "{}…\" ({} bytes)", &head[..head.len() - 1], self.0.len())
            }
        }
    }
}

impl fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_are_quoted_whole_and_long_ones_cut_with_their_length() {
        assert_eq!(quote("a b").to_string(), "\"a b\"");
        assert_eq!(quote("a\nb").to_string(), "\"a\\nb\"");
        let exact = "x".repeat(QUOTE_MAX_CHARS);
        assert_eq!(quote(&exact).to_string(), format!("\"{exact}\""));
        let big = "y".repeat(1 << 20);
        let shown = quote(&big).to_string();
        assert_eq!(
            shown,
            format!("\"{}…\" (1048576 bytes)", "y".repeat(QUOTE_MAX_CHARS))
        );
        // Cut on a character boundary.
        let wide = "é".repeat(300);
        assert!(quote(&wide).to_string().ends_with("…\" (600 bytes)"));
        // A kubelet target path is shown whole.
        let target = "/var/lib/kubelet/pods/0f9e3c9a-1d1b-4c8a-9b8e-6a4f1b2c3d4e/volumes/\
                      kubernetes.io~csi/pvc-5b1f0a4e-2c3d-4e5f-8a9b-0c1d2e3f4a5b/mount";
        assert_eq!(quote(target).to_string(), format!("{target:?}"));
    }
}
