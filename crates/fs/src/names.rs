//! Keys ↔ names: the one rule for keys that cannot be POSIX names, and turning LIST pages into a
//! directory listing (implicit directories, markers, "directory wins").
//!
//! The rule: a key segment that is empty (`a//b`), `.` or `..`, longer than 255 bytes or holds a
//! NUL byte is not a name; the key (or the directory it would be under) is hidden. When a file and a
//! directory share a name (`x` and `x/...`), the directory wins and the file is hidden.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::time::SystemTime;

use ferry_store::ObjectInfo;
use serde::{Deserialize, Serialize};

use crate::error::FsError;

/// Longest name (one path segment), in bytes.
pub const NAME_MAX: usize = 255;
/// Longest S3 key, in bytes.
pub const KEY_MAX: usize = 1024;

/// File or directory: the only two kinds Ferry shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Kind {
    File,
    Dir,
}

/// What S3 told us about an object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectMeta {
    pub size: u64,
    pub mtime: Option<SystemTime>,
    /// Quoted, as the server sent it; `None` when a LIST omitted it.
    pub etag: Option<String>,
}

impl From<&ObjectInfo> for ObjectMeta {
    fn from(info: &ObjectInfo) -> Self {
        ObjectMeta {
            size: info.size,
            mtime: info.last_modified,
            etag: info.etag.clone(),
        }
    }
}

/// Why a key segment is not a name, or `None` if it is one.
pub fn invalid_segment(segment: &str) -> Option<&'static str> {
    if segment.is_empty() {
        Some("empty path segment")
    } else if segment == "." || segment == ".." {
        Some("'.' or '..' segment")
    } else if segment.len() > NAME_MAX {
        Some("segment longer than 255 bytes")
    } else if segment.contains('\0') {
        Some("NUL byte")
    } else {
        None
    }
}

/// A name the kernel asks to look up: names that cannot exist are `ENOENT` (or `ENAMETOOLONG`).
pub fn lookup_name(name: &OsStr) -> Result<&str, FsError> {
    let name = name.to_str().ok_or(FsError::NotFound)?;
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    match invalid_segment(name) {
        Some(_) => Err(FsError::NotFound),
        None if name.contains('/') => Err(FsError::NotFound),
        None => Ok(name),
    }
}

/// A name to create: it must be a valid key segment (UTF-8 etc.), else `EINVAL`/`ENAMETOOLONG`.
pub fn new_name(name: &OsStr) -> Result<&str, FsError> {
    let name = name.to_str().ok_or(FsError::InvalidArgument(
        "names must be UTF-8 (S3 keys are)",
    ))?;
    if name.len() > NAME_MAX {
        return Err(FsError::NameTooLong);
    }
    match invalid_segment(name) {
        Some(why) => Err(FsError::InvalidArgument(why)),
        None if name.contains('/') => Err(FsError::InvalidArgument("'/' in a name")),
        // Existing keys with control characters are shown, but new ones are refused: many S3
        // servers reject or rewrite them, and an XML body cannot carry most of them.
        None if name.chars().any(char::is_control) => Err(FsError::InvalidArgument(
            "control characters are not allowed in new names",
        )),
        None => Ok(name),
    }
}

/// The path (relative to the mount prefix) of `name` in the directory at `parent_path`.
pub fn child_path(parent_path: &str, name: &str) -> String {
    if parent_path.is_empty() {
        name.to_owned()
    } else {
        format!("{parent_path}/{name}")
    }
}

/// The key of the file at `path`.
pub fn file_key(prefix: &str, path: &str) -> String {
    format!("{prefix}{path}")
}

/// The key prefix (ending in `/`, or the mount prefix itself for the root) of the directory at `path`.
pub fn dir_prefix(prefix: &str, path: &str) -> String {
    if path.is_empty() {
        prefix.to_owned()
    } else {
        format!("{prefix}{path}/")
    }
}

/// One name of a directory listing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListedEntry {
    pub name: String,
    pub kind: Kind,
    /// `Some` for files (from the LIST response).
    pub meta: Option<ObjectMeta>,
}

/// A directory listing built from every LIST page of one directory.
#[derive(Debug, Default)]
pub struct Listing {
    /// Sorted by name (byte order), each name once.
    pub entries: Vec<ListedEntry>,
    /// Keys (or common prefixes) that were hidden, with the reason.
    pub hidden: Vec<(String, &'static str)>,
    /// The directory's own marker object (`dir/`) was in the listing.
    pub has_marker: bool,
}

/// Accumulates LIST pages (delimiter `/`) of the directory whose key prefix is `dir_prefix`.
#[derive(Debug)]
pub struct ListingBuilder {
    dir_prefix: String,
    dirs: BTreeMap<String, ()>,
    files: BTreeMap<String, ObjectMeta>,
    hidden: Vec<(String, &'static str)>,
    has_marker: bool,
}

impl ListingBuilder {
    pub fn new(dir_prefix: &str) -> Self {
        ListingBuilder {
            dir_prefix: dir_prefix.to_owned(),
            dirs: BTreeMap::new(),
            files: BTreeMap::new(),
            hidden: Vec::new(),
            has_marker: false,
        }
    }

