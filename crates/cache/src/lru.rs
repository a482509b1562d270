//! [`Lru`]: the eviction order of the cached blocks, with their sizes and the bytes they hold.
//!
//! Every use ([`Lru::insert`], [`Lru::touch`]) makes an entry the most recent; [`Lru::pop_lru`]
//! gives the least recent. A property test holds it to a reference model (a recency-ordered list).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Entries by recency, with their sizes.
#[derive(Debug, Clone)]
pub struct Lru<K> {
    entries: HashMap<K, (u64, u64)>,
    order: BTreeMap<u64, K>,
    next: u64,
    bytes: u64,
}

impl<K> Default for Lru<K> {
    fn default() -> Self {
        Lru {
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next: 0,
            bytes: 0,
        }
    }
}

impl<K: Hash + Eq + Clone> Lru<K> {
    /// Adds `key` (or replaces its size) as the most recent entry.
    pub fn insert(&mut self, key: K, size: u64) {
        self.remove(&key);
        let seq = self.bump();
        self.order.insert(seq, key.clone());
        self.entries.insert(key, (seq, size));
        self.bytes += size;
    }

    /// Makes `key` the most recent entry; `false` if it is not there.
    pub fn touch(&mut self, key: &K) -> bool {
        let seq = self.bump();
        match self.entries.get_mut(key) {
            Some((old, _)) => {
                let k = self.order.remove(old).expect("order mirrors entries");
                *old = seq;
                self.order.insert(seq, k);
                true
            }
            None => false,
        }
    }

    /// Removes `key`; returns its size if it was there.
    pub fn remove(&mut self, key: &K) -> Option<u64> {
        let (seq, size) = self.entries.remove(key)?;
        self.order.remove(&seq);
        self.bytes -= size;
        Some(size)
    }

    /// Removes and returns the least recently used entry.
    pub fn pop_lru(&mut self) -> Option<(K, u64)> {
        let (_, key) = self.order.pop_first()?;
        let (_, size) = self.entries.remove(&key).expect("order mirrors entries");
        self.bytes -= size;
        Some((key, size))
    }

    /// Removes and returns the least recently used entry that `keep` does not keep (the kept
    /// ones stay where they are in the order).
    pub fn pop_lru_except(&mut self, keep: impl Fn(&K) -> bool) -> Option<(K, u64)> {
        let seq = *self.order.iter().find(|(_, k)| !keep(k))?.0;
        let key = self.order.remove(&seq).expect("just found");
        let (_, size) = self.entries.remove(&key).expect("order mirrors entries");
        self.bytes -= size;
        Some((key, size))
    }

    /// The size of `key`, if it is there.
    pub fn size(&self, key: &K) -> Option<u64> {
        self.entries.get(key).map(|&(_, size)| size)
    }

    pub fn contains(&self, key: &K) -> bool {
        self.entries.contains_key(key)
    }

    /// Bytes held by all entries.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn bump(&mut self) -> u64 {
        self.next += 1;
        self.next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The reference: a list ordered from least to most recent.
    #[derive(Default)]
    struct Model(Vec<(u8, u64)>);

    impl Model {
        fn insert(&mut self, k: u8, size: u64) {
            self.remove(k);
            self.0.push((k, size));
        }
        fn touch(&mut self, k: u8) -> bool {
            match self.0.iter().position(|e| e.0 == k) {
                Some(i) => {
                    let e = self.0.remove(i);
                    self.0.push(e);
                    true
                }
                None => false,
            }
        }
        fn remove(&mut self, k: u8) -> Option<u64> {
            let i = self.0.iter().position(|e| e.0 == k)?;
            Some(self.0.remove(i).1)
        }
        fn pop(&mut self) -> Option<(u8, u64)> {
            (!self.0.is_empty()).then(|| self.0.remove(0))
        }
        fn pop_except(&mut self, keep: impl Fn(&u8) -> bool) -> Option<(u8, u64)> {
            let i = self.0.iter().position(|e| !keep(&e.0))?;
            Some(self.0.remove(i))
        }
        fn bytes(&self) -> u64 {
            self.0.iter().map(|e| e.1).sum()
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u64),
        Touch(u8),
        Remove(u8),
        Pop,
        /// Pops the least recent entry not below this key (a join passing over its own blocks).
        PopExcept(u8),
        /// What the cache does before adding a block: evict until `bytes + incoming <= limit`.
        EvictFor(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..16, 1u64..100).prop_map(|(k, s)| Op::Insert(k, s)),
            3 => (0u8..16).prop_map(Op::Touch),
            1 => (0u8..16).prop_map(Op::Remove),
            1 => Just(Op::Pop),
            1 => (0u8..16).prop_map(Op::PopExcept),
            2 => (0u64..600, 1u64..100).prop_map(|(l, s)| Op::EvictFor(l, s)),
        ]
    }

    proptest! {
        #[test]
        fn lru_matches_the_model(ops in proptest::collection::vec(op(), 1..200)) {
            let mut lru = Lru::default();
            let mut model = Model::default();
            for op in ops {
                match op {
                    Op::Insert(k, s) => { lru.insert(k, s); model.insert(k, s); }
                    Op::Touch(k) => prop_assert_eq!(lru.touch(&k), model.touch(k)),
                    Op::Remove(k) => prop_assert_eq!(lru.remove(&k), model.remove(k)),
                    Op::Pop => prop_assert_eq!(lru.pop_lru(), model.pop()),
                    Op::PopExcept(below) => prop_assert_eq!(
                        lru.pop_lru_except(|k| *k < below),
                        model.pop_except(|k| *k < below)
                    ),
                    Op::EvictFor(limit, incoming) => {
                        while lru.bytes() + incoming > limit {
                            let got = lru.pop_lru();
                            prop_assert_eq!(got, model.pop());
                            if got.is_none() { break; }
                        }
                        prop_assert!(lru.is_empty() || lru.bytes() + incoming <= limit);
                    }
                }
                prop_assert_eq!(lru.bytes(), model.bytes());
                prop_assert_eq!(lru.len(), model.0.len());
                for (k, _) in &model.0 {
                    prop_assert!(lru.contains(k));
                }
            }
        }
    }
}
