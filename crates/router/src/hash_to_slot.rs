//! Physical hash slots and the versioned table that maps them to logical slot groups.

use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use tidings_types::{GroupId, HashSlot, HashToSlotVersion, HASH_SLOT_COUNT};

/// The physical slot of a key: CRC-32 (IEEE) of the key bytes, modulo 256.
///
/// ```
/// use tidings_router::hash_slot;
/// // CRC-32/IEEE("123456789") = 0xCBF43926; 0x26 = 38.
/// assert_eq!(hash_slot(b"123456789").index(), 38);
/// ```
#[inline]
pub fn hash_slot(key: &[u8]) -> HashSlot {
    let crc = crc32fast::hash(key);
    // Cannot fail: the remainder is below HASH_SLOT_COUNT, and HASH_SLOT_COUNT fits in u16.
    let index = u16::try_from(crc % u32::from(HASH_SLOT_COUNT)).expect("remainder below slot count");
    HashSlot::new(index).expect("remainder below slot count")
}

/// Why a slot → group table was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HashToSlotError {
    /// An even split needs at least one group, and at most one group per slot.
    #[error("cannot split {HASH_SLOT_COUNT} slots into {groups} groups")]
    BadGroupCount {
        /// The refused group count.
        groups: u32,
    },
    /// The assignment does not have exactly one entry per slot.
    #[error("assignment has {len} entries, expected {HASH_SLOT_COUNT}")]
    WrongLength {
        /// Number of entries given.
        len: usize,
    },
    /// A slot is assigned to a group that is not in the declared group set.
    #[error("{slot} is assigned to unknown {group}")]
    UnknownGroup {
        /// The slot.
        slot: HashSlot,
        /// The group it names.
        group: GroupId,
    },
    /// A declared group owns no slot.
    #[error("{group} owns no slot")]
    EmptyGroup {
        /// The group.
        group: GroupId,
    },
    /// A table whose version is below the sum of its slots' ownership epochs (it cannot have been built).
    #[error("table version {version} is below the {moved} migrations it records")]
    VersionBelowMigrations {
        /// The version given.
        version: HashToSlotVersion,
        /// The sum of its slots' ownership epochs.
        moved: u64,
    },
    /// A table with an older version than the current one.
    #[error("table version {offered} is older than the current {current}")]
    Stale {
        /// Version offered.
        offered: HashToSlotVersion,
        /// Version in force.
        current: HashToSlotVersion,
    },
}

/// Maps every physical hash slot to the logical slot group that owns it, at a version.
///
/// Every slot carries an ownership epoch: 0 as built, one more for each migration of the slot. Tables
/// learned from different sources merge per slot by the higher epoch ([`HashToSlot::with_owner`]), so a
/// node's table only moves forward; the table's version is its base version plus the sum of the epochs.
///
/// Always valid: every slot is assigned to one of `groups()`, and every group owned at least one slot when
/// the table was built (migrations may later leave a group with none; the group still exists).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawHashToSlot")]
pub struct HashToSlot {
    version: HashToSlotVersion,
    slots: Vec<GroupId>,
    groups: BTreeSet<GroupId>,
    epochs: Vec<u64>,
}

/// Wire form of [`HashToSlot`], validated on decode.
#[derive(Deserialize)]
struct RawHashToSlot {
    version: HashToSlotVersion,
    slots: Vec<GroupId>,
    groups: BTreeSet<GroupId>,
    epochs: Vec<u64>,
}

impl TryFrom<RawHashToSlot> for HashToSlot {
    type Error = HashToSlotError;

    fn try_from(raw: RawHashToSlot) -> Result<Self, Self::Error> {
        if raw.epochs.len() != usize::from(HASH_SLOT_COUNT) {
            return Err(HashToSlotError::WrongLength { len: raw.epochs.len() });
        }
        let moved: u64 = raw.epochs.iter().sum();
        let base = raw
            .version
            .get()
            .checked_sub(moved)
            .ok_or(HashToSlotError::VersionBelowMigrations { version: raw.version, moved })?;
        let mut table = HashToSlot::validated(HashToSlotVersion::new(base), raw.groups, raw.slots, moved == 0)?;
        table.version = raw.version;
        table.epochs = raw.epochs;
        Ok(table)
    }
}

