//! A map of what this process remembers per key (Redis's last word on a bucket, a local
//! count), bounded in size and in the work of any one call: a new key looks at a few of
//! the oldest entries (those gone stale are dropped, the rest move behind), and past
//! the bound the oldest goes. No call scans the map, however many keys it holds.

use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// The oldest entries a new key looks at.
const STEP: usize = 4;

pub(crate) struct BoundedMap<K, V> {
    map: HashMap<K, V>,
    /// Every key of `map`, once, the oldest first (rotated as looked at).
    order: VecDeque<K>,
    most: usize,
}

impl<K: Hash + Eq + Clone, V> BoundedMap<K, V> {
    pub(crate) fn new(most: usize) -> BoundedMap<K, V> {
        BoundedMap {
            map: HashMap::new(),
            order: VecDeque::new(),
            most: most.max(1),
        }
    }

    pub(crate) fn get<Q: Hash + Eq + ?Sized>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
    {
        self.map.get(key)
    }

    /// The entry at `key`, made by `make` when missing; a new key first looks at the
    /// oldest entries (dropping those `stale`) and makes room.
    pub(crate) fn entry(
        &mut self,
        key: K,
        make: impl FnOnce() -> V,
        stale: impl Fn(&K, &V) -> bool,
    ) -> &mut V {
        if !self.map.contains_key(&key) {
            self.make_room(stale);
            self.order.push_back(key.clone());
        }
        self.map.entry(key).or_insert_with(make)
    }

    /// Sets `key` to `value` (a new key as [`BoundedMap::entry`] makes one). One
    /// lookup for a key already kept, as a plain map's insert: Redis's every answer
    /// comes here.
    pub(crate) fn insert(&mut self, key: K, value: V, stale: impl Fn(&K, &V) -> bool) {
        if let Some(kept) = self.map.get_mut(&key) {
            *kept = value;
            return;
        }
        self.make_room(stale);
        self.order.push_back(key.clone());
        self.map.insert(key, value);
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.map.values_mut()
    }

    fn make_room(&mut self, stale: impl Fn(&K, &V) -> bool) {
        for _ in 0..STEP {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if self
                .map
                .get(&oldest)
                .is_some_and(|value| stale(&oldest, value))
            {
                self.map.remove(&oldest);
            } else {
                self.order.push_back(oldest);
            }
        }
        while self.map.len() >= self.most {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            self.map.remove(&oldest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_entries_go_a_few_at_a_time_and_the_bound_holds() {
        let mut map = BoundedMap::new(1000);
        for key in 0..100 {
            map.insert(key, key, |_, _| false);
        }
        // The first hundred are stale from now on.
        let stale = |_: &u64, value: &u64| *value < 100;
        assert_eq!(map.len(), 100);
        // Each new key looks at STEP of the oldest: the stale ones go.
        for key in 100..110 {
            map.insert(key, key, stale);
        }
        assert_eq!(map.len(), 110 - 10 * STEP);
        for key in 110..5000 {
            map.insert(key, key, stale);
            assert!(map.len() <= 1000);
        }
        assert!(map.get(&4999).is_some());
        assert_eq!(map.order.len(), map.len());
    }

    #[test]
    fn live_entries_stay_until_the_bound_then_the_oldest_goes() {
        let mut map = BoundedMap::new(10);
        let never = |_: &u32, _: &u32| false;
        for key in 0..10 {
            map.insert(key, key, never);
        }
        map.insert(10, 10, never);
        assert_eq!(map.len(), 10);
        assert!(map.get(&10).is_some());
        // Updating a key is no new key: nothing goes.
        map.insert(10, 11, never);
        assert_eq!(map.get(&10), Some(&11));
        assert_eq!(map.len(), 10);
    }
}
