//! A map from a channel's other replicas to what the leader knows of each: a handful of entries (a
//! channel has 3 to 5 replicas), kept in a vector sorted by node.
//!
//! A leader reads its followers' progress on every input and every timer poll (the next deadline is a
//! minimum over them). A `BTreeMap` of two entries costs a tree walk and a pointer chase per visit; a
//! sorted vector costs a linear scan of a few adjacent entries, in the same order.

use tidings_types::NodeId;

/// Entries sorted by node, at most one per node.
#[derive(Debug, Clone)]
pub(super) struct ReplicaMap<V> {
    entries: Vec<(NodeId, V)>,
}

impl<V> ReplicaMap<V> {
    fn position(&self, node: NodeId) -> Result<usize, usize> {
        self.entries.binary_search_by_key(&node, |(n, _)| *n)
    }

    pub(super) fn get(&self, node: &NodeId) -> Option<&V> {
        self.position(*node).ok().map(|i| &self.entries[i].1)
    }

    pub(super) fn get_mut(&mut self, node: &NodeId) -> Option<&mut V> {
        self.position(*node).ok().map(|i| &mut self.entries[i].1)
    }

    /// The entry of `node`, inserted from `make` when there is none.
    pub(super) fn get_or_insert_with(&mut self, node: NodeId, make: impl FnOnce() -> V) -> &mut V {
        let index = match self.position(node) {
            Ok(index) => index,
            Err(index) => {
                self.entries.insert(index, (node, make()));
                index
            }
        };
        &mut self.entries[index].1
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&NodeId, &mut V) -> bool) {
        self.entries.retain_mut(|(node, value)| keep(node, value));
    }

    /// Entries in node order.
    pub(super) fn iter(&self) -> impl Iterator<Item = (&NodeId, &V)> {
        self.entries.iter().map(|(node, value)| (node, value))
    }

    /// Entries in node order, mutable.
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&NodeId, &mut V)> {
        self.entries.iter_mut().map(|(node, value)| (&*node, value))
    }

    /// Values in node order.
    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.entries.iter().map(|(_, value)| value)
    }
}

impl<V> FromIterator<(NodeId, V)> for ReplicaMap<V> {
    /// Later entries of a node replace earlier ones, as a map's collect does.
    fn from_iter<I: IntoIterator<Item = (NodeId, V)>>(entries: I) -> Self {
        let mut map = Self { entries: Vec::new() };
        for (node, value) in entries {
            match map.position(node) {
                Ok(index) => map.entries[index].1 = value,
                Err(index) => map.entries.insert(index, (node, value)),
            }
        }
        map
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(id: u64) -> NodeId {
        NodeId::new(id)
    }

    #[test]
    fn entries_stay_sorted_by_node_one_per_node() {
        let mut map: ReplicaMap<&str> = [(n(3), "c"), (n(1), "a"), (n(3), "c2")].into_iter().collect();
        assert_eq!(map.iter().map(|(k, v)| (k.get(), *v)).collect::<Vec<_>>(), vec![(1, "a"), (3, "c2")]);
        *map.get_or_insert_with(n(2), || "b") = "b";
        assert_eq!(*map.get_or_insert_with(n(1), || "unused"), "a", "an existing entry is kept");
        assert_eq!(map.values().copied().collect::<Vec<_>>(), vec!["a", "b", "c2"]);
        map.retain(|node, _| node.get() != 1);
        assert_eq!(map.get(&n(1)), None);
        *map.get_mut(&n(3)).expect("present") = "z";
        assert_eq!(map.iter().map(|(k, v)| (k.get(), *v)).collect::<Vec<_>>(), vec![(2, "b"), (3, "z")]);
        for (_, value) in map.iter_mut() {
            *value = "w";
        }
        assert!(map.values().all(|v| *v == "w"));
    }
}