impl HashToSlot {
    /// Version 1 of a table that splits the slots into `groups` contiguous ranges of near-equal size,
    /// groups numbered from 1. Group `g` owns slots `[(g-1)*256/n, g*256/n)`.
    pub fn even_split(groups: u32) -> Result<Self, HashToSlotError> {
        if groups == 0 || groups > u32::from(HASH_SLOT_COUNT) {
            return Err(HashToSlotError::BadGroupCount { groups });
        }
        let slots = HashSlot::all()
            .map(|slot| {
                let group = u32::from(slot.index()) * groups / u32::from(HASH_SLOT_COUNT);
                GroupId::new(group + 1)
            })
            .collect();
        let declared = (1..=groups).map(GroupId::new).collect();
        Self::from_assignment(HashToSlotVersion::new(1), declared, slots)
    }

    /// A table from an explicit assignment: `slots[i]` is the group of slot `i`. Every slot must be
    /// assigned to a declared group, and every declared group must own a slot.
    pub fn from_assignment(
        version: HashToSlotVersion,
        groups: BTreeSet<GroupId>,
        slots: Vec<GroupId>,
    ) -> Result<Self, HashToSlotError> {
        Self::validated(version, groups, slots, true)
    }

    fn validated(
        version: HashToSlotVersion,
        groups: BTreeSet<GroupId>,
        slots: Vec<GroupId>,
        every_group_owns: bool,
    ) -> Result<Self, HashToSlotError> {
        if slots.len() != usize::from(HASH_SLOT_COUNT) {
            return Err(HashToSlotError::WrongLength { len: slots.len() });
        }
        for (slot, group) in HashSlot::all().zip(&slots) {
            if !groups.contains(group) {
                return Err(HashToSlotError::UnknownGroup { slot, group: *group });
            }
        }
        if let Some(&group) = groups.iter().find(|g| !slots.contains(g)).filter(|_| every_group_owns) {
            return Err(HashToSlotError::EmptyGroup { group });
        }
        Ok(Self { version, slots, groups, epochs: vec![0; usize::from(HASH_SLOT_COUNT)] })
    }

    /// The table's version.
    pub fn version(&self) -> HashToSlotVersion {
        self.version
    }

    /// The ownership epoch of `slot`: how many migrations of it this table knows of.
    pub fn epoch_of(&self, slot: HashSlot) -> u64 {
        self.epochs[usize::from(slot.index())]
    }

    /// This table with `slot` owned by `group` from ownership epoch `epoch` on, or `None` if the table
    /// already knows that epoch or a later one (or `group` is not one of its groups): what a node learns
    /// of a migration only ever moves its table forward.
    pub fn with_owner(&self, slot: HashSlot, group: GroupId, epoch: u64) -> Option<HashToSlot> {
        let i = usize::from(slot.index());
        if epoch <= self.epochs[i] || !self.groups.contains(&group) {
            return None;
        }
        let mut next = self.clone();
        next.version = HashToSlotVersion::new(self.version.get() + (epoch - self.epochs[i]));
        next.slots[i] = group;
        next.epochs[i] = epoch;
        Some(next)
    }

    /// The group that owns `slot`.
    #[inline]
    pub fn group_of(&self, slot: HashSlot) -> GroupId {
        self.slots[usize::from(slot.index())]
    }

    /// The group that owns `key`'s slot.
    #[inline]
    pub fn group_of_key(&self, key: &[u8]) -> GroupId {
        self.group_of(hash_slot(key))
    }

