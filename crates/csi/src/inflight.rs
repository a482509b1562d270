//! At most one operation per key (volume name, volume id, target path) at a time: a concurrent
//! request for the same key gets `Aborted`, as the CSI spec asks, and retries later.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use crate::CsiError;

/// The keys with an operation in progress.
#[derive(Debug)]
pub struct InFlightSet<K> {
    set: Arc<Mutex<HashSet<K>>>,
}

impl<K> Default for InFlightSet<K> {
    fn default() -> Self {
        InFlightSet {
            set: Arc::new(Mutex::new(HashSet::new())),
        }
    }
}

/// Holds a key for the life of an operation; dropping it releases the key.
#[derive(Debug)]
pub struct InFlight<K: Eq + Hash> {
    set: Arc<Mutex<HashSet<K>>>,
    key: K,
}

impl<K: Eq + Hash + Clone + AsRef<OsStr>> InFlightSet<K> {
    /// Claims `key`, or fails with Aborted when another operation holds it.
    pub fn begin(&self, key: K) -> Result<InFlight<K>, CsiError> {
        if !self.set.lock().unwrap().insert(key.clone()) {
            return Err(CsiError::Aborted(format!(
                "an operation on {} is already in progress",
                crate::error::quote(&key.as_ref().to_string_lossy())
            )));
        }
        Ok(InFlight {
            set: self.set.clone(),
            key,
        })
    }
}

impl<K: Eq + Hash> Drop for InFlight<K> {
    fn drop(&mut self) {
        self.set.lock().unwrap().remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_operation_per_key() {
        let set = InFlightSet::default();
        let a = set.begin("a".to_string()).unwrap();
        assert!(matches!(
            set.begin("a".to_string()),
            Err(CsiError::Aborted(_))
        ));
        let _b = set.begin("b".to_string()).unwrap();
        drop(a);
        set.begin("a".to_string()).unwrap();
    }
}