    /// Adds one page's objects and common prefixes.
    pub fn add_page(&mut self, objects: &[ObjectInfo], common_prefixes: &[String]) {
        for prefix in common_prefixes {
            let Some(rest) = prefix.strip_prefix(self.dir_prefix.as_str()) else {
                self.hidden
                    .push((prefix.clone(), "outside the listed prefix"));
                continue;
            };
            let name = rest.strip_suffix('/').unwrap_or(rest);
            match invalid_segment(name).or(name.contains('/').then_some("'/' in a segment")) {
                Some(why) => self.hidden.push((prefix.clone(), why)),
                None => {
                    self.dirs.insert(name.to_owned(), ());
                }
            }
        }
        for object in objects {
            let Some(name) = object.key.strip_prefix(self.dir_prefix.as_str()) else {
                self.hidden
                    .push((object.key.clone(), "outside the listed prefix"));
                continue;
            };
            if name.is_empty() {
                self.has_marker = true;
                continue;
            }
            match invalid_segment(name).or(name.contains('/').then_some("'/' in a segment")) {
                Some(why) => self.hidden.push((object.key.clone(), why)),
                None => {
                    self.files.insert(name.to_owned(), ObjectMeta::from(object));
                }
            }
        }
    }

    /// Applies "directory wins" and returns the sorted listing.
    pub fn finish(mut self) -> Listing {
        let mut entries = Vec::with_capacity(self.dirs.len() + self.files.len());
        for (name, meta) in std::mem::take(&mut self.files) {
            if self.dirs.contains_key(&name) {
                self.hidden.push((
                    format!("{}{name}", self.dir_prefix),
                    "file shadowed by a directory of the same name",
                ));
            } else {
                entries.push(ListedEntry {
                    name,
                    kind: Kind::File,
                    meta: Some(meta),
                });
            }
        }
        entries.extend(self.dirs.into_keys().map(|name| ListedEntry {
            name,
            kind: Kind::Dir,
            meta: None,
        }));
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Listing {
            entries,
            hidden: self.hidden,
            has_marker: self.has_marker,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(key: &str, size: u64) -> ObjectInfo {
        ObjectInfo {
            key: key.into(),
            size,
            etag: Some("\"e\"".into()),
            last_modified: None,
        }
    }

    #[test]
    fn segments() {
        assert!(invalid_segment("a").is_none());
        assert!(invalid_segment("").is_some());
        assert!(invalid_segment(".").is_some());
        assert!(invalid_segment("..").is_some());
        assert!(invalid_segment("...").is_none());
        assert!(invalid_segment(&"x".repeat(255)).is_none());
        assert!(invalid_segment(&"x".repeat(256)).is_some());
        assert!(matches!(
            lookup_name(OsStr::new(&"x".repeat(256))),
            Err(FsError::NameTooLong)
        ));
        assert!(matches!(
            new_name(OsStr::new("..")),
            Err(FsError::InvalidArgument(_))
        ));
    }

    #[test]
    fn listing_rules() {
        let mut b = ListingBuilder::new("p/");
        b.add_page(
            &[obj("p/", 0), obj("p/x", 1), obj("p/y", 2), obj("p/..", 3)],
            &["p/x/".into(), "p//".into(), "p/d/".into()],
        );
        b.add_page(&[obj("p/z", 3)], &["p/../".into()]);
        let l = b.finish();
        let names: Vec<_> = l
            .entries
            .iter()
            .map(|e| (e.name.as_str(), e.kind))
            .collect();
        assert_eq!(
            names,
            [
                ("d", Kind::Dir),
                ("x", Kind::Dir),
                ("y", Kind::File),
                ("z", Kind::File)
            ]
        );
        assert!(l.has_marker);
        assert_eq!(l.hidden.len(), 4, "{:?}", l.hidden);
    }

    #[test]
    fn paths() {
        assert_eq!(child_path("", "a"), "a");
        assert_eq!(child_path("a", "b"), "a/b");
        assert_eq!(file_key("p/", "a/b"), "p/a/b");
        assert_eq!(dir_prefix("p/", ""), "p/");
        assert_eq!(dir_prefix("p/", "a"), "p/a/");
        assert_eq!(dir_prefix("", ""), "");
    }
}