    /// The groups of the table, ascending.
    pub fn groups(&self) -> impl ExactSizeIterator<Item = GroupId> + '_ {
        self.groups.iter().copied()
    }

    /// The slots owned by `group`, ascending.
    pub fn slots_of(&self, group: GroupId) -> impl Iterator<Item = HashSlot> + '_ {
        HashSlot::all().filter(move |slot| self.group_of(*slot) == group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published CRC-32/IEEE values, reduced modulo 256.
    #[test]
    fn known_vectors() {
        let vectors: [(&[u8], u32); 5] = [
            (b"", 0x0000_0000),
            (b"a", 0xE8B7_BE43),
            (b"abc", 0x3524_41C2),
            (b"123456789", 0xCBF4_3926),
            (b"The quick brown fox jumps over the lazy dog", 0x414F_A339),
        ];
        for (key, crc) in vectors {
            assert_eq!(u32::from(hash_slot(key).index()), crc % 256, "key {key:?}");
        }
    }

    #[test]
    fn even_split_is_contiguous_and_balanced() {
        for n in [1u32, 2, 3, 7, 8, 64, 256] {
            let table = HashToSlot::even_split(n).unwrap();
            assert_eq!(table.groups().len(), usize::try_from(n).unwrap());
            let sizes: Vec<usize> = table.groups().map(|g| table.slots_of(g).count()).collect();
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1, "n={n} sizes={sizes:?}");
            // Contiguous: the group id never decreases along the slots.
            let owners: Vec<GroupId> = HashSlot::all().map(|s| table.group_of(s)).collect();
            assert!(owners.windows(2).all(|w| w[0] <= w[1]));
        }
    }

    #[test]
    fn even_split_refuses_bad_counts() {
        assert_eq!(HashToSlot::even_split(0), Err(HashToSlotError::BadGroupCount { groups: 0 }));
        assert_eq!(HashToSlot::even_split(257), Err(HashToSlotError::BadGroupCount { groups: 257 }));
    }

    #[test]
    fn explicit_assignment_is_validated() {
        let g1 = GroupId::new(1);
        let g2 = GroupId::new(2);
        let v = HashToSlotVersion::new(3);
        let short = vec![g1; 10];
        assert_eq!(HashToSlot::from_assignment(v, [g1].into(), short), Err(HashToSlotError::WrongLength { len: 10 }));
        let mut slots = vec![g1; 256];
        slots[9] = g2;
        assert!(matches!(
            HashToSlot::from_assignment(v, [g1].into(), slots.clone()),
            Err(HashToSlotError::UnknownGroup { group, .. }) if group == g2
        ));
        assert_eq!(
            HashToSlot::from_assignment(v, [g1, g2, GroupId::new(3)].into(), slots.clone()),
            Err(HashToSlotError::EmptyGroup { group: GroupId::new(3) })
        );
        let table = HashToSlot::from_assignment(v, [g1, g2].into(), slots).unwrap();
        assert_eq!(table.group_of(HashSlot::new(9).unwrap()), g2);
        assert_eq!(table.version(), v);
    }

    #[test]
    fn learning_an_owner_moves_the_table_forward_only() {
        let table = HashToSlot::even_split(2).unwrap();
        let slot = HashSlot::new(0).unwrap();
        let moved = table.with_owner(slot, GroupId::new(2), 1).unwrap();
        assert_eq!(moved.version(), table.version().next());
        assert_eq!(moved.group_of(slot), GroupId::new(2));
        assert_eq!(moved.epoch_of(slot), 1);
        assert_eq!(moved.slots_of(GroupId::new(1)).count(), 127);
        assert_eq!(moved.with_owner(slot, GroupId::new(1), 1), None, "same epoch again");
        assert_eq!(moved.with_owner(slot, GroupId::new(9), 2), None, "unknown group");
        // Two migrations of different slots learned in either order give one table.
        let other = HashSlot::new(200).unwrap();
        let ab = moved.with_owner(other, GroupId::new(1), 1).unwrap();
        let ba = table.with_owner(other, GroupId::new(1), 1).unwrap().with_owner(slot, GroupId::new(2), 1).unwrap();
        assert_eq!(ab, ba);
        assert_eq!(ab.version().get(), table.version().get() + 2);
    }

    #[test]
    fn decoding_validates() {
        let table = HashToSlot::even_split(4).unwrap();
        let raw = |t: &HashToSlot| RawHashToSlot {
            version: t.version,
            slots: t.slots.clone(),
            groups: t.groups.clone(),
            epochs: t.epochs.clone(),
        };
        assert_eq!(HashToSlot::try_from(raw(&table)).unwrap(), table);
        // A group left without slots by migrations decodes.
        let mut emptied = table.clone();
        for slot in table.slots_of(GroupId::new(4)) {
            emptied = emptied.with_owner(slot, GroupId::new(1), 1).unwrap();
        }
        assert_eq!(HashToSlot::try_from(raw(&emptied)).unwrap(), emptied);
        let mut slots = table.slots.clone();
        slots.pop();
        let raw = RawHashToSlot { version: table.version, slots, groups: table.groups.clone(), epochs: table.epochs };
        assert_eq!(HashToSlot::try_from(raw), Err(HashToSlotError::WrongLength { len: 255 }));
    }
}
