//! Values read from a slot group's replicated state, kept until the group applies another entry.
//!
//! The controller's periodic passes (preferred leaders every second, slot migrations every scan) read
//! each led group's intent or slot records. The state at one applied index is the same on every replica
//! and never changes, so a pass reads the store again only for groups that moved on. This matters
//! beyond the read itself: these passes run on the core thread, and a store read there can wait behind
//! a message-log write-behind batch (sled applies a batch under a process-wide lock) — at 100 busy
//! channels such waits cost 16–97 ms each, which every message in flight then waited too.

use std::collections::BTreeMap;
use tidings_types::GroupId;

/// One value per group, valid at the applied index it was read at.
#[derive(Debug)]
pub(crate) struct AppliedCache<T> {
    entries: BTreeMap<GroupId, (u64, T)>,
}

impl<T> Default for AppliedCache<T> {
    fn default() -> Self {
        Self { entries: BTreeMap::new() }
    }
}

impl<T: Clone> AppliedCache<T> {
    /// The value for `group` at `applied` (its applied index now): the one read at that index, or
    /// `read`'s (kept when it succeeds). A group with no applied index is read every time.
    pub(crate) fn get_or_read<E>(
        &mut self,
        group: GroupId,
        applied: Option<u64>,
        read: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        let Some(applied) = applied else { return read() };
        if let Some((at, value)) = self.entries.get(&group) {
            if *at == applied {
                return Ok(value.clone());
            }
        }
        let value = read()?;
        self.entries.insert(group, (applied, value.clone()));
        Ok(value)
    }

    /// Forgets the groups `keep` rejects (no longer led, or gone).
    pub(crate) fn retain(&mut self, keep: impl Fn(GroupId) -> bool) {
        self.entries.retain(|group, _| keep(*group));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_group_is_read_again_only_once_it_applied_more() {
        let mut cache = AppliedCache::default();
        let group = GroupId::new(1);
        let reads = std::cell::Cell::new(0);
        let read = |value: u32| {
            reads.set(reads.get() + 1);
            Ok::<_, ()>(value)
        };
        assert_eq!(cache.get_or_read(group, Some(5), || read(1)), Ok(1));
        assert_eq!(cache.get_or_read(group, Some(5), || read(2)), Ok(1), "same index: no read");
        assert_eq!(cache.get_or_read(group, Some(6), || read(3)), Ok(3), "moved on: read again");
        assert_eq!(cache.get_or_read(group, None, || read(4)), Ok(4), "no applied index: always read");
        assert_eq!(cache.get_or_read(group, Some(6), || Err(())), Ok(3));
        assert_eq!(cache.get_or_read(group, Some(7), || Err(())), Err(()), "a failed read is not kept");
        assert_eq!(cache.get_or_read(group, Some(7), || read(5)), Ok(5));
        cache.retain(|_| false);
        assert_eq!(cache.get_or_read(group, Some(7), || read(6)), Ok(6), "forgotten");
        assert_eq!(reads.get(), 5);
    }
}
